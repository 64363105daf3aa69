"""The block scheduler: streams blocks from their tier into a fixed set of device slots ahead of use.

Each block has a tier (phantom.placement.assign_tiers): resident on the device, in host RAM, or in
the store's files. Loader threads take the next blocks of the known plan that are not on the device
and fill free slots as a pipeline: read (disk tier: several requests in flight, O_DIRECT) into the
slot's pinned staging buffer -> copy on a dedicated CUDA stream -> an event the compute stream waits
on, so neither the host nor the compute waits for a copy it does not need yet. A lower-precision
store feeding an fp32 run is converted in that pipeline, never on the compute thread. Slots are
evicted by next use in the plan, so the turn from forward to backward reuses what is still on the
device (LIFO). A write-back queue carries data the other way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from phantom import faults, fileio, quant
from phantom.placement import Placement, assign_tiers
from phantom.placement import ram_budget as default_ram_budget
from phantom.store import DATA_ALIGN, BlockStore, packed_empty

log = logging.getLogger(__name__)

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
        fileio.atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())


@dataclass
class Metrics:
    """Counters of one step, reset by `BlockScheduler.take_metrics()`."""

    loads: int = 0
    bytes_read: int = 0  # from disk (the disk tier)
    bytes_ram: int = 0  # served from the RAM tier
    bytes_h2d: int = 0  # host -> device copies
    read_s: float = 0.0
    copy_s: float = 0.0  # CPU/MPS: copy time; CUDA: the copy stream's time by events (see copy_events)
    stall_s: float = 0.0  # training thread waiting for a block
    dequant_s: float = 0.0  # quantized stores: loader time dequantizing (CUDA: queueing it on the copy stream)
    copy_events: list = field(default_factory=list)  # CUDA: (start, end, bytes) of copies not yet counted

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "copy_events"}

    def count_finished_copies(self) -> list:
        """Adds the finished CUDA copies' device time and bytes (no host sync); returns the unfinished."""
        pending = []
        for start, end, nbytes in self.copy_events:
            if end.query():
                self.copy_s += start.elapsed_time(end) / 1e3
                self.bytes_h2d += nbytes
            else:
                pending.append((start, end, nbytes))
        self.copy_events = []
        return pending


def mem_available() -> int | None:
    """The machine's available host memory (Linux: MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def local_ranks() -> int:
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 when run alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def free_host_bytes(shared: bool = False) -> int | None:
    """This process's share of the available host memory: local ranks size their RAM tiers (and host
    optimizer state) from the same MemAvailable, so each takes 1 / local_ranks() of it, or N ranks
    would pin N machine-sized tiers (cudaHostRegister fails, or the OOM killer fires). `shared`: for
    what one copy serves every local rank (the shared RAM tier), the whole of it."""
    free = mem_available()
    return free if free is None or shared else free // local_ranks()


def free_device_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64; arm64 with 4 KiB base pages)
HUGE_MIN = 16 << 20  # host buffers from this size are backed by huge pages (phantom.store.READ_CHUNK: O_DIRECT)


def huge_page_memory(nbytes: int, dontfork: bool = False) -> torch.Tensor | None:
    """nbytes of fresh anonymous memory, 2 MiB aligned and advised for transparent huge pages, or None
    where the platform has no madvise(MADV_HUGEPAGE) (macOS, Windows). `dontfork`: see mapped_memory.

    Why: an O_DIRECT read DMAs straight into the destination's pages. Over 4 KiB pages scattered in
    physical memory each request is split into many segments (a virtio disk takes 254 a request), and
    the rate depends on how fragmented the buffer happened to be: on the dev VM reads into 4 KiB pages
    ran at 0.8-2.4 GB/s from one buffer to the next, into huge pages at 2.0-2.7 every time
    (notes/bench-tiers.md). Where THP is off ("never") the advice is a no-op: plain pages, as before.
    At most one huge page past nbytes becomes resident (the last one touched).
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    return mapped_memory(nbytes, huge=True, dontfork=dontfork)


