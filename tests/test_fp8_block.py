"""FP8 checkpoints read as shipped (fp8-block stores): tiny Qwen3, DeepSeek-V3 and GLM-4.5 models written in the published
layout (tests/fp8_checkpoint.py; widths that are no multiple of 128, so edge tiles are partial), prepared copied
and linked in place, against the transformers model holding what transformers' own FP8 routine dequantizes:

- every dequantized weight equals transformers' _dequantize_fp8_weight (explicit weight_block_size) bit for bit;
- logits from disk and RAM within 1e-5 (fp32), the experts read routed and whole;
- LoRA gradients equal peft's within 1e-4, the adapter loads in peft, the merged export loads in transformers;
- the store keeps the shipped bytes (<= 1.02x), a linked store copies none of them;
- full finetuning, --quantize on an FP8 checkpoint and FP8 configs phantom does not read are refused in one line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import pytest
import torch

import phantom
from phantom.arch import quant
from phantom.arch.config import ConfigError, block_tensor_shapes
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import QuantFormat, block_nbytes
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from phantom.arch.family import config_from_hf
from phantom.files.store import BlockStore
from phantom.convert.convert import disk_usage
from phantom.export.export import export
from family_check import batch, check_lora, make, peft_step, rel_err, transformers
from fp8_checkpoint import BLOCK, _dequantize_fp8_weight, write_fp8
from test_bad_inputs import check, script
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json
from test_moe_lora import RUNS as EXPERT_RUNS, assert_equals_peft, few, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

# Qwen3 with 6 heads of 24 (q: 144 rows, two row tiles, the second partial), one MLP width 16-bit as a
# modules_to_not_convert keeps it; DeepSeek-V3 with a 136-wide q bottleneck, experts of 40, a dense first layer
MODELS = {"qwen3": (dict(hidden_size=160, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=24), ("mlp.down_proj",)),
          "deepseek_v3": (dict(hidden_size=144, q_lora_rank=136, moe_intermediate_size=40, intermediate_size=200), ()),
          # GLM-4.5-FP8's shape: q/k/v biases, per-head q/k norms, RoPE over half of each head, DeepSeekMoE experts
          "glm4_moe": (dict(hidden_size=144, num_attention_heads=6, head_dim=24, moe_intermediate_size=40,
                            intermediate_size=200), ())}
RUNS = [(off, reads) for off in ("disk", "ram") for reads in ("routed", "whole")]


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """get(name) -> (model, shipped tensors, reference model, {"copy": store, "link": store}), each made once."""
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            fields, keep = MODELS[name]
            model = make(name, **fields)
            shipped, ref = write_fp8(model, root / "hf", keep)
            llama3_style_tokenizer_json(root / "hf")
            stores = {}
            for kind in ("copy", "link"):
                args = ["--src", str(root / "hf"), "--out", str(root / kind), "--quiet"] + (["--link"] if kind == "link" else [])
                assert load_script("prepare_model").main(args) == 0
                stores[kind] = root / kind
            made[name] = model, shipped, ref, stores
        return made[name]
    return get


def test_the_shipped_tiles_are_partial_at_the_edges(fp8):
    for name in MODELS:
        _, shipped, _, _ = fp8(name)
        weights = {k: v for k, v in shipped.items() if v.dtype == torch.float8_e4m3fn}
        assert any(v.shape[0] % 128 and v.shape[0] > 128 for v in weights.values()), name
        assert any(v.shape[1] % 128 and v.shape[1] > 128 for v in weights.values()), name
        for k, v in weights.items():
            assert shipped[k + "_scale_inv"].shape == (-(-v.shape[0] // 128), -(-v.shape[1] // 128))


@pytest.mark.parametrize("name", list(MODELS))
def test_dequantized_weights_equal_transformers_bit_for_bit(fp8, name):
    """Each stored FP8 weight, dequantized by phantom into fp32 and bf16, equals transformers' routine on the
    same bytes (fp32, then rounded), q/k rows aside (phantom permutes them after: compared before)."""
    _, _, _, stores = fp8(name)
    for kind, path in stores.items():
        store = BlockStore(path)
        assert store.quant.method == "fp8-block" and store.quant.block == tuple(BLOCK)
        n = 0
        for i in range(store.n_blocks):
            buf = torch.empty(store.block_size(i), dtype=torch.uint8)
            store.read_block_into(i, buf)
            stored = store.block_views(buf, i)
            for key in [k for k in stored if k.endswith(".fp8")]:
                parts = {"fp8": stored[key], "scale_inv": stored[key.replace(".fp8", ".scale_inv")]}
                theirs = _dequantize_fp8_weight(parts["fp8"].clone(), parts["scale_inv"], BLOCK, torch.float32)
                for dtype in (torch.float32, torch.bfloat16):
                    ours = quant.dequantize_into(store.quant, parts, torch.empty(parts["fp8"].shape, dtype=dtype))
                    assert torch.equal(ours, theirs.to(dtype)), (kind, i, key, dtype)
                n += 1
        assert n > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_transformers_from_disk_and_ram(fp8, name):
    model, _, ref, stores = fp8(name)
    tokens, targets = batch()
    with torch.no_grad():
        expected = ref(tokens).logits
    moe = name != "qwen3"
    for kind, path in stores.items():
        if moe:  # every expert one byte range (its codes and scales), so a routed read fetches it alone
            store = BlockStore(path)
            assert all(len(store.blocks[i].experts) == store.cfg.n_experts for i in range(1, store.n_blocks)), kind
        for offload, reads in RUNS if moe else [("disk", None), ("ram", None)]:
            knobs = dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None) if moe else {}
            with phantom.load(path, offload=offload, prefetch=1, lora=None, dtype=torch.float32, **knobs) as pm:
                with torch.no_grad():
                    assert rel_err(pm(tokens), expected) < 1e-5, (kind, offload, reads)


def test_the_store_keeps_the_shipped_bytes_and_a_link_copies_none(fp8):
    for name in MODELS:
        _, shipped, _, stores = fp8(name)
        fp8_bytes = sum(v.numel() * v.element_size() for k, v in shipped.items()
                        if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv"))
        copy = BlockStore(stores["copy"])
        stored = sum(s.end - s.start for b in copy.blocks for s in b.specs if s.name.endswith((".fp8", ".scale_inv")))
        assert stored == fp8_bytes  # the quantized tensors take their shipped bytes, no more
        assert disk_usage(stores["copy"]) <= 1.02 * sum(v.numel() * v.element_size() for v in shipped.values()) + \
            (64 << 10)  # + the manifest, tokenizer and 4 KiB-aligned headers
        linked = json.loads((stores["link"] / "manifest.json").read_text())["links"]["files"]
        quantized = [t for f in linked.values() for t in f["tensors"] if t["name"].endswith((".fp8", ".scale_inv"))]
        assert len(quantized) == sum(1 for v in shipped.values() if v.dtype == torch.float8_e4m3fn) * 2
        assert all(t["file"].startswith("/") and "model-0000" in t["file"] for t in quantized)  # in place
        local = sum(p.stat().st_size for p in (stores["link"] / "blocks").glob("*.local.safetensors"))
        assert local < fp8_bytes / 10, name


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_lora_equals_peft_and_the_merged_export_loads(fp8, name, tmp_path):
    """LoRA on the attention (and the MLP) of the streamed FP8 store: gradients equal peft's on the dequantized
    transformers model; the adapter loads in peft; merge_lora's 16-bit export loads in transformers (bf16 by
    default, fp32 asked: then equal to peft's merge within 1e-5)."""
    _, _, ref, stores = fp8(name)
    tokens, targets = batch()
    targets_ = ("q", "kv_a", "kv_b", "o") if name == "deepseek_v3" else ("q", "k", "v", "o", "gate", "up", "down")
    runs = (("disk", 1, "all"), ("ram", 0, "none"))
    adapter, _ = check_lora(ref, stores["link"], tmp_path, tokens, targets, runs=runs, lora_targets=targets_)
    pmodel = transformers_peft_merged(ref, adapter)
    with torch.no_grad():
        expected = pmodel(tokens).logits
    for dtype, tol in ((None, 2e-2), (torch.float32, 1e-5)):
        out = export(stores["link"], tmp_path / f"merged-{dtype}", adapter, "hf", dtype=dtype, progress=False)
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert rel_err(merged(tokens).logits, expected) < tol, dtype


