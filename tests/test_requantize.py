"""merge_lora.py --requantize: a store of a checkpoint shipped quantized, merged with an adapter and written in the
checkpoint's own format again (FP8 in 128 x 128 tiles, compressed-tensors' INT4 in groups of 32, gpt-oss's MXFP4),
from tiny checkpoints written by the published recipes (tests/fp8_checkpoint.py, int4_checkpoint.py,
mxfp4_checkpoint.py):

- without an adapter, or with one as initialized (B = 0), every tensor of the export is the checkpoint's, byte for
  byte, and config.json's quantization_config is the checkpoint's;
- with an adapter, each weight it changes is what the published quantizer makes of the 16-bit export's merged
  weight, bit for bit (transformers' Fp8Quantize, zero-padded to whole tiles; compressed-tensors' compressor; for
  MXFP4, where no quantizer is installed, its definition: the E8M0 exponent of amax / 6 rounded up, each value the
  nearest e2m1 level, ties away from zero), the others keep their shipped bytes; transformers loads the export
  (dequantizing on a CPU) and its logits are within the format's rounding of the 16-bit export's;
- --requantize on a 16-bit or NF4 store, on a store that does not record its checkpoint's quantization_config,
  or with --format gguf, is one `error:` line, exit 2.
"""
from __future__ import annotations

import json
import types

import pytest
import torch
from family_check import batch, make, rel_err, transformers
from safetensors.torch import load_file
from test_bad_inputs import check, script
from test_convert import load_script

import phantom
from phantom.export.export import FormatOptions, export

# (tiny model, its fields, LoRA targets, whether transformers loads it on a CPU): the FP8 Qwen3's weights
# are whole tiles or one tile each (transformers' CPU dequantization derives the tile from the scales' grid), the
# edge one's are cut short at the right and bottom (bit-equality with the reference only)
CASES = {"fp8": ("qwen3", dict(hidden_size=128, intermediate_size=256, head_dim=32), ("q", "v", "gate"), True),
         "fp8-edge": ("qwen3", dict(hidden_size=160, intermediate_size=200, num_attention_heads=6, head_dim=24),
                      ("q", "o", "down"), False),
         "int4": ("llama-tied", {}, ("q", "k", "up"), True),
         "int4-kimi": ("deepseek_v3", {}, ("down",), True),  # Kimi-K2-Thinking's layout: only the routed experts INT4
         "mxfp4": ("gpt_oss", {}, ("q", "down"), True)}


def write(kind, model, folder):
    if kind.startswith("fp8"):
        from fp8_checkpoint import write_fp8
        return write_fp8(model, folder, ("mlp.down_proj",) if kind == "fp8" else ())[0]
    if kind.startswith("int4"):
        from int4_checkpoint import KIMI_IGNORE, write_int4
        return write_int4(model, folder, KIMI_IGNORE if kind == "int4-kimi" else ("lm_head",))[0]
    from mxfp4_checkpoint import write_mxfp4
    return write_mxfp4(model, folder)


def adapter(store, folder, targets, zero: bool):
    """An adapter on targets: as initialized (B = 0), or every A and B random."""
    with phantom.load(store, lora=phantom.LoraConfig(rank=4, alpha=8, targets=targets), offload="none") as pm:
        if not zero:
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in pm.trainable_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        pm.save_adapter(folder)
    return folder


