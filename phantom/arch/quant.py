"""Quantized base weights: NF4 (QLoRA's 4-bit NormalFloat) and int8 with one scale per output channel.

A quantized store keeps each linear weight as codes plus scales; the scheduler moves those bytes and
dequantizes a block into the compute dtype where it is used. Both formats are bitsandbytes' value for
value (tests/test_quant.py checks codes, scales and dequantized weights against it bit for bit).
"""
from __future__ import annotations

import contextlib

import torch

from phantom.arch.quantformat import QuantError, QuantFormat, gate_up_part, weight_format

CHUNK = 1 << 18  # values dequantized per piece: temporaries of 1 MiB stay in L2 (a multiple of every block size;
#                  fastest of 2^16..2^22 on the CPU of notes/bench-quant.md)

# QLoRA's NF4 levels as bitsandbytes stores them (float32), code k for k = 0..15.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=torch.float32)
# Each packed byte (first value in the high nibble) to its two levels, the pair read as one 8-byte
# element: one 1-D gather per byte (4x faster than gathering rows of two floats on a CPU).
NF4_PAIRS = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=1).contiguous().view(torch.float64)

# Each e4m3 byte's value in fp32 (exact): one gather per weight, 4x faster than torch's float8 -> float32
# conversion on a CPU (8 ms against 38 for 4M values, one thread).
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()

# int4-group: each byte of a packed int32 word (little-endian: the word's first values) to its two values
# q = nibble - 8, the low nibble first, as one 8-byte element (one gather a byte, as NF4_PAIRS).
_BYTES = torch.arange(256)
INT4_PAIRS = torch.stack([(_BYTES & 15) - 8, (_BYTES >> 4) - 8], dim=1).float().contiguous().view(torch.float64)
# mxfp4: e2m1's 16 values (transformers' FP4_VALUES, the OCP MX spec's), a byte's two the low nibble first;
# and each E8M0 scale byte's power of two as transformers' ldexp computes it (2.0 ** (e - 127) in fp32).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_PAIRS = torch.stack([FP4_VALUES[_BYTES & 15], FP4_VALUES[_BYTES >> 4]], dim=1).contiguous().view(torch.float64)
E8M0_POWERS = torch.pow(2.0, _BYTES.to(torch.int32) - 127)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(True, 7, 8)): double quantization's codes."""
    data = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + ((-(10 ** (-6 + i))) * means).tolist()
    data += [0, 1.0]
    return torch.tensor(sorted(data + [0] * (256 - len(data))), dtype=torch.float32)


DYNAMIC_CODE = dynamic_map()


# ---------------------------------------------------------------------------------------------
# Quantizing (prepare time)

def _absmax_scaled(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax of fp32 values and the values scaled into [-1, 1], as bitsandbytes computes
    them: full blocks multiply by the reciprocal, a last partial block divides."""
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, flat[full:].abs().max().unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    return absmax, scaled


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of a sorted code (ties up), as uint8.

    bitsandbytes' CPU kernel for the 8-bit scales of double quantization looks the nearest level up in
    a table over 65536 points of [-1, 1] instead: it picks the other neighbour for a value within
    1/65535 of a midpoint (a few in a thousand scales). Its CUDA kernel and its torch kernel, and this,
    pick the nearest."""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)


