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
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Placement
from phantom.stream.hostmem import HUGE_MIN, HostBuffer
from phantom.stream.scheduler import BlockScheduler
from phantom.files.store import BlockStore
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
            for k, v in sched.residency.views(i).items():
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
        buffers = [sched.residency.held["ram"].buffer] + [s.host for s in sched.slots]
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
    import phantom.stream.memory as S
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
            assert sched.tiers.count("ram") == 2 and \
                sched.residency.held["ram"].buffer.tensor.numel() == 2 * block
    finally:
        sched.close()


class RecordedWork:
    """A torch.distributed Work whose wait is recorded with the stream it makes wait."""

    def __init__(self, fc):
        self.fc = fc

    def wait(self):
        self.fc.log.append(("reduce_wait", self.fc.current_stream()))


def full_finetune(fc, monkeypatch, store_path, tier: str):
    """A FullFinetune on the fake device whose write-back items run inline (recorded in this thread),
    with all-reduces recorded (one rank: the sums are the values)."""
    import phantom.train.dist as pdist
    from phantom.stream.optim import AdamWConfig, BlockAdamW, FullFinetune, HostGradients
    monkeypatch.setattr(pdist.dist, "all_reduce", lambda t, async_op=False: RecordedWork(fc))
    store = BlockStore(store_path)
    sched = BlockScheduler(store, "cuda", Placement(offload="ram", resident=0, prefetch=0))
    monkeypatch.setattr(sched.writeback, "submit", lambda fn, *args, name="": fn(*args))
    share = {i: 1 / store.n_blocks for i in range(store.n_blocks)}
    opt = BlockAdamW(AdamWConfig(lr=1e-2, max_grad_norm=1.0), share, tier, device="cuda")
    host_grads = HostGradients(torch.device("cuda"), lambda n: HostBuffer(n, pin=True)) if tier != "device" else None
    return sched, FullFinetune(opt, sched, store, host_grads), pdist.block_grad_sync(lambda: 3.0)


def expected_block(store_path, grads) -> dict:
    """Block 0 after one AdamW step on the CPU (the reference for the fake device's update)."""
    from phantom.stream.optim import AdamWConfig, BlockAdamW
    store = BlockStore(store_path)
    opt = BlockAdamW(AdamWConfig(lr=1e-2, max_grad_norm=1.0), {0: 1 / store.n_blocks}, "ram")
    return opt.step_block(0, lambda: store.load_block(0), {k: g.clone() for k, g in grads.items()})


@pytest.mark.parametrize("tier", ["ram", "device"])
def test_block_updates_never_hold_up_the_compute_stream(fc, monkeypatch, small_store, tier):
    """Full finetuning under data parallel: block i's all-reduce is waited for on a side stream (the
    host-gradient copier's, or the update's), never the compute stream, so it overlaps block i-1's
    backward; the gradients are reduced in place (no flat copy). With device-held state the AdamW
    kernels run on the update's stream, nothing is uploaded with a blocking torch.tensor, and the new
    weights are converted on the device and copied into the pinned RAM tier without blocking."""
    host = {k: torch.randn(v.shape) for k, v in BlockStore(small_store).load_block(0).items()}
    want = expected_block(small_store, host)
    with fc.tensors_to_host():
        sched, ft, sync = full_finetune(fc, monkeypatch, small_store, tier)
        try:
            grads = {k: g.to("cuda") for k, g in host.items()}
            start = len(fc.log)
            ft.on_block_grads(0, grads, sync)
            log = fc.log[start:]
            waits = [e for e in log if e[0] == "reduce_wait"]
            assert waits and all(s is not fc.default for _, s in waits), "the compute stream waits for a reduction"
            assert not [e for e in log if e[0] == "op" and e[1] == "cat"], "a flat copy of the block's gradients"
            assert not [e for e in log if e[0] in ("device_sync", "h2d_value") or
                        (e[0] in ("stream_sync", "wait_event", "wait_stream") and e[1] is fc.default)]
            if tier == "device":
                adamw = [e for e in log if e[0] == "op" and "adamw" in e[1]]
                assert adamw and all(s is ft.stream for _, _, s in adamw)
                to_ram = [e for e in log if e[0] == "copy" and fc.on_cuda(e[2]) and not fc.on_cuda(e[1])]
                assert to_ram and all(nb and s is ft.stream and d.dtype == src.dtype for _, d, src, nb, s in to_ram)
            got = sched.host_weights(0)
            for k in want:
                torch.testing.assert_close(got[k], want[k].to(got[k].dtype), rtol=1e-5, atol=1e-6)
        finally:
            sched.close()


