"""AdamW for streamed blocks, applied one block at a time as the backward produces its gradients.

Full finetuning never holds the whole model's gradients: block i's gradients exist only until its
update has run. Master weights (fp32, when the store holds bf16/fp16) and both moments live in host
RAM or in per-block files on disk. Imports phantom.store only.

Clipping: a global-norm clip needs every gradient before the first update, which is exactly what a
streamed step does not have. We clip per block instead, with each block's threshold scaled by its
share of the parameters: block b is clipped to max_norm * sqrt(P_b / P). When every block sits at its
threshold the global norm is exactly max_norm; when gradients are small nothing changes. Other
parameters (head, embedding) form one more group under the same rule.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from phantom.store import write_safetensors

TIERS = ("ram", "disk")


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of the block optimizer (lr may be changed per step via BlockAdamW.lr)."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # per-block share of it, see the module docstring


def clip_coefficient(grads: list[torch.Tensor], max_norm: float | None, share: float) -> float:
    """The factor (<= 1) that clips these gradients to max_norm * sqrt(share)."""
    if max_norm is None:
        return 1.0
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    return min(1.0, max_norm * math.sqrt(share) / (norm + 1e-6))


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                 cfg: AdamWConfig, lr: float) -> None:
    """One AdamW step in place on fp32 tensors, in the order torch.optim.AdamW applies it."""
    b1, b2 = cfg.betas
    p.mul_(1 - lr * cfg.weight_decay)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(cfg.eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))


class BlockAdamW:
    """Optimizer state per block (master weights, moments, step), in RAM or in files.

    Args:
        cfg: hyper-parameters.
        share: block index -> P_b / P, for the per-block clipping.
        tier: "ram" keeps the state in host memory; "disk" keeps it in `state_dir/NNN.safetensors`,
            read and rewritten (atomically) at each update.
        state_dir: where the disk tier lives, and where `save()` writes the RAM tier.
    """

    def __init__(self, cfg: AdamWConfig, share: dict[int, float], tier: str = "ram", state_dir: Path | None = None):
        if tier not in TIERS:
            raise ValueError(f"optimizer state tier must be one of {TIERS}, not {tier!r}")
        if tier == "disk" and state_dir is None:
            raise ValueError("the disk tier of the optimizer state needs a state_dir")
        self.cfg, self.share, self.tier, self.lr = cfg, share, tier, cfg.lr
        self.state_dir = Path(state_dir) if state_dir else None
        self._ram: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _path(self, i: int) -> Path:
        return self.state_dir / f"{i:03d}.safetensors"

    def load_state(self, i: int, weights) -> dict[str, torch.Tensor]:
        """Block i's state; `weights()` gives the stored weights, read only for a first update."""
        if self.tier == "ram" and i in self._ram:
            return self._ram[i]
        if self.state_dir is not None and self._path(i).is_file():
            state = load_file(str(self._path(i)))
        else:  # first update: master weights from the stored ones, zero moments
            state = {"step": torch.zeros(1, dtype=torch.int64)}
            for k, w in weights().items():
                state[f"master.{k}"] = w.detach().to("cpu", torch.float32, copy=True)
                state[f"exp_avg.{k}"] = torch.zeros(w.shape, dtype=torch.float32)
                state[f"exp_avg_sq.{k}"] = torch.zeros(w.shape, dtype=torch.float32)
        if self.tier == "ram":
            self._ram[i] = state
        return state

    def _store_state(self, i: int, state: dict[str, torch.Tensor]) -> None:
        if self.tier == "disk":
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp = self._path(i).with_suffix(".tmp")
            write_safetensors(tmp, state)
            tmp.replace(self._path(i))

    def step_block(self, i: int, weights, grads: dict[str, torch.Tensor],
                   lr: float | None = None) -> dict[str, torch.Tensor]:
        """Update block i from its gradients; returns the new fp32 master weights (CPU).

        `weights` is a callable giving the block's stored weights (needed only at the first update).
        """
        lr = self.lr if lr is None else lr
        state = self.load_state(i, weights)
        names = sorted(grads)
        coef = clip_coefficient([grads[k] for k in names], self.cfg.max_grad_norm, self.share[i])
        step = int(state["step"].item()) + 1
        state["step"] = torch.tensor([step], dtype=torch.int64)
        for k in names:
            g = grads[k].to("cpu", torch.float32)
            if coef < 1.0:
                g = g * coef
            adamw_update(state[f"master.{k}"], g, state[f"exp_avg.{k}"], state[f"exp_avg_sq.{k}"], step,
                         self.cfg, lr)
        self._store_state(i, state)
        return {k: state[f"master.{k}"] for k in names}

    def save(self, state_dir: Path) -> None:
        """Write the RAM tier's state to files (for a checkpoint)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        for i, state in self._ram.items():
            tmp = state_dir / f".{i:03d}.tmp"
            write_safetensors(tmp, state)
            tmp.replace(state_dir / f"{i:03d}.safetensors")
