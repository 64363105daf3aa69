"""Where a PhantomModel's blocks run, chosen once when the model is built: `ResidentBlocks` (every
block's weights on the device, plain autograd: the reference) or `StreamedBlocks` (weights streamed
by a BlockScheduler into slots and run by a BlockExecutor). The model asks its backend for the block
stack, the embedding table's home, the blocks' clipping groups, the end of a step and closing, and
never branches on which one it holds. The head and loss are phantom.model.heads'; how full
finetuning updates streamed blocks is phantom.model.fullmode's.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from phantom.arch import carry as C
from phantom.arch.config import ModelConfig
from phantom.arch.layers import fuse_adjacent, lora_disabled, make_block
from phantom.arch.ops import KVCache
from phantom.stream.kvcache import block_cache
from phantom.files.store import BlockStore
from phantom.files.tensorfile import packed_empty
from phantom.model.lora import LoraConfig, apply_lora, expert_names
from phantom.stream import lanes as L
from phantom.stream.executor import BlockExecutor
from phantom.stream.memory import free_device_bytes, free_host_bytes
from phantom.stream.placement import Activations
from phantom.stream.scheduler import BlockScheduler

log = logging.getLogger(__name__)


def build_layers(cfg: ModelConfig, lora: LoraConfig | None, activations: Activations, dtype: torch.dtype,
                 device: torch.device) -> nn.ModuleList:
    """The blocks both backends run: base weights as meta placeholders (frozen; a backend fills them),
    LoRA applied with its fp32 master weights on the device."""
    layers = nn.ModuleList(make_block(cfg, "meta", dtype, i) for i in range(cfg.n_layers))
    for p in layers.parameters():
        p.requires_grad_(False)
    for i, block in enumerate(layers):
        if lora is not None:
            apply_lora(block, lora, i, expert_names(cfg))
        block.checkpoint_inner = activations.checkpoint_inner
        block.mlp_chunk = activations.mlp_chunk
        if activations.compile:
            block.compile(options=inductor_options(device))
    for name, p in layers.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(device)  # fp32 master weights on the device
    if lora is not None and lora.layers is None:
        warn_unadapted(layers, lora)
    return layers


def inductor_options(device: torch.device) -> dict:
    """The block's torch.compile options: on a CPU, the vector width inductor picks (from ATEN_CPU_CAPABILITY,
    else the widest the CPU has) named outright. Left implicit, it is not in inductor's graph cache key, so a
    graph generated for AVX-512 (16 floats a vector) is served from the cache to an AVX2 run, built with AVX2
    flags and computes garbage (NaN losses), and an AVX2 graph under AVX-512 writes past its buffers; named,
    each width has its own cache entries. The same ISA is picked either way."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return {"cpp.simdlen": pick_vec_isa().bit_width()}


def warn_unadapted(layers: nn.ModuleList, lora: LoraConfig) -> None:
    """Say which blocks the targets leave without a LoRA, where some get one: a model mixing kinds of block
    (Qwen3.5's Gated DeltaNet layers among attention ones) would otherwise train a quarter of them, silently."""
    bare = [i for i, block in enumerate(layers) if not any("lora_" in n for n, _ in block.named_parameters())]
    if bare and len(bare) < len(layers):
        log.warning("LoRA targets %s adapt no module of %d of the %d blocks (%s); see --lora-targets for the "
                    "names their modules take", ",".join(lora.targets), len(bare), len(layers),
                    ", ".join(map(str, bare[:8])) + (", ..." if len(bare) > 8 else ""))


