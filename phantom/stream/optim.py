"""AdamW for streamed blocks, applied one block at a time as the backward produces its gradients.

Full finetuning never holds the whole model's gradients: block i's gradients exist only until its
update has run. Master weights (fp32, when the store holds bf16/fp16) and both moments live in host
RAM, in per-block files on disk, or (CUDA) on the device. `FullFinetune` is the component the
executor calls with each block's gradients: it queues the block's update on the scheduler's
write-back thread, so block i's update overlaps the backward of block i-1.

Speed: the update is torch's fused AdamW kernel (one pass over master, gradient and both moments,
threaded over every core by ATen: on a 2-core box ~7x the per-op AdamW it replaced, which made
five passes and two temporaries; notes/bench-full.md). On CUDA with host-placed state the gradients
leave the device on their own stream into pinned buffers (`HostGradients`), never on the compute
stream; with device-placed state the update runs on the device and nothing is copied but the weights.

Clipping: a global-norm clip needs every gradient before the first update, which is exactly what a
streamed step does not have. We clip per block instead, with each block's threshold scaled by its
share of the parameters: block b is clipped to max_norm * sqrt(P_b / P). When every block sits at its
threshold the global norm is exactly max_norm; when gradients are small nothing changes. Other
parameters (head, embedding) form one more group under the same rule.
"""
from __future__ import annotations

import contextlib
import math
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch.optim.adamw import adamw as adamw_functional

from phantom.base import faults, fileio
from phantom.files.tensorfile import write_safetensors
from phantom.stream import adam8bit
from phantom.stream.adam8bit import check_optimizer, check_rounding

TIERS = ("ram", "disk", "device")  # where a block's master weights and moments live


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of the block optimizer (lr may be changed per step via BlockAdamW.lr)."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # per-block share of it, see the module docstring
    state: str = "auto"  # where master weights and moments live: see state_tier
    optim: str = "adamw_torch"  # or "adamw_8bit": the moments as 8-bit codes (phantom.stream.adam8bit)
    rounding: str = "nearest"  # adamw_8bit's requantization; "bnb_cpu": bitsandbytes' CPU lookup (to compare)

    def __post_init__(self):
        check_optimizer(self.optim)
        check_rounding(self.rounding)


def moment_bytes(optim: str, n: int) -> int:
    """Bytes of an n-element tensor's two moments under `optim`."""
    return 8 * n if optim == "adamw_torch" else adam8bit.state_bytes(n)


def block_state_bytes(optim: str, n: int) -> int:
    """The block optimizer's bytes for n parameters: fp32 master weights and the moments."""
    return 4 * n + moment_bytes(optim, n)


def state_tier(wanted: str, device: torch.device, state_bytes: int, free_device: int | None,
               free_host: int | None) -> str:
    """Where the block optimizer's state lives (and so where each update runs) for `wanted`.

    "auto" fills the fastest place with room, as the scheduler does for blocks: a CUDA device when
    the state (12 bytes per block parameter) takes at most half of what is free there once the
    blocks are placed (the update then runs at device memory speed and no gradient crosses the
    link); else host RAM when it takes at most half of what is available; else per-block files,
    read and rewritten at each update (then the step is bound by the disk's write speed: 16 bytes
    a parameter per step with the block itself; notes/bench-full.md).
    """
    if wanted not in ("auto", *TIERS):
        raise ValueError(f"optimizer state must be one of auto, {', '.join(TIERS)}, not {wanted!r}")
    if wanted == "device" and device.type != "cuda":
        raise ValueError(f"optimizer state 'device' needs a CUDA device, not {device.type}: use auto, ram or disk")
    if wanted != "auto":
        return wanted
    if device.type == "cuda" and free_device is not None and state_bytes <= free_device // 2:
        return "device"
    return "ram" if free_host is None or state_bytes <= free_host // 2 else "disk"


