"""Holes an audit of the suite found, closed in a file of their own.

- Full finetuning must leave the store it started from byte for byte as it was: test_full.py compared
  that store with itself; here every file's sha256 is taken before and after, and the trained copy is
  checked to differ (so the comparison could fail).
- compile=True must really compile: test_compile.py's bound (`unique_graphs <= 4`) holds at 0 graphs and
  the eager fallback swallows any error; here a graph must be built and no fallback logged, or the test
  skips saying why the compiler is unavailable.
"""
from __future__ import annotations

import hashlib
import logging

import pytest

import torch

import phantom
from phantom.convert.synthetic import write_synthetic
from phantom.files.store import BlockStore
from conftest import SMALL, batch, randomize_lora


def digests(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_full_finetune_leaves_the_original_store_byte_identical(tmp_path):
    store = write_synthetic(tmp_path / "base", SMALL, torch.float32, seed=5, progress=False)
    before = digests(store)
    model = phantom.load(store, offload="disk", prefetch=1, mode="full", work_dir=tmp_path / "work",
                         optim=phantom.AdamWConfig(lr=1e-2))
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
    tokens, targets = batch(SMALL)
    for _ in range(2):
        model(tokens, targets=targets).backward()
        opt.step()
        opt.zero_grad()
        model.finish_step()
    model.save_full()
    model.close()
    assert digests(store) == before
    trained = BlockStore(tmp_path / "work" / "store", verify="full")
    original = BlockStore(store, verify="full")
    for i in range(SMALL.n_layers):
        assert not torch.equal(trained.load_block(i)["attention.wq.weight"], original.load_block(i)["attention.wq.weight"])


def test_compile_builds_a_graph_and_does_not_fall_back(small_store, caplog):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # noqa: BLE001 - no C compiler, no triton, ...: say which
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}: {str(e)[:120]}")
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="phantom.model.phantom_model"):
        with phantom.load(small_store, offload="disk", compile=True) as model:
            randomize_lora(model)
            tokens, targets = batch(SMALL)
            model(tokens, targets=targets).backward()
    assert "torch.compile failed" not in caplog.text
    assert counters["stats"]["unique_graphs"] >= 1
