"""Choosing a placement with the cost model: every candidate the profile allows (`search`), the fastest
that fits (`choose`), and the plan in words for a person (`describe_plan`, `describe_measured`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phantom.plan.costinputs import MachineProfile, Shape
from phantom.plan.costmodel import (
    MARGIN,
    Prediction,
    align,
    device_memory,
    gib,
    held_slots,
    host_input_bytes,
    host_memory,
    kept_blocks,
    kept_row_bytes,
    layout,
    predict,
    tiled,
)
from phantom.stream.placement import Activations, Placement

PREFETCH = (0, 1, 2, 3, 4, 6, 8)
MIN_CHUNK = 256  # the fewest tokens a chunk of tiled block compute is chosen to have

def pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]

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

def keep_budget_left(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
                     acts: Activations, margin: float) -> int:
    """Bytes of kept activations that fit beside everything else (on the device, or the host on a CPU), at
    acts' micro-batch and chunk."""
    free, used = memory_used(shape, profile, tiers, slots, rows, acts)
    if free is None:
        return 1 << 62
    per_block = rows * kept_row_bytes(shape, profile, acts.mlp_chunk)
    extra = per_block - rows * shape.act_bytes_per_row  # a kept block holds its graph, not just its input
    n_keep = min(shape.n_blocks, max(0, int((free * (1 - margin) - used) // extra))) if extra > 0 else shape.n_blocks
    return int(n_keep * per_block)

def memory_used(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
                acts: Activations) -> tuple[int | None, int]:
    """(free bytes, bytes used with no block kept) where activations live: the device, or the host on a CPU."""
    if profile.host_is_device:
        return profile.free_host_bytes, host_memory(shape, profile, tiers, slots, Placement(), 0, rows, acts)[0]
    return profile.free_device_bytes, device_memory(shape, profile, tiers, slots, 0, rows, acts)

def mlp_chunk(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
              micro_batch: int, margin: float) -> int:
    """Tokens per chunk of a block's tiled compute (Activations.mlp_chunk): the default where it fits beside the
    blocks the layout must hold (its RAM tier and resident blocks streamed instead: they yield to the chunk, the
    search shrinking the RAM tier of a candidate left short), else the largest power of two down to MIN_CHUNK
    that does (MIN_CHUNK where none does)."""
    chunk, cpu = Activations.mlp_chunk, profile.host_is_device
    lean = tuple("ram" if t == "device" else "disk" if t == "ram" and cpu else t for t in tiers)
    while chunk > MIN_CHUNK and tiled(shape, chunk // 2):
        free, used = memory_used(shape, profile, lean, slots, rows, Activations(micro_batch=micro_batch,
                                                                                mlp_chunk=chunk))
        if free is None or used <= free * (1 - margin):
            break
        chunk //= 2
    return chunk

def activation_choices(shape: Shape, profile: MachineProfile, tiers: tuple[str, ...], slots: int, rows: int,
                       micro_batch: int, recompute: tuple[str, ...], margin: float) -> set[Activations]:
    """The policies to try: "all", "none", and "auto" with the keep budget that fills the memory left.

    An "auto" that keeps every block is "none", one that keeps none is "all": the plan says so."""
    out = set()
    chunk = mlp_chunk(shape, profile, tiers, slots, rows, micro_batch, margin)
    for rc in recompute:
        budget = None
        if rc == "auto":
            budget = keep_budget_left(shape, profile, tiers, slots, rows,
                                      Activations(micro_batch=micro_batch, mlp_chunk=chunk), margin)
            keep = kept_blocks(shape, profile, Activations(recompute="auto", keep_budget=budget, mlp_chunk=chunk), rows)
            rc, budget = ("none", None) if keep == shape.n_blocks else ("all", None) if keep == 0 else (rc, budget)
        out.add(Activations(recompute=rc, keep_budget=budget, micro_batch=micro_batch, mlp_chunk=chunk))
    return out

def search(profile: MachineProfile, shape: Shape, rows: int, space: SearchSpace = SearchSpace(),
           margin: float = MARGIN) -> list[Prediction]:
    """Every candidate, fitting ones first, each group by predicted time.

    Candidates: each offload mode; blocks resident on the device 0..n (a CPU has no device tier); for a
    mixture of experts, each streamed block's attention, norms, router and shared experts kept on the device
    where the memory left allows (`moe_base` "auto") or before resident blocks ("device");
    the RAM tier filled to the default RAM budget of the free host memory (more RAM, fewer disk
    reads), and where every policy with it that the device holds leaves the host short, smaller by what is
    missing (a long row's block inputs on CUDA take host memory the RAM tier yields); prefetch depths up to the
    streamed blocks; micro-batches that divide the rows (powers
    of two and the rows); the activation policies of `activation_choices`. Compile is not a candidate:
    the tuner does not measure its speed-up, and the model's default stands (on for CUDA).
    `space.budgets` cap the device tier with its slots and the RAM tier, as the scheduler would.
    """
    micros = space.micro_batches or tuple(sorted({b for b in pow2_upto(rows) if rows % b == 0} | {rows}))
    n, out, seen = shape.n_blocks, [], set()
    budgets, prefetch, recompute = space.budgets or Placement(), space.prefetch, space.recompute
    bases = ("auto", "device") if shape.moe_blocks and shape.sizes.base else ("auto",)
    for offload, moe_base in ((o, b) for o in space.offloads for b in bases):
        for R in ([0] if profile.host_is_device or offload == "none" else range(n + 1)):
            for K in prefetch:
                reserve = len(shape.moe_blocks) * shape.sizes.base if moe_base == "device" else 0
                if budgets.device_budget is not None and offload != "none" and (R + K + 1) * shape.tier_bytes + \
                        reserve > max(budgets.device_budget, (K + 1) * shape.tier_bytes):
                    continue  # more resident blocks than the device budget holds beside the slots
                base = Placement(offload=offload, prefetch=K, resident=R, moe_base=moe_base,
                                 device_budget=budgets.device_budget)
                n_ram = layout(shape, profile, dataclasses.replace(base, ram_budget=budgets.ram_budget)).split["ram"]
                while n_ram is not None:  # the RAM tier the budget allows; less if none of it fits the host
                    place = dataclasses.replace(base, ram_budget=n_ram * shape.tier_bytes)
                    lay = layout(shape, profile, place)
                    if K > max(0, len(lay.streamed) - 1) and K != min(prefetch):
                        break  # deeper than the streamed blocks: the same as a shallower one
                    short = []
                    for b in micros:
                        for acts in activation_choices(shape, profile, lay.tiers, held_slots(lay, profile), rows, b,
                                                       ("none",) if offload == "none" else recompute, margin):
                            if (lay.tiers, lay.bases, K, acts) not in seen:
                                seen.add((lay.tiers, lay.bases, K, acts))
                                out.append(predict(profile, shape, place, acts, rows, lay.tiers, margin))
                                missing = dict(out[-1].missing)
                                if set(missing) <= {"host"}:  # a smaller RAM tier fits it (not a device short)
                                    short.append(missing.get("host", 0))
                    least = min(short, default=0)
                    n_ram = max(0, n_ram - -(-least // align(shape.block_bytes))) if least and n_ram > 0 else None
    out.sort(key=lambda c: (not c.fits, c.step_s))
    return out

def choose(candidates: list[Prediction], tie: float = 0.01) -> Prediction:
    """The fastest fitting candidate of `search`.

    Within `tie` of the fastest, it prefers the default chunk of tiled compute, fewer block loads, more resident
    blocks, a deeper queue (it absorbs read-time variance), a larger micro-batch (fewer calls) and, last, less
    memory. Its bound becomes "memory" when it is compute-bound only because a faster candidate did not fit.

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
    best = min(near, key=lambda c: (c.activations.mlp_chunk < Activations.mlp_chunk, c.loads, -c.resident,
                                    -c.placement.prefetch, -c.activations.micro_batch, c.device_bytes + c.host_bytes))
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

def per_s(x: float) -> str:
    """A rate for a person: 1,015 or 0.0189 (a 70B on two CPU cores is not zero tokens/s)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

def describe_plan(prediction: Prediction, shape: Shape, profile: MachineProfile, name: str = "model") -> str:
    """The plan for the whole model as a few labelled lines: placement, memory, traffic, step and bound.

    What `scripts/tune.py` prints and `finetune.py` logs at its start, so the two say the same thing."""
    p, place = prediction, prediction.placement
    cpu = profile.host_is_device
    inputs = host_input_bytes(shape, profile, p.kept_blocks, p.rows, p.activations.mlp_chunk)  # CUDA, long rows
    device = "on a CPU: blocks compute in host memory" if cpu else \
        f"device {gib(p.device_bytes)} of {gib(profile.free_device_bytes)} free"
    lines = [
        f"model      {name}: {shape.n_blocks} blocks of {gib(shape.block_bytes)}, store {gib(shape.store_bytes)}; "
        f"{p.rows} rows x {p.seq_len} tokens per step",
        f"machine    {profile.machine} ({profile.device}); disk {profile.disk_gbps:.2f} GB/s, "
        + ("" if cpu else f"host-to-device {profile.h2d_gbps:.1f} GB/s, ")
        + f"block compute {profile.fwd_flops / 1e9:,.1f} GFLOP/s"
        + (f" (from the datasheet of {profile.datasheet}, not measured: run on the GPU to measure; the disk "
           f"measured here)" if profile.datasheet else f" (measured on {profile.measured_on})"
           if profile.measured_on else " (rates given by hand)"),
        f"placement  {p.describe()}; offload {place.offload}",
        f"memory     {device}; host {gib(p.host_bytes)} of {gib(profile.free_host_bytes)} free"
        + (f" ({gib(p.pinned_bytes)} pinned)" if p.pinned_bytes else "")
        + (f", the recomputed blocks' inputs {gib(inputs)} of it" if inputs else "")
        + f"; disk {gib(shape.store_bytes)} for the store",
        f"traffic    per step {p.loads} block loads: {p.bytes_read / 1e9:.1f} GB read from disk, "
        f"{p.bytes_h2d / 1e9:.1f} GB host-to-device"
        + (f"; block inputs {p.bytes_inputs / 1e9:.1f} GB each way (a side stream, beside the compute: not in the "
           f"step's time)" if p.bytes_inputs else ""),
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
