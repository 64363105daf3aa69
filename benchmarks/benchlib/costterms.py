"""--modes costterms: the cost model's disk rows (recompute --recompute, prefetch each of --prefetch) against their
steps, and each term of the prediction timed on its own: the profile's block calls at 1 row and at the step's rows,
the disk's cold read rate, the blocks a run keeps, a RAM-tier row (no reads: the compute alone).

On a shared machine every figure moves with the other jobs' load between one minute and the next, so all of them
are timed in one process, interleaved (a round times the profile's calls, the disk and one step of every row), and
the fastest of --rounds rounds is kept for each; the profile (profiles.measure, once: the slowdowns beside reads, the
read jitter, the kept bytes, free memory) takes its compute and disk rates from those fastest figures. Every row's
model is held at once: a small store (a few blocks).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

import phantom
from benchlib.common import machine
from phantom.files.store import BlockStore
from phantom.model.phantom_model import PhantomModel
from phantom.plan import computetimer as ct
from phantom.plan import costinputs as ci
from phantom.plan import costmodel as cm
from phantom.plan import profiles
from phantom.stream.placement import Activations, Placement


def row_specs(args) -> list[tuple[str, str, int]]:
    """(tier, recompute, prefetch) of each row: disk at every policy and depth asked, and RAM (read nothing) at the
    first of each."""
    policies, depths = args.recompute.split(","), [int(k) for k in args.prefetch.split(",")]
    return [("disk", rc, k) for rc in policies for k in depths] + [("ram", policies[0], depths[0])]


def one_step(model: PhantomModel, opt, tokens: torch.Tensor) -> dict:
    """One LoRA step: seconds, the blocks the executor kept, the scheduler's read rate and stall."""
    model.scheduler.take_metrics()
    t0 = time.perf_counter()
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ct.sync(model.device)
    step_s = time.perf_counter() - t0
    m = model.scheduler.take_metrics()
    return dict(step_s=step_s, kept=model.executor.kept_blocks, read_gbps=m["read_gbps"], stall_s=m["stall_s"])


