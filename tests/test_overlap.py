"""Prefetch overlaps compute: with reads slowed by a test hook and compute per block longer than a
read, the training thread's stall time per step at prefetch K >= 1 is far below K = 0.

Timing is only compared as ratios within one test (a loaded 2-core CI slows both sides), with the
K = 0 side bounded from below by construction: a sleep never returns early, and with one slot the
next read cannot start before the block computing is released, so each load stalls a full read.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import phantom
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Placement
from phantom.stream.scheduler import BlockScheduler
from phantom.files.store import BlockStore
from conftest import SMALL, batch

N = 6
READ_S = 0.02  # each block read sleeps this long (the slow disk)
COMPUTE_S = 0.04  # the training thread holds each block this long (compute >= read: overlap can hide it)
RATIO = 0.3  # stall at K >= 1 must be below this fraction of stall at K = 0 (ideal: ~0)


@pytest.fixture(scope="module")
def store8(tmp_path_factory):
    cfg = dataclasses.replace(SMALL, n_layers=N)
    return write_synthetic(tmp_path_factory.mktemp("overlap") / "s8", cfg, torch.float32, seed=3, progress=False)


def slow_reads(store: BlockStore, monkeypatch) -> list[int]:
    """Every block read sleeps READ_S first; returns the list the reads are counted into."""
    real, reads = store.read_block_into, []

    def slow(i, buf, **kw):
        time.sleep(READ_S)
        reads.append(i)
        return real(i, buf, **kw)

    monkeypatch.setattr(store, "read_block_into", slow)
    return reads


def scheduler_step(sched: BlockScheduler) -> dict:
    """One training step's order of use (forward 0..N-1, backward N-1..0), compute a fixed sleep."""
    order = list(range(N)) + list(range(N - 1, -1, -1))
    sched.plan(order)
    for i in order:
        sched.acquire(i)
        time.sleep(COMPUTE_S)
        sched.release(i)
    return sched.take_metrics()


def test_prefetch_hides_slow_reads_behind_compute(store8, monkeypatch):
    stall, loads = {}, {}
    for k in (0, 1, 2):
        store = BlockStore(store8)
        reads = slow_reads(store, monkeypatch)
        with BlockScheduler(store, "cpu", Placement(offload="disk", prefetch=k)) as sched:
            scheduler_step(sched)  # the first step starts cold; the second is a steady one
            m = scheduler_step(sched)
        stall[k], loads[k] = m["stall_s"], m["loads"]
        assert m["loads"] > 0 and len(reads) >= m["loads"]
    # K = 0: every load is waited for in full (one slot: nothing is read while a block computes)
    assert stall[0] >= 0.9 * loads[0] * READ_S, (stall, loads)
    for k in (1, 2):
        assert stall[k] < RATIO * stall[0], f"prefetch {k} did not overlap reads with compute: stall {stall}"


def test_model_step_overlaps_reads_with_compute(store8, monkeypatch):
    """The same through PhantomModel: the executor plans ahead, so the loaders have a window.
    Compute is a sleep while the block is held (wrapping acquire), on top of the real (tiny) maths."""
    tokens, targets = batch(SMALL, b=1, t=8)
    stall, loads = {}, {}
    for k in (0, 1):
        model = phantom.load(store8, offload="disk", prefetch=k, recompute="all")
        try:
            sched = model.scheduler
            slow_reads(sched.store, monkeypatch)
            real_acquire = sched.acquire

            def acquire(i, real_acquire=real_acquire):
                views = real_acquire(i)
                time.sleep(COMPUTE_S)
                return views

            monkeypatch.setattr(sched, "acquire", acquire)
            model(tokens, targets=targets).backward()
            sched.take_metrics()
            model(tokens, targets=targets).backward()
            m = sched.take_metrics()
        finally:
            model.close()
        stall[k], loads[k] = m["stall_s"], m["loads"]
    assert loads[0] >= 2 * N - 2 and loads[1] >= 2 * N - 4, loads  # streamed, not kept resident
    assert stall[0] >= 0.9 * loads[0] * READ_S, (stall, loads)
    assert stall[1] < RATIO * stall[0], f"a model step at prefetch 1 did not overlap reads: stall {stall}"
