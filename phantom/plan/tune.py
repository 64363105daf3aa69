"""Choosing a placement with the cost model: the plan for a whole model, `--prefetch auto`, a plan
checked on a scaled store.

`plan` searches the cost model's candidates for a machine profile (phantom.plan.profiles measures
and keeps those) and any model of that block shape; `auto_placement` is what `finetune.py --prefetch
auto` calls; `check_plan` runs a plan's fractions on a few synthetic blocks and sets the measured step
beside the prediction. The cost model itself is phantom.plan.costmodel (pure functions).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path

import torch

from phantom.arch.quantformat import as_format
from phantom.base import dtypes, fileio
from phantom.files.store import BlockStore
from phantom.files.tensorfile import parse_dtype
from phantom.model.phantom_model import PhantomModel
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costexperts, costinputs as ci
from phantom.plan import costmodel as cm
from phantom.plan import computetimer, planner, profiles
from phantom.stream import placement as P

log = logging.getLogger(__name__)


def plan(profile: ci.MachineProfile, cfg, work: ci.Workload, space: planner.SearchSpace = planner.SearchSpace()
         ) -> tuple[cm.Prediction, list[cm.Prediction], ci.Shape]:
    """The chosen prediction for a whole model, every candidate, and the shape they were made for.

    Raises:
        ValueError: nothing fits; the message says how many bytes are missing and where.
    """
    shape = pred_shape(cfg, work.store_dtype, work.dtype, work.seq_len, work.quant)
    cands = planner.search(profile, shape, work.rows, space)
    best = costexperts.with_moe_base(profile, shape, cfg, work.store_dtype, planner.choose(cands),
                                     quantized=work.quant is not None)
    return best, cands, shape


def auto_placement(store_path: Path | str, device: torch.device | str, batch_size: int, seq_len: int,
                   dtype: torch.dtype | str, profile_dir: Path | str | None = None,
                   space: planner.SearchSpace = planner.SearchSpace()) -> cm.Prediction:
    """The prediction for `--prefetch auto`: from the saved profile, or a quick one measured (and saved) now.

    Free memory is read again at each call (it changes between runs); the rates are reused. Rows per
    step stay the caller's: the tuner chooses tiers, prefetch, resident blocks and, unless given,
    micro-batch and recompute policy. Its `placement` (offload, prefetch, resident) is what to run.

    Args:
        store_path: the model's store folder.
        device: a resolved device ("cpu", "cuda", ...; not "auto").
        batch_size: rows per optimizer step (finetune's batch_size * grad_accum).
        seq_len: tokens per row.
        dtype: compute dtype.
        profile_dir: where profiles live (default $PHANTOM_CACHE/profiles or ~/.cache/phantom/profiles).
        space: what it may choose from (offload modes: ("ram", "disk") means the mixed "auto"; a
            micro-batch kept as given, since it changes the order of sums; recompute policies).

    Raises:
        ValueError: nothing fits in free memory.
    """
    if set(space.offloads) == {"ram", "disk"}:
        space = dataclasses.replace(space, offloads=("auto",))
    store = BlockStore(store_path, verify="none")
    profile = profiles.profile_for(store, device, dtype, batch_size, seq_len, profile_dir)
    work = ci.Workload(batch_size, seq_len, dtypes.lookup(dtype).torch_name, store.manifest["dtype"], store.quant)
    best, _, shape = plan(profile, store.cfg, work, space)
    log.info("the tuner's plan:\n%s", planner.describe_plan(best, shape, profile, store.path.name))
    return best


def tuned_placement(store_path: Path | str, device: torch.device | str, dtype: torch.dtype | str,
                    placement: P.Placement, rows: int, seq_len: int) -> tuple[cm.Prediction, P.Placement]:
    """`prefetch="auto"`: the tuner's tiers, prefetch depth, resident blocks and (a mixture of experts, where the
    caller left it "auto") whether the blocks' non-expert weights stay on the device put into `placement` (what
    cannot change the numbers: micro-batch and recompute stay the caller's). An offload of "auto" lets
    the tuner mix RAM and disk; another offload is kept. One process measures at a time (a lock beside
    the profiles), so ranks or runs started together measure once."""
    offloads = ("ram", "disk") if placement.offload == "auto" else (placement.offload,)
    store = BlockStore(store_path, verify="none")
    with fileio.locked(profiles.profile_path(store, device, dtype, seq_len).parent / ".measure.lock"):
        best = auto_placement(store_path, device, rows, seq_len, dtype, space=planner.SearchSpace(offloads=offloads))
    return best, dataclasses.replace(placement, offload=best.offload, prefetch=best.prefetch, resident=best.resident,
                                     moe_base=best.placement.moe_base if placement.moe_base == "auto" else
                                     placement.moe_base)


def resolve_prefetch(prefetch: int | str | None, store_path: Path | str, device: torch.device | str,
                     dtype: torch.dtype | str, placement: P.Placement, rows: int,
                     seq_len: int) -> tuple[cm.Prediction | None, P.Placement]:
    """The one meaning of `prefetch` that phantom.load and phantom.run share: a depth, None (keep
    `placement`'s) or "auto" (tuned_placement for `rows` of `seq_len` tokens per step; nothing to tune
    when every block is on the device). Returns (the tuner's prediction, None where it chose nothing;
    the placement)."""
    if prefetch is None:
        return None, placement
    if prefetch != "auto":
        return None, dataclasses.replace(placement, prefetch=int(prefetch))
    if placement.offload == "none":
        return None, placement
    return tuned_placement(store_path, device, dtype, placement, rows, seq_len)


def tuned_chunk(best: cm.Prediction | None, activations: P.Activations, fixed: bool) -> P.Activations:
    """activations with `prefetch="auto"`'s chunk of tiled compute (`best`: the tuner's plan, None where it chose
    nothing): it chose the chunk beside the blocks it placed (the default where it fits, else smaller), so a run
    takes it unless `fixed` (a flag, a run file or the checkpoint it resumes set one)."""
    if best is None or fixed:
        return activations
    return dataclasses.replace(activations, mlp_chunk=best.activations.mlp_chunk)


def format_table(candidates: list[cm.Prediction], top: int = 12, chosen: cm.Prediction | None = None) -> str:
    """The fastest `top` fitting candidates, and the chosen one if it is not among them, as a table."""
    fitting = [c for c in candidates if c.fits]
    rows = fitting[:top]
    if chosen is not None and chosen not in rows:
        rows.append(chosen)
    lines = [f"{'dev':>4s} {'ram':>4s} {'disk':>4s} {'K':>2s} {'micro':>5s} {'recompute':14s} {'step s':>8s} "
             f"{'tok/s':>8s} {'bound':7s} {'dev GiB':>7s} {'host GiB':>8s} {'loads':>5s}"]
    for c in rows:
        s, a = c.split, c.activations
        rc = a.recompute if a.recompute != "auto" else f"keep {c.kept_blocks}"
        lines.append(f"{s['device']:4d} {s['ram']:4d} {s['disk']:4d} {c.prefetch:2d} {a.micro_batch or c.rows:5d} "
                     f"{rc:14s} {c.step_s:8.3f} {c.tokens_per_s:8.0f} {c.bound:7s} {c.device_bytes / 2**30:7.1f} "
                     f"{c.host_bytes / 2**30:8.1f} {c.loads:5d}" + (" <- chosen" if c == chosen else ""))
    lines.append(f"({len(fitting)} of {len(candidates)} candidates fit)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Checking a plan on a scaled store: N blocks of the model's shape, the plan's fractions in each tier

def scaled_placement(full: cm.Prediction, shape: ci.Shape, n_blocks: int) -> tuple[P.Placement, P.Activations]:
    """The full model's plan cut to `n_blocks`: the same fractions of blocks on the device, in RAM and
    on disk (rounded; each tier the plan uses keeps a block), the same prefetch and micro-batch, the
    keep budget scaled with the depth."""
    split, n = full.split, len(full.tiers)

    def share(tier: str) -> int:  # rounded, but a tier the plan uses keeps at least one block
        return max(1 if split[tier] else 0, round(n_blocks * split[tier] / n))
    n_dev = min(n_blocks, share("device"))
    n_disk = min(n_blocks - n_dev, share("disk"))
    if split["ram"] and n_dev + n_disk == n_blocks and n_disk > 1:
        n_disk -= 1  # the RAM tier keeps its block too
    n_ram = n_blocks - n_dev - n_disk
    place = dataclasses.replace(full.placement, offload="auto", resident=n_dev, device_budget=None,
                                ram_budget=n_ram * shape.tier_bytes + shape.tier_bytes // 2)
    acts = full.activations
    if acts.keep_budget is not None:
        acts = dataclasses.replace(acts, keep_budget=acts.keep_budget * n_blocks // n)
    return place, acts


def timed_steps(store_path: Path | str, device, dtype, placement: P.Placement, activations: P.Activations,
                rows: int, seq_len: int, steps: int) -> tuple[list[float], list[dict], tuple[str, ...]]:
    """Seconds and scheduler metrics of `steps` LoRA forward + backward steps after one warm-up step
    (which also fills the slots), and the tiers the scheduler chose."""
    gen = torch.Generator().manual_seed(0)
    times, metrics = [], []
    store = BlockStore(store_path, verify="none")
    with PhantomModel(store, torch.device(device), parse_dtype(dtype), placement, activations) as model:
        for s in range(steps + 1):
            tokens = torch.randint(0, model.cfg.vocab_size, (rows, seq_len), generator=gen).to(device)
            t0 = time.perf_counter()
            model(tokens, targets=tokens).backward()
            computetimer.sync(torch.device(device))
            if s:
                times.append(time.perf_counter() - t0)
                metrics.append(model.scheduler.take_metrics())
            else:
                model.scheduler.take_metrics()
        return times, metrics, model.scheduler.tiers


def check_plan(full: cm.Prediction, profile: ci.MachineProfile, cfg, work: ci.Workload, device,
               n_blocks: int, steps: int, path: Path) -> dict:
    """The full model's plan run on `n_blocks` blocks of its shape (a synthetic store at `path`, written
    if absent), budgets at the plan's fractions: the measured step (median) against the prediction
    (work: the plan's seq_len, dtypes and quantization; its rows are the plan's).

    Raises:
        ValueError: fewer than 2 blocks or 1 step, or no disk space for the store.
    """
    if n_blocks < 2 or steps < 1:
        raise ValueError("--check needs at least 2 blocks and --steps >= 1")
    store_dtype, dtype, seq_len, quant = work.store_dtype, work.dtype, work.seq_len, work.quant
    small = cfg.first_layers(n_blocks)
    if not (path / "manifest.json").is_file():
        need, free = ci.shape_of(small, store_dtype, quant=quant).store_bytes, profiles.free_disk_bytes(path)
        if need > free:
            raise ValueError(f"--check {n_blocks} needs {cm.gib(need)} under {path}, {cm.gib(free)} free: "
                             f"use fewer blocks")
        log.info("writing %d synthetic blocks to %s (%s)", n_blocks, path, cm.gib(need))
        write_synthetic(path, small, parse_dtype(store_dtype), progress=False,
                        quant=as_format(quant))
    place, acts = scaled_placement(full, ci.shape_of(cfg, store_dtype, dtype, seq_len, quant), n_blocks)
    pred = cm.predict(profile, pred_shape(small, store_dtype, dtype, seq_len, quant), place, acts, full.rows)
    store = BlockStore(path, verify="none")
    if (held := profiles.store_quant(store)) != quant:
        raise ValueError(f"{path} holds a {held or 'bf16'} store, the plan is for {quant or 'bf16'}: "
                         f"give another --check-dir")
    disk_before = profiles.measure_disk(store) if "disk" in pred.tiers else None
    times, metrics, tiers = timed_steps(path, device, dtype, place, acts, full.rows, seq_len, steps)
    measured = statistics.median(times)
    err = measured / pred.step_s - 1
    out = dict(blocks=n_blocks, split=pred.split, tiers=list(tiers), tiers_match=tiers == pred.tiers,
               placement=dataclasses.asdict(place), predicted_step_s=pred.step_s, measured_step_s=measured,
               steps_s=times, error=err, within_15=abs(err) <= 0.15, bytes_read_predicted=pred.bytes_read,
               bytes_read_measured=[m["bytes_read"] for m in metrics])
    if disk_before is not None:  # a shared disk's rate drifts within minutes: the model given the rate of now
        disk_after = profiles.measure_disk(store)
        now = dataclasses.replace(profile, disk_gbps=(disk_before[0] + disk_after[0]) / 2,
                                  disk_jitter=(disk_before[1] + disk_after[1]) / 2)
        step_now = cm.predict(now, pred_shape(small, store_dtype, dtype, seq_len, quant), place, acts,
                              full.rows).step_s
        out.update(disk_gbps_profile=profile.disk_gbps, disk_gbps_around=[disk_before[0], disk_after[0]],
                   predicted_with_disk_now_s=step_now, error_with_disk_now=measured / step_now - 1)
    return out


def pred_shape(cfg, store_dtype: str, dtype: str, seq_len: int, quant: str | None = None) -> ci.Shape:
    return ci.shape_of(cfg, store_dtype, dtype, seq_len, quant)
