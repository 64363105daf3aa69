"""The loop of a sweep: several LoRA adapters trained together, one read of the weights per step.

Each adapter is a run of its own in everything but the weights it reads: its folder, optimizer, schedule,
data order, dropout stream, evaluation, checkpoint and metrics.jsonl are what phantom.train.loop gives
a run of it alone (start_run and after_step are the loop's, given phantom.model.adaptermodel's view of
the adapter), so each ends where its own run would. A step draws each adapter's batch, runs every
adapter's rows through one forward and backward (phantom.stream.lanes: each loaded block serves every
adapter's micro-batches), then steps each adapter's optimizer on its own gradient. A non-finite loss or
gradient stops that adapter alone; the others go on.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from statistics import median

import torch
from tqdm import tqdm

from phantom.base import faults, fileio
from phantom.model.adaptermodel import AdapterModel, add_adapter
from phantom.model.lora import LoraConfig
from phantom.stream.lanes import Lane, RngStream
from phantom.train.loop import Run, StopFlag, after_step, finish, start_run
from phantom.train.preference import lane_pair_logps
from phantom.train.records import to_json, tier_metrics
from phantom.train.step import packing
from phantom.train.trainconfig import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One adapter of a sweep: its name, LoRA, training settings (its own out folder) and data."""

    name: str
    lora: LoraConfig
    cfg: TrainConfig
    train_data: object
    val_data: object = None
    tokenizer: object = None
    sinks: tuple = ()  # callables given each of its metrics.jsonl records (its trackers)
    keep: dict | None = None  # more for its checkpoints to hold (its trackers' run ids)


@dataclass
class Member:
    """An adapter's place in the loop: its view, its run, where it stands and how it ended."""

    view: AdapterModel
    run: Run
    step: int
    status: str | None = None  # None: still training
    loss: float = float("nan")
    tokens: int = 0
    log: fileio.RecordLog | None = field(default=None, repr=False)


class _NoBar:
    """after_step's progress bar for one adapter: the sweep shows one bar for all of them."""

    def set_postfix(self, **kw):
        pass

    def update(self, n):
        pass


def train_adapters(model, jobs: list[Job]) -> list[dict]:
    """Train each job's adapter on `model` (a PhantomModel loaded without a LoRA, micro_batch = the jobs'
    batch_size rows, two per pair for dpo); the jobs share iters, batch_size, grad_accum, seq_len and mode.

    Returns:
        Each adapter's summary, as phantom.train.loop.train returns a run's.
    """
    members = [join(model, job) for job in jobs]
    take = model.scheduler.take_metrics if model.scheduler is not None else dict
    take()
    t_start = time.perf_counter()
    progress = jobs[0].cfg.progress
    bar = tqdm(total=jobs[0].cfg.iters, initial=min(m.step for m in members), desc=f"sweep of {len(jobs)}",
               unit="step", disable=not progress or None, dynamic_ncols=True)
    with StopFlag().installed() as stop, contextlib.ExitStack() as files:
        for m in members:
            m.log = files.enter_context(fileio.RecordLog(m.run.metrics_path))
            m.status = "done" if m.step >= m.run.cfg.iters else None
        while active := [m for m in members if m.status is None]:
            for m, (rec, finite) in zip(active, sweep_step(model, active, take)):
                m.step, m.loss, m.tokens = rec["step"], rec["loss"], m.tokens + rec["tokens"]
                if not finite:
                    m.status = "nan"
                    m.log.append(to_json(rec))
                    m.run.emit(rec)
                    log.error("adapter %s: the loss or gradient became not finite at step %d; it stops, the others "
                              "go on", m.view.adapter.name, m.step)
                    continue
                with m.view.adapter.rng.active():  # its checkpoint keeps its own dropout stream
                    after_step(m.run, rec, m.log, _NoBar(), last=m.step == m.run.cfg.iters or stop.set)
                m.status = "done" if m.step == m.run.cfg.iters else None
            take()  # the evaluations' and checkpoints' traffic is not the next step's
            bar.set_postfix(loss="/".join(f"{m.loss:.3f}" for m in members), refresh=False)
            bar.update(1)
            if stop.set:
                for m in active:
                    m.status = m.status or "interrupted"
    bar.close()
    elapsed = time.perf_counter() - t_start
    return [summary(m, elapsed) for m in members]


