"""Gemma-2 and Gemma-3: what the shared checks (tests/test_families.py) compare with transformers'
Gemma2ForCausalLM and Gemma3ForCausalLM matters there. Embeddings times sqrt(dim), the (1 + w) RMSNorm,
norms after attention and MLP as well as before, a GELU-tanh MLP, query_pre_attn_scalar, local
sliding-window layers between global ones (rows of 40 tokens, window 16), Gemma-2's soft-capping of
scores and logits, Gemma-3's q/k norms and its two RoPE bases (the global one with linear scaling),
tied embeddings.
"""
from __future__ import annotations

import pytest
import torch

from family_check import batch, make, rel_err


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", None), ("final_logit_softcapping", None),
                                         ("sliding_window", 64), ("query_pre_attn_scalar", 32)])
def test_gemma2_fields_change_the_logits_where_they_are_checked(family_models, field, value):
    model, _ = family_models("gemma2")
    other = make("gemma2", **{field: value})
    other.load_state_dict(model.state_dict())
    tokens, _ = batch()
    with torch.no_grad():
        assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-3, field


def test_gemma3_rope_bases_and_scaling_change_the_logits(family_models):
    model, _ = family_models("gemma3")
    for rope in ({"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
                 {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}}):
        other = make("gemma3", rope_parameters=rope)
        other.load_state_dict(model.state_dict())
        tokens, _ = batch()
        with torch.no_grad():
            assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-3
