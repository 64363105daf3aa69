"""The cost model against what the engine does: bytes read, loads and pinned bytes of a mixed placement
measured on small stores, the shape read from a config against a store's, and the search's choices."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import pytest
import torch

import phantom
import phantom.model.backends
import phantom.model.phantom_model
import phantom.stream.hostmem
import phantom.stream.memory
import phantom.stream.placement
import phantom.stream.scheduler
from phantom.plan import costinputs as ci, costmodel as cm, planner
from phantom.arch.config import ModelConfig
from phantom.arch.presets import preset
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Activations, Placement
from phantom.stream.scheduler import BlockScheduler
from phantom.files.store import BlockStore
from phantom.files.tensorfile import DATA_ALIGN
from conftest import rss_bytes

# 8 blocks, so a placement can have blocks in every tier and streamed blocks both reused and reloaded
CFG = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
GiB = 1 << 30
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def store(request, tmp_path_factory):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[request.param]
    return write_synthetic(tmp_path_factory.mktemp("cm") / request.param, CFG, dtype, seed=3, progress=False)


def steady_step_metrics(model, steps: int = 3) -> list[dict]:
    """Scheduler metrics of each step after the first (which also fills the slots)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
        model(tokens, targets=tokens).backward()
        m = model.scheduler.take_metrics()
        if s:
            out.append(m)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("n_device,n_ram", [(0, 3), (2, 3), (0, 0), (2, 6)])
def test_bytes_read_per_step_equal_the_schedulers(store, device, prefetch, n_device, n_ram):
    s = BlockStore(store)
    shape = ci.shape_of(CFG, s.manifest["dtype"], "fp32", seq_len=16)
    profile = ci.MachineProfile(machine="test", device=device)
    # budgets as a user gives them: the device's holds the slots and n_device blocks, the RAM's n_ram blocks
    slots = (prefetch + 1) * shape.tier_bytes
    place = Placement(offload="auto", prefetch=prefetch, ram_budget=n_ram * shape.tier_bytes,
                      device_budget=slots + n_device * shape.tier_bytes)
    pred = cm.predict(profile, shape, place, Activations(recompute="all"), rows=2)
    with phantom.load(store, device=device, dtype="fp32", placement=place, recompute="all") as model:
        assert model.scheduler.tiers == pred.tiers
        for m in steady_step_metrics(model):
            assert m["bytes_read"] == pred.bytes_read
            assert m["loads"] == pred.loads
    if device == "cpu":
        assert pred.split["device"] == 0  # a CPU has no device tier: those blocks are RAM
    elif n_device:
        assert pred.split["device"] == n_device
    assert pred.split["disk"] == CFG.n_layers - pred.split["device"] - pred.split["ram"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_bytes_are_the_ram_tier_rounded_to_4k(store):
    s = BlockStore(store)
    shape = ci.shape_of(CFG, s.manifest["dtype"], "fp32", seq_len=16)
    place = Placement(offload="ram", prefetch=1)
    pred = cm.predict(ci.MachineProfile(machine="t", device="cuda"), shape, place, Activations(), rows=2)
    with phantom.load(store, device="cuda", dtype="fp32", placement=place) as model:
        assert model.scheduler.pinned_bytes == pred.pinned_bytes == CFG.n_layers * cm.align(s.block_nbytes)


def test_shape_from_the_config_is_the_stores(store):
    s = BlockStore(store)
    shape = ci.shape_of(CFG, s.manifest["dtype"], "fp32", seq_len=16)
    assert shape.block_bytes == s.block_nbytes
    assert abs(shape.store_bytes - sum(e.nbytes for e in [s.embed, s.head, *s.blocks])) == 0
    assert cm.ALIGN == DATA_ALIGN
    assert (cm.HUGE_PAGE, cm.HUGE_MIN) == (phantom.stream.hostmem.HUGE_PAGE, phantom.stream.hostmem.HUGE_MIN)
    assert shape.converts == (s.dtype != torch.float32)


@pytest.mark.parametrize("cfg,t", [(CFG, 16), (dataclasses.replace(CFG, dim=128, n_kv_heads=4, n_layers=2), 48)])
def test_kept_activation_bytes_match_what_autograd_keeps(tmp_path, cfg, t):
    path = write_synthetic(tmp_path / "s", cfg, torch.float32, seed=0, progress=False)
    with phantom.load(path, dtype="fp32", offload="disk", recompute="none") as model:
        tokens = torch.randint(0, cfg.vocab_size, (2, t))
        model(tokens, targets=tokens).backward()
        kept = model.executor.kept_per_block / 2  # per row
    predicted = ci.shape_of(cfg, "fp32", "fp32", seq_len=t).keep_bytes_per_row
    assert predicted == pytest.approx(kept, rel=0.06)


def test_loads_by_tier_and_the_turn():
    """The last prefetch + 1 streamed blocks of the forward and the first of the backward are reused."""
    shape = ci.shape_of(CFG, "bf16", "bf16", 16)
    gpu = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=None, free_host_bytes=None)
    tiers = ("device",) * 2 + ("ram",) * 3 + ("disk",) * 3
    p = cm.predict(gpu, shape, Placement(prefetch=1), Activations(), 4, tiers=tiers)
    # streamed: 3 RAM + 3 disk; m = 2 reused at each turn: the forward loads 4, the backward 4
    assert p.loads == 8 and p.bytes_read == (1 + 3) * shape.block_bytes  # disk: last 2 once, first one twice
    assert p.bytes_h2d == 8 * shape.block_bytes
    cpu = dataclasses.replace(gpu, device="cpu")  # RAM used in place: only the disk blocks stream
    p = cm.predict(cpu, shape, Placement(prefetch=1), Activations(), 4, tiers=("ram",) * 5 + ("disk",) * 3)
    assert p.loads == 2 and p.bytes_read == 2 * shape.block_bytes and p.bytes_h2d == 0