def timed_rounds(store: BlockStore, args, specs: list) -> tuple[dict, list, dict, list]:
    """(block-call points by rows, disk GB/s, steps by row, 1-minute load) of every round."""
    device, dtype, rows, seq = phantom.resolve_device(args.device), store.dtype, args.batch_size, args.seq_len
    timing = PhantomModel(store, device, dtype, Placement(offload="disk", prefetch=0),
                          Activations(recompute="all", compile=False))
    timer = ct.BlockTimer(timing, seq, 3, ct.Beside())
    models = {}
    for tier, rc, k in specs:
        m = PhantomModel(BlockStore(store.path), device, dtype, Placement(offload=tier, prefetch=k, resident=0),
                         Activations(recompute=rc, compile=False), lora=phantom.LoraConfig(rank=args.lora_rank))
        models[tier, rc, k] = (m, torch.optim.AdamW(m.trainable_parameters(), lr=1e-4))
    tokens = torch.randint(0, store.cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    points, disks, steps, loads = {1: [], rows: []}, [], {s: [] for s in specs}, []
    try:
        for m, opt in models.values():
            one_step(m, opt, tokens.to(device))  # fills the slots, and tells the executor a kept block's bytes
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for b in sorted(points):
                points[b].append(timer.point(b, with_head=b == 1))
            disks.append(profiles.measure_disk(store, passes=1)[0])
            for spec, (m, opt) in models.items():
                steps[spec].append(one_step(m, opt, tokens.to(device)))
            print(f"round {r + 1}/{args.rounds}, load {loads[-1]:.1f}: " + ", ".join(
                f"{t} {rc} K{k} {v[-1]['step_s']:.3f} s" for (t, rc, k), v in steps.items()), file=sys.stderr)
    finally:
        timer.close()
        timing.close()
        for m, _ in models.values():
            m.close()
    return points, disks, steps, loads


def fastest_profile(base: ci.MachineProfile, points: dict, disks: list, shape: ci.Shape) -> tuple:
    """The profile with the fastest of each block call (at 1 row and the step's rows) and of the disk's read
    rate; those fastest calls."""
    rows = max(points)
    fastest = {b: {k: min(p[k] for p in ps) for k in ("fwd", "fwd_grad", "bwd")} for b, ps in points.items()}
    head_row = min(p["head"] for p in points[1])
    c = dict(ct.fit_call_and_row(fastest), head_row_s=head_row, keep_bytes_per_row=points[rows][0]["keep"],
             busy_compute_slowdown=base.busy_compute_slowdown, busy_read_slowdown=base.busy_read_slowdown)
    profile = dataclasses.replace(base, disk_gbps=max(disks), **profiles.compute_rates(c, shape))
    return profile, dict(fastest, head_row=head_row)


def row_lines(profile: ci.MachineProfile, shape: ci.Shape, steps: dict, rows: int) -> list[str]:
    """A table row for each (tier, recompute, prefetch): the fastest step beside the prediction."""
    lines = ["| tier | recompute | prefetch | step s (fastest) | predicted s | predicted / measured | blocks kept: "
             "run, model | read GB/s in the step | stall s | predicted compute s | each round's step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (tier, rc, k), runs in steps.items():
        best = min(runs, key=lambda r: r["step_s"])
        each = ", ".join(f"{r['step_s']:.2f}" for r in runs)
        p = cm.predict(profile, shape, Placement(offload=tier, prefetch=k, resident=0), Activations(recompute=rc), rows)
        lines.append(f"| {tier} | {rc} | {k} | {best['step_s']:.3f} | {p.step_s:.3f} | {p.step_s / best['step_s']:.2f} | "
                     f"{best['kept']}, {p.kept_blocks} | {best['read_gbps']:.2f} | {best['stall_s']:.3f} | "
                     f"{p.compute_s:.3f} | {each} |")
    return lines


def costterms_bench(args, store: BlockStore) -> str:
    """Mode costterms: the note's text (see the module's docstring)."""
    rows, seq = args.batch_size, args.seq_len
    load0 = os.getloadavg()
    base = profiles.measure(store, phantom.resolve_device(args.device), store.dtype, rows, seq)
    specs = row_specs(args)
    points, disks, steps, loads = timed_rounds(store, args, specs)
    shape = ci.shape_of(store.cfg, store.manifest["dtype"], store.manifest["dtype"], seq)
    profile, fastest = fastest_profile(base, points, disks, shape)
    call = lambda b, k: f"{fastest[b][k] * 1e3:.0f}"  # noqa: E731
    cfg = store.cfg
    return "\n".join([
        f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`", "",
        f"- machine: {machine()}; device {args.device}; load average {load0[0]:.1f} at the start, "
        f"{', '.join(f'{x:.1f}' for x in loads)} at each round, {os.getloadavg()[0]:.1f} at the end",
        f"- model: dim {cfg.dim}, {cfg.n_layers} blocks of {store.block_nbytes / 2**20:.1f} MiB ({store.dtype}), "
        f"batch {rows} x {seq}, LoRA rank {args.lora_rank}; fastest of {args.rounds} interleaved rounds",
        f"- profile's block calls at {rows} rows (ms, fastest): forward {call(rows, 'fwd')}, graph forward "
        f"{call(rows, 'fwd_grad')}, backward {call(rows, 'bwd')}; at 1 row: {call(1, 'fwd')}, {call(1, 'fwd_grad')}, "
        f"{call(1, 'bwd')}; head {fastest['head_row'] * rows * 1e3:.0f} ms for {rows} rows",
        f"- disk (cold, O_DIRECT, 2 readers): {profile.disk_gbps:.2f} GB/s fastest of the rounds, "
        f"{base.disk_gbps:.2f} in the profile measured once; beside reads: compute x{base.busy_compute_slowdown:.2f}, "
        f"reads x{base.busy_read_slowdown:.2f}; free host memory {cm.gib(base.free_host_bytes)} (recompute auto's "
        f"keep budget half of it)", "",
        *row_lines(profile, shape, steps, rows), ""])
