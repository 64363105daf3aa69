"""The CUDA path on a real GPU: streamed == resident, the copy pipeline's ordering, exact pinning.

Run with `python3 -m pytest -q -m cuda tests` on a machine with a GPU; skipped elsewhere.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import phantom
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Placement
from phantom.stream.scheduler import BlockScheduler
from phantom.files.store import BlockStore
from conftest import SMALL, batch, max_rel_err, randomize_lora, rss_bytes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Wide enough that a block's copy takes measurable time, small enough for any GPU.
WIDE = dataclasses.replace(SMALL, dim=256, n_heads=8, n_kv_heads=4, multiple_of=64, n_layers=6, vocab_size=211)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return {dt: write_synthetic(root / str(dt), WIDE, dt, seed=3, progress=False)
            for dt in (torch.float32, torch.bfloat16)}


def loss_and_grads(model, seed=0):
    randomize_lora(model, seed)
    tokens, targets = batch(WIDE, b=4, t=32, seed=seed)
    loss = model(tokens.cuda(), targets=targets.cuda())
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().cpu(), [p.grad.detach().cpu() for p in model.trainable_parameters()]


def run(store, dtype, compile=False, **knobs):
    with phantom.load(store, device="cuda", dtype=dtype, compile=compile, **knobs) as model:
        if knobs.get("offload", "auto") != "none":  # a streamed placement must stream something
            assert set(model.scheduler.tiers) - {"device"}, model.scheduler.tiers
        return loss_and_grads(model)


# ("auto", ram_budget=0) alone keeps every block on a GPU with room: resident=0 makes it read from disk
@pytest.mark.parametrize("offload,extra", [("ram", {}), ("disk", {}), ("auto", {"resident": 0, "ram_budget": 0}),
                                           ("auto", {"resident": 2, "ram_budget": 1})])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
@pytest.mark.parametrize("recompute", ["all", "none"])
def test_streamed_equals_resident(stores, offload, extra, prefetch, recompute):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.0)):
        store = stores[dtype]
        if "ram_budget" in extra and extra["ram_budget"]:  # two blocks' worth: a mixed placement
            extra = dict(extra, ram_budget=2 * BlockStore(store).block_nbytes)
        ref_loss, ref_grads = run(store, dtype, offload="none", recompute=recompute)
        loss, grads = run(store, dtype, offload=offload, prefetch=prefetch, recompute=recompute, **extra)
        assert max_rel_err(loss, ref_loss) <= tol
        assert all(max_rel_err(g, r) <= tol for g, r in zip(grads, ref_grads)), (dtype, offload)


def test_bf16_store_upcast_in_the_pipeline_equals_resident(stores):
    ref_loss, ref_grads = run(stores[torch.bfloat16], torch.float32, offload="none")
    loss, grads = run(stores[torch.bfloat16], torch.float32, offload="disk", prefetch=1)
    assert max_rel_err(loss, ref_loss) <= 1e-5
    assert all(max_rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))


def test_slot_reuse_waits_for_compute(stores):
    """One slot, and every block's compute held up on the GPU: a copy that did not wait for the slot's
    free event would overwrite weights still being read, and the result would differ."""
    store = BlockStore(stores[torch.float32])
    sched = BlockScheduler(store, "cuda", Placement(offload="ram", prefetch=0))
    x = torch.randn(64, WIDE.dim, device="cuda")
    outs = []
    sched.plan(list(range(WIDE.n_layers)))
    for i in range(WIDE.n_layers):
        w = sched.acquire(i)["attention.wq.weight"]
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the weights are read
        outs.append(x @ w.T)
        sched.release(i)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        ref = x @ store.load_block(i)["attention.wq.weight"].cuda().T
        assert torch.equal(out, ref), f"block {i} was overwritten while in use"
    sched.close()


def test_ram_tier_pins_exactly_the_blocks(stores):
    """The RAM tier costs its blocks' bytes of host memory (within 1%), not the next power of two
    that the caching host allocator would pin, and none of it goes through that allocator."""
    big = dataclasses.replace(WIDE, dim=1024, n_heads=8, n_kv_heads=8, multiple_of=256, n_layers=6)
    store = BlockStore(write_synthetic(stores[torch.float32].parent / "big", big, torch.bfloat16, seed=0,
                                       progress=False))
    want = store.n_blocks * store.block_nbytes
    torch.cuda.init()
    before_alloc = torch.cuda.host_memory_stats()["allocated_bytes.current"]  # the key must exist
    before = rss_bytes()
    with BlockScheduler(store, "cuda", Placement(offload="ram", prefetch=1)) as sched:
        grown = rss_bytes() - before
        assert sched.residency.held["ram"].buffer.pinned
        assert want <= sched.pinned_bytes <= 1.01 * want
        assert grown <= 1.01 * want + (64 << 20), (grown, want)  # + the process's own small allocations
        assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == before_alloc


def test_a_huge_page_host_buffer_pins_and_copies_both_ways():
    """Buffers from HUGE_MIN are huge-page mappings (phantom.stream.hostmem.huge_page_memory): registered with
    cudaHostRegister like any host memory, copied asynchronously on a side stream, byte for byte."""
    from phantom.stream.hostmem import HUGE_MIN, HostBuffer
    n = HUGE_MIN + 4096 + 7
    buf = HostBuffer(n, pin=True)
    assert buf.pinned
    want = (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)
    buf.tensor.copy_(want)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = buf.tensor.to("cuda", non_blocking=True)
        dev.add_(1)
        buf.tensor.copy_(dev, non_blocking=True)
    stream.synchronize()
    assert torch.equal(buf.tensor, want + 1)


def test_no_host_sync_in_a_block_forward(stores):
    with phantom.load(stores[torch.bfloat16], device="cuda", dtype="bf16", offload="ram", prefetch=2,
                      compile=False, lora=None) as model, torch.no_grad():
        tokens = torch.randint(0, WIDE.vocab_size, (2, 32)).cuda()
        h = model.embed(tokens)
        rope = model.rope[:32]
        model.blocks(h, rope)  # warm-up: allocations, cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with model.executor.block_weights(0) as weights:
                model.executor.run_block(0, h, rope)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_streamed_equals_compiled_resident(stores, dtype, tol):
    """Compiling is the CUDA default: the compiled block over streamed weights (slot views) against
    the compiled resident model."""
    ref_loss, ref_grads = run(stores[dtype], dtype, compile=True, offload="none")
    loss, grads = run(stores[dtype], dtype, compile=True, offload="disk", prefetch=1)
    assert max_rel_err(loss, ref_loss) <= tol
    assert all(max_rel_err(g, r) <= tol for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("state", ["ram", "device"])
def test_full_finetune_on_cuda_with_the_default_compile_equals_the_resident_model(stores, tmp_path, state):
    """Full finetuning streamed from disk (state in RAM: gradients to pinned buffers; on the device:
    the update on its own stream), compiled as CUDA's default: two AdamW steps equal the resident model's."""
    store = stores[torch.float32]
    tokens, targets = batch(WIDE, b=4, t=32, seed=1)

    def two_steps(model):
        opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3, weight_decay=0.0)  # AdamWConfig's
        for _ in range(2):
            model(tokens, targets=targets).backward()
            opt.step()
            opt.zero_grad()
            model.finish_step()
    with phantom.load(store, device="cuda", offload="none", mode="full") as ref:
        two_steps(ref)
        want = [{k: v.detach().cpu() for k, v in block.state_dict().items()} for block in ref.layers]
    with phantom.load(store, device="cuda", offload="disk", prefetch=1, mode="full", work_dir=tmp_path,
                      optim=phantom.AdamWConfig(lr=1e-3, state=state)) as model:
        two_steps(model)
        model.save_full()
    got = BlockStore(tmp_path / "store", verify="full")
    for i, block in enumerate(want):
        trained = got.load_block(i)
        assert all(max_rel_err(trained[k], v) <= 1e-4 for k, v in block.items()), i


def test_a_host_side_embedding_trains_on_each_batch_s_own_tokens(stores, monkeypatch):
    """The embedding table kept in host memory (as for a large vocabulary on a small GPU), three steps
    with different batches in a row: each loss equals the resident model's for the same batch (reading
    ids from an unfinished device-to-host copy gave the previous batch's)."""
    from phantom.model.backends import StreamedBlocks
    monkeypatch.setattr(StreamedBlocks, "embed_table",
                        lambda self, dtype, trained: self.store.load_embed()["tok_embeddings.weight"].to(dtype))
    store = stores[torch.float32]
    with phantom.load(store, device="cuda", offload="ram", prefetch=1) as model, \
            phantom.load(store, device="cuda", offload="none") as ref:
        assert model.embed_table.device.type == "cpu"
        for seed in range(3):
            tokens, targets = batch(WIDE, b=4, t=32, seed=seed)
            with torch.no_grad():
                got = model(tokens.cuda(), targets=targets.cuda())  # ids on the device, table on the host
                want = ref(tokens, targets=targets)
            assert max_rel_err(got.cpu(), want.cpu()) <= 1e-5, seed