def join(model, job: Job) -> Member:
    """job's adapter on `model`, and its run started as phantom.train.loop starts one: its seed (or its
    checkpoint) sets the generators, whose state then becomes the adapter's own dropout stream."""
    adapter = add_adapter(model, job.name, job.lora)
    view = AdapterModel(model, adapter)
    run = start_run(view, job.train_data, job.val_data, job.cfg, job.tokenizer, job.sinks, job.keep)
    adapter.rng = RngStream.capture(model.device)
    return Member(view, run, run.start)


def sweep_step(model, members: list[Member], take) -> list[tuple[dict, bool]]:
    """One optimizer step of every member: each draws its batch, all rows go through one forward and
    backward, each adapter's optimizer steps on its own gradient (skipped where it is not finite).
    Each member's metrics record (the step's traffic is the shared one's) and whether it was finite."""
    t0 = time.perf_counter()
    batches = [next(m.run.batches) for m in members]
    t_data = time.perf_counter()
    lrs = [m.run.opt.param_groups[0]["lr"] for m in members]
    losses = lane_losses(model, members, batches)
    torch.stack(losses).sum().backward()  # each adapter's gradient is its own loss's: the others' do not reach it
    updates = [update(m.run, loss) for m, loss in zip(members, losses)]
    dt = time.perf_counter() - t0
    traffic = {**tier_metrics(model, take(), dt), "adapters": len(members)}
    out = []
    for m, b, lr, loss, (norm, finite) in zip(members, batches, lrs, losses, updates):
        n = b[0].numel()
        figures = m.run.objective.figures if m.run.objective else {}
        out.append(({"step": m.step + 1, "loss": loss.item(), "lr": lr, "grad_norm": norm, "tokens": n,
                     "tokens_per_s": n / dt, "step_s": dt, "data_s": t_data - t0, **figures, **traffic}, finite))
    return out


def lane_losses(model, members: list[Member], batches: list) -> list[torch.Tensor]:
    """Each member's loss over its batch: its rows a lane of one pass (cross-entropy, or its preference loss)."""
    if members[0].run.objective is not None:  # dpo: (P, 2, T) pairs, two rows each
        lanes = [Lane(m.view.adapter, 2 * len(b[0])) for m, b in zip(members, batches)]
        return [m.run.objective.loss(*logps) for m, logps in zip(members, lane_pair_logps(model, batches, lanes))]
    lanes = [Lane(m.view.adapter, len(b[0])) for m, b in zip(members, batches)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    segments = None
    if any(len(b) > 2 for b in batches):  # packed rows beside windows: a window is one example
        segments = torch.cat([b[2] if len(b) > 2 else torch.zeros_like(b[0]) for b in batches])
    return model(x, targets=y, lanes=lanes, **packing(segments))


def update(run: Run, loss: torch.Tensor) -> tuple[float, bool]:
    """run's optimizer step on its gradient, as phantom.train.step.train_step takes it: clipped, skipped
    (and the loop stops this adapter) when the loss or the norm is not finite. (grad norm, finite)."""
    params = [p for g in run.opt.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.grad_clip if run.cfg.grad_clip > 0 else float("inf"))
    finite = bool(torch.isfinite(loss.detach()) and torch.isfinite(norm))
    if finite:
        run.opt.step()
        faults.point("optimizer.step")  # crash tests: weights updated in memory only
        run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return norm.item(), finite


def summary(m: Member, elapsed: float) -> dict:
    """m's summary as phantom.train.loop.train gives a run's, its files written (none of a stopped one's)."""
    run, status = m.run, m.status or "interrupted"
    s = {"name": m.view.adapter.name, "status": status, "steps": m.step, "tokens": m.tokens, "time_s": elapsed,
         "final_loss": m.loss, "best_val_loss": run.best_val if math.isfinite(run.best_val) else None,
         "median_step_s": median(run.step_times[1:] or run.step_times) if run.step_times else None}
    return {**s, **finish(run.out, m.view, run.cfg, status, m.step, m.loss)}
