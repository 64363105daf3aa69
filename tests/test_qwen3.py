"""Qwen3 dense (RMSNorm over each head of q and k before RoPE, an explicit head_dim wider than
hidden_size / heads), against transformers' Qwen3ForCausalLM (tests/family_check.py). The small
Qwen3 checkpoints tie their embeddings: checked tied here.
"""
from __future__ import annotations

import pytest
import torch

from family_check import (batch, check_full_step, check_logits, check_lora, check_merged_export, hf_model, prepare,
                          rel_err)

FIELDS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=1000000.0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = hf_model("Qwen3Config", **FIELDS)
    return model, prepare(model, tmp_path_factory.mktemp("qwen3"))


def test_the_qk_norms_matter(qwen3):
    """q/k norm weights that are not all ones change the logits: the checks below could fail."""
    model, _ = qwen3
    other = hf_model("Qwen3Config", **FIELDS)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.fill_(1.0)
        tokens, _ = batch()
        assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-2


def test_logits_and_loss_match_transformers_streamed_every_way(qwen3):
    model, store = qwen3
    check_logits(model, store, *batch())


def test_lora_matches_peft_and_the_merged_export_loads(qwen3, tmp_path):
    model, store = qwen3
    tokens, targets = batch()
    adapter, logits = check_lora(model, store, tmp_path, tokens, targets)
    check_merged_export(store, adapter, tmp_path, tokens, logits, "Qwen3ForCausalLM")


def test_full_step_matches_adamw_resident_and_streamed(qwen3, tmp_path):
    model, store = qwen3
    check_full_step(model, store, *batch())
    check_full_step(hf_model("Qwen3Config", **FIELDS), store, *batch(), work_dir=tmp_path / "work")


def test_qwen3_with_biases_and_untied(tmp_path):
    model = hf_model("Qwen3Config", **{**FIELDS, "attention_bias": True, "tie_word_embeddings": False})
    store = prepare(model, tmp_path)
    check_logits(model, store, *batch(), runs=[("disk", 2, "all"), ("ram", 0, "none")])
