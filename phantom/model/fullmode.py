"""Full finetuning's wiring in a PhantomModel: what it refuses, the device memory it holds beside the
blocks, the streamed blocks' optimizer beside the backward, clipping by groups, and the trained model
written back to its store. Apart from the backends (phantom.model.backends), which only run blocks,
so a LoRA run never reads it; the optimizer itself is phantom.stream.optim's.
"""
from __future__ import annotations

import dataclasses

import torch

from phantom.arch.config import ModelConfig, head_tensor_shapes
from phantom.files.store import BlockStore
from phantom.model.lora import LoraConfig
from phantom.stream.hostmem import HostBuffer
from phantom.stream.memory import free_device_bytes, free_host_bytes
from phantom.stream.optim import (AdamWConfig, BlockAdamW, FullFinetune, HostGradients, block_state_bytes,
                                  clip_coefficient, state_tier)
from phantom.stream.placement import Activations, Placement
from phantom.stream.scheduler import BlockScheduler
from phantom.stream.tiers import Held


def refuse_frozen(store: BlockStore) -> None:
    """A quantized store is frozen: full finetuning needs its 16-bit weights. phantom.load asks before it
    makes a working copy, the model again when it is built."""
    if store.quant is not None and store.quant.shipped:
        raise ValueError(f"{store.path}: full finetuning of a {store.quant.method} store is not supported: its weights "
                         f"are read as the checkpoint ships them; train LoRA on it")
    if store.quant is not None:
        raise ValueError(f"{store.path}: a {store.quant.method} store is frozen: full finetuning needs the 16-bit "
                         f"weights (prepare the store without --quantize), or train LoRA on this one")


def checked(store: BlockStore, lora: LoraConfig | None, placement: Placement, activations: Activations) -> Activations:
    """Refuse what full finetuning cannot work with; recompute "auto" becomes "all"."""
    refuse_frozen(store)
    if lora is not None:
        raise ValueError("full finetuning trains every weight: pass lora=None with an optim config")
    if activations.recompute == "none":
        raise ValueError("full finetuning needs recompute='all' (kept graphs hold no path to the weights)")
    if placement.shared_ram:
        raise ValueError("shared_ram is read-only: full finetuning needs private RAM blocks")
    if activations.recompute == "auto":
        activations = dataclasses.replace(activations, recompute="all")
    return activations


def device_reserve(cfg: ModelConfig) -> int:
    """Device bytes full finetuning holds beside blocks and activations: the head's three fp32 head-sized
    buffers (ChunkedHeadLoss: its gradient, one chunk's, the scaled copy it saves) and the fp32 gradients
    of the two blocks in flight (the one updating, the one the backward produces)."""
    return 3 * 4 * cfg.vocab_size * cfg.dim + 2 * 4 * cfg.block_params()


def block_updates(cfg: ModelConfig, optim: AdamWConfig, scheduler: BlockScheduler) -> FullFinetune:
    """The streamed blocks' optimizer (state where optim.state says, phantom.stream.optim.state_tier; on
    disk in the folder `optim` beside the store's) and the component that runs their updates beside the
    backward."""
    device, store = scheduler.device, scheduler.store
    frozen = sorted(name for name, held in scheduler.residency.held.items() if type(held).update is Held.update)
    if frozen:  # refused when the run opens, not at the first update
        raise ValueError(f"full finetuning writes every block back: the {', '.join(frozen)} tier cannot take "
                         f"updated weights (Held.update); place the blocks in ram or disk")
    share = {i: cfg.block_params(i) / cfg.n_params() for i in range(cfg.n_layers)}  # each block its own size
    state_bytes = sum(block_state_bytes(optim.optim, cfg.block_params(i)) for i in range(cfg.n_layers))
    tier = state_tier(optim.state, device, state_bytes, free_device_bytes(device), free_host_bytes())
    optimizer = BlockAdamW(optim, share, tier, store.path.parent / "optim", device)
    host_grads = None
    if device.type == "cuda" and tier != "device":  # gradients to pinned host buffers, own stream
        host_grads = HostGradients(device, lambda n: HostBuffer(n, pin=True))
    return FullFinetune(optimizer, scheduler, store, host_grads)


def clip(groups: list[list[torch.nn.Parameter]], max_norm: float, n_params: int) -> None:
    """Each group's gradients to max_norm * sqrt(its share of the parameters) (the documented rule:
    phantom.stream.optim.clip_coefficient), the streamed blocks' having been clipped as they arrived."""
    for group in groups:
        share = sum(p.numel() for p in group) / n_params
        coef = clip_coefficient([p.grad for p in group if p.grad is not None], max_norm, share)
        for p in group:
            if p.grad is not None and coef < 1.0:
                p.grad.mul_(coef)


def save(full_ft: FullFinetune, store: BlockStore, head: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    """Make the store hold the trained model: the blocks and their optimizer state, head, embedding."""
    full_ft.save()
    store.write_head({k: v for k, v in head.items() if k in head_tensor_shapes(store.cfg)})
    store.write_embed({"tok_embeddings.weight": embed})
