"""Dense layers among a mixture of experts' sparse ones (Qwen3-MoE's and Qwen2-MoE's mlp_only_layers and
decoder_sparse_step) against transformers' own classes, and quantized MoE stores' expert byte ranges.

Tiny random models of three layers saved by save_pretrained and converted by scripts/prepare_model.py: a
store then holds blocks of two tensor layouts (a dense MLP of intermediate_size, or the experts), each
block's own in its file; streamed from disk and RAM through slots sized for the largest block, the
logits and loss equal transformers', LoRA gradients equal peft's, the merged export loads in transformers.
"""
from __future__ import annotations

import json

import pytest
import torch

import phantom
from family_check import (MOE, SHAPES, batch, check_converts_to, check_full_step, check_logits, check_lora,
                          check_merged_export, check_quantized, hf_model, prepare, rel_err, save_fused)
from family_check import transformers
from phantom.arch.family import ConfigError, config_from_hf
from phantom.files.store import BlockStore
from phantom.files.tensorfile import read_header

LAYERS = dict(SHAPES, num_hidden_layers=3, num_experts=8, moe_intermediate_size=32)
DENSE_CASES = {  # name -> (config class, fields, the dense layers transformers builds)
    "qwen3_moe-mlp_only": ("Qwen3MoeConfig", dict(LAYERS, num_experts_per_tok=2, norm_topk_prob=True,
                                                  mlp_only_layers=[0]), (0,)),
    "qwen3_moe-step2": ("Qwen3MoeConfig", dict(LAYERS, num_experts_per_tok=2, decoder_sparse_step=2), (0, 2)),
    "qwen2_moe-mlp_only": ("Qwen2MoeConfig", dict(LAYERS, num_experts_per_tok=3, shared_expert_intermediate_size=48,
                                                  mlp_only_layers=[1]), (1,)),
}
HF_CLASS = {"Qwen3MoeConfig": "Qwen3MoeForCausalLM", "Qwen2MoeConfig": "Qwen2MoeForCausalLM"}


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            config_class, fields, _ = DENSE_CASES[name]
            model = hf_model(config_class, **fields)
            built[name] = model, prepare(model, tmp_path_factory.mktemp(name))
        return built[name]
    return get


def transformers_dense_layers(model) -> tuple[int, ...]:
    return tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_layers_among_sparse_ones_match_transformers_streamed(dense_models, name):
    """Each block is built with its own MLP: logits and loss within 1e-5 resident and streamed (disk and RAM,
    prefetch 0 and 2, recomputed or kept) through slots the size of the largest block."""
    model, store = dense_models(name)
    s = BlockStore(store)
    assert s.cfg.dense_layers == DENSE_CASES[name][2] == transformers_dense_layers(model)
    sizes = [s.block_size(i) for i in range(s.n_blocks)]
    assert s.block_nbytes == max(sizes) > min(sizes) and s.two_layouts
    assert set(s.load_block(s.cfg.dense_layers[0])) >= {"feed_forward.w1.weight", "feed_forward.w2.weight"}
    check_logits(model, store, *batch(), runs=MOE["runs"])


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_layers_lora_matches_peft_and_the_merged_export_loads(dense_models, name, tmp_path):
    model, store = dense_models(name)
    tokens, targets = batch()
    adapter, logits = check_lora(model, store, tmp_path, tokens, targets, runs=MOE["lora_runs"],
                                 lora_targets=MOE["lora_targets"])
    check_merged_export(store, adapter, tmp_path, tokens, logits, HF_CLASS[DENSE_CASES[name][0]])
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged["mlp_only_layers"] == list(DENSE_CASES[name][2]) and merged["decoder_sparse_step"] == 1


def test_the_ram_tier_holds_each_block_at_its_own_size(dense_models):
    """The RAM tier reads each block's own bytes (a dense block's fewer), and so do its loads."""
    model, store = dense_models("qwen3_moe-step2")
    s = BlockStore(store)
    tokens, _ = batch()
    with phantom.load(store, offload="ram", prefetch=1, lora=None) as pm:
        with torch.no_grad():
            pm(tokens)
        held = pm.scheduler.residency.held["ram"]
        assert [held.host(i).numel() for i in range(s.n_blocks)] == [s.block_size(i) for i in range(s.n_blocks)]


