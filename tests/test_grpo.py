"""GRPO: each token's log-probability at a temperature, its entropy and the reference's, with the gradient of a loss
that is not linear in them, equal transformers + peft's; streamed from disk as resident.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.model.adapterfiles import read_adapter_config
from conftest import need, randomize_lora
from family_check import VOCAB, lora_grads, make, peft_grads, rel_err


def rollout_rows(seed: int = 0, b: int = 4, t: int = 20):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets[:, :8] = -100  # the prompt
    targets[1, 15:] = -100  # a completion that ended early
    return tokens, targets


def nonlinear(logps: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A clipped-ratio-like loss: exp and clamp of the log-probabilities, masked."""
    mask = (targets != -100).float()
    ratio = torch.exp(logps - logps.detach() * 0.5)
    return -(torch.minimum(ratio * 0.7, ratio.clamp(0.8, 1.2) * 0.7) * mask).sum() / mask.sum()


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_token_logps_entropy_and_their_gradients_equal_peft(family_models, tmp_path, offload):
    peft = need("peft")
    _, store = family_models("llama-tied")
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4, targets=("q", "v"))) as pm:
        randomize_lora(pm, seed=3)
        pm.save_adapter(tmp_path / "adapter")
    tokens, targets = rollout_rows()
    temperature = 0.7
    pmodel = peft.PeftModel.from_pretrained(make("llama-tied"), tmp_path / "adapter", is_trainable=True).eval()
    logits = pmodel(tokens).logits / temperature
    all_lp = torch.log_softmax(logits, -1)
    want = all_lp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    want_entropy = -(all_lp.exp() * all_lp).sum(-1)
    nonlinear(want, targets).backward()
    want_grads = peft_grads(pmodel)
    with torch.no_grad(), pmodel.disable_adapter():
        base_lp = torch.log_softmax(pmodel(tokens).logits / temperature, -1)
        want_ref = base_lp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    with phantom.load(store, offload=offload, prefetch=1, lora=read_adapter_config(tmp_path / "adapter"),
                      loss_chunk=7) as pm:
        pm.load_adapter(tmp_path / "adapter")
        logps, entropy, ref = pm.token_logps(tokens, targets, temperature, reference=True)
        assert rel_err(logps, want) < 1e-5 and rel_err(entropy, want_entropy) < 1e-5 and rel_err(ref, want_ref) < 1e-5
        assert not entropy.requires_grad and not ref.requires_grad
        nonlinear(logps, targets).backward()
        got = lora_grads(pm)
    assert got.keys() == want_grads.keys()
    for key, (ga, gb) in got.items():
        assert rel_err(ga, want_grads[key][0]) < 1e-4 and rel_err(gb, want_grads[key][1]) < 1e-4, key


def test_the_cost_of_a_grpo_step_is_its_generation_its_reference_passes_and_its_training():
    """A step's parts as the run does them: the generation of prompts x G completions (phantom.plan.costgen), the
    passes without autograd once a batch of rollouts, a LoRA step over the rows; the disk's bytes of all three, none
    from a RAM tier a CPU uses in place."""
    from phantom.arch.config import ModelConfig
    from phantom.plan import costmodel
    from phantom.plan.costgen import GenRates, predict_generation
    from phantom.plan.costgrpo import GrpoWork, forward_pass, predict_grpo_step
    from phantom.plan.costinputs import MachineProfile, shape_of
    cfg = ModelConfig(dim=1024, n_layers=8, n_heads=16, vocab_size=4096)
    profile = MachineProfile(machine="m", device="cpu", dtype="fp32", disk_gbps=2.0, h2d_gbps=10.0, fwd_flops=1e11,
                             free_host_bytes=64 << 30)
    rates = GenRates(decode=((1, 1e-3), (64, 1e-2)), rest=((1, 0.0),), prefill=((8, 1e-3), (512, 2e-2)))
    disk, acts = phantom.Placement(offload="disk", prefetch=1), phantom.Activations(recompute="none", micro_batch=8)
    work = GrpoWork(prompts=2, num_generations=8, prompt_len=8, completion_len=32)
    step = predict_grpo_step(rates, profile, cfg, ("fp32", "fp32"), disk, acts, work)
    gen = predict_generation(rates, profile, shape_of(cfg, "fp32", "fp32", 1), disk, 16, 8, 32, 16)
    train = costmodel.predict(profile, shape_of(cfg, "fp32", "fp32", 39), disk, acts, 16)
    assert step.generation_s == pytest.approx(gen.seconds) and step.train_s == pytest.approx(train.step_s)
    assert step.reference_s == 0 and step.step_s == pytest.approx(gen.seconds + train.step_s)
    block = shape_of(cfg, "fp32", "fp32", 1).block_bytes
    assert step.bytes_read == 32 * cfg.n_layers * block + train.bytes_read  # every block each new token, then training
    twice = predict_grpo_step(rates, profile, cfg, ("fp32", "fp32"), disk, acts,
                              GrpoWork(2, 8, 8, 32, num_iterations=2, reference_passes=1))
    forward_s, _ = forward_pass(profile, shape_of(cfg, "fp32", "fp32", 39), disk, acts, 16)
    assert twice.generation_s == pytest.approx(gen.seconds / 2) and twice.reference_s == pytest.approx(forward_s / 2)
    ram = predict_grpo_step(rates, profile, cfg, ("fp32", "fp32"), phantom.Placement(offload="ram"), acts, work)
    assert ram.bytes_read == 0 and ram.generation_s < step.generation_s
