"""Mistral's sliding window (the shared checks against MistralForCausalLM: tests/test_families.py).

Rows of 40 tokens under a window of 16: every query past position 15 sees only its last 16 keys.
"""
from __future__ import annotations

import torch

import phantom
from family_check import batch, make, rel_err
from phantom.model.generate import next_logits
from phantom.arch.ops import KVCache, attention_mask


def test_the_window_changes_the_logits_where_it_is_checked(family_models):
    """Past the window the logits differ from plain causal attention's: the shared checks could fail."""
    model, _ = family_models("mistral")
    unwindowed = make("mistral", sliding_window=None)
    unwindowed.load_state_dict(model.state_dict())
    tokens, _ = batch()
    with torch.no_grad():
        a, b = model(tokens).logits, unwindowed(tokens).logits
    assert rel_err(a[:, :16], b[:, :16]) < 1e-6  # inside the window: the same
    assert rel_err(a[:, 16:], b[:, 16:]) > 0.05


def test_cached_decoding_keeps_the_window(family_models):
    """Token by token through the KV cache past the window gives the full forward's logits."""
    _, store = family_models("mistral")
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