def test_pinned_and_host_memory_are_exact_sizes():
    shape = ci.shape_of(preset("70B"), "bf16", "bf16", 1024)
    gpu = ci.MachineProfile(machine="t", device="cuda")
    tiers = ("device",) * 10 + ("ram",) * 30 + ("disk",) * 40
    p = cm.predict(gpu, shape, Placement(prefetch=2), Activations(), 4, tiers=tiers)
    stride = -(-shape.block_bytes // 4096) * 4096
    assert p.pinned_bytes == (30 + 3) * stride  # RAM tier + one staging buffer per slot, no power-of-two rounding
    assert p.pinned_bytes < 34 * shape.block_bytes
    no_disk = cm.predict(gpu, shape, Placement(prefetch=2), Activations(), 4, tiers=tiers[:40] + ("ram",) * 40)
    assert no_disk.pinned_bytes == 70 * stride  # no staging without a disk tier


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the RSS from /proc")
def test_a_host_buffer_is_resident_within_the_cost_models_bytes():
    """A huge-page HostBuffer, touched whole, holds at least its bytes and at most host_buffer_bytes."""
    n = cm.HUGE_MIN + 3 * cm.ALIGN + 5
    torch.zeros(1 << 20).fill_(1)  # the first fill's own allocations (thread pool) not counted
    buf = phantom.stream.hostmem.HostBuffer(n, pin=False)
    before = rss_bytes()
    buf.tensor.fill_(1)
    grown = rss_bytes() - before
    assert cm.align(n) - (1 << 20) <= grown <= cm.host_buffer_bytes(n) + (1 << 20), (grown, n)
    assert cm.host_buffer_bytes(n) - n < cm.HUGE_PAGE and cm.host_buffer_bytes(cm.HUGE_MIN - 1) == cm.HUGE_MIN


def test_recompute_policy_trades_time_for_memory():
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    gpu = ci.MachineProfile(machine="t", device="cuda", fwd_flops=1e9)
    tiers = ("device",) * 8
    rc_all, rc_none = (cm.predict(gpu, shape, Placement(), Activations(recompute=r), 4, tiers=tiers)
                       for r in ("all", "none"))
    assert rc_none.step_s < rc_all.step_s and rc_none.device_bytes > rc_all.device_bytes
    half = shape.keep_bytes_per_row * 4 * 4  # four blocks' graphs
    auto = cm.predict(gpu, shape, Placement(), Activations(recompute="auto", keep_budget=half), 4, tiers=tiers)
    assert auto.kept_blocks == 4 and rc_none.step_s < auto.step_s < rc_all.step_s
    # the full formula, by hand: 8 resident blocks, forward 1x, backward 1x, recompute 1x more
    f = 4 * shape.flops_per_row / 1e9
    head = 4 * shape.head_flops_per_row / 1e9
    assert rc_all.step_s == pytest.approx(8 * 3 * f + head) and rc_none.step_s == pytest.approx(8 * 2 * f + head)


def test_a_resident_model_keeps_every_graph_whatever_the_policy(store):
    """offload "none" is plain autograd (ResidentBlocks): each block runs forward once a step under any recompute
    policy (counted), so the cost model predicts it as keeping every graph: no recomputed forward, every graph's
    bytes."""
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    cpu = ci.MachineProfile(machine="t", device="cpu", fwd_flops=1e9, free_host_bytes=64 * GiB)
    resident = {r: cm.predict(cpu, shape, Placement(offload="none"), Activations(recompute=r), 2)
                for r in ("all", "none")}
    assert resident["all"].step_s == resident["none"].step_s and resident["all"].kept_blocks == CFG.n_layers
    assert resident["all"].host_bytes == resident["none"].host_bytes
    streamed = cm.predict(cpu, shape, Placement(offload="ram"), Activations(recompute="all"), 2)
    assert streamed.kept_blocks == 0 and streamed.compute_s > resident["all"].compute_s
    calls = {}
    for offload in ("none", "ram"):
        with phantom.PhantomModel(BlockStore(store), "cpu", torch.float32, Placement(offload=offload),
                                  Activations(recompute="all")) as model:
            n = [0]
            hooks = [b.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1)) for b in model.layers]
            tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            model(tokens, targets=tokens).backward()
            calls[offload] = n[0]
            for h in hooks:
                h.remove()
    assert calls == {"none": CFG.n_layers, "ram": 2 * CFG.n_layers}


