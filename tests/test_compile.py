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


def test_compiled_blocks_match_eager_under_each_vector_width(tmp_path, monkeypatch):
    """inductor's graph cache key leaves out the vector ISA it picks from ATEN_CPU_CAPABILITY: without the width
    named in the block's options, an AVX2 run served the graphs an AVX-512 run had cached computed a NaN loss.
    Both widths share one cache here, the wider first (the order that gave NaN; the other wrote out of bounds)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.utils import clear_caches, fresh_cache
    if not {256, 512} <= {isa.bit_width() for isa in cpu_vec_isa.valid_vec_isa_list()}:
        pytest.skip("needs a CPU with both AVX2 and AVX-512: the two vector widths a shared cache confused")
    cfg = dataclasses.replace(SMALL, n_layers=2)
    store = write_synthetic(tmp_path / "two", cfg, torch.float32, seed=1, progress=False)
    tokens, _ = batch(cfg)
    with torch.no_grad():
        eager = phantom.load(store, offload="disk")
        ref = eager(tokens)
        eager.close()
        with fresh_cache():
            for capability in ("avx512", "avx2"):
                monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
                torch._dynamo.reset()
                clear_caches()  # in-memory caches only: the second width must go to the shared disk cache
                model = phantom.load(store, offload="disk", compile=True)
                assert max_rel_err(model(tokens), ref) <= 1e-5, capability
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
