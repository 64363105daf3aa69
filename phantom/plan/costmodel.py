"""The cost model: a training step's time, memory and bytes moved for a placement, as pure functions.

Inputs are a `MachineProfile` (rates: measured by phantom.plan.tune, or given by hand) and a `Shape` (what
a `ModelConfig` says about one block), so a profile measured on a few blocks predicts the whole
model, and a preset can be planned before its weights exist. No I/O, no torch, no clocks: every
function here is a function of its arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phantom.base import dtypes
from phantom.arch.config import ModelConfig, block_tensor_shapes
from phantom.stream import placement as P
from phantom.stream.placement import Activations, Layout, Placement, loss_budget
from phantom.arch.quantformat import QuantFormat, as_format, block_nbytes

ALIGN = 4096  # phantom.files.tensorfile.DATA_ALIGN: HostBuffer rounds each RAM-tier block and staging buffer to it
HUGE_PAGE, HUGE_MIN = 2 << 20, 16 << 20  # phantom.stream.hostmem's: host buffers from HUGE_MIN get huge pages
FIXED_BYTES = 256 << 20  # LoRA and its optimizer state, allocator slack
MARGIN = 0.15  # keep this fraction of free memory unused
PREFETCH = (0, 1, 2, 3, 4, 6, 8)
GB = 1e9


def pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def host_buffer_bytes(n: int) -> int:
    """Resident bytes of a phantom.stream.hostmem.HostBuffer of n bytes, at most: from HUGE_MIN it is
    backed by huge pages, and the last one is resident whole."""
    step = HUGE_PAGE if n >= HUGE_MIN else ALIGN
    return -(-n // step) * step


@dataclass(frozen=True)
class Workload:
    """What one training step computes: `rows` rows of `seq_len` tokens in the compute dtype, over a store
    in `store_dtype` (its linear weights quantized as `quant`: a store's QuantFormat, or "nf4" / "int8" for
    prepare_model.py's format of that method, or None)."""

    rows: int
    seq_len: int
    dtype: str = "bf16"
    store_dtype: str = "bf16"
    quant: str | QuantFormat | None = None


@dataclass(frozen=True)
class SearchSpace:
    """What `search` may choose from: offload modes, recompute policies, micro-batches (None: the powers
    of two that divide the rows, and the rows), prefetch depths; `budgets` (a Placement's device_budget
    and ram_budget, when given) cap the device tier with its slots and the RAM tier."""

    offloads: tuple[str, ...] = ("auto",)
    recompute: tuple[str, ...] = ("auto", "all", "none")
    micro_batches: tuple[int, ...] | None = None
    prefetch: tuple[int, ...] = PREFETCH
    budgets: Placement | None = None


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a model, derived from its config and dtypes (see `shape_of`).

    block_bytes is one block in the store's dtype (what is read, and held in RAM); resident_bytes the
    same block in the compute dtype (a resident block); slot_bytes one device slot (store bytes plus
    the converted copy when the dtypes differ); tier_bytes the block size the scheduler budgets
    tiers with. flops_per_row is one block's forward over one row of seq_len tokens.
    """

    n_blocks: int
    block_bytes: int
    resident_bytes: int
    sizes: P.BlockBytes  # one block in each tier (phantom.stream.placement.block_sizes: the scheduler's rule)
    head_bytes: int
    embed_bytes: int
    flops_per_row: float
    head_flops_per_row: float
    act_bytes_per_row: int
    keep_bytes_per_row: int
    seq_len: int
    store_bytes: int  # the store's files: blocks, embedding, head (headers of a few KiB left out)
    dequant_bytes: int = 0  # a quantized store: the compute-dtype bytes each load dequantizes into

    @property
    def slot_bytes(self) -> int:
        return self.sizes.slot

    @property
    def tier_bytes(self) -> int:
        return self.sizes.budget

    @property
    def converts(self) -> bool:
        """Store and compute dtypes differ (or the store is quantized): the RAM tier is not used in place."""
        return self.sizes.converts


def keep_elems_per_token(cfg: ModelConfig) -> float:
    """Elements autograd saves per token for one block's graph (weights excluded).

    Fitted to the bytes `WeightHandles` counts for LoRA on q, v over five block shapes (dim 64-256,
    GQA and not, hidden 176-1024, seq 32-256; each within 3%): the norms' and projections' inputs
    (~8.5 dim), SwiGLU's three hidden-wide tensors, k and v. Attention runs as SDPA (flash): no
    T x T matrix is kept. A measured profile corrects it by its `keep_scale`.
    """
    return 8.5 * cfg.dim + 3 * cfg.token_hidden_dim + 2 * cfg.kv_heads * cfg.head_dim + 16


def shape_of(cfg: ModelConfig, store_dtype: str = "bf16", dtype: str = "bf16", seq_len: int = 1024,
             quant: str | QuantFormat | None = None) -> Shape:
    """The cost model's view of a model from its config alone: no store needed. quant (a QuantFormat, or
    "nf4" / "int8" as prepare_model.py writes them): a quantized store of it (its other tensors in
    store_dtype), its block bytes counted by the store's own layout rule, dequantized into `dtype` at
    each load."""
    stored, computed = dtypes.lookup(store_dtype), dtypes.lookup(dtype)
    s, c = stored.itemsize, computed.itemsize
    params = cfg.block_params()
    fmt = as_format(quant)
    block = params * s if fmt is None else block_nbytes(fmt, block_tensor_shapes(cfg), stored.torch_name)
    head_params = cfg.vocab_size * cfg.dim + cfg.dim
    embed_params = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # tied: the head's table is it
    return Shape(
        n_blocks=cfg.n_layers, block_bytes=block, resident_bytes=params * c,
        sizes=P.block_sizes(block, params, s, c, quant is not None, stored == computed),
        head_bytes=head_params * c, embed_bytes=embed_params * s,
        # matmuls (a mixture of experts: the experts a token routes to) + causal attention
        flops_per_row=seq_len * (2 * cfg.active_block_params() + 2 * seq_len * cfg.q_dim),
        head_flops_per_row=seq_len * 4 * cfg.vocab_size * cfg.dim,  # logits and their input gradient
        act_bytes_per_row=seq_len * cfg.dim * c,
        keep_bytes_per_row=int(seq_len * c * keep_elems_per_token(cfg)),
        seq_len=seq_len,
        store_bytes=cfg.n_layers * block + (head_params + embed_params) * s,
        dequant_bytes=params * c if quant is not None else 0)


@dataclass(frozen=True)
class MachineProfile:
    """A machine's rates, independent of the model (seconds, bytes, GB/s = 1e9 bytes/s, FLOP/s).

    Block compute is `call + rows * flops_per_row / rate` for each kind of call: the no-grad
    forward at `fwd_flops`, the graph-building forward (a kept block, or the recompute) and the
    backward at `fwd_flops / fwd_grad_ratio` and `fwd_flops / bwd_ratio`. `keep_scale` corrects the
    config's estimate of kept activation bytes. `compile_speedup` (eager / compiled block time) and
    `compile_s` are not measured by the tuner (None); a profile that gives them has compiled rows
    predicted with the speed-up. Free bytes of None mean: unknown, not a limit.
    """

    machine: str
    device: str  # "cuda", "cpu", "mps"
    dtype: str = "bf16"
    disk_gbps: float = 2.0  # cold reads (the page cache does not help a store larger than it)
    disk_warm_gbps: float | None = None
    h2d_gbps: float = 25.0  # pinned host -> device (on a CPU: a host memcpy)
    dequant_gbps: float = 4.0  # quantized stores: compute-dtype GB/s a loader dequantizes (tune.measure_dequant)
    fwd_flops: float = 100e12
    fwd_grad_ratio: float = 1.0
    bwd_ratio: float = 1.0  # LoRA: input gradients only, about the forward's FLOPs
    fwd_call_s: float = 0.0
    fwd_grad_call_s: float = 0.0
    bwd_call_s: float = 0.0
    head_flops: float | None = None  # None: at fwd_flops
    keep_scale: float = 1.0
    disk_jitter: float = 0.0  # relative std of one block read
    busy_compute_slowdown: float = 1.0  # compute while blocks are read / alone
    busy_read_slowdown: float = 1.0  # reads while a block computes / alone
    compute_threads: int = 0  # a CPU: threads a block computes on (0: unknown; loader work is taken to be free)
    compile_speedup: float | None = None
    compile_s: float | None = None
    free_device_bytes: int | None = None
    free_host_bytes: int | None = None
    free_disk_bytes: int | None = None
    quick: bool = False
    measured_on: str = ""  # the shape the rates were measured on ("" when given by hand)
    measured_at: str = ""

    @property
    def host_is_device(self) -> bool:
        """A CPU: blocks compute in host memory, so device and host are one pool."""
        return self.device == "cpu"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Prediction:
    """A placement and activation policy, and what the cost model predicts for them.

    layout: where each block lives (phantom.stream.placement.resolve; `tiers` is its tiers). bytes_read: read from the store's files per step (the scheduler's
    `bytes_read`); bytes_h2d: copied into device slots per step. pinned_bytes: page-locked host
    memory (RAM tier and staging, each buffer rounded to 4 KiB as HostBuffer allocates it).
    device_bytes, host_bytes: peak use (on a CPU, host_bytes holds everything). missing: what more
    the placement needs to fit, as (where, bytes) for each of "disk", "device", "host" that is short;
    empty when it fits. The store's disk space is the same for every placement, so it comes first.
    """

    placement: Placement
    activations: Activations
    rows: int
    layout: Layout
    step_s: float
    compute_s: float
    transfer_s: float
    bound: str
    device_bytes: int
    host_bytes: int
    pinned_bytes: int
    bytes_read: int
    bytes_h2d: int
    loads: int
    kept_blocks: int
    seq_len: int
    missing: tuple[tuple[str, int], ...] = ()

    @property
    def fits(self) -> bool:
        return not self.missing

    @property
    def short_of(self) -> str:
        """What is short, e.g. "disk" or "device, host"; "" when it fits."""
        return ", ".join(where for where, _ in self.missing)

    @property
    def missing_bytes(self) -> int:
        return sum(b for _, b in self.missing)

    def missing_text(self) -> str:
        """E.g. '35.2 GiB more disk space and 1.0 GiB more device memory'."""
        return " and ".join(f"{gib(b)} more {where} {'space' if where == 'disk' else 'memory'}"
                            for where, b in self.missing)

    @property
    def tokens_per_s(self) -> float:
        return self.rows * self.seq_len / self.step_s if self.step_s > 0 else 0.0

    @property
    def tiers(self) -> tuple[str, ...]:
        return self.layout.tiers

    @property
    def split(self) -> dict[str, int]:
        return self.layout.split

    # What scripts/finetune.py reads of the tuner's answer.
    @property
    def offload(self) -> str:
        return self.placement.offload

    @property
    def prefetch(self) -> int:
        return self.placement.prefetch

    @property
    def resident(self) -> int:
        return self.split["device"]

    def to_dict(self) -> dict:
        """Plain JSON types (what `scripts/tune.py --json` prints), with the derived figures beside them."""
        d = dataclasses.asdict(self)
        d["layout"].update(tiers=list(self.tiers), streamed=list(self.layout.streamed))
        d.update(tiers=list(self.tiers), missing=dict(self.missing), fits=self.fits, split=self.split,
                 tokens_per_s=self.tokens_per_s)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        lay = d["layout"]
        layout = Layout(**{**lay, "tiers": tuple(lay["tiers"]), "streamed": tuple(lay["streamed"]),
                           "sizes": P.BlockBytes(**lay["sizes"])})
        return cls(**{**d, "placement": Placement(**d["placement"]), "activations": Activations(**d["activations"]),
                      "layout": layout, "missing": tuple(d["missing"].items())})

    def describe(self) -> str:
        s, a = self.split, self.activations
        keep = {"none": "keep all", "all": "recompute all"}.get(a.recompute, f"keep {self.kept_blocks} blocks")
        return (f"{s['device']} blocks on the device, {s['ram']} in RAM, {s['disk']} on disk; prefetch "
                f"{self.placement.prefetch}; {keep}; micro-batch {a.micro_batch}; compile "
                f"{ {True: 'on', False: 'off', None: 'default'}[a.compile] }")


def layout(shape: Shape, profile: MachineProfile, placement: Placement,
           tiers: tuple[str, ...] | None = None) -> Layout:
    """The run's layout as the scheduler resolves it (phantom.stream.placement.resolve) from the same placement
    and memory; `tiers` fixes each block's tier instead (a plan being checked)."""
    free = P.FreeMemory(device=None if profile.host_is_device else profile.free_device_bytes,
                        host=profile.free_host_bytes, unified=profile.device == "mps")
    return P.resolve(shape.n_blocks, shape.sizes, placement, free, host_is_device=profile.host_is_device,
                     tiers=tiers)


