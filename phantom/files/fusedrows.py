"""Tensors a checkpoint fuses, read as the parts phantom stores: each part is a range of the fused
tensor's rows, contiguous in the file (so a linked store reads it in place). Phi-3's qkv_proj holds q, k,
v; transformers 5's 3-D experts hold each expert's gate and up (or down) rows, expert after expert.
gpt-oss's experts are (experts, in, out) with gate and up alternating on out: a part is every other column of
its expert's slice, transposed (read and copied, never linked).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from phantom.files.tensorfile import TensorSpec


@dataclasses.dataclass(frozen=True)
class RowSpec(TensorSpec):
    """A tensor's spec inside the checkpoint's: the whole of it (rows None), or rows [r0, r1) of a
    fused tensor (phantom.arch.family.Family.fused), whose bytes are contiguous: linkable in place."""

    rows: tuple[int, int] | None = None
    pick: tuple[int, int, int] | None = None  # (expert, part, parts): columns part::parts of the expert, transposed
    pick_rows: bool = False  # pick's part::parts are the expert's rows, as they are (gpt-oss's MXFP4 blocks, scales)
    halves: bool = False  # pick's part is the part-th of `parts` equal column ranges, not every parts-th (Llama 4)
    digits: bool = False  # an integer table read as its base-256 digits on a last dim of 2 (DeepSeek-V4's tid2eid)


def read_rows(f, key: str, spec: RowSpec) -> torch.Tensor:
    """spec's tensor from an open safetensors file: all of key, or its rows [r0, r1), counted over its
    leading two dims where it is 3-D (one expert's part of transformers 5's fused experts)."""
    if spec.pick is not None:
        e, p, parts = spec.pick
        t = f.get_slice(key)[e:e + 1][0]
        if spec.pick_rows:
            return t[p::parts].contiguous()
        w = t.shape[-1] // parts
        t = t[..., p * w:(p + 1) * w] if spec.halves else t[..., p::parts]
        return (t.T if t.dim() == 2 else t).contiguous()
    if spec.digits:  # exact in any 16-bit float, as the store keeps it
        t = f.get_tensor(key).long()
        return torch.stack([t // 256, t % 256], dim=-1)
    if spec.rows is None:
        return f.get_tensor(key)
    r0, r1 = spec.rows
    shape = f.get_slice(key).get_shape()
    if len(shape) == 2:
        return f.get_slice(key)[r0:r1]
    e, r = divmod(r0, shape[1])  # a part never crosses an expert
    return f.get_slice(key)[e:e + 1, r:r + r1 - r0][0]


def fused_rows(groups: dict[str, tuple[str, ...]], spec: TensorSpec, name: str, shapes: dict, path: Path,
               interleaved: bool | str = False) -> RowSpec:
    """spec as name's: itself, or name's rows of the fused tensor spec names (checked against config.json);
    groups: the checkpoint's fused tensors (phantom.arch.family.Family.layout). A 3-D fused tensor's rows are
    counted over its leading two dims (its experts' rows, expert after expert); with interleaved (gpt-oss),
    the experts' tensors are (experts, in, out), their parts alternating on out (interleaved_part); with
    interleaved "halves" (Llama 4), one after the other on out."""
    group = next((names for names in groups.values() if name in names), None)
    if group is None:
        if not spec.dtype.is_floating_point and (*spec.shape, 2) == shapes[name]:
            return RowSpec(spec.name, spec.dtype, shapes[name], spec.start, spec.end, digits=True)
        if spec.shape != shapes[name]:
            raise ValueError(f"{path}: {spec.name} has shape {spec.shape}, config.json implies {shapes[name]}")
        return RowSpec(spec.name, spec.dtype, spec.shape, spec.start, spec.end)
    if interleaved:
        part = interleaved_part(group, spec, name, shapes, path)
        return dataclasses.replace(part, halves=True) if interleaved == "halves" else part
    fused = (sum(shapes[n][0] for n in group), *shapes[name][1:])
    if len(spec.shape) == 3 and (spec.shape[0] * spec.shape[1], spec.shape[2]) == fused:
        fused = spec.shape  # (experts, rows of each, columns)
    if spec.shape != fused:
        raise ValueError(f"{path}: {spec.name} has shape {spec.shape}, config.json implies {fused}")
    r0 = sum(shapes[n][0] for n in group[:group.index(name)])
    r1 = r0 + shapes[name][0]
    row_bytes = math.prod(shapes[name][1:]) * spec.dtype.itemsize
    return RowSpec(spec.name, spec.dtype, shapes[name], spec.start + r0 * row_bytes, spec.start + r1 * row_bytes,
                   rows=(r0, r1))


def interleaved_part(group: tuple[str, ...], spec: TensorSpec, name: str, shapes: dict, path: Path) -> RowSpec:
    """name's part of an (experts, in, parts * out) weight or (experts, parts * out) bias whose experts' parts
    alternate on the last dim (group: every expert's parts, expert after expert): (expert, part, parts)."""
    n_experts = spec.shape[0] if spec.shape else 0
    parts = len(group) // max(n_experts, 1)
    out = shapes[name]
    want = (n_experts, out[1], out[0] * parts) if len(out) == 2 else (n_experts, out[0] * parts)
    if parts * n_experts != len(group) or spec.shape != want:
        raise ValueError(f"{path}: {spec.name} has shape {spec.shape}, config.json implies "
                         f"({len(group) // parts if parts else '?'}, {', '.join(map(str, want[1:]))})")
    e, p = divmod(group.index(name), parts)
    size = math.prod(want[1:]) * spec.dtype.itemsize
    return RowSpec(spec.name, spec.dtype, out, spec.start + e * size, spec.start + (e + 1) * size, pick=(e, p, parts))
