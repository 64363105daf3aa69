"""One optimizer step, the held-out evaluation and the progress samples: what the model computes
between the loop's bookkeeping. Apart from the loop (phantom.train.loop: batches, records,
checkpoints, resume) so a custom loop can take the step alone.
"""
from __future__ import annotations

import math

import torch

from phantom.base import faults
from phantom.data import batches as B
from phantom.data import dataset as D
from phantom.model.generate import generate
from phantom.train import dist as pdist
from phantom.train.trainconfig import TrainConfig


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
    return j * ds.seq_len if isinstance(ds, B.Windows) else j


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


def evaluate_with(objective, model, ds, rows: int, iters: int) -> dict:
    """The held-out figures: the objective's (preference training) or loss and perplexity."""
    return objective.evaluate(model, ds, rows, iters) if objective is not None else evaluate(model, ds, rows, iters)
