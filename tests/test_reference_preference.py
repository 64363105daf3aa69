"""Preference training against an independent reference: phantom's DPO / IPO loss and every LoRA
gradient equal the DPO formula computed on transformers' LlamaForCausalLM with peft (the policy with
the adapter, the reference under peft's `disable_adapter()`), resident and streamed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phantom
from phantom.model.lora import PROJECTIONS, TARGETS, lora_modules
from conftest import need
from phantom.train.preference import Preference, PreferenceConfig


transformers, peft = need("transformers"), need("peft")  # before test_reference's: a skip names this file

from test_reference import CONFIGS, assert_lora_grads_match, in_pairs, peft_lora_grads, rel_err, stores  # noqa: E402, F401, F811 (stores: fixture)

P, T = 3, 24  # pairs, tokens per row


def pairs(vocab: int, seed: int = 0):
    """(P, 2, T) tokens and targets: a shared prompt per pair (masked), two different responses."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (P, 2, T), generator=gen)
    x[:, 1, :8] = x[:, 0, :8]  # the same prompt on both sides
    y = torch.randint(0, vocab, (P, 2, T), generator=gen)
    y[:, :, :7] = -100  # prompt
    y[0, :, 20:] = -100  # padding after a short response
    y[2, 1, 15:] = -100
    return x, y


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    lp = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return lp.view(targets.shape).sum(-1)


def dpo_reference(model, adapter, x, y, cfg: PreferenceConfig):
    """The DPO / IPO loss as the papers (and TRL) write it, on peft's model; its LoRA gradients."""
    pmodel = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True).eval()
    tokens, targets = x.reshape(2 * P, T), y.reshape(2 * P, T)
    policy = sequence_logps(pmodel(tokens).logits, targets).view(P, 2)
    with pmodel.disable_adapter(), torch.no_grad():
        ref = sequence_logps(pmodel(tokens).logits, targets).view(P, 2)
    chosen_rewards = cfg.beta * (policy[:, 0] - ref[:, 0]).detach()  # TRL: summed log-ratios, any loss
    if cfg.loss == "ipo":
        n = (y != -100).sum(-1)
        policy, ref = policy / n, ref / n
    logits = (policy[:, 0] - policy[:, 1]) - (ref[:, 0] - ref[:, 1])
    if cfg.loss == "sigmoid":
        s = cfg.label_smoothing
        loss = (-F.logsigmoid(cfg.beta * logits) * (1 - s) - F.logsigmoid(-cfg.beta * logits) * s).mean()
    else:
        loss = ((logits - 1 / (2 * cfg.beta)) ** 2).mean()
    loss.backward()
    grads = peft_lora_grads(pmodel, model.config.num_hidden_layers)
    pmodel.unload()
    return loss.detach(), grads, chosen_rewards.mean().item()


def phantom_dpo(store, adapter, x, y, cfg: PreferenceConfig, **knobs):
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=PROJECTIONS)
    with phantom.load(store, lora=lora, loss_chunk=7, micro_batch=2, **knobs) as pm:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)  # B nonzero: policy != reference
        pm.save_adapter(adapter)
        objective = Preference(cfg)
        loss = objective(pm, x, y)
        loss.backward()
        grads = {k: (m.lora_A.grad.clone(), m.lora_B.grad.clone()) for k, m in lora_modules(pm.layers).items()}
    return loss.detach(), grads, objective.figures


KNOBS = {"resident": dict(offload="none"), "disk-prefetch0": dict(offload="disk", prefetch=0),
         "disk-prefetch2": dict(offload="disk", prefetch=2),
         "disk-prefetch2-keep": dict(offload="disk", prefetch=2, recompute="none")}
LOSSES = {"sigmoid": PreferenceConfig(beta=0.5), "smoothed": PreferenceConfig(beta=0.3, label_smoothing=0.2),
          "ipo": PreferenceConfig(loss="ipo", beta=0.4)}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("where", list(KNOBS))
def test_dpo_loss_and_lora_gradients_match_peft(stores, tmp_path, where, loss):
    model, store = stores("gqa")
    cfg = CONFIGS["gqa"]
    x, y = pairs(cfg.vocab_size)
    got_loss, got, figures = phantom_dpo(store, tmp_path / "adapter", x, y, LOSSES[loss], **KNOBS[where])
    ref_loss, ref, chosen_reward = dpo_reference(model, tmp_path / "adapter", x, y, LOSSES[loss])
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=0)
    assert figures["rewards_chosen"] == pytest.approx(chosen_reward, rel=1e-4, abs=1e-6)
    assert_lora_grads_match(got, ref, cfg, 1e-5, in_pairs(store))