@pytest.mark.parametrize("free_blocks", [None, 3.5])
def test_recompute_auto_without_a_budget_recomputes_the_blocks_a_run_recomputes(store, free_blocks, monkeypatch):
    """recompute "auto" with no keep budget: a run keeps blocks within half the free host memory
    (phantom.model.backends.default_keep_budget) and reruns the forward of the rest in its backward. The cost
    model counts the same blocks, checked against the block forwards the run makes: n, and one more for each
    block it does not keep. Free memory as this machine has it (every block kept: the step is "none"'s), and
    as little as 3.5 kept blocks' graphs need, twice (the run keeps 3)."""
    if BlockStore(store).dtype != torch.float32:
        pytest.skip("one store dtype is enough")
    rows, t, n = 2, 16, CFG.n_layers
    shape = ci.shape_of(CFG, "fp32", "fp32", t)
    free = phantom.stream.memory.free_host_bytes()
    if free_blocks is not None:
        free = int(2 * free_blocks * rows * shape.keep_bytes_per_row)
        monkeypatch.setattr(phantom.model.backends, "free_host_bytes", lambda: free)
    with phantom.PhantomModel(BlockStore(store), "cpu", torch.float32, Placement(offload="disk", prefetch=1),
                              Activations(recompute="auto")) as model:
        calls = [0]
        for b in model.layers:
            b.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        tokens = torch.randint(0, CFG.vocab_size, (rows, t), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # the second step: the executor knows a kept block's bytes from the first
            calls[0] = 0
            model(tokens, targets=tokens).backward()
    cpu = ci.MachineProfile(machine="t", device="cpu", fwd_flops=1e9, free_host_bytes=free)
    pred = cm.predict(cpu, shape, Placement(offload="disk", prefetch=1), Activations(recompute="auto"), rows)
    assert calls[0] == 2 * n - pred.kept_blocks
    assert pred.kept_blocks == (n if free_blocks is None else 3)
    if free_blocks is None:
        keep_all = cm.predict(cpu, shape, Placement(offload="disk", prefetch=1), Activations(recompute="none"), rows)
        assert pred.step_s == keep_all.step_s


def test_the_search_keeps_what_memory_allows_and_says_what_is_missing():
    shape = ci.shape_of(preset("70B"), "bf16", "bf16", 1024)
    big = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=80 * GiB, free_host_bytes=1024 * GiB,
                            h2d_gbps=55, fwd_flops=500e12, disk_gbps=2)
    best = planner.choose(planner.search(big, shape, 4))
    assert best.split["disk"] == 0 and best.split["device"] > 20 and best.fits
    assert best.device_bytes <= 80 * GiB * (1 - cm.MARGIN)
    small = dataclasses.replace(big, free_device_bytes=24 * GiB, free_host_bytes=64 * GiB)
    best = planner.choose(planner.search(small, shape, 4))
    assert best.split["disk"] > 0 and best.split["ram"] > 0 and best.bound == "disk"
    assert best.host_bytes <= 64 * GiB * (1 - cm.MARGIN)
    no_disk = dataclasses.replace(small, free_disk_bytes=100 * 10**9)  # the 70B store is ~138 GB
    with pytest.raises(ValueError, match=r"needs 3[0-9]\.[0-9] GiB more disk space"):
        planner.choose(planner.search(no_disk, shape, 4))
    with pytest.raises(ValueError, match="more device memory"):
        planner.choose(planner.search(dataclasses.replace(small, free_device_bytes=4 * GiB), shape, 4))


