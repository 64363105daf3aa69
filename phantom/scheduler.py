"""The block scheduler: streams blocks from the store into a fixed set of device slots ahead of use.

A background thread reads (disk tier) or takes (RAM tier) the next K blocks of the plan and copies
them into free slots (a dedicated copy stream and events on CUDA, plain copies elsewhere); the
training thread only waits when a block is late. Slots are evicted by next use in the known plan,
which makes the turn from forward to backward reuse what is still on the device (LIFO). A
write-back queue carries data the other way. Concurrency lives here alone. Imports phantom.store.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from phantom import faults
from phantom.store import BlockStore

log = logging.getLogger(__name__)

OFFLOADS = ("ram", "disk")


class Tracer:
    """Chrome trace events (open in Perfetto / chrome://tracing), one lane per kind of work."""

    LANES = {"compute": 1, "read": 2, "copy": 3, "write-back": 4, "stall": 5}

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: list[dict] = []
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def span(self, lane: str, name: str, start: float, end: float, **args) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "ph": "X", "pid": 0, "tid": self.LANES[lane], "ts": (start - self._t0) * 1e6,
              "dur": (end - start) * 1e6, "args": args}
        with self._lock:
            self.events.append(ev)

    def write(self, path: Path) -> None:
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
                for lane, tid in self.LANES.items()]
        with self._lock:
            events = meta + list(self.events)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)


@dataclass
class Metrics:
    """Counters of one step, reset by `BlockScheduler.take_metrics()`."""

    loads: int = 0
    bytes_read: int = 0  # from disk
    bytes_h2d: int = 0  # host -> device copies
    bytes_d2h: int = 0  # device -> host (write-back)
    read_s: float = 0.0
    copy_s: float = 0.0
    stall_s: float = 0.0  # training thread waiting for a block

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Slot:
    buf: torch.Tensor  # flat uint8 block buffer on the device
    staging: torch.Tensor | None = None  # pinned host buffer (CUDA/mps, disk tier)
    block: int | None = None
    state: str = "empty"  # empty | loading | ready | failed
    users: int = 0
    error: BaseException | None = None
    views: dict | None = None
    free_event: object = None  # CUDA: compute done with the slot's previous block


