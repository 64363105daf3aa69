"""Qwen2 / Qwen2.5 (biases on q, k, v) and tied embeddings (Qwen2.5's small models, Llama-3.2 1B/3B), against
transformers' own classes (tests/family_check.py). A tied table is one parameter: the embedding's and the
head's gradients add up in it, and full finetuning updates it once.
"""
from __future__ import annotations

import json

import pytest

from family_check import (batch, check_full_step, check_logits, check_lora, check_merged_export, hf_model,
                          model_stores)
from phantom.files.store import BlockStore

SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
CASES = {  # name -> (config class, fields, the family's class)
    "qwen2": ("Qwen2Config", dict(SHAPES, tie_word_embeddings=False), "Qwen2ForCausalLM"),
    "qwen2-tied": ("Qwen2Config", dict(SHAPES, tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "llama-tied": ("LlamaConfig", dict(SHAPES, tie_word_embeddings=True, rope_theta=500000.0), "LlamaForCausalLM"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_stores(tmp_path_factory, lambda name: hf_model(CASES[name][0], **CASES[name][1]))


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
    fresh = hf_model(CASES[name][0], **CASES[name][1])  # the step above moved the shared model
    check_full_step(fresh, store, *batch(), work_dir=tmp_path / "work")


def test_a_tied_model_keeps_one_table_and_links_it(models):
    model, store = models("qwen2-tied", link=True)
    s = BlockStore(store)
    assert s.cfg.tie_embeddings and set(s.load_head()) == {"norm.weight"}
    manifest = json.loads((store / "manifest.json").read_text())
    assert "embed.safetensors" in json.dumps(manifest.get("links", {}))  # read in place, not copied
    check_logits(model, store, *batch(), runs=[("disk", 1, "all")])
