"""What the scripts share: flags generated from the configs, device and dtype resolution.

A field added to `Placement` or `Activations` becomes a flag of every script that calls
`add_config_flags` (its help, choices and type come from the field), and `configs_from_args` builds
the configs back from the parsed flags. `guarded` runs a script's main: bad input becomes one
`error:` line and exit 2, a bug keeps its traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import sys
import traceback
import typing
from pathlib import Path

import torch

from phantom.base import cpufeatures, dtypes, fileio
from phantom.stream.placement import parse_bytes

STORE_DTYPES = dtypes.NAMES  # what a store holds
DTYPES = ("auto",) + STORE_DTYPES  # compute dtypes; auto: resolve_dtype


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
        if f.name not in skip:
            group.add_argument(flag(f.name), **knob_flag(f, hints[f.name], defaults.get(f.name, f.default),
                                                         defaults.get(f.name)))


def knob_flag(f: dataclasses.Field, kind, shown, default=None) -> dict:
    """argparse keywords of the flag of config field `f` (type hint `kind`): its help with `shown` as its
    default, its choices or type from the field; `default` (None: "not given", the config decides)."""
    meta = dict(f.metadata)
    kw = dict(dest=f.name, default=default, help=meta.get("help", "") + f" (default: {shown})")
    if "choices" in meta:  # a function where they change at run time (offload: the registered tiers)
        kw["choices"] = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    elif meta.get("type") == "bytes":
        kw.update(type=_bytes_or_none, metavar="SIZE|auto")
    elif kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif kind == bool | None:
        kw.update(type=_bool, metavar="on|off", nargs="?", const=True)
    elif kind in (int, int | None):
        kw.update(type=_int_or_none if kind != int else int, metavar="N" if kind is int else "N|auto")
    return kw


def configs_from_args(args: argparse.Namespace, *configs):
    """The configs with every flag the user gave (not None) applied."""
    out = []
    for cfg in configs:
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cfg)
                 if getattr(args, f.name, None) is not None}
        out.append(dataclasses.replace(cfg, **given))
    return out


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto`: bf16 on CUDA, fp32 elsewhere (mps bf16 kernels are incomplete; a CPU without bf16
    instructions emulates bf16 at a fraction of its fp32 rate, see `emulated_bf16`, and one with them
    is not second-guessed either: fp32 is exact and never the slow choice by much)."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" else "fp32"


def emulated_bf16(dtype: str, device: torch.device) -> str | None:
    """Why `dtype` runs emulated in software here (bf16 on a CPU without bf16 instructions, or with them
    kept from oneDNN by ONEDNN_MAX_CPU_ISA: phantom.base.cpufeatures), or None."""
    if torch.device(device).type != "cpu" or dtypes.lookup(dtype).name != "bf16":
        return None
    return cpufeatures.bf16_emulated()


PROJECT = Path(__file__).resolve().parent.parent.parent  # phantom/ and scripts/: where user errors are raised
BUG = "internal error: this is a bug in phantom or a library it uses, not in what you gave; please report it " \
      "with the traceback below"


def user_error(e: BaseException) -> str | None:
    """The one line to print if `e` is about what the user gave, else None (a bug).

    Files and OS errors a user can fix (missing, permissions, disk full, quota, read-only, EIO) are
    theirs; a ValueError is theirs when phantom's own code raised it (phantom checks what it is
    given and says what to do), not when a library raised it (its innermost frame is then a call,
    not one of phantom's `raise` statements).
    """
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)):
        return str(e)
    if isinstance(e, OSError):
        return fileio.describe(e, "reading" if e.errno == errno.EIO else "writing") or None
    if isinstance(e, ValueError):  # raised by a `raise` statement of phantom's, not by a call into a library
        frames = traceback.extract_tb(e.__traceback__)
        if not frames:
            return str(e)
        last = frames[-1]
        ours = PROJECT in Path(last.filename).resolve().parents and (last.line or "").lstrip().startswith("raise")
        return str(e) if ours else None
    return None


def guarded(main, argv=None) -> int:
    """Run `main(argv)`: a user error prints `error: <one line>` and returns 2; a bug prints a line
    saying so and re-raises (its traceback is the report)."""
    try:
        return main(argv)
    except Exception as e:  # noqa: BLE001 - classified here; a bug is re-raised with its traceback
        line = user_error(e)
        if line is None:
            print(BUG, file=sys.stderr)
            raise
        print(f"error: {' '.join(line.split())}", file=sys.stderr)
        return 2
