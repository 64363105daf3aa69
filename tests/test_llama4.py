"""Llama 4 (text) beyond the shared checks of tests/test_families.py (logits streamed every way, LoRA on attention
against peft, the merged export, the full step against AdamW):

- each feature of the family changes transformers' logits, so the shared checks see it: chunked attention, the
  q/k L2 norms, the attention temperature of the RoPE-less layers, which layers skip RoPE, the shared expert, the
  dense layers' own width, the experts' input scaled by the router;
- LoRA on attention and the experts (peft's target_parameters) equals peft, resident and streamed with the
  experts read routed and whole;
- the text of a Llama4ForConditionalGeneration checkpoint (the vision tower left out) gives the text model's logits;
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import json

import pytest
import torch

from family_check import CASES, batch, make, prepare, rel_err
from phantom.arch.config import ConfigError
from phantom.arch.family import config_from_hf
from test_deepseek import differs, expert_models, zero
from test_moe_lora import assert_runs_equal_peft, few, peft_step, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)


def scale_router(model):
    """The router's logits moved uniformly: the top-k stays, the sigmoid scale of each expert's input changes."""
    for n, p in model.named_parameters():
        if n.endswith("feed_forward.router.weight"):
            p.mul_(3.0)


@pytest.mark.parametrize("change,edit", [
    (dict(attention_chunk_size=64), None),  # layer 0 attends within chunks of 16 tokens
    (dict(use_qk_norm=False), None),  # the L2 norms of q and k on the RoPE layers
    (dict(attn_temperature_tuning=False), None),  # the RoPE-less layer's temperature by position
    (dict(no_rope_layers=[1, 1]), None),  # layer 1 without RoPE
    (None, zero("shared_expert.down_proj.weight")),  # the shared expert, always on
    (None, zero("layers.0.feed_forward.down_proj.weight")),  # the dense layer, intermediate_size_mlp wide
    (None, scale_router),  # the router's sigmoid scales each expert's input
])
def test_each_feature_changes_transformers_logits(change, edit):
    assert differs("llama4", change, edit) > 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return expert_models(tmp_path_factory)


@pytest.mark.usefixtures("ram_streams")
def test_expert_lora_equals_peft_with_experts_read_routed_and_whole(models, tmp_path):
    """LoRA on attention and every expert: logits within 1e-5 of peft's, every A and B gradient within 1e-4,
    resident and streamed from disk and RAM, experts read routed and whole; the adapter names the experts as
    peft's target_parameters under Llama 4's feed_forward."""
    model, store = models("llama4")
    tokens, targets = few()
    adapter = tmp_path / "adapter"
    phantom_step(store, tokens, targets, adapter, offload="none")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert_runs_equal_peft(store, tokens, targets, peft_step(model, adapter, tokens, targets))


def llama4_vl():
    """A tiny Llama4ForConditionalGeneration (a one-layer vision tower and its projector beside CASES' text model,
    whose weights it carries) and that text model."""
    import transformers
    text = make("llama4")
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=28, patch_size=14,
                                             vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=text.config.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    vl = transformers.Llama4ForConditionalGeneration(config).float().eval()
    vl.language_model.load_state_dict(text.state_dict())
    return vl, text


def test_the_text_of_the_vision_language_checkpoint_reads_as_the_text_model(tmp_path):
    """Llama4ForConditionalGeneration saved by transformers: phantom reads its text model (language_model.*),
    leaves the vision tower out, and computes the logits Llama4ForCausalLM computes from the same weights."""
    vl, text = llama4_vl()
    tokens, _ = batch()
    store = prepare(vl, tmp_path / "vl")
    import phantom
    with phantom.load(store, verify="none") as pm, torch.no_grad():
        got = pm(tokens)
    with torch.no_grad():
        ref = text(tokens).logits
    assert rel_err(got, ref) < 1e-5


def test_unmodelled_fields_are_refused_naming_the_field():
    c = make("llama4").config.to_dict()
    with pytest.raises(ConfigError, match="router_jitter_noise="):
        config_from_hf({**c, "router_jitter_noise": 0.1})
    assert CASES["llama4"].facts["n_experts"] == 4


def test_the_merged_export_with_expert_lora_equals_peft_merged_model(models, tmp_path):
    """The export adds each expert's delta to the (E, in, out) tensors: transformers loads it with the logits of
    peft's merge_and_unload of the same adapter."""
    import peft
    import transformers

    from phantom.export.export import export
    _, store = models("llama4")
    tokens, targets = few()
    phantom_step(store, tokens, targets, tmp_path / "adapter", offload="none")
    merged_ref = peft.PeftModel.from_pretrained(make("llama4"), tmp_path / "adapter").merge_and_unload().eval()
    out = export(store, tmp_path / "hf", tmp_path / "adapter", "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = merged_ref(tokens).logits, make("llama4")(tokens).logits
        assert rel_err(merged(tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3