def clip_coefficient(grads: list[torch.Tensor], max_norm: float | None, share: float) -> float:
    """The factor (<= 1) that clips these gradients to max_norm * sqrt(share).

    The norm is torch's (per-tensor fp32 norms, then the norm of those): one read of each gradient,
    no fp64 copy of it."""
    if max_norm is None or not grads:
        return 1.0
    norm = float(torch.nn.utils.get_total_norm(grads))
    return min(1.0, max_norm * math.sqrt(share) / (norm + 1e-6))


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], step: int, cfg: AdamWConfig, lr: float, coef: float = 1.0) -> None:
    """Step `step` (1-based) of AdamW in place on fp32 tensors: torch's fused kernel (CPU and CUDA;
    its for-each form elsewhere), the gradients scaled by `coef` inside the kernel (which leaves them
    scaled: they are consumed). Equals torch.optim.AdamW on gradients multiplied by coef, to rounding."""
    fused = params[0].device.type in ("cpu", "cuda")
    # filled where they are used: a torch.tensor(..., device="cuda") is a blocking copy from the host
    steps = [torch.full((), float(step - 1), device=params[0].device if fused else "cpu") for _ in params]
    scale = torch.full((), 1.0 / coef, device=params[0].device) if coef < 1.0 else None
    if scale is not None and not fused:
        grads = torch._foreach_mul(grads, coef)
        scale = None
    b1, b2 = cfg.betas
    adamw_functional(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=fused, foreach=not fused,
                     grad_scale=scale, amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=cfg.weight_decay,
                     eps=cfg.eps, maximize=False)


def state_memory(tier: str, block_params: int, n_blocks: int, grads_in_flight: int = 2,
                 per_param: float = 12.0) -> dict[str, int]:
    """Bytes the block optimizer holds, by place, for a state tier (the tuner's memory model).

    State is 12 bytes per parameter (fp32 master, exp_avg, exp_avg_sq; 6 and 1/32 with adamw_8bit's
    codes and scales: `per_param`) in the tier's place; the disk
    tier holds one block's state in host memory while it updates it. Gradients are 4 bytes per
    parameter (fp32) for each block between its backward and the end of its update: the one being
    updated and the one the backward is producing (`grads_in_flight`), on the host for host tiers
    (pinned buffers on CUDA), on the device for the device tier.
    """
    state, grads = int(per_param * block_params), 4 * block_params * grads_in_flight
    if tier == "device":
        return {"host": 0, "device": state * n_blocks + grads, "disk": 0}
    if tier == "disk":
        return {"host": state + grads, "device": 0, "disk": state * n_blocks}
    return {"host": state * n_blocks + grads, "device": 0, "disk": 0}


