"""What the scripts share: flags generated from the configs, device and dtype resolution.

A field added to `Placement` or `Activations` becomes a flag of every script that calls
`add_config_flags` (its help, choices and type come from the field), and `configs_from_args` builds
the configs back from the parsed flags. Imports phantom.placement only (and torch).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

import torch

from phantom.placement import parse_bytes

DTYPES = ("auto", "fp32", "bf16", "fp16")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, not {text!r}")


def _int_or_none(text: str) -> int | None:
    return None if text.lower() in ("auto", "none") else int(text)


def _bytes_or_none(text: str) -> int | None:
    if text.lower() == "auto":
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_config_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), **defaults) -> None:
    """One flag per field of the config class `cls` (defaults None: "not given", the config decides)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind, meta = hints[f.name], dict(f.metadata)
        help_ = meta.get("help", "") + f" (default: {defaults.get(f.name, f.default)})"
        kw = dict(dest=f.name, default=defaults.get(f.name), help=help_)
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        elif meta.get("type") == "bytes":
            kw.update(type=_bytes_or_none, metavar="SIZE|auto")
        elif kind in (bool, bool | None):
            if kind is bool:
                group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kw)
                continue
            kw.update(type=_bool, metavar="on|off", nargs="?", const=True)
        elif kind in (int, int | None):
            kw.update(type=_int_or_none if kind != int else int, metavar="N" if kind is int else "N|auto")
        group.add_argument(flag(f.name), **kw)


def configs_from_args(args: argparse.Namespace, *configs):
    """The configs with every flag the user gave (not None) applied."""
    out = []
    for cfg in configs:
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cfg)
                 if getattr(args, f.name, None) is not None}
        out.append(dataclasses.replace(cfg, **given))
    return out


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto`: bf16 on CUDA, fp32 elsewhere (mps bf16 kernels are incomplete)."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" else "fp32"