class BlockScheduler:
    """Streams transformer blocks of a `BlockStore` to a device.

    Args:
        store: the block store.
        device: where blocks are computed.
        offload: "ram" reads every block into host memory once (pinned on CUDA) and copies from
            there; "disk" reads each block from its file when it is needed.
        prefetch: K, how many blocks may be read/copied ahead of the one computing. 0 loads each
            block only when asked for (slowllama's synchronous behaviour). Device memory holds K+1
            streaming slots.
        resident: the first `resident` blocks are copied to the device once and stay there.
        trace: record a Chrome trace of compute, reads, copies and write-back.
        shared_ram: the RAM tier maps the block files read-only instead of copying them, so every
            process on the machine (torchrun's local ranks) shares one copy through the page cache.
            Not with full finetuning, which writes new weights into the RAM tier.
    """

    def __init__(self, store: BlockStore, device: torch.device | str = "cpu", offload: str = "ram",
                 prefetch: int = 2, resident: int = 0, trace: bool = False, shared_ram: bool = False):
        if offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, not {offload!r}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.store, self.device, self.offload, self.prefetch = store, torch.device(device), offload, prefetch
        self.n_blocks = store.n_blocks
        self.resident = min(resident, self.n_blocks)
        self.tracer = Tracer(trace)
        self.metrics = Metrics()
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        pin = self._cuda
        nbytes = store.block_nbytes

        # Host tier: every block in RAM, read once (and verified) here.
        self._ram: list[torch.Tensor | None] = [None] * self.n_blocks
        if offload == "ram":
            for i in tqdm(range(self.n_blocks), desc="loading blocks to RAM", unit="block", disable=None, leave=False):
                if shared_ram:
                    self._ram[i] = store.map_block(i)
                else:
                    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                    store.read_block_into(i, buf)
                    self._ram[i] = buf
                self.metrics.bytes_read += nbytes

        # Resident blocks: their own device buffers, loaded once.
        self._resident_views: dict[int, dict] = {}
        for i in range(self.resident):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            staging = None if offload == "ram" else (buf if self.device.type == "cpu" else torch.empty_like(buf, device="cpu"))
            src = self._host_copy_of(i, staging)
            if src is not buf:
                buf.copy_(src)
            self._resident_views[i] = store.block_views(buf)

        # Streaming slots. On CPU with the RAM tier the host buffer is the device buffer: no copy.
        self._zero_copy = self.device.type == "cpu" and offload == "ram"
        n_slots = 0 if self._zero_copy or self.resident == self.n_blocks else prefetch + 1
        self.slots: list[Slot] = []
        for _ in range(n_slots):
            if self.device.type == "cpu":
                self.slots.append(Slot(buf=torch.empty(nbytes, dtype=torch.uint8)))
            else:
                staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) if offload == "disk" else None
                self.slots.append(Slot(buf=torch.empty(nbytes, dtype=torch.uint8, device=self.device),
                                       staging=staging))
        self._plan: list[int] = []
        self._pos = 0  # index into the plan of the next acquire
        self._cv = threading.Condition()
        self._closed = False
        self._thread = None
        if self.slots:
            self._thread = threading.Thread(target=self._prefetch_loop, name="phantom-prefetch", daemon=True)
            self._thread.start()
        self.writeback = WriteBackQueue(self.tracer, self.metrics)

    # -- the training thread's side ------------------------------------------------------------

    def plan(self, order: list[int]) -> None:
        """Tell the scheduler the order in which blocks will be acquired next (e.g. 0..N-1, N-1..0)."""
        with self._cv:
            self._plan, self._pos = list(order), 0
            self._cv.notify_all()

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights on the device, as views; waits if it is not there yet. Pair with release()."""
        if block in self._resident_views:
            with self._cv:
                self._advance_plan_to(block)
                self._pos += 1
            return self._resident_views[block]
        if self._zero_copy:
            return self.store.block_views(self._ram[block])
        t0 = time.perf_counter()
        with self._cv:
            self._advance_plan_to(block)
            while True:
                self._raise_if_closed()
                slot = self._slot_holding(block)
                if slot is not None and slot.state == "failed":
                    err, slot.state, slot.block, slot.error = slot.error, "empty", None, None
                    raise err
                if slot is not None and slot.state == "ready":
                    break
                self._cv.wait(0.1)
            slot.users += 1
            self._pos += 1
            self._cv.notify_all()
        t1 = time.perf_counter()
        if t1 - t0 > 1e-4:
            self.metrics.stall_s += t1 - t0
            self.tracer.span("stall", f"wait {block}", t0, t1)
        return slot.views

    def release(self, block: int) -> None:
        """The training thread is done with the block (its kernels may still be queued on CUDA)."""
        if block in self._resident_views or self._zero_copy:
            return
        with self._cv:
            slot = self._slot_holding(block)
            assert slot is not None and slot.users > 0, f"release of block {block} that is not acquired"
            slot.users -= 1
            if self._cuda:
                slot.free_event = torch.cuda.Event()
                slot.free_event.record(torch.cuda.current_stream(self.device))
            self._cv.notify_all()

    def host_weights(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights in host memory: the RAM tier's views, or read from the store."""
        if self._ram[block] is not None:
            return self.store.block_views(self._ram[block])
        return self.store.load_block(block)

    def update_block(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        """New values of a block (full finetuning): into the RAM tier and resident copies; any slot
        still holding the old version is dropped so the next acquire loads the new one."""
        for views in ([self.store.block_views(self._ram[block])] if self._ram[block] is not None else []) + \
                ([self._resident_views[block]] if block in self._resident_views else []):
            for k, v in views.items():
                v.copy_(tensors[k])
        with self._cv:
            for s in self.slots:
                if s.block == block and s.state in ("ready", "failed"):
                    assert s.users == 0, f"block {block} updated while in use"
                    s.block, s.state, s.views = None, "empty", None
            self._cv.notify_all()

    def take_metrics(self) -> dict:
        """This step's counters (and achieved GB/s); resets them."""
        with self._cv:
            m, self.metrics = self.metrics, Metrics()
            self.writeback.metrics = self.metrics
        d = m.as_dict()
        d["read_gbps"] = m.bytes_read / m.read_s / 1e9 if m.read_s > 0 else 0.0
        d["copy_gbps"] = m.bytes_h2d / m.copy_s / 1e9 if m.copy_s > 0 else 0.0
        return d

    def close(self) -> None:
        """Stop the prefetch thread and drain the write-back queue (re-raising its errors)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.writeback.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- internals (hold self._cv unless noted) ---------------------------------------------------

    def _raise_if_closed(self):
        if self._closed:
            raise RuntimeError("the block scheduler is closed")

    def _advance_plan_to(self, block: int) -> None:
        """Move the plan position to the next use of block; an unplanned acquire gets a plan of its own."""
        for p in range(self._pos, len(self._plan)):
            if self._plan[p] == block:
                self._pos = p
                break
        else:
            self._plan, self._pos = [block], 0
        self._cv.notify_all()  # the prefetch window moved

    def _slot_holding(self, block: int) -> Slot | None:
        for s in self.slots:
            if s.block == block and s.state != "empty":
                return s
        return None

    def _next_use(self, block: int, start: int) -> float:
        for p in range(start, len(self._plan)):
            if self._plan[p] == block:
                return p
        return float("inf")

    def _next_load(self) -> tuple[Slot, int] | None:
        """The earliest block in the prefetch window that is not in a slot, and a slot to put it in."""
        window = self._plan[self._pos: self._pos + self.prefetch + 1]
        for p, block in enumerate(window, start=self._pos):
            if block in self._resident_views or self._slot_holding(block) is not None:
                continue
            # Evict the slot whose block is needed furthest in the future (Belady; known plan).
            best, best_use = None, p
            for s in self.slots:
                if s.users or s.state == "loading":
                    continue
                use = float("inf") if s.state in ("empty", "failed") else self._next_use(s.block, self._pos)
                if use > best_use:
                    best, best_use = s, use
            if best is None:
                return None  # every slot holds something needed sooner; wait for a release
            return best, block
        return None

    def _prefetch_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (task := self._next_load()) is None:
                    self._cv.wait()
                if self._closed:
                    return
                slot, block = task
                slot.block, slot.state, slot.error, slot.views = block, "loading", None, None
                free_event, slot.free_event = slot.free_event, None
            try:
                self._load(slot, block, free_event)
                faults.point("prefetch.load")  # crash tests: a block loaded, not yet handed over
                state, error = "ready", None
            except BaseException as e:  # surfaced in the training thread by acquire()
                log.debug("prefetch of block %d failed", block, exc_info=True)
                state, error = "failed", e
            with self._cv:
                slot.state, slot.error = state, error
                self._cv.notify_all()

    def _host_copy_of(self, block: int, staging: torch.Tensor | None = None) -> torch.Tensor:
        """Block bytes in host memory: the RAM tier's buffer, or read from disk into staging. No lock."""
        if self._ram[block] is not None:
            return self._ram[block]
        assert staging is not None
        t0 = time.perf_counter()
        self.store.read_block_into(block, staging)
        t1 = time.perf_counter()
        self.metrics.read_s += t1 - t0
        self.metrics.bytes_read += staging.numel()
        self.tracer.span("read", f"read {block}", t0, t1, bytes=staging.numel())
        return staging

    def _load(self, slot: Slot, block: int, free_event) -> None:
        """Fill slot with block (runs in the prefetch thread, without the lock)."""
        if self.device.type == "cpu":
            self._host_copy_of(block, slot.buf)  # disk tier: read straight into the slot
        else:
            src = self._host_copy_of(block, slot.staging)
            t0 = time.perf_counter()
            if self._cuda:
                with torch.cuda.stream(self._copy_stream):
                    if free_event is not None:
                        self._copy_stream.wait_event(free_event)
                    slot.buf.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._copy_stream)
                done.synchronize()
            else:
                slot.buf.copy_(src)
                if self.device.type == "mps":
                    torch.mps.synchronize()
            t1 = time.perf_counter()
            self.metrics.copy_s += t1 - t0
            self.metrics.bytes_h2d += slot.buf.numel()
            self.tracer.span("copy", f"copy {block}", t0, t1, bytes=slot.buf.numel())
        self.metrics.loads += 1
        slot.views = self.store.block_views(slot.buf)


class WriteBackQueue:
    """A bounded queue of work moving data off the device (or to disk), run by one worker thread.

    submit() blocks when `maxsize` items are pending (back-pressure) and re-raises the first error
    a previous item hit, so a failed write-back stops training in the training thread.
    """

    def __init__(self, tracer: Tracer | None = None, metrics: Metrics | None = None, maxsize: int = 4):
        self.tracer, self.metrics = tracer or Tracer(False), metrics
        self._q: queue.Queue = queue.Queue(maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="phantom-writeback", daemon=True)
        self._thread.start()

    def submit(self, fn, *args, name: str = "write-back") -> Future:
        self._raise_error()
        fut: Future = Future()
        self._q.put((fn, args, name, fut))
        return fut

    def flush(self) -> None:
        """Wait until every submitted item is done; re-raise the first error."""
        self._q.join()
        self._raise_error()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        self._raise_error()

    def _raise_error(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _loop(self):
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            fn, args, name, fut = item
            faults.point("writeback.item")  # crash tests: a write-back about to run
            t0 = time.perf_counter()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                if self._error is None:
                    self._error = e
                fut.set_exception(e)
            self.tracer.span("write-back", name, t0, time.perf_counter())
            self._q.task_done()
