"""Mixed precision: streamed bf16/fp16 equal resident bf16/fp16 exactly, and the fp32 reference within
the format's rounding. bf16 keeps 8 significant bits (unit roundoff 2^-8 ~ 0.4%); a few roundings per
block over 4 blocks give ~1% on logits and ~3% on gradients relative to their largest entry, so the
tolerances are 3% (logits) and 6% (grads). fp16 keeps 11 bits: 0.5% and 1%."""
from __future__ import annotations

import pytest
import torch

import phantom
from conftest import SMALL, batch, max_rel_err
from test_model import run

TOLERANCES = {"bf16": (0.03, 0.06), "fp16": (0.005, 0.01)}


@pytest.fixture(scope="module")
def fp32_reference(small_store):
    return run(small_store, "none")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_streamed_amp_equals_resident_amp(small_store, small_store_bf16, dtype, offload):
    store = small_store_bf16 if dtype == "bf16" else small_store
    ref_logits, ref_loss, ref_grads = run(store, "none", dtype=dtype)
    logits, loss, grads = run(store, offload, dtype=dtype)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n
        assert grads[n].dtype == torch.float32  # LoRA master weights and their grads stay fp32


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_is_within_rounding_of_fp32(small_store, small_store_bf16, fp32_reference, dtype):
    store = small_store_bf16 if dtype == "bf16" else small_store
    logits_tol, grad_tol = TOLERANCES[dtype]
    ref_logits, ref_loss, ref_grads = fp32_reference
    logits, loss, grads = run(store, "disk", dtype=dtype)
    assert max_rel_err(logits, ref_logits) <= logits_tol
    assert max_rel_err(loss, ref_loss) <= logits_tol
    for n in ref_grads:
        assert max_rel_err(grads[n], ref_grads[n]) <= grad_tol, n


def test_fp16_with_grad_scaler_unscales_to_the_reference_and_skips_overflow(small_store, fp32_reference):
    _, _, ref_grads = fp32_reference
    model = phantom.load(small_store, offload="disk", dtype="fp16",
                         lora=phantom.LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")))
    from conftest import randomize_lora
    randomize_lora(model)
    opt = torch.optim.SGD(model.trainable_parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    tokens, targets = batch(SMALL)
    torch.manual_seed(123)
    scaler.scale(model(tokens, targets=targets)).backward()
    scaler.unscale_(opt)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert max_rel_err(p.grad, ref_grads[n]) <= TOLERANCES["fp16"][1], n
    before = [p.detach().clone() for p in model.trainable_parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.trainable_parameters()))
    # an overflowing step (inf in a gradient) is skipped and the scale backs off
    opt.zero_grad()
    scale = scaler.get_scale()
    scaler.scale(model(tokens, targets=targets)).backward()
    next(iter(model.trainable_parameters())).grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.trainable_parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.trainable_parameters()))
    assert scaler.get_scale() < scale
    model.close()
