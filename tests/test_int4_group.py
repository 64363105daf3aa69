"""INT4 checkpoints read as shipped (int4-group stores): a tiny Llama with every linear weight INT4 and a tiny
DeepSeek-V3 (Kimi-K2-Thinking's shape) with its routed experts INT4 and the rest 16-bit as its `ignore` says,
written by compressed-tensors' own compressor (tests/int4_checkpoint.py), prepared copied and linked in place,
against the transformers model holding compressed-tensors' decompression of the same bytes:

- every dequantized weight equals compressed-tensors' decompression bit for bit;
- logits from disk and RAM within 1e-5 (fp32), the experts read routed and whole;
- LoRA gradients equal peft's within 1e-4 (on the INT4 projections of the Llama, on the INT4 experts of the
  DeepSeek-V3), the adapter loads in peft, the merged export loads in transformers;
- the store keeps the shipped bytes (<= 1.02x), a linked store copies none of them;
- full finetuning and INT4 configs phantom does not read are refused in one line.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import phantom
from phantom.arch import quant
from phantom.arch.config import ConfigError, block_tensor_shapes
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import QuantFormat, block_nbytes
from phantom.files.store import BlockStore
from phantom.files.tensorfile import read_header
from phantom.convert.convert import disk_usage
from phantom.export.export import export
from phantom.plan import costinputs as ci
from phantom.plan import profiles
from family_check import batch, check_lora, make, peft_step, rel_err, transformers
from int4_checkpoint import GROUP, KIMI_IGNORE, WEIGHTS, decompress, write_int4
from test_bad_inputs import check, script
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json
from test_moe_lora import assert_equals_peft, few, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

MODELS = {"llama-tied": ("lm_head",), "deepseek_v3": tuple(KIMI_IGNORE)}
RUNS = [(off, reads) for off in ("disk", "ram") for reads in ("routed", "whole")]


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """get(name) -> (shipped tensors, reference model, {"copy": store, "link": store}), each made once."""
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            shipped, ref = write_int4(make(name), root / "hf", MODELS[name])
            llama3_style_tokenizer_json(root / "hf")
            stores = {}
            for kind in ("copy", "link"):
                args = ["--src", str(root / "hf"), "--out", str(root / kind), "--quiet"] + (["--link"] if kind == "link" else [])
                assert load_script("prepare_model").main(args) == 0
                stores[kind] = root / kind
            made[name] = shipped, ref, stores
        return made[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_dequantized_weights_equal_compressed_tensors_bit_for_bit(int4, name):
    """Each stored INT4 weight, dequantized by phantom into fp32 and bf16, equals compressed-tensors'
    decompression of the same bytes (bf16 products, then widened), q/k rows aside (phantom permutes them after)."""
    shipped, _, stores = int4(name)
    for kind, path in stores.items():
        store = BlockStore(path)
        assert (store.quant.method, store.quant.group, store.quant.scale_dtype) == ("int4-group", GROUP, "bfloat16")
        n = 0
        for i in range(store.n_blocks):
            buf = torch.empty(store.block_size(i), dtype=torch.uint8)
            store.read_block_into(i, buf)
            stored = store.block_views(buf, i)
            for key in [k for k in stored if k.endswith(".packed")]:
                parts = {"packed": stored[key], "scale": stored[key.replace(".packed", ".scale")]}
                rows, cols = parts["packed"].shape[0], parts["scale"].shape[1] * GROUP
                theirs = decompress({"w_packed": parts["packed"], "w_scale": parts["scale"],
                                     "w_shape": torch.tensor([rows, cols])}, "w_packed")
                for dtype in (torch.float32, torch.bfloat16):
                    ours = quant.dequantize_into(store.quant, parts, torch.empty(rows, cols, dtype=dtype))
                    assert torch.equal(ours, theirs.to(dtype)), (kind, i, key, dtype)
                n += 1
        assert n == sum(k.endswith("_packed") for k in shipped), kind


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16", "float32"])
def test_every_scale_dtype_and_output_dtype_equal_compressed_tensors(scale_dtype):
    """compressed-tensors rounds each product to the scale's dtype: phantom's fp32, bf16 and fp16 outputs are its
    decompression widened or rounded, bit for bit, whatever dtype the checkpoint's scales are in."""
    fmt = QuantFormat("int4-group", scale_dtype=scale_dtype)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)).to(getattr(torch, scale_dtype))
    parts = quant.quantize_int4(w, fmt)
    theirs = decompress({"w_packed": parts["packed"], "w_scale": parts["scale"], "w_shape": torch.tensor([48, 128])},
                        "w_packed")
    assert theirs.dtype == getattr(torch, scale_dtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(quant.dequantize_into(fmt, parts, torch.empty(48, 128, dtype=dtype)), theirs.to(dtype))


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_the_decompressed_transformers_model_from_disk_and_ram(int4, name):
    _, ref, stores = int4(name)
    tokens, _ = batch()
    with torch.no_grad():
        expected = ref(tokens).logits
    moe = name == "deepseek_v3"
    for kind, path in stores.items():
        if moe:  # every expert one byte range (its words and scales), so a routed read fetches it alone
            store = BlockStore(path)
            assert all(len(store.blocks[i].experts) == store.cfg.n_experts for i in range(1, store.n_blocks)), kind
        runs = (RUNS if kind == "link" else RUNS[1:2]) if moe else [("disk", None), ("ram", None)]
        for offload, reads in runs:
            knobs = dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None) if moe else {}
            with phantom.load(path, offload=offload, prefetch=1, lora=None, dtype=torch.float32, **knobs) as pm:
                with torch.no_grad():
                    assert rel_err(pm(tokens), expected) < 1e-5, (kind, offload, reads)


