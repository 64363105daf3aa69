"""Qwen3 dense: RMSNorm over each head of q and k before RoPE, an explicit head_dim wider than
hidden_size / heads (the shared checks against Qwen3ForCausalLM: tests/test_families.py). The small
Qwen3 checkpoints tie their embeddings: checked tied there, untied with biases here.
"""
from __future__ import annotations

import torch

from family_check import batch, check_logits, make, prepare, rel_err


def test_the_qk_norms_matter(family_models):
    """q/k norm weights that are not all ones change the logits: the shared checks could fail."""
    model, _ = family_models("qwen3")
    other = make("qwen3")
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.fill_(1.0)
        tokens, _ = batch()
        assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-2


def test_qwen3_with_biases_and_untied(tmp_path):
    model = make("qwen3", attention_bias=True, tie_word_embeddings=False)
    store = prepare(model, tmp_path)
    check_logits(model, store, *batch(), runs=[("disk", 2, "all"), ("ram", 0, "none")])