def test_the_ram_set_sits_between_disk_ends_and_reads_the_least():
    """Streamed blocks at either end are reused at a turn (read once), the middle ones read twice: with
    RAM blocks streamed (CUDA), the disk tier takes both ends, and no other RAM set reads fewer bytes."""
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    gpu = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=None, free_host_bytes=None)
    place = Placement(offload="auto", resident=0, prefetch=1, ram_budget=3 * shape.tier_bytes)
    pred = cm.predict(gpu, shape, place, Activations(), 4)
    assert pred.tiers == ("disk",) * 2 + ("ram",) * 3 + ("disk",) * 3
    every = [cm.predict(gpu, shape, place, Activations(), 4, tiers=tuple(
        "ram" if i in ram else "disk" for i in range(8))).bytes_read for ram in itertools.combinations(range(8), 3)]
    assert pred.bytes_read == min(every) == 6 * shape.block_bytes  # 5 disk blocks, one of them in the middle
    assert cm.predict(gpu, shape, place, Activations(), 4, tiers=("ram",) * 3 + ("disk",) * 5).bytes_read == \
        8 * shape.block_bytes  # the RAM set first, as before: two more reads per step
    # a CPU uses its RAM tier in place: only disk blocks stream, their order does not matter
    assert cm.predict(dataclasses.replace(gpu, device="cpu"), shape, place, Activations(), 4).tiers == \
        ("ram",) * 3 + ("disk",) * 5


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_scheduler_reads_what_the_split_disk_tier_predicts(store, prefetch, monkeypatch):
    """The RAM tier streamed through slots (CUDA's path, forced on the CPU), disk at both ends."""
    s = BlockStore(store)
    if s.dtype != torch.float32:
        pytest.skip("one store dtype is enough")
    real = phantom.stream.placement.assign_tiers
    monkeypatch.setattr(phantom.stream.placement, "assign_tiers", lambda *a, **k: real(*a, **{**k, "zero_copy": False}))
    monkeypatch.setattr(phantom.model.phantom_model, "BlockScheduler", functools.partial(BlockScheduler, zero_copy=False))
    shape = ci.shape_of(CFG, "fp32", "fp32", seq_len=16)
    place = Placement(offload="auto", resident=0, prefetch=prefetch, ram_budget=3 * shape.tier_bytes)
    pred = cm.predict(ci.MachineProfile(machine="t", device="cuda", free_device_bytes=None, free_host_bytes=None),
                      shape, place, Activations(recompute="all"), rows=2)
    assert pred.tiers[0] == "disk" and pred.split == {"device": 0, "ram": 3, "disk": 5}
    with phantom.load(store, device="cpu", dtype="fp32", placement=place, recompute="all") as model:
        assert model.scheduler.tiers == pred.tiers
        for m in steady_step_metrics(model):
            assert m["bytes_read"] == pred.bytes_read and m["loads"] == pred.loads