def device_bytes(sched) -> int:
    """Bytes of the device tensors a scheduler holds: its slots (store bytes and converted copy) and
    resident blocks, read off the tensors themselves."""
    def nbytes(views: dict) -> int:
        return sum(v.numel() * v.element_size() for v in views.values())
    slots = sum(s.buf.numel() + (nbytes(s.converted) if s.converted is not None else 0) for s in sched.slots)
    return slots + sum(nbytes(sched.residency.views(i)) for i, t in enumerate(sched.tiers) if t == "device")


def test_the_device_budget_holds_what_the_scheduler_allocates(fc, small_store_bf16):
    """A bf16 store computed in fp32: a slot holds the stored bytes and the fp32 copy (3x the store's
    bytes, where placement counted 2x). With a device budget of two slots and two resident blocks,
    what the scheduler allocates on the device stays within it, and the cost model says the same."""
    from phantom.plan import costinputs as ci, costmodel as cm
    store = BlockStore(small_store_bf16)
    shape = ci.shape_of(SMALL, "bf16", "fp32")
    budget = 2 * shape.slot_bytes + 2 * shape.tier_bytes
    with fc.tensors_to_host():
        sched = BlockScheduler(store, "cuda", Placement(offload="auto", prefetch=1, device_budget=budget,
                                                        ram_budget=1 << 30), dtype=torch.float32)
    try:
        assert sched.resident == 2 and len(sched.slots) == 2
        assert device_bytes(sched) <= budget
        profile = ci.MachineProfile(machine="t", device="cuda")
        blocks = 2 * shape.slot_bytes + sched.resident * shape.resident_bytes
        assert abs(device_bytes(sched) - blocks) <= 2 * 4096  # the model counts what the tensors hold
        assert cm.layout(shape, profile, sched.placement) == sched.layout
    finally:
        sched.close()


