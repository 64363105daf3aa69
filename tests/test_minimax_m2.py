"""MiniMax-M2 beyond the shared checks of tests/test_families.py (logits streamed every way, LoRA on attention
against peft, the merged export, the full step with the routers' loss against AdamW):

- each feature of the family changes transformers' logits, so the shared checks see it: the q/k norms over the
  whole projections, RoPE over part of each head, the router's correction bias;
- LoRA on attention and the experts (peft's target_parameters) equals peft, resident and streamed with the
  experts read routed and whole;
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import pytest
import torch

from family_check import CASES, make
from phantom.arch.config import ConfigError
from phantom.arch.family import config_from_hf
from test_deepseek import differs, expert_models, zero
from test_moe_lora import assert_runs_equal_peft, expert_adapter, peft_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)


@pytest.mark.parametrize("change,edit", [
    (None, zero("e_score_correction_bias")),  # the correction bias moves the choice
    (dict(rotary_dim=24), None),  # RoPE over the whole head
    (None, zero("self_attn.k_norm.weight")),  # the norm over the whole k projection
])
def test_each_feature_changes_transformers_logits(change, edit):
    assert differs("minimax_m2", change, edit) > 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return expert_models(tmp_path_factory)


@pytest.mark.usefixtures("ram_streams")
def test_expert_lora_equals_peft_with_experts_read_routed_and_whole(models, tmp_path):
    model, store, tokens, targets, adapter, config = expert_adapter(models, "minimax_m2", tmp_path)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert_runs_equal_peft(store, tokens, targets, peft_step(model, adapter, tokens, targets))


def test_the_rotated_dims_are_read_from_rotary_dim_or_rope_parameters():
    c = make("minimax_m2").config.to_dict()
    assert config_from_hf(c).rope_dim == 12
    c.pop("rotary_dim")
    assert config_from_hf({**c, "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"}}).rope_dim == 24
    assert config_from_hf({**c, "rotary_dim": 6, "rope_parameters": None}).rope_dim == 6


def test_jitter_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="router_jitter_noise="):
        config_from_hf({**make("minimax_m2").config.to_dict(), "router_jitter_noise": 0.1})
    assert CASES["minimax_m2"].facts["router_bias"]
