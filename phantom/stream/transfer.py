"""The transfer stage: one block into one device slot, read -> copy -> convert, in a loader thread.

`Transfer` is the host-side stage (a CPU, and `mps`): a reading tier (phantom.stream.tiers: the disk
tier) reads straight into the slot on a CPU, the copy and the conversion run in the loader thread and are done when `load` returns.
A CPU dequantizes a quantized block with every core when the training thread acquires it (`wait_ready`), as a
GPU dequantizes on the device: in loader threads it competed with the compute for the same cores, and each of
the compute's OpenMP ops waited at its barrier for the thread that lost its core (notes/bench-quant.md).
`CudaTransfer` reads into the slot's pinned staging buffer, then queues the copy and the conversion
on a dedicated copy stream after the slot's free event and marks their end with a ready event that
the compute stream waits on: neither the host nor the compute waits for a copy it does not need yet.
A block's checksum runs on a verify thread beside the copy. Neither stage takes a lock: a load
returns its counts (`LoadStats`) for the scheduler to add.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from phantom.files.store import BlockStore
from phantom.files.tensorfile import DATA_ALIGN, packed_views
from phantom.stream.experts import ExpertLayout
from phantom.stream.hostmem import HostBuffer
from phantom.stream.tiers import Held
from phantom.stream.trace import LoadStats, Tracer


@dataclass
class Slot:
    buf: torch.Tensor  # flat uint8 block buffer (store dtype) on the device
    staging: torch.Tensor | None = None  # host buffer a reading tier (disk) reads into (pinned on CUDA)
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
    flat: torch.Tensor | None = None  # the compute-dtype buffer `converted` views (the largest block's size)
    layouts: dict = field(default_factory=dict)  # the store's layout index -> `converted` for a block of it
    experts: frozenset | None = None  # a routed load: the experts in the slot beside the non-expert bytes
    dequant: tuple | None = None  # a CPU: (block, names or None for all) loaded, to dequantize when acquired


class DequantPool:
    """A CPU's dequantization of a block, its tensors split over one worker per core, each on one OpenMP thread.

    torch's gather (index_select), on which NF4 and FP8 dequantization turn, runs on one thread whatever
    torch.get_num_threads() says; whole tensors on single-threaded workers use every core. A dim-2048 block on
    2 cores, against one call on torch's 2 threads: NF4 36 -> 22 ms, FP8 48-92 -> 32-36, int4-group 60 -> 49,
    MXFP4 55 -> 46, int8 16 -> 13 (the same bits)."""

    def __init__(self, threads: int):
        self.threads, self.pool = threads, None
        if threads < 2:
            return
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="phantom-dequant")
        started, n = threading.Barrier(threads + 1), torch.get_num_threads()

        def one_thread():  # OpenMP's thread count is per thread: each worker's stays 1
            torch.set_num_threads(1)
            started.wait()
        workers = [self.pool.submit(one_thread) for _ in range(threads)]
        started.wait()  # every worker has its own thread (each waited for the others)
        for w in workers:
            w.result()
        torch.set_num_threads(n)  # threads started later take torch's last count: the caller's again

    def dequantize(self, store: BlockStore, block: int, stored: dict, out: dict) -> None:
        """Block's stored views into out's dense tensors, the largest tensors first, each to the least-loaded
        worker."""
        if self.pool is None or len(out) < 2:
            return store.dequantize_block(block, stored, out)
        groups, sizes = [{} for _ in range(self.threads)], [0] * self.threads
        for name, t in sorted(out.items(), key=lambda kv: -kv[1].numel()):
            j = sizes.index(min(sizes))
            groups[j][name], sizes[j] = t, sizes[j] + t.numel()
        for _ in self.pool.map(lambda g: store.dequantize_block(block, stored, g), [g for g in groups if g]):
            pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class Transfer:
    """Loads blocks into slots on a CPU or `mps`, synchronously in the calling (loader) thread."""

    pin = False  # host buffers page-locked for the device's copies

    def __init__(self, store: BlockStore, device: torch.device, dtype: torch.dtype, tracer: Tracer):
        self.store, self.device, self.dtype, self.tracer = store, device, dtype, tracer
        self.stride = -(-store.block_nbytes // DATA_ALIGN) * DATA_ALIGN
        # Checksums off the read path, two blocks at a time: one sha256 thread (~1.7 GB/s a core) is slower
        # than a fast drive, and on a busy CPU it falls behind even a slow one (notes/bench-tiers.md).
        self.verifier = ThreadPoolExecutor(2, thread_name_prefix="phantom-verify")
        self.experts: ExpertLayout | None = None  # set where a run reads MoE blocks routed (the scheduler)
        # blocks whose non-expert weights stay on the device (Placement.moe_base): their tensors after the
        # first load (None before it); a later load reads only experts (the scheduler sets it)
        self.bases: dict[int, dict | None] | None = None
        self.dequant_pool = DequantPool(torch.get_num_threads()) if self.defers_dequant else None

    def new_slot(self, needs_staging: bool) -> Slot:
        """A slot: the block's bytes (aligned on a CPU: the disk tier reads straight in), a staging buffer
        where a device's disk-tier reads land first, and the compute-dtype copy when one is needed."""
        nbytes = self.store.block_nbytes
        host = None
        if self.device.type == "cpu":
            buf, staging = HostBuffer(self.stride, False).tensor[:nbytes], None
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            host = HostBuffer(self.stride, self.pin) if needs_staging else None
            staging = host.tensor[:nbytes] if host is not None else None
        flat = None  # a quantized block is dequantized into it (a 16-bit block's layout), or converted
        if self.store.quant is not None or self.dtype != self.store.dtype:
            flat = torch.empty(self.store.dense_nbytes // self.store.dtype.itemsize, dtype=self.dtype,
                               device=self.device)
        slot = Slot(buf=buf, staging=staging, host=host, flat=flat)
        slot.converted = self._converted(slot, 0)  # each load sets its block's (layouts may differ)
        return slot

    def _converted(self, slot: Slot, block: int) -> dict | None:
        """The slot's compute-dtype tensors for block, in its layout (dense layers among sparse ones
        have their own), views of slot.flat made once per layout."""
        if slot.flat is None:
            return None
        k = self.store.layout_index(block)
        if k not in slot.layouts:
            like = self.store.dense_like(block) if self.store.quant is not None else \
                self.store.block_views(slot.buf, block)
            slot.layouts[k] = packed_views(slot.flat, like)
        return slot.layouts[k]

    def load(self, slot: Slot, block: int, source: Held, free_event=None,
             experts: frozenset | None = None) -> LoadStats:
        """Fill slot with block (without any lock) from its tier: copied from the bytes the tier holds in
        host memory (RAM), or read by the tier into the slot's host buffer (disk). `experts` (a routed
        load): only the block's non-expert bytes and those experts' (`fill` adds others later)."""
        slot.experts, slot.dequant = None, None
        if experts is not None:
            return self._load_routed(slot, block, source, free_event, experts)
        stats = LoadStats()
        slot.converted = self._converted(slot, block)
        held = None if source.tier.reads else source.host(block)
        src = held if held is not None else self._read(slot, block, source, stats)
        if held is not None:
            stats.bytes_ram = held.numel()
        t0 = time.perf_counter()
        self._copy(slot, block, src, free_event, stats)
        t1 = time.perf_counter()
        if src.data_ptr() != slot.buf.data_ptr():
            self.tracer.span("copy", f"copy {block}", t0, t1, bytes=src.numel())
        slot.views = slot.converted if slot.converted is not None else self.store.block_views(slot.buf, block)
        if slot.dequant is None:
            self._keep_base(slot, block)
        return stats

    def _load_routed(self, slot: Slot, block: int, source: Held, free_event, experts: frozenset) -> LoadStats:
        """The block's non-expert bytes (unless the device keeps them: `bases`) and those experts' bytes."""
        lay, base = self.experts.at(self.store.layout_index(block)), self.kept_base(block)
        slot.converted = self._converted(slot, block)
        ranges = lay.of(experts) if base is not None else list(lay.base) + lay.of(experts)
        stats = self._ranges(slot, block, source, ranges, source.tier.lane, f"read {block} (routed)", free_event)
        names = [n for e in experts for n in lay.names[e]]
        self._convert_names(slot, block, names if base is not None else [*lay.base_names, *names], stats, loader=True)
        stats.bytes_experts = len(experts) * lay.expert_bytes
        slot.experts = frozenset(experts)
        slot.views = slot.converted if slot.converted is not None else self.store.block_views(slot.buf, block)
        if base is not None:
            slot.views = {**slot.views, **base}
        elif slot.dequant is None:
            self._keep_base(slot, block)
        return stats

    def kept_base(self, block: int) -> dict | None:
        """The block's non-expert weights the device keeps (None: not kept, or not loaded yet)."""
        return self.bases.get(block) if self.bases is not None else None

    def _keep_base(self, slot: Slot, block: int) -> None:
        """After a block's first load: its non-expert weights copied out of the slot, to stay (`bases`), and
        used from there at once: every use of the block sees its weights split between the slot and the kept
        copy alike (phantom.stream.executor.WeightHandles rebuilds saved weights on the slot's part)."""
        if self.bases is not None and block in self.bases and self.bases[block] is None:
            names = self.experts.at(self.store.layout_index(block)).base_names
            self.bases[block] = packed_copy({n: slot.views[n] for n in names})
            slot.views = {**slot.views, **self.bases[block]}

    def fill(self, slot: Slot, block: int, source: Held, experts) -> LoadStats:
        """Read the experts of `experts` that a routed slot lacks into it (on the training thread, which
        holds the slot); their bytes are counted in `bytes_experts` too, drawn in the tier's expert lane."""
        missing = sorted(set(experts) - slot.experts) if slot.experts is not None else []
        if not missing:
            return LoadStats()
        lay = self.experts.at(self.store.layout_index(block))
        ranges = lay.of(missing)
        stats = self._ranges(slot, block, source, ranges, source.tier.expert_lane,
                             f"experts {block} ({len(missing)})", None)
        self._convert_names(slot, block, [n for e in missing for n in lay.names[e]], stats)
        stats.bytes_experts, stats.requests = len(missing) * lay.expert_bytes, len(ranges)
        slot.experts = slot.experts | frozenset(missing)
        return stats

    def _ranges(self, slot: Slot, block: int, source: Held, ranges, lane: str, what: str, free_event) -> LoadStats:
        """Bytes `ranges` of the block's data section into the slot: sliced from the tier's host copy, or
        read by the tier into the slot's host buffer, then copied where the slot is on a device."""
        stats, nbytes = LoadStats(), sum(b - a for a, b in ranges)
        if not ranges:  # a block whose other weights the device keeps, before its router has run
            return stats
        held = None if source.tier.reads else source.host(block)
        t0 = time.perf_counter()
        if held is None:
            into = self._staging(slot)
            self.wait_staging_free(slot)
            source.read_ranges(block, into, ranges)
            stats.bytes_read, src = nbytes, into
        else:
            stats.bytes_ram, src = nbytes, held
        t1 = time.perf_counter()
        if src is not slot.buf:
            self._copy_ranges(slot, src, ranges, free_event)
            stats.bytes_h2d = nbytes
        t2 = time.perf_counter()
        stats.read_s, stats.copy_s = t1 - t0, t2 - t1
        self.tracer.span(lane, what, t0, t2, bytes=nbytes)
        return stats

    def _copy_ranges(self, slot: Slot, src: torch.Tensor, ranges, free_event) -> None:
        for a, b in ranges:
            slot.buf[a:b].copy_(src[a:b])

    def _convert_names(self, slot: Slot, block: int, names, stats: LoadStats, loader: bool = False) -> None:
        """The named tensors (the dense block's names) of a routed slot into the compute dtype where it differs
        from the store's, or dequantized from a quantized store's parts (a CPU's loader leaves that to
        `wait_ready`, as `convert` does)."""
        if slot.converted is None:
            return
        if self.store.quant is None:
            stored = self.store.block_views(slot.buf, block)
            for n in names:
                slot.converted[n].copy_(stored[n])
        elif loader and self.defers_dequant:
            slot.dequant = (block, list(names))
        else:
            stats.dequant_s += self._dequantize(slot, block, names)

    @property
    def defers_dequant(self) -> bool:
        """A loader leaves a quantized block's dequantization to the compute's threads (a CPU, see the module)."""
        return self.device.type == "cpu" and self.store.quant is not None

    def _dequantize(self, slot: Slot, block: int, names=None) -> float:
        """The slot's quantized block (or its tensors `names`, the dense block's) into slot.converted (a CPU's
        over its cores: DequantPool); the seconds it took."""
        out = slot.converted if names is None else {n: slot.converted[n] for n in names}
        t0 = time.perf_counter()
        if self.dequant_pool is not None:
            self.dequant_pool.dequantize(self.store, block, self.store.block_views(slot.buf, block), out)
        else:
            self.store.dequantize_block(block, self.store.block_views(slot.buf, block), out)
        t1 = time.perf_counter()
        self.tracer.span("dequant", f"dequant {block}" + (f" ({len(names)})" if names is not None else ""), t0, t1)
        return t1 - t0

    def _staging(self, slot: Slot) -> torch.Tensor:
        """Where a reading tier's block is read to: the slot itself on a CPU, else its staging buffer."""
        return slot.buf if self.device.type == "cpu" else slot.staging

    def _read(self, slot: Slot, block: int, source: Held, stats: LoadStats) -> torch.Tensor:
        """Block bytes read by its tier into the slot's host buffer; its checksum goes to the verify thread."""
        into = self._staging(slot)[:self.store.block_size(block)]
        t0 = time.perf_counter()
        check = source.read_into(block, into)
        t1 = time.perf_counter()
        stats.read_s, stats.bytes_read = t1 - t0, into.numel()
        self.tracer.span(source.tier.lane, f"read {block}", t0, t1, bytes=into.numel())
        if check is not None:
            slot.verify = self.verifier.submit(check)
        return into

    def _copy(self, slot: Slot, block: int, src: torch.Tensor, free_event, stats: LoadStats) -> None:
        t0 = time.perf_counter()
        copies = src.data_ptr() != slot.buf.data_ptr()  # on a CPU a reading tier reads into the slot itself
        if copies:
            slot.buf[:src.numel()].copy_(src)
        self.convert(slot, block, stats)
        if self.device.type == "mps":
            torch.mps.synchronize()
        if copies:
            stats.copy_s, stats.bytes_h2d = time.perf_counter() - t0, src.numel()

    def convert(self, slot: Slot, block: int, stats: LoadStats) -> None:
        """The slot's block into the compute dtype: a dtype conversion, or a quantized block
        dequantized (on the device after the copy; on a CPU when acquired, see `wait_ready`)."""
        if self.defers_dequant:
            slot.dequant = (block, None)
        elif self.store.quant is not None:
            stats.dequant_s += self._dequantize(slot, block)
        elif slot.converted is not None:
            for k, v in self.store.block_views(slot.buf, block).items():
                slot.converted[k].copy_(v)

    def wait_ready(self, slot: Slot) -> float:
        """Make the compute wait for the slot's block; the seconds it spent dequantizing (the training thread,
        which holds the slot). A CPU's load is done when it returns, but for a quantized block's dequantization,
        done here on the compute's threads at the block's first acquire after its load."""
        if slot.dequant is None:
            return 0.0
        (block, names), slot.dequant = slot.dequant, None
        seconds = self._dequantize(slot, block, names)
        self._keep_base(slot, block)  # a block whose other weights the device keeps: after their first load
        return seconds

    def mark_free(self, slot: Slot) -> None:
        """The compute has queued its last use of the slot's block."""

    def wait_staging_free(self, slot: Slot) -> None:
        """The host waits until the staging buffer's last copy is done (nothing to wait for here)."""

    def sync_ready(self, slot: Slot) -> None:
        """The host waits for the slot's copy, its checksum and its dequantization (a CPU's, deferred)."""
        if slot.dequant is not None:
            self.wait_ready(slot)
        if slot.ready_event is not None:
            slot.ready_event.synchronize()
        if slot.verify is not None:
            slot.verify.result()
            slot.verify = None

    def close(self) -> None:
        self.verifier.shutdown(wait=True)
        if self.dequant_pool is not None:
            self.dequant_pool.close()