def mapped_memory(nbytes: int, huge: bool, dontfork: bool) -> torch.Tensor:
    """nbytes of a fresh anonymous mapping (page aligned; 2 MiB aligned and advised for huge pages when
    `huge`). `dontfork` marks it MADV_DONTFORK: a forked child (a DataLoader worker) gets none of it.
    Pinned memory needs that: drivers pin long-term, and since Linux 5.9 fork copies every pinned
    anonymous page into the child at once (huge pages split first), so each worker would hold a copy
    of the pinned RAM tier."""
    pad = HUGE_PAGE if huge else 0
    mapping = mmap.mmap(-1, max(1, nbytes + pad), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice, wanted in ((getattr(mmap, "MADV_HUGEPAGE", None), huge), (getattr(mmap, "MADV_DONTFORK", None), dontfork)):
        if wanted and advice is not None:
            try:
                mapping.madvise(advice)  # before any page is touched
            except OSError:  # a kernel built without THP (EINVAL): 4 KiB pages, still aligned
                pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped with the last tensor
    skip = -raw.data_ptr() % HUGE_PAGE if huge else 0
    return raw[skip: skip + nbytes]


def aligned_memory(nbytes: int) -> torch.Tensor:
    """nbytes of host memory at a 4 KiB boundary (O_DIRECT's alignment), in the allocator's pages."""
    raw = torch.empty(nbytes + DATA_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DATA_ALIGN
    return raw[skip: skip + nbytes]


class HostBuffer:
    """A host allocation of exactly `nbytes` (4 KiB aligned; huge pages from HUGE_MIN), page-locked for
    CUDA when `pin`, and then marked MADV_DONTFORK (see mapped_memory).

    `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds each
    request up to a power of two (pytorch#150517): 80 blocks of 1.71 GB would pin 160 GiB for 137 GB.
    Here one plain allocation is registered with cudaHostRegister instead, so what is pinned is what
    is needed, and copies from it run at the link's full speed.
    """

    def __init__(self, nbytes: int, pin: bool):
        huge = huge_page_memory(nbytes, dontfork=pin) if nbytes >= HUGE_MIN else None
        if huge is None and pin and hasattr(mmap, "MADV_DONTFORK"):  # a mapping of its own: no fork copies it
            huge = mapped_memory(nbytes, huge=False, dontfork=True)
        self.tensor = huge if huge is not None else aligned_memory(nbytes)  # a view: it keeps the memory
        self.pinned = False
        if pin and nbytes:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (error {int(err)}): "
                                   f"lower the RAM budget (--ram-budget)")
            self.pinned = True
            self._unregister = weakref.finalize(self, cudart.cudaHostUnregister, self.tensor.data_ptr())

    def block(self, offset: int, nbytes: int) -> torch.Tensor:
        """A tensor over bytes [offset, offset + nbytes) that is not a view: it has a version counter
        of its own, so autograd does not see block j's update (full finetuning) as a change of block i."""
        t = torch.empty(0, dtype=torch.uint8)
        return t.set_(self.tensor.untyped_storage(), self.tensor.storage_offset() + offset, (nbytes,))


CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA >= 11.1)


def register_read_only(t: torch.Tensor):
    """Page-lock the pages under a read-only tensor (a file mapping shared by the local ranks) for
    CUDA copies; returns the finalizer that unregisters them, or None where the driver refuses (then
    copies from it stay pageable: slower, correct)."""
    start = t.data_ptr() - t.data_ptr() % DATA_ALIGN
    nbytes = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // DATA_ALIGN) * DATA_ALIGN
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(start, nbytes, CUDA_HOST_REGISTER_READ_ONLY))
    if err != 0:
        log.warning("cudaHostRegister (read-only) of a shared RAM-tier block failed (error %d): its copies "
                    "go through pageable memory", err)
        return None
    return weakref.finalize(t, cudart.cudaHostUnregister, start)