class BlockAdamW:
    """Optimizer state per block (master weights, moments, step) in RAM, in files or on the device.

    Args:
        cfg: hyper-parameters.
        share: block index -> P_b / P, for the per-block clipping.
        tier: "ram" keeps the state in host memory; "disk" keeps it in `state_dir/NNN.safetensors`,
            read and rewritten (atomically) at each update; "device" keeps it on `device` (CUDA: the
            update runs there, only the new weights leave it).
        state_dir: where the disk tier lives, and where `save()` writes the RAM and device tiers.
        device: where the "device" tier lives.

    Memory per trained parameter: 12 bytes (master + 2 moments, fp32) in the tier's place, plus the
    gradient (4 bytes, fp32) of at most the blocks queued for update (phantom.stream.scheduler's write-back
    queue bounds them).
    """

    def __init__(self, cfg: AdamWConfig, share: dict[int, float], tier: str = "ram", state_dir: Path | None = None,
                 device: torch.device | str = "cpu"):
        if tier not in TIERS:
            raise ValueError(f"optimizer state tier must be one of {TIERS}, not {tier!r}")
        if tier == "disk" and state_dir is None:
            raise ValueError("the disk tier of the optimizer state needs a state_dir")
        self.cfg, self.share, self.tier, self.lr = cfg, share, tier, cfg.lr
        self.state_dir = Path(state_dir) if state_dir else None
        self.device = torch.device(device) if tier == "device" else torch.device("cpu")
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # the RAM and device tiers' state
        self.params_updated = 0  # parameters stepped, and the seconds it took (for parameters/s)
        self.update_s = 0.0

    def _path(self, i: int) -> Path:
        return self.state_dir / f"{i:03d}.safetensors"

    def load_state(self, i: int, weights) -> dict[str, torch.Tensor]:
        """Block i's state; `weights()` gives the stored weights, read only for a first update."""
        if i in self._held:
            return self._held[i]
        if self.state_dir is not None and self._path(i).is_file():
            state = load_file(str(self._path(i)), device=str(self.device))
            self._check_kind(i, state)
        else:  # first update: master weights from the stored ones, zero moments
            state = {"step": torch.zeros(1, dtype=torch.int64)}
            for k, w in weights().items():
                state[f"master.{k}"] = w.detach().to(self.device, torch.float32, copy=True)
                moments = adam8bit.new_state(w.shape, self.device, self.cfg.optim == "adamw_8bit")
                state.update({f"{name}.{k}": t for name, t in moments.items()})
        state["step"] = state["step"].cpu()
        if self.tier != "disk":
            self._held[i] = state
        return state

    def _check_kind(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """A state file of the other optimizer is refused in one line (8-bit codes under adamw_torch, or
        fp32 moments of an 8-bit-sized tensor under adamw_8bit)."""
        coded = any(k.startswith("exp_avg_q.") for k in state)
        wide = any(k.startswith("exp_avg.") and v.numel() >= adam8bit.MIN_8BIT for k, v in state.items())
        kind = "adamw_8bit" if coded else "adamw_torch" if wide else self.cfg.optim
        if kind != self.cfg.optim:
            raise ValueError(f"{self._path(i)} holds {kind}'s optimizer state, not {self.cfg.optim}'s: resume with "
                             f"--optim {kind}, or start another run")

    def _store_state(self, i: int, state: dict[str, torch.Tensor]) -> None:
        if self.tier == "disk":
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with fileio.replacing(self._path(i)) as tmp:
                write_safetensors(tmp, state)

    def step_block(self, i: int, weights, grads: dict[str, torch.Tensor],
                   lr: float | None = None) -> dict[str, torch.Tensor]:
        """Update block i from its gradients; returns the new fp32 master weights (on the tier's device).

        `weights` is a callable giving the block's stored weights (needed only at the first update).
        Gradients must be on the tier's device (FullFinetune moves them).
        """
        t0 = time.perf_counter()
        lr = self.lr if lr is None else lr
        state = self.load_state(i, weights)
        names = sorted(grads)
        gs = [grads[k].to(self.device, torch.float32) for k in names]
        coef = clip_coefficient(gs, self.cfg.max_grad_norm, self.share[i])
        step = int(state["step"].item()) + 1
        wide = [k for k in names if f"exp_avg.{k}" in state]  # fp32 moments: torch's fused AdamW
        if wide and self.cfg.optim == "adamw_torch":
            adamw_step([state[f"master.{k}"] for k in wide], [gs[names.index(k)] for k in wide],
                       [state[f"exp_avg.{k}"] for k in wide], [state[f"exp_avg_sq.{k}"] for k in wide], step,
                       self.cfg, lr, coef)
        if self.cfg.optim == "adamw_8bit":
            h = adam8bit.hyper(lr, self.cfg.betas, self.cfg.eps, self.cfg.weight_decay, step, coef, self.device)
            for k, g in zip(names, gs):
                moments = {name: state[f"{name}.{k}"] for name in adam8bit.MOMENT_NAMES if f"{name}.{k}" in state}
                adam8bit.step_tensor(state[f"master.{k}"], g, moments, h, self.cfg.rounding)
        state["step"] = torch.tensor([step], dtype=torch.int64)
        faults.point("optim.update")  # crash tests: block i's state stepped in memory, nothing written
        self._store_state(i, state)
        self.params_updated += sum(g.numel() for g in gs)
        self.update_s += time.perf_counter() - t0
        return {k: state[f"master.{k}"] for k in names}

    def take_rate(self) -> dict:
        """Parameters updated and seconds spent since the last call (and their ratio); resets them."""
        n, s = self.params_updated, self.update_s
        self.params_updated, self.update_s = 0, 0.0
        return {"optim_params": n, "optim_s": s, "optim_params_per_s": n / s if s > 0 else 0.0}

    def save(self, state_dir: Path) -> None:
        """Write the RAM and device tiers' state to files (for a checkpoint)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        for i, state in self._held.items():
            with fileio.replacing(state_dir / f"{i:03d}.safetensors") as tmp:
                write_safetensors(tmp, state)


class HostGradients:
    """CUDA, host-placed optimizer state: a block's gradients to pinned host buffers on a copy stream.

    The copy is ordered after the backward that produced the gradients by the stream wait, and the
    update waits for the copy's event on the write-back thread: the compute stream never waits for
    it, and no copy goes through pageable memory. `slots` pinned buffers (each as large as the
    largest block's gradients) bound what is in flight: when all are in use, `start` waits for the
    oldest update to finish (back-pressure), so queued gradients never hold more than `slots` blocks
    of device memory.

    Args:
        device: the CUDA device the gradients are on.
        alloc: nbytes -> an owner of exactly that many pinned host bytes, whose `.tensor` is a flat
            uint8 view (phantom.stream.hostmem.HostBuffer); the owner is kept while the buffer is used.
        slots: buffers in flight.
    """

    def __init__(self, device: torch.device, alloc: Callable[[int], object], slots: int = 2):
        self.device, self.alloc = torch.device(device), alloc
        self.stream = torch.cuda.Stream(self.device)
        self._free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self._free.put(None)  # allocated on first use, at the size of the block that needs it
        self.pinned_bytes = 0

    def start(self, grads: dict[str, torch.Tensor], synced: Callable[[], None] | None = None
              ) -> tuple[dict[str, torch.Tensor], object, Callable[[], None]]:
        """Queue the copy of `grads` (training thread), after their data-parallel reduction when
        `synced` (its wait) is given: that wait runs on this stream too, so the compute stream waits
        for neither. Returns the host tensors, the copy's event (read them only after
        `event.synchronize()`) and `release`, to call once they are used."""
        nbytes = sum(g.numel() * g.element_size() for g in grads.values())
        owner = self._free.get()  # back-pressure: waits for an update to release its buffer
        if owner is None or owner.tensor.numel() < nbytes:
            self.pinned_bytes -= owner.tensor.numel() if owner is not None else 0
            owner = self.alloc(nbytes)
            self.pinned_bytes += nbytes
        host, offset = {}, 0
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if synced is not None:
                synced()
            for k, g in grads.items():
                n = g.numel() * g.element_size()
                host[k] = owner.tensor[offset:offset + n].view(g.dtype).view(g.shape)
                host[k].copy_(g, non_blocking=True)
                g.record_stream(self.stream)  # the allocator may not reuse g before the copy is done
                offset += n
            event = torch.cuda.Event()
            event.record(self.stream)
        return host, event, lambda: self._free.put(owner)


class FullFinetune:
    """Full finetuning of streamed blocks: the component the executor calls with each block's gradients.

    `on_block_grads` (training thread, inside backward) starts the gradients' way to the optimizer
    (data-parallel reduction, copy to pinned host memory on CUDA) and queues the update on the
    scheduler's write-back thread; `update` (that thread) steps the block's AdamW and puts the new
    weights where the scheduler reads them: the RAM tier (written to the store by `save`), or the
    store's file (disk tier). `finish` waits for a step's updates before the next step reads blocks.

    Args:
        optimizer: the block optimizer (its tier says where the state lives and the update runs).
        scheduler: the model's BlockScheduler (write-back queue, host weights, tiers).
        store: the working store that disk-tier blocks are rewritten in.
        host_grads: CUDA with host-placed state: the copier of gradients to pinned host buffers.
    """

    def __init__(self, optimizer: BlockAdamW, scheduler, store, host_grads: HostGradients | None = None):
        self.optimizer, self.scheduler, self.store, self.host_grads = optimizer, scheduler, store, host_grads
        # CUDA: the updates' device work (AdamW on device-held state, the reduction's wait, copies of the
        # new weights) runs on a stream of its own, never queued behind or in front of the compute
        self.stream = torch.cuda.Stream(scheduler.device) if scheduler.device.type == "cuda" else None

    def on_block_grads(self, i: int, grads: dict[str, torch.Tensor], grad_sync=None) -> None:
        """Block i's backward is done (training thread): its update is queued and backward goes on.

        `grad_sync` (data parallel) starts the reduction of these gradients and returns a function
        that waits for it; the wait runs on the host-gradient copier's stream or on the update's
        stream, so the all-reduce of block i overlaps the backward of block i-1."""
        synced = grad_sync(list(grads.values())) if grad_sync else None
        ready = release = None
        if self.host_grads is not None:  # the copies to the host wait for the reduction, on their stream
            grads, ready, release = self.host_grads.start(grads, synced)
            synced = None
        elif self.stream is not None:  # device-held state: the update's stream waits for the backward
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.scheduler.device))
        self.scheduler.writeback.submit(self.update, i, grads, synced, ready, release, name=f"update {i}")

    def update(self, i: int, grads: dict[str, torch.Tensor], synced=None, ready=None, release=None) -> None:
        """Block i's optimizer step (write-back thread): new weights to host RAM, or to the store."""
        if self.optimizer.tier == "device" and self.stream is not None:
            new = self._update_on_device(i, grads, synced, ready)
        else:
            if synced is not None:
                synced()
            if ready is not None:  # CUDA: the gradients' copies to the host have landed
                ready.synchronize()
            try:
                new = self.optimizer.step_block(i, lambda: self.scheduler.host_weights(i), grads)
            finally:
                if release is not None:
                    release()
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.scheduler.update_block(i, new)
        if self.scheduler.tiers[i] != "ram":  # RAM-tier blocks are written by save
            self.store.write_block(i, self.untrained(i, new) | new)

    def untrained(self, i: int, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Block i's stored tensors that new lacks: those no optimizer steps (a block's buffers, DeepSeek-V3's
        router correction bias), read from the file's mapping (those pages alone)."""
        if len(new) == len(self.store.blocks[i].specs):
            return {}
        stored = self.store.block_views(self.store.map_block(i), i)
        return {k: v.clone() for k, v in stored.items() if k not in new}

    def _update_on_device(self, i: int, grads: dict[str, torch.Tensor], synced, ready) -> dict[str, torch.Tensor]:
        """Device-held state: the step on this component's stream after the backward (and the
        reduction), the new weights converted to the store's dtype on the device and copied into the
        RAM tier's pinned memory without blocking. update_block waits for those copies on this thread,
        which also keeps the gradients alive until the stream is done with them."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            if synced is not None:
                synced()
            master = self.optimizer.step_block(i, lambda: self.scheduler.host_weights(i), grads)
            new = {k: v.to(self.store.dtype) for k, v in master.items()}
            self.scheduler.update_block(i, new)
            if self.scheduler.tiers[i] != "ram":  # written to the store's file by the caller
                new = {k: v.to("cpu") for k, v in new.items()}
        return new

    def finish(self) -> None:
        """Wait for the queued block updates and re-raise any error they hit."""
        self.scheduler.writeback.flush()

    def save(self) -> None:
        """The RAM-tier blocks to the store, the held optimizer state to its files."""
        self.finish()
        for i, tier in enumerate(self.scheduler.tiers):
            if tier == "ram":
                self.store.write_block(i, self.scheduler.host_weights(i))
        if self.optimizer.state_dir is not None:
            self.optimizer.save(self.optimizer.state_dir)
