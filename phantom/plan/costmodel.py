"""The cost model: a training step's time, memory and bytes moved for a placement, as pure functions.

Its inputs are phantom.plan.costinputs' (a `MachineProfile` of rates, a `Shape` of the model, each tier's
load seconds); `predict` gives a `Prediction` of one placement and activation policy. phantom.plan.planner
searches the candidates and says the plan in words. No I/O, no clocks: every function here is a function
of its arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phantom.plan.costinputs import LoadTimes, MachineProfile, Shape
from phantom.stream import placement as P
from phantom.stream import tiers as T
from phantom.stream.placement import Activations, Layout, Placement, loss_budget

ALIGN = 4096  # phantom.files.tensorfile.DATA_ALIGN: HostBuffer rounds each RAM-tier block and staging buffer to it
HUGE_PAGE, HUGE_MIN = 2 << 20, 16 << 20  # phantom.stream.hostmem's: host buffers from HUGE_MIN get huge pages
FIXED_BYTES = 256 << 20  # LoRA and its optimizer state, allocator slack
PROCESS_BYTES = 320 << 20  # a CPU run's process before its model: Python, torch and phantom imported (ru_maxrss
# 0.316 GiB, notes/long-rows.md), its allocator's slack and LoRA's state at the widths planned
CPU_LOSS_LOGITS = 64 << 20  # phantom.model.heads.default_loss_chunk on a CPU: fp32 logits of one loss chunk
MARGIN = 0.15  # keep this fraction of free memory unused

def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN

def host_buffer_bytes(n: int) -> int:
    """Resident bytes of a phantom.stream.hostmem.HostBuffer of n bytes, at most: from HUGE_MIN it is
    backed by huge pages, and the last one is resident whole."""
    step = HUGE_PAGE if n >= HUGE_MIN else ALIGN
    return -(-n // step) * step

def gib(n: int | float | None) -> str:
    """Bytes for a person: GiB, or MiB below one GiB."""
    if n is None:
        return "unknown"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

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
    bytes_inputs: int = 0  # block inputs copied to host memory and back, each way (CUDA, long rows; hostinputs)

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
        return missing_text(self.missing)

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
                           "bases": tuple(lay.get("bases", ())),
                           "sizes": P.BlockBytes(**lay["sizes"])})
        return cls(**{**d, "placement": Placement(**d["placement"]), "activations": Activations(**d["activations"]),
                      "layout": layout, "missing": tuple(d["missing"].items())})

    def describe(self) -> str:
        s, a = self.split, self.activations
        keep = {"none": "keep all", "all": "recompute all"}.get(a.recompute, f"keep {self.kept_blocks} blocks")
        more = "".join(f", {n} in {t}" for t, n in s.items() if t not in ("device", "ram", "disk"))
        if self.layout.bases:
            more += f" (the attention and shared experts of {len(self.layout.bases)} of them kept on the device)"
        if a.mlp_chunk and self.seq_len > a.mlp_chunk:
            keep += f"; blocks tiled in chunks of {a.mlp_chunk} tokens (--mlp-chunk {a.mlp_chunk})"
        return (f"{s['device']} blocks on the device, {s['ram']} in RAM, {s['disk']} on disk{more}; prefetch "
                f"{self.placement.prefetch}; {keep}; micro-batch {a.micro_batch}; compile "
                f"{ {True: 'on', False: 'off', None: 'default'}[a.compile] }")

def layout(shape: Shape, profile: MachineProfile, placement: Placement,
           tiers: tuple[str, ...] | None = None) -> Layout:
    """The run's layout as the scheduler resolves it (phantom.stream.placement.resolve) from the same placement
    and memory; `tiers` fixes each block's tier instead (a plan being checked)."""
    free = P.FreeMemory(device=None if profile.host_is_device else profile.free_device_bytes,
                        host=profile.free_host_bytes, unified=profile.device == "mps")
    return P.resolve(shape.n_blocks, shape.sizes, placement, free, host_is_device=profile.host_is_device,
                     tiers=tiers, moe_blocks=shape.moe_blocks)

def held_slots(lay: Layout, profile: MachineProfile) -> int:
    """Slots that hold memory: on a CPU, a slot no block is loaded into stays untouched (fewer streamed blocks
    than slots); a device's and its pinned staging buffers are allocated whole."""
    return min(lay.slots, len(lay.streamed)) if profile.host_is_device else lay.slots