def test_a_full_finetune_keeps_its_loss_chunk_and_gradients_out_of_the_blocks_budget(fc, tmp_path, small_store):
    """Full finetuning on CUDA: one loss chunk at its peak (~4.5x its fp32 logits), the head's three fp32
    head-sized buffers and two blocks' fp32 gradients in flight are taken from the free memory before
    blocks are placed: with free memory whose default budget holds two slots and every block, the
    blocks that stay resident are those that fit beside the reserve."""
    from phantom.stream.placement import LOSS_BYTES_PER_LOGIT, device_budget
    block = BlockStore(small_store).block_nbytes
    fc.free = int(((2 << 30) + (2 + SMALL.n_layers) * block) / 0.75) + 1
    assert (device_budget(fc.free) - 2 * block) // block == SMALL.n_layers
    with fc.tensors_to_host():
        model = phantom.load(small_store, device="cuda", offload="auto", prefetch=1, compile=False, mode="full",
                             work_dir=tmp_path / "work", optim=phantom.AdamWConfig(state="ram"))
    try:
        V, D = SMALL.vocab_size, SMALL.dim
        reserve = model.loss_chunk * LOSS_BYTES_PER_LOGIT * V + 3 * 4 * V * D + 2 * 4 * SMALL.block_params()
        assert model.loss_chunk * LOSS_BYTES_PER_LOGIT * V <= fc.free // 8  # the chunk's peak, not its logits
        assert model.device_reserve() == reserve
        fit = max(0, (device_budget(fc.free - reserve) - 2 * block) // block)
        assert model.scheduler.resident == fit < SMALL.n_layers
        assert device_bytes(model.scheduler) + reserve <= fc.free
    finally:
        model.close()


def test_a_shared_ram_tier_is_registered_read_only_and_every_thread_uses_the_run_s_device(fc, small_store):
    """Under torchrun the shared RAM tier is a file mapping: registered read-only with CUDA (else each
    copy from it is staged through pageable memory). The loader and write-back threads make the
    run's device theirs (the current device is per thread: cuda:1's copies would make a context on
    GPU 0)."""
    store = BlockStore(small_store)
    with fc.tensors_to_host():
        sched = BlockScheduler(store, "cuda:1", Placement(offload="ram", resident=0, shared_ram=True, prefetch=1))
    try:
        sched.writeback.flush()
        regs = fc.of("register")
        assert len(regs) == store.n_blocks and all(flags & 0x08 for *_, flags in regs)
        for i in range(store.n_blocks):
            start, end = sched.residency.host(i).data_ptr(), sched.residency.host(i).data_ptr() + store.block_nbytes
            assert any(p <= start and end <= p + n for _, p, n, _ in regs), i
        threads = {name for _, device, name in fc.of("set_device") if device == torch.device("cuda:1")}
        assert {t.name for t in sched._threads} | {"phantom-writeback"} <= threads
    finally:
        sched.close()
    assert len(fc.of("unregister")) == store.n_blocks


def test_a_failed_setup_stops_the_loader_threads(small_store, tmp_path):
    """An optimizer that cannot be set up (state on a device that is not CUDA) after the scheduler
    started: its loader threads, and the memory they hold, do not outlive the error."""
    import threading
    before = {t for t in threading.enumerate() if t.name.startswith("phantom-")}
    with pytest.raises(ValueError, match="needs a CUDA device"):
        phantom.load(small_store, offload="ram", mode="full", work_dir=tmp_path / "w",
                     optim=phantom.AdamWConfig(state="device"))
    left = {t for t in threading.enumerate() if t.name.startswith("phantom-") and t.is_alive()} - before
    assert not left, left


def test_a_quantized_store_s_slots_and_blocks_fit_the_device_budget(fc, tmp_path, small_store_bf16):
    """An int8 store computed in bf16: a slot holds the quantized bytes and the dequantized block, a
    resident block the dequantized one. With a budget of two slots and two resident blocks, what the
    scheduler allocates on the device stays within it (device budgets are counted in dequantized units)."""
    from phantom.convert.quantstore import quantize_store
    from phantom.arch.quantformat import QuantFormat
    out = quantize_store(small_store_bf16, tmp_path / "int8", QuantFormat("int8"), progress=False)["out"]
    store = BlockStore(out)
    dense = store.dense_nbytes  # bf16 store, bf16 compute
    budget = 2 * (store.block_nbytes + dense) + 2 * dense
    with fc.tensors_to_host():
        sched = BlockScheduler(store, "cuda", Placement(offload="auto", prefetch=1, device_budget=budget,
                                                        ram_budget=1 << 30), dtype=torch.bfloat16)
    try:
        assert len(sched.slots) == 2 and device_bytes(sched) <= budget
        assert sched.resident == 2, sched.tiers
    finally:
        sched.close()


def test_generation_caches_in_host_memory_come_up_on_the_copy_stream_and_go_back_after_their_block(fc, small_store):
    """Caches kept in host memory (a device budget of 0) are page-locked; each block's comes up non-blocking on
    the copy stream, the compute waits for it by an event, its new columns go back on the copy stream after an
    event of the compute, and no copy touches bytes another stream touched unordered; the tokens are the
    device-resident caches'."""
    from phantom.model.generate import Request, generate_many
    reqs = [Request([1, 5, 7], 4), Request([3, 4, 5, 6, 7, 8], 4), Request([9], 2)]  # the last ends early
    with fc.tensors_to_host():
        model = phantom.load(small_store, device="cuda", offload="disk", prefetch=1, compile=False, lora=None)
        try:
            start = len(fc.log)
            got = [c.ids for c in generate_many(model, reqs, cache_budget=0)]
            log = fc.log[start:]
        finally:
            model.close()
    assert len([e for e in log if e[0] == "register"]) == 2 * SMALL.n_layers  # every block's k and v
    side = {e[4] for e in log if e[0] == "copy" and e[4] is not fc.default and fc.on_cuda(e[1]) and e[2].dim() == 4}
    assert len(side) == 1, "the caches' uploads run on one copy stream"
    stream = side.pop()
    ups = [e for e in log if e[0] == "copy" and e[4] is stream and fc.on_cuda(e[1]) and not fc.on_cuda(e[2])]
    downs = [e for e in log if e[0] == "copy" and e[4] is stream and fc.on_cuda(e[2]) and not fc.on_cuda(e[1])]
    assert ups and downs and all(e[3] for e in ups + downs), "cache copies are non-blocking"
    for k, e in enumerate(log):
        if any(e is u for u in ups):  # the compute waits for the event recorded after the upload
            ev = next(r[1] for r in log[k + 1:] if r[0] == "record" and r[2] is stream)
            assert any(w[0] == "wait_event" and w[1] is fc.default and w[2] is ev for w in log[k + 1:])
        if any(e is d for d in downs):  # a write-back waits for an event the compute recorded before it
            assert any(w[0] == "wait_event" and w[1] is stream and w[2].stream is fc.default for w in log[:k])
    synced = [k for k, e in enumerate(log) if e[0] == "event_sync"]
    assert synced, "the host compacts the caches only once their write-backs have landed"
    assert fc.unordered() == []
    with phantom.load(small_store, offload="disk", lora=None) as ref:
        assert got == [c.ids for c in generate_many(ref, reqs)]