def small(config_class: str, **fields) -> dict:
    c = getattr(transformers, config_class)(**{**LAYERS, "vocab_size": 100, **fields}).to_dict()
    return {**c, "architectures": [HF_CLASS[config_class]]}


def test_mlp_only_layers_and_decoder_sparse_step_are_modelled():
    """Both fields, read as transformers' decoder layers read them; a layer that is not one is refused."""
    from phantom.arch.family import FAMILIES
    for family in ("qwen3_moe", "qwen2_moe"):  # in the field enumeration (tests/test_family_config.py): modelled
        assert {"mlp_only_layers", "decoder_sparse_step"} <= FAMILIES[family].modelled()
    assert config_from_hf(small("Qwen3MoeConfig", mlp_only_layers=[1, 2])).dense_layers == (1, 2)
    assert config_from_hf(small("Qwen2MoeConfig", decoder_sparse_step=3)).dense_layers == (0, 1)
    assert config_from_hf(small("Qwen2MoeConfig", decoder_sparse_step=2, mlp_only_layers=[1])).dense_layers == (0, 1, 2)
    assert config_from_hf(small("Qwen3MoeConfig")).dense_layers == ()
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        config_from_hf(small("Qwen3MoeConfig", mlp_only_layers=[3]))
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        config_from_hf(small("Qwen3MoeConfig", decoder_sparse_step=0))


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_quantized_store_with_dense_layers_equals_transformers_on_its_weights(dense_models, method, tmp_path):
    """NF4 / int8 copies of a store with dense layers: each block dequantized in its own layout, the
    streamed logits equal transformers' on the dequantized weights (the --format hf export)."""
    _, store = dense_models("qwen2_moe-mlp_only")
    check_quantized(store, tmp_path, method)


@pytest.mark.parametrize("method,double_quant", [("nf4", True), ("nf4", False), ("int8", True)])
def test_each_quantized_expert_is_one_byte_range_the_manifest_records(family_models, method, double_quant, tmp_path):
    """In an NF4 / int8 store each expert's codes, scales (and double-quantization parts) lie back to back:
    the manifest's [start, end) of expert e holds exactly those tensors' bytes, as safetensors reads them,
    and every tensor of the file stays aligned to its element size."""
    from safetensors import safe_open
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    _, store = family_models("qwen2_moe")
    fmt = QuantFormat(method, double_quant=double_quant)
    quantize_store(store, tmp_path / "q", fmt, dtype=torch.bfloat16, progress=False)
    path = tmp_path / "q" / "blocks" / "001.safetensors"
    entry = json.loads((tmp_path / "q" / "manifest.json").read_text())["files"]["blocks/001.safetensors"]
    specs, start = read_header(path)
    raw = path.read_bytes()[start:]
    assert all(s.start % s.dtype.itemsize == 0 for s in specs)
    assert len(entry["experts"]) == BlockStore(store).cfg.n_experts
    with safe_open(path, framework="pt") as f:
        for e, (a, b) in enumerate(entry["experts"]):
            mine = sorted((s for s in specs if s.name.startswith(f"feed_forward.experts.{e}.")), key=lambda s: s.start)
            parts = {s.name.rsplit(".", 1)[1] for s in mine}
            assert parts == ({"int8", "absmax"} if method == "int8" else
                             {"nf4", "absmax", "absmax2", "offset"} if double_quant else {"nf4", "absmax"})
            assert len(mine) == 3 * len(parts)  # gate, down and up, each in its parts
            want = b"".join(f.get_tensor(s.name).contiguous().view(torch.uint8).numpy().tobytes() for s in mine)
            assert raw[a:b] == want


