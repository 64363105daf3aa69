"""The CUDA path, proven without a GPU: what it asks of streams, events, copies and pinned memory.

tests/fake_cuda.py records every stream, event and copy call while the real code runs its CUDA
branches on host memory; each test here pins one ordering or memory rule that a GPU run depends on
and that a careless change would break silently (a race shows on a GPU only now and then).
"""
from __future__ import annotations

import os

import pytest
import torch

import phantom
from phantom.convert import write_synthetic
from phantom.placement import Placement
from phantom.scheduler import HUGE_MIN, BlockScheduler, HostBuffer
from phantom.store import BlockStore
from conftest import SMALL, batch
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


def test_a_host_side_embedding_never_reads_ids_from_an_unfinished_copy(fc, small_store):
    """With the embedding table in host memory (large against free device memory), ids that are on
    the device come back with a blocking copy: a non-blocking device-to-host copy returns before the
    ids land, and F.embedding would read what the buffer held before (the previous batch's ids)."""
    fc.free = 64 << 10  # the table (97 x 64 fp32) is more than an eighth of it: it stays on the host
    with fc.tensors_to_host():
        model = phantom.load(small_store, device="cuda", offload="disk", prefetch=1, compile=False)
        try:
            assert not fc.on_cuda(model.embed_table)
            ids = torch.randint(0, SMALL.vocab_size, (2, 8))
            on_device = ids.to("cuda", non_blocking=True)
            start = len(fc.log)
            h = model.embed(on_device)
            back = [e for e in fc.log[start:] if e[0] == "copy" and fc.on_cuda(e[2]) and not fc.on_cuda(e[1])]
            assert back and not any(nb for _, _, _, nb, _ in back), "ids read back without waiting"
            assert torch.equal(h, model.embed_table[ids])
            start = len(fc.log)
            h = model.embed(ids)  # host ids (what the training loop passes): no round trip at all
            assert not [e for e in fc.log[start:] if e[0] == "copy" and fc.on_cuda(e[2])]
            assert torch.equal(h, model.embed_table[ids])
        finally:
            model.close()


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping that holds address ptr (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_every_pinned_host_buffer_is_left_out_of_a_fork(fc, small_store):
    """DataLoader workers fork after the scheduler pinned its buffers; a pinned page is copied into
    the child at fork (Linux >= 5.9), so each is marked MADV_DONTFORK ("dc" in smaps, do not copy on fork;
    "dd" is the core-dump flag): the RAM tier,
    the staging buffers, small and huge-page ones alike."""
    for n in (4096 * 3 + 5, HUGE_MIN + 7):
        buf = HostBuffer(n, pin=True)
        assert buf.pinned and "dc" in vm_flags(buf.tensor.data_ptr()), n
        assert "dc" not in vm_flags(HostBuffer(n, pin=False).tensor.data_ptr()), n  # nothing to protect
    registered = len(fc.of("register"))
    with fc.tensors_to_host():
        store = BlockStore(small_store)
        sched = BlockScheduler(store, "cuda", Placement(offload="auto", resident=0, ram_budget=2 * store.block_nbytes,
                                                        prefetch=1))
    try:
        assert "ram" in sched.tiers and "disk" in sched.tiers
        buffers = [sched._ram_buffer] + [s.host for s in sched.slots]
        assert all(b.pinned and "dc" in vm_flags(b.tensor.data_ptr()) for b in buffers)
        assert len(fc.of("register")) - registered == len(buffers)  # no pinned host memory but these
    finally:
        sched.close()


def kept_by_blocks(store, dtype: str) -> tuple[int, int, torch.dtype]:
    """(bytes kept for backward, weights kept as handles, the blocks' output dtype) of one step."""
    with phantom.load(store, dtype=dtype, offload="ram", prefetch=1, recompute="none") as model:
        tokens, targets = batch(SMALL, b=2, t=16)
        with torch.autocast(**model.autocast_args()):
            h = model.blocks(model.embed(tokens).requires_grad_(), model.rope[:16])
        return model.executor.kept_bytes, model.executor.weight_handles, h.dtype


def test_a_store_in_another_dtype_is_converted_once_per_load_not_at_every_use(tmp_path, small_store_bf16):
    """An fp16 store (Llama-2-hf's default) at CUDA's bf16 default: weights converted in the transfer
    stage, so with recompute="none" autograd keeps handles into the slot, not a cast copy of every
    weight, and the hidden state stays bf16. The same bytes are kept as for a bf16 store."""
    fp16 = write_synthetic(tmp_path / "fp16", SMALL, torch.float16, seed=1, progress=False)
    want_bytes, want_handles, _ = kept_by_blocks(small_store_bf16, "bf16")
    kept, handles, out_dtype = kept_by_blocks(fp16, "bf16")
    assert want_handles > 0 and handles == want_handles
    assert kept == want_bytes and out_dtype == torch.bfloat16


@pytest.mark.parametrize("shared", [False, True])
def test_local_ranks_split_the_host_memory_for_their_ram_tiers(fc, monkeypatch, small_store, shared):
    """Under torchrun with 4 ranks on a machine each rank sizes its pinned RAM tier from a quarter of
    MemAvailable (sized from all of it, 4 ranks would pin 4 machine-sized tiers); a shared tier is one
    copy for all of them and keeps the whole."""
    import phantom.scheduler as S
    store = BlockStore(small_store)
    block = -(-store.block_nbytes // 4096) * 4096
    per_rank = int((4 << 30) + 2.5 * store.block_nbytes)  # default_ram_budget: 85% less 4 GiB -> ~2 blocks
    monkeypatch.setattr(S, "mem_available", lambda: int(4 * per_rank / 0.85))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with fc.tensors_to_host():
        sched = BlockScheduler(store, "cuda", Placement(offload="auto", resident=0, prefetch=1, shared_ram=shared))
    try:
        if shared:
            assert sched.tiers.count("ram") == store.n_blocks and sched.pinned_bytes == 0
        else:
            assert sched.tiers.count("ram") == 2 and sched._ram_buffer.tensor.numel() == 2 * block
    finally:
        sched.close()

