"""MXFP4 (gpt-oss's experts): the codec against transformers' own dequantization, and mxfp4 stores of a mixture of
experts (the routed experts in MXFP4, the rest bf16, as gpt-oss ships them): what they hold, each expert's blocks and
scales one byte range read routed, and the cost model's bytes.

- phantom's dequantized values equal transformers' convert_moe_packed_tensors (the Mxfp4Config(dequantize=True)
  path) bit for bit, in fp32 and bf16, over every byte value and scales from 2^-127 to 2^127;
- a synthetic mxfp4 store's experts are near its bf16 twin's, its attention equal, each expert one byte range; its
  block files hold block_nbytes;
- gpt-oss as the Hub ships it (tests/mxfp4_checkpoint.py), prepared copied and linked: each expert's weights equal
  transformers' Mxfp4Config(dequantize=True) load bit for bit, logits within 1e-5 from disk and RAM with the
  experts read routed and whole, LoRA on attention and the experts equal to peft's within 1e-4, the merged 16-bit
  export loads in transformers; the store keeps the shipped bytes; a config saying MXFP4 over 16-bit weights is
  refused in one line.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import phantom
from phantom.arch import quant
from phantom.arch.config import block_tensor_shapes
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import QuantFormat, as_format, block_nbytes
from phantom.files.store import BlockStore
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from conftest import need
from family_check import batch, rel_err
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

CFG = dataclasses.replace(PRESETS["qwen3-30B-A3B"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=16,
                          vocab_size=97, intermediate_size=96, max_seq_len=64, n_experts=6, experts_per_token=2,
                          expert_dim=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_values_equal_transformers_bit_for_bit(dtype):
    need("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 40, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    blocks[0, 0, :, :] = torch.arange(256, dtype=torch.uint8).view(-1, 16)[:groups]  # every byte value
    blocks[0, 1, :, :] = torch.arange(256, dtype=torch.uint8).view(-1, 16)[-groups:]
    scales = torch.randint(110, 140, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales[1, 0] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)  # 2^-127 (subnormal in fp32) .. 2^127
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # (experts, columns, rows)
    fmt = QuantFormat("mxfp4")
    for e in range(experts):
        ours = quant.dequantize_into(fmt, {"blocks": blocks[e], "scales": scales[e]},
                                     torch.empty(rows, groups * 32, dtype=dtype))
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs[e].T.contiguous().view(ours.view(torch.int16 if dtype == torch.bfloat16 else
                                                                   torch.int32).dtype)), e


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    dense = write_synthetic(root / "bf16", CFG, torch.bfloat16, progress=False)
    fmt = as_format("mxfp4")
    return dense, write_synthetic(root / "mxfp4", CFG, torch.bfloat16, progress=False, quant=fmt)


def test_a_synthetic_mxfp4_store_holds_its_weights_and_an_expert_is_one_range(stores):
    dense, mx = BlockStore(stores[0]), BlockStore(stores[1])
    assert mx.quant.method == "mxfp4" and mx.quant.experts_only
    for i in range(mx.n_blocks):
        assert mx.block_size(i) == block_nbytes(mx.quant, block_tensor_shapes(mx.cfg, i), "bfloat16")
        assert len(mx.blocks[i].experts) == CFG.n_experts  # each expert's blocks and scales: one byte range
        names = [s.name for s in mx.blocks[i].specs]
        assert any(n.endswith(".blocks") for n in names) and not any("attention" in n and n.endswith(".blocks")
                                                                      for n in names)
        a, b = mx.load_block(i, torch.float32), dense.load_block(i, torch.float32)
        for k, v in b.items():
            err = ((a[k] - v).abs().mean() / v.abs().mean()).item()
            assert err < (0.15 if ".experts." in k else 1e-6), (k, err)
    ratio = ci.shape_of(PRESETS["qwen3-235B-A22B"], quant="mxfp4").block_bytes / \
        ci.shape_of(PRESETS["qwen3-235B-A22B"]).block_bytes
    assert 0.2656 < ratio < 0.29, ratio  # 4.25 bits a routed expert's value, attention bf16


# ---------------------------------------------------------------------------------------------
# gpt-oss as the Hub ships it: experts in MXFP4 (tests/mxfp4_checkpoint.py), against transformers' own dequantized
# load (Mxfp4Config(dequantize=True)) of the same folder

@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(shipped tensors, transformers' dequantized load, {"copy": store, "link": store})."""
    transformers = need("transformers")
    from family_check import make
    from mxfp4_checkpoint import write_mxfp4
    from test_convert import load_script
    from test_export_hf import llama3_style_tokenizer_json
    root = tmp_path_factory.mktemp("gptoss-mxfp4")
    shipped = write_mxfp4(make("gpt_oss"), root / "hf")
    llama3_style_tokenizer_json(root / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        root / "hf", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    stores = {}
    for kind in ("copy", "link"):
        args = ["--src", str(root / "hf"), "--out", str(root / kind), "--quiet"] + (["--link"] if kind == "link" else [])
        assert load_script("prepare_model").main(args) == 0
        stores[kind] = root / kind
    return shipped, ref, stores


def test_gpt_oss_experts_are_transformers_dequantized_weights_bit_for_bit(gptoss):
    """Each expert's gate, up and down, dequantized from the store (copied and linked) into fp32, equal the
    weights transformers' Mxfp4Config(dequantize=True) load holds: gate and up its alternating columns, turned."""
    _, ref, stores = gptoss
    for kind, path in stores.items():
        store = BlockStore(path)
        assert store.quant.method == "mxfp4" and "attention.wq.weight" in store.quant.unquantized
        for i in range(store.n_blocks):
            dense, experts = store.load_block(i, torch.float32), ref.model.layers[i].mlp.experts
            for e in range(store.cfg.n_experts):
                gate_up, down = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()
                for w, theirs in (("w1", gate_up[:, 0::2]), ("w3", gate_up[:, 1::2]), ("w2", down)):
                    assert torch.equal(dense[f"feed_forward.experts.{e}.{w}.weight"], theirs.T), (kind, i, e, w)


def test_gpt_oss_logits_equal_transformers_dequantized_load_from_disk_and_ram(gptoss):
    _, ref, stores = gptoss
    tokens, _ = batch()
    with torch.no_grad():
        expected = ref(tokens).logits
    for kind, path in stores.items():
        store = BlockStore(path)
        assert all(len(store.blocks[i].experts) == store.cfg.n_experts for i in range(store.n_blocks)), kind
        for offload, reads in [(o, r) for o in ("disk", "ram") for r in ("routed", "whole")][:4 if kind == "link" else 1]:
            with phantom.load(path, offload=offload, prefetch=1, lora=None, dtype=torch.float32, expert_reads=reads,
                              micro_batch=1 if reads == "routed" else None) as pm, torch.no_grad():
                assert rel_err(pm(tokens), expected) < 1e-5, (kind, offload, reads)


def test_gpt_oss_store_keeps_the_shipped_bytes_and_links_every_expert(gptoss):
    """The blocks and scales take their shipped bytes; a linked store reads each expert's down_proj rows and its
    gate_up_proj rows (gate and up alternating, kept so: the format's gate_up, w13) in place, copying none."""
    shipped, _, stores = gptoss
    mx = sum(v.numel() for k, v in shipped.items() if k.endswith(("_blocks", "_scales")))
    copy = BlockStore(stores["copy"])
    assert sum(s.end - s.start for b in copy.blocks for s in b.specs if s.name.endswith((".blocks", ".scales"))) == mx
    linked = json.loads((stores["link"] / "manifest.json").read_text())["links"]["files"]
    parts = [t for f in linked.values() for t in f["tensors"] if t["name"].endswith((".blocks", ".scales"))]
    in_place = [t for t in parts if t["file"].startswith("/") and "model-0000" in t["file"]]
    assert copy.quant.gate_up and {t["name"].split(".")[3] for t in in_place} == {"w13", "w2"}
    assert len(in_place) == len(parts) == 4 * copy.cfg.n_experts * copy.n_blocks


@pytest.mark.usefixtures("ram_streams")
def test_lora_on_gpt_oss_mxfp4_experts_equals_peft_and_the_merged_export_loads(gptoss, tmp_path):
    """LoRA on attention and every MXFP4 expert of the linked store: logits within 1e-5 of peft's on transformers'
    dequantized load, every A and B gradient within 1e-4, streamed with the experts read routed and whole; the
    merged 16-bit export loads in transformers with peft's merged logits."""
    from family_check import peft, peft_step, transformers
    from phantom.export.export import export
    from test_moe_lora import assert_equals_peft, few, phantom_step
    _, ref, stores = gptoss
    tokens, targets = few()
    adapter = tmp_path / "adapter"
    phantom_step(stores["link"], tokens, targets, adapter, offload="none")
    want = peft_step(ref, adapter, tokens, targets)
    for offload, prefetch, recompute, reads in (("disk", 0, "none", "routed"), ("ram", 1, "all", "whole")):
        got = phantom_step(stores["link"], tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute,
                           expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        assert_equals_peft(got, want, (offload, prefetch, recompute, reads), unhit=True)
    merged_ref = peft.PeftModel.from_pretrained(copy.deepcopy(ref), adapter).merge_and_unload().eval()
    out = export(stores["link"], tmp_path / "hf", adapter, "hf", dtype=torch.float32, progress=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(merged(tokens).logits, merged_ref(tokens).logits) < 1e-5


def test_a_config_saying_mxfp4_over_16_bit_weights_is_refused_in_one_line(tmp_path, capsys):
    from family_check import make
    from test_bad_inputs import check, script
    make("llama-tied").save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code = script("prepare_model").main(["--src", str(tmp_path / "hf"), "--out", str(tmp_path / "s"), "--quiet"])
    check(capsys, code, tmp_path, "MXFP4", "no weight")
    assert not (tmp_path / "s").exists()