def transformers_peft_merged(model, adapter):
    from family_check import peft
    import copy
    return peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter).merge_and_unload().eval()


def test_full_finetuning_and_quantizing_again_are_refused(fp8, tmp_path, capsys):
    _, _, _, stores = fp8("qwen3")
    out = tmp_path / "out"
    code = script("finetune").main(["--model", str(stores["link"]), "--mode", "full", "--iters", "1", "--quiet",
                                    "--batch-size", "1", "--seq-len", "8", "--val-split", "0", "--out", str(out),
                                    "--data", str(__import__("pathlib").Path(phantom.__file__).parent / "assets" /
                                                  "tiny.txt")])
    check(capsys, code, tmp_path, "fp8-block", "full finetuning", "LoRA")
    assert not (out / "store").exists()
    hf = stores["link"].parent / "hf"
    code = script("prepare_model").main(["--src", str(hf), "--out", str(tmp_path / "q"), "--quantize", "nf4", "--quiet"])
    check(capsys, code, tmp_path, "fp8-block", "--quantize")


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "fp8"}, "quantization_config"),  # per-tensor FP8 (no weight_block_size)
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "quantization_config"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "quantization_config"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue4m3"}, "quantization_config"),
    ({"quant_method": "compressed-tensors"}, "quantization_config"),
])
def test_fp8_configs_phantom_does_not_read_are_refused(qc, named):
    c = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 96,
         "max_position_embeddings": 64, "head_dim": 16, "quantization_config": qc}
    with pytest.raises(ConfigError, match=f"{named}="):
        config_from_hf(c)
    for extra in ({}, {"scale_fmt": "ue8m0"}):  # DeepSeek-V3.1's scales: float32 powers of two
        ok = {**c, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128], **extra}}
        assert config_from_hf(ok).dim == 64


