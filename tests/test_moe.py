"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral with a sliding window, OLMoE
with q/k norms over the whole projection) against transformers' own classes: what the experts add to the
shared checks of tests/test_families.py (logits, LoRA on attention against peft, the full step with the
router loss against AdamW, all streamed).

Tiny random models saved by save_pretrained (one tensor per expert and projection) and, written from
their state_dict, transformers 5's fused 3-D expert tensors, both converted by scripts/prepare_model.py
to the same store; each expert's bytes lie back to back where the manifest says.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import phantom
from family_check import (CASES, batch, check_converts_to, check_logits, check_quantized, cross_entropy, make, prepare,
                          rel_err, save_fused, synthetic_preset_loss, transformers)
from phantom.arch.config import ModelConfig
from phantom.arch.presets import PRESETS
from phantom.export.export import export
from phantom.arch.moe import load_balancing_loss, mix, route
from phantom.files.store import BlockStore
from phantom.files.tensorfile import read_header

MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]  # their tiny models: family_check.CASES


def test_the_experts_and_the_shared_expert_matter(family_models):
    """Each part the shared checks compare changes the logits: the routing (k), the shared expert's gate,
    Mixtral's window, OLMoE's whole-projection q norm."""
    tokens, _ = batch()
    for name, change in (("qwen3_moe", dict(num_experts_per_tok=1)), ("mixtral", dict(sliding_window=None)),
                         ("qwen2_moe", None), ("olmoe", None)):
        model, _ = family_models(name)
        other = make(name, **(change or {}))
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            for pname, p in other.named_parameters():
                if change is None and ("shared_expert_gate" in pname or "q_norm" in pname):
                    p.fill_(1.0 if "norm" in pname else -30.0)
            assert rel_err(other(tokens).logits, model(tokens).logits) > 1e-3, name


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("link", [False, True])
def test_the_fused_expert_layout_converts_to_the_same_model(family_models, name, link, tmp_path):
    """Both checkpoint layouts give the same store; with --link each expert's gate, up and down are read in
    place, as rows of the 3-D tensors, and nothing is copied (q and k keep the RoPE halves they ship in)."""
    model, store = family_models(name)
    save_fused(model, tmp_path / "hf")
    check_converts_to(tmp_path / "hf", store, tmp_path / "store", link)
    if link:
        linked = json.loads((tmp_path / "store" / "manifest.json").read_text())["links"]["files"]
        copied = {t["name"] for t in linked["blocks/000.safetensors"]["tensors"] if ".local." in t["file"]}
        assert copied == set()
        written = json.loads((store / "manifest.json").read_text())["files"]["blocks/000.safetensors"]["experts"]
        assert linked["blocks/000.safetensors"]["experts"] == written  # the same ranges of the same bytes
        check_logits(model, tmp_path / "store", *batch(), runs=[("disk", 1, "all")])


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_each_expert_is_one_byte_range_the_manifest_records(family_models, name):
    """The manifest's range of expert e holds its gate, down and up weights, back to back, as the
    transformers model has them."""
    model, store = family_models(name)
    cfg = BlockStore(store).cfg
    entry = json.loads((store / "manifest.json").read_text())["files"]["blocks/001.safetensors"]
    _, start = read_header(store / "blocks" / "001.safetensors")
    raw = (store / "blocks" / "001.safetensors").read_bytes()
    experts = dict(model.named_parameters())
    gate_up = experts["model.layers.1.mlp.experts.gate_up_proj"].detach()
    down = experts["model.layers.1.mlp.experts.down_proj"].detach()
    assert len(entry["experts"]) == cfg.n_experts
    for e, (a, b) in enumerate(entry["experts"]):
        got = torch.frombuffer(bytearray(raw[start + a:start + b]), dtype=torch.float32)
        w1, w3 = gate_up[e].split(cfg.expert_dim)
        assert torch.equal(got, torch.cat([w1.flatten(), down[e].flatten(), w3.flatten()]))


@pytest.mark.parametrize("name", MOE)
def test_the_export_loads_in_transformers_with_equal_logits(family_models, name, tmp_path):
    model, store = family_models(name)
    out = export(store, tmp_path / "hf", None, "hf", progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == CASES[name].hf_class
    tokens, _ = batch()
    with torch.no_grad():
        assert rel_err(back(tokens).logits, model(tokens).logits) < 1e-5


def test_grouped_experts_equal_a_loop_over_tokens():
    """mix groups tokens by expert; the sum it computes is, token by token, sum_j w_j * expert_j(x)."""
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
    x = torch.randn(11, 8)
    weights, chosen = route(torch.randn(11, 5), 2, renormalise=False)
    want = torch.stack([sum(weights[t, j] * experts[int(chosen[t, j])](x[t]) for j in range(2)) for t in range(11)])
    torch.testing.assert_close(mix(x, weights, chosen, experts), want)


def test_the_router_loss_is_transformers_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    logits = [torch.randn(13, 8), torch.randn(13, 8)]
    torch.testing.assert_close(load_balancing_loss(logits, 8, 3), load_balancing_loss_func(tuple(logits), 8, 3))


@pytest.mark.parametrize("name", ["qwen3-30B-A3B", "mixtral-8x7B", "olmoe-1B-7B"])
def test_a_synthetic_store_of_a_moe_preset_shape_streams(name, tmp_path):
    import math
    loss = synthetic_preset_loss(name, tmp_path, n_layers=2, n_experts=6, experts_per_token=2, expert_dim=32)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(97)) < 1.0


