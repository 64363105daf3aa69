"""torch.compile of the block: one compiled graph serves every block (weights are swapped inputs),
results equal eager, and a failing compiler falls back to eager with a warning."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import phantom
from phantom.convert.synthetic import write_synthetic
from conftest import SMALL, batch, max_rel_err, randomize_lora


def loss_and_grads(model):
    randomize_lora(model)
    tokens, targets = batch(SMALL)
    loss = model(tokens, targets=targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.trainable_parameters()]


def test_compiled_blocks_match_eager_and_compile_once(tmp_path):
    from torch._dynamo.utils import counters
    deep = dataclasses.replace(SMALL, n_layers=8)
    store = write_synthetic(tmp_path / "deep", deep, torch.float32, seed=1, progress=False)
    torch._dynamo.reset()
    counters.clear()
    ref_loss, ref_grads = loss_and_grads(phantom.load(store, offload="disk"))
    model = phantom.load(store, offload="disk", compile=True)
    for _ in range(2):
        model.zero_grad()
        loss, grads = loss_and_grads(model)
    assert max_rel_err(loss, ref_loss) <= 1e-5
    assert all(max_rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))
    # a few graphs (forward without grad, recompute with grad, ...), not one per block
    assert counters["stats"]["unique_graphs"] <= 4 < deep.n_layers
    model.close()


def test_compile_failure_falls_back_to_eager(small_store, monkeypatch, caplog):
    def broken(self, *a, **k):
        raise RuntimeError("backend exploded (injected)")

    model = phantom.load(small_store, offload="disk", compile=True)
    for block in model.layers:
        block._compiled_call_impl = broken.__get__(block)
    with caplog.at_level(logging.WARNING, logger="phantom.model.phantom_model"):
        loss, _ = loss_and_grads(model)
    assert "torch.compile failed" in caplog.text and torch.isfinite(loss)
    model.close()
