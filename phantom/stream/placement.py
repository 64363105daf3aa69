"""The run's knobs as small frozen configs, and the pure rule that places blocks in tiers by budget.

`Placement` says where the weights live and how they stream; `Activations` says what a block keeps
between forward and backward and how it runs. These two objects are what the CLI builds (phantom.train.cli
turns their fields into flags), what `phantom.load` takes, what the tuner returns and what a
checkpoint records.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from phantom.stream import tiers as T

OFFLOADS = ("auto", "none", "ram", "disk")  # and any tier added with phantom.stream.tiers.register
RECOMPUTE = ("auto", "all", "none")
EXPERT_READS = ("auto", "routed", "whole")
MOE_BASE = ("auto", "device", "stream")
TIERS = T.BUILTIN
GiB = 1 << 30


def knob(default, help: str, **meta):
    """A config field with the help text (and choices, type) its CLI flag shows."""
    return field(default=default, metadata=dict(help=help, **meta))


@dataclass(frozen=True)
class Placement:
    """Where the base weights live and how they reach the device.

    Tiers, fastest first: resident on the device, host RAM (pinned on CUDA: exactly the bytes
    needed, see BlockScheduler), the store's files. `offload="auto"` fills the device, then RAM, by
    budget; the rest is read from disk on each use (`assign_tiers`). `offload` may also name a tier
    added with phantom.stream.tiers.register: every block not resident on the device lives there.
    """

    offload: str = knob("auto", "where blocks wait between uses: auto fills device then RAM by budget, the rest "
                                "from disk; none (all on the device), ram (all in RAM), disk (all read per use), "
                                "or a tier an installed package declares (entry points phantom.tiers)",
                        choices=lambda: offloads())
    prefetch: int = knob(2, "blocks read and copied ahead of the one computing (device slots = prefetch + 1)")
    resident: int | None = knob(None, "blocks kept on the device (default: as many as --device-budget allows "
                                      "with --offload auto, else 0)")
    device_budget: int | None = knob(None, "bytes of device memory for resident blocks and slots (default: free "
                                           "memory less a margin for activations)", type="bytes")
    ram_budget: int | None = knob(None, "bytes of host RAM for the RAM tier (default: 85%% of available memory "
                                        "less a margin)", type="bytes")
    shared_ram: bool = knob(False, "map the RAM tier from the store files so local ranks share one copy (LoRA)")
    expert_reads: str = knob("auto", "mixture-of-experts blocks streamed from RAM or disk: read only the experts "
                                     "the step's tokens route to, after the router (routed), the whole block "
                                     "(whole), or whichever the cost model says is faster (auto)",
                             choices=EXPERT_READS)
    moe_base: str = knob("auto", "mixture-of-experts blocks that stream: keep each one's attention, norms, router and "
                                 "shared experts on the device after its first load and stream only its experts "
                                 "(device: their memory is set aside before resident blocks), read them with the "
                                 "experts at each load (stream), or keep them where they fit in the memory the "
                                 "blocks and slots leave (auto); LoRA and DPO (full finetuning trains them)",
                         choices=MOE_BASE)

    def __post_init__(self):
        if self.offload not in offloads() and self.offload not in offload_choices():
            raise ValueError(f"offload must be one of {', '.join(offloads())}, not {self.offload!r}")
        if self.expert_reads not in EXPERT_READS:
            raise ValueError(f"expert_reads must be one of {', '.join(EXPERT_READS)}, not {self.expert_reads!r}")
        if self.moe_base not in MOE_BASE:
            raise ValueError(f"moe_base must be one of {', '.join(MOE_BASE)}, not {self.moe_base!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        for name in ("resident", "device_budget", "ram_budget"):
            if (v := getattr(self, name)) is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")

    @property
    def slots(self) -> int:
        """Device slots a streaming run cycles through: the block computing and `prefetch` ahead of it."""
        return self.prefetch + 1


@dataclass(frozen=True)
class Activations:
    """What each block keeps for its backward, and how its computation runs."""

    recompute: str = knob("auto", "rerun each block's forward in backward (all), keep its activations without "
                                  "its weights (none), or keep as many blocks as --keep-budget allows (auto)",
                          choices=RECOMPUTE)
    keep_budget: int | None = knob(None, "bytes of kept activations under recompute auto (default: half the "
                                         "memory left on the compute side)", type="bytes")
    checkpoint_inner: bool = knob(False, "also checkpoint attention and MLP inside blocks (long sequences)")
    micro_batch: int | None = knob(None, "rows per block call; a larger batch is accumulated layer-major")
    compile: bool | None = knob(None, "torch.compile the block once for all layers (default: on for CUDA)")
    loss_chunk: int | None = knob(None, "tokens per chunk of the fused head + loss (default: sized from memory)")
    mlp_chunk: int = knob(2048, "tokens per chunk of a block's MLP, its norms and attention's projections in a "
                                "longer row, forward and backward: one chunk's hidden activations at a time "
                                "(0: whole rows)")

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, not {self.recompute!r}")
        for name in ("micro_batch", "loss_chunk"):
            if (v := getattr(self, name)) is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.mlp_chunk < 0:
            raise ValueError(f"mlp_chunk must be >= 0, got {self.mlp_chunk}")


def offloads() -> tuple[str, ...]:
    """What `Placement.offload` may be: the built-in modes, and every registered tier but the device."""
    return OFFLOADS + tuple(t for t in T.names() if t not in TIERS)


def offload_choices() -> tuple[str, ...]:
    """`offloads()` once the tiers installed packages declare are registered (T.load_plugins): what a
    script's --offload offers and its --help lists.

    Raises:
        ValueError: a tier plugin is broken or conflicts (one line).
    """
    T.load_plugins()
    return offloads()


def split_knobs(knobs: dict, *configs):
    """Route keyword knobs to the config that has a field of that name; returns the new configs.

    So `phantom.load(..., prefetch=1, recompute="none")` and a CLI flag reach the right config without
    any layer listing them: a field added to a config is a keyword of the API at once.
    """
    out, left = [], dict(knobs)
    for cfg in configs:
        names = {f.name for f in dataclasses.fields(cfg)}
        mine = {k: left.pop(k) for k in list(left) if k in names}
        out.append(dataclasses.replace(cfg, **mine) if mine else cfg)
    if left:
        raise TypeError(f"unknown option(s): {', '.join(sorted(left))}")
    return out


@dataclass(frozen=True)
class BlockBytes:
    """One block's bytes where each tier holds it.

    stored: in the store's files and in host RAM (quantized bytes for a quantized store).
    budget: the size the RAM tier is budgeted with (the stored block in the compute dtype when that
        is wider: the budget a RAM tier was always planned with).
    slot: one device streaming slot (the stored bytes, and the converted copy when dtypes differ).
    resident: one block kept on the device (compute dtype; dequantized for a quantized store).
    converts: the compute dtype differs from the stored one (or the store is quantized), so the
        RAM tier cannot be used in place on a CPU.
    base: a mixture-of-experts block's attention, norms, router and shared experts as the device keeps
        them (compute dtype; `Placement.moe_base`); 0 for a dense model.
    """

    stored: int
    budget: int
    slot: int
    resident: int
    converts: bool = False
    base: int = 0


def block_sizes(stored: int, params: int, store_itemsize: int, itemsize: int, quantized: bool,
                same_dtype: bool) -> BlockBytes:
    """A block's BlockBytes from its stored bytes and parameter count, the store's and the compute's
    element sizes (and whether the two dtypes are one: fp16 and bf16 are not): what the scheduler reads
    off a store and the cost model off a config, one rule."""
    dense = params * itemsize  # the block in the compute dtype
    converts = not same_dtype or quantized
    budget = stored if quantized else stored * max(1, itemsize // store_itemsize)  # RAM: a quantized block's bytes
    return BlockBytes(stored=stored, budget=budget, slot=stored + (dense if converts else 0),
                      resident=dense if quantized else budget, converts=converts)


@dataclass(frozen=True)
class FreeMemory:
    """Free bytes as the probes measured them (phantom.stream.memory); None: unknown, not a limit.

    `unified`: the device and the host share one memory (Apple silicon, `mps`): what the device tier
    and the slots take is not there for the RAM tier."""

    device: int | None = None
    host: int | None = None
    unified: bool = False


@dataclass(frozen=True)
class Layout:
    """Where every block of a run lives, resolved once (`resolve`) and read by the scheduler, the cost
    model, the tuner and the benchmarks: nothing else decides any of it.

    tiers: each block's tier ("device", "ram", "disk"). streamed: the blocks that pass through the
    device slots (disk, and RAM unless the RAM tier is used in place). slots: `Placement.slots` where
    any block streams. in_place: the RAM tier is the device memory (a CPU computing in the stored dtype).
    offload: what "auto" resolved to ("none", "ram", "disk" or "mixed"; others as asked).
    bases: the streamed mixture-of-experts blocks whose non-expert weights stay on the device after their
    first load, so that each later load reads only experts (`Placement.moe_base`).
    """

    tiers: tuple[str, ...]
    streamed: tuple[int, ...]
    slots: int
    prefetch: int
    in_place: bool
    offload: str
    sizes: BlockBytes
    bases: tuple[int, ...] = ()

    @property
    def split(self) -> dict[str, int]:
        """Blocks in each tier: the built-in ones always, a registered one where it holds any."""
        return {t: self.tiers.count(t) for t in TIERS + tuple(sorted(set(self.tiers) - set(TIERS)))}

    @property
    def tier_bytes(self) -> dict[str, int]:
        """Bytes each tier holds: resident blocks on the device (and the slots), the others' stored blocks."""
        s = self.split
        return {t: n * self.sizes.resident + self.slots * self.sizes.slot + len(self.bases) * self.sizes.base
                if t == "device" else n * self.sizes.stored for t, n in s.items()}

    def streams(self, block: int) -> bool:
        return block in self.streamed

    def loads(self) -> dict[str, int]:
        """Blocks loaded into device slots per training step, by tier: "disk" and "ram" always, a
        registered tier where it holds any (see `loads_per_step`)."""
        fwd, bwd = self.loaded()
        loaded = [self.tiers[i] for i in fwd + bwd]
        return {t: loaded.count(t) for t in self.split if t != "device"}

    def loaded(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The streamed blocks the forward and the backward load, in order (see `turn_loads`)."""
        return turn_loads(self.streamed, self.slots)


def resolve(n_blocks: int, sizes: BlockBytes, placement: Placement, free: FreeMemory,
            host_is_device: bool = False, in_place: bool | None = None,
            tiers: tuple[str, ...] | None = None, moe_blocks: tuple[int, ...] = ()) -> Layout:
    """The whole layout of a run: each block's tier by budget, what streams, the slots.

    host_is_device: a CPU run, whose device memory is host memory: no device tier by budget (only
    offload "none" keeps every block "on the device", in buffers of its own; a CPU converting blocks
    streams those from RAM instead). The RAM tier is used where it lies on a CPU whenever a block needs
    no conversion; in_place=False forces the slot path a GPU takes (tests). `tiers` fixes each
    block's tier instead of the budgets (a plan being checked, a test); the rest follows from them.
    `moe_blocks`: the blocks with experts, whose non-expert weights may stay on the device (`kept_bases`).
    """
    in_place = host_is_device and not sizes.converts and in_place is not False
    if tiers is not None:
        if len(tiers) != n_blocks or set(tiers) - set(T.names()):
            raise ValueError(f"tiers must name one of {', '.join(T.names())} for each of the {n_blocks} blocks")
        lay = _layout(tuple(tiers), placement, sizes, in_place)
    else:
        reserve = len(moe_blocks) * sizes.base if placement.moe_base == "device" else 0
        tiers = assign_tiers(n_blocks, sizes, placement, free, zero_copy=host_is_device, reserve=reserve)
        if host_is_device and not in_place:  # a CPU converting blocks: what it keeps goes through slots
            tiers = tuple("ram" if t == "device" else t for t in tiers)
        lay = _layout(tiers, placement, sizes, in_place)
    return dataclasses.replace(lay, bases=kept_bases(lay, placement, free, host_is_device, moe_blocks))


def kept_bases(lay: Layout, placement: Placement, free: FreeMemory, host_is_device: bool,
               moe_blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The streamed blocks with experts whose attention, norms, router and shared experts stay on the device
    (`Placement.moe_base`): all of them under "device" (their memory was set aside before the resident
    blocks), none under "stream", and under "auto" all of them where they fit in the memory the resident
    blocks and the slots leave of the budget (the device's; on a CPU, what the RAM tier leaves of its budget), else
    none. Each byte kept saves a byte read at every load of its block, as a resident block's do: "auto"
    spends only what the whole blocks could not use; the tuner weighs "device" against more resident blocks."""
    moe = tuple(i for i in lay.streamed if i in set(moe_blocks))
    if not moe or not lay.sizes.base or placement.moe_base == "stream":
        return ()
    if placement.moe_base == "device":
        return moe
    s, n = lay.sizes, lay.split
    if host_is_device:
        budget = placement.ram_budget if placement.ram_budget is not None else ram_budget(free.host)
        used = (n["ram"] + n["device"]) * s.budget  # what the RAM budget placed (its slots are not in it)
    else:
        budget = placement.device_budget if placement.device_budget is not None else device_budget(free.device)
        used = n["device"] * s.resident + lay.slots * s.slot
    return moe if budget is None or budget - used >= len(moe) * s.base else ()


def _layout(tiers: tuple[str, ...], placement: Placement, sizes: BlockBytes, in_place: bool) -> Layout:
    streamed = tuple(i for i, t in enumerate(tiers) if T.get(t).streams(in_place))
    offload = placement.offload if placement.offload != "auto" else \
        "ram" if set(tiers) <= {"device", "ram"} else "disk" if set(tiers) <= {"device", "disk"} else "mixed"
    return Layout(tiers=tiers, streamed=streamed, slots=placement.slots if streamed else 0,
                  prefetch=placement.prefetch, in_place=in_place, offload=offload, sizes=sizes)


def assign_tiers(n_blocks: int, sizes: BlockBytes, placement: Placement, free: FreeMemory,
                 zero_copy: bool = False, reserve: int = 0) -> tuple[str, ...]:
    """Each block's tier ("device", "ram", "disk" or a registered one), from the placement and the free
    memory (`resolve` calls it; nothing else should).

    The device tier takes the first blocks (which ones does not change the bytes moved). Of the
    streamed blocks, the last `slots` are still in device slots at the turn from forward to
    backward, and the first `slots` at the turn from backward to the next forward: each is read
    once per step, every other streamed block twice. So the disk tier takes those ends (the last
    ones first) and the RAM set sits in the middle: the fewest bytes read from disk per step. On a
    CPU (`zero_copy`) the RAM tier is used in place, not streamed, and the device tier is the RAM tier.
    With unified memory (Apple silicon) the device tier and the slots come out of the same memory as
    the RAM tier, so the RAM budget is what the host has left after them.

    Args:
        n_blocks, sizes: the store's blocks: the RAM tier is budgeted by sizes.budget, a streaming slot
            takes sizes.slot of the device (the stored bytes and a converted copy), a resident block
            sizes.resident (dequantized, for a quantized store).
        placement: the requested placement; its budgets override the free-memory defaults.
        free: measured free bytes (None: unknown, treated as unlimited); a CPU's device is ignored.
        reserve: bytes set aside before any block is placed (the bases of `Placement.moe_base` "device"):
            out of the device budget, or a CPU's RAM budget.
    """
    block_bytes, device_block_bytes = sizes.budget, sizes.resident
    free_device, free_host = None if zero_copy else free.device, free.host
    slots = placement.slots * sizes.slot + (0 if zero_copy else reserve)
    if placement.offload == "none":
        return ("device",) * n_blocks
    n_device = placement.resident or 0
    if placement.offload == "auto" and placement.resident is None and not zero_copy:
        budget = placement.device_budget if placement.device_budget is not None else device_budget(free_device)
        n_device = max(0, (budget - slots) // device_block_bytes) if budget is not None else n_blocks
    n_device = min(n_device, n_blocks)
    if placement.offload not in OFFLOADS:  # a registered tier: every block off the device lives there
        n_kept = n_device if zero_copy else 0  # a CPU keeps its "device" blocks in the RAM tier, in place
        return ("device",) * (n_device - n_kept) + ("ram",) * n_kept + (placement.offload,) * (n_blocks - n_device)
    if placement.offload == "ram":
        n_ram = n_blocks - n_device
    elif placement.offload == "disk":
        n_ram = 0
    else:
        if free.unified and free_host is not None:
            free_host = max(0, free_host - n_device * device_block_bytes - slots)
        budget = placement.ram_budget if placement.ram_budget is not None else ram_budget(free_host)
        budget = None if budget is None else max(0, budget - (reserve if zero_copy else 0))
        n_ram = min(n_blocks - n_device, budget // block_bytes if budget is not None else n_blocks)
    if zero_copy:  # a CPU: blocks in RAM are used where they lie; there is no separate device tier
        n_ram, n_device = min(n_blocks, n_ram + n_device), 0
    extra = by_budget(n_blocks - n_device - n_ram, sizes, free) if placement.offload == "auto" else ()
    return arrange(n_blocks, n_device, n_ram, extra, placement.slots, ram_streams=not zero_copy)


def by_budget(n_left: int, sizes: BlockBytes, free: FreeMemory) -> tuple[tuple[str, int], ...]:
    """(tier, blocks) that `offload="auto"` puts in registered tiers after the device and RAM tiers:
    each in the order they were registered, up to its budget (phantom.stream.tiers.Tier.budget, in
    stored bytes); what is left goes to disk."""
    out = []
    for name in T.names():
        if name in TIERS or n_left <= 0:
            continue
        budget = T.get(name).budget(free)
        n = n_left if budget is None else min(n_left, budget // sizes.stored)
        if n > 0:
            out.append((name, n))
            n_left -= n
    return tuple(out)


def arrange(n_blocks: int, n_device: int, n_ram: int, extra: tuple[tuple[str, int], ...], ends: int,
            ram_streams: bool) -> tuple[str, ...]:
    """Each block's tier from the counts (`assign_tiers`): the device tier first; of the streamed
    blocks the first and last `ends` (the slots) are read once per step, the others twice, so disk
    takes those ends and the faster streamed tiers (RAM unless used in place, registered ones) sit
    in the middle."""
    middle = ("ram",) * n_ram + tuple(name for name, n in extra for _ in range(n))
    n_disk = n_blocks - n_device - len(middle)
    head = min(ends, max(0, n_disk - ends)) if (n_ram and ram_streams) or extra else 0
    return ("device",) * n_device + ("disk",) * head + middle + ("disk",) * (n_disk - head)


def device_budget(free_device: int | None) -> int | None:
    """Default device budget for blocks: free memory less a quarter (activations, workspace) and 2 GiB."""
    return None if free_device is None else max(0, int(free_device * 0.75) - 2 * GiB)


LOSS_BYTES_PER_LOGIT = 18  # a loss chunk's peak: bf16 and fp32 logits, log-softmax, fp32 and bf16 gradient


def loss_budget(free_device: int | None) -> int:
    """Device bytes for one chunk of the fused head + loss at its peak: an eighth of the free memory
    (measured before blocks are placed, and kept out of their budget), between 64 MiB and 2 GiB."""
    return 64 << 20 if free_device is None else max(64 << 20, min(2 * GiB, free_device // 8))


def ram_budget(free_host: int | None) -> int | None:
    """Default RAM-tier budget: 85% of available host memory less 4 GiB (the process, page cache)."""
    return None if free_host is None else max(0, int(free_host * 0.85) - 4 * GiB)


def parse_bytes(text: str) -> int:
    """'64G', '512M', '1.5T', '1000' (bytes) -> int; binary units."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in units and s[-1:] else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 64G, 512M or a number of bytes)") from None
    if value < 0:
        raise ValueError(f"a size must be >= 0, not {text!r}")
    return int(value * units[unit])


def loads_per_step(tiers: tuple[str, ...], slots: int, ram_streams: bool) -> dict[str, int]:
    """Blocks loaded into device slots per training step, by tier, once the run is in its rhythm: the
    streamed blocks are disk, and RAM unless the RAM tier is used in place as on a CPU (`turn_loads`)."""
    streamed = tuple(i for i, t in enumerate(tiers) if t == "disk" or (t == "ram" and ram_streams))
    fwd, bwd = turn_loads(streamed, slots)
    loaded = [tiers[i] for i in fwd + bwd]
    return {"disk": loaded.count("disk"), "ram": loaded.count("ram")}


def turn_loads(streamed: tuple[int, ...], slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks the forward and the backward load: the streamed blocks S go forward then backward
    through `slots` device slots with eviction by next use, so the last m = min(slots, |S|) of the
    forward are reused by the backward, and the first m of the backward by the next forward: the
    forward loads S[m:], the backward S[:|S| - m]."""
    m = min(slots, len(streamed))
    return tuple(streamed[m:]), tuple(streamed[:len(streamed) - m])


def cycle_loads(streamed: tuple[int, ...], slots: int) -> tuple[int, ...]:
    """The blocks each pass loads when forward passes follow one another (generation's steps): a pass ends with
    its last m = min(slots, |S|) blocks in the slots and the next one's window asks for its first m, evicting by
    next use the held blocks outside it, so the blocks among both the first and the last m stay: none where the
    slots hold every streamed block."""
    n = len(streamed)
    if slots >= n:
        return ()
    kept = range(n - slots, slots)  # empty unless the first and the last `slots` overlap
    return tuple(b for k, b in enumerate(streamed) if k not in kept)


# A CPU runs a block fastest per token over a few thousand tokens a call: a dim-1024 fp32 block took 0.141 ms a
# token over 2048 tokens and 0.196 over 8192 (its MLP's intermediates no longer in cache). Scoring's micro-batches
# (phantom.plan.costscore) and a generation's prefill (phantom.stream.executor) take at most this many tokens a
# call on a CPU; a GPU's calls grow with its memory.
CPU_CALL_TOKENS = 2048
