"""Tiers by budget: a placement over device, RAM and disk trains like the resident model,
reads from disk exactly the bytes the planner predicts, and degrades to disk or to buffered reads
with a log line instead of failing. Tiny 8-block fp32 stores; every test runs in about a second."""
from __future__ import annotations

import errno
import fcntl
import functools
import gc
import logging
import mmap
import os
from pathlib import Path

import pytest
import torch

import phantom
import phantom.model.phantom_model
import phantom.stream.hostmem
import phantom.stream.placement
import phantom.stream.scheduler
import phantom.files.directio
import phantom.files.store
import phantom.files.tensorfile
from phantom.plan import costinputs as ci, costmodel as cm
from phantom.arch.config import ModelConfig
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Activations, Placement, loads_per_step
from phantom.stream.scheduler import BlockScheduler
from conftest import batch, max_rel_err, randomize_lora

# 8 blocks: room for blocks in every tier and streamed blocks that are both reused and reloaded
CFG = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
B, T = 2, 16
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is ~10x faster than two OpenMP threads spinning on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("tiers") / "s8", CFG, torch.float32, seed=5, progress=False)


def step(model) -> tuple[float, dict[str, torch.Tensor]]:
    """One LoRA step's loss and gradients (no optimizer step: every step sees the same weights)."""
    for p in model.trainable_parameters():
        p.grad = None
    tokens, targets = batch(CFG, B, T)
    loss = model(tokens, targets=targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def resident(store):
    with phantom.load(store, offload="none") as model:
        randomize_lora(model)
        return step(model)


def assert_same(got, ref) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert max_rel_err(grads[name], ref_grads[name]) <= TOL, name


def run(store, placement: Placement, steps: int = 2) -> tuple[tuple, list[dict], tuple[str, ...], int]:
    """Loss and grads of the first step, the scheduler's metrics of the later (steady) steps, the tiers."""
    with phantom.load(store, placement=placement) as model:
        randomize_lora(model)
        sched = model.scheduler
        sched.take_metrics()
        first = step(model)
        metrics = []
        for _ in range(steps - 1):
            sched.take_metrics()
            assert step(model)[0] == first[0]
            metrics.append(sched.take_metrics())
        return first, metrics, sched.tiers, model.store.block_nbytes


def budgets(nbytes: int, prefetch: int, n_ram: int) -> Placement:
    """What a user gives: a RAM budget of n_ram blocks (a CPU has no separate device tier)."""
    return Placement(offload="auto", prefetch=prefetch, ram_budget=n_ram * nbytes + nbytes // 2)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_ram_and_disk_by_budget_equal_resident_and_read_what_the_planner_predicts(store, resident, prefetch):
    nbytes = phantom.files.store.BlockStore(store).block_nbytes
    place = budgets(nbytes, prefetch, n_ram=3)
    first, metrics, tiers, _ = run(store, place)
    assert tiers == ("ram",) * 3 + ("disk",) * 5
    assert_same(first, resident)
    planned = loads_per_step(tiers, prefetch + 1, ram_streams=False)  # a CPU uses its RAM tier in place
    pred = cm.predict(ci.MachineProfile(machine="test", device="cpu"), ci.shape_of(CFG, "fp32", "fp32", T),
                      place, Activations(), rows=B)
    assert pred.tiers == tiers and pred.bytes_read == planned["disk"] * nbytes
    for m in metrics:
        assert m["bytes_read"] == pred.bytes_read  # from disk: exactly the plan
        assert m["bytes_ram"] == 2 * 3 * nbytes  # each RAM block served in place, forward and backward


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_device_ram_and_disk_equal_resident(store, resident, prefetch, monkeypatch):
    """All three tiers at once, as on CUDA: a CPU merges its device tier into RAM, so the tiers are
    given here; resident blocks are kept in buffers of their own, RAM ones used in place, disk streamed."""
    three = ("device",) * 2 + ("ram",) * 3 + ("disk",) * 3
    monkeypatch.setattr(phantom.stream.placement, "assign_tiers", lambda *a, **k: three)
    first, metrics, tiers, nbytes = run(store, Placement(offload="auto", prefetch=prefetch))
    assert tiers == three
    assert_same(first, resident)
    pred = cm.predict(ci.MachineProfile(machine="test", device="cpu"), ci.shape_of(CFG, "fp32", "fp32", T),
                      Placement(offload="auto", prefetch=prefetch), Activations(), rows=B, tiers=three)
    for m in metrics:
        assert m["bytes_read"] == pred.bytes_read == loads_per_step(three, prefetch + 1, False)["disk"] * nbytes
        assert m["bytes_ram"] == 2 * 3 * nbytes


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_ram_tier_through_slots_equals_resident(store, resident, prefetch, monkeypatch):
    """The RAM tier copied into device slots (CUDA's path, forced on the CPU): RAM loads are planned too."""
    monkeypatch.setattr(phantom.model.phantom_model, "BlockScheduler", functools.partial(BlockScheduler, zero_copy=False))
    nbytes = phantom.files.store.BlockStore(store).block_nbytes
    first, metrics, tiers, _ = run(store, budgets(nbytes, prefetch, n_ram=4))
    assert tiers == ("ram",) * 4 + ("disk",) * 4
    assert_same(first, resident)
    planned = loads_per_step(tiers, prefetch + 1, ram_streams=True)
    for m in metrics:
        assert m["bytes_read"] == planned["disk"] * nbytes
        assert m["bytes_ram"] == planned["ram"] * nbytes
        assert m["loads"] == planned["disk"] + planned["ram"]


def test_ram_budget_below_one_block_falls_back_to_disk_and_says_so(store, resident, caplog):
    nbytes = phantom.files.store.BlockStore(store).block_nbytes
    with caplog.at_level(logging.WARNING, logger="phantom.stream.residency"):
        first, metrics, tiers, _ = run(store, Placement(offload="auto", prefetch=1, ram_budget=nbytes - 1))
    assert tiers == ("disk",) * CFG.n_layers
    assert_same(first, resident)
    assert metrics[0]["bytes_ram"] == 0 and metrics[0]["bytes_read"] > 0
    assert any("smaller than one block" in r.getMessage() and "--ram-budget" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.fixture
def direct_reads(monkeypatch):
    """Small read chunks, so tiny blocks take the O_DIRECT path (it is used from READ_CHUNK bytes on),
    a fresh per-filesystem cache of whether O_DIRECT works, and a record of O_DIRECT descriptors."""
    monkeypatch.setattr(phantom.files.directio, "READ_CHUNK", 4 * phantom.files.tensorfile.DATA_ALIGN)
    monkeypatch.setattr(phantom.files.directio, "_direct_ok", {})
    opened, real_open = [], os.open

    def spy(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        if flags & os.O_DIRECT:
            opened.append(fd)
        return fd

    monkeypatch.setattr(os, "open", spy)
    return opened


def test_o_direct_is_used_where_the_filesystem_has_it(store, resident, direct_reads):
    fd = phantom.files.directio._open_direct(store / "manifest.json")
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    os.close(fd)
    direct_reads.clear()
    first, _, _, _ = run(store, budgets(phantom.files.store.BlockStore(store).block_nbytes, 2, n_ram=3), steps=1)
    assert_same(first, resident)
    assert len(direct_reads) > 1  # the blocks were read with O_DIRECT, not through the page cache


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's memory is advised for huge pages ("hg" in its smaps VmFlags)."""
    addr, vma = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            vma = lo <= addr < hi
        elif line.startswith("VmFlags") and vma:
            return "hg" in line.split()
    raise AssertionError(f"{addr:#x} is in no mapping")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists()
                    or not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no huge pages to advise here")
def test_o_direct_reads_into_huge_page_slots(store, resident, direct_reads, monkeypatch):
    """Slots and the RAM tier from HUGE_MIN bytes are 2 MiB-aligned memory advised for huge pages (an
    O_DIRECT request over scattered 4 KiB pages splits into many segments); reads into them train alike."""
    monkeypatch.setattr(phantom.stream.hostmem, "HUGE_MIN", phantom.files.tensorfile.DATA_ALIGN)
    nbytes = phantom.files.store.BlockStore(store).block_nbytes
    with phantom.load(store, placement=budgets(nbytes, 2, n_ram=3)) as model:
        randomize_lora(model)
        buffers = [s.buf for s in model.scheduler.slots] + [model.scheduler.residency.held["ram"].buffer.tensor]
        assert all(b.data_ptr() % phantom.stream.hostmem.HUGE_PAGE == 0 and advised_huge(b) for b in buffers)
        assert_same(step(model), resident)
    assert len(direct_reads) > 1


def test_a_kernel_without_huge_pages_still_gets_its_buffer(monkeypatch):
    """madvise(MADV_HUGEPAGE) fails with EINVAL where the kernel has no THP: the buffer is made anyway."""
    class NoAdvice(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(phantom.stream.hostmem.mmap, "mmap", NoAdvice)
    buf = phantom.stream.hostmem.HostBuffer(phantom.stream.hostmem.HUGE_MIN, pin=False)
    buf.tensor.fill_(1)
    assert buf.tensor.numel() == phantom.stream.hostmem.HUGE_MIN and int(buf.tensor[-1]) == 1


def test_host_buffer_memory_outlives_the_buffer_object_while_a_block_uses_it(monkeypatch):
    """The RAM tier hands out blocks over one allocation: the memory (a mapping, from HUGE_MIN) stays
    mapped as long as a block tensor does, and the exact size asked is what the tensor covers."""
    for huge_min in (phantom.files.tensorfile.DATA_ALIGN, 1 << 40):
        monkeypatch.setattr(phantom.stream.hostmem, "HUGE_MIN", huge_min)
        buf = phantom.stream.hostmem.HostBuffer(5 * phantom.files.tensorfile.DATA_ALIGN + 3, pin=False)
        assert buf.tensor.numel() == 5 * phantom.files.tensorfile.DATA_ALIGN + 3
        assert buf.tensor.data_ptr() % phantom.files.tensorfile.DATA_ALIGN == 0
        block = buf.block(phantom.files.tensorfile.DATA_ALIGN, 100)
        del buf
        gc.collect()
        block.fill_(7)
        assert int(block.sum()) == 700


def test_o_direct_refused_at_open_falls_back_to_buffered_reads(store, resident, direct_reads, monkeypatch, caplog):
    """tmpfs before Linux 6.6 and some FUSE filesystems fail open(O_DIRECT) with EINVAL."""
    spy, tried = os.open, []

    def refuse_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument (no O_DIRECT here)")
        return spy(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse_direct)
    with caplog.at_level(logging.INFO, logger="phantom.files.directio"):
        first, _, _, _ = run(store, budgets(phantom.files.store.BlockStore(store).block_nbytes, 2, n_ram=3))
    assert_same(first, resident)
    assert len(tried) == 1  # asked once per filesystem, then buffered reads only
    assert "O_DIRECT not supported" in caplog.text


def test_o_direct_refused_at_read_falls_back_to_buffered_reads(store, resident, direct_reads, monkeypatch, caplog):
    """Some filesystems accept open(O_DIRECT) and refuse the reads: the block is read again, buffered."""
    real_preadv, refused = os.preadv, []

    def preadv(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT read)")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with caplog.at_level(logging.INFO, logger="phantom.files.directio"):
        first, _, _, _ = run(store, budgets(phantom.files.store.BlockStore(store).block_nbytes, 2, n_ram=3))
    if not direct_reads:
        pytest.skip("this filesystem refuses O_DIRECT at open")
    assert_same(first, resident)
    assert refused and "O_DIRECT reads refused" in caplog.text
    assert len(direct_reads) == 1  # remembered: later blocks go straight to buffered reads


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_store_on_tmpfs_gives_the_same_result(store, resident, direct_reads):
    import shutil
    import tempfile
    shm = Path(tempfile.mkdtemp(prefix="phantom-tiers-", dir="/dev/shm"))
    try:
        copy = Path(shutil.copytree(store, shm / "s8"))
        first, _, _, _ = run(copy, budgets(phantom.files.store.BlockStore(copy).block_nbytes, 2, n_ram=3))
        assert_same(first, resident)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