class CudaTransfer(Transfer):
    """Loads through pinned staging buffers and a copy stream; the host never waits for a copy."""

    pin = True

    def __init__(self, store: BlockStore, device: torch.device, dtype: torch.dtype, tracer: Tracer):
        super().__init__(store, device, dtype, tracer)
        self.stream = torch.cuda.Stream(device)

    def _read(self, slot: Slot, block: int, source: Held, stats: LoadStats) -> torch.Tensor:
        self.wait_staging_free(slot)
        return super()._read(slot, block, source, stats)

    def _copy(self, slot: Slot, block: int, src: torch.Tensor, free_event, stats: LoadStats) -> None:
        """Queue the copy and the conversion on the copy stream after the slot's free event; the ready
        event marks their end (its time is counted when it has passed: Metrics.count_finished_copies)."""
        with torch.cuda.stream(self.stream):
            if free_event is not None:
                self.stream.wait_event(free_event)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            slot.buf[:src.numel()].copy_(src, non_blocking=True)
            self.convert(slot, block, stats)
            slot.ready_event = torch.cuda.Event(enable_timing=True)
            slot.ready_event.record(self.stream)
        stats.copy_event = (start, slot.ready_event, src.numel())

    def _copy_ranges(self, slot: Slot, src: torch.Tensor, ranges, free_event) -> None:
        """A routed load's ranges on the copy stream (after the slot's free event); a fill's (free_event
        None: the training thread holds the slot) on the compute stream, which uses them next. The ready
        event marks the last copy either way (the staging buffer is free after it)."""
        stream = self.stream if free_event is not None or slot.users == 0 else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            if free_event is not None:
                stream.wait_event(free_event)
            for a, b in ranges:
                slot.buf[a:b].copy_(src[a:b], non_blocking=True)
            slot.ready_event = torch.cuda.Event()
            slot.ready_event.record(stream)

    def _convert_names(self, slot: Slot, block: int, names, stats: LoadStats, loader: bool = False) -> None:
        if slot.converted is not None:
            stream = self.stream if slot.users == 0 else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                super()._convert_names(slot, block, names, stats, loader)
                slot.ready_event = torch.cuda.Event()
                slot.ready_event.record(stream)

    def _keep_base(self, slot: Slot, block: int) -> None:
        """The copy out of the slot on the copy stream, after the load's copy and conversion; the slot's ready
        event marks its end (the compute's later uses of the kept tensors come after it)."""
        if self.bases is not None and block in self.bases and self.bases[block] is None:
            with torch.cuda.stream(self.stream):
                super()._keep_base(slot, block)
                slot.ready_event = torch.cuda.Event(enable_timing=True)
                slot.ready_event.record(self.stream)

    def wait_ready(self, slot: Slot) -> float:
        if slot.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
        return 0.0

    def mark_free(self, slot: Slot) -> None:
        slot.free_event = torch.cuda.Event()
        slot.free_event.record(torch.cuda.current_stream(self.device))

    def wait_staging_free(self, slot: Slot) -> None:
        if slot.ready_event is not None:
            slot.ready_event.synchronize()  # the staging buffer's last copy is done


def packed_copy(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `views` (one block's tensors in a slot), one buffer per dtype, that keeps which of them lie
    back to back: a tensor goes right after the one before it where it did so in the slot, else to the next
    64-element boundary. So phantom.arch.layers.fuse_adjacent fuses the projections it fused in the slot:
    the block computes with the same matmuls, to the same bits."""
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in views.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        starts, end, prev = {}, 0, None
        for name in names:
            t = views[name]
            after = prev is not None and t.is_contiguous() and prev.is_contiguous() and \
                t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr() and \
                t.storage_offset() == prev.storage_offset() + prev.numel()
            starts[name] = end if after else -(-end // 64) * 64
            end, prev = starts[name] + t.numel(), t
        flat = torch.empty(end, dtype=dtype, device=views[names[0]].device)
        for name in names:
            t = views[name]
            out[name] = flat[starts[name]:starts[name] + t.numel()].view(t.shape)
            out[name].copy_(t)
    return out


def transfer_for(store: BlockStore, device: torch.device, dtype: torch.dtype, tracer: Tracer) -> Transfer:
    """The stage for a device: CUDA's asynchronous one, or the host-side one (CPU, mps)."""
    return (CudaTransfer if device.type == "cuda" else Transfer)(store, device, dtype, tracer)
