"""Mistral with its sliding window, against transformers' MistralForCausalLM (tests/family_check.py).

Rows of 40 tokens under a window of 16: every query past position 15 sees only its last 16 keys.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from family_check import (batch, check_full_step, check_logits, check_lora, check_merged_export, hf_model, prepare,
                          rel_err)
from phantom.model.generate import next_logits
from phantom.arch.layers import KVCache, attention_mask

FIELDS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              sliding_window=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model = hf_model("MistralConfig", **FIELDS)
    return model, prepare(model, tmp_path_factory.mktemp("mistral"))


def test_the_window_changes_the_logits_where_it_is_checked(mistral):
    """Past the window the logits differ from plain causal attention's: the checks below could fail."""
    model, store = mistral
    unwindowed = hf_model("MistralConfig", **{**FIELDS, "sliding_window": None})
    unwindowed.load_state_dict(model.state_dict())
    tokens, _ = batch()
    with torch.no_grad():
        a, b = model(tokens).logits, unwindowed(tokens).logits
    assert rel_err(a[:, :16], b[:, :16]) < 1e-6  # inside the window: the same
    assert rel_err(a[:, 16:], b[:, 16:]) > 0.05


def test_logits_and_loss_match_transformers_streamed_every_way(mistral):
    model, store = mistral
    tokens, targets = batch()
    check_logits(model, store, tokens, targets)


def test_lora_matches_peft_and_the_merged_export_loads(mistral, tmp_path):
    model, store = mistral
    tokens, targets = batch()
    adapter, logits = check_lora(model, store, tmp_path, tokens, targets)
    check_merged_export(store, adapter, tmp_path, tokens, logits, "MistralForCausalLM")


def test_full_step_matches_adamw_resident_and_streamed(mistral, tmp_path):
    model, store = mistral
    check_full_step(model, store, *batch())
    check_full_step(hf_model("MistralConfig", **FIELDS), store, *batch(), work_dir=tmp_path / "work")


def test_cached_decoding_keeps_the_window(mistral):
    """Token by token through the KV cache past the window gives the full forward's logits."""
    _, store = mistral
    tokens, _ = batch(b=1, t=30)
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm, torch.no_grad():
        full = pm(tokens)
        caches = [KVCache.empty(pm.cfg, 1, 30) for _ in range(pm.cfg.n_layers)]
        stepped = [next_logits(pm, tokens[:, :8], caches, 0)]
        stepped += [next_logits(pm, tokens[:, p:p + 1], caches, p) for p in range(8, 30)]
    assert rel_err(torch.stack(stepped, 1), full[:, 7:]) < 1e-5


def test_attention_mask_of_a_window():
    m = attention_mask(3, 4, 3)  # queries at 4, 5, 6 over keys 0..6, each sees 3 keys
    assert m.tolist() == [[False, False, True, True, True, False, False],
                          [False, False, False, True, True, True, False],
                          [False, False, False, False, True, True, True]]
    assert attention_mask(5, 0, 8) is None and attention_mask(5, 0, None) is None  # plain causal: sdpa's own