def test_quantized_experts_that_cannot_stay_aligned_keep_the_size_order(tmp_path):
    """Experts 33 wide: an NF4 expert is 3291 bytes, which would leave the next one's fp32 scales unaligned;
    such a store keeps tensor_order's layout (aligned, no expert ranges) and reads as before."""
    from phantom.arch.presets import preset
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.synthetic import write_synthetic
    cfg = preset("qwen3-30B-A3B", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=16, vocab_size=64,
                 n_experts=4, experts_per_token=2, expert_dim=33, intermediate_size=96, dense_layers=(0,))
    out = write_synthetic(tmp_path / "q", cfg, torch.bfloat16, progress=False, quant=QuantFormat("nf4"))
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert "experts" not in files["blocks/001.safetensors"]
    s = BlockStore(out)
    assert all(sp.start % sp.dtype.itemsize == 0 for sp in s.blocks[1].specs)
    with phantom.load(out, offload="disk", lora=None, dtype=torch.float32) as pm:
        with torch.no_grad():
            assert torch.isfinite(pm(batch()[0] % 64)).all()


def test_the_cost_model_counts_each_blocks_own_bytes_and_flops(dense_models):
    """Where blocks differ, the cost model reads and computes the blocks' mean (bytes as the store's files
    hold them, weights a token runs through as transformers' layers have them) and sizes slots for the
    largest block."""
    from phantom.plan.costinputs import shape_of
    model, store = dense_models("qwen3_moe-step2")
    s = BlockStore(store)
    shape = shape_of(s.cfg, "fp32", "fp32", seq_len=16)
    assert shape.block_bytes == round(sum(s.block_size(i) for i in range(s.n_blocks)) / s.n_blocks)
    assert shape.sizes.stored == s.block_nbytes
    active = []
    for layer in model.model.layers:  # a sparse layer's token runs through k of its experts
        n = sum(p.numel() for p in layer.parameters())
        if hasattr(layer.mlp, "experts"):
            per_expert = sum(p.numel() for p in layer.mlp.experts.parameters()) // s.cfg.n_experts
            n -= (s.cfg.n_experts - s.cfg.experts_per_token) * per_expert
        active.append(n)
    attention = 2 * 16 * s.cfg.q_dim
    assert shape.flops_per_row == pytest.approx(16 * (2 * sum(active) / len(active) + attention))


@pytest.mark.parametrize("name", ["qwen3_moe-step2", "qwen2_moe-mlp_only"])
def test_dense_layers_full_step_matches_adamw_resident_and_streamed(dense_models, name, tmp_path):
    """One full step with the router loss (over the sparse layers' routers alone, as transformers collects
    them) equals torch.optim.AdamW on the transformers model, resident and streamed from disk."""
    _, store = dense_models(name)
    config_class, fields, _ = DENSE_CASES[name]
    check_full_step(hf_model(config_class, **fields), store, *batch())
    check_full_step(hf_model(config_class, **fields), store, *batch(), work_dir=tmp_path / "work")


@pytest.mark.parametrize("link", [False, True])
def test_the_fused_expert_layout_with_dense_layers_converts_to_the_same_store(dense_models, link, tmp_path):
    """transformers 5's 3-D expert tensors (its modules' state_dict) with layer 0 dense convert to the same
    blocks as save_pretrained's files; linked, each expert's range is the one the copied store records."""
    model, store = dense_models("qwen3_moe-mlp_only")
    state = model.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate_proj.weight" in state
    save_fused(model, tmp_path / "hf")
    check_converts_to(tmp_path / "hf", store, tmp_path / "store", link)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    files = manifest["links"]["files"] if link else manifest["files"]
    written = json.loads((store / "manifest.json").read_text())["files"]
    assert "experts" not in files["blocks/000.safetensors"]
    assert files["blocks/001.safetensors"]["experts"] == written["blocks/001.safetensors"]["experts"]
    if link:
        check_logits(model, tmp_path / "store", *batch(), runs=[("disk", 1, "all"), ("ram", 0, "none")])


