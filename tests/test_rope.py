"""RoPE scaling types of the released checkpoints, against transformers: llama3 (Llama-3.1/3.2), linear
(Gemma-3's global layers; any family), yarn (Qwen2.5's long-context configs), each on 40-token rows past
an original context of 16 where the scaling changes the angles. Types phantom does not compute (dynamic
NTK, whose angles change with each batch's length; longrope outside Phi-3, tests/test_phi3.py) are refused
naming the type.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.arch.family import ConfigError, config_from_hf
from family_check import SHAPES, batch, check_lora, hf_model, prepare, rel_err

SCALINGS = {
    "llama3": ("LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}),
    "linear": ("LlamaConfig", {"rope_type": "linear", "factor": 4.0}),
    "yarn": ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-attention-factor": ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                              "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2}),
}


def model_with(name: str, scaled: bool = True):
    config_class, rope = SCALINGS[name]
    params = {**rope, "rope_theta": 10000.0} if scaled else {"rope_type": "default", "rope_theta": 10000.0}
    return hf_model(config_class, **SHAPES, rope_theta=10000.0, rope_parameters=params)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_matches_transformers_past_the_original_context(name, tmp_path):
    model = model_with(name)
    unscaled = model_with(name, scaled=False)
    unscaled.load_state_dict(model.state_dict())
    tokens, targets = batch()
    with torch.no_grad():
        ref, plain = model(tokens).logits, unscaled(tokens).logits
    assert rel_err(ref[:, 16:], plain[:, 16:]) > 1e-2  # the scaling matters where it is checked
    store = prepare(model, tmp_path)
    for offload in ("none", "disk"):
        with phantom.load(store, offload=offload, lora=None, prefetch=1) as pm, torch.no_grad():
            assert rel_err(pm(tokens), ref) < 1e-5, offload
    check_lora(model, store, tmp_path, tokens, targets, runs=[("disk", 0, "all")])


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_other_rope_types_are_refused_naming_the_type(kind):
    c = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100, "rope_scaling": {"rope_type": kind, "factor": 2.0}}
    with pytest.raises(ConfigError, match=f'rope_type="{kind}".*supported: .default., .llama3., .linear., .yarn.'):
        config_from_hf(c)
