"""Tensors a checkpoint fuses, read as the parts phantom stores: each part is a range of the fused
tensor's rows, contiguous in the file (so a linked store reads it in place). Phi-3's qkv_proj holds q, k,
v; transformers 5's 3-D experts hold each expert's gate and up (or down) rows, expert after expert.
gpt-oss's experts are (experts, in, out) with gate and up alternating on out: a part is every other column of
its expert's slice, transposed (read and copied, never linked); their biases' rows (gate_up_biases). DeepSeek-V4's
FP4 experts are MXFP4's bytes under another dtype and shape (fp4_parts), its tid2eid an integer table kept as digits.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from phantom.arch.quantformat import QuantFormat, gate_up_part
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
    if spec.rows is None:  # a tensor whose bytes are another dtype's (DeepSeek-V4's FP4 int8 as MXFP4's uint8 blocks)
        t = f.get_tensor(key)
        return t if t.dtype == spec.dtype else t.view(spec.dtype).view(spec.shape)
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
        if spec.dtype == torch.int8 and len(spec.shape) == 2 and (spec.shape[0], 2 * spec.shape[1]) == shapes[name]:
            return RowSpec(spec.name, spec.dtype, spec.shape, spec.start, spec.end)  # two FP4 values a byte (DeepSeek-V4)
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


def gate_up_biases(index: dict, fmt: QuantFormat) -> None:
    """Index each expert's w13.bias (fmt.gate_up): its row of gate_up_proj_bias, gate's and up's values alternating,
    one contiguous range (read in place), from the spec of its gate part (a pick of every other value)."""
    for (part, name), (path, spec, start) in list(index.items()):
        if (fused := gate_up_part(fmt, name)) is not None and fused[1] == 0 and name.endswith(".bias"):
            e = spec.pick[0]
            index[(part, fused[0])] = (path, RowSpec(spec.name, spec.dtype, (2 * spec.shape[0],), spec.start, spec.end,
                                                     pick=(e, 0, 1)), start)


def fp4_parts(part: int, name: str, weight: tuple, scale: tuple, layout: dict) -> dict:
    """A DeepSeek-V4 FP4 expert weight (int8 (rows, in / 2), two e2m1 values a byte, the first the low nibble) and its
    e8m0 scales (rows, in / 32) indexed as MXFP4's NAME.blocks and NAME.scales (layout: their stored shapes): the same
    bytes, read in place. weight and scale: (file, spec, data start)."""
    (path, spec, start), (spath, sspec, sstart) = weight, scale
    blocks, scales = layout[f"{name}.blocks"][0], layout[f"{name}.scales"][0]
    if sspec.dtype != torch.float8_e8m0fnu or sspec.shape != scales:
        raise ValueError(f"{spath}: {sspec.name} is {sspec.dtype} {list(sspec.shape)}, not e8m0 {list(scales)}")
    return {(part, f"{name}.blocks"): (path, RowSpec(spec.name, torch.uint8, blocks, spec.start, spec.end), start),
            (part, f"{name}.scales"): (spath, RowSpec(sspec.name, torch.uint8, scales, sspec.start, sspec.end), sstart)}


def scale_key(name: str, weight_map: dict) -> str:
    """An FP8 weight's scale: NAME_scale_inv (DeepSeek-V3's, transformers'), or NAME's module's `scale` (V4's)."""
    return next((k for k in (name + "_scale_inv", name.removesuffix("weight") + "scale") if k in weight_map),
                name + "_scale_inv")


def float_scale(spec) -> bool:
    """Whether spec's dtype is one an FP8 weight's scale is read in: a float of 16 bits or more, or e8m0 (a power of
    two a byte: DeepSeek-V4's ue8m0 scales, exact in float32)."""
    return spec.dtype == torch.float8_e8m0fnu or (spec.dtype.is_floating_point and spec.dtype.itemsize >= 2)