def test_the_cost_model_counts_the_stored_bytes(fp8):
    """shape_of's fp8-block blocks (block_nbytes, as tune.py --quantize fp8-block plans them) are the bytes of the
    store's block files; DeepSeek-V3-671B's blocks in fp8-block are half their bf16 bytes (the scales add 0.04%)."""
    for name in MODELS:
        store = BlockStore(fp8(name)[3]["copy"])
        for i in range(store.n_blocks):
            assert store.block_size(i) == block_nbytes(store.quant, block_tensor_shapes(store.cfg, i), "bfloat16")
    cfg = PRESETS["deepseek-v3-671B"]
    ratio = ci.shape_of(cfg, quant="fp8-block").block_bytes / ci.shape_of(cfg).block_bytes
    assert 0.5 < ratio < 0.5005


def test_a_synthetic_fp8_block_store_holds_its_weights(tmp_path):
    """write_synthetic with fp8-block (bench.py's FP8 stores): tiles quantized as DeepSeek-V3's recipe, q/k rows
    in Hugging Face's order as a checkpoint ships them, read back near the 16-bit weights (e4m3: 3 mantissa bits)."""
    cfg = dataclasses.replace(PRESETS["tiny"], dim=160, n_heads=5, n_kv_heads=1, intermediate_size=200, n_layers=1)
    dense = BlockStore(write_synthetic(tmp_path / "bf16", cfg, torch.bfloat16, progress=False))
    store = BlockStore(write_synthetic(tmp_path / "fp8", cfg, torch.bfloat16, progress=False,
                                       quant=QuantFormat("fp8-block")))
    a, b = store.load_block(0, torch.float32), dense.load_block(0, torch.float32)
    for k, v in b.items():
        err = ((a[k] - v).abs().mean() / v.abs().mean()).item()
        assert err < (0.05 if v.dim() == 2 else 1e-6), (k, err)


