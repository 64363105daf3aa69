"""Gemma-2 and Gemma-3 text models against transformers' Gemma2ForCausalLM and Gemma3ForCausalLM
(tests/family_check.py): embeddings times sqrt(dim), the (1 + w) RMSNorm, norms after attention and
MLP as well as before, a GELU-tanh MLP, query_pre_attn_scalar, local sliding-window layers between
global ones (rows of 40 tokens, window 16), Gemma-2's soft-capping of scores and logits, Gemma-3's
q/k norms and its two RoPE bases (the global one with linear scaling), tied embeddings.
"""
from __future__ import annotations

import pytest
import torch

from family_check import (batch, check_full_step, check_logits, check_lora, check_merged_export, hf_model,
                          model_stores, rel_err)

SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, query_pre_attn_scalar=24, sliding_window=16, max_position_embeddings=64)
CASES = {  # name -> (config class, fields, the family's class)
    "gemma2": ("Gemma2Config", dict(SHAPES, attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
               "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", dict(SHAPES, layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
               "Gemma3ForCausalLM"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_stores(tmp_path_factory, lambda name: hf_model(CASES[name][0], **CASES[name][1]))


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", None), ("final_logit_softcapping", None),
                                         ("sliding_window", 64), ("query_pre_attn_scalar", 32)])
def test_gemma2_fields_change_the_logits_where_they_are_checked(models, field, value):
    model, _ = models("gemma2")
    other = hf_model("Gemma2Config", **{**CASES["gemma2"][1], field: value})
    other.load_state_dict(model.state_dict())
    tokens, _ = batch()
    with torch.no_grad():
        assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-3, field


def test_gemma3_rope_bases_and_scaling_change_the_logits(models):
    model, _ = models("gemma3")
    for rope in ({"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
                 {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}}):
        other = hf_model("Gemma3TextConfig", **{**CASES["gemma3"][1], "rope_parameters": rope})
        other.load_state_dict(model.state_dict())
        tokens, _ = batch()
        with torch.no_grad():
            assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_match_transformers_streamed_every_way(models, name):
    model, store = models(name)
    check_logits(model, store, *batch())


@pytest.mark.parametrize("name", list(CASES))
def test_lora_matches_peft_and_the_merged_export_loads(models, name, tmp_path):
    model, store = models(name)
    tokens, targets = batch()
    adapter, logits = check_lora(model, store, tmp_path, tokens, targets)
    check_merged_export(store, adapter, tmp_path, tokens, logits, CASES[name][2])


@pytest.mark.parametrize("name", list(CASES))
def test_full_step_matches_adamw_resident_and_streamed(models, name, tmp_path):
    model, store = models(name)
    check_full_step(model, store, *batch())
    check_full_step(hf_model(CASES[name][0], **CASES[name][1]), store, *batch(), work_dir=tmp_path / "work")
