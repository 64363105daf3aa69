"""Data parallelism with torch.distributed (launched by torchrun): setup from the environment and
gradient averaging weighted by each rank's number of target tokens, so N ranks compute exactly the
gradient of the global batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_from_env(device_type: str = "cpu") -> DistInfo:
    """Join the process group torchrun describes in the environment (NCCL on CUDA, gloo otherwise)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if device_type == "cuda":  # one device per local rank, set before NCCL or any allocation touches cuda:0
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise ValueError(f"torchrun started {local_world} ranks on this machine but it has "
                             f"{torch.cuda.device_count()} CUDA device(s); use --nproc-per-node "
                             f"{torch.cuda.device_count()} or --device cpu")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return current()


def current() -> DistInfo:
    """The DistInfo of the process group this process is in (single process if none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    world = dist.get_world_size()
    return DistInfo(rank=dist.get_rank(), world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def _weighted(tensors: list[torch.Tensor], n_tokens: float):
    """Start all-reducing sum(n_r * g_r) and sum(n_r); returns a function that waits and divides."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors] + [torch.zeros(1, device=tensors[0].device)])
    flat[:-1] *= n_tokens
    flat[-1] = n_tokens
    work = dist.all_reduce(flat, async_op=True)

    def wait():
        work.wait()
        total = flat[-1].clone()
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_((flat[offset:offset + n] / total).view_as(t))
            offset += n
    return wait


def all_finite(*values: torch.Tensor) -> bool:
    """Whether every value is finite on every rank. Ranks must agree before one of them skips a
    backward or leaves the loop, or the others wait in a collective it never joins (until NCCL's
    watchdog aborts the job). One all-reduce of one number on the values' device, one host sync."""
    bad = torch.stack([(~torch.isfinite(v.detach())).sum() for v in values]).sum().float().reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    return not bool(bad.item())


def rank_mean(values: dict[str, float], weight: float, device: torch.device | str = "cpu") -> dict[str, float]:
    """Each value's mean over the ranks, weighted by `weight` (this rank's target tokens, or pairs): a
    rank's loss and preference figures are means over its own rows, and what one process over the
    global batch would log is their weighted mean. One all-reduce on `device` (NCCL's: the GPU); the
    values as they are in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return dict(values)
    keys = list(values)
    t = torch.tensor([float(weight)] + [float(values[k]) * weight for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: v / t[0].item() for k, v in zip(keys, t[1:].tolist())}


def average_gradients(params: list[torch.Tensor], n_tokens: float) -> None:
    """Replace each param's .grad (a per-rank mean over its n_tokens) by the global token mean."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and dist.is_initialized() and dist.get_world_size() > 1:
        _weighted(grads, n_tokens)()


def _weighted_in_place(tensors: list[torch.Tensor], n_tokens: float):
    """As _weighted, on the tensors themselves: each scaled by n_tokens and all-reduced where it is;
    the wait divides them by the total in place. A block's gradients are large: no flat copy of them,
    no divided temporaries (the flat form made two block-sized ones)."""
    total = torch.full((1,), float(n_tokens), dtype=torch.float32, device=tensors[0].device)
    works = [dist.all_reduce(total, async_op=True)]
    for t in tensors:
        t.mul_(n_tokens)
        works.append(dist.all_reduce(t, async_op=True))

    def wait():
        for work in works:
            work.wait()
        if total.is_cuda:  # read on the caller's stream: not reused before that read is done
            total.record_stream(torch.cuda.current_stream(total.device))
        for t in tensors:
            t.div_(total)
    return wait


def block_grad_sync(n_tokens_fn):
    """A `PhantomModel.grad_sync` for full finetuning: starts each block's all-reduce in backward and
    returns the wait. On CUDA a Work's wait makes the *current* stream wait for the reduction, so the
    caller (phantom.stream.optim.FullFinetune) calls it on its own stream, never the compute stream: block i's
    reduction then overlaps block i-1's backward."""
    def sync(grads: list[torch.Tensor]):
        return _weighted_in_place(grads, n_tokens_fn())
    return sync