def test_an_fp8_weight_without_its_scales_is_refused_in_one_line(fp8, tmp_path, capsys):
    hf = fp8("qwen3")[3]["copy"].parent / "hf"
    bad = tmp_path / "hf"
    shutil.copytree(hf, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    code = script("prepare_model").main(["--src", str(bad), "--out", str(tmp_path / "s"), "--quiet"])
    check(capsys, code, tmp_path, "o_proj.weight_scale_inv", "incomplete")


@pytest.mark.usefixtures("ram_streams")
def test_lora_on_fp8_experts_equals_peft_with_experts_read_routed_and_whole(fp8, tmp_path):
    """LoRA on latent attention and every routed expert of the linked FP8 DeepSeek-V3 (peft's target_parameters):
    logits within 1e-5 of peft's on the dequantized model, every A and B gradient within 1e-4, resident and
    streamed from disk and RAM, the experts' FP8 bytes and scales read routed (alone: checked) and whole."""
    _, _, ref, stores = fp8("deepseek_v3")
    tokens, targets = few()
    adapter = tmp_path / "adapter"
    phantom_step(stores["link"], tokens, targets, adapter, offload="none")
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"] == [
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    want = peft_step(ref, adapter, tokens, targets)
    for offload, prefetch, recompute, reads in EXPERT_RUNS:
        knobs = {} if offload == "none" else dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        got = phantom_step(stores["link"], tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute,
                           **knobs)
        assert_equals_peft(got, want, (offload, prefetch, recompute, reads), unhit=True)


def test_finetune_trains_on_an_fp8_deepseek_v3_from_the_hub_cache(fp8, tmp_path, monkeypatch):
    """finetune.py --model OWNER/NAME on the FP8 DeepSeek-V3 in the local hub cache (a snapshot of links to blobs):
    linked on first use, LoRA on latent attention and the experts, streamed from disk with the experts read
    routed; the adapter loads in peft onto the dequantized transformers model with phantom's logits."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(tmp_path / "weights"))
    _, _, ref, stores = fp8("deepseek_v3")
    repo = tmp_path / "hub" / "models--deepseek-ai--tiny-v3-fp8"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (stores["link"].parent / "hf").iterdir():  # as the hub lays a download out
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    out = tmp_path / "out"
    targets = "q,kv_a,kv_b,o,gate,up,down"
    assert load_script("finetune").main([
        "--model", "deepseek-ai/tiny-v3-fp8", "--offload", "disk", "--expert-reads", "routed", "--lora-targets",
        targets, "--iters", "2", "--warmup", "0", "--lr", "1e-2", "--batch-size", "2", "--seq-len", "32",
        "--eval-every", "0", "--val-split", "0", "-q", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("bytes_experts", 0) > 0 for r in records if "loss" in r)  # the experts were read alone
    store = phantom.resolve_model("deepseek-ai/tiny-v3-fp8")
    assert BlockStore(store).quant.method == "fp8-block" and "links" in json.loads((store / "manifest.json").read_text())
    tokens, _ = batch()
    with phantom.load(store, offload="none", dtype=torch.float32,
                      lora=phantom.LoraConfig(targets=tuple(targets.split(",")))) as pm, torch.no_grad():
        pm.load_adapter(out / "adapter")
        ours, base = pm(tokens), ref(tokens).logits
    theirs = transformers_peft_logits(ref, out / "adapter", tokens)
    assert rel_err(ours, base) > 1e-4 and rel_err(ours, theirs) < 1e-5


def transformers_peft_logits(model, adapter, tokens):
    from family_check import peft
    import copy
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()(tokens).logits