class ResidentBlocks:
    """offload="none": every block's weights on the device, in the file's layout (so frozen blocks run
    the same fused projections as streamed ones), separate tensors when trained; plain autograd."""

    scheduler = executor = None  # nothing streams
    offload = "none"

    def __init__(self, layers: nn.ModuleList, store: BlockStore, device: torch.device, dtype: torch.dtype,
                 micro_batch: int | None, trained: bool):
        self.layers, self.store, self.device, self.micro_batch = layers, store, device, micro_batch
        for block_index, block in enumerate(layers):
            stored = store.load_block(block_index, dtype)  # quantized: dequantized into it
            weights = packed_empty(stored, dtype, device)
            for k, v in stored.items():
                weights[k].copy_(v)
            if trained:
                weights = {k: v.clone() for k, v in weights.items()}
            block.load_state_dict(weights, strict=False, assign=True)  # keeps requires_grad=False
            for name, p in block.named_parameters():
                p.requires_grad_(trained or "lora_" in name)
            if not trained:
                for name, view in fuse_adjacent(weights).items():
                    if name not in weights:
                        owner, _, leaf = name.rpartition(".")
                        block.get_submodule(owner).register_parameter(leaf, nn.Parameter(view, requires_grad=False))

    def share(self, layers: nn.ModuleList) -> None:
        """An adapter's copy of the blocks (phantom.stream.lanes) takes the same resident weights."""
        for block, source in zip(layers, self.layers):
            L.bind_shared(block, source)

    def embed_table(self, dtype: torch.dtype, trained: bool) -> torch.Tensor:
        """The embedding table, on the device with the blocks."""
        return self.store.load_embed()["tok_embeddings.weight"].to(self.device, dtype)

    def __call__(self, h: torch.Tensor, rope: torch.Tensor, caches: list[KVCache] | None = None, start_pos: int = 0,
                 mask: torch.Tensor | None = None, reference: torch.Tensor | None = None,
                 lanes: list[L.Lane] | None = None, carry: C.Carry = None):
        """Every block over h (micro-batches of `micro_batch` rows); with `reference`, also over that
        hidden state with the adapters off and no autograd, block by block beside h (returns both).
        `lanes`: each adapter's rows through its own blocks, its micro-batches split on their own. `carry`: the
        state the first block receives (phantom.arch.carry; None: a fresh one), the reference's a copy of it."""
        split = lambda t: L.split_rows(t, lanes, self.micro_batch)  # noqa: E731
        carry = C.start(self.store.cfg) if carry is None else carry
        ref_carry = dict(carry) if carry is not None and reference is not None else None
        for i, block in enumerate(self.layers):
            if caches is not None:
                with block_cache(caches, i, start_pos, h.shape[1]) as cache:
                    h = block(h, rope, cache, start_pos, mask, **({} if carry is None else {"carry": carry}))
                continue
            hs = split(h)
            ropes = split(rope) if mask is not None else [rope] * len(hs)  # packed rows: a rope per row
            masks = split(mask) if mask is not None else [None] * len(hs)
            which = L.chunk_lanes(lanes, self.micro_batch, h.shape[0])
            blocks = [block if lane is None else lane.adapter.layers[i] for lane in which]
            carries = C.split(carry, split, len(hs))
            h = torch.cat([_drawn(b, lane, hc, rc, mc, cc) for b, lane, hc, rc, mc, cc in
                           zip(blocks, which, hs, ropes, masks, carries)])
            carry = C.join(carries)
            if reference is not None:
                with torch.no_grad():
                    carries = C.split(ref_carry, split, len(hs))
                    reference = torch.cat([_reference(b, r, rc, mc, cc) for b, r, rc, mc, cc in
                                           zip(blocks, split(reference), ropes, masks, carries)])
                    ref_carry = C.join(carries)
        return h if reference is None else (h, reference)

    def run_micro_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each (h, rope, token ids) micro-batch through every block, block by block (causal, no cache, no lanes):
        the layer-major inference of scoring (phantom.train.score), each micro-batch its own length; the ids start
        its carry (DeepSeek-V4's hashed layers route by them)."""
        hs, carries = [h for h, _, _ in batches], [C.start(self.store.cfg, ids) for _, _, ids in batches]
        for block in self.layers:
            hs = [block(h, rope, **({} if c is None else {"carry": c}))
                  for h, (_, rope, _), c in zip(hs, batches, carries)]
        return hs

    def block_groups(self) -> list[list[nn.Parameter]]:
        """The blocks' clipping groups in full mode: resident blocks are clipped with the rest, one group each."""
        return [list(block.parameters()) for block in self.layers]

    def finish_step(self) -> None:
        """Nothing runs beside a resident step."""

    def close(self) -> None:
        """Nothing to stop."""


def _drawn(block: nn.Module, lane: L.Lane | None, h: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None,
           carry: C.Carry = None):
    """block over one micro-batch (with its rows of the carried state, where there is one); a lane's dropout draws
    from its adapter's stream."""
    kw = {} if carry is None else {"carry": carry}
    if lane is None:
        return block(h, rope, mask=mask, **kw)
    with lane.adapter.rng_for():
        return block(h, rope, mask=mask, **kw)


def _reference(block: nn.Module, h: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None,
               carry: C.Carry = None) -> torch.Tensor:
    with lora_disabled(block):
        return block(h, rope, mask=mask, **({} if carry is None else {"carry": carry}))


class StreamedBlocks:
    """Blocks streamed by a BlockScheduler (tiers, slots, loader threads) and run by a BlockExecutor
    (weights bound while held; activations kept or recomputed); with `on_block_grads`, a trained
    block's gradients go there as soon as its backward is done (full finetuning)."""

    def __init__(self, layers: nn.ModuleList, scheduler: BlockScheduler, activations: Activations,
                 on_block_grads: Callable[[int, dict[str, torch.Tensor]], None] | None = None):
        self.layers, self.scheduler, self.store, self.device = layers, scheduler, scheduler.store, scheduler.device
        self.offload = scheduler.offload  # what "auto" resolved to
        keep_budget = activations.keep_budget if activations.keep_budget is not None else \
            default_keep_budget(self.device)
        self.executor = BlockExecutor(layers, scheduler, activations.recompute, keep_budget,
                                      activations.micro_batch, on_block_grads)

    def embed_table(self, dtype: torch.dtype, trained: bool) -> torch.Tensor:
        """On the device when it fits easily (no token round trip through the host), else in host memory
        (memory-mapped for a disk-tier model that does not train it)."""
        cfg = self.store.cfg
        nbytes = cfg.vocab_size * cfg.dim * dtype.itemsize
        if self.device.type == "cuda" and nbytes < free_device_bytes(self.device) // 8:
            return self.store.load_embed()["tok_embeddings.weight"].to(self.device, dtype)
        if self.offload == "disk" and not trained:
            return self.store.mmap_embed()
        return self.store.load_embed()["tok_embeddings.weight"].to(dtype)

    def __call__(self, h: torch.Tensor, rope: torch.Tensor, caches: list[KVCache] | None = None, start_pos: int = 0,
                 mask: torch.Tensor | None = None, reference: torch.Tensor | None = None,
                 lanes: list[L.Lane] | None = None, carry: C.Carry = None):
        """Every block over h on streamed weights (the executor's autograd reaches each block's LoRA, and
        each lane's adapter's); `carry` as ResidentBlocks'."""
        trained = [[p for n_, p in block.named_parameters() if "lora_" in n_] for block in self.layers]
        for lane in lanes or ():
            trained = [ps + lane.adapter.trained(i) for i, ps in enumerate(trained)]
        carry = C.start(self.store.cfg) if carry is None else carry
        return self.executor(h, rope, trained, caches, start_pos, mask, reference, lanes, carry)

    def run_micro_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each (h, rope, token ids) micro-batch through every block, each block loaded once for all of them (a wave
        of phantom.train.score reads the store once, however many requests it holds)."""
        ex, n, hs = self.executor, len(self.layers), [h for h, _, _ in batches]
        carries = [C.start(self.store.cfg, ids) for _, _, ids in batches]  # each one's own, set in place block by block
        self.scheduler.plan(list(range(n)), sum(h.shape[0] * h.shape[1] for h in hs))
        for i in range(n):
            with ex.block_weights(i), ex.first_pass(i):
                hs = ex.run_rows(i, [(h, rope, None, None, c) for h, (_, rope, _), c in zip(hs, batches, carries)])
        return hs

    def share(self, layers: nn.ModuleList) -> None:
        """Nothing: an adapter's blocks are bound to the streamed weights with the model's, per use."""

    def block_groups(self) -> list[list[nn.Parameter]]:
        """None: each streamed block is clipped as its gradients arrive (phantom.model.fullmode)."""
        return []

    def finish_step(self) -> None:
        """Wait for the step's block updates (full mode) and re-raise any error they hit."""
        self.scheduler.writeback.flush()

    def close(self) -> None:
        """Stop the scheduler's threads (and drain its write-back queue)."""
        self.scheduler.close()


def default_keep_budget(device: torch.device) -> int:
    """Bytes of kept activations under recompute "auto": half of what is free on the compute side."""
    if device.type == "cuda":
        return free_device_bytes(device) // 2
    free = free_host_bytes()  # this rank's share of the host
    return free // 2 if free is not None else 4 << 30
