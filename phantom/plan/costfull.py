"""Full finetuning in the cost model: the block optimizer's state (where it lives, its bytes), what a
step moves for it and the seconds it adds to the same placement's LoRA step. Pure functions.

A full step is the LoRA step of its placement plus, per step:
    grad_s     the weight gradients: one more backward's FLOPs per block (LoRA computes input gradients
               only), at the profile's backward rate
    update_s   every parameter's update at the optimizer's measured parameters/s (`OptimRates`)
    state_s    the disk tier's state: read and written once (master weights and moments)
    write_s    blocks that do not live in RAM written back to the store
These add on a CPU, where the write-back thread's update and writes share the cores with the backward;
on a CUDA device with device-held state the update overlaps the backward and the sum is an upper bound.
Memory: the state's bytes in its tier (phantom.stream.optim.state_memory), the head's and embedding's
fp32 weights, gradients and moments on the compute side, a working copy of the store on disk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phantom.arch.config import ModelConfig
from phantom.plan.costinputs import MachineProfile, Shape
from phantom.plan.costmodel import MARGIN, Prediction, gib, missing_text, shortfall
from phantom.stream.optim import block_state_bytes, moment_bytes, state_memory, state_tier


@dataclass(frozen=True)
class OptimRates:
    """An optimizer update's parameters/s on this machine, by optimizer, and the disk's fsynced write
    GB/s (phantom.plan.optimtimer measures them)."""

    params_per_s: dict[str, float]
    disk_write_gbps: float


def moment_bytes_per_param(optim: str, block_params: int) -> float:
    """Bytes of the two moments per parameter of a block of `block_params` (8-bit: codes and scales; a
    block's smaller tensors keep fp32 moments, which this rounding of the largest ones leaves out)."""
    return moment_bytes(optim, block_params) / block_params


def state_per_param(optim: str, block_params: int) -> float:
    """The block optimizer's bytes per parameter: the fp32 master weights and the moments."""
    return block_state_bytes(optim, block_params) / block_params


@dataclass(frozen=True)
class FullPrediction:
    """What full finetuning adds to a LoRA plan of the same placement (see the module docstring)."""

    optim: str
    state_tier: str
    state_bytes: int  # master weights and moments of every block
    moment_bytes: int  # the moments alone (a checkpoint's optimizer state beside the masters)
    host_bytes: int
    device_bytes: int
    disk_bytes: int  # the working store and the disk tier's state
    lora_step_s: float
    grad_s: float
    update_s: float
    state_s: float
    write_s: float
    missing: tuple[tuple[str, int], ...] = ()

    @property
    def step_s(self) -> float:
        return self.lora_step_s + self.grad_s + self.update_s + self.state_s + self.write_s

    @property
    def fits(self) -> bool:
        return not self.missing

    def describe(self) -> str:
        need = f"; missing: {missing_text(self.missing)}" if self.missing else ""
        return (f"full       {self.optim}: optimizer state {gib(self.state_bytes)} (moments {gib(self.moment_bytes)}) "
                f"{'in RAM' if self.state_tier == 'ram' else 'on disk' if self.state_tier == 'disk' else 'on the device'}"
                f"; needs {gib(self.host_bytes)} host memory, {gib(self.disk_bytes)} disk"
                f"{', ' + gib(self.device_bytes) + ' device memory' if self.device_bytes else ''}; predicted "
                f"{self.step_s:.3f} s/step against LoRA's {self.lora_step_s:.3f} s (+{self.grad_s:.3f} weight "
                f"gradients, +{self.update_s:.3f} update, +{self.state_s:.3f} state I/O, +{self.write_s:.3f} "
                f"block writes){need}")


def predict_full(profile: MachineProfile, shape: Shape, cfg: ModelConfig, lora: Prediction, optim: str,
                 rates: OptimRates, state: str = "auto") -> FullPrediction:
    """The full finetune of `lora`'s placement with `optim`; the state tier as phantom.stream.optim.state_tier
    chooses it from the free memory left beside the plan."""
    block_params, n = cfg.block_params(), shape.n_blocks
    per_param = state_per_param(optim, block_params)
    total_state = int(per_param * block_params * n)
    free_device = None if profile.free_device_bytes is None else \
        int(profile.free_device_bytes * (1 - MARGIN)) - lora.device_bytes  # the plan's margin kept
    free_host = None if profile.free_host_bytes is None else int(profile.free_host_bytes * (1 - MARGIN)) - lora.host_bytes
    tier = state_tier(state, torch.device(profile.device), total_state, free_device, free_host)
    held = state_memory(tier, block_params, n, per_param=per_param)
    others = cfg.n_params() - block_params * n  # head, embedding, final norm: the caller's optimizer
    other_bytes = int((8 + moment_bytes_per_param(optim, others)) * others)  # fp32 weight, gradient, moments
    host = lora.host_bytes + held["host"] + (other_bytes if profile.device == "cpu" else 0)
    device = (lora.device_bytes + held["device"] + other_bytes) if profile.device != "cpu" else 0
    disk = shape.store_bytes + held["disk"]
    disk_blocks = n - lora.layout.tiers.count("ram") - lora.layout.tiers.count("device")
    bwd_rate = profile.fwd_flops / profile.bwd_ratio
    return FullPrediction(
        optim=optim, state_tier=tier, state_bytes=total_state,
        moment_bytes=moment_bytes(optim, block_params) * n,
        host_bytes=host, device_bytes=device, disk_bytes=disk, lora_step_s=lora.step_s,
        grad_s=n * lora.rows * shape.flops_per_row / bwd_rate,
        update_s=cfg.n_params() / rates.params_per_s[optim],
        state_s=(total_state / (profile.disk_gbps * 1e9) + total_state / (rates.disk_write_gbps * 1e9))
        if tier == "disk" else 0.0,
        write_s=disk_blocks * shape.block_bytes / (rates.disk_write_gbps * 1e9),
        missing=shortfall(shape, profile, device, host, MARGIN, disk))