def quantize_nf4(w: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """A weight's NF4 parts ({"nf4", "absmax"[, "absmax2", "offset"]}), in pieces of CHUNK values."""
    flat = w.reshape(-1)
    packed, absmax = torch.empty((flat.numel() + 1) // 2, dtype=torch.uint8), []
    for a in range(0, flat.numel(), CHUNK):
        am, scaled = _absmax_scaled(flat[a:a + CHUNK].float(), fmt.blocksize)
        codes = _nearest(scaled, NF4_CODE)
        if codes.numel() % 2:  # an odd count: the last byte's low nibble encodes 0.0, as bitsandbytes pads
            codes = torch.cat([codes, _nearest(torch.zeros(1), NF4_CODE)])
        packed[a // 2:a // 2 + codes.numel() // 2] = (codes[::2] << 4) | codes[1::2]
        absmax.append(am)
    absmax = torch.cat(absmax)
    if not fmt.double_quant:
        return {"nf4": packed, "absmax": absmax}
    offset = absmax.mean()
    absmax2, scaled = _absmax_scaled(absmax - offset, fmt.absmax_blocksize)
    return {"nf4": packed, "absmax": _nearest(scaled, DYNAMIC_CODE), "absmax2": absmax2, "offset": offset.view(1)}


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight's int8 parts: round(w * 127 / absmax) per output row, and the rows' fp32 absmax."""
    absmax = w.abs().amax(dim=1).float()
    return {"int8": torch.round(w * (127.0 / absmax.unsqueeze(1))).to(torch.int8), "absmax": absmax}


def quantize_fp8(w: torch.Tensor, fmt: QuantFormat, pow2: bool = False,
                 scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A weight's fp8-block parts as transformers' FP8 quantizer (Fp8Quantize) makes them, DeepSeek-V3's rule:
    per tile of fmt.block, scale = 448 / amax (e4m3's largest over the tile's absmax; 1 for an all-zero tile),
    scale_inv = 1 / scale in fp32 (rounded up to a power of two where pow2: DeepSeek-V3.1's ue8m0 scales, the
    scale then its exact reciprocal) and fp8 = e4m3(clamp(w * scale, -448, 448)). Tiles at the right and bottom
    edges are cut short (transformers quantizes whole tiles only; a zero-padded weight gives the same values). A
    16-bit scale_dtype (a checkpoint that ships its scales so) rounds scale_inv to it first, as ue8m0 does, so the
    codes are made with the scale stored."""
    (br, bc), (rows, cols) = fmt.block, w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(nr, br, nc, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    inv = 1.0 / scale
    if pow2 or scale_dtype != torch.float32:
        if pow2:
            inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
        inv = inv.to(scale_dtype).float()
        scale = 1.0 / inv
    q = torch.clamp(tiles * scale[:, None, :, None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return {"fp8": q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), "scale_inv": inv}


def quantize_int4(w: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """A weight's int4-group parts as compressed-tensors' symmetric group quantizer and packer make them (its
    calculate_qparams, quantize and pack_to_int32): per group, scale = absmax / 7.5 computed in w's dtype and
    held in fmt.scale_dtype (0 becomes that dtype's eps), q = clamp(round(w / scale), -8, 7) with the quotient
    in the wider of the two dtypes (rounded half to even), stored q + 8 eight to an int32 word, the first in the
    low bits."""
    rows, cols = w.shape
    groups = w.view(rows, cols // fmt.group, fmt.group)
    sdtype = getattr(torch, fmt.scale_dtype)
    scale = (groups.abs().amax(dim=2) / 7.5).to(sdtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(sdtype).eps, dtype=sdtype), scale)
    quotient = (groups.float() / scale.float()[:, :, None]).to(torch.promote_types(w.dtype, sdtype))
    q = (torch.round(quotient.float()).clamp(-8, 7).to(torch.int32) + 8).view(rows, cols // 8, 8)
    top = torch.where(q[:, :, 7] >= 8, q[:, :, 7] - 16, q[:, :, 7]) << 28  # the sign bit's nibble, without overflow
    return {"packed": (q[:, :, :7] << torch.arange(0, 28, 4, dtype=torch.int32)).sum(dim=2, dtype=torch.int32) | top,
            "scale": scale}


def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight's mxfp4 parts as transformers' MXFP4 quantizer makes them (quantize_to_mxfp4: OpenAI's
    triton_kernels downcast_to_mxfp_torch on the weight in bf16): per 32 values of a row the E8M0 scale is
    amax / 6 rounded up to a power of two (its fp32 bits), each value times its reciprocal rounded to e2m1 from
    its sign, exponent and top mantissa bits (half away from zero, saturating at 6), two a byte, low nibble
    first."""
    rows, cols = w.shape
    x = w.to(torch.bfloat16).float().view(rows, cols // 32, 32)
    bits = (x.abs().amax(dim=2, keepdim=True) / 6.0).view(torch.int32)
    bits = (bits + 0x007FFFFF) & 0x7F800000
    dq = bits.view(torch.float32)
    q = (x * torch.where(dq == 0, torch.zeros_like(dq), 1.0 / dq)).view(torch.int32)
    exp, mant = (q >> 23) & 0xFF, q & 0x7FFFFF
    mant = torch.where(exp < 127, (0x400000 | (mant >> 1)) >> (126 - exp).clamp(0, 31), mant)
    exp = exp.clamp(min=126) - 126
    code = (((exp << 2) | (mant >> 21)) + 1) >> 1
    code = (code.clamp(max=7) | ((q >> 28) & 8)).to(torch.uint8).view(rows, cols // 32, 16, 2)
    return {"blocks": code[..., 0] | (code[..., 1] << 4), "scales": (bits.squeeze(2) >> 23).to(torch.uint8)}


QUANTIZERS = {"int8": lambda t, fmt: quantize_int8(t), "fp8-block": quantize_fp8, "int4-group": quantize_int4,
              "mxfp4": lambda t, fmt: quantize_mxfp4(t), "nf4": quantize_nf4}


def quantize_block(fmt: QuantFormat, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A block's stored tensors: its linear weights quantized (from their values in `dtype`), the
    rest in `dtype`."""
    out = {}
    for name, t in tensors.items():
        if not fmt.quantizes(name, tuple(t.shape)):
            out[name] = t.to(dtype)
            continue
        t, wfmt = t.to(dtype), weight_format(fmt, name)  # quantize what a 16-bit store would have held
        parts = QUANTIZERS[wfmt.method](t, wfmt)
        out.update({f"{name}.{k}": v for k, v in parts.items()})
    return out


# ---------------------------------------------------------------------------------------------
# Dequantizing (each time a block is used)

def check_scales(name: str, scales: torch.Tensor) -> None:
    """Scales a quantizer writes are finite and >= 0; anything else was not written by one."""
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise QuantError(f"{name}: scales that are negative or not finite (tampered or corrupt)")


def nf4_absmax(fmt: QuantFormat, parts: dict[str, torch.Tensor], name: str = "weight") -> torch.Tensor:
    """A weight's fp32 block scales (double quantization undone as bitsandbytes does: code * scale + offset)."""
    if not fmt.double_quant:
        check_scales(f"{name}.absmax", parts["absmax"])
        return parts["absmax"]
    check_scales(f"{name}.absmax2", parts["absmax2"])
    check_scales(f"{name}.offset", parts["offset"].abs())
    q, scale = parts["absmax"], parts["absmax2"]
    code = DYNAMIC_CODE.to(q.device)
    n = q.numel()
    full = n - n % fmt.absmax_blocksize
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    out[:full] = (code[q[:full].int()].view(-1, fmt.absmax_blocksize) * scale[:full // fmt.absmax_blocksize, None]).view(-1)
    if full < n:
        out[full:] = code[q[full:].int()] * scale[-1]
    return out.add_(parts["offset"])


def dequantize_nf4_into(fmt: QuantFormat, parts: dict[str, torch.Tensor], out: torch.Tensor,
                        name: str = "weight") -> torch.Tensor:
    """out (any float dtype, contiguous) = the weight: level * block scale in fp32, then rounded to
    out's dtype. One gather per packed byte and one multiply per value, CHUNK values at a time."""
    absmax = nf4_absmax(fmt, parts, name)
    codes, flat, bs = parts["nf4"], out.view(-1), fmt.blocksize
    pairs = NF4_PAIRS.to(codes.device).view(-1)
    n = flat.numel()
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        vals = pairs.index_select(0, codes[a // 2:(b + 1) // 2].int()).view(torch.float32)[:b - a]
        nb, rem = (b - a) // bs, (b - a) % bs
        dst = flat[a:b]
        if nb:
            scale = absmax[a // bs:a // bs + nb].view(-1, 1)
            torch.mul(vals[:nb * bs].view(-1, bs), scale, out=dst[:nb * bs].view(-1, bs))  # fp32, rounded once
        if rem:
            dst[nb * bs:].copy_(vals[nb * bs:] * absmax[(a + nb * bs) // bs])
    return out


def dequantize_int8_into(parts: dict[str, torch.Tensor], out: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """out = q * absmax * (1 / 127) in fp32 (bitsandbytes' int8_vectorwise_dequant), rounded to out's dtype."""
    q, absmax = parts["int8"], parts["absmax"]
    check_scales(f"{name}.absmax", absmax)
    rows = max(1, CHUNK // max(1, q.shape[1]))
    for a in range(0, q.shape[0], rows):
        torch.mul(q[a:a + rows] * absmax[a:a + rows, None], 7.874015718698502e-3, out=out[a:a + rows])
    return out


def dequantize_fp8_into(fmt: QuantFormat, parts: dict[str, torch.Tensor], out: torch.Tensor,
                        name: str = "weight") -> torch.Tensor:
    """out = e4m3 value * its tile's scale_inv in fp32, rounded to out's dtype (DeepSeek-V3's weight_dequant;
    transformers' _dequantize_fp8_weight with weight_block_size in fp32): tiles of fmt.block, the last row and
    column of tiles cut short where the weight's shape is no multiple of them. CHUNK values at a time."""
    q, scale = parts["fp8"], parts["scale_inv"]
    check_scales(f"{name}.scale_inv", scale)
    (br, bc), (rows, cols) = fmt.block, q.shape
    if tuple(scale.shape) != (-(-rows // br), -(-cols // bc)):
        raise QuantError(f"{name}.scale_inv: shape {tuple(scale.shape)} is not one scale per {br}x{bc} tile")
    full = cols // bc * bc
    step = max(br, CHUNK // max(cols, 1) // br * br)  # whole row tiles
    for a in range(0, rows, step):
        b = min(a + step, rows)
        s = scale[a // br:-(-b // br)].repeat_interleave(br, dim=0)[:b - a]  # each row's scales
        vals = FP8_VALUES.to(q.device).index_select(0, q[a:b].reshape(-1).view(torch.uint8).int()).view(b - a, cols)
        if full:
            vals[:, :full].unflatten(1, (-1, bc)).mul_(s[:, :full // bc, None])  # fp32, then rounded once
        if full < cols:
            vals[:, full:].mul_(s[:, -1:])
        out[a:b].copy_(vals)  # (2.5x faster than multiplying into a 16-bit out through the tiles' strides)
    return out


def _check_shapes(name: str, parts: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    for key, shape in want.items():
        if tuple(parts[key].shape) != shape:
            raise QuantError(f"{name}.{key}: shape {tuple(parts[key].shape)}, the weight's needs {shape}")


def dequantize_int4_into(fmt: QuantFormat, parts: dict[str, torch.Tensor], out: torch.Tensor,
                         name: str = "weight") -> torch.Tensor:
    """out = q * its group's scale, the product rounded to the scale's dtype, then to out's (compressed-tensors'
    decompression: x_q.to(scale.dtype) * scale; exact in fp32 before the rounding). Whole rows, CHUNK values
    at a time."""
    packed, scale = parts["packed"], parts["scale"]
    rows, cols = out.shape
    if cols % fmt.group:
        raise QuantError(f"{name}: {cols} columns are no whole number of groups of {fmt.group}")
    _check_shapes(name, parts, {"packed": (rows, cols // 8), "scale": (rows, cols // fmt.group)})
    check_scales(f"{name}.scale", scale)
    pairs = INT4_PAIRS.to(packed.device)
    step = max(1, CHUNK // max(cols, 1))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        vals = pairs.index_select(0, packed[a:b].reshape(-1).view(torch.uint8).int()).view(torch.float32)
        vals, dst = vals.view(b - a, -1, fmt.group), out[a:b].view(b - a, -1, fmt.group)
        if out.dtype == scale.dtype or scale.dtype == torch.float32:  # one rounding: the product's to out's dtype
            torch.mul(vals, scale[a:b].float()[:, :, None], out=dst)
        else:  # rounded to the scale's dtype first, then to out's
            dst.copy_(vals.mul_(scale[a:b].float()[:, :, None]).to(scale.dtype))
    return out


def dequantize_mxfp4_into(parts: dict[str, torch.Tensor], out: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """out = e2m1 value * 2^(scale byte - 127) in fp32, rounded to out's dtype (transformers' mxfp4
    convert_moe_packed_tensors: lut[nibble], low nibble first, ldexp by the scale, in out's dtype; exact in
    fp32 before the rounding). Whole rows, CHUNK values at a time."""
    blocks, scales = parts["blocks"], parts["scales"]
    rows, cols = out.shape
    if cols % 32:
        raise QuantError(f"{name}: {cols} columns are no whole number of MXFP4 groups of 32")
    _check_shapes(name, parts, {"blocks": (rows, cols // 32, 16), "scales": (rows, cols // 32)})
    pairs, powers = MXFP4_PAIRS.to(blocks.device), E8M0_POWERS.to(blocks.device)
    step = max(1, CHUNK // max(cols, 1))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        vals = pairs.index_select(0, blocks[a:b].reshape(-1).int()).view(torch.float32).view(b - a, -1, 32)
        torch.mul(vals, powers.index_select(0, scales[a:b].reshape(-1).int()).view(b - a, -1, 1),
                  out=out[a:b].view(b - a, -1, 32))  # fp32, rounded once to out's dtype
    return out


def dequantize_into(fmt: QuantFormat, parts: dict[str, torch.Tensor], out: torch.Tensor,
                    name: str = "weight") -> torch.Tensor:
    fmt = weight_format(fmt, name)  # DeepSeek-V4's experts: mxfp4 beside fp8-block
    if fmt.method == "int4-group":
        return dequantize_int4_into(fmt, parts, out, name)
    if fmt.method == "mxfp4":
        return dequantize_mxfp4_into(parts, out, name)
    if fmt.method == "fp8-block":
        return dequantize_fp8_into(fmt, parts, out, name)
    if fmt.method == "int8":
        return dequantize_int8_into(parts, out, name)
    return dequantize_nf4_into(fmt, parts, out, name)


@contextlib.contextmanager
def one_thread():
    """This thread's torch ops on one core (OpenMP's thread count is per calling thread), restored after.

    Work beside a compute that has the cores: on a busy 2-core machine a loader's dequantization on two OpenMP
    threads spinning at each op's barrier took 5-9 s for a dim-2048 block, on one thread 0.18 s
    (benchmarks/bench_dequant.py runs that former placement; phantom.stream.transfer.DequantPool's workers keep
    one thread each for good)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def stored_parts(fmt: QuantFormat, stored: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """A quantized weight's parts among a block's stored views (part name -> view): NAME.PART's, or, where fmt keeps
    an expert's gate and up in gpt-oss's alternating rows (gate_up_part), its rows of w13's."""
    fused, p = gate_up_part(fmt, name) or (name, None)
    prefix = fused + "."
    return {k[len(prefix):]: v if p is None else v[p::2] for k, v in stored.items() if k.startswith(prefix)}


def dequantize_block(fmt: QuantFormat, stored: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """Fill a block's dense tensors (out: name -> tensor in the compute dtype) from its stored views."""
    for name, dst in out.items():
        if name in stored:
            dst.copy_(stored[name])
        elif (part := gate_up_part(fmt, name)) is not None and part[0] in stored:  # a bias of gate and up's rows
            dst.copy_(stored[part[0]][part[1]::2])
        else:
            dequantize_into(fmt, stored_parts(fmt, stored, name), dst, name)