def test_the_store_keeps_the_shipped_bytes_and_a_link_copies_none(int4):
    for name in MODELS:
        shipped, _, stores = int4(name)
        int4_bytes = sum(v.numel() * v.element_size() for k, v in shipped.items() if k.endswith(("_packed", "_scale")))
        copy = BlockStore(stores["copy"])
        stored = sum(s.end - s.start for b in copy.blocks for s in b.specs if s.name.endswith((".packed", ".scale")))
        assert stored == int4_bytes  # the quantized tensors take their shipped bytes, no more (weight_shape: checked)
        assert disk_usage(stores["copy"]) <= 1.02 * sum(v.numel() * v.element_size() for v in shipped.values()) + \
            (64 << 10)  # + the manifest, tokenizer and 4 KiB-aligned headers
        linked = json.loads((stores["link"] / "manifest.json").read_text())["links"]["files"]
        parts = [t for f in linked.values() for t in f["tensors"] if t["name"].endswith((".packed", ".scale"))]
        assert len(parts) == sum(k.endswith("_packed") for k in shipped) * 2
        assert all(t["file"].startswith("/") and "model-0000" in t["file"] for t in parts)  # in place
        for local in (stores["link"] / "blocks").glob("*.local.safetensors"):  # 16-bit rows permuted for RoPE alone
            assert not [s.name for s in read_header(local)[0] if s.name.endswith((".packed", ".scale"))], name