def kept_blocks(shape: Shape, profile: MachineProfile, activations: Activations, rows: int) -> int:
    """Blocks whose activations are kept, as BlockExecutor.keeps decides (the first ones, in order)."""
    if activations.recompute != "auto":
        return shape.n_blocks if activations.recompute == "none" else 0
    per_block = rows * shape.keep_bytes_per_row * profile.keep_scale
    budget = activations.keep_budget or 0
    return min(shape.n_blocks, int(budget // per_block)) if per_block > 0 else shape.n_blocks


def predict(profile: MachineProfile, shape: Shape, placement: Placement, activations: Activations, rows: int,
            tiers: tuple[str, ...] | None = None, margin: float = MARGIN) -> Prediction:
    """Predicted step time, memory and traffic of one placement for `rows` rows of shape.seq_len tokens.

    Per block and pass, for m calls of b = micro_batch rows (N = rows):
        Cf = m * call + N * flops_per_row / rate     forward (the graph-building one if kept)
        Cb = backward, + a graph forward if recomputed
        X  = block_bytes / disk (disk tier) + block_bytes / h2d (unless it is read into a CPU slot)
             + dequant_bytes / dequant rate (a quantized store: the loader dequantizes each load)
    Streamed blocks S (disk, and RAM unless used in place) pass through K + 1 slots; each pass
    loads L of them (`loads_per_step`: the blocks still in slots at each turn are reused), so
        pipe(C) = S * C + sum(X)                                     K = 0: load, then compute
        pipe(C) = max(S * C + L * (C' - C), 2 * C + sum(X')) + jitter   K >= 1
    with C', X' slowed by the measured contention for the fraction of time they overlap (on a CPU, C'
    also loses a load's dequantization time over the compute's threads: the loader takes one of them), and
        step = (n - S) * (Cf + Cb) + pipe(Cf) + pipe(Cb) + head.
    Memory: see `device_memory` and `host_memory`.
    """
    lay = layout(shape, profile, placement, tiers)
    tiers, streams, slots = lay.tiers, list(lay.streamed), lay.slots
    keep = kept_blocks(shape, profile, activations, rows)
    cf, cb, head = block_compute(profile, shape, activations, rows, keep)
    b = activations.micro_batch or rows
    device, host, pinned = device_memory(shape, profile, tiers, slots, keep, rows, b), \
        *host_memory(shape, profile, tiers, slots, placement, keep, rows, b)
    cold = profile.disk_warm_gbps is None or tiers.count("disk") * shape.block_bytes > \
        (profile.free_host_bytes or 0) * (1 - margin) - host
    t = LoadTimes(disk_s=shape.block_bytes / ((profile.disk_gbps if cold else profile.disk_warm_gbps) * GB),
                  link_s=shape.block_bytes / (profile.h2d_gbps * GB),
                  dequant_s=shape.dequant_bytes / (profile.dequant_gbps * GB), host_is_device=profile.host_is_device)
    fwd_loads, bwd_loads = (list(x) for x in lay.loaded())
    still = set(range(shape.n_blocks)) - set(streams)
    step = sum(cf[i] + cb[i] for i in still) + head + \
        pipe_s(cf, fwd_loads, lay, t, profile) + pipe_s(cb, bwd_loads, lay, t, profile)
    compute = sum(cf) + sum(cb) + head
    loads = lay.loads()
    transfer = sum(t.of(tiers[i]) for i in fwd_loads + bwd_loads)
    bound = "compute" if step <= 1.1 * compute or transfer == 0 else \
        "disk" if loads["disk"] * t.disk_s >= (loads["disk"] + loads["ram"]) * t.link_s else "link"
    return Prediction(
        placement=placement, activations=activations, rows=rows, layout=lay, step_s=step, compute_s=compute,
        transfer_s=transfer, bound=bound, device_bytes=device, host_bytes=host, pinned_bytes=pinned,
        bytes_read=loads["disk"] * shape.block_bytes,
        bytes_h2d=(loads["ram"] + (0 if profile.host_is_device else loads["disk"])) * shape.block_bytes,
        loads=loads["disk"] + loads["ram"], kept_blocks=keep, seq_len=shape.seq_len,
        missing=shortfall(shape, profile, device, host, margin))


def block_compute(profile: MachineProfile, shape: Shape, activations: Activations, rows: int,
                  keep: int) -> tuple[list[float], list[float], float]:
    """Seconds of each block's forward (Cf) and backward (Cb, with the recomputed forward unless kept),
    and of the head, for `rows` rows in calls of micro_batch rows."""
    calls = -(-rows // (activations.micro_batch or rows))
    speed = profile.compile_speedup if activations.compile and profile.compile_speedup else 1.0

    def secs(call_s: float, ratio: float) -> float:
        return (calls * call_s + rows * shape.flops_per_row * ratio / profile.fwd_flops) / speed
    fwd, fwd_grad, bwd = secs(profile.fwd_call_s, 1.0), secs(profile.fwd_grad_call_s, profile.fwd_grad_ratio), \
        secs(profile.bwd_call_s, profile.bwd_ratio)
    cf = [fwd_grad if i < keep else fwd for i in range(shape.n_blocks)]
    cb = [bwd if i < keep else fwd_grad + bwd for i in range(shape.n_blocks)]
    return cf, cb, rows * shape.head_flops_per_row / (profile.head_flops or profile.fwd_flops)


@dataclass(frozen=True)
class LoadTimes:
    """Seconds one block load takes: read from disk, copied over the link, dequantized."""

    disk_s: float
    link_s: float
    dequant_s: float
    host_is_device: bool

    def of(self, tier: str) -> float:
        """X of a block of this tier: a CPU reads a disk block straight into its slot (no copy)."""
        if tier == "disk":
            return self.disk_s + (0.0 if self.host_is_device else self.link_s) + self.dequant_s
        return self.link_s + self.dequant_s


def pipe_s(c: list[float], loads: list[int], lay: Layout, t: LoadTimes, profile: MachineProfile) -> float:
    """One pass over the streamed blocks with `loads` of them loaded (see `predict`)."""
    streams, prefetch = lay.streamed, lay.prefetch
    if not streams:
        return 0.0
    total, c_avg = sum(c[i] for i in streams), sum(c[i] for i in streams) / len(streams)
    xs = [t.of(lay.tiers[i]) for i in loads]
    if not xs:
        return total
    if prefetch == 0:
        return total + sum(xs)
    x_avg = sum(xs) / len(xs)
    c_busy = c_avg * (1 + (profile.busy_compute_slowdown - 1) * min(1.0, x_avg / c_avg)) if c_avg else 0.0
    if profile.host_is_device and profile.compute_threads:  # a CPU's loader dequantizes on one of the cores
        c_busy += t.dequant_s / profile.compute_threads     # the block computes on: that share of it is lost
    reads = sum(t.disk_s for i in loads if lay.tiers[i] == "disk")
    x_busy = sum(xs) + reads * (profile.busy_read_slowdown - 1) * min(1.0, c_avg / x_avg)
    jitter = len(xs) * profile.disk_jitter * min(c_avg, x_avg) / prefetch
    return max(total + len(xs) * (c_busy - c_avg), 2 * c_avg + x_busy) + jitter


def activation_bytes(shape: Shape, profile: MachineProfile, keep: int, rows: int, micro_batch: int) -> int:
    """Saved for backward (kept graphs, or block inputs), one micro-batch's graph, the running output
    and its gradient."""
    kept_row = shape.keep_bytes_per_row * profile.keep_scale
    saved = keep * rows * kept_row + (shape.n_blocks - keep) * rows * shape.act_bytes_per_row
    return int(saved + micro_batch * kept_row + 2 * rows * shape.act_bytes_per_row)


def device_memory(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, keep: int,
                  rows: int, micro_batch: int) -> int:
    """Device bytes at the peak: slots, resident blocks, activations, head, one loss chunk at its peak
    (phantom.stream.placement.loss_budget, as PhantomModel sizes it), fixed slack (0 on a CPU)."""
    if profile.host_is_device:
        return 0
    blocks = slots * shape.slot_bytes + tiers.count("device") * shape.resident_bytes
    return blocks + activation_bytes(shape, profile, keep, rows, micro_batch) + shape.head_bytes + \
        loss_budget(profile.free_device_bytes) + FIXED_BYTES


def host_memory(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, placement: Placement,
                keep: int, rows: int, micro_batch: int) -> tuple[int, int]:
    """(host bytes, of which pinned) as BlockScheduler allocates them.

    The RAM tier is one HostBuffer of 4 KiB-aligned blocks (pinned on CUDA, exactly that size; resident
    up to the next huge page, see host_buffer_bytes); on CUDA each slot has a pinned staging buffer of
    one aligned block when any streamed block comes from disk. On a CPU the slots are aligned host
    buffers and everything else lives there too.
    """
    held = tiers.count("ram") + (tiers.count("device") if profile.host_is_device else 0)  # a CPU's device is RAM
    ram = 0 if placement.shared_ram else held * align(shape.block_bytes)
    slot = host_buffer_bytes(align(shape.block_bytes))
    if profile.host_is_device:
        rest = slots * slot + (slots * shape.resident_bytes if shape.converts else 0)
        acts = activation_bytes(shape, profile, keep, rows, micro_batch)
        return host_buffer_bytes(ram) + rest + acts + shape.head_bytes + FIXED_BYTES, 0
    staging = slots if "disk" in tiers else 0  # buffers of one aligned block
    pinned = ram + staging * align(shape.block_bytes) if profile.device == "cuda" else 0
    return host_buffer_bytes(ram) + staging * slot, pinned


def shortfall(shape: Shape, profile: MachineProfile, device: int, host: int,
              margin: float) -> tuple[tuple[str, int], ...]:
    """(where, bytes missing) for the store on disk, device and host memory (less `margin`) that are short."""
    def over(need: int, free: int | None, keep: float) -> int:
        return 0 if free is None else max(0, need - int(free * (1 - keep)))
    unified = profile.device == "mps"  # Apple silicon: what the device holds comes out of the host's memory
    short = (("disk", over(shape.store_bytes, profile.free_disk_bytes, 0.0)),
             ("device", over(device, profile.free_device_bytes, margin)),
             ("host", over(host + (device if unified else 0), profile.free_host_bytes, margin)))
    return tuple((where, b) for where, b in short if b)


# ---------------------------------------------------------------------------------------------
# The search: every placement the profile allows, ranked

def keep_budget_left(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
                     micro_batch: int, margin: float) -> int:
    """Bytes of kept activations that fit beside everything else (on the device, or the host on a CPU)."""
    if profile.host_is_device:
        free, used = profile.free_host_bytes, host_memory(shape, profile, tiers, slots, Placement(), 0, rows,
                                                          micro_batch)[0]
    else:
        free, used = profile.free_device_bytes, device_memory(shape, profile, tiers, slots, 0, rows, micro_batch)
    if free is None:
        return 1 << 62
    per_block = rows * shape.keep_bytes_per_row * profile.keep_scale
    extra = per_block - rows * shape.act_bytes_per_row  # a kept block holds its graph, not just its input
    n_keep = min(shape.n_blocks, max(0, int((free * (1 - margin) - used) // extra))) if extra > 0 else shape.n_blocks
    return int(n_keep * per_block)


def activation_choices(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
                       micro_batch: int, recompute: tuple[str, ...], margin: float) -> set[Activations]:
    """The policies to try: "all", "none", and "auto" with the keep budget that fills the memory left.

    An "auto" that keeps every block is "none", one that keeps none is "all": the plan says so."""
    out = set()
    for rc in recompute:
        budget = None
        if rc == "auto":
            budget = keep_budget_left(shape, profile, tiers, slots, rows, micro_batch, margin)
            keep = kept_blocks(shape, profile, Activations(recompute="auto", keep_budget=budget), rows)
            rc, budget = ("none", None) if keep == shape.n_blocks else ("all", None) if keep == 0 else (rc, budget)
        out.add(Activations(recompute=rc, keep_budget=budget, micro_batch=micro_batch))
    return out


def search(profile: MachineProfile, shape: Shape, rows: int, space: SearchSpace = SearchSpace(),
           margin: float = MARGIN) -> list[Prediction]:
    """Every candidate, fitting ones first, each group by predicted time.

    Candidates: each offload mode; blocks resident on the device 0..n (a CPU has no device tier);
    the RAM tier filled to the default RAM budget of the free host memory (more RAM, fewer disk
    reads), and where every policy with it leaves the host short, smaller by what is missing; prefetch depths up to the streamed blocks; micro-batches that divide the rows (powers
    of two and the rows); the activation policies of `activation_choices`. Compile is not a candidate:
    the tuner does not measure its speed-up, and the model's default stands (on for CUDA).
    `space.budgets` cap the device tier with its slots and the RAM tier, as the scheduler would.
    """
    micros = space.micro_batches or tuple(sorted({b for b in pow2_upto(rows) if rows % b == 0} | {rows}))
    n, out, seen = shape.n_blocks, [], set()
    budgets, prefetch, recompute = space.budgets or Placement(), space.prefetch, space.recompute
    for offload in space.offloads:
        for R in ([0] if profile.host_is_device or offload == "none" else range(n + 1)):
            for K in prefetch:
                if budgets.device_budget is not None and offload != "none" and \
                        (R + K + 1) * shape.tier_bytes > max(budgets.device_budget, (K + 1) * shape.tier_bytes):
                    continue  # more resident blocks than the device budget holds beside the slots
                base = Placement(offload=offload, prefetch=K, resident=R)
                n_ram = layout(shape, profile, dataclasses.replace(base, ram_budget=budgets.ram_budget)).split["ram"]
                while n_ram is not None:  # the RAM tier the budget allows; less if none of it fits the host
                    place = dataclasses.replace(base, ram_budget=n_ram * shape.tier_bytes)
                    lay = layout(shape, profile, place)
                    if K > max(0, len(lay.streamed) - 1) and K != min(prefetch):
                        break  # deeper than the streamed blocks: the same as a shallower one
                    short = []
                    for b in micros:
                        for acts in activation_choices(shape, profile, lay.tiers, lay.slots, rows, b, recompute,
                                                       margin):
                            if (lay.tiers, K, acts) not in seen:
                                seen.add((lay.tiers, K, acts))
                                out.append(predict(profile, shape, place, acts, rows, lay.tiers, margin))
                                short.append(dict(out[-1].missing).get("host", 0))
                    least = min(short, default=0)
                    n_ram = max(0, n_ram - -(-least // align(shape.block_bytes))) if least and n_ram > 0 else None
    out.sort(key=lambda c: (not c.fits, c.step_s))
    return out


def choose(candidates: list[Prediction], tie: float = 0.01) -> Prediction:
    """The fastest fitting candidate of `search`.

    Within `tie` of the fastest, it prefers fewer block loads, more resident blocks, a deeper queue
    (it absorbs read-time variance), a larger micro-batch (fewer calls) and, last, less memory. Its
    bound becomes "memory" when it is compute-bound only because a faster candidate did not fit.

    Raises:
        ValueError: nothing fits; the message says how many bytes are missing and where.
    """
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.missing_bytes)
        fix = "free that much disk space, or prepare the store on a larger disk" if least.short_of == "disk" else \
            "free that much, or use a smaller --batch-size or --seq-len"
        raise ValueError(f"no placement fits: even the smallest needs {least.missing_text()} (with a {MARGIN:.0%} "
                         f"margin on memory); {fix}")
    t_best = min(c.step_s for c in fitting)
    near = [c for c in fitting if c.step_s <= t_best * (1 + tie)]
    best = min(near, key=lambda c: (c.loads, -c.resident, -c.placement.prefetch, -c.activations.micro_batch,
                                    c.device_bytes + c.host_bytes))
    if best.bound == "compute" and faster_if_more_memory(candidates, best) is not None:
        best = dataclasses.replace(best, bound="memory")
    return best


def faster_if_more_memory(candidates: list[Prediction], chosen: Prediction, gain: float = 0.05) -> Prediction | None:
    """The fastest candidate that does not fit, if it beats the chosen one by more than `gain`."""
    fastest = min(candidates, key=lambda c: c.step_s)
    return fastest if not fastest.fits and fastest.step_s < (1 - gain) * chosen.step_s else None


def check_prediction(prediction: Prediction, measured_step_s: float, tolerance: float = 0.20,
                     min_step_s: float = 0.1) -> str | None:
    """A line for the log when a measured step differs from the prediction by more than `tolerance`.

    Steps under `min_step_s` are Python overhead, which the model does not try to predict."""
    if prediction.step_s <= 0 or measured_step_s <= 0 or max(prediction.step_s, measured_step_s) < min_step_s:
        return None
    err = measured_step_s / prediction.step_s - 1
    if abs(err) <= tolerance:
        return None
    return (f"measured step {measured_step_s:.3f} s is {err:+.0%} off the tuner's prediction "
            f"{prediction.step_s:.3f} s ({prediction.bound}-bound); if the machine or its load changed, "
            f"re-measure with python scripts/tune.py")


# ---------------------------------------------------------------------------------------------
# What a person reads: the plan before a run, and the measured step beside it after

def gib(n: int | float | None) -> str:
    """Bytes for a person: GiB, or MiB below one GiB."""
    if n is None:
        return "unknown"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def per_s(x: float) -> str:
    """A rate for a person: 1,015 or 0.0189 (a 70B on two CPU cores is not zero tokens/s)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def describe_plan(prediction: Prediction, shape: Shape, profile: MachineProfile, name: str = "model") -> str:
    """The plan for the whole model as a few labelled lines: placement, memory, traffic, step and bound.

    What `scripts/tune.py` prints and `finetune.py` logs at its start, so the two say the same thing."""
    p, place = prediction, prediction.placement
    cpu = profile.host_is_device
    device = "on a CPU: blocks compute in host memory" if cpu else \
        f"device {gib(p.device_bytes)} of {gib(profile.free_device_bytes)} free"
    lines = [
        f"model      {name}: {shape.n_blocks} blocks of {gib(shape.block_bytes)}, store {gib(shape.store_bytes)}; "
        f"{p.rows} rows x {p.seq_len} tokens per step",
        f"machine    {profile.machine} ({profile.device}); disk {profile.disk_gbps:.2f} GB/s, "
        + ("" if cpu else f"host-to-device {profile.h2d_gbps:.1f} GB/s, ")
        + f"block compute {profile.fwd_flops / 1e9:,.1f} GFLOP/s"
        + (f" (measured on {profile.measured_on})" if profile.measured_on else " (rates given by hand)"),
        f"placement  {p.describe()}; offload {place.offload}",
        f"memory     {device}; host {gib(p.host_bytes)} of {gib(profile.free_host_bytes)} free"
        + (f" ({gib(p.pinned_bytes)} pinned)" if p.pinned_bytes else "")
        + f"; disk {gib(shape.store_bytes)} for the store",
        f"traffic    per step {p.loads} block loads: {p.bytes_read / 1e9:.1f} GB read from disk, "
        f"{p.bytes_h2d / 1e9:.1f} GB host-to-device",
        f"predicted  {p.step_s:.3f} s/step, {per_s(p.tokens_per_s)} tokens/s, {p.bound}-bound "
        f"(compute {p.compute_s:.3f} s, transfers {p.transfer_s:.3f} s)"]
    if not p.fits:
        lines.append(f"does not fit: needs {p.missing_text()}")
    return "\n".join(lines)


def describe_measured(prediction: Prediction, measured_step_s: float) -> str:
    """One line for the end of a run: the measured step beside the prediction."""
    err = measured_step_s / prediction.step_s - 1 if prediction.step_s > 0 else 0.0
    tokens = prediction.rows * prediction.seq_len / measured_step_s if measured_step_s > 0 else 0.0
    return (f"measured   {measured_step_s:.3f} s/step, {per_s(tokens)} tokens/s; predicted {prediction.step_s:.3f} s "
            f"({err:+.0%})")