def test_a_host_short_with_the_default_ram_tier_gets_a_smaller_one():
    """A 70B on a 20 GiB CPU: every policy with the RAM tier the default budget allows leaves the host
    short (activations live there too); a smaller RAM tier fits, and the tuner finds it."""
    from phantom.arch import presets as config
    cpu = ci.MachineProfile(machine="c", device="cpu", free_host_bytes=20 * GiB, fwd_flops=2e11, disk_gbps=1.5)
    shape = ci.shape_of(config.preset("70B"), "bf16", "bf16", 512)
    default_ram = cm.layout(shape, cpu, Placement()).split["ram"]
    best = planner.choose(planner.search(cpu, shape, 8))
    assert best.fits and best.split["ram"] < default_ram


def test_a_cpu_dequantizes_each_load_on_the_compute_threads_and_a_gpu_in_the_load():
    """On a CPU the compute's threads dequantize a loaded block when it is acquired (phantom.stream.transfer),
    so each load's dequantization adds to the compute however fast the disk, and a load is its read alone; on
    a GPU the dequantization is the load's (the copy stream), hidden behind compute where compute bounds."""
    shape = ci.shape_of(CFG, "bf16", "bf16", 128, "nf4")
    place, acts = Placement(offload="disk", prefetch=2), Activations(recompute="none")
    fast = ci.MachineProfile(machine="c", device="cpu", fwd_flops=1e8, dequant_gbps=1e6, disk_gbps=1e6)
    slow = dataclasses.replace(fast, dequant_gbps=1.0)
    a, b = (cm.predict(p, shape, place, acts, 2) for p in (fast, slow))
    per_load = shape.dequant_bytes / 1e9
    assert a.loads > 0 and b.step_s - a.step_s == pytest.approx(a.loads * per_load, rel=1e-3)
    t = ci.LoadTimes.of_block(slow, shape, ("disk",), warm=False)
    assert t.of("disk") == t.read_s["disk"] and t.compute_dequant_s == pytest.approx(per_load)
    gpu = dataclasses.replace(slow, device="cuda", free_device_bytes=8 * GiB, free_host_bytes=64 * GiB)
    g = ci.LoadTimes.of_block(gpu, shape, ("disk",), warm=False)
    assert g.compute_dequant_s == 0 and g.of("disk") == pytest.approx(g.read_s["disk"] + g.link_s + per_load)
    gpu_fast = dataclasses.replace(gpu, dequant_gbps=1e6)
    assert cm.predict(gpu, shape, place, acts, 2).step_s == pytest.approx(  # compute-bound: hidden
        cm.predict(gpu_fast, shape, place, acts, 2).step_s, rel=1e-6)