def test_lora_on_the_int4_llama_equals_peft_and_the_merged_export_loads(int4, tmp_path):
    """LoRA on every INT4 projection of the streamed Llama: gradients equal peft's on the decompressed transformers
    model; the adapter loads in peft; merge_lora's 16-bit export loads in transformers (fp32 asked: equal to
    peft's merge within 1e-5)."""
    from test_fp8_block import transformers_peft_merged
    _, ref, stores = int4("llama-tied")
    tokens, targets = batch()
    adapter, _ = check_lora(ref, stores["link"], tmp_path, tokens, targets, runs=(("disk", 1, "all"), ("ram", 0, "none")),
                            lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
    with torch.no_grad():
        expected = transformers_peft_merged(ref, adapter)(tokens).logits
    out = export(stores["link"], tmp_path / "merged", adapter, "hf", dtype=torch.float32, progress=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(merged(tokens).logits, expected) < 1e-5


@pytest.mark.usefixtures("ram_streams")
def test_lora_on_int4_experts_equals_peft_with_experts_read_routed_and_whole(int4, tmp_path):
    """LoRA on every routed expert of the linked Kimi-K2-Thinking-shaped store (INT4 experts, 16-bit attention):
    logits within 1e-5 of peft's on the decompressed model, every A and B gradient within 1e-4, streamed from disk
    and RAM, the experts' words and scales read routed (alone: checked) and whole."""
    _, ref, stores = int4("deepseek_v3")
    tokens, targets = few()
    adapter = tmp_path / "adapter"
    phantom_step(stores["link"], tokens, targets, adapter, offload="none")
    want = peft_step(ref, adapter, tokens, targets)
    for offload, prefetch, recompute, reads in (("disk", 0, "none", "routed"), ("ram", 1, "all", "whole")):
        got = phantom_step(stores["link"], tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute,
                           expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        assert_equals_peft(got, want, (offload, prefetch, recompute, reads), unhit=True)


def test_full_finetuning_is_refused_and_an_incomplete_weight_named(int4, tmp_path, capsys):
    stores = int4("llama-tied")[2]
    out = tmp_path / "out"
    code = script("finetune").main(["--model", str(stores["link"]), "--mode", "full", "--iters", "1", "--quiet",
                                    "--batch-size", "1", "--seq-len", "8", "--val-split", "0", "--out", str(out),
                                    "--data", str(__import__("pathlib").Path(phantom.__file__).parent / "assets" /
                                                  "tiny.txt")])
    check(capsys, code, tmp_path, "int4-group", "full finetuning", "LoRA")
    assert not (out / "store").exists()
    bad = tmp_path / "hf"
    shutil.copytree(stores["link"].parent / "hf", bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    code = script("prepare_model").main(["--src", str(bad), "--out", str(tmp_path / "s"), "--quiet"])
    check(capsys, code, tmp_path, "o_proj.weight_scale", "incomplete")


@pytest.mark.parametrize("change", [
    {"num_bits": 8}, {"symmetric": False}, {"strategy": "channel"}, {"group_size": 20}, {"actorder": "group"},
    {"dynamic": True}, {"type": "float"}])
def test_int4_configs_phantom_does_not_read_are_refused(change):
    qc = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                        "weights": {**WEIGHTS, **change}}},
          "format": "pack-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
          "quantization_status": "compressed"}
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 96,
         "max_position_embeddings": 64, "quantization_config": qc}
    with pytest.raises(ConfigError, match="quantization_config="):
        config_from_hf(c)
    assert config_from_hf({**c, "quantization_config": {**qc, "config_groups": {"group_0": {
        **qc["config_groups"]["group_0"], "weights": WEIGHTS}}}}).dim == 64


def test_the_cost_model_counts_the_stored_bytes(int4):
    """block_nbytes of the stores' formats are the bytes of their block files, and the profile measures their
    dequantization; Kimi-K2 1T's blocks as
    Kimi-K2-Thinking ships them (experts INT4, the rest bf16: tune.py --quantize int4-group) are 0.288x bf16: 4
    bits and a bf16 scale per 32 values are 4.5 bits (0.281x), the 16-bit attention and shared expert add 0.007x."""
    for name in MODELS:
        store = BlockStore(int4(name)[2]["copy"])
        for i in range(store.n_blocks):
            assert store.block_size(i) == block_nbytes(store.quant, block_tensor_shapes(store.cfg, i), "bfloat16")
        # the profile's dequantization rate, on a sparse block (the DeepSeek-V3's dense first one holds no INT4)
        assert profiles.measure_dequant(store, torch.device("cpu"), torch.float32, repeats=1) > 0
    cfg = PRESETS["kimi-k2-1T"]
    ratio = ci.shape_of(cfg, quant="int4-group").block_bytes / ci.shape_of(cfg).block_bytes
    assert 0.2812 < ratio < 0.29, ratio
