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
