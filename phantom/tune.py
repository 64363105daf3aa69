"""Tuning per machine: measure the machine once, predict a step with a cost model, choose a placement.

`measure` fills a `MachineProfile` (disk, link, one block's compute, free memory), `search` ranks
every `Placement` the profile allows, `auto_placement` is what `--prefetch auto` calls. Imports
phantom.store, phantom.model and phantom.config only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from phantom.model import ChunkedHeadLoss, PhantomModel, WeightHandles
from phantom import placement as P
from phantom.store import BlockStore, atomic_write_json, dtype_name, parse_dtype, readinto_exact

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
MARGIN = 0.15  # keep this fraction of free memory unused
TOLERANCE = 0.20  # check_prediction speaks up beyond this relative error
PREFETCH = (0, 1, 2, 3, 4, 6, 8)
RECOMPUTE = ("all", "none")
FIXED_BYTES = 256 << 20  # loss chunks, LoRA and optimizer state, allocator slack


@dataclass(frozen=True)
class MachineProfile:
    """What `measure` found on one machine for one model (times in seconds, sizes in bytes).

    Compute times are per block call of `b` rows of `seq_len` tokens, fitted as `call + row * b`:
    `fwd` is the no-grad forward, `fwd_grad` the forward that builds a graph (the recompute, or a
    kept block's forward), `bwd` the backward alone. `keep_bytes_per_row` is what autograd saves for
    one block and one row (weights excluded); `act_bytes_per_row` is one block input row.
    """

    machine: str
    model: str
    device: str
    dtype: str
    quick: bool
    n_blocks: int
    block_bytes: int
    store_bytes: int
    head_bytes: int
    seq_len: int
    act_bytes_per_row: int
    keep_bytes_per_row: int
    disk_warm_gbps: float
    disk_cold_gbps: float | None  # None: could not be made cold here
    disk_jitter: float  # relative std of one block's read time
    h2d_gbps: float
    d2h_gbps: float
    zero_copy: bool  # the device is host memory: the RAM tier needs no copy
    fwd_call_s: float
    fwd_row_s: float
    fwd_grad_call_s: float
    fwd_grad_row_s: float
    bwd_call_s: float
    bwd_row_s: float
    head_row_s: float
    free_device_bytes: int
    free_host_bytes: int
    busy_compute_slowdown: float = 1.0  # block forward time while blocks are read / alone
    busy_read_slowdown: float = 1.0  # block read time while a block computes / alone
    measured_at: str = ""

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')} is not {PROFILE_VERSION}")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class Placement:
    """A way to run the model, and what the cost model predicts for it.

    Args:
        offload: "ram" (every block in host memory) or "disk" (read from the files per use).
        prefetch: K, blocks read/copied ahead; the scheduler keeps K + 1 device slots.
        resident: blocks loaded on the device once and kept.
        micro_batch: rows per block call; accum: calls per block per step (rows = micro_batch * accum).
        recompute: "all" (rerun each block's forward in backward) or "none" (keep activations).
        step_s: predicted seconds per optimizer step; compute_s, transfer_s: its two sides.
        bound: what limits it: "compute", "disk", "link" or "memory" (a faster placement did not fit).
        device_bytes, host_bytes: predicted peak use; on a CPU the two are one pool.
        loads: blocks loaded per step (2 * (S - w) in `predict`; 0 when nothing streams).
        zero_copy: the RAM tier is the device's own memory (a CPU): blocks are used where they lie.
        fits: within free memory less the safety margin.
    """

    offload: str
    prefetch: int
    resident: int
    micro_batch: int
    accum: int
    recompute: str
    step_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    bound: str = ""
    device_bytes: int = 0
    host_bytes: int = 0
    loads: int = 0
    zero_copy: bool = False
    fits: bool = True

    @property
    def rows(self) -> int:
        return self.micro_batch * self.accum

    def describe(self) -> str:
        return (f"--offload {self.offload} --prefetch {self.prefetch} resident={self.resident} "
                f"micro_batch={self.micro_batch} accum={self.accum} recompute={self.recompute}")


# ---------------------------------------------------------------------------------------------
# The cost model

def predict(p: MachineProfile, offload: str, prefetch: int, resident: int, micro_batch: int, accum: int,
            recompute: str = "all", seq_len: int | None = None, cold: bool | None = None,
            margin: float = MARGIN) -> Placement:
    """Predicted step time and memory of one placement.

    For N = micro_batch * accum rows (m = accum calls of b = micro_batch rows), per block and pass:

        Cf = m * fwd_call + N * fwd_row          forward ("none": the graph-building forward)
        Cb = m * bwd_call + N * bwd_row          backward ("all": + the recompute, a graph forward)
        X  = block_bytes / disk_GBps             disk tier (cold unless the store fits the page cache)
           + block_bytes / h2d_GBps              on a GPU; the CPU's RAM tier is zero-copy: X = 0

    With R resident blocks, S = n - R streamed ones and w = min(K + 1, S) of them still in the
    K + 1 slots at each turn (the scheduler reuses them LIFO, so 2 * (S - w) loads per step):

        pipe(C) = C + (S - 1) * (C + X)                              K = 0: load, then compute
        pipe(C) = S * C                                              K >= 1 and S == w (all fit)
        pipe(C) = max(w * C + (S - w) * C', 2 * C + (S - w) * X')    K >= 1: compute or loads bound
                  + (S - w) * jitter * min(C, X) / K                 read variance the queue absorbs

    where overlapped work runs slower by the measured contention (a CPU reads and computes with
    the same cores and memory bus; ~1 on a GPU), for the fraction of the time the two overlap:
        C' = C * (1 + (busy_compute_slowdown - 1) * min(1, X / C))
        X' = X + disk_s * (busy_read_slowdown - 1) * min(1, C / X)
        step    = R * (Cf + Cb) + pipe(Cf) + pipe(Cb) + N * head_row

    Memory, device side: (K + 1 slots if S > 0) + R blocks, + the saved block inputs
    n * N * act_row ("all") or the kept activations n * N * keep_row ("none"), + one micro-batch's
    graph b * keep_row, + the block output and its gradient 2 * N * act_row, + the head. Host side:
    the RAM tier's n blocks, + K + 1 pinned staging buffers for the disk tier on a GPU. Times and
    activations scale with seq_len linearly from the profile's.
    """
    n, bb = p.n_blocks, p.block_bytes
    N, m = micro_batch * accum, accum
    scale = (seq_len or p.seq_len) / p.seq_len
    fwd = (m * p.fwd_call_s + N * p.fwd_row_s) * scale
    fwd_grad = (m * p.fwd_grad_call_s + N * p.fwd_grad_row_s) * scale
    bwd = (m * p.bwd_call_s + N * p.bwd_row_s) * scale
    cf, cb = (fwd, fwd_grad + bwd) if recompute == "all" else (fwd_grad, bwd)

    zero_copy = p.zero_copy and offload == "ram"
    R = 0 if zero_copy else min(resident, n)
    S = n - R
    K = prefetch
    if cold is None:
        cold = p.store_bytes > p.free_host_bytes * (1 - margin) / 2
    disk_gbps = (p.disk_cold_gbps or p.disk_warm_gbps) if cold else p.disk_warm_gbps
    disk_s = bb / (disk_gbps * 1e9) if offload == "disk" else 0.0
    link_s = 0.0 if p.zero_copy else bb / (p.h2d_gbps * 1e9)
    X = disk_s + link_s
    w = 0 if zero_copy else min(K + 1, S)

    def pipe(c: float) -> float:
        if S == 0 or zero_copy:
            return S * c
        if K == 0:
            return c + (S - 1) * (c + X)
        if S == w:
            return S * c
        c_busy = c * (1 + (p.busy_compute_slowdown - 1) * min(1.0, X / c))
        x_busy = X + disk_s * (p.busy_read_slowdown - 1) * min(1.0, c / X)
        return max(w * c + (S - w) * c_busy, 2 * c + (S - w) * x_busy) + (S - w) * p.disk_jitter * min(c, X) / K

    head = N * p.head_row_s * scale
    step = R * (cf + cb) + pipe(cf) + pipe(cb) + head
    compute = n * (cf + cb) + head

    act, keep = p.act_bytes_per_row * scale, p.keep_bytes_per_row * scale
    slots = 0 if zero_copy or S == 0 else K + 1
    saved = n * N * (act if recompute == "all" else keep)
    device = int((slots + R) * bb + saved + micro_batch * keep + 2 * N * act + p.head_bytes + FIXED_BYTES)
    host = n * bb if offload == "ram" else 0
    if offload == "disk" and not p.zero_copy:
        host += slots * bb  # pinned staging
    if p.zero_copy:
        fits = device + host <= p.free_host_bytes * (1 - margin)
    else:
        fits = device <= p.free_device_bytes * (1 - margin) and host <= p.free_host_bytes * (1 - margin)

    transfer = 2 * (S - w) * X
    if step <= 1.1 * compute or transfer == 0:
        bound = "compute"
    else:
        bound = "disk" if disk_s >= link_s else "link"
    return Placement(offload, K if slots else 0, R, micro_batch, accum, recompute, step, compute, transfer, bound,
                     device, host, 0 if zero_copy else 2 * (S - w), zero_copy, fits)


def pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def search(p: MachineProfile, batch_size: int, seq_len: int | None = None, max_batch_size: int | None = None,
           offloads: tuple[str, ...] = ("ram", "disk"), recompute: tuple[str, ...] = RECOMPUTE,
           prefetch: tuple[int, ...] = PREFETCH, resident: tuple[int, ...] | None = None,
           cold: bool | None = None, margin: float = MARGIN) -> list[Placement]:
    """Every candidate placement, fitting ones first, each group by predicted time per row.

    Candidates: each tier in `offloads`, prefetch depth in `prefetch` (up to the streamed blocks),
    resident blocks (default 0..n), micro-batches that divide the step (powers of two and the step
    itself), each recompute policy, and rows per step: `batch_size` (the user's optimizer batch)
    or, with `max_batch_size`, every power-of-two multiple of it up to that.
    """
    n = p.n_blocks
    rows_options = [batch_size * f for f in pow2_upto(max(1, (max_batch_size or batch_size) // batch_size))]
    seen, out = set(), []
    for rows in rows_options:
        micros = sorted({b for b in pow2_upto(rows) if rows % b == 0} | {rows})
        for offload in offloads:
            for R in (range(n + 1) if resident is None else resident):
                for K in prefetch:
                    if K > max(0, n - R - 1):
                        continue
                    for b in micros:
                        for rc in recompute:
                            c = predict(p, offload, K, R, b, rows // b, rc, seq_len, cold, margin)
                            key = (c.offload, c.prefetch, c.resident, b, rows, rc)
                            if key not in seen:
                                seen.add(key)
                                out.append(c)
    out.sort(key=lambda c: (not c.fits, c.step_s / c.rows))
    return out


def choose(candidates: list[Placement], tie: float = 0.01) -> Placement:
    """The fastest fitting candidate of `search`.

    Its bound is the side that dominates its time (disk, link or compute), or "memory" when it is
    compute-bound only because a faster placement (e.g. keeping activations) did not fit.

    Candidates within `tie` of the fastest count as equal; among them the choice prefers the
    user's rows per step, then fewer block loads, blocks used in place (zero-copy RAM tier) or
    resident (nothing to move), a deeper queue (it absorbs read-time variance), a larger
    micro-batch (fewer calls) and, last, less memory.

    Raises:
        ValueError: no candidate fits in memory.
    """
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        need = min(candidates, key=lambda c: c.device_bytes + c.host_bytes)
        raise ValueError(f"no placement fits in free memory (the smallest needs {need.device_bytes / 2**30:.1f} GiB "
                         f"on the device and {need.host_bytes / 2**30:.1f} GiB on the host, with a {MARGIN:.0%} "
                         f"margin); use a smaller --batch-size or --seq-len, or free memory")
    t_best = min(c.step_s / c.rows for c in fitting)
    near = [c for c in fitting if c.step_s / c.rows <= t_best * (1 + tie)]
    best = min(near, key=lambda c: (c.rows, c.loads, not c.zero_copy, -c.resident, -c.prefetch, -c.micro_batch,
                                    c.device_bytes + c.host_bytes))
    if best.bound == "compute" and faster_if_more_memory(candidates, best) is not None:
        best = dataclasses.replace(best, bound="memory")
    return best


def faster_if_more_memory(candidates: list[Placement], chosen: Placement, gain: float = 0.05) -> Placement | None:
    """The fastest candidate that does not fit, if it beats the chosen one by more than `gain`."""
    fastest = min(candidates, key=lambda c: c.step_s / c.rows)
    return fastest if fastest.step_s / fastest.rows < (1 - gain) * chosen.step_s / chosen.rows else None


# ---------------------------------------------------------------------------------------------
# Measuring

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_disk(store: BlockStore, max_bytes: int = 1 << 30, passes: int = 2) -> tuple[float, float | None, float]:
    """Read GB/s of the store's block files: (warm, cold or None, relative std of a block read).

    Cold reads evict each file from the page cache first (posix_fadvise DONTNEED, no root needed);
    where that call does not exist only warm reads are measured.
    """
    k = max(2, min(store.n_blocks, max_bytes // max(store.block_nbytes, 1)))
    entries = store.blocks[:k]
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)

    def read_all(drop: bool) -> list[float]:
        times = []
        for e in entries:
            if drop:
                with open(e.path, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            readinto_exact(e.path, e.data_start, buf[: e.nbytes])
            times.append(time.perf_counter() - t0)
        return times

    read_all(False)  # warm the page cache
    warm = [t for _ in range(passes) for t in read_all(False)]
    cold = read_all(True) if hasattr(os, "posix_fadvise") else None
    nbytes = sum(e.nbytes for e in entries)
    times = cold or warm
    jitter = statistics.pstdev(times) / statistics.mean(times)
    if cold is not None:
        read_all(False)  # leave the files warm, as we found them
    return passes * nbytes / sum(warm) / 1e9, nbytes / sum(cold) / 1e9 if cold else None, jitter


def measure_link(device: torch.device, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """Host-to-device and device-to-host GB/s with pinned host buffers (a host memcpy on a CPU)."""
    nbytes = max(1 << 20, min(nbytes, 256 << 20))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def free_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # macOS: half of RAM


def free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    return free_host_bytes()


def measure_overlap(store: BlockStore, fn, device: torch.device, repeats: int, cold: bool) -> tuple[float, float]:
    """(median seconds of fn(), GB/s of block reads) while a thread reads block files in a loop."""
    stop, got = threading.Event(), [0, 0.0]
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)

    def reader():
        t0, i = time.perf_counter(), 0
        while not stop.is_set():
            e, i = store.blocks[i % store.n_blocks], i + 1
            readinto_exact(e.path, e.data_start, buf[: e.nbytes], drop_cache=cold)
            got[0] += e.nbytes
        got[1] = time.perf_counter() - t0

    thread = threading.Thread(target=reader, name="phantom-tune-reader", daemon=True)
    thread.start()
    try:
        t = _timed(fn, device, repeats)
    finally:
        stop.set()
        thread.join()
    return t, got[0] / got[1] / 1e9


def measure_compute(store: BlockStore, device: torch.device, dtype: torch.dtype, seq_len: int, max_rows: int,
                    free_bytes: int, repeats: int = 3, read_gbps: float | None = None, cold: bool = False) -> dict:
    """One block's forward, graph forward and backward per call of b rows, plus the head per row.

    Runs the model's own block call (PhantomModel's default LoRA) on block 0, acquired and bound as
    StreamedBlock holds it, at b = 1 and at the largest power of two dividing `max_rows` whose graphs
    fit well inside `free_bytes`, and fits `call + row * b` through the two points. With `read_gbps`
    (block reads alone, cold or not) it also times the largest forward while a thread reads blocks:
    how much reading and computing slow each other down.
    """
    model = PhantomModel(store, device, dtype, P.Placement(offload="disk", prefetch=0),
                         P.Activations(recompute="all", compile=False))
    try:
        held = model.executor.block_weights(0)  # acquired and bound, as StreamedBlock holds it
        weights = held.__enter__()
        params = [p for name, p in model.layers[0].named_parameters() if "lora_" in name]
        rope, dim, amp = model.rope[:seq_len], model.cfg.dim, model.autocast_args()
        gen = torch.Generator().manual_seed(0)

        def point(b: int, with_head: bool, overlap: bool) -> dict:
            x = torch.randn(b, seq_len, dim, generator=gen).to(device, model.weight_dtype)
            hooks = WeightHandles(weights)
            hooks.bind(weights)
            graphs = []

            def fwd():
                with torch.no_grad(), torch.autocast(**amp):
                    return model.executor.run_block(0, weights, x, rope)

            def fwd_grad():
                xg = x.detach().requires_grad_()
                with torch.enable_grad(), torch.autocast(**amp), \
                        torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                    graphs.append((xg, model.executor.run_block(0, weights, xg, rope)))

            out = fwd()
            g = torch.randn(out.shape, generator=gen).to(device, out.dtype)
            t_fwd = _timed(fwd, device, repeats)
            t_grad = _timed(fwd_grad, device, repeats)
            t_bwd = []
            for xg, o in graphs:
                t0 = time.perf_counter()
                torch.autograd.grad(o, [xg] + params, g)
                _sync(device)
                t_bwd.append(time.perf_counter() - t0)
            h = torch.randn(b, seq_len, dim, generator=gen).to(device, model.weight_dtype).requires_grad_()
            tgt = torch.randint(0, model.cfg.vocab_size, (b, seq_len), generator=gen).to(device)

            def head():
                with torch.autocast(**amp):
                    ChunkedHeadLoss.apply(h, model.norm_weight, model.output_weight, tgt, model.cfg.norm_eps,
                                          model.loss_chunk)
            busy = (1.0, 1.0)
            if overlap and read_gbps:
                t_busy, gbps_busy = measure_overlap(store, fwd, device, repeats, cold)
                busy = (max(1.0, t_busy / t_fwd), max(1.0, read_gbps / gbps_busy))
            return dict(fwd=t_fwd, fwd_grad=t_grad, bwd=statistics.median(t_bwd[1:]), busy=busy,
                        head=_timed(head, device, repeats) / b if with_head else None,
                        keep=hooks.kept_bytes // len(graphs) // b, act=out.element_size() * seq_len * dim)

        points = {1: point(1, with_head=True, overlap=True)}  # the head's cost is per token: one size is enough
        hi = max(b for b in pow2_upto(max_rows) if max_rows % b == 0)
        while hi > 1 and hi * points[1]["keep"] * (repeats + 2) > free_bytes // 4:
            hi //= 2  # the measurement holds repeats + 1 graphs at once: keep it well inside memory
        if hi > 1:
            points[hi] = point(hi, with_head=False, overlap=True)
        head_bytes = model.output_weight.numel() * model.output_weight.element_size()
        held.__exit__(None, None, None)
    finally:
        model.close()
    lo, hi = min(points), max(points)
    fit = {}
    for name in ("fwd", "fwd_grad", "bwd"):
        row = (points[hi][name] - points[lo][name]) / (hi - lo) if hi > lo else points[hi][name] / hi
        if row <= 0:  # noise swamped the slope: no per-call part
            row = points[hi][name] / hi
        fit[f"{name}_row_s"] = row
        fit[f"{name}_call_s"] = max(0.0, points[lo][name] - row * lo)
    return dict(fit, head_row_s=points[1]["head"], keep_bytes_per_row=points[hi]["keep"],
                busy_compute_slowdown=points[hi]["busy"][0], busy_read_slowdown=points[hi]["busy"][1],
                act_bytes_per_row=points[hi]["act"], head_bytes=head_bytes)


def measure(store: BlockStore, device: torch.device | str, dtype: torch.dtype | str, batch_size: int,
            seq_len: int, quick: bool = False) -> MachineProfile:
    """Measure this machine for this model: disk, link, one block's compute, free memory.

    Args:
        store: the model's block store.
        device: where blocks compute.
        dtype: compute dtype.
        batch_size: rows per step; compute is measured at 1 row and at the largest power of two
            that divides it (and fits), which gives the per-call and per-row costs.
        seq_len: tokens per row.
        quick: fewer repeats and a smaller read sample (what `auto_placement` runs without a profile).
    """
    device, dtype = torch.device(device), parse_dtype(dtype)
    repeats = 2 if quick else 4
    t0 = time.perf_counter()
    warm, cold, jitter = measure_disk(store, (256 << 20) if quick else (1 << 30), 1 if quick else 3)
    h2d, d2h = measure_link(device, store.block_nbytes, repeats)
    free_dev, free_host = free_device_bytes(device), free_host_bytes()
    c = measure_compute(store, device, dtype, seq_len, batch_size, free_dev, repeats, cold or warm, cold is not None)
    log.info("measured a %s in %.1f s", "quick profile" if quick else "profile", time.perf_counter() - t0)
    store_bytes = sum(e.path.stat().st_size for e in [store.embed, store.head, *store.blocks])
    return MachineProfile(
        machine=machine_key(device), model=model_key(store, dtype), device=str(device), dtype=dtype_name(dtype),
        quick=quick, n_blocks=store.n_blocks, block_bytes=store.block_nbytes, store_bytes=store_bytes,
        head_bytes=c["head_bytes"], seq_len=seq_len, act_bytes_per_row=c["act_bytes_per_row"],
        keep_bytes_per_row=c["keep_bytes_per_row"], disk_warm_gbps=warm, disk_cold_gbps=cold, disk_jitter=jitter,
        h2d_gbps=h2d, d2h_gbps=d2h, zero_copy=device.type == "cpu",
        **{k: c[k] for k in ("fwd_call_s", "fwd_row_s", "fwd_grad_call_s", "fwd_grad_row_s", "bwd_call_s",
                             "bwd_row_s", "head_row_s", "busy_compute_slowdown", "busy_read_slowdown")},
        free_device_bytes=free_dev, free_host_bytes=free_host, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


# ---------------------------------------------------------------------------------------------
# Profiles on disk, and what the trainer calls

def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


def machine_key(device: torch.device | str) -> str:
    """Host name and device name, e.g. `box-nvidia-h100-80gb-hbm3` or `box-cpu-2c`."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"mps-{platform.machine()}"
    else:
        name = f"cpu-{os.cpu_count()}c"
    return _slug(f"{socket.gethostname()}-{name}")


def model_key(store: BlockStore, dtype: torch.dtype | str) -> str:
    """Store folder name, compute dtype and a hash of the shapes, e.g. `tiny-float32-1a2b3c4d`."""
    shapes = json.dumps([store.manifest["config"], store.manifest["dtype"]], sort_keys=True)
    return _slug(f"{store.path.name}-{dtype_name(parse_dtype(dtype))}") + "-" + \
        hashlib.sha256(shapes.encode()).hexdigest()[:8]


def profile_path(store: BlockStore, device, dtype, profile_dir: Path | str | None = None) -> Path:
    """<profile_dir or $PHANTOM_CACHE/profiles or ~/.cache/phantom/profiles>/<machine>-<model>.json"""
    if profile_dir is None:
        root = Path(os.environ.get("PHANTOM_CACHE") or Path.home() / ".cache" / "phantom")
        profile_dir = root / "profiles"
    return Path(profile_dir) / f"{machine_key(device)}-{model_key(store, dtype)}.json"


def save_profile(profile: MachineProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, profile.to_dict())


def load_profile(path: Path) -> MachineProfile | None:
    """The profile at path, or None if there is none or it is unreadable (it is then measured again)."""
    try:
        return MachineProfile.from_dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring profile %s (%s)", path, e)
        return None


def auto_placement(store_path: Path | str, device: torch.device | str, batch_size: int, seq_len: int,
                   dtype: torch.dtype | str, profile_dir: Path | str | None = None,
                   offloads: tuple[str, ...] = ("ram", "disk"), micro_batch: int | None = None,
                   recompute: tuple[str, ...] = RECOMPUTE) -> Placement:
    """The placement for `--prefetch auto`: from the saved profile, or a quick one measured (and saved) now.

    Free memory is read again at each call (it changes between runs); the rest of the profile is
    reused. Rows per step stay the caller's: the tuner chooses tier, prefetch, resident blocks,
    micro-batch and recompute policy.

    Args:
        store_path: the model's store folder.
        device: a resolved device ("cpu", "cuda", ...; not "auto").
        batch_size: rows per optimizer step (finetune's batch_size * grad_accum).
        seq_len: tokens per row.
        dtype: compute dtype.
        profile_dir: where profiles live (default $PHANTOM_CACHE/profiles or ~/.cache/phantom/profiles).
        offloads: the tiers it may choose from (("disk",) when the user asked for --offload disk).
        micro_batch: keep this micro-batch (the finetune CLI does: it changes the order of sums, so
            a resumed run could differ in its last bits); None lets the tuner choose.
        recompute: the recompute policies it may choose from.

    Raises:
        ValueError: nothing fits in free memory.
    """
    device = torch.device(device)
    store = BlockStore(store_path, verify="none")
    path = profile_path(store, device, dtype, profile_dir)
    profile = load_profile(path)
    if profile is None:
        log.info("no tuning profile at %s: measuring a quick one (python scripts/tune.py for a full one)", path)
        profile = measure(store, device, dtype, batch_size, seq_len, quick=True)
        save_profile(profile, path)
    profile = dataclasses.replace(profile, free_device_bytes=free_device_bytes(device),
                                  free_host_bytes=free_host_bytes())
    candidates = [c for c in search(profile, batch_size, seq_len, offloads=offloads, recompute=recompute)
                  if micro_batch is None or c.micro_batch == micro_batch]
    best = choose(candidates)
    log.info("tuned placement: %s; predicted %.3f s/step (%s-bound)", best.describe(), best.step_s, best.bound)
    return best


MIN_CHECKED_STEP_S = 0.1


def check_prediction(placement: Placement, measured_step_s: float, tolerance: float = TOLERANCE) -> str | None:
    """A line for the log when a measured step differs from the prediction by more than `tolerance`, else None."""
    if placement.step_s <= 0 or measured_step_s <= 0:
        return None
    if max(placement.step_s, measured_step_s) < MIN_CHECKED_STEP_S:
        return None  # steps of a few ms are Python overhead, which the model does not try to predict
    err = measured_step_s / placement.step_s - 1
    if abs(err) <= tolerance:
        return None
    return (f"measured step {measured_step_s:.3f} s is {err:+.0%} off the tuner's prediction "
            f"{placement.step_s:.3f} s ({placement.bound}-bound); if the machine or its load changed, "
            f"re-measure with python scripts/tune.py")


def format_table(candidates: list[Placement], top: int = 12, chosen: Placement | None = None) -> str:
    """The fastest `top` fitting candidates, and the chosen one if it is not among them, as a table."""
    head = (f"{'offload':7s} {'K':>2s} {'res':>3s} {'micro':>5s} {'accum':>5s} {'recomp':6s} "
            f"{'step s':>8s} {'ms/row':>7s} {'compute':>8s} {'transfer':>8s} {'bound':7s} {'dev GB':>7s} "
            f"{'host GB':>7s} fits")
    fitting = [c for c in candidates if c.fits]
    rows = fitting[:top]
    if chosen is not None and not any(_same(c, chosen) for c in rows):
        rows.append(next((c for c in fitting if _same(c, chosen)), chosen))
    lines = [head]
    for c in rows:
        mark = " <- chosen" if chosen is not None and _same(c, chosen) else ""
        lines.append(f"{c.offload:7s} {c.prefetch:2d} {c.resident:3d} {c.micro_batch:5d} {c.accum:5d} "
                     f"{c.recompute:6s} {c.step_s:8.3f} {1e3 * c.step_s / c.rows:7.1f} {c.compute_s:8.3f} "
                     f"{c.transfer_s:8.3f} {c.bound:7s} {c.device_bytes / 1e9:7.2f} {c.host_bytes / 1e9:7.2f} "
                     f"{'yes' if c.fits else 'no'}{mark}")
    lines.append(f"({len(fitting)} of {len(candidates)} candidates fit; {len(candidates) - len(fitting)} "
                 f"need more memory than is free less {MARGIN:.0%})")
    return "\n".join(lines)


def _same(a: Placement, b: Placement) -> bool:
    return (a.offload, a.prefetch, a.resident, a.micro_batch, a.accum, a.recompute) == \
        (b.offload, b.prefetch, b.resident, b.micro_batch, b.accum, b.recompute)