def kept_blocks(shape: Shape, profile: MachineProfile, activations: Activations, rows: int) -> int:
    """Blocks whose activations are kept, as BlockExecutor.keeps decides (the first ones, in order), within
    the policy's keep budget or, where it gives none, the one a run takes (`default_keep_budget`)."""
    if activations.recompute != "auto":
        return shape.n_blocks if activations.recompute == "none" else 0
    per_block = rows * kept_row_bytes(shape, profile, activations.mlp_chunk)
    budget = default_keep_budget(profile) if activations.keep_budget is None else activations.keep_budget
    return min(shape.n_blocks, int(budget // per_block)) if per_block > 0 else shape.n_blocks

def default_keep_budget(profile: MachineProfile) -> int:
    """The keep budget of a run under recompute "auto" that is given none, as phantom.model.backends'
    default_keep_budget sets it: half of what is free on the compute side (CUDA's device, else the host; a
    host of unknown free memory 4 GiB, a device's unknown: no limit). Counted as no budget at all, an "auto"
    run that keeps every block was predicted to recompute every one: a no-grad forward a block too many."""
    if profile.device == "cuda":
        return profile.free_device_bytes // 2 if profile.free_device_bytes is not None else 1 << 62
    return profile.free_host_bytes // 2 if profile.free_host_bytes is not None else 4 << 30

def resident_activations(placement: Placement, activations: Activations) -> Activations:
    """What a policy does under `placement`: a resident model (offload "none") is trained by plain autograd
    (phantom.model.backends.ResidentBlocks), which keeps every block's graph whatever `recompute` says."""
    if placement.offload != "none" or activations.recompute == "none":
        return activations
    return dataclasses.replace(activations, recompute="none", keep_budget=None)

def predict(profile: MachineProfile, shape: Shape, placement: Placement, activations: Activations, rows: int,
            tiers: tuple[str, ...] | None = None, margin: float = MARGIN) -> Prediction:
    """Predicted step time, memory and traffic of one placement for `rows` rows of shape.seq_len tokens.

    Per block and pass, for m calls of b = micro_batch rows (N = rows):
        Cf = m * call + N * flops_per_row / rate     forward (the graph-building one if kept)
        Cb = backward, + a graph forward if recomputed
        X  = the tier's read (phantom.stream.tiers.Tier.read_s: block_bytes / disk for the disk tier)
             + block_bytes / h2d (unless it is read into a CPU slot)
             + D = dequant_bytes / dequant rate (a quantized store dequantizes each load on the device)
    On a CPU the compute's threads dequantize a loaded block when it is acquired (phantom.stream.transfer):
    D is the compute's, once per load, not the loader's.
    A block whose attention, norms, router and shared experts the device keeps (Layout.bases) loads its
    experts alone: X of Shape.kept() (its other bytes take device memory instead).
    Streamed blocks S (disk, and RAM unless used in place) pass through K + 1 slots; each pass
    loads L of them (`loads_per_step`: the blocks still in slots at each turn are reused), so
        pipe(C) = S * C + sum(X)                                     K = 0: load, then compute
        pipe(C) = max(S * C + L * (D + W' - W), 2 * W + loaders(X')) + jitter   K >= 1, W = C + D (D: a CPU's)
    with W', X' slowed by the measured contention for the time they overlap (a CPU's D as its compute: beside
    two cold readers a dim-2048 block's dequantization took 0.86-1.46x its time alone, its forward 1.0-1.13x:
    one factor within the spread), loaders(X') the loads
    in series or, on a CPU reading from disk, spread over its loaders (`loaders_s`), and
        step = (n - S) * (Cf + Cb) + pipe(Cf) + pipe(Cb) + head.
    Memory: see `device_memory` and `host_memory`, with `held_slots`.
    """
    activations = resident_activations(placement, activations)
    lay = layout(shape, profile, placement, tiers)
    tiers, streams, slots = lay.tiers, list(lay.streamed), lay.slots
    keep = kept_blocks(shape, profile, activations, rows)
    cf, cb, head = block_compute(profile, shape, activations, rows, keep)
    bases, host_slots = len(lay.bases) * shape.sizes.base, held_slots(lay, profile)
    device, host, pinned = device_memory(shape, profile, tiers, slots, keep, rows, activations) + \
        (0 if profile.host_is_device else bases), *host_memory(shape, profile, tiers, host_slots, placement, keep,
                                                               rows, activations)
    host += bases if profile.host_is_device else 0
    cold = profile.disk_warm_gbps is None or tiers.count("disk") * shape.block_bytes > \
        (profile.free_host_bytes or 0) * (1 - margin) - host
    t = LoadTimes.of_block(profile, shape, tiers, warm=not cold)
    t_kept = LoadTimes.of_block(profile, shape.kept(), tiers, warm=not cold) if lay.bases else None
    fwd_loads, bwd_loads = (list(x) for x in lay.loaded())
    still = set(range(shape.n_blocks)) - set(streams)
    step = sum(cf[i] + cb[i] for i in still) + head + \
        pipe_s(cf, fwd_loads, lay, t, profile, t_kept) + pipe_s(cb, bwd_loads, lay, t, profile, t_kept)
    compute = sum(cf) + sum(cb) + head
    loads = lay.loads()
    read = sum(n for tier, n in loads.items() if T.get(tier).reads)  # loads a tier reads (disk), the rest copied
    saved = lambda which: sum(shape.base_bytes for i in fwd_loads + bwd_loads  # noqa: E731
                              if i in lay.bases and which(T.get(tiers[i]).reads))
    transfer = sum((t_kept if i in lay.bases else t).of(tiers[i]) for i in fwd_loads + bwd_loads)
    bound = "compute" if step <= 1.1 * compute or transfer == 0 else \
        "disk" if sum(t.read_s.get(tier, 0.0) * n for tier, n in loads.items()) >= sum(loads.values()) * t.link_s else "link"
    return Prediction(
        placement=placement, activations=activations, rows=rows, layout=lay, step_s=step, compute_s=compute,
        transfer_s=transfer, bound=bound, device_bytes=device, host_bytes=host, pinned_bytes=pinned,
        bytes_read=read * shape.block_bytes - saved(bool),
        bytes_h2d=(sum(loads.values()) - (read if profile.host_is_device else 0)) * shape.block_bytes -
        saved(lambda reads: not (reads and profile.host_is_device)),
        loads=sum(loads.values()), kept_blocks=keep, seq_len=shape.seq_len,
        bytes_inputs=input_copy_bytes(shape, profile, keep, rows, activations.mlp_chunk),
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

def pipe_s(c: list[float], loads: list[int], lay: Layout, t: LoadTimes, profile: MachineProfile,
           t_kept: LoadTimes | None = None) -> float:
    """One pass over the streamed blocks with `loads` of them loaded (see `predict`); `t_kept`: a load of a
    block whose other weights the device keeps (Layout.bases)."""
    streams, prefetch = lay.streamed, lay.prefetch
    if not streams:
        return 0.0
    total, c_avg = sum(c[i] for i in streams), sum(c[i] for i in streams) / len(streams)
    kept = set(lay.bases) if t_kept is not None else set()
    of = lambda i: t_kept if i in kept else t  # noqa: E731
    xs = [of(i).of(lay.tiers[i]) for i in loads]
    if not xs:
        return total
    deq = sum(of(i).compute_dequant_s for i in loads)  # a CPU's: on the compute's threads, once per load
    if prefetch == 0:
        return total + sum(xs) + deq
    x_avg, d_avg = sum(xs) / len(xs), deq / len(xs)
    work = c_avg + d_avg  # the compute's threads' per load; a CPU's dequantization slows beside reads as its compute
    slowed = (profile.busy_compute_slowdown - 1) * min(x_avg, work)  # for the time a load's reads overlap it
    reads = sum(of(i).read_s.get(lay.tiers[i], 0.0) for i in loads)
    x_busy = loaders_s(xs, reads, lay, profile) + \
        reads * (profile.busy_read_slowdown - 1) * min(1.0, work / x_avg) if x_avg else 0.0
    jitter = len(xs) * profile.disk_jitter * min(c_avg, x_avg) / prefetch
    return max(total + len(xs) * slowed + deq, 2 * work + x_busy) + jitter


def loaders_s(xs: list[float], reads: float, lay: Layout, profile: MachineProfile) -> float:
    """Seconds the scheduler's loaders take for loads of xs seconds each (reads of `reads` in all). Where a tier
    reads, the scheduler runs a loader per slot, up to 3 (phantom.stream.scheduler): on a CPU, whose loaders
    only read (and copy), they overlap, bounded by the disk (the reads one after another) and by each loader's
    own loads in series."""
    n = min(lay.slots, 3) if reads else 1
    if n == 1 or not profile.host_is_device:
        return sum(xs)
    return max(reads, sum(xs) / n)

def tiled(shape: Shape, chunk: int) -> bool:
    """A row of shape.seq_len tokens runs its blocks' token-wise parts `chunk` tokens at a time (phantom.arch.tiled)."""
    return bool(chunk) and shape.seq_len > chunk

def kept_row_bytes(shape: Shape, profile: MachineProfile, chunk: int) -> float:
    """Bytes one kept block's graph holds per row: the whole graph, or where the row is tiled the parts' inputs
    and attention's (phantom.arch.tiled keeps no chunk's intermediates)."""
    whole = shape.seq_len * shape.row_bytes_per_token if tiled(shape, chunk) else shape.keep_bytes_per_row
    return whole * profile.keep_scale

def inputs_on_host(shape: Shape, profile: MachineProfile, chunk: int) -> bool:
    """Whether the recomputed blocks' inputs wait in host memory (phantom.stream.hostinputs): on CUDA, where the
    row is tiled. On a CPU they are in host memory anyway."""
    return profile.device == "cuda" and tiled(shape, chunk)

def block_peak_bytes(shape: Shape, profile: MachineProfile, chunk: int, micro_batch: int) -> float:
    """One block's backward at its peak for a micro-batch: its graph and gradients over the whole row, or where
    the row is tiled what stays at full length with attention's gradients (the MLP's input's gradient among
    `row_bytes_per_token`), and one chunk's graph and gradients; a sparse attention's chunk of queries and its
    recompute (their bytes are the chunk's, whatever the rows)."""
    per_token = shape.graph_bytes_per_token or shape.keep_bytes_per_row / shape.seq_len
    if tiled(shape, chunk):
        row = shape.seq_len * (shape.row_bytes_per_token + shape.row_grad_bytes_per_token) + chunk * per_token
    else:
        row = shape.seq_len * per_token
    return micro_batch * row * profile.keep_scale + shape.chunk_bytes

def activation_bytes(shape: Shape, profile: MachineProfile, keep: int, rows: int, micro_batch: int,
                     chunk: int = 0) -> int:
    """Saved for backward (kept graphs, the recomputed blocks' inputs: all of them, or where they wait in host
    memory the one block's brought back, and the state blocks carry to later ones), one micro-batch's block backward
    at its peak (`block_peak_bytes`), and untiled the gradient coming in beside the block's output (a tiled block's
    residual part makes no output in its recompute and writes its input's gradient into the one coming in, which
    `row_bytes_per_token` counts: phantom.arch.tiled); `chunk`: Activations.mlp_chunk."""
    inputs = min(1, shape.n_blocks - keep) if inputs_on_host(shape, profile, chunk) else shape.n_blocks - keep
    saved = keep * rows * kept_row_bytes(shape, profile, chunk) + inputs * rows * shape.act_bytes_per_row + \
        rows * shape.carry_bytes_per_row
    running = 0 if tiled(shape, chunk) else 2  # tiled: the MLP's input's gradient is written into the one coming in
    return int(saved + block_peak_bytes(shape, profile, chunk, micro_batch) +
               running * rows * shape.act_bytes_per_row)

def input_copy_bytes(shape: Shape, profile: MachineProfile, keep: int, rows: int, chunk: int) -> int:
    """Bytes of the recomputed blocks' inputs copied to host memory and back per step, each way, where they wait
    there (`inputs_on_host`)."""
    return (shape.n_blocks - keep) * rows * shape.act_bytes_per_row if inputs_on_host(shape, profile, chunk) else 0

def host_input_bytes(shape: Shape, profile: MachineProfile, keep: int, rows: int, chunk: int) -> int:
    """Page-locked host bytes of the recomputed blocks' inputs where they wait there (`inputs_on_host`): one
    HostBuffer each."""
    if not inputs_on_host(shape, profile, chunk):
        return 0
    return (shape.n_blocks - keep) * host_buffer_bytes(rows * shape.act_bytes_per_row)

def device_memory(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, keep: int,
                  rows: int, acts: Activations) -> int:
    """Device bytes at the peak: slots, resident blocks, activations (acts: micro-batch, None for all the rows, and
    chunk), head, one loss chunk at its peak (phantom.stream.placement.loss_budget, as PhantomModel sizes it), fixed
    slack (0 on a CPU)."""
    if profile.host_is_device:
        return 0
    blocks = slots * shape.slot_bytes + tiers.count("device") * shape.resident_bytes
    return blocks + activation_bytes(shape, profile, keep, rows, acts.micro_batch or rows, acts.mlp_chunk) + \
        shape.head_bytes + loss_budget(profile.free_device_bytes) + FIXED_BYTES

def host_memory(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, placement: Placement,
                keep: int, rows: int, acts: Activations) -> tuple[int, int]:
    """(host bytes, of which pinned) as BlockScheduler allocates them.

    Each tier's blocks take `Tier.host_bytes` (phantom.stream.tiers). The RAM tier is one HostBuffer of 4 KiB-aligned blocks (pinned on CUDA, exactly that size; resident
    up to the next huge page, see host_buffer_bytes); on CUDA each slot has a pinned staging buffer of
    one aligned block when any streamed block is read (the disk tier). On a CPU the slots are aligned host
    buffers and everything else lives there too: the process (PROCESS_BYTES in place of FIXED_BYTES), the
    embedding and head tables and one loss chunk (`cpu_loss_bytes`). On CUDA a tiled row's recomputed block
    inputs wait in pinned host memory (`host_input_bytes`).
    """
    held = {t: T.get(t).host_bytes(tiers.count(t), shape.block_bytes, placement.shared_ram, profile.host_is_device)
            for t in set(tiers)}  # a CPU's device tier is RAM
    ram = sum(held.values())
    slot = host_buffer_bytes(align(shape.block_bytes))
    if profile.host_is_device:
        rest = slots * slot + (slots * shape.resident_bytes if shape.converts else 0)
        held_acts = activation_bytes(shape, profile, keep, rows, acts.micro_batch or rows, acts.mlp_chunk)
        return host_buffer_bytes(ram) + rest + held_acts + shape.head_bytes + shape.embed_bytes + \
            cpu_loss_bytes(shape) + PROCESS_BYTES, 0
    staging = slots if any(T.get(t).reads for t in tiers) else 0  # buffers of one aligned block
    inputs = host_input_bytes(shape, profile, keep, rows, acts.mlp_chunk)
    pinned = sum(b for t, b in held.items() if T.get(t).pinned) + staging * align(shape.block_bytes) + inputs \
        if profile.device == "cuda" else 0
    return host_buffer_bytes(ram) + staging * slot + inputs, pinned

def cpu_loss_bytes(shape: Shape) -> int:
    """A CPU's loss chunk at its peak (phantom.model.heads.default_loss_chunk: ~64 MB of fp32 logits): the logits
    and their gradient."""
    return 2 * CPU_LOSS_LOGITS

def missing_text(missing: tuple[tuple[str, int], ...]) -> str:
    """E.g. '35.2 GiB more disk space and 1.0 GiB more device memory' (shortfall's answer)."""
    return " and ".join(f"{gib(b)} more {where} {'space' if where == 'disk' else 'memory'}" for where, b in missing)


def shortfall(shape: Shape, profile: MachineProfile, device: int, host: int, margin: float,
              disk: int | None = None) -> tuple[tuple[str, int], ...]:
    """(where, bytes missing) for disk (the store, or `disk` bytes), device and host memory (less `margin`)
    that are short."""
    def over(need: int, free: int | None, keep: float) -> int:
        return 0 if free is None else max(0, need - int(free * (1 - keep)))
    unified = profile.device == "mps"  # Apple silicon: what the device holds comes out of the host's memory
    short = (("disk", over(shape.store_bytes if disk is None else disk, profile.free_disk_bytes, 0.0)),
             ("device", over(device, profile.free_device_bytes, margin)),
             ("host", over(host + (device if unified else 0), profile.free_host_bytes, margin)))
    return tuple((where, b) for where, b in short if b)