def test_moe_config_checks():
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=10, n_experts=4, experts_per_token=5, expert_dim=8)


def test_the_router_loss_is_in_the_loss_and_moves_the_routers(family_models):
    """The loss phantom returns in full mode is cross-entropy + coef * aux as transformers computes it; with
    a coefficient of 0 the routers' gradients differ (the term is not a no-op)."""
    _, store = family_models("qwen3_moe")
    model = make("qwen3_moe")  # as stored (a full step may have moved the shared one)
    tokens, targets = batch()
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    want = cross_entropy(out.logits, targets) + model.config.router_aux_loss_coef * out.aux_loss
    grads = {}
    for coef in (None, 0.0):
        with phantom.load(store, mode="full", offload="none", optim=phantom.AdamWConfig()) as pm:
            if coef is not None:
                pm.cfg = dataclasses.replace(pm.cfg, router_aux_coef=coef)
            loss = pm(tokens, targets=targets)
            loss.backward()
            grads[coef] = pm.layers[0].feed_forward.gate.weight.grad.clone()
            if coef is None:
                torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=0)
    assert rel_err(grads[0.0], grads[None]) > 1e-3


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_quantized_moe_store_streams_its_dequantized_experts(family_models, method, tmp_path):
    """NF4 and int8 experts (routers kept 16-bit): the streamed quantized model's logits equal transformers'
    on the weights the store dequantizes to (its --format hf export), from disk and RAM; LoRA on it runs."""
    _, store = family_models("qwen2_moe")
    quantized = check_quantized(store, tmp_path, method)
    record = json.loads((quantized / "manifest.json").read_text())["quantization"]["tensors"]
    assert record["feed_forward.gate.weight"] == record["feed_forward.shared_expert_gate.weight"] == "bfloat16"
    assert record["feed_forward.experts.3.w2.weight"] == method
    tokens, targets = batch()
    with phantom.load(quantized, offload="disk", lora=phantom.LoraConfig(targets=("q", "v"))) as pm:
        pm(tokens, targets=targets).backward()
        assert all(p.grad is not None for p in pm.trainable_parameters())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss"])
def test_greedy_generation_equals_transformers_generate(family_models, name):
    """Through the KV cache (latent attention's: each token's latent and rotated key), a token at a time (one or few
    tokens routed per step), past Mixtral's and gpt-oss's windows (gpt-oss: its sinks beside the cached keys)."""
    from phantom.model.generate import generate
    _, store = family_models(name)
    model = make(name)
    prompt = batch(b=1, t=6)[0]
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm:
        got = list(generate(pm, prompt[0].tolist(), max_new_tokens=24, temperature=0.0))
    assert got == want[0, 6:].tolist()


def test_the_cost_model_counts_the_flops_of_the_routed_experts(family_models):
    """flops_per_row's matmul term is 2 x the weights a token runs through (experts_per_token of the experts):
    torch's FLOP counter on transformers' own forward of the tiny Qwen3-MoE (its blocks, attention's
    scores and values excluded) agrees within 2% (the norms' weights count too); Qwen3-30B-A3B runs 3.3B of
    its 30.5B weights a token, as its card says."""
    from torch.utils.flop_counter import FlopCounterMode
    from phantom.plan import costinputs as ci
    _, store = family_models("qwen3_moe")
    cfg = BlockStore(store).cfg
    model = make("qwen3_moe")  # reconfigured below: not the shared one
    model.config._experts_implementation = "eager"  # its loop of matmuls (the counter misses grouped_mm)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.layers[0].mlp(torch.randn(1, 32, cfg.dim))
    mlp = counter.get_total_flops()
    attention = 2 * 32 * (cfg.q_dim * cfg.dim * 2 + 2 * cfg.kv_heads * cfg.head_dim * cfg.dim)
    predicted = ci.shape_of(cfg, "fp32", "fp32", seq_len=32).flops_per_row - 2 * 32 * 32 * cfg.q_dim
    assert abs(predicted - (mlp + attention)) < 0.02 * (mlp + attention)
    big = PRESETS["qwen3-30B-A3B"]
    active = big.n_layers * big.active_block_params() + 2 * big.vocab_size * big.dim
    assert abs(active / 1e9 - 3.3) < 0.1 and big.n_params() / active > 9


@pytest.mark.parametrize("name,fields", [
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16)),  # every layer slides
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),  # layer 0 of 2 slides
])
def test_the_qwen_moe_windows_follow_their_config_classes(name, fields, tmp_path):
    model = make(name, **fields)
    store = prepare(model, tmp_path)
    cfg = BlockStore(store).cfg
    assert [cfg.window(i) for i in range(2)] == ([16, 16] if name == "qwen3_moe" else [16, None])
    check_logits(model, store, *batch(), runs=[("disk", 1, "all")])
