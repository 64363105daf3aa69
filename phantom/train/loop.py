"""The finetuning loop: the run's state from step to step, layer-major accumulation, evaluation and samples
on schedule, metrics.jsonl, atomic checkpoints with bit-exact resume, and a clean stop on Ctrl-C or NaN.

Every file it writes follows phantom.base.fileio's rule (whole replacement or whole appended records), so a
full disk or a crash leaves the last checkpoint intact and `--resume` working. Works on a PhantomModel. The
settings are phantom.train.trainconfig's, one step phantom.train.step's, a record phantom.train.records'.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import numpy as np
import torch
from tqdm import tqdm

from phantom.base import faults, fileio
from phantom.data import batches as B
from phantom.data import dataset as D
from phantom.model.backends import default_keep_budget
from phantom.export.export import write_tokenizer_files
from phantom.train import dist as pdist
from phantom.train import grpoloop as GR
from phantom.train.checkpoint import (
    check_free_space,
    find_checkpoint,
    planned_bytes,
    read_state,
    restore,
    run_identity,
    save_checkpoint,
)
from phantom.train.preference import (
    REFERENCE_FILE,
    PairRows,
    Preference,
    cached_reference,
    compute_reference,
    reference_key,
)
from phantom.train.records import (
    describe_eval,
    describe_tasks,
    preference_postfix,
    read_metrics,
    tier_metrics,
    tier_postfix,
    to_json,
)
from phantom.train.step import evaluate_with, sample, train_step
from phantom.train.trainconfig import TrainConfig, make_optimizer, make_scheduler

log = logging.getLogger(__name__)


class StopFlag:
    """Ctrl-C sets the flag (the step finishes, a checkpoint is saved); a second Ctrl-C aborts."""

    def __init__(self):
        self.set = False

    def _handle(self, signum, frame):
        if self.set:
            raise KeyboardInterrupt
        self.set = True
        log.warning("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)")

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@dataclass
class Run:
    """What the loop carries from step to step (built once by `start_run`)."""

    model: object
    cfg: TrainConfig
    out: Path
    tokenizer: object
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    identity: dict
    val_ds: object
    rows: int  # rows of a step on this rank
    start: int
    best_val: float
    batches: object
    metrics_path: Path
    objective: object = None  # preference training: phantom.train.preference.Preference (None: cross-entropy)
    n_tokens: float = 0.0  # target tokens (pairs) of this rank's rows in the step (data parallel weighting)
    step_times: list = dataclasses.field(default_factory=list)
    sinks: tuple = ()  # rank 0: callables given each record written to metrics.jsonl
    keep: dict = dataclasses.field(default_factory=dict)  # more for each checkpoint to hold (tracker run ids)
    tasks: object = None  # rank 0, --eval-tasks: phantom.train.evaltasks.DuringTraining

    def emit(self, rec: dict) -> None:
        for sink in self.sinks:
            sink(rec)


def train(model, train_data: D.TokenData, val_data: D.TokenData | None = None, cfg: TrainConfig = TrainConfig(),
          tokenizer=None, sinks: tuple = (), keep: dict | None = None) -> dict:
    """Finetune `model` on `train_data`; write adapter/, checkpoint/ and metrics.jsonl into cfg.out.

    Args:
        model: a PhantomModel with something to train (a LoRA), loaded with micro_batch=cfg.batch_size.
        train_data, val_data: from phantom.data.dataset.load (and split), or preference pairs from
            phantom.train.preference.load_pairs (and split_pairs) with cfg.mode "dpo"; val_data None: no evaluation.
        cfg: the run's settings.
        tokenizer: needed for samples (cfg.sample_every); its pad id pads packed rows.
        sinks: callables given each record as it is written to metrics.jsonl on rank 0 (experiment
            trackers); they must not raise (phantom.train.trackers.Reporter warns and drops a failing one).
        keep: more for each checkpoint to hold ({"trackers": run ids}: phantom.train.checkpoint.tracker_runs).

    Returns:
        A summary: status ("done", "interrupted" or "nan"), steps, tokens, time_s, final_loss,
        best_val_loss, adapter (LoRA) or weights (full mode: the trained store), checkpoint (or None),
        metrics, out.

    Raises:
        ValueError: data shorter than one sequence, or --resume from another run's checkpoint.
        FileNotFoundError: --resume with no checkpoint in cfg.out.
    """
    run, ddp = start_run(model, train_data, val_data, cfg, tokenizer, sinks, keep), pdist.current()
    sync = data_parallel_sync(model, run)
    sched_metrics = model.scheduler.take_metrics if model.scheduler is not None else dict
    sched_metrics()
    status, step, loss, t_start, tokens = "done", run.start, float("nan"), time.perf_counter(), 0
    bar = tqdm(total=cfg.iters, initial=run.start, desc="finetune", unit="step",
               disable=not (cfg.progress and ddp.is_main) or None, dynamic_ncols=True)
    with StopFlag().installed() as stop, fileio.RecordLog(run.metrics_path) as mfile:
        while step < cfg.iters:
            rec, finite = one_step(run, sync, sched_metrics, step + 1)
            step, loss, tokens = step + 1, rec["loss"], tokens + rec["tokens"]
            if not finite:  # on any rank: all of them stop here
                status = "nan"
                mfile.append(to_json(rec))
                run.emit(rec)
                break
            after_step(run, rec, mfile, bar, last=step == cfg.iters or stop.set)
            sched_metrics()  # the eval's, sample's and checkpoint's block traffic is not the next step's
            if stop.set:
                status = "interrupted"
                break
    bar.close()
    summary = {"status": status, "steps": step, "tokens": tokens, "time_s": time.perf_counter() - t_start,
               "final_loss": loss, "best_val_loss": run.best_val if math.isfinite(run.best_val) else None,
               "median_step_s": median(run.step_times[1:] or run.step_times) if run.step_times else None}  # past step 1
    if not ddp.is_main:
        return {**summary, "adapter": None, "weights": None, "checkpoint": None, "metrics": None, "out": str(run.out)}
    return {**summary, **finish(run.out, model, cfg, status, step, loss)}


def data_parallel_sync(model, run: "Run"):
    """Under torchrun: gradients averaged by target tokens, so N ranks give the global batch's gradient
    (full finetuning: each block's all-reduce started in its backward). None in one process."""
    if not pdist.current().enabled:
        return None
    if getattr(model, "full", False):
        model.grad_sync = pdist.block_grad_sync(lambda: run.n_tokens)
    return lambda: pdist.average_gradients(model.trainable_parameters(), run.n_tokens)


def one_step(run: "Run", sync, sched_metrics, step: int) -> tuple[dict, bool]:
    """Draw the next batch (this rank's rows of it), run one optimizer step; its metrics record and
    whether the loss and gradient were finite on every rank."""
    model, cfg, ddp = run.model, run.cfg, pdist.current()
    t0 = time.perf_counter()
    batch = next(run.batches)  # (x, y), packed rows (x, y, segment ids) or pairs (x, y, reference)
    if ddp.enabled:  # every rank draws the same global batch and keeps its own rows (or pairs)
        batch = [t[ddp.rank * run.rows:(ddp.rank + 1) * run.rows] for t in batch]
        run.n_tokens = float(len(batch[0]) if run.objective else (batch[1] != D.IGNORE_INDEX).sum())
    t_data = time.perf_counter()
    x, y = batch[:2]  # on the host: the model uploads them (a host-side embedding reads them there)
    loss_fn = functools.partial(run.objective, ref=batch[2]) if run.objective else None
    seg = batch[2:] if not run.objective else []
    lr = run.opt.param_groups[0]["lr"]
    loss, norm, finite = train_step(model, run.opt, run.sched, (x, y, *seg), cfg, sync, loss_fn=loss_fn)
    dt, n = time.perf_counter() - t0, x.numel() * ddp.world_size
    means = pdist.rank_mean({"loss": loss, **(run.objective.figures if run.objective else {})}, run.n_tokens,
                            model.device)  # torchrun: the global batch's, as one process logs them
    rec = {"step": step, "loss": means.pop("loss"), "lr": lr, "grad_norm": norm, "tokens": n, "tokens_per_s": n / dt,
           "step_s": dt, "data_s": t_data - t0, **means, **tier_metrics(model, sched_metrics(), dt)}
    if cfg.mode == "grpo":  # the step's time as generation, scoring and training; its rollouts' samples logged
        rollout = batch[2]
        rec["train_s"] = dt - (t_data - t0)
        if pdist.current().is_main:
            GR.log_samples(run.out, rollout)
        rollout.logged = True
        run.keep["rollout"] = rollout.state() if step % cfg.grpo.num_iterations else None
    return rec, finite


def start_run(model, train_data: D.TokenData, val_data: D.TokenData | None, cfg: TrainConfig, tokenizer,
              sinks: tuple = (), keep: dict | None = None) -> Run:
    """Check what can be checked before any work, then the optimizer, the resumed state, the metrics
    file (cut back to the checkpoint's step) and the batches from where the run stands."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ddp = pdist.current()  # torchrun: each rank trains on its slice of the global batch; rank 0 writes
    if ddp.is_main:
        check_free_space(out, planned_bytes(model, cfg))
    if cfg.seq_len > model.cfg.max_seq_len and cfg.mode != "grpo":  # grpo's rows: a prompt and its completion
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    pad = tokenizer.pad_or_eos if tokenizer is not None else 0
    tasks = task_eval(cfg, tokenizer) if ddp.is_main else None  # names and datasets checked before any step
    objective = Preference(cfg.preference) if cfg.mode == "dpo" else None
    if cfg.mode == "grpo":
        objective, val_data = grpo_objective(cfg, val_data, ddp)
        train_ds = val_ds = None
    elif objective is None:
        train_ds = B.rows(train_data, cfg.seq_len, pad, "training data", segments=True)
        val_ds = B.rows(val_data, cfg.seq_len, pad, "held-out data", segments=True) if val_data is not None else None
    rows = cfg.batch_size * cfg.grad_accum  # pairs in preference training
    micro = cfg.batch_size * (2 if cfg.mode == "dpo" else 1)
    if cfg.grad_accum > 1 and model.micro_batch != micro:
        log.warning("--grad-accum %d: load the model with micro_batch=%d so each block runs the %d rows of a "
                    "step in micro-batches (it has micro_batch=%s)", cfg.grad_accum, micro,
                    micro * cfg.grad_accum, model.micro_batch)
    seed_everything(cfg.seed)
    model.train()
    opt, identity = make_optimizer(model, cfg), run_identity(model, train_data, cfg)
    sched = make_scheduler(opt, cfg)
    rollouts = None  # --init-adapter: the frozen reference of dpo and grpo is the adapter as it starts
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad} \
        if cfg.init_adapter and cfg.mode in ("dpo", "grpo") else None
    if cfg.mode == "grpo":  # its reward functions and batch checked before anything is written
        rollouts = GR.Rollouts(model, tokenizer, train_data, cfg, reference_adapter=initial)
    start, best_val = restore(out, model, opt, sched, identity, cfg.resume)
    history = read_metrics(out / "metrics.jsonl", start) if cfg.resume else []
    first = {"step": 0}
    if cfg.mode == "dpo":  # after restore: a resumed run finds its reference in the cache
        train_ds, val_ds, first = preference_rows(model, train_data, val_data, cfg, pad, out, identity, initial)
    if val_ds is not None and start == 0:
        first.update(evaluate_with(objective, model, val_ds, rows, cfg.eval_iters))
        log.info("step 0: %s", describe_eval(first))
    if len(first) > 1 and start == 0:
        history.append(first)
    metrics_path = out / "metrics.jsonl" if ddp.is_main else Path(os.devnull)
    if ddp.is_main:
        fileio.atomic_write_text(metrics_path, "".join(to_json(r) for r in history))
    if cfg.mode == "grpo":
        batches = grpo_batches(rollouts, start, out)
    else:
        batches = iter(B.loader(train_ds, rows * ddp.world_size, cfg.seed, cfg.shuffle, start, cfg.workers,
                                pin_memory=model.device.type == "cuda"))
    run = Run(model, cfg, out, tokenizer, opt, sched, identity, val_ds, rows, start, best_val, batches, metrics_path,
              objective=objective, sinks=tuple(sinks) if ddp.is_main else (), keep=dict(keep or {}), tasks=tasks)
    if history and start == 0:
        run.emit(history[-1])  # the eval before training (a resumed run's earlier records were sent already)
    return run


def grpo_objective(cfg: TrainConfig, val_data, ddp) -> tuple:
    """GRPO's objective (no held-out loss: val_data becomes None); refused under torchrun."""
    if ddp.enabled:
        raise ValueError("--mode grpo runs in one process (torchrun is not supported for it yet)")
    if val_data is not None:
        log.info("--mode grpo has no held-out loss: the held-out data is not used")
    return GR.GrpoObjective(cfg.grpo, cfg.batch_size, base_reference=cfg.init_adapter is None), None


def grpo_batches(rollouts: GR.Rollouts, start: int, out: Path):
    """Each step's (x, y, rollout) from start + 1 on: the rollouts of phantom.train.grpoloop, the batch a resumed
    run stopped within restored from its checkpoint (its old policy's log-probabilities are gone with the policy)."""
    if start:
        ckpt = find_checkpoint(out)
        rollouts.current = GR.restored(read_state(ckpt / "state.pt")["extra"].get("rollout")) if ckpt else None
    GR.keep_samples(out, start)
    step = start
    while True:
        step += 1
        rollout = rollouts.for_step(step)
        yield rollout.x, rollout.y, rollout


def task_eval(cfg: TrainConfig, tokenizer):
    """cfg.eval_tasks as phantom.train.evaltasks.DuringTraining (their names and datasets checked now), or None."""
    if not cfg.eval_tasks:
        return None
    try:
        from phantom.train import evaltasks
    except ImportError as e:
        raise ValueError(f"--eval-tasks needs lm-evaluation-harness ({e}); pip install 'phantom[eval]'") from None
    return evaltasks.DuringTraining(cfg.eval_tasks, tokenizer, cfg.eval_limit, cfg.batch_size)


def preference_rows(model, train_data, val_data, cfg: TrainConfig, pad: int, out: Path, identity: dict,
                    initial: dict | None = None):
    """Rows of the pairs (train, held-out) and the step-0 record. With reference "precompute" their
    reference log-probabilities come from out/reference_logps.safetensors, computed first if it does
    not hold them for these weights and data: one pass over the weights, its traffic in the record.
    With --init-adapter (`initial`: its tensors) the reference is that adapter, frozen: always precomputed."""
    sets = [PairRows(train_data, cfg.seq_len, pad)] + ([PairRows(val_data, cfg.seq_len, pad)] if val_data else [])
    first = {"step": 0}
    if cfg.preference.reference == "precompute" or initial is not None:
        weights = identity["weights"] if initial is None else \
            f"{identity['weights']}:{GR.tensors_fingerprint(initial)}"  # the initial adapter is part of the reference
        key = reference_key(model, [train_data] + ([val_data] if val_data else []), cfg.seq_len, weights)
        per_row = cfg.seq_len * model.cfg.dim * 4 * 4  # the hidden state and what a block makes of it, fp32
        rows_per_pass = max(2 * cfg.batch_size, default_keep_budget(model.device) // 2 // per_row)
        take = model.scheduler.take_metrics if model.scheduler is not None else dict
        take()
        t0 = time.perf_counter()
        def compute():
            if initial is None:
                return compute_reference(model, sets, rows_per_pass)
            with GR.initial_adapter(model, initial):
                return compute_reference(model, sets, rows_per_pass, adapters=True)
        refs = cached_reference(out / REFERENCE_FILE, key, compute)
        m = take()
        if m.get("loads"):
            first.update(reference_s=time.perf_counter() - t0, reference_bytes_read=m["bytes_read"],
                         reference_loads=m["loads"])
        for ds, ref in zip(sets, refs):
            ds.reference = ref
    return sets[0], sets[1] if val_data else None, first


def after_step(run: Run, rec: dict, mfile: fileio.RecordLog, bar, last: bool) -> None:
    """Evaluate, sample, check the tuner's prediction, log the record, move the bar, checkpoint."""
    model, cfg, step = run.model, run.cfg, rec["step"]
    if run.val_ds is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
        rec.update(evaluate_with(run.objective, model, run.val_ds, run.rows, cfg.eval_iters))
        run.best_val = min(run.best_val, rec["val_loss"])
        log.info("step %d: %s", step, describe_eval(rec))
    if run.tasks is not None and ((cfg.eval_tasks_every and step % cfg.eval_tasks_every == 0) or last):
        figures = run.tasks(model)  # the lm-eval tasks' metrics, beside the loss
        rec.update(figures)
        log.info("step %d: %s", step, describe_tasks(figures))
    if cfg.sample_every and run.tokenizer is not None and cfg.prompt and (step % cfg.sample_every == 0 or last):
        rec["sample"] = sample(model, run.tokenizer, cfg.prompt, cfg.max_new_tokens)
        log.info("step %d sample: %s%s", step, cfg.prompt, rec["sample"])
    run.step_times.append(rec["step_s"])
    if cfg.check_step is not None and step == run.start + 4:  # steps 2-4: past the warm-up
        if msg := cfg.check_step(sorted(run.step_times[1:4])[1]):
            log.warning(msg)
    mfile.append(to_json(rec))
    run.emit(rec)
    faults.point("metrics.write")  # crash tests: a step logged, its checkpoint not yet written
    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                    stall=f"{100 * rec['stall_frac']:.0f}%", **tier_postfix(rec), **preference_postfix(rec),
                    refresh=False)
    bar.update(1)
    if pdist.current().is_main and ((cfg.save_every and step % cfg.save_every == 0) or last):
        mfile.fsync()  # the records up to the checkpoint are durable with it
        save_checkpoint(run.out, model, run.opt, run.sched, step, run.identity, {"best_val": run.best_val, **run.keep})


def finish(out: Path, model, cfg: TrainConfig, status: str, step: int, loss: float) -> dict:
    """Write the trace and the trained weights (unless the run went NaN); where things are."""
    if cfg.trace and model.scheduler is not None:
        model.scheduler.tracer.write(out / "trace.json")
    adapter = weights = None
    if status == "nan":
        log.error("the loss or gradient became not finite (on this rank or another; the loss here: %s) at step %d; "
                  "stopped. The last good checkpoint is %s; lower --lr (or check the data) and --resume",
                  loss, step, find_checkpoint(out) or "none")
    elif getattr(model, "lora_cfg", None) is not None:
        adapter = model.save_adapter(out / "adapter")
        write_tokenizer_files(model.store, adapter)  # PeftModel + AutoTokenizer load from this one folder
    elif getattr(model, "full", False) and model.scheduler is not None:
        model.save_full()
        weights = model.store.path
    ckpt = find_checkpoint(out)
    return {"adapter": str(adapter) if adapter else None, "weights": str(weights) if weights else None,
            "checkpoint": str(ckpt) if ckpt else None, "metrics": str(out / "metrics.jsonl"), "out": str(out)}