def test_a_bf16_store_with_dense_layers_computed_in_fp32_equals_transformers_on_its_weights(dense_models, tmp_path):
    """A bf16 store computed in fp32: each load converts its block in its own layout (views of the slot's one
    fp32 buffer); the logits equal transformers' on the store's weights (its --format hf export in fp32)."""
    from phantom.convert.convert import convert_checkpoint
    from phantom.export.export import export
    _, store = dense_models("qwen3_moe-mlp_only")
    convert_checkpoint(store.parent / "hf", tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    out = export(tmp_path / "bf16", tmp_path / "hf", None, "hf", dtype=torch.float32, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, _ = batch()
    with torch.no_grad():
        ref = reference(tokens).logits
    for offload, prefetch in (("disk", 2), ("ram", 1)):
        with phantom.load(tmp_path / "bf16", offload=offload, prefetch=prefetch, lora=None,
                          dtype=torch.float32) as pm:
            with torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, offload


def test_a_quantized_moe_store_in_the_older_order_still_reads(family_models, monkeypatch, tmp_path):
    """Quantized stores written before their experts were grouped (element size first, no ranges in the
    manifest) read as ever: the same weights as a store of today's layout."""
    import phantom.files.tensorfile as tensorfile
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    _, store = family_models("qwen3_moe")
    quantize_store(store, tmp_path / "new", QuantFormat("nf4"), dtype=torch.bfloat16, progress=False)
    monkeypatch.setattr(tensorfile, "experts_together", lambda order, nbytes, itemsize: order)
    quantize_store(store, tmp_path / "old", QuantFormat("nf4"), dtype=torch.bfloat16, progress=False)
    old, new = BlockStore(tmp_path / "old"), BlockStore(tmp_path / "new")
    assert "experts" not in old.manifest["files"]["blocks/000.safetensors"]
    assert [s.name for s in old.blocks[0].specs] != [s.name for s in new.blocks[0].specs]
    for i in range(old.n_blocks):
        a, b = old.load_block(i), new.load_block(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens, _ = batch()
    with phantom.load(tmp_path / "old", offload="disk", lora=None) as pm, torch.no_grad():
        with phantom.load(tmp_path / "new", offload="disk", lora=None) as pn:
            assert torch.equal(pm(tokens), pn(tokens))


@pytest.mark.parametrize("kind", ["written", "linked", "nf4"])
def test_each_expert_has_its_own_crc32_and_a_read_of_it_alone_is_checked(family_models, kind, tmp_path):
    """The manifest keeps a crc32 of each expert's range (zlib's of those bytes) and of the rest of the data
    section, for copied, linked and quantized blocks: an expert read alone is checked by itself, a damaged
    byte in it named by the expert; the file counts as checked once every part has been."""
    import zlib
    from phantom.arch.quantformat import QuantFormat
    from phantom.files.tensorfile import StoreError
    from phantom.convert.quantstore import quantize_store
    _, store = family_models("qwen3_moe", link=kind == "linked")
    if kind == "nf4":
        store = quantize_store(store, tmp_path / "q", QuantFormat("nf4"), dtype=torch.bfloat16, progress=False)["out"]
    manifest = json.loads((store / "manifest.json").read_text())
    record = (manifest["links"]["files"] if kind == "linked" else manifest["files"])["blocks/001.safetensors"]
    s = BlockStore(store)
    data = torch.empty(s.block_size(1), dtype=torch.uint8)
    s.read_block_into(1, data)
    assert record["experts_crc32"] == [zlib.crc32(data[a:b].numpy().tobytes()) for a, b in record["experts"]]
    inside = torch.zeros(len(data), dtype=torch.bool)
    for a, b in record["experts"]:
        inside[a:b] = True
    assert record["experts_rest_crc32"] == zlib.crc32(data[~inside].numpy().tobytes())
    s = BlockStore(store)  # nothing checked yet
    entry = s.blocks[1]
    routed = torch.zeros_like(data)  # experts 2 and 5 alone, as a routed read leaves a slot
    ranges = [tuple(record["experts"][e]) for e in (2, 5)]
    for a, b in ranges:
        routed[a:b] = data[a:b]
    s.checks.check_pieces(entry, routed, ranges)
    assert s.checks.partial[str(entry.path)] == {2, 5} and s.checks.pending(entry)
    bad = routed.clone()
    bad[record["experts"][5][0] + 7] ^= 1
    with pytest.raises(StoreError, match="expert 5's bytes"):
        BlockStore(store).checks.check_pieces(entry, bad, ranges)
    s.checks.check_pieces(entry, data, [(0, len(data))])  # every part: the file is checked
    assert not s.checks.pending(entry)
