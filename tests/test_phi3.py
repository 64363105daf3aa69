"""Phi-3 / Phi-4 (Phi3ForCausalLM): q, k, v fused in one qkv_proj and gate, up in one gate_up_proj in the
checkpoint (the shared checks against transformers' own class, Phi-3-mini's, Phi-4's and Phi-4-mini's
shapes: tests/test_families.py).

The store keeps the parts apart (back to back: a block still runs each group as one matmul), the
converter reads each part as its rows of the fused tensor (in place with --link where no permutation
is needed), the exporter stacks them again, and a LoRA on a fused module is peft's: one A for the
module, its B the parts' rows stacked.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

import phantom
from family_check import batch, check_logits, check_lora, check_merged_export, make, prepare, rel_err
from phantom.arch.config import ModelConfig
from phantom.arch.presets import preset
from phantom.arch.layers import LoraLinear, TransformerBlock, project
from phantom.model.lora import apply_lora, for_family
from phantom.export.export import export
from phantom.files.store import BlockStore


def test_a_linked_store_reads_unpermuted_parts_in_place(family_models):
    """q, k, v, gate and up are rows of the fused tensors, read where they lie: q and k keep the RoPE halves they
    ship in (the store's rope_interleave false), so no block tensor is copied."""
    model, store = family_models("phi4", link=True)
    linked = json.loads((store / "manifest.json").read_text())["links"]["files"]["blocks/000.safetensors"]["tensors"]
    assert not [t["name"] for t in linked if t["file"].endswith(".local.safetensors")]
    assert {t["name"] for t in linked} >= {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                                           "feed_forward.w1.weight", "feed_forward.w3.weight"}
    check_logits(model, store, *batch(), runs=[("disk", 1, "all")])


def test_q_and_v_on_phi3_is_its_qkv_proj_and_says_so(family_models, caplog):
    """peft has one LoRA on qkv_proj, so the default targets (q, v) become it, with a line saying k is in."""
    _, store = family_models("phi4")
    cfg = BlockStore(store).cfg
    with caplog.at_level(logging.INFO, logger="phantom.model.lora"):
        assert for_family(phantom.LoraConfig(), cfg).targets == ("qkv",)
    assert "covers k too" in caplog.text
    assert for_family(phantom.LoraConfig(targets=("all-linear",)), cfg).targets == ("qkv", "o", "gate_up", "down")
    llama = preset("tiny")
    assert for_family(phantom.LoraConfig(targets=("qkv", "o")), llama).targets == ("q", "k", "v", "o")


def test_the_parts_of_a_fused_lora_share_one_a_and_one_dropout_mask():
    """With dropout, peft drops x once for qkv_proj's LoRA: with equal B rows, q's, k's and v's updates
    must be equal (three masks would make them differ)."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=50, family="phi3")
    block = TransformerBlock(cfg)
    apply_lora(block, phantom.LoraConfig(rank=4, dropout=0.5, targets=("qkv",)), 0)
    att = block.attention
    assert isinstance(att.wq, LoraLinear) and att.wq.lora_A is att.wk.lora_A is att.wv.lora_A
    assert len([n for n, _ in block.named_parameters() if "lora_A" in n]) == 1
    for w in (att.wq, att.wk, att.wv):
        torch.nn.init.zeros_(w.weight)
        w.lora_B.data = torch.ones_like(w.lora_B)
    block.train()
    torch.manual_seed(0)
    q, k, v = project(torch.randn(3, 5, 32), [att.wq, att.wk, att.wv], None)
    assert rel_err(q, k) == 0 and rel_err(q, v) == 0
    assert q.abs().sum() > 0


LONGROPE = dict(max_position_embeddings=64, original_max_position_embeddings=16,  # Phi-4 with these
                rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                 "long_factor": [1.0 + 0.7 * i for i in range(8)]})


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    model = make("phi4", **LONGROPE)
    return model, prepare(model, tmp_path_factory.mktemp("longrope"))


@pytest.mark.parametrize("t", [12, 40])
def test_longrope_picks_short_or_long_factors_by_the_last_position_as_transformers_does(longrope, tmp_path, t):
    """Phi-3-*-128k and Phi-3.5's RoPE: short factors up to the original context (16 here), long ones past it,
    cos and sin scaled by sqrt(1 + ln(64/16) / ln 16); the top-level original_max_position_embeddings counts."""
    model, store = longrope
    cfg = BlockStore(store).cfg
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.rope_scaling.original_max_seq_len == 16
    tokens, targets = batch(t=t)
    check_logits(model, store, tokens, targets, runs=[("disk", 1, "all"), ("none", 0, "none")])
    if t == 40:
        adapter, logits = check_lora(model, store, tmp_path, tokens, targets, runs=[("disk", 1, "all")])
        check_merged_export(store, adapter, tmp_path, tokens, logits, "Phi3ForCausalLM")


def test_longrope_in_packed_rows_follows_the_longest_example(longrope):
    """A 40-token row of two 12-token examples and padding: each example is below the original context, so
    each gets the short factors, as each would alone in transformers."""
    model, store = longrope
    tokens, _ = batch(b=1, t=40)
    segments = torch.tensor([[0] * 12 + [1] * 12 + [2] * 16])
    with torch.no_grad():
        ref = [model(tokens[:, a:b]).logits for a, b in ((0, 12), (12, 24), (24, 40))]
        with phantom.load(store, offload="none", lora=None) as pm:
            out = pm(tokens, segments=segments)
    for (a, b), r in zip(((0, 12), (12, 24), (24, 40)), ref):
        assert rel_err(out[:, a:b], r) < 1e-5, (a, b)


def test_the_export_names_the_models_own_token_ids(tmp_path):
    """config.json carries the generation_config.json's bos/eos ids, not Phi3Config's defaults (1, 32000)."""
    model = make("phi4")
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 5, 7
    store = prepare(model, tmp_path)
    out = export(store, tmp_path / "out", None, "hf", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, 7)


def test_cached_generation_crossing_the_original_context_matches_transformers(longrope):
    """Greedy decoding from 10 tokens to 30: when the sequence first passes the original context of 16,
    transformers' Phi-3 drops the cache (keys turned by the short factors) and computes the whole sequence
    again with the long ones; phantom's KV-cached generation does the same."""
    from phantom.model.generate import generate
    model, store = longrope
    prompt = batch(b=1, t=10)[0]
    model.generation_config.update(eos_token_id=None, pad_token_id=None, bos_token_id=None)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)[0, 10:].tolist()
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm:
        ours = list(generate(pm, prompt[0].tolist(), max_new_tokens=20, temperature=0))
    assert ours == ref