@dataclass
class Slot:
    buf: torch.Tensor  # flat uint8 block buffer (store dtype) on the device
    staging: torch.Tensor | None = None  # host buffer the disk tier reads into (pinned on CUDA)
    converted: dict | None = None  # compute-dtype tensors when the store's dtype differs
    block: int | None = None
    state: str = "empty"  # empty | loading | ready | failed
    users: int = 0
    error: BaseException | None = None
    views: dict | None = None
    free_event: object = None  # CUDA: compute done with the slot's previous block
    ready_event: object = None  # CUDA: the copy into the slot is done
    verify: Future | None = None  # a deferred checksum of the staged bytes
    host: object = None  # keeps the staging HostBuffer (and its registration) alive


class BlockScheduler:
    """Streams transformer blocks of a `BlockStore` to a device.

    Args:
        store: the block store.
        device: where blocks are computed.
        placement: tiers by budget (see phantom.placement): blocks resident on the device, in host
            RAM (read once here; pinned on CUDA, exactly the bytes needed), or read from their files
            at each use. `prefetch` K: blocks loaded ahead of the one computing; K + 1 device slots.
        trace: record a Chrome trace of compute, reads, copies and write-back.
        dtype: the dtype blocks are computed in (default: the store's); others are converted while
            loading.
        zero_copy: on a CPU the RAM tier is used where it lies (no slot copy). False forces the
            slot path that CUDA takes (tests); None: whenever the dtypes allow it.
        device_reserve: device bytes the caller needs beside blocks and activations (the loss chunk,
            gradients in flight): taken from the free memory before the default device budget.
    """

    def __init__(self, store: BlockStore, device: torch.device | str = "cpu", placement: Placement = Placement(),
                 trace: bool = False, dtype: torch.dtype | None = None, zero_copy: bool | None = None,
                 device_reserve: int = 0):
        self.store, self.device, self.prefetch = store, torch.device(device), placement.prefetch
        self.n_blocks = store.n_blocks
        self.dtype = dtype or store.dtype
        cpu = self.device.type == "cpu"
        self._zero_copy = cpu and self.dtype == store.dtype and zero_copy is not False and store.quant is None
        nbytes = store.block_nbytes
        self.placement = placement  # as asked; `tiers` and `offload` say what it resolved to
        converts = self.dtype != store.dtype or store.quant is not None  # a slot also holds the converted block
        self.slot_bytes = store.block_nbytes + (store.dense_nbytes // store.dtype.itemsize * self.dtype.itemsize
                                                if converts else 0)
        self.tiers = self._choose_tiers(placement, cpu, device_reserve)
        self.offload = placement.offload if placement.offload != "auto" else \
            ("ram" if "disk" not in self.tiers else "disk" if "ram" not in self.tiers else "mixed")
        self.resident = self.tiers.count("device")
        self.tracer = Tracer(trace)
        self.metrics = Metrics()
        self._cv = threading.Condition()  # guards slots, the plan and the metrics' counters
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pin = self._cuda
        self._stride = -(-nbytes // DATA_ALIGN) * DATA_ALIGN
        # Checksums off the read path, two blocks at a time: one sha256 thread (~1.7 GB/s a core) is slower
        # than a fast drive, and on a busy CPU it falls behind even a slow one (notes/bench-tiers.md).
        self._verifier = ThreadPoolExecutor(2, thread_name_prefix="phantom-verify")

        self._fill_ram_tier(placement.shared_ram)
        self._load_device_tier()  # before the streaming slots: its loader slot is gone when they come
        # Streaming slots. On CPU with the RAM tier the host buffer is the device buffer: no copy.
        streamed = [i for i, t in enumerate(self.tiers) if t == "disk" or (t == "ram" and not self._zero_copy)]
        self.slots: list[Slot] = [self._new_slot(any(self.tiers[i] == "disk" for i in streamed))
                                  for _ in range(placement.prefetch + 1 if streamed else 0)]
        self.pinned_bytes += sum(s.staging.numel() for s in self.slots if s.staging is not None and self._pin)
        self.metrics = Metrics()  # loading at start-up is not a step's traffic

        self._plan: list[int] = []
        self._pos = 0  # index into the plan of the next acquire
        self._closed = False
        self._load_error: BaseException | None = None  # a failed load stops all loading (see acquire)
        n_loaders = 0 if not self.slots else min(len(self.slots), 3) if "disk" in self.tiers else 1
        self._threads = [threading.Thread(target=self._prefetch_loop, name=f"phantom-prefetch-{k}", daemon=True)
                         for k in range(n_loaders)]
        for t in self._threads:
            t.start()
        self.writeback = WriteBackQueue(self.tracer, self.metrics, device=self.device)
        log.info("placement: %d blocks on the device, %d in RAM (%.1f GiB pinned), %d read from disk; "
                 "%d slots", self.resident, self.tiers.count("ram"), self.pinned_bytes / 2**30,
                 self.tiers.count("disk"), len(self.slots))

    def _choose_tiers(self, placement: Placement, cpu: bool, device_reserve: int) -> tuple[str, ...]:
        """Each block's tier by budget (phantom.placement.assign_tiers), from measured free memory."""
        tier_bytes = self.store.block_nbytes * max(1, self.dtype.itemsize // self.store.dtype.itemsize)
        free_host = free_host_bytes(shared=placement.shared_ram)
        free_device = free_device_bytes(self.device)
        if free_device is not None:
            free_device = max(0, free_device - device_reserve)
        device_block = None
        if self.store.quant is not None:  # RAM holds the stored bytes, the device dequantized blocks
            tier_bytes = self.store.block_nbytes
            device_block = self.store.dense_nbytes // self.store.dtype.itemsize * self.dtype.itemsize
        tiers = assign_tiers(self.n_blocks, tier_bytes, placement, free_device, free_host, zero_copy=cpu,
                             slot_bytes=self.slot_bytes, device_block_bytes=device_block)
        ram_cap = placement.ram_budget if placement.ram_budget is not None else default_ram_budget(free_host)
        if placement.offload == "auto" and "disk" in tiers and ram_cap is not None and ram_cap < tier_bytes:
            log.warning("RAM budget of %.1f MiB is smaller than one block (%.1f MiB): no RAM tier, the %d blocks "
                        "off the device are read from disk at each use; give --ram-budget at least %.0fM for one",
                        ram_cap / 2**20, tier_bytes / 2**20, tiers.count("disk"), -(-tier_bytes // 2**20))
        if cpu and not self._zero_copy:  # no device tier on a CPU; RAM blocks go through slots
            tiers = tuple("ram" if t == "device" else t for t in tiers)
        return tiers

    def _fill_ram_tier(self, shared: bool) -> None:
        """RAM tier: one exact-size (pinned on CUDA) allocation, every block read once (and verified)
        here; or, shared, the block files mapped so local ranks hold one copy."""
        nbytes = self.store.block_nbytes
        self._ram: list[torch.Tensor | None] = [None] * self.n_blocks
        ram_blocks = [i for i, t in enumerate(self.tiers) if t == "ram"]
        self._registered = []  # finalizers of registered file mappings (the shared tier on CUDA)
        if shared:
            for i in ram_blocks:
                self._ram[i] = self.store.map_block(i)
                if self._pin:  # else every copy from it goes through pageable memory: staged, synchronous
                    self._registered.append(register_read_only(self._ram[i]))
        elif ram_blocks:
            self._ram_buffer = HostBuffer(self._stride * len(ram_blocks), self._pin)
            for k, i in enumerate(tqdm(ram_blocks, desc="loading blocks to RAM", unit="block", disable=None,
                                       leave=False)):
                self._ram[i] = self._ram_buffer.block(k * self._stride, nbytes)
                self.store.read_block_into(i, self._ram[i])
                self.metrics.bytes_read += nbytes
        self.pinned_bytes = self._stride * len(ram_blocks) if self._pin and not shared else 0

    def _load_device_tier(self) -> None:
        """Device tier: each block loaded once through a slot's pipeline, then kept in buffers of its
        own (in the file's layout, so its projections still fuse)."""
        self._resident_views: dict[int, dict] = {}
        loader = self._new_slot(True) if "device" in self.tiers else None
        copied = None  # CUDA: the compute stream is done reading the loader's converted tensors
        for i in (i for i, t in enumerate(self.tiers) if t == "device"):
            self._load(loader, i, copied)
            self._sync_ready(loader)
            if loader.converted is None:  # the slot's buffer becomes the block's; the slot gets a new one
                views = loader.views
                loader.buf = torch.empty_like(loader.buf)
            else:  # copied on this thread's stream; the next load (copy stream) overwrites them after it
                views = packed_empty(loader.views, self.dtype, self.device)
                for k, v in loader.views.items():
                    views[k].copy_(v)
                if self._cuda:
                    copied = torch.cuda.Event()
                    copied.record(torch.cuda.current_stream(self.device))
            self._resident_views[i] = views
            loader.block, loader.state, loader.views = None, "empty", None

    def _new_slot(self, needs_staging: bool) -> Slot:
        nbytes = self.store.block_nbytes
        cpu = self.device.type == "cpu"
        host = None
        if cpu:
            buf = HostBuffer(self._stride, False).tensor[:nbytes]  # aligned: the disk tier reads straight in
            staging = None
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            host = HostBuffer(self._stride, self._pin) if needs_staging else None
            staging = host.tensor[:nbytes] if host is not None else None
        converted = None
        if self.store.quant is not None:  # dequantized into here, in a 16-bit block's layout
            converted = self.store.dense_empty(self.dtype, self.device)
        elif self.dtype != self.store.dtype:
            converted = packed_empty(self.store.block_views(buf), self.dtype, self.device)
        return Slot(buf=buf, staging=staging, converted=converted, host=host)

    # -- the training thread's side ------------------------------------------------------------

    def plan(self, order: list[int]) -> None:
        """Tell the scheduler the order in which blocks will be acquired next (e.g. 0..N-1, N-1..0)."""
        with self._cv:
            self._plan, self._pos = list(order), 0
            self._cv.notify_all()

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights on the device, as views; waits if it is not there yet. Pair with release().

        On CUDA the current stream is made to wait for the block's copy (an event), not the host."""
        if block in self._resident_views:
            with self._cv:
                self._advance_plan_to(block)
                self._pos += 1
            return self._resident_views[block]
        if self._zero_copy and self.tiers[block] == "ram":
            with self._cv:
                self._advance_plan_to(block)
                self._pos += 1
            self.metrics.bytes_ram += self.store.block_nbytes
            return self.store.block_views(self._ram[block])
        t0 = time.perf_counter()
        with self._cv:
            self._advance_plan_to(block)
            while True:
                self._raise_if_closed()
                slot = self._slot_holding(block)
                if slot is not None and slot.state == "ready":
                    break
                if slot is not None and slot.state == "failed":
                    err, slot.state, slot.block, slot.error = slot.error, "empty", None, None
                    raise err
                if slot is None and self._load_error is not None:  # a failed load stopped the loaders
                    raise self._load_error
                self._cv.wait(0.1)
            slot.users += 1
            self._pos += 1
            self._cv.notify_all()
        if slot.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
        t1 = time.perf_counter()
        if t1 - t0 > 1e-4:
            self.metrics.stall_s += t1 - t0
            self.tracer.span("stall", f"wait {block}", t0, t1)
        return slot.views

    def release(self, block: int) -> None:
        """The training thread is done with the block (its kernels may still be queued on CUDA).

        A deferred checksum of the block's bytes is checked here: a corrupt file stops training in the
        training thread, and the slot is not reused before its bytes were hashed."""
        if block in self._resident_views or (self._zero_copy and self.tiers[block] == "ram"):
            return
        with self._cv:
            slot = self._slot_holding(block)
            assert slot is not None and slot.users > 0, f"release of block {block} that is not acquired"
            slot.users -= 1
            if self._cuda:
                slot.free_event = torch.cuda.Event()
                slot.free_event.record(torch.cuda.current_stream(self.device))
            verify, slot.verify = slot.verify, None
            if verify is not None and not verify.done():
                slot.verify = verify  # still hashing: the loader waits for it before reusing the slot
            self._cv.notify_all()
        if verify is not None and verify.done():
            verify.result()

    def host_weights(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights in host memory: the RAM tier's views, or read from the store."""
        if self._ram[block] is not None:
            return self.store.block_views(self._ram[block])
        return self.store.load_block(block)

    def update_block(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        """New values of a block (full finetuning): into the RAM tier and device copies; any slot
        still holding the old version is dropped so the next acquire loads the new one.

        On CUDA the copies are queued on the caller's current stream (phantom.optim's update stream)
        without blocking, and the calling thread, not the compute stream, waits for them."""
        for views in ([self.store.block_views(self._ram[block])] if self._ram[block] is not None else []) + \
                ([self._resident_views[block]] if block in self._resident_views else []):
            for k, v in views.items():
                v.copy_(tensors[k], non_blocking=self._cuda)
        if self._cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
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
            self.metrics.copy_events = m.count_finished_copies()  # still in flight: next step's
            self.writeback.metrics = self.metrics
        d = m.as_dict()
        d["read_gbps"] = m.bytes_read / m.read_s / 1e9 if m.read_s > 0 else 0.0
        d["copy_gbps"] = m.bytes_h2d / m.copy_s / 1e9 if m.copy_s > 0 else 0.0
        return d

    def close(self) -> None:
        """Stop the loader threads and drain the write-back queue (re-raising its errors)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        if self._cuda:
            torch.cuda.synchronize(self.device)  # no copy may still target a buffer we free
        for unregister in self._registered:
            if unregister is not None:
                unregister()
        self._verifier.shutdown(wait=True)
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
        """Plan position of block's next use from start. Past the plan's end the plan is taken to
        repeat (a training loop's next step runs the same order), so of the blocks this step no longer
        needs, the slots keep those the next step needs first: without it a tie among them was broken
        by slot order, and a loader running late could evict a block the next forward reads first."""
        for p in range(start, len(self._plan)):
            if self._plan[p] == block:
                return p
        for p in range(min(start, len(self._plan))):
            if self._plan[p] == block:
                return len(self._plan) + p
        return float("inf")

    def _streams(self, block: int) -> bool:
        return block not in self._resident_views and not (self._zero_copy and self.tiers[block] == "ram")

    def _next_load(self) -> tuple[Slot, int] | None:
        """The earliest block in the prefetch window that is not in a slot, and a slot to put it in."""
        window = self._plan[self._pos:]
        ahead = 0
        for p, block in enumerate(window, start=self._pos):
            if not self._streams(block):
                continue
            ahead += 1
            if ahead > self.prefetch + 1:
                return None
            if self._slot_holding(block) is not None:
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
        if self._cuda:  # the current device is per thread: else cuda:1's copies make a context on GPU 0
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while not self._closed and (self._load_error is not None or (task := self._next_load()) is None):
                    self._cv.wait()
                if self._closed:
                    return
                slot, block = task
                slot.block, slot.state, slot.error, slot.views = block, "loading", None, None
                free_event, slot.free_event = slot.free_event, None
                verify, slot.verify = slot.verify, None
            try:
                if verify is not None:
                    verify.result()  # the previous block's bytes were hashed before they are overwritten
                self._load(slot, block, free_event)
                faults.point("prefetch.load")  # crash tests: a block loaded, not yet handed over
                state, error = "ready", None
            except BaseException as e:  # surfaced in the training thread by acquire()
                log.debug("prefetch of block %d failed", block, exc_info=True)
                state, error = "failed", e
            with self._cv:
                slot.state, slot.error = state, error
                if error is not None and self._load_error is None:
                    self._load_error = error  # no loader starts another read: the step is lost anyway
                self._cv.notify_all()

    def _read(self, block: int, into: torch.Tensor, defer_verify: bool):
        """Block bytes from disk into a host buffer (no lock); returns a deferred checksum or None."""
        t0 = time.perf_counter()
        check = self.store.read_block_into(block, into, defer_verify=defer_verify)
        t1 = time.perf_counter()
        with self._cv:  # several loader threads count into one step's metrics: no lost update
            self.metrics.read_s += t1 - t0
            self.metrics.bytes_read += into.numel()
        self.tracer.span("read", f"read {block}", t0, t1, bytes=into.numel())
        return check

    def _load(self, slot: Slot, block: int, free_event) -> None:
        """Fill slot with block (a loader thread, without the lock): read -> copy -> convert.

        On CUDA the copy and the conversion are queued on the copy stream after the slot's free
        event, and `slot.ready_event` marks their end; the host does not wait for them. A disk
        block's checksum runs on the verify thread beside the copy (see release())."""
        check = None
        if self._ram[block] is not None:
            src = self._ram[block]
            with self._cv:
                self.metrics.bytes_ram += src.numel()
        elif self.device.type == "cpu":
            src = slot.buf  # disk tier on a CPU: read straight into the slot
            check = self._read(block, src, defer_verify=True)
        else:
            if slot.ready_event is not None:
                slot.ready_event.synchronize()  # the staging buffer's last copy is done
            src = slot.staging
            check = self._read(block, src, defer_verify=True)
        if check is not None:
            slot.verify = self._verifier.submit(check)
        t0 = time.perf_counter()
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if free_event is not None:
                    self._copy_stream.wait_event(free_event)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self._copy_stream)
                slot.buf.copy_(src, non_blocking=True)
                self._convert(slot, block)
                slot.ready_event = torch.cuda.Event(enable_timing=True)
                slot.ready_event.record(self._copy_stream)
            with self._cv:
                m = self.metrics
                m.copy_events.append((start, slot.ready_event, slot.buf.numel()))
                if len(m.copy_events) > 1024:  # nobody takes metrics (generation): fold finished ones in
                    m.copy_events = m.count_finished_copies()
        else:
            if src is not slot.buf:
                slot.buf.copy_(src)
            self._convert(slot, block)
            if self.device.type == "mps":
                torch.mps.synchronize()
        t1 = time.perf_counter()
        with self._cv:
            if src is not slot.buf and not self._cuda:
                self.metrics.copy_s += t1 - t0
                self.metrics.bytes_h2d += slot.buf.numel()
            self.metrics.loads += 1
        if src is not slot.buf:
            self.tracer.span("copy", f"copy {block}", t0, t1, bytes=slot.buf.numel())
        slot.views = slot.converted if slot.converted is not None else self.store.block_views(slot.buf)

    def _convert(self, slot: Slot, block: int) -> None:
        """The slot's block into the compute dtype: a dtype conversion, or a quantized block
        dequantized (on the device after the copy; on a CPU here, in the loader thread)."""
        if self.store.quant is not None:
            t0 = time.perf_counter()
            with quant.one_thread() if self.device.type == "cpu" else contextlib.nullcontext():
                self.store.dequantize_block(block, self.store.block_views(slot.buf), slot.converted)
            t1 = time.perf_counter()
            with self._cv:
                self.metrics.dequant_s += t1 - t0
            self.tracer.span("dequant", f"dequant {block}", t0, t1)
            return
        if slot.converted is not None:
            for k, v in self.store.block_views(slot.buf).items():
                slot.converted[k].copy_(v)

    def _sync_ready(self, slot: Slot) -> None:
        if slot.ready_event is not None:
            slot.ready_event.synchronize()
        if slot.verify is not None:
            slot.verify.result()
            slot.verify = None


class WriteBackQueue:
    """A bounded queue of work moving data off the device (or to disk), run by one worker thread.

    submit() blocks when `maxsize` items are pending (back-pressure) and re-raises the first error
    a previous item hit, so a failed write-back stops training in the training thread.
    """

    def __init__(self, tracer: Tracer | None = None, metrics: Metrics | None = None, maxsize: int = 4,
                 name: str = "phantom-writeback", device: torch.device | str = "cpu"):
        self.tracer, self.metrics = tracer or Tracer(False), metrics
        self.device = torch.device(device)  # CUDA: made the worker thread's current device
        self._q: queue.Queue = queue.Queue(maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
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