def test_a_fork_after_pinning_leaves_the_pinned_tier_out_of_the_child(stores):
    """DataLoader workers fork after the RAM tier is pinned: the child does not get the pinned pages
    (MADV_DONTFORK), so it neither copies them at fork nor can touch them."""
    import os
    with BlockScheduler(BlockStore(stores[torch.float32]), "cuda", Placement(offload="ram", prefetch=1)) as sched:
        assert sched.residency.held["ram"].buffer.pinned
        ptr = sched.residency.held["ram"].buffer.tensor.data_ptr()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: is the pinned buffer mapped here?
            mapped = False
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    mapped |= lo <= ptr < hi
            os.write(write, b"1" if mapped else b"0")
            os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
        assert answer == b"0", "the child has the pinned RAM tier mapped"


@pytest.mark.parametrize("cache_budget", ["auto", 0])
def test_batched_generation_on_the_gpu_equals_the_cpu(stores, cache_budget):
    """Eight prompts of different lengths, greedy, fp32: the GPU's tokens (caches on the device, or all of them
    in page-locked host memory copied with their blocks) are the CPU's."""
    from phantom.model.generate import Request, generate_many
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, WIDE.vocab_size, (n,), generator=gen).tolist(), 8)
            for n in (3, 9, 5, 12, 1, 7, 16, 4)]
    with phantom.load(stores[torch.float32], device="cpu", offload="disk", lora=None) as cpu:
        want = [c.ids for c in generate_many(cpu, reqs)]
    with phantom.load(stores[torch.float32], device="cuda", offload="disk", prefetch=2, lora=None) as gpu:
        assert [c.ids for c in generate_many(gpu, reqs, cache_budget=cache_budget)] == want