def test_a_cpus_dequantization_slows_beside_reads_as_its_compute():
    """The compute's threads dequantize a CPU's loads, beside the loaders' reads of the next blocks: the measured
    compute-beside-reads slowdown applies to that work too, for as long as a load's reads overlap it."""
    shape = ci.shape_of(CFG, "bf16", "bf16", 8, "nf4")
    place, acts = Placement(offload="disk", prefetch=2), Activations(recompute="none")
    per_load = shape.dequant_bytes / 1e9  # seconds at 1 GB/s
    disk = 2 * shape.block_bytes / per_load / 1e9  # a load's read half as long as its dequantization
    alone = ci.MachineProfile(machine="c", device="cpu", fwd_flops=1e15, head_flops=1e15, dequant_gbps=1.0,
                              disk_gbps=disk)
    beside = dataclasses.replace(alone, busy_compute_slowdown=1.5)
    a, b = (cm.predict(p, shape, place, acts, 1) for p in (alone, beside))
    assert a.loads > 0 and b.step_s - a.step_s == pytest.approx(a.loads * 0.5 * per_load / 2, rel=0.02)


def test_a_cpus_loaders_read_in_parallel(tmp_path):
    """Reading from disk, the scheduler runs a loader per slot (up to 3): a load-bound step with a slow read
    request per block takes the loads over the loaders, bounded by the disk's bytes one after another."""
    shape = ci.shape_of(CFG, "bf16", "bf16", 8)
    prof = ci.MachineProfile(machine="c", device="cpu", fwd_flops=1e15, head_flops=1e15, disk_gbps=0.01)
    per_load = shape.block_bytes / 0.01e9
    for k in (0, 1, 2):
        p = cm.predict(prof, shape, Placement(offload="disk", prefetch=k), Activations(recompute="none"), 1)
        assert p.step_s == pytest.approx(p.loads * per_load, rel=0.02), (k, p.step_s, p.loads * per_load)
    lay = cm.layout(shape, prof, Placement(offload="disk", prefetch=2))
    assert cm.loaders_s([1.0] * 6, 3.0, lay, prof) == 3.0  # reads bound: the disk's bytes in series
    assert cm.loaders_s([1.0] * 6, 0.6, lay, prof) == 2.0  # else three loaders' loads in series
    with BlockScheduler(BlockStore(write_synthetic(tmp_path / "s", CFG, torch.bfloat16, progress=False)), "cpu",
                        Placement(offload="disk", prefetch=2)) as sched:
        assert len(sched._threads) == 3  # the loaders the model counts


def test_adapters_in_one_run_read_once_and_compute_k_times():
    """K adapters: K times the rows through each block, the reads of one run; against K separate runs the
    step shrinks toward 1/K where reads bound it and stays K times one run's where compute does."""
    from phantom.plan import costsweep
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    disk = ("disk",) * 8
    slow_disk = ci.MachineProfile(machine="t", device="cuda", fwd_flops=1e12, disk_gbps=0.01, h2d_gbps=1.0,
                                  free_device_bytes=8 * GiB, free_host_bytes=64 * GiB)
    fast_disk = dataclasses.replace(slow_disk, fwd_flops=1e6, disk_gbps=100.0)
    acts = Activations(recompute="all", micro_batch=4)
    place = Placement(offload="disk", prefetch=1)
    for profile, bound in ((slow_disk, "disk"), (fast_disk, "compute")):
        s = costsweep.predict_sweep(profile, shape, place, acts, 4, 4, adapter_bytes=1 << 20)
        one = cm.predict(profile, shape, place, acts, 16, tiers=disk)
        assert s.together.step_s == pytest.approx(one.step_s) and s.together.bytes_read == s.alone.bytes_read
        assert s.together.bound == bound and s.state_bytes == 4 << 20
        assert (s.ratio < 0.3) if bound == "disk" else s.ratio == pytest.approx(1.0, rel=0.05)
    fit = costsweep.adapters_that_fit(slow_disk, shape, place, acts, 4, adapter_bytes=GiB)
    assert 1 <= fit < 8 and costsweep.adapters_that_fit(slow_disk, shape, place, acts, 4, adapter_bytes=64 * GiB) == 0


