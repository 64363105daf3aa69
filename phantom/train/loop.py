"""The finetuning loop: AdamW with warmup + cosine decay, clipping, layer-major accumulation, eval,
samples, metrics.jsonl, atomic checkpoints with bit-exact resume, and a clean stop on Ctrl-C or NaN.

Every file it writes follows phantom.base.fileio's rule (whole replacement or whole appended records), so a
full disk or a crash leaves the last checkpoint intact and `--resume` working. Works on a PhantomModel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
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

from phantom.data import dataset as D
from phantom.train import dist as pdist
from phantom.base import faults, fileio
from phantom.train.checkpoint import (check_free_space, find_checkpoint, planned_bytes, restore, run_identity,
                                save_checkpoint)
from phantom.model.export import write_tokenizer_files
from phantom.model.generate import generate
from phantom.model.phantom_model import default_keep_budget
from phantom.stream.placement import knob
from phantom.train.preference import REFERENCE_FILE, PairRows, Preference, PreferenceConfig, cached_reference, \
    compute_reference, reference_key

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class TrainConfig:
    """How to train (the model and data are given to `train` separately).

    Args:
        iters: optimizer steps.
        batch_size: rows per micro-batch (the model's micro_batch).
        grad_accum: micro-batches per step; the step's K * B rows go through the model in one call,
            which runs each block over all of them while it is loaded (layer-major).
        seq_len: tokens per row.
        lr, min_lr: peak learning rate and the floor of the cosine decay (None: lr / 10).
        warmup: steps of linear warmup from 0.
        weight_decay, betas: AdamW's.
        grad_clip: max gradient norm (0: no clipping): the global norm of the LoRA weights; in full mode
            each block (and the embedding, norm and head together) is clipped to grad_clip * sqrt(its
            share of the parameters) as its gradients arrive (phantom.stream.optim.clip_coefficient), since
            a streamed block is updated before the global norm could be known.
        eval_every, eval_iters: evaluate the held-out set every N steps (0: only at the end), on at
            most this many batches.
        save_every: checkpoint every N steps (0: only at the end or on Ctrl-C).
        sample_every, prompt, max_new_tokens: a greedy sample from `prompt` every N steps (0: off).
        seed: seeds the torch/numpy/python RNGs and the batch order.
        shuffle: random windows / shuffled rows; False: in order.
        out: the output folder (adapter/, checkpoint/, metrics.jsonl, trace.json).
        resume: continue from out/checkpoint.
        mode: "lora", "full" (what the model trains; recorded in checkpoints) or "dpo": a LoRA trained on
            preference pairs (train_data a phantom.train.preference.PairData; batch_size pairs a micro-batch,
            so the model's micro_batch is 2 * batch_size rows).
        preference: the preference loss and where its reference comes from (mode "dpo").
        workers: DataLoader worker processes.
        trace: write the scheduler's Chrome trace to out/trace.json at the end.
        progress: show a tqdm bar.
    """

    # knob(): the flag of scripts/finetune.py and the run-file section each field is (phantom.train.runconfig)
    iters: int = knob(200, "optimizer steps", section="optim")
    batch_size: int = knob(8, "rows per micro-batch", section="data")
    grad_accum: int = knob(1, "micro-batches per step, layer-major", section="data")
    seq_len: int = knob(128, "tokens per row", section="data")
    lr: float = knob(1e-2, "", cli=False)  # RunConfig.lr: None picks it by the model's size
    min_lr: float | None = knob(None, "end of the cosine decay (default: lr / 10)", section="optim")
    warmup: int = knob(10, "linear warmup steps", section="optim")
    weight_decay: float = knob(0.0, "AdamW weight decay", section="optim")
    betas: tuple[float, float] = knob((0.9, 0.95), "", cli=False)
    grad_clip: float = knob(1.0, "max gradient norm, 0: off", section="optim")
    eval_every: int = knob(50, "evaluate every N steps, 0: at the end only", section="output")
    eval_iters: int = knob(8, "batches per evaluation", section="output")
    save_every: int = knob(100, "checkpoint every N steps, 0: at the end only", section="output")
    sample_every: int = knob(0, "", cli=False)  # RunConfig.sample_every: None is the tiny demo's rule
    prompt: str = knob("", "prompt of the samples", section="output")
    max_new_tokens: int = knob(32, "", cli=False)
    seed: int = knob(0, "seed of the LoRA init, batch order and dropout", section="optim")
    shuffle: bool = knob(True, "read the data in order instead of random windows/rows", section="data",
                         flag="sequential", invert=True)
    out: str = knob("out/finetune", "output folder", section="output")
    resume: bool = knob(False, "continue from --out/checkpoint", section="output")
    mode: str = knob("lora", "train a LoRA, all weights, or a LoRA on preference pairs (dpo: --data with "
                             "prompt/chosen/rejected)", section="model", choices=("lora", "full", "dpo"))
    preference: PreferenceConfig = knob(PreferenceConfig(), "", section="optim")
    workers: int = knob(1, "DataLoader worker processes", section="data")
    trace: bool = knob(False, "write --out/trace.json (Chrome trace of the scheduler)", section="output")
    progress: bool = knob(True, "no progress bar or log lines", section="output", flag="quiet", short="-q",
                          invert=True)
    check_step: object = knob(None, "", cli=False)  # f(median step s of steps 2-4) -> warning or None (the tuner's prediction check)

    def __post_init__(self):
        for name in ("iters", "batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "eval_iters", "save_every", "sample_every", "workers",
                     "weight_decay", "grad_clip", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.mode not in ("lora", "full", "dpo"):
            raise ValueError(f"--mode must be lora, full or dpo, not {self.mode!r}")


# -- optimizer and schedule ---------------------------------------------------------------------

def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the one place a model-provided optimizer would plug in)."""
    params = model.trainable_parameters()
    if not params:
        raise ValueError("the model has nothing to train; load it with a LoRA (or --mode full)")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at 0-based `step`: linear warmup, then cosine down to min_lr."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    floor = (cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10) / cfg.lr
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.iters - cfg.warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))


