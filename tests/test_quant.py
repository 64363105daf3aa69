"""NF4 and int8 weights against bitsandbytes: the same codes and scales, dequantized bit for bit."""
from __future__ import annotations

import logging

import pytest
import torch

from phantom.arch import quant
from phantom.arch.quantformat import QuantFormat, block_layout
from phantom.files.tensorfile import dtype_name

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "no kernels package" (a GEMM we do not use)
bnb = pytest.importorskip("bitsandbytes.functional")

# A Llama-like matrix, a row length that is not a block multiple, a last partial block, an odd count.
SHAPES = [(256, 512), (96, 100), (41, 64 * 257 + 32), (7, 9)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def weight(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    w[0, :3] = torch.tensor([0.3, -0.25, 0.0])  # outliers: a block whose scale they set
    return w.to(dtype)


def test_code_tables_are_bitsandbytes():
    assert torch.equal(quant.NF4_CODE, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(quant.DYNAMIC_CODE, bnb.create_dynamic_map())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_codes_and_scales_equal_bitsandbytes(shape, dtype):
    w = weight(shape, dtype)
    ref_codes, ref = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    got = quant.quantize_nf4(w, QuantFormat("nf4", double_quant=False))
    assert torch.equal(got["nf4"], ref_codes.view(-1))
    assert torch.equal(got["absmax"], ref.absmax)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_nf4_double_quantized_scales_equal_bitsandbytes(shape):
    """Same codes, offset and second-level scales; the 8-bit scale codes are the nearest level, which
    bitsandbytes' CPU table lookup also gives except within 1/65535 of a midpoint (see quant._nearest)."""
    w = weight(shape, torch.bfloat16)
    ref_codes, ref = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    got = quant.quantize_nf4(w, QuantFormat("nf4"))
    assert torch.equal(got["nf4"], ref_codes.view(-1))
    assert torch.equal(got["offset"], ref.offset.view(1))
    assert torch.equal(got["absmax2"], ref.state2.absmax)
    plain = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")[1].absmax
    scaled = ((plain - ref.offset).view(-1)[: plain.numel() // 256 * 256].view(-1, 256)
              * (1.0 / ref.state2.absmax[: plain.numel() // 256].view(-1, 1))).view(-1)
    n = scaled.numel()
    differ = (got["absmax"][:n] != ref.absmax[:n]).nonzero().view(-1)
    assert differ.numel() <= 0.01 * n
    code = quant.DYNAMIC_CODE
    for i in differ.tolist():
        a, b = sorted((int(got["absmax"][i]), int(ref.absmax[i])))
        assert b == a + 1 and abs(scaled[i] - (code[a] + code[b]) / 2) <= 1.5 / 65535
        assert abs(scaled[i] - code[int(got["absmax"][i])]) <= abs(scaled[i] - code[int(ref.absmax[i])])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_dequantized_bit_equal_to_bitsandbytes(shape, double_quant, dtype):
    """bitsandbytes' own quantized state, dequantized by phantom: the same values, bit for bit.

    Its CPU kernel takes rows of whole blocks; for other shapes the reference is its torch kernel
    (the CPU kernel disagrees with bitsandbytes' own flat quantize_4bit there)."""
    w = weight(shape, torch.bfloat16, seed=1)
    codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    state.dtype = dtype
    if shape[1] % 64 == 0:
        ref = bnb.dequantize_4bit(codes, state)
    else:
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        absmax = state.absmax if not double_quant else \
            bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
        ref = _dequantize_4bit_compute.__wrapped__(codes.view(-1), absmax, state.code, 64, shape, dtype)
    parts = {"nf4": codes.view(-1), "absmax": state.absmax}
    if double_quant:
        parts.update(absmax2=state.state2.absmax, offset=state.offset.view(1))
    out = torch.empty(shape, dtype=dtype)
    quant.dequantize_nf4_into(QuantFormat("nf4", double_quant=double_quant), parts, out)
    assert torch.equal(out, ref)


def test_nf4_dequantize_in_pieces(monkeypatch):
    """A weight larger than a piece is dequantized piece by piece to the same values."""
    w, fmt = weight((130, 192), torch.bfloat16), QuantFormat("nf4")
    parts = quant.quantize_nf4(w, fmt)
    whole = quant.dequantize_nf4_into(fmt, parts, torch.empty(130, 192))
    monkeypatch.setattr(quant, "CHUNK", 64 * 6)
    assert torch.equal(quant.dequantize_nf4_into(fmt, parts, torch.empty(130, 192)), whole)
    assert torch.equal(quant.quantize_nf4(w, fmt)["nf4"], parts["nf4"])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_equals_bitsandbytes_and_a_per_channel_reference(shape, dtype):
    w = weight(shape, dtype)
    got = quant.quantize_int8(w)
    q, stats, _ = bnb.int8_vectorwise_quant(w.clone())
    assert torch.equal(got["int8"], q) and torch.equal(got["absmax"], stats)
    # the straightforward reference: one scale per output channel, round to nearest
    scale = w.float().abs().amax(dim=1, keepdim=True) / 127
    assert (got["int8"].float() - w.float() / scale).abs().max() <= 0.5 + 1e-3
    assert got["int8"].abs().max() == 127
    out = quant.dequantize_int8_into(got, torch.empty(shape, dtype=torch.float32))
    assert torch.equal(out, bnb.int8_vectorwise_dequant(q, stats))
    torch.testing.assert_close(out, w.float(), atol=float(scale.max()) / 2 + 1e-7, rtol=0)
    low = quant.dequantize_int8_into(got, torch.empty(shape, dtype=dtype))
    assert torch.equal(low, out.to(dtype))


def test_block_layout_and_roundtrip():
    """quantize_block stores every matrix as its parts and the norms as they are; dequantize_block
    gives back the dequantized matrices and the norms."""
    shapes = {"attention.wq.weight": (64, 64), "feed_forward.w2.weight": (64, 96), "ffn_norm.weight": (64,)}
    tensors = {n: weight(s, torch.float32, seed=k) if len(s) == 2 else torch.rand(s) for k, (n, s) in
               enumerate(shapes.items())}
    for fmt in (QuantFormat("nf4"), QuantFormat("nf4", double_quant=False), QuantFormat("int8")):
        stored = quant.quantize_block(fmt, tensors, torch.bfloat16)
        layout = block_layout(fmt, shapes, "bfloat16")
        assert {k: (tuple(v.shape), dtype_name(v.dtype)) for k, v in stored.items()} == layout
        out = {n: torch.empty(s) for n, s in shapes.items()}
        quant.dequantize_block(fmt, stored, out)
        assert torch.equal(out["ffn_norm.weight"], tensors["ffn_norm.weight"].bfloat16().float())
        tol = 0.2 if fmt.method == "nf4" else 0.01  # of each block's largest value
        for n in ("attention.wq.weight", "feed_forward.w2.weight"):
            assert (out[n] - tensors[n]).abs().max() <= tol * tensors[n].abs().max()


def test_scales_a_quantizer_never_writes_are_refused():
    fmt = QuantFormat("nf4", double_quant=False)
    parts = quant.quantize_nf4(weight((8, 64), torch.float32), fmt)
    parts["absmax"][1] = -parts["absmax"][1]
    with pytest.raises(quant.QuantError, match="scales"):
        quant.dequantize_nf4_into(fmt, parts, torch.empty(8, 64))
    parts = quant.quantize_int8(weight((8, 64), torch.float32))
    parts["absmax"][0] = float("nan")
    with pytest.raises(quant.QuantError, match="scales"):
        quant.dequantize_int8_into(parts, torch.empty(8, 64))


def test_format_records():
    for fmt in (QuantFormat("nf4"), QuantFormat("nf4", 128, False), QuantFormat("int8")):
        assert QuantFormat.from_record(fmt.record()) == fmt
    for bad in ({"method": "nf3"}, {"method": "nf4", "blocksize": 48, "double_quant": True, "absmax_blocksize": 256},
                {"method": "nf4"}, {"method": "int8", "blocksize": 64}):
        with pytest.raises(quant.QuantError):
            QuantFormat.from_record(bad)
