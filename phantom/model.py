"""`PhantomModel`: a Llama whose blocks are streamed through the scheduler, trained with plain autograd.

Each streamed block is one autograd Function: its forward runs without a graph and keeps only the
block's input; its backward acquires the block again, recomputes it with the RNG state and autocast
of the forward, and returns the input and LoRA gradients. The head and loss are one chunked
Function that never holds the (B, T, vocab) logits. `offload="none"` is the same model resident on
the device with ordinary autograd: the reference. Imports config, layers, lora, store, scheduler.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.config import ModelConfig
from phantom.layers import TransformerBlock, fuse_adjacent, rms_norm, rope_table, KVCache
from phantom.lora import LoraConfig, apply_lora, load_adapter, save_adapter
from phantom.optim import AdamWConfig, BlockAdamW, clip_coefficient
from phantom.placement import Activations, Placement
from phantom.scheduler import BlockScheduler
from phantom.store import BlockStore, packed_empty

log = logging.getLogger(__name__)

MODES = ("lora", "full")
IGNORE_INDEX = -100


class RngState:
    """CPU (and CUDA) RNG state at a block's forward, replayed in its recompute so dropout matches."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class WeightHandles:
    """saved_tensors_hooks that keep activations but not weights.

    A tensor autograd saves that lives in the block's weight buffer (a weight, or a view of one) is
    packed as a handle (offset, shape, stride) into that buffer; in backward the block is acquired
    again and the handle is rebuilt on whatever slot now holds it. Everything else is kept as is.
    """

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.storage_ptr = next(iter(weights.values())).untyped_storage().data_ptr()
        self.storage = None
        self.kept_bytes = 0
        self.weight_handles = 0

    def bind(self, weights: dict[str, torch.Tensor] | None) -> None:
        self.storage = next(iter(weights.values())).untyped_storage() if weights else None

    def pack(self, t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() == self.storage_ptr:
            self.weight_handles += 1
            return (WeightHandles, t.dtype, t.storage_offset(), t.shape, t.stride())
        self.kept_bytes += t.numel() * t.element_size()
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and packed[0] is WeightHandles:
            _, dtype, offset, shape, stride = packed
            assert self.storage is not None, "weight handle used outside the block's backward"
            return torch.empty(0, dtype=dtype, device=self.storage.device).set_(self.storage, offset, shape, stride)
        return packed


class StreamedBlock(torch.autograd.Function):
    """One transformer block over a streamed weight slot.

    The batch is run in micro-batches of `model.micro_batch` rows while the block is on the device,
    forward and backward (layer-major accumulation): each block is loaded once per direction per
    step however many micro-batches the step has.

    Two policies for what lives between forward and backward (`model.keeps(i)`):
    - recompute: only the block's input; the backward acquires the block again and reruns its
      forward with the forward's RNG state and autocast (activation checkpointing).
    - keep: the autograd graph with its activations, but not the weights (see WeightHandles); the
      backward acquires the block again and only runs the backward: no forward compute twice.
    """

    @staticmethod
    def forward(ctx, x, rope, model: "PhantomModel", i: int, *params):
        ctx.model, ctx.i = model, i
        ctx.autocast = model.autocast_args()
        ctx.keep = model.keeps(i)
        ctx.rng = RngState(x.device) if model.has_dropout and not ctx.keep else None
        with model.block_weights(i) as weights:
            if not ctx.keep:
                out = torch.cat([model.run_block(i, weights, xc, rope) for xc in model.split_batch(x)])
                ctx.save_for_backward(x, rope, *params)
                return out
            ctx.hooks, ctx.graphs = WeightHandles(weights), []
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(ctx.hooks.pack, ctx.hooks.unpack):
                for xc in model.split_batch(x):
                    xc = xc.detach().requires_grad_(x.requires_grad)
                    ctx.graphs.append((xc, model.run_block(i, weights, xc, rope)))
        model.kept_bytes += ctx.hooks.kept_bytes
        model.kept_blocks += 1
        model.kept_per_block = max(model.kept_per_block, ctx.hooks.kept_bytes)
        model.weight_handles += ctx.hooks.weight_handles
        ctx.save_for_backward(*params)
        return torch.cat([out.detach() for _, out in ctx.graphs])

    @staticmethod
    def backward(ctx, grad_out):
        model, needs_x = ctx.model, ctx.needs_input_grad[0]
        saved = ctx.saved_tensors
        params = saved if ctx.keep else saved[2:]
        trained = [p for p in params if p.requires_grad]
        param_grads = [torch.zeros_like(p) for p in trained]
        x_grads = []
        rng = ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext()
        # The weights stay acquired until the gradients are computed: autograd reads them.
        with model.block_weights(ctx.i, trainable=model.full) as weights, rng:
            weight_grads = {k: torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                            for k, w in weights.items()} if model.full else {}
            trained_all = trained + list(weights.values()) if model.full else trained
            if ctx.keep:
                ctx.hooks.bind(weights)
                graphs = ctx.graphs
            else:
                x_chunks, rope = model.split_batch(saved[0]), saved[1]
                graphs = None
            for k, gc in enumerate(model.split_batch(grad_out)):
                if graphs is not None:
                    xc, out = graphs[k]
                else:
                    xc = x_chunks[k].detach().requires_grad_(needs_x)
                    with torch.enable_grad(), torch.autocast(**ctx.autocast):
                        out = model.run_block(ctx.i, weights, xc, rope)
                grads = torch.autograd.grad(out, ([xc] if needs_x else []) + trained_all, gc, allow_unused=True)
                if needs_x:
                    x_grads.append(grads[0])
                for acc, g in zip(param_grads + list(weight_grads.values()), grads[1:] if needs_x else grads):
                    if g is not None:
                        acc += g
            if ctx.keep:
                ctx.hooks.bind(None)
                ctx.graphs = None
        if model.full:  # the block's AdamW step runs on the write-back thread while backward goes on
            synced = model.grad_sync(list(weight_grads.values())) if model.grad_sync else None
            model.scheduler.writeback.submit(model.update_block, ctx.i, weight_grads, synced, name=f"update {ctx.i}")
        it = iter(param_grads)
        gparams = [next(it) if p.requires_grad else None for p in params]
        return (torch.cat(x_grads) if needs_x else None, None, None, None, *gparams)


class ChunkedHeadLoss(torch.autograd.Function):
    """Final norm + output projection + cross-entropy, a chunk of tokens at a time.

    The forward also computes the gradient with respect to the hidden states, chunk by chunk, so no
    (B, T, vocab) tensor ever exists and the head weight is used once per step. Targets equal to
    -100 are ignored; the loss is the mean over the rest (0 if every target is ignored).
    """

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int):
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        n_valid = (tf != IGNORE_INDEX).sum().clamp(min=1)
        wants = [ctx.needs_input_grad[0], norm_w.requires_grad, out_w.requires_grad]
        grads = [torch.zeros_like(hf) if wants[0] else None, torch.zeros_like(norm_w) if wants[1] else None,
                 torch.zeros_like(out_w) if wants[2] else None]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(wants[0])
            with torch.enable_grad():
                logits = F.linear(rms_norm(hc, norm_w, eps), out_w).float()  # (chunk, vocab)
                loss = F.cross_entropy(logits, tf[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
            if any(wants):
                inputs = [t for t, w in zip((hc, norm_w, out_w), wants) if w]
                gs = iter(torch.autograd.grad(loss, inputs))
                if wants[0]:
                    grads[0][s:s + chunk] = next(gs)
                for k in (1, 2):
                    if wants[k]:
                        grads[k] += next(gs)
            total += loss.detach()
        ctx.save_for_backward(*(g / n_valid if g is not None else None for g in grads))
        ctx.h_shape = h.shape
        return total / n_valid

    @staticmethod
    def backward(ctx, g):
        gh, gn, go = ctx.saved_tensors
        return (gh.view(ctx.h_shape) * g if gh is not None else None, gn * g if gn is not None else None,
                go * g if go is not None else None, None, None, None)


class PhantomModel(nn.Module):
    """A Llama model whose transformer blocks live in a block store and are streamed to `device`.

    Build it with `phantom.load(...)`. Parameters that train (LoRA A/B) are ordinary nn.Parameters
    of this module; base weights of streamed blocks are meta placeholders filled per use.

    Args:
        store: the block store.
        device: where compute runs.
        offload: "none" (all weights on the device, plain autograd; the reference), "ram" or "disk"
            (blocks streamed by a BlockScheduler from host memory or from the files).
        dtype: compute dtype; fp32 runs exactly, bf16/fp16 run blocks and head under autocast.
        lora: the LoRA to apply, or None for a frozen model (inference).
        prefetch: blocks read/copied ahead of the one computing (streamed modes).
        resident: blocks kept on the device in streamed modes.
        recompute: "all" reruns each block's forward in backward (keeps only block inputs);
            "none" keeps each block's activations (not its weights) and skips the rerun; "auto"
            keeps as many blocks as fit `keep_budget` bytes and recomputes the rest.
        keep_budget: bytes of kept activations allowed under "auto" (default: half the memory
            available on the device's side: host RAM on CPU, free device memory on CUDA).
        checkpoint_inner: also checkpoint attention and MLP separately inside each block, so a
            block's backward holds one of them at a time (long sequences; costs one more forward).
        micro_batch: rows of the batch run through a block at once (None: the whole batch). A batch
            of K * micro_batch rows is gradient accumulation over K micro-batches, layer-major.
        loss_chunk: tokens per chunk of the fused head + loss (default: ~64 MB of fp32 logits).
        trace: record a Chrome trace in the scheduler.
        mode: "lora" trains the LoRA parameters only; "full" trains every weight. In streamed full
            mode each block's AdamW step runs as soon as its backward is done (BlockAdamW, on the
            write-back thread) and the updated block is written back to the store (the disk tier)
            or to host RAM; head and embedding are ordinary parameters for the caller's optimizer.
            The store is modified: open a working copy (phantom.load(..., work_dir=...) does).
        optim: the block optimizer's hyper-parameters (full mode, streamed).
        optim_dir: where the block optimizer's state lives for the disk tier (offload="disk").
        shared_ram: map the RAM tier from the store files, shared by all local processes (LoRA only).
        compile: torch.compile the block once for every layer (weights are graph inputs, swapped
            per use, so one compiled graph serves all blocks); falls back to eager with a warning.
    """

    def __init__(self, store: BlockStore, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 placement: Placement = Placement(), activations: Activations = Activations(),
                 lora: LoraConfig | None = LoraConfig(), mode: str = "lora", optim: AdamWConfig | None = None,
                 optim_dir: Path | None = None, trace: bool = False):
        super().__init__()
        self.cfg: ModelConfig = store.cfg
        self.store, self.device, self.dtype, self.lora_cfg = store, torch.device(device), dtype, lora
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.full = mode == "full"
        if self.full and lora is not None:
            raise ValueError("full finetuning trains every weight: pass lora=None with mode='full'")
        if self.full and activations.recompute == "none":
            raise ValueError("full finetuning needs recompute='all' (kept graphs hold no path to the weights)")
        if self.full and activations.recompute == "auto":
            activations = dataclasses.replace(activations, recompute="all")
        if activations.compile is None:  # the largest single speed-up measured on CUDA; slow to build elsewhere
            activations = dataclasses.replace(activations, compile=self.device.type == "cuda")
        if placement.shared_ram and self.full:
            raise ValueError("shared_ram is read-only: full finetuning needs private RAM blocks")
        self.placement, self.activations = placement, activations
        self.amp = dtype != torch.float32
        # Slots hold the compute dtype: fp32 runs get lower-precision stores upcast in the prefetch
        # pipeline (never on the compute thread); AMP runs use the stored weights as they are.
        self.weight_dtype = torch.float32 if not self.amp else store.dtype
        self.micro_batch = activations.micro_batch
        self.recompute = activations.recompute
        self.keep_budget = activations.keep_budget if activations.keep_budget is not None else \
            default_keep_budget(self.device)
        self.kept_bytes = 0  # activations kept by `keep` blocks in the current step
        self.kept_blocks = 0
        self.kept_per_block = 0  # the most one block kept (the estimate for "auto")
        self.weight_handles = 0  # weights saved by autograd as handles, not tensors (for tests)
        self.loss_chunk = activations.loss_chunk or default_loss_chunk(self.cfg.vocab_size, self.device)

        self.layers = nn.ModuleList(TransformerBlock(self.cfg, device="meta", dtype=self.weight_dtype)
                                    for _ in range(self.cfg.n_layers))
        for p in self.layers.parameters():
            p.requires_grad_(False)
        if lora is not None:
            for i, block in enumerate(self.layers):
                apply_lora(block, lora, i)
        self.has_dropout = lora is not None and lora.dropout > 0
        for block in self.layers:
            block.checkpoint_inner = activations.checkpoint_inner
            if activations.compile:
                block.compile()
        self._compile_checked = not activations.compile
        for name, p in self.layers.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(self.device)  # fp32 master weights on the device

        head = store.load_head()
        head_dtype = torch.float32 if self.full else self.weight_dtype  # trained ones keep fp32 masters
        self.norm_weight = nn.Parameter(head["norm.weight"].to(self.device, head_dtype), requires_grad=self.full)
        self.output_weight = nn.Parameter(head["output.weight"].to(self.device, head_dtype),
                                          requires_grad=self.full)
        self.register_buffer("rope", rope_table(self.cfg, self.cfg.max_seq_len, self.device), persistent=False)

        self.scheduler: BlockScheduler | None = None
        self.block_optimizer: BlockAdamW | None = None
        # data parallel, full mode: grads -> a function that waits for their average (phantom.dist)
        self.grad_sync = None
        self.offload = placement.offload
        if placement.offload == "none":
            self.embed_table = store.load_embed()["tok_embeddings.weight"].to(self.device, head_dtype)
            for i, block in enumerate(self.layers):
                stored = store.load_block(i)
                weights = packed_empty(stored, self.weight_dtype, self.device)  # the file's layout
                for k, v in stored.items():
                    weights[k].copy_(v)
                if self.full:
                    weights = {k: v.clone() for k, v in weights.items()}  # trained one by one
                block.load_state_dict(weights, strict=False, assign=True)  # keeps requires_grad=False
                for name, p in block.named_parameters():
                    p.requires_grad_(self.full or "lora_" in name)
                if not self.full:  # frozen: the same fused projections as the streamed blocks
                    for name, view in fuse_adjacent(weights).items():
                        if name not in weights:
                            owner, _, leaf = name.rpartition(".")
                            block.get_submodule(owner)._parameters[leaf] = nn.Parameter(view, requires_grad=False)
        else:
            self.scheduler = BlockScheduler(store, self.device, placement, trace=trace, dtype=self.weight_dtype)
            self.offload = self.scheduler.offload  # what "auto" resolved to
            self.embed_table = self._place_embed(head_dtype)
            if self.full:
                share = {i: self.cfg.block_params() / self.cfg.n_params() for i in range(self.cfg.n_layers)}
                tier = "disk" if "disk" in self.scheduler.tiers else "ram"
                self.block_optimizer = BlockAdamW(optim or AdamWConfig(), share, tier, optim_dir)
        if self.full:
            self.embed_table = nn.Parameter(self.embed_table)

    def _place_embed(self, dtype: torch.dtype) -> torch.Tensor:
        """The embedding table for a streamed model: on the device when it fits easily (no token
        round trip through the host), else in host memory (memory-mapped for a disk-tier model)."""
        nbytes = self.cfg.vocab_size * self.cfg.dim * dtype.itemsize
        if self.device.type == "cuda" and nbytes < torch.cuda.mem_get_info(self.device)[0] // 8:
            return self.store.load_embed()["tok_embeddings.weight"].to(self.device, dtype)
        if self.offload == "disk" and not self.full:
            return self.store.mmap_embed()
        return self.store.load_embed()["tok_embeddings.weight"].to(dtype)

    # -- public API ----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) in fp32, or with targets the mean cross-entropy (a scalar)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        if self.full and self.scheduler is not None:
            self.finish_step()  # the previous step's block updates must land before blocks are read
        h = self.embed(tokens)
        rope = self.rope[:T]
        with torch.autocast(**self.autocast_args()):
            h = self.blocks(h, rope)
            if targets is None:
                return F.linear(rms_norm(h, self.norm_weight, self.cfg.norm_eps), self.output_weight).float()
            if targets.shape != tokens.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} differs from tokens {tuple(tokens.shape)}")
            return ChunkedHeadLoss.apply(h, self.norm_weight, self.output_weight, targets.to(self.device),
                                         self.cfg.norm_eps, self.loss_chunk)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the caller's optimizer updates: LoRA parameters, or in full mode everything that is
        not a streamed block (those are updated inside backward by `block_optimizer`)."""
        return [p for p in self.parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip gradients: globally for LoRA; in full mode per block with the documented rule
        (phantom.optim: each group to max_norm * sqrt(its share of the parameters))."""
        if not self.full:
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
            return
        n = self.cfg.n_params()
        groups = [[self.embed_table, self.norm_weight, self.output_weight]]
        if self.scheduler is None:  # resident reference: the blocks' groups are clipped here too
            groups += [list(block.parameters()) for block in self.layers]
        for group in groups:
            share = sum(p.numel() for p in group) / n
            coef = clip_coefficient([p.grad for p in group if p.grad is not None], max_norm, share)
            for p in group:
                if p.grad is not None and coef < 1.0:
                    p.grad.mul_(coef)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the block optimizer (full mode) for the next backward."""
        if self.block_optimizer is not None:
            self.block_optimizer.lr = lr

    def finish_step(self) -> None:
        """Wait for this step's block updates (full mode) and re-raise any error they hit."""
        if self.scheduler is not None:
            self.scheduler.writeback.flush()

    def update_block(self, i: int, grads: dict[str, torch.Tensor], synced=None) -> None:
        """Block i's optimizer step (write-back thread): new weights to host RAM, or to the store.

        `synced`, if given, waits for the data-parallel reduction of these gradients started by
        `grad_sync` in the backward, so the all-reduce of block i overlaps the backward of i-1."""
        if synced is not None:
            synced()
        new = self.block_optimizer.step_block(i, lambda: self.scheduler.host_weights(i), grads)
        self.scheduler.update_block(i, new)
        if self.scheduler.tiers[i] != "ram":  # RAM-tier blocks are written by save_full
            self.store.write_block(i, new)

    def save_full(self) -> None:
        """Make the store hold the trained model (full mode): head, embedding, and RAM-tier blocks."""
        if not self.full or self.scheduler is None:
            raise ValueError("save_full is for streamed full finetuning")
        self.finish_step()
        self.store.write_head({"norm.weight": self.norm_weight.detach(), "output.weight": self.output_weight.detach()})
        self.store.write_embed({"tok_embeddings.weight": self.embed_table.detach()})
        for i, tier in enumerate(self.scheduler.tiers):
            if tier == "ram":
                self.store.write_block(i, self.scheduler.host_weights(i))
        if self.block_optimizer.state_dir is not None:
            self.block_optimizer.save(self.block_optimizer.state_dir)  # the RAM tier's state, to files

    def save_adapter(self, out: Path | str, base_model: str = "") -> Path:
        if self.lora_cfg is None:
            raise ValueError("this model has no LoRA to save")
        return save_adapter(self.layers, self.cfg, self.lora_cfg, Path(out), base_model or str(self.store.path))

    def load_adapter(self, path: Path | str) -> None:
        load_adapter(self.layers, self.cfg, Path(path))

    def close(self) -> None:
        """Stop the scheduler's threads (and drain its write-back queue)."""
        if self.scheduler is not None:
            self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- pieces --------------------------------------------------------------------------------

    def keeps(self, i: int) -> bool:
        """Whether block i keeps its activations this step (else it is recomputed in backward)."""
        if self.recompute != "auto":
            return self.recompute == "none"
        return self.kept_bytes + self.kept_per_block <= self.keep_budget

    def split_batch(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.split(self.micro_batch) if self.micro_batch else (x,)

    def autocast_args(self) -> dict:
        return dict(device_type=self.device.type, dtype=self.dtype if self.amp else torch.bfloat16,
                    enabled=self.amp)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_table
        if tokens.device.type == "cpu":  # checked before the upload: no device sync for it
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got [{lo}, {hi}]")
        h = F.embedding(tokens.to(table.device, non_blocking=True), table)  # (B, T, dim)
        return h.to(self.device, self.weight_dtype, non_blocking=True)

    def blocks(self, h: torch.Tensor, rope: torch.Tensor, caches: list[KVCache] | None = None,
               start_pos: int = 0) -> torch.Tensor:
        if self.scheduler is None:
            for i, block in enumerate(self.layers):
                h = torch.cat([block(hc, rope, caches[i] if caches else None, start_pos)
                               for hc in self.split_batch(h)]) if caches is None else block(h, rope, caches[i], start_pos)
            return h
        n = self.cfg.n_layers
        self.kept_bytes = self.kept_blocks = 0
        lora_params = [[p for n_, p in block.named_parameters() if "lora_" in n_] for block in self.layers]
        training = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for ps in lora_params for p in ps))
        self.scheduler.plan(list(range(n)) + (list(range(n - 1, -1, -1)) if training else []))
        for i in range(n):
            if training:
                h = StreamedBlock.apply(h, rope, self, i, *lora_params[i])
            else:
                with self.block_weights(i) as weights:
                    h = self.run_block(i, weights, h, rope, caches[i] if caches else None, start_pos)
        return h

    @contextlib.contextmanager
    def block_weights(self, i: int, trainable: bool = False):
        """Block i's streamed weights acquired and bound into self.layers[i] until the `with` ends.

        Binding swaps the meta placeholders for the slot's tensor views (no copy, no new module);
        autograd may read them until the `with` ends, so backward passes run inside it.
        """
        weights = self.scheduler.acquire(i)
        t0 = time.perf_counter()
        try:
            assert next(iter(weights.values())).dtype == self.weight_dtype, "the scheduler converts dtypes"
            if trainable:  # leaves whose gradients the backward asks for (full finetuning)
                weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
            elif not self.full:
                weights = fuse_adjacent(weights)
            with bind_weights(self.layers[i], weights):
                yield weights
        finally:
            self.scheduler.tracer.span("compute", f"block {i}", t0, time.perf_counter())  # the time it is held
            self.scheduler.release(i)

    def run_block(self, i: int, weights: dict[str, torch.Tensor], x: torch.Tensor, rope: torch.Tensor,
                  cache: KVCache | None = None, start_pos: int = 0) -> torch.Tensor:
        """Block i over x; its base weights are bound by block_weights(i)."""
        if self._compile_checked:
            return self.layers[i](x, rope, cache, start_pos)
        try:  # the first call compiles: fall back to eager if the backend cannot
            out = self.layers[i](x, rope, cache, start_pos)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly
            log.warning("torch.compile failed (%s: %s); running blocks eagerly", type(e).__name__, str(e)[:200])
            for block in self.layers:
                block._compiled_call_impl = None
            out = self.layers[i](x, rope, cache, start_pos)
        self._compile_checked = True
        return out


@contextlib.contextmanager
def bind_weights(module: nn.Module, weights: dict[str, torch.Tensor]):
    """Temporarily make module's parameters named in weights be those tensors (views into a slot)."""
    saved = []
    try:
        for name, t in weights.items():
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner)
            saved.append((sub, leaf, sub._parameters[leaf]))
            sub._parameters[leaf] = t
        yield
    finally:
        for sub, leaf, old in reversed(saved):
            sub._parameters[leaf] = old


def default_loss_chunk(vocab_size: int, device: torch.device) -> int:
    """Tokens per chunk of the fused head + loss: ~64 MB of fp32 logits on a CPU; on CUDA an eighth
    of free memory (at most 2 GB), so a 128k vocabulary runs a few large matmuls, not hundreds of thin ones."""
    budget = 64 << 20
    if device.type == "cuda":
        budget = max(budget, min(2 << 30, torch.cuda.mem_get_info(device)[0] // 8))
    return max(16, budget // (4 * vocab_size))


def default_keep_budget(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return 4 << 30
