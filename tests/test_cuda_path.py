"""The CUDA path, proven without a GPU: what it asks of streams, events, copies and pinned memory.

tests/fake_cuda.py records every stream, event and copy call while the real code runs its CUDA
branches on host memory; each test here pins one ordering or memory rule that a GPU run depends on
and that a careless change would break silently (a race shows on a GPU only now and then).
"""
from __future__ import annotations

import pytest
import torch

from phantom.placement import Placement
from phantom.scheduler import BlockScheduler
from phantom.store import BlockStore
from fake_cuda import fake_cuda


@pytest.fixture
def fc(monkeypatch):
    return fake_cuda(monkeypatch)


def test_device_tier_blocks_are_copied_out_of_the_loader_before_it_is_refilled(fc, small_store_bf16):
    """A converting store's device-tier blocks pass through one loader slot: each block's converted
    tensors are copied into its own buffers on the compute stream, and the next block's load (copy
    stream) must wait for that copy, or it overwrites what is still being read."""
    with fc.tensors_to_host():
        sched = BlockScheduler(BlockStore(small_store_bf16), "cuda",
                               Placement(offload="auto", resident=3, ram_budget=0, prefetch=1), dtype=torch.float32)
    try:
        assert sched.resident == 3, sched.tiers
        assert fc.of("copy"), "the device tier was not loaded through the recorded path"
        assert fc.unordered() == []
        for i in range(3):
            ref = BlockStore(small_store_bf16).load_block(i)
            for k, v in sched._resident_views[i].items():
                assert torch.equal(v, ref[k].float()), (i, k)
    finally:
        sched.close()
