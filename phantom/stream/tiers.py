"""Tiers: where a block waits between uses, each described in one place.

A `Tier` says everything the rest of the engine asks of it: whether its blocks pass through the
device slots (`streams`), whether a load reads the block into a host buffer (`reads`: the disk tier)
or copies it from bytes the tier holds in host memory (the RAM tier), the trace lane its reads are
drawn in (`lane`), the seconds one block takes to reach host memory at a machine's rates (`read_s`,
for the cost model), the host memory its blocks take (`host_bytes`, `pinned`), and how a run holds
its blocks (`open`, returning a `Held`). The device, RAM and disk tiers are its implementations.

`register` adds another tier (a remote object store, compressed RAM, NVMe-direct reads): a run
places blocks in it with `Placement(offload=<its name>)`, and placement, the scheduler, the transfer
stage, the cost model and the trace read it from here; nothing else names it. A tier that declares a
`budget` also takes blocks under `offload="auto"`, after the device and RAM tiers and before disk.

A package makes its tier a choice of the scripts' `--offload` (and of a run file's `offload:`) by
declaring it in the `phantom.tiers` entry point group, under the tier's name:

    [project.entry-points."phantom.tiers"]          # pyproject.toml; setup.cfg: [options.entry_points]
    objstore = "mypkg.tiers:ObjectStoreTier"         # a Tier subclass, a Tier, or a function returning one

`load_plugins` registers them (the scripts call it before building their flags, so `--help` lists
them; a Placement naming a tier not registered yet calls it too).
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from phantom.files.tensorfile import DATA_ALIGN, packed_empty
from phantom.stream.experts import read_ranges
from phantom.stream.hostmem import HostBuffer, register_read_only

GB = 1e9


def aligned(nbytes: int) -> int:
    """A block's bytes rounded up to DATA_ALIGN, as host buffers lay blocks out (direct I/O's alignment)."""
    return -(-nbytes // DATA_ALIGN) * DATA_ALIGN


@dataclass
class TierContext:
    """What a tier gets to hold a run's blocks: the store (its `read_block_into`, `map_block`,
    `block_views`), the transfer stage (its `pin`, `stride`, `new_slot`, `load`), the step's metrics
    (start-up reads are counted there), the compute dtype and device, and `shared` (the RAM tier maps
    the store's files so local ranks hold one copy)."""

    store: object
    transfer: object
    metrics: object
    dtype: torch.dtype
    device: torch.device
    shared: bool = False


class Held:
    """One tier's blocks for one run (what `Tier.open` returns); the scheduler asks it for bytes."""

    pinned_bytes = 0  # page-locked host bytes it allocated

    def __init__(self, tier: "Tier", ctx: TierContext):
        self.tier, self.ctx = tier, ctx

    def read_into(self, block: int, into: torch.Tensor) -> Callable | None:
        """A reading tier: the block's bytes into `into` (a host uint8 buffer of the block's size, on
        a loader thread, several at once); returns a deferred check of those bytes to run before they
        are trusted, or None."""
        raise NotImplementedError(f"the {self.tier.name} tier does not read blocks into buffers")

    def read_ranges(self, block: int, into: torch.Tensor, ranges) -> None:
        """A reading tier: bytes [a, b) of the block's data section into into[a:b] for each range (a
        mixture-of-experts block read routed: phantom.stream.experts). Not every tier can: those that
        cannot read their MoE blocks whole."""
        raise NotImplementedError(f"the {self.tier.name} tier does not read parts of blocks")

    def host(self, block: int) -> torch.Tensor | None:
        """The block's bytes where this tier keeps them in host memory (the store's layout); None if not."""
        return None

    def views(self, block: int) -> dict[str, torch.Tensor]:
        """The block's weights where they are computed without a slot (the device tier; the RAM tier
        used in place on a CPU)."""
        return self.ctx.store.block_views(self.host(block), block)

    def update(self, block: int, tensors: dict[str, torch.Tensor], non_blocking: bool) -> None:
        """New values of a block (full finetuning) into what this tier holds."""
        raise ValueError(f"the {self.tier.name} tier cannot take updated weights (full finetuning)")

    def close(self) -> None:
        """Release what the tier holds (registrations, mappings)."""


class Tier:
    """Where a block lives between uses, and what that costs; subclass and `register` one to add a tier.

    Class attributes (override as needed):
        name: the tier's name in a Layout's tiers and in `Placement(offload=...)`.
        reads: a load reads the block into a host buffer (a slot's staging buffer; on a CPU the slot
            itself, so no copy follows); False: the tier holds the bytes in host memory and a load
            copies them from there.
        lane: the Chrome trace lane its reads are drawn in (phantom.stream.trace.Tracer).
        expert_lane: the lane of its routed expert reads (after the router; phantom.stream.experts).
        round_trip_s: seconds one more request costs beside its bytes (a routed block's expert read).
        pinned: its host bytes are page-locked on CUDA (the cost model counts them as pinned).
    """

    name = ""
    reads = True
    lane = "read"
    expert_lane = "experts"
    round_trip_s = 1e-4
    pinned = False

    def streams(self, in_place: bool) -> bool:
        """Its blocks pass through the device slots; `in_place`: a CPU computes host-tier blocks where
        they lie (no conversion needed)."""
        return True

    @property
    def counter(self) -> str:
        """The Metrics counter its bytes go to: read from storage, or served from host memory."""
        return "bytes_read" if self.reads else "bytes_ram"

    def read_s(self, nbytes: int, profile) -> float:
        """Seconds one block of nbytes takes to reach host memory at the rates of `profile` (a
        phantom.plan MachineProfile; its disk rate is the warm one when the page cache holds the files)."""
        return 0.0

    def budget(self, free) -> int | None:
        """Stored bytes of blocks `offload="auto"` may put in this tier after the device and RAM tiers,
        given the free memory (a phantom.stream.placement.FreeMemory); None: no limit. 0 (the default)
        leaves the tier to runs that name it. The built-in tiers are budgeted by Placement's fields."""
        return 0

    def host_bytes(self, n_blocks: int, block_bytes: int, shared: bool, host_is_device: bool) -> int:
        """Host memory n of its blocks take (`shared`: a shared RAM tier maps the files; `host_is_device`:
        a CPU, whose device memory is host memory)."""
        return 0

    def open(self, ctx: TierContext, blocks: list[int]) -> Held:
        """Hold `blocks` for a run (read them in now if the tier keeps a copy)."""
        raise NotImplementedError


class DiskHeld(Held):
    def read_into(self, block: int, into: torch.Tensor) -> Callable | None:
        return self.ctx.store.read_block_into(block, into, defer_verify=True)

    def read_ranges(self, block: int, into: torch.Tensor, ranges) -> None:
        store = self.ctx.store
        read_ranges(store.blocks[block], into, ranges, store.drop_cache)
        store.checks.check_pieces(store.blocks[block], into, ranges)  # what a routed read read, checked alone

    def update(self, block, tensors, non_blocking) -> None:
        """The store's file is rewritten by the caller (phantom.stream.optim)."""


class DiskTier(Tier):
    """The store's files: each block read at each use (direct I/O where the filesystem allows)."""

    name = "disk"

    def read_s(self, nbytes: int, profile) -> float:
        return nbytes / (profile.disk_gbps * GB)

    def open(self, ctx: TierContext, blocks: list[int]) -> Held:
        return DiskHeld(self, ctx)


class RamHeld(Held):
    def __init__(self, tier: Tier, ctx: TierContext, blocks: list[int]):
        """One exact-size allocation (pinned on CUDA), every block read once (and verified) here; or,
        shared, the block files mapped so local ranks hold one copy."""
        super().__init__(tier, ctx)
        store, stride, pin = ctx.store, ctx.transfer.stride, ctx.transfer.pin
        self.blocks: dict[int, torch.Tensor] = {}
        self.buffer: HostBuffer | None = None
        self._registered = []  # finalizers of registered file mappings (the shared tier on CUDA)
        if ctx.shared:
            for i in blocks:
                self.blocks[i] = store.map_block(i)
                if pin:  # else every copy from it goes through pageable memory: staged, synchronous
                    self._registered.append(register_read_only(self.blocks[i]))
        elif blocks:  # each block its own size (dense layers' blocks among sparse ones are smaller)
            starts = [0]
            for i in blocks:
                starts.append(starts[-1] + (stride if not store.two_layouts else aligned(store.block_size(i))))
            self.buffer = HostBuffer(starts[-1], pin)
            for k, i in enumerate(tqdm(blocks, desc="loading blocks to RAM", unit="block", disable=None,
                                       leave=False)):
                self.blocks[i] = self.buffer.block(starts[k], store.block_size(i))
                store.read_block_into(i, self.blocks[i])
                ctx.metrics.bytes_read += store.block_size(i)
        self.pinned_bytes = self.buffer.tensor.numel() if pin and self.buffer is not None else 0

    def host(self, block: int) -> torch.Tensor | None:
        return self.blocks.get(block)

    def update(self, block, tensors, non_blocking) -> None:
        for k, v in self.views(block).items():
            v.copy_(tensors[k], non_blocking=non_blocking)

    def close(self) -> None:
        for unregister in self._registered:
            if unregister is not None:
                unregister()


class RamTier(Tier):
    """Host RAM: read once at start-up (pinned on CUDA, exactly the bytes needed), copied at each use;
    on a CPU computing in the stored dtype, used where it lies."""

    name = "ram"
    reads = False
    pinned = True
    round_trip_s = 1e-5

    def streams(self, in_place: bool) -> bool:
        return not in_place

    def host_bytes(self, n_blocks: int, block_bytes: int, shared: bool, host_is_device: bool) -> int:
        return 0 if shared else n_blocks * aligned(block_bytes)

    def open(self, ctx: TierContext, blocks: list[int]) -> Held:
        return RamHeld(self, ctx, blocks)


class DeviceHeld(Held):
    def __init__(self, tier: Tier, ctx: TierContext, blocks: list[int]):
        """Each block loaded once from the store's files through a slot's pipeline, then kept in buffers
        of its own (in the file's layout, so its projections still fuse)."""
        super().__init__(tier, ctx)
        self.resident: dict[int, dict] = {}
        transfer, cuda = ctx.transfer, ctx.device.type == "cuda"
        source = get("disk").open(ctx, blocks)
        loader = transfer.new_slot(True) if blocks else None
        copied = None  # CUDA: the compute stream is done reading the loader's converted tensors
        for i in blocks:
            ctx.metrics.add(transfer.load(loader, i, source, copied))
            transfer.sync_ready(loader)
            if loader.converted is None:  # the slot's buffer becomes the block's; the slot gets a new one
                views = loader.views
                loader.buf = torch.empty_like(loader.buf)
            else:  # copied on this thread's stream; the next load (copy stream) overwrites them after it
                views = packed_empty(loader.views, ctx.dtype, ctx.device)
                for k, v in loader.views.items():
                    views[k].copy_(v)
                if cuda:
                    copied = torch.cuda.Event()
                    copied.record(torch.cuda.current_stream(ctx.device))
            self.resident[i] = views
            loader.block, loader.state, loader.views = None, "empty", None

    def views(self, block: int) -> dict[str, torch.Tensor]:
        return self.resident[block]

    def update(self, block, tensors, non_blocking) -> None:
        for k, v in self.resident[block].items():
            v.copy_(tensors[k], non_blocking=non_blocking)


class DeviceTier(Tier):
    """Resident on the device: loaded once, never streamed."""

    name = "device"
    reads = False

    def streams(self, in_place: bool) -> bool:
        return False

    def host_bytes(self, n_blocks: int, block_bytes: int, shared: bool, host_is_device: bool) -> int:
        return n_blocks * aligned(block_bytes) if host_is_device else 0  # a CPU's device memory is RAM

    def open(self, ctx: TierContext, blocks: list[int]) -> Held:
        return DeviceHeld(self, ctx, blocks)


BUILTIN = ("device", "ram", "disk")  # fastest first; `offload="auto"` fills them by budget
_REGISTRY: dict[str, Tier] = {t.name: t for t in (DeviceTier(), RamTier(), DiskTier())}


def register(tier: Tier, replace: bool = False) -> Tier:
    """Add a tier (an instance of a Tier subclass) under its name; `replace` swaps a registered one of
    that name (not a built-in one). Returns the tier."""
    if not tier.name or not tier.name.isidentifier():
        raise ValueError(f"a tier needs a name that is an identifier, not {tier.name!r}")
    if tier.name in BUILTIN or tier.name in ("auto", "none"):
        raise ValueError(f"{tier.name!r} is a built-in name; give the tier another")
    if tier.name in _REGISTRY and not replace:
        raise ValueError(f"a tier named {tier.name!r} is registered already (replace=True swaps it)")
    _REGISTRY[tier.name] = tier
    return tier


def unregister(name: str) -> None:
    """Remove a tier added by `register`."""
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in tier")
    _REGISTRY.pop(name, None)


def get(name: str) -> Tier:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r} (tiers: {', '.join(_REGISTRY)})") from None