def load(kind, folder):
    """transformers' model of a checkpoint folder, dequantizing on a CPU as it does there (compressed-tensors
    decompresses INT4 by itself), in fp32."""
    config = {"fp8": transformers.FineGrainedFP8Config(dequantize=True),
              "mxfp4": transformers.Mxfp4Config(dequantize=True)}.get(kind.split("-")[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              **({"quantization_config": config} if config else {}))
    return (model.float() if kind == "fp8" else model).eval()  # FP8's dequantized weights come in bf16


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """get(kind) -> (shipped tensors, {export name: folder}, the logits' relative error of the checkpoint loaded
    by transformers against the model it was quantized from: the format's own rounding), each made once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            name, fields, targets, loads = CASES[kind]
            model = make(name, **fields).eval()
            shipped = write(kind, model, root / "hf")
            own = None
            if loads:
                with torch.no_grad():
                    own = rel_err(load(kind, root / "hf")(batch()[0]).logits, model(batch()[0]).logits)
            assert load_script("prepare_model").main(["--src", str(root / "hf"), "--out", str(root / "store"),
                                                      "--quiet"]) == 0
            lora = adapter(root / "store", root / "adapter-lora", targets, False)
            zero = adapter(root / "store", root / "adapter-zero", targets, True)
            outs = {}
            for out, ad, rq in (("base", None, True), ("zero", zero, True), ("lora", lora, True), ("16", lora, False)):
                outs[out] = export(root / "store", root / out, ad, "hf", progress=False,
                                   options=FormatOptions(requantize=rq))
            cache[kind] = shipped, outs, own
        return cache[kind]
    return get


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("kind", list(CASES))
def test_unmerged_export_is_the_checkpoint_byte_for_byte(made, kind):
    shipped, outs, _ = made(kind)
    source_qc = json.loads((outs["base"].parent / "hf" / "config.json").read_text())["quantization_config"]
    for out in ("base", "zero"):
        got = tensors(outs[out])
        assert sorted(got) == sorted(shipped), (out, sorted(set(got) ^ set(shipped)))
        # DeepSeek-V3's float32 router bias too: a shipped store keeps it in float32 (its format's float32)
        assert [k for k in shipped if not same_bytes(got[k], shipped[k])] == [], out
        assert json.loads((outs[out] / "config.json").read_text())["quantization_config"] == source_qc


def quantized_keys(kind, keys) -> list[str]:
    end = {"fp8": "_scale_inv", "int4": "_packed", "mxfp4": "_blocks"}[kind.split("-")[0]]
    return [k[:-len(end)] if kind.startswith("fp8") else k for k in keys if k.endswith(end)]


def fp8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' FP8 quantizer (whole 128 x 128 tiles) on w padded with zeros to whole tiles, cut back."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    config = types.SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None)
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128, dtype=w.dtype)
    padded[:rows, :cols] = w
    out = Fp8Quantize(types.SimpleNamespace(quantization_config=config))._quantize_one("w.weight", padded)
    return out["w.weight"][:rows, :cols], out["w.weight_scale_inv"]


def mxfp4_definition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of w's rows (bf16) by its definition: per 32 values the smallest power of two 2^s >= amax / 6 (E8M0
    byte s + 127), each value the e2m1 level nearest to it / 2^s, ties away from zero, at most 6; decoded values."""
    x = w.to(torch.bfloat16).float().unflatten(-1, (-1, 32))
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127.0))
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    y = (x.abs() / torch.pow(2.0, s)).clamp(max=6.0).contiguous()
    nearest = levels[torch.bucketize(y, (levels[:-1] + levels[1:]) / 2, right=True)]  # a midpoint goes up
    return (torch.where(x < 0, -nearest, nearest) * torch.pow(2.0, s)).flatten(-2), (s + 127).squeeze(-1)


@pytest.mark.parametrize("kind", list(CASES))
def test_changed_weights_are_the_published_quantizers_output_and_transformers_loads(made, kind):
    shipped, outs, own = made(kind)
    got, merged16 = tensors(outs["lora"]), tensors(outs["16"])
    changed = 0
    for key in quantized_keys(kind, shipped):
        if kind == "mxfp4":
            w = merged16[key.removesuffix("_blocks")].transpose(1, 2)  # (experts, out rows, in)
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            values = convert_moe_packed_tensors(got[key], got[key.replace("_blocks", "_scales")], dtype=torch.float32)
            want, scales = mxfp4_definition(w)
            same = same_bytes(got[key], shipped[key])
            if not same:
                assert torch.equal(values.transpose(1, 2), want) and torch.equal(got[key.replace("_blocks", "_scales")],
                                                                                 scales.to(torch.uint8)), key
        elif kind.startswith("fp8"):
            q, s = fp8_reference(merged16[key])
            same = same_bytes(got[key], shipped[key]) and same_bytes(got[key + "_scale_inv"], shipped[key + "_scale_inv"])
            if not same:
                assert same_bytes(got[key], q.contiguous()) and same_bytes(got[key + "_scale_inv"], s), key
        else:
            from int4_checkpoint import compress
            ref = compress(merged16[key.removesuffix("_packed")])
            same = all(same_bytes(got[key.replace("_packed", p)], shipped[key.replace("_packed", p)])
                       for p in ("_packed", "_scale", "_shape"))
            if not same:
                assert all(same_bytes(got[key.replace("_packed", f"_{p}")], ref[f"weight_{p}"])
                           for p in ("packed", "scale", "shape")), key
        changed += not same
    assert 0 < changed < len(quantized_keys(kind, shipped)), changed  # the adapter's weights; the others as shipped
    if own is None:
        return
    tokens, _ = batch()
    with torch.no_grad():
        err = rel_err(load(kind, outs["lora"])(tokens).logits, load("16", outs["16"])(tokens).logits)
    print(f"{kind}: logits of the requantized export against the 16-bit export: relative error {err:.4f} "
          f"(the checkpoint against the model it was quantized from: {own:.4f})")
    assert err < own, (err, own)  # one rounding of the changed weights, within the format's own