def test_compute_beside_reads_is_timed_once_the_readers_read_and_over_several_reads(tmp_path, monkeypatch):
    """The compute-beside-reads slowdown (profiles.measure) times a block call after every reader has finished
    its first read (a reader's start is no read), over at least min_s seconds and min_reads reads however short
    the call (a few tokens: far less than one read), and rates the reads by the bytes read in that window."""
    import time as clock

    from phantom.plan import computetimer as ct
    store = BlockStore(write_synthetic(tmp_path / "s", CFG, torch.bfloat16, progress=False))
    reads = []

    def slow_read(path, offset, buf, drop_cache=False):  # a disk that takes 20 ms a block
        clock.sleep(0.02)
        reads.append(buf.numel())
    monkeypatch.setattr(ct, "readinto_exact", slow_read)
    seen, started = [], clock.perf_counter()

    def call():  # a few-token block call: 2 ms
        seen.append(len(reads))
        clock.sleep(0.002)
    t, gbps = ct.measure_overlap(store, call, torch.device("cpu"), 3, True, readers=2, min_s=0.3, min_reads=4)
    assert seen[0] >= 2 and len(seen) > 3  # both readers read before the first call; calls for min_s, not 3
    assert clock.perf_counter() - started >= 0.3 and t >= 0.002
    expected = 2 * store.block_nbytes / 0.02 / 1e9  # two readers, a block each per 20 ms at most
    assert 0.5 * expected < gbps < 1.05 * expected
    seen.clear()
    ct.measure_overlap(store, call, torch.device("cpu"), 3, True, readers=2, min_s=0.0, min_reads=4)
    assert len(reads) - seen[0] >= 4  # no floor on the window: still four reads in it


@pytest.mark.parametrize("t_lo,t_hi,hi", [(0.3, 0.9, 4), (0.628, 0.370, 2), (0.1, 1.0, 4), (0.2, 0.2, 8)])
def test_a_profile_predicts_the_block_calls_it_timed_at_the_planned_rows(t_lo, t_hi, hi):
    """A profile times each block call at 1 row and at the step's rows (hi) and fits `call + row * b`; the cost
    model's calls at hi rows are then the times measured there, whatever the 1-row point: a line through both,
    or (a slope of 0 or less, or a negative call: noise on a shared machine) through the hi point alone. The
    1-row graph forward timed 0.628 s beside a 2-row one of 0.370 s was planned at 0.813 s before."""
    from phantom.plan import computetimer as ct
    from phantom.plan import profiles
    scale = {"fwd": 1.0, "fwd_grad": 1.1, "bwd": 1.7}
    points = {b: {k: t * f for k, f in scale.items()} for b, t in ((1, t_lo), (hi, t_hi))}
    fit = ct.fit_call_and_row(points)
    for k in scale:
        assert fit[f"{k}_call_s"] >= 0 and fit[f"{k}_row_s"] > 0
        assert fit[f"{k}_call_s"] + hi * fit[f"{k}_row_s"] == pytest.approx(points[hi][k])
        if t_hi > t_lo and t_lo - (t_hi - t_lo) / (hi - 1) >= 0:  # a line with a call: through the 1-row point too
            assert fit[f"{k}_call_s"] + fit[f"{k}_row_s"] == pytest.approx(points[1][k])
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    c = dict(fit, head_row_s=0.01, keep_bytes_per_row=shape.keep_bytes_per_row, busy_compute_slowdown=1.0,
             busy_read_slowdown=1.0)
    profile = ci.MachineProfile(machine="t", device="cpu", **profiles.compute_rates(c, shape))
    n = CFG.n_layers
    cf, cb, _ = cm.block_compute(profile, shape, Activations(recompute="none"), hi, keep=n)
    assert cf[0] == pytest.approx(points[hi]["fwd_grad"]) and cb[0] == pytest.approx(points[hi]["bwd"])
    cf, cb, _ = cm.block_compute(profile, shape, Activations(recompute="all"), hi, keep=0)
    assert cf[0] == pytest.approx(points[hi]["fwd"])
    assert cb[0] == pytest.approx(points[hi]["fwd_grad"] + points[hi]["bwd"])