def names() -> tuple[str, ...]:
    """Every tier's name: the built-in ones, fastest first, then the registered ones."""
    return tuple(_REGISTRY)


ENTRY_POINTS = "phantom.tiers"  # the entry point group installed packages declare their tiers in
_loaded: set[str] = set()  # entry points registered by load_plugins


def load_plugins() -> tuple[str, ...]:
    """Register the tier each `phantom.tiers` entry point names (once per process); returns their names.

    An entry point's object is a Tier, a Tier subclass (made with no arguments) or a function returning a
    Tier, whose name is the entry point's. A tier its package registered itself on import, of the same
    class, is kept.

    Raises:
        ValueError: a plugin that fails to load, is not a tier, is named unlike its entry point, takes a
            built-in name, or is declared by two packages (one line naming the package).
    """
    points = importlib.metadata.entry_points(group=ENTRY_POINTS)
    seen: dict[str, str] = {}
    for ep in points:
        where = f"the tier plugin {ep.name!r} ({ep.value}, package {ep.dist.name if ep.dist else 'unknown'})"
        if ep.name in seen and seen[ep.name] != ep.value:
            raise ValueError(f"two packages declare a tier named {ep.name!r}: {seen[ep.name]} and {ep.value}; "
                             f"uninstall one")
        seen[ep.name] = ep.value
        if ep.name in _loaded:
            continue
        tier = _plugin_tier(ep, where)
        if (held := _REGISTRY.get(tier.name)) is not None and type(held) is type(tier):
            _loaded.add(ep.name)
            continue
        try:
            register(tier)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        _loaded.add(ep.name)
    return tuple(sorted(seen))


def _plugin_tier(ep, where: str) -> Tier:
    """The Tier an entry point names, checked."""
    try:
        obj = ep.load()
        tier = obj() if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Tier)) else obj
    except Exception as e:  # noqa: BLE001 - any failure in a plugin's code is reported as its own, in one line
        raise ValueError(f"{where} failed to load: {type(e).__name__}: {e}") from None
    if not isinstance(tier, Tier):
        raise ValueError(f"{where} gives {type(tier).__name__}, not a phantom.stream.tiers.Tier")
    if tier.name != ep.name:
        raise ValueError(f"{where} is a tier named {tier.name!r}: the entry point must be named as its tier")
    return tier
