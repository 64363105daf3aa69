"""Timing a block's compute as training runs it: the clock discipline (sync, medians after a warm-up),
one block's forward, graph forward and backward at two row counts fitted to `call + row * b`, the head,
the slowdown of computing beside a reader, and a bare matmul's rate (what a quick profile chooses its
slice from, phantom.plan.quickslice). phantom.plan.profiles turns these times into a profile's rates.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch

from phantom.arch import carry as C
from phantom.arch.hyper import streams
from phantom.files.directio import readinto_exact
from phantom.files.store import BlockStore
from phantom.model.heads import ChunkedHeadLoss
from phantom.model.phantom_model import PhantomModel
from phantom.plan import planner
from phantom.stream import placement as P
from phantom.stream.executor import WeightHandles
from phantom.stream.hostmem import HostBuffer
from phantom.stream.memory import free_host_bytes


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a clock read after it times the work, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def call_s(fn, device: torch.device) -> float:
    """Seconds of one fn() call, its queued device work included."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    call_s(fn, device)
    return statistics.median(call_s(fn, device) for _ in range(repeats))


def timed_mean(fn, device: torch.device, repeats: int, sample_s: float, most: int, before=None) -> float:
    """Mean seconds of fn() after one warm-up call: at least `repeats` calls, more until `sample_s` seconds
    have passed, at most `most` (an expected cost per call, where `timed`'s median is one typical call);
    `before()` runs untimed before each."""
    call_s(fn, device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (len(times) < most and time.perf_counter() - start < sample_s):
        if before is not None:
            before()
        times.append(call_s(fn, device))
    return statistics.fmean(times)


def measure_beside(fn, background, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() while a thread runs background() in a loop."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            background()

    thread = threading.Thread(target=loop, name="phantom-tune-beside", daemon=True)
    thread.start()
    try:
        return timed(fn, device, repeats)
    finally:
        stop.set()
        thread.join()


OVERLAP_MOST_S = 60.0  # measure_overlap's bound on its window (a reader that stalls ends it)


def measure_overlap(store: BlockStore, fn, device: torch.device, repeats: int, cold: bool, readers: int = 2,
                    min_s: float = 0.5, min_reads: int = 4) -> tuple[float, float]:
    """(median seconds of fn(), GB/s of block reads) while `readers` threads read block files in a loop, as
    profiles.measure_disk reads them alone (the same threads: the ratio is the contention, not the readers).

    fn() is timed once the readers are reading, for at least `repeats` calls, `min_s` seconds and `min_reads`
    reads (up to OVERLAP_MOST_S): a block call of a few tokens takes milliseconds, far less than one read, and
    timed over a handful of calls it caught a reader starting or none at all (slowdowns of 1.3x to 7x in a
    row on one machine). The read rate counts the bytes read within that window, a read that straddles its
    ends in proportion. One reader where two blocks' buffers would take over a quarter of the free host memory
    (the measured block and its graphs are in memory too)."""
    if readers > 1 and readers * store.block_nbytes > (free_host_bytes() or 0) // 4:
        readers = 1
    stop, lock, started = threading.Event(), threading.Lock(), threading.Barrier(readers + 1)
    spans: list[tuple[float, float, int]] = []
    failed: list[BaseException] = []

    def reader(r: int) -> None:
        buf = HostBuffer(store.block_nbytes, pin=False).tensor
        i, first = r, True
        try:
            while not stop.is_set():
                e, i = store.blocks[i % store.n_blocks], i + readers
                t0 = time.perf_counter()
                readinto_exact(e.path, e.data_start, buf[: e.nbytes], drop_cache=cold)
                with lock:
                    spans.append((t0, time.perf_counter(), e.nbytes))
                if first:
                    first = False
                    started.wait()
        except BaseException as err:  # noqa: BLE001 - re-raised on the measuring thread
            failed.append(err)
            started.abort()

    threads = [threading.Thread(target=reader, args=(r,), name=f"phantom-tune-reader{r}", daemon=True)
               for r in range(readers)]
    for t in threads:
        t.start()
    times, w0 = [], time.perf_counter()
    w1 = w0
    try:
        started.wait()  # every reader past its first read: reading steadily
        w0 = time.perf_counter()
        while time.perf_counter() - w0 < OVERLAP_MOST_S and (len(times) < repeats or time.perf_counter() - w0 < min_s
                                                              or sum(1 for a, _, _ in list(spans) if a >= w0) < min_reads):
            times.append(call_s(fn, device))
        w1 = time.perf_counter()
    except threading.BrokenBarrierError:
        pass
    finally:
        stop.set()
        for t in threads:
            t.join()
    if failed:
        raise failed[0]
    got = sum(n * max(0.0, min(b, w1) - max(a, w0)) / (b - a) for a, b, n in spans if b > a)
    return statistics.median(times), got / (w1 - w0) / 1e9


@dataclass(frozen=True)
class Beside:
    """What a block's forward is also timed beside: threads reading block files at disk_gbps (GB/s of block
    reads alone; 0: none), cold or not, for at least window_s seconds (and four reads: measure_overlap), how
    much reading and computing slow each other down."""

    disk_gbps: float = 0.0
    cold: bool = True
    window_s: float = 0.5


class BlockTimer:
    """Times block 0 of a model as training runs it: held and bound as StreamedBlock holds it, called
    through the executor (the model's default LoRA), with the saved tensors counted."""

    def __init__(self, model: PhantomModel, seq_len: int, repeats: int, beside: Beside):
        self.model, self.seq_len, self.repeats, self.beside = model, seq_len, repeats, beside
        self.device = model.device
        self.held = model.executor.block_weights(0)  # acquired and bound, as StreamedBlock holds it
        self.weights = self.held.__enter__()
        self.params = [p for name, p in model.layers[0].named_parameters() if "lora_" in name]
        self.rope, self.amp = model.rope[:seq_len], model.autocast_args()
        self.gen = torch.Generator().manual_seed(0)

    def close(self) -> None:
        self.held.__exit__(None, None, None)

    def point(self, b: int, with_head: bool) -> dict:
        """Seconds of the forward, graph forward and backward of b rows (and the head per row), kept
        bytes per row; with a disk rate, how much a concurrent read slows the forward and the read."""
        model, device, weights, repeats, gen = self.model, self.device, self.weights, self.repeats, self.gen
        x = torch.randn(b, self.seq_len, model.cfg.dim, generator=gen).to(device, model.weight_dtype)
        x = streams(x, model.cfg.hc_mult)  # DeepSeek-V4's residual: its streams; its hashed layers read token ids
        carry = C.start(model.cfg, torch.randint(0, model.cfg.vocab_size, x.shape[:2], generator=gen).to(device))
        hooks = WeightHandles(weights)
        hooks.bind(weights)

        def fwd():
            with torch.no_grad(), torch.autocast(**self.amp):
                return model.executor.run_block(0, x, self.rope, carry=C.split(carry, lambda t: [t], 1)[0])

        def fwd_grad():
            xg = x.detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(**self.amp), \
                    torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                return xg, model.executor.run_block(0, xg, self.rope, carry=C.split(carry, lambda t: [t], 1)[0])

        out = fwd()
        g = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        t_fwd = timed(fwd, device, repeats)
        t_grad, t_bwd = [], []
        for _ in range(repeats + 1):  # each graph's backward before the next forward, as training runs them:
            t0 = time.perf_counter()  # graphs held at once would each take fresh pages and time that too
            xg, o = fwd_grad()
            sync(device)
            t1 = time.perf_counter()
            torch.autograd.grad(o, [xg] + self.params, g)
            sync(device)
            t_grad.append(t1 - t0)
            t_bwd.append(time.perf_counter() - t1)
            del xg, o
        busy = (1.0, 1.0)
        if self.beside.disk_gbps:
            t_busy, gbps_busy = measure_overlap(model.store, fwd, device, repeats, self.beside.cold,
                                               min_s=self.beside.window_s)
            busy = (max(1.0, t_busy / t_fwd), max(1.0, self.beside.disk_gbps / gbps_busy))
        return dict(fwd=t_fwd, fwd_grad=statistics.median(t_grad[1:]), bwd=statistics.median(t_bwd[1:]), busy=busy,
                    head=self.head_s(b) / b if with_head else None,
                    keep=hooks.kept_bytes // len(t_grad) // b, act=out.element_size() * out[0].numel())

    def head_s(self, b: int) -> float:
        """Seconds of the fused head + loss (and its backward's inputs) over b rows."""
        model = self.model
        h = torch.randn(b, self.seq_len, model.cfg.dim, generator=self.gen).to(self.device, model.weight_dtype)
        h.requires_grad_()
        tgt = torch.randint(0, model.cfg.vocab_size, (b, self.seq_len), generator=self.gen).to(self.device)

        def head():
            with torch.autocast(**self.amp):
                ChunkedHeadLoss.apply(h, model.norm_weight, model.output_weight, tgt, model.cfg.norm_eps,
                                      model.loss_chunk)
        return timed(head, self.device, self.repeats)


def measure_compute(store: BlockStore, device: torch.device, dtype: torch.dtype, seq_len: int, max_rows: int,
                    free_bytes: int | None, repeats: int = 3, beside: Beside = Beside()) -> dict:
    """One block's forward, graph forward and backward per call of b rows, plus the head per row.

    Runs the model's own block call (PhantomModel's default LoRA) on block 0, acquired and bound as
    StreamedBlock holds it, at b = 1 and at the largest power of two dividing `max_rows` whose graphs
    fit well inside `free_bytes`, and fits `call + row * b` through the two points. `beside`: what else the
    largest forward is timed beside (how much they slow each other down).
    """
    model = PhantomModel(store, device, dtype, P.Placement(offload="disk", prefetch=0),
                         P.Activations(recompute="all", compile=False))
    try:
        timer = BlockTimer(model, seq_len, repeats, beside)
        points = {1: timer.point(1, with_head=True)}  # the head's cost is per token: one size is enough
        hi = max(b for b in planner.pow2_upto(max_rows) if max_rows % b == 0)
        free = free_bytes if free_bytes is not None else free_host_bytes()
        while hi > 1 and hi * points[1]["keep"] * 2 > (free or 0) // 4:
            hi //= 2  # the measurement holds a graph and its gradients at once: keep it well inside memory
        if hi > 1:
            points[hi] = timer.point(hi, with_head=False)
        head_bytes = model.output_weight.numel() * model.output_weight.element_size()
        timer.close()
    finally:
        model.close()
    hi = max(points)
    return dict(fit_call_and_row(points), head_row_s=points[1]["head"], keep_bytes_per_row=points[hi]["keep"],
                busy_compute_slowdown=points[hi]["busy"][0], busy_read_slowdown=points[hi]["busy"][1],
                act_bytes_per_row=points[hi]["act"], head_bytes=head_bytes)


def fit_call_and_row(points: dict[int, dict]) -> dict:
    """`call + row * b` through the smallest and largest b measured, for each kind of block call; where that
    line has no positive slope or a negative call (noise: a shared machine's 1-row graph forward timed slower
    than its 2-row one), `row * b` alone through the largest b. The largest b is the step's rows (or a micro-batch
    of them) that the profile plans: a line through the smallest point and the largest's slope gave the 2-row
    call `t(1) + t(2) / 2`, 2.2x the 2-row time measured beside it (notes/costmodel-disk.md)."""
    lo, hi = min(points), max(points)
    fit = {}
    for name in ("fwd", "fwd_grad", "bwd"):
        row = (points[hi][name] - points[lo][name]) / (hi - lo) if hi > lo else points[hi][name] / hi
        call = points[lo][name] - row * lo
        if row <= 0 or call < 0:
            row, call = points[hi][name] / hi, 0.0
        fit[f"{name}_row_s"], fit[f"{name}_call_s"] = row, call
    return fit



def matmul_rate(device: torch.device, dtype: torch.dtype, dim: int, tokens: int, repeats: int = 3) -> float:
    """FLOP/s of a (tokens x dim) @ (dim x min(dim, 2048)) matmul in dtype: about what a block's matmuls
    run at, timed in well under a second."""
    a = torch.randn(max(tokens, 16), dim).to(device, dtype)
    b = torch.randn(dim, min(dim, 2048)).to(device, dtype)
    return 2 * a.shape[0] * dim * b.shape[1] / timed(lambda: a @ b, device, repeats)