# -- steps, eval, samples -----------------------------------------------------------------------

def train_step(model, opt, sched, batch: tuple, cfg: TrainConfig, sync=None,
               loss_fn=None) -> tuple[float, float | None, bool]:
    """One optimizer step over a batch (x, y) or packed rows (x, y, segment ids) of (K * B, T) tokens;
    returns (loss, grad norm, finite).

    `finite` is False when the loss or the gradient norm is not finite on any rank: every rank then
    skips the update and the loop stops on all of them together (a rank that stopped alone would
    leave the others waiting in an all-reduce). LoRA: backward runs whatever the loss, and the loss
    and norm are checked at once after it (one host sync a step, the one reading them needs anyway).
    Full mode: the model updates each block inside backward (with this step's lr and its per-block
    clipping), so the loss is checked before it; `opt` updates the rest; the norm is not known (None).
    `sync`, if given, runs after backward (data parallel: averages the gradients over the ranks).
    `loss_fn(model, x, y)`, if given, is the loss instead of the model's cross-entropy (preference
    training). x and y may stay on the host (the model uploads them without waiting).
    """
    x, y, *segments = batch
    full = getattr(model, "full", False)
    if full:
        model.set_lr(opt.param_groups[0]["lr"])
    loss = model(x, targets=y, **packing(*segments)) if loss_fn is None else loss_fn(model, x, y)
    if full and not pdist.all_finite(loss):
        return loss.item(), None, False
    loss.backward()
    if sync is not None:
        sync()
    norm = None
    if full:
        model.clip_grad_norm_(cfg.grad_clip or None)
        finite = True
    else:
        params = [p for g in opt.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        finite = pdist.all_finite(loss, norm)
        norm = norm.item()
    if finite:
        opt.step()
        faults.point("optimizer.step")  # crash tests: weights updated in memory only
        sched.step()
    opt.zero_grad(set_to_none=True)
    if full:
        model.finish_step()
    return loss.item(), norm, finite


@torch.no_grad()
def evaluate(model, ds, rows: int, iters: int) -> dict:
    """Mean loss (over target tokens) and perplexity on the first `iters` batches of `ds`, in order."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    n = min(ds.n_sequential, rows * iters)
    for i in range(0, n, rows):
        x, y, *seg = (torch.stack(t) for t in zip(*(ds[_seq_index(ds, j)] for j in range(i, min(i + rows, n)))))
        k = int((y != D.IGNORE_INDEX).sum())
        if k:
            total += float(model(x, targets=y, **packing(*seg))) * k
            count += k
    model.train(was_training)
    loss = total / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}


def packing(segments: torch.Tensor | None = None) -> dict:
    """The model's segments argument for packed rows (none for windows of text)."""
    return {"segments": segments} if segments is not None else {}


def _seq_index(ds, j: int) -> int:
    return j * ds.seq_len if isinstance(ds, D.Windows) else j


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> str:
    """Greedy continuation of `prompt` (KV-cached, phantom.model.generate), for progress samples."""
    was_training = model.training
    model.eval()
    ids = tokenizer.encode(prompt, bos=True)[-(model.cfg.max_seq_len - max_new_tokens):]
    stop = set(tokenizer.stop_ids)
    new = [t for t in generate(model, ids, max_new_tokens, temperature=0, eos_id=stop) if t not in stop]
    model.train(was_training)
    return tokenizer.decode(new)


# -- the loop -----------------------------------------------------------------------------------

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


def to_json(rec: dict) -> str:
    """One metrics.jsonl line; NaN and inf become null (strict JSON)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}) + "\n"


def read_metrics(path: Path, upto: int) -> list[dict]:
    """Records of metrics.jsonl up to step `upto` (what a resumed run keeps); a torn last line (a run
    stopped mid-write) is dropped with a warning, and the resumed run rewrites the file without it."""
    return [r for r in fileio.read_records(path) if isinstance(r, dict) and r.get("step", 0) <= upto]


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
    if cfg.seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    pad = tokenizer.pad_or_eos if tokenizer is not None else 0
    objective = Preference(cfg.preference) if cfg.mode == "dpo" else None
    if objective is None:
        train_ds = D.rows(train_data, cfg.seq_len, pad, "training data", segments=True)
        val_ds = D.rows(val_data, cfg.seq_len, pad, "held-out data", segments=True) if val_data is not None else None
    rows = cfg.batch_size * cfg.grad_accum  # pairs in preference training
    micro = cfg.batch_size * (2 if objective else 1)
    if cfg.grad_accum > 1 and model.micro_batch != micro:
        log.warning("--grad-accum %d: load the model with micro_batch=%d so each block runs the %d rows of a "
                    "step in micro-batches (it has micro_batch=%s)", cfg.grad_accum, micro,
                    micro * cfg.grad_accum, model.micro_batch)
    seed_everything(cfg.seed)
    model.train()
    opt, identity = make_optimizer(model, cfg), run_identity(model, train_data, cfg)
    sched = make_scheduler(opt, cfg)
    start, best_val = restore(out, model, opt, sched, identity, cfg.resume)
    history = read_metrics(out / "metrics.jsonl", start) if cfg.resume else []
    first = {"step": 0}
    if objective is not None:  # after restore: a resumed run finds its reference in the cache
        train_ds, val_ds, first = preference_rows(model, train_data, val_data, cfg, pad, out, identity)
    if val_ds is not None and start == 0:
        first.update(evaluate_with(objective, model, val_ds, rows, cfg.eval_iters))
        log.info("step 0: %s", describe_eval(first))
    if len(first) > 1 and start == 0:
        history.append(first)
    metrics_path = out / "metrics.jsonl" if ddp.is_main else Path(os.devnull)
    if ddp.is_main:
        fileio.atomic_write_text(metrics_path, "".join(to_json(r) for r in history))
    batches = iter(D.loader(train_ds, rows * ddp.world_size, cfg.seed, cfg.shuffle, start, cfg.workers,
                            pin_memory=model.device.type == "cuda"))
    run = Run(model, cfg, out, tokenizer, opt, sched, identity, val_ds, rows, start, best_val, batches, metrics_path,
              objective=objective, sinks=tuple(sinks) if ddp.is_main else (), keep=dict(keep or {}))
    if history and start == 0:
        run.emit(history[-1])  # the eval before training (a resumed run's earlier records were sent already)
    return run


def preference_rows(model, train_data, val_data, cfg: TrainConfig, pad: int, out: Path, identity: dict):
    """Rows of the pairs (train, held-out) and the step-0 record. With reference "precompute" their
    reference log-probabilities come from out/reference_logps.safetensors, computed first if it does
    not hold them for these weights and data: one pass over the weights, its traffic in the record."""
    sets = [PairRows(train_data, cfg.seq_len, pad)] + ([PairRows(val_data, cfg.seq_len, pad)] if val_data else [])
    first = {"step": 0}
    if cfg.preference.reference == "precompute":
        key = reference_key(model, [train_data] + ([val_data] if val_data else []), cfg.seq_len, identity["weights"])
        per_row = cfg.seq_len * model.cfg.dim * 4 * 4  # the hidden state and what a block makes of it, fp32
        rows_per_pass = max(2 * cfg.batch_size, default_keep_budget(model.device) // 2 // per_row)
        take = model.scheduler.take_metrics if model.scheduler is not None else dict
        take()
        t0 = time.perf_counter()
        refs = cached_reference(out / REFERENCE_FILE, key, lambda: compute_reference(model, sets, rows_per_pass))
        m = take()
        if m.get("loads"):
            first.update(reference_s=time.perf_counter() - t0, reference_bytes_read=m["bytes_read"],
                         reference_loads=m["loads"])
        for ds, ref in zip(sets, refs):
            ds.reference = ref
    return sets[0], sets[1] if val_data else None, first


def evaluate_with(objective, model, ds, rows: int, iters: int) -> dict:
    """The held-out figures: the objective's (preference training) or loss and perplexity."""
    return objective.evaluate(model, ds, rows, iters) if objective is not None else evaluate(model, ds, rows, iters)


def describe_eval(rec: dict) -> str:
    if "val_reward_accuracy" in rec:
        return f"val loss {rec['val_loss']:.4f}, reward accuracy {rec['val_reward_accuracy']:.3f}, " \
               f"margin {rec['val_reward_margin']:.4f}"
    return f"val loss {rec['val_loss']:.4f}, ppl {rec['val_ppl']:.2f}"


def tier_metrics(model, m: dict, dt: float) -> dict:
    """A step's scheduler traffic for metrics.jsonl: stall fraction, kept activations, bytes and loads per tier."""
    executor = getattr(model, "executor", None)
    return {"stall_frac": m.get("stall_s", 0.0) / dt, "kept_bytes": executor.kept_bytes if executor else 0,
            **{k: m[k] for k in m if k.startswith(("bytes", "loads"))}}


def after_step(run: Run, rec: dict, mfile: fileio.RecordLog, bar, last: bool) -> None:
    """Evaluate, sample, check the tuner's prediction, log the record, move the bar, checkpoint."""
    model, cfg, step = run.model, run.cfg, rec["step"]
    if run.val_ds is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
        rec.update(evaluate_with(run.objective, model, run.val_ds, run.rows, cfg.eval_iters))
        run.best_val = min(run.best_val, rec["val_loss"])
        log.info("step %d: %s", step, describe_eval(rec))
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


def preference_postfix(rec: dict) -> dict:
    """The step's reward accuracy for the progress bar (preference training)."""
    return {"acc": f"{rec['reward_accuracy']:.2f}"} if "reward_accuracy" in rec else {}


def tier_postfix(rec: dict) -> dict:
    """MB a step took from host RAM and from disk, for the progress bar (nothing when nothing streamed)."""
    ram, disk = rec.get("bytes_ram", 0), rec.get("bytes_read", 0)
    return {"ram_MB": f"{ram / 1e6:.0f}", "disk_MB": f"{disk / 1e6:.0f}"} if ram or disk else {}


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