@pytest.mark.parametrize("case", ["16-bit", "nf4", "gguf", "unrecorded"])
def test_requantize_without_a_shipped_format_is_refused(made, case, tmp_path, capsys):
    _, outs, _ = made("fp8")
    store = outs["base"].parent / "store"
    if case == "unrecorded":  # a store prepared before the manifest kept the checkpoint's quantization_config
        import shutil
        store = shutil.copytree(store, tmp_path / "old")
        manifest = json.loads((store / "manifest.json").read_text())
        del manifest["shipped_quantization"]
        (store / "manifest.json").write_text(json.dumps(manifest))
    elif case != "gguf":
        sixteen = tmp_path / "s16"
        assert load_script("prepare_model").main(["--src", str(outs["16"]), "--out", str(sixteen), "--quiet"]) == 0
        store = sixteen
        if case == "nf4":
            store = tmp_path / "nf4"
            assert load_script("prepare_model").main(["--src", str(sixteen), "--out", str(store), "--quantize", "nf4",
                                                      "--quiet"]) == 0
    args = ["--model", str(store), "--out", str(tmp_path / "out"), "--requantize", "--quiet"]
    capsys.readouterr()  # what making the fixture printed
    code = script("merge_lora").main(args + (["--format", "gguf"] if case == "gguf" else []))
    words = {"16-bit": ["16-bit"], "nf4": ["nf4"], "gguf": ["--format hf"], "unrecorded": ["prepare it again"]}[case]
    check(capsys, code, tmp_path, "--requantize", *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fp8-edge", "mxfp4"])
def test_requantizing_the_shipped_values_gives_the_shipped_codes(made, kind):
    """The quantizer applied to the checkpoint's own dequantized weights gives its bytes back: MXFP4's (in bf16, as
    transformers' quantizer takes them; the OCP recipe's exponents leave 4 or 6 the largest level of a group, which
    the round-up rule keeps) and FP8's codes, its scales within one ulp (from fp32: the tile's largest value is 448 *
    scale_inv, which a bf16 export's rounding moves, and with it the scale; the checkpoint's writer divides amax by
    448 where transformers' quantizer takes the reciprocal of 448 / amax). Not so for INT4 (absmax / 7.5 moves a group's scale when applied to its
    own output), nor FP8 from bf16: why an export keeps the shipped bytes of the weights an adapter leaves."""
    from phantom.arch import quant
    from phantom.arch.quantformat import QuantFormat
    shipped, _, _ = made(kind)
    n = 0
    for key, t in shipped.items():
        if kind == "mxfp4" and key.endswith("_blocks"):
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            scales = shipped[key.replace("_blocks", "_scales")]
            values = convert_moe_packed_tensors(t.clone(), scales.clone(), dtype=torch.bfloat16)
            for e in range(t.shape[0]):
                parts = quant.quantize_mxfp4(values[e].T.contiguous())
                assert torch.equal(parts["blocks"], t[e]) and torch.equal(parts["scales"], scales[e]), (key, e)
                n += 1
        elif t.dtype == torch.float8_e4m3fn:
            from fp8_checkpoint import _dequantize_fp8_weight
            scale = shipped[key + "_scale_inv"]
            w = _dequantize_fp8_weight(t.clone(), scale, [128, 128], torch.float32)
            parts = quant.quantize_fp8(w, QuantFormat("fp8-block"))
            assert same_bytes(parts["fp8"], t), key
            assert ((parts["scale_inv"].view(torch.int32) - scale.view(torch.int32)).abs() <= 1).all(), key
            n += 1
    assert n > 0
