"""The block scheduler: streams blocks from their tier into a fixed set of device slots ahead of use.

Each block's tier comes from the run's layout (phantom.stream.placement.resolve): resident on the device, in
host RAM, in the store's files, or a tier registered in phantom.stream.tiers; phantom.stream.residency
holds them. Loader threads take the next blocks of the known plan that are not
on the device and fill free slots through the transfer stage (phantom.stream.transfer: read -> copy ->
convert). Slots are evicted by next use in the plan (Belady), so the turn from forward to backward
reuses what is still on the device (LIFO). A write-back queue (phantom.stream.writeback) carries data the
other way.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from phantom.base import faults
from phantom.files.store import BlockStore
from phantom.stream import tiers as T
from phantom.stream.experts import ExpertLayout, ExpertReads
from phantom.stream.placement import Placement
from phantom.stream.residency import Residency, resolve_layout
from phantom.stream.trace import Metrics, Tracer
from phantom.stream.transfer import Slot, transfer_for
from phantom.stream.writeback import WriteBackQueue

log = logging.getLogger(__name__)


def next_use(plan: list[int], block: int, start: int) -> float:
    """Plan position of block's next use from start. Past the plan's end the plan is taken to
    repeat (a training loop's next step runs the same order), so of the blocks this step no longer
    needs, the slots keep those the next step needs first: without it a tie among them was broken
    by slot order, and a loader running late could evict a block the next forward reads first."""
    for p in range(start, len(plan)):
        if plan[p] == block:
            return p
    for p in range(min(start, len(plan))):
        if plan[p] == block:
            return len(plan) + p
    return float("inf")


def belady_victim(slots: list[Slot], plan: list[int], pos: int, needed_at: int) -> Slot | None:
    """The slot to load a block needed at plan position `needed_at` into: of those not in use nor
    loading, the one whose block is needed furthest in the future, and later than `needed_at`
    (Belady, over the known plan); None when every slot holds something needed sooner."""
    best, best_use = None, needed_at
    for s in slots:
        if s.users or s.state == "loading":
            continue
        use = float("inf") if s.state in ("empty", "failed") else next_use(plan, s.block, pos)
        if use > best_use:
            best, best_use = s, use
    return best


class BlockScheduler:
    """Streams transformer blocks of a `BlockStore` to a device.

    Args:
        store: the block store.
        device: where blocks are computed.
        placement: tiers by budget (see phantom.stream.placement): blocks resident on the device, in host
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
        self.placement = placement  # as asked; `layout` says what it resolved to
        self.layout = resolve_layout(store, self.device, self.dtype, placement, zero_copy, device_reserve)
        self.tiers, self.offload = self.layout.tiers, self.layout.offload
        self.resident = self.tiers.count("device")
        self._zero_copy, self._streamed = self.layout.in_place, frozenset(self.layout.streamed)
        self.tracer = Tracer(trace)
        self.metrics = Metrics()
        self._cv = threading.Condition()  # guards slots, the plan and the metrics' counters
        self._cuda = self.device.type == "cuda"
        self.transfer = transfer_for(store, self.device, self.dtype, self.tracer)

        self.residency = Residency(store, self.layout, self.transfer, self.metrics, placement.shared_ram,
                                   self.dtype, self.device)  # before the slots: the device tier's loader is gone
        # Streaming slots. On CPU with the RAM tier the host buffer is the device buffer: no copy.
        reads = any(self.residency.tier(i).reads for i in self.layout.streamed)
        self.slots: list[Slot] = [self.transfer.new_slot(reads) for _ in range(self.layout.slots)]
        self.pinned_bytes = self.residency.pinned_bytes + \
            sum(s.staging.numel() for s in self.slots if s.staging is not None and self.transfer.pin)
        self.metrics = Metrics()  # loading at start-up is not a step's traffic
        self.routed = RoutedSlots(self, expert_reads_for(store, self.residency, self.layout, placement), placement)

        self._plan: list[int] = []
        self._pos = 0  # index into the plan of the next acquire
        self._closed = False
        self._load_error: BaseException | None = None  # a failed load stops all loading (see acquire)
        n_loaders = 0 if not self.slots else min(len(self.slots), 3) if reads else 1
        self._threads = [threading.Thread(target=self._prefetch_loop, name=f"phantom-prefetch-{k}", daemon=True)
                         for k in range(n_loaders)]
        for t in self._threads:
            t.start()
        self.writeback = WriteBackQueue(self.tracer, self.metrics, device=self.device)
        log.info("placement: %s blocks (%.1f GiB pinned); %d slots",
                 ", ".join(f"{t} {n}" for t, n in self.layout.split.items()), self.pinned_bytes / 2**30,
                 len(self.slots))

    # -- the training thread's side ------------------------------------------------------------

    def plan(self, order: list[int], tokens: int = 0) -> None:
        """Tell the scheduler the order in which blocks will be acquired next (e.g. 0..N-1, N-1..0), and
        the tokens each block runs over (a mixture of experts picks routed or whole reads by them)."""
        with self._cv:
            self._plan, self._pos = list(order), 0
            self.routed.plan(tokens)
            self._cv.notify_all()

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights on the device, as views; waits if it is not there yet. Pair with release().

        On CUDA the current stream is made to wait for the block's copy (an event), not the host."""
        if not self._streams(block):  # the device tier; the RAM tier used where it lies (a CPU)
            with self._cv:
                self._advance_plan_to(block)
                self._pos += 1
                if self.tiers[block] != "device":
                    self.metrics.bytes_ram += self.store.block_size(block)
            return self.residency.views(block)
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
        dequant_s = self.transfer.wait_ready(slot)  # a CPU dequantizes here: not a stall (no loader counts it then)
        t1 = time.perf_counter() - dequant_s
        if dequant_s:
            self.metrics.dequant_s += dequant_s
        if t1 - t0 > 1e-4:
            self.metrics.stall_s += t1 - t0
            self.tracer.span("stall", f"wait {block}", t0, t1)
        return slot.views

    def release(self, block: int) -> None:
        """The training thread is done with the block (its kernels may still be queued on CUDA).

        A deferred checksum of the block's bytes is checked here: a corrupt file stops training in the
        training thread, and the slot is not reused before its bytes were hashed."""
        if not self._streams(block):
            return
        with self._cv:
            slot = self._slot_holding(block)
            assert slot is not None and slot.users > 0, f"release of block {block} that is not acquired"
            slot.users -= 1
            self.transfer.mark_free(slot)
            verify, slot.verify = slot.verify, None
            if verify is not None and not verify.done():
                slot.verify = verify  # still hashing: the loader waits for it before reusing the slot
            self._cv.notify_all()
        if verify is not None and verify.done():
            verify.result()

    def host_weights(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights in host memory: the RAM tier's views, or read from the store."""
        return self.residency.host_weights(block)

    def update_block(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        """New values of a block (full finetuning): into the RAM tier and device copies; any slot
        still holding the old version is dropped so the next acquire loads the new one.

        On CUDA the copies are queued on the caller's current stream (phantom.stream.optim's update stream)
        without blocking, and the calling thread, not the compute stream, waits for them."""
        self.residency.update(block, tensors, non_blocking=self._cuda)
        if self._cuda:
            (done := torch.cuda.Event()).record(torch.cuda.current_stream(self.device))
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
        self.residency.close()
        self.transfer.close()
        self.writeback.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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

    def _streams(self, block: int) -> bool:
        return block in self._streamed

    def _next_load(self) -> tuple[Slot, int] | None:
        """The earliest block in the prefetch window that is not in a slot, and a slot to put it in."""
        window = self._plan[self._pos:]
        ahead = 0
        for p, block in enumerate(window, start=self._pos):
            if not self._streams(block):
                continue
            ahead += 1
            if ahead > self.layout.slots:
                return None
            if self._slot_holding(block) is not None:
                continue
            best = belady_victim(self.slots, self._plan, self._pos, p)
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
                experts = self.routed.wanted(block)
                slot.block, slot.state, slot.error, slot.views = block, "loading", None, None
                free_event, slot.free_event = slot.free_event, None
                verify, slot.verify = slot.verify, None
            try:
                if verify is not None:
                    verify.result()  # the previous block's bytes were hashed before they are overwritten
                stats = self.transfer.load(slot, block, self.residency.source(block), free_event, experts)
                with self._cv:  # several loader threads count into one step's metrics: no lost update
                    self.metrics.add(stats)
                    self.routed.observe_load(stats)
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


class RoutedSlots:
    """A scheduler's mixture-of-experts blocks read routed (phantom.stream.experts): which blocks are this
    step, what a load of one reads, and the experts read into a held slot after its router ran."""

    def __init__(self, scheduler: BlockScheduler, policy: ExpertReads | None, placement: Placement = Placement()):
        self.s, self.policy = scheduler, policy  # None: every block read whole
        self.every: frozenset = frozenset()  # every expert id (a load of a block whose other weights stay)
        if self.policy is not None:
            scheduler.transfer.experts = self.policy.layout
        self.keep_bases(placement.moe_base)

    def keep_bases(self, mode: str) -> None:
        """The layout's blocks whose attention, norms, router and shared experts stay on the device
        (phantom.stream.placement.kept_bases): each later load reads experts alone. Where the store or a tier
        cannot read experts apart, "auto" streams them with the experts and "device" is refused (ValueError)."""
        s = self.s
        if not s.layout.bases:
            return
        try:
            lay = self.policy.layout if self.policy is not None else ExpertLayout.of_store(s.store)
            for i in s.layout.bases:
                held = s.residency.source(i)
                if held.tier.reads and type(held).read_ranges is T.Held.read_ranges:
                    raise ValueError(f"moe_base device: the {held.tier.name} tier does not read parts of blocks; "
                                     "use moe_base stream")
        except ValueError as e:
            if mode == "device":
                raise ValueError(f"moe_base device: {e}") from None
            return
        s.transfer.experts, self.every = lay, frozenset(range(lay.n_experts))
        if self.policy is not None:
            self.policy.bases_kept = True
        s.transfer.bases = {i: None for i in s.layout.bases}
        log.info("the attention, norms, router and shared experts of %d mixture-of-experts blocks stay on the "
                 "device after their first load (%.1f MiB): later loads read experts alone",
                 len(s.layout.bases), len(s.layout.bases) * s.layout.sizes.base / 2**20)

    def drop_bases(self) -> None:
        """Nothing kept (full finetuning trains the weights a kept copy would hold)."""
        self.s.transfer.bases, self.every = None, frozenset()
        if self.policy is not None:
            self.policy.bases_kept = False

    def plan(self, tokens: int) -> None:
        if self.policy is not None:
            self.policy.plan(tokens)

    def observe_load(self, stats) -> None:
        if self.policy is not None:
            self.policy.observe_load(stats)

    def reads(self, block: int) -> bool:
        """Block's experts are read after its router this step (routed), where it streams."""
        return self.policy is not None and block in self.policy.routed and self.s._streams(block)

    def wanted(self, block: int) -> frozenset | None:
        """What a load of block reads (ExpertReads.wanted; the caller holds the scheduler's lock): a block whose
        other weights the device keeps reads every expert where it would read whole, once those weights are
        there and the file's parts can be checked alone."""
        store, entry = self.s.store, self.s.store.blocks[block]
        unchecked = self.s.residency.tier(block).reads and store.checks.pending(entry) and \
            not store.checks.routable(entry)
        wanted = self.policy.wanted(block, unchecked) if self.policy is not None else None
        if wanted is None and not unchecked and self.s.transfer.kept_base(block) is not None:
            return self.every
        return wanted

    def settle(self, block: int) -> None:
        """An acquired block read whole this step: a slot a routed load left partial (an earlier step's,
        before `auto` switched) gets the experts it lacks."""
        if self.policy is not None and not self.reads(block) and self.s._streams(block):
            self.ensure(block, range(self.policy.layout.n_experts))

    def ensure(self, block: int, experts) -> None:
        """The experts (ids) some token of this step routes to in an acquired block: read into its slot
        where a routed load left them out, and kept for the block's next load this step (the backward's
        reload reads the same ones)."""
        s = self.s
        if self.policy is None or not s._streams(block):
            return
        with s._cv:
            slot = s._slot_holding(block)
            assert slot is not None and slot.users > 0, f"experts of block {block} that is not acquired"
            self.policy.remember(block, experts)
        stats = s.transfer.fill(slot, block, s.residency.source(block), experts)
        if stats.bytes_experts:
            with s._cv:
                s.metrics.add(stats, fill=True)
            self.policy.observe_fill(stats)


def expert_reads_for(store: BlockStore, residency: Residency, layout, placement: Placement) -> ExpertReads | None:
    """The run's routed-read policy (phantom.stream.experts.ExpertReads), or None where nothing reads routed:
    a dense model, `whole`, no streamed block. Under `auto` a store or tier that cannot read experts apart
    (a quantized store without expert ranges, a tier without read_ranges) reads whole blocks, and so does a
    quantized store (`routed` reads it routed); `routed` refuses what cannot (ValueError)."""
    mode = placement.expert_reads
    if not store.cfg.n_experts or mode == "whole" or not layout.streamed:
        return None
    try:
        lay = ExpertLayout.of_store(store)
        tiers = {residency.tier(i) for i in layout.streamed}
        for tier in tiers:
            held = residency.held[tier.name]
            if tier.reads and type(held).read_ranges is T.Held.read_ranges:
                raise ValueError(f"routed expert reads: the {tier.name} tier does not read parts of blocks; "
                                 "use expert_reads whole")
    except ValueError:
        if mode == "routed":
            raise
        return None
    if mode == "auto" and store.quant is not None:
        return None  # its choice does not count the hit experts' dequantization, in series after the router
    return ExpertReads(lay, mode, store.n_blocks, round_trip_s=max(t.round_trip_s for t in tiers),
                       sparse=tuple(i for i in range(store.n_blocks) if store.cfg.sparse(i)))
