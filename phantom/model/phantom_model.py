"""`PhantomModel`: a Llama (embedding, blocks, final norm, head) whose blocks may live off the device.

With `offload="none"` it is an ordinary resident model trained by plain autograd: the reference.
Otherwise its blocks hold meta placeholders and a BlockExecutor (phantom.stream.executor) runs them on
weights streamed by a BlockScheduler; full finetuning hands each block's gradients to the block
optimizer as soon as the executor has them. The head and loss are one chunked Function that never
holds the (B, T, vocab) logits.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.base import provenance
from phantom.arch.config import ModelConfig, head_tensor_shapes
from phantom.stream.executor import BlockExecutor
from phantom.arch.layers import TransformerBlock, fuse_adjacent, longest_example, lora_disabled, packed_layout, rms_norm, \
    rope_table, softcap, KVCache
from phantom.model.lora import LoraConfig, apply_lora, for_family, load_adapter, save_adapter
from phantom.stream.optim import AdamWConfig, BlockAdamW, FullFinetune, HostGradients, clip_coefficient, state_tier
from phantom.stream.placement import LOSS_BYTES_PER_LOGIT, Activations, Placement, loss_budget
from phantom.stream.hostmem import HostBuffer
from phantom.stream.memory import free_device_bytes, free_host_bytes
from phantom.arch.moe import RouterLoss
from phantom.stream.scheduler import BlockScheduler
from phantom.files.store import BlockStore
from phantom.files.tensorfile import packed_empty

MODES = ("lora", "full")
IGNORE_INDEX = -100


class ChunkedHeadLoss(torch.autograd.Function):
    """Final norm + output projection + cross-entropy, a chunk of tokens at a time.

    The forward also computes the gradient with respect to the hidden states, chunk by chunk, so no
    (B, T, vocab) tensor ever exists and the head weight is used once per step. Targets equal to
    -100 are ignored; the loss is the mean over the rest (0 if every target is ignored).
    """

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int, *head):
        norm_offset, cap = head + (0.0, None)[len(head):]  # optional: the final norm's offset, the logits' soft-cap
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        n_valid = (tf != IGNORE_INDEX).sum().clamp(min=1)
        wants = [ctx.needs_input_grad[0], norm_w.requires_grad, out_w.requires_grad]
        grads = [torch.zeros_like(hf) if wants[0] else None, torch.zeros_like(norm_w) if wants[1] else None,
                 torch.zeros_like(out_w) if wants[2] else None]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(wants[0])
            with torch.enable_grad():
                logits = softcap(F.linear(rms_norm(hc, norm_w, eps, norm_offset), out_w).float(), cap)  # (chunk, vocab)
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
        ctx.n_args = 6 + len(head)  # backward answers each argument apply was given
        return total / n_valid

    @staticmethod
    def backward(ctx, g):
        gh, gn, go = ctx.saved_tensors
        grads = (gh.view(ctx.h_shape) * g if gh is not None else None, gn * g if gn is not None else None,
                 go * g if go is not None else None)
        return grads + (None,) * (ctx.n_args - 3)


class ChunkedHeadLogps(torch.autograd.Function):
    """Final norm + output projection + each row's summed log-probability of its targets (-100
    ignored): (B,) fp32, a chunk of tokens at a time, as ChunkedHeadLoss (no (B, T, vocab) tensor).

    The forward computes each token's gradient of its own row's sum with respect to h; the backward
    scales it by that row's upstream gradient, which is exact since a token belongs to one row. Norm
    and head weights are frozen here (LoRA): sequence scores are for preference training.
    """

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int, norm_offset: float = 0.0,
                cap: float | None = None):
        if norm_w.requires_grad or out_w.requires_grad:
            raise ValueError("sequence log-probabilities need a frozen head (train a LoRA, not --mode full)")
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        token_logps = torch.zeros(tf.shape, dtype=torch.float32, device=h.device)
        grad = torch.zeros_like(hf) if ctx.needs_input_grad[0] else None
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                logits = softcap(F.linear(rms_norm(hc, norm_w, eps, norm_offset), out_w).float(), cap)  # (chunk, vocab)
                lp = -F.cross_entropy(logits, tf[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="none")
                total = lp.sum()
            if grad is not None:
                grad[s:s + chunk] = torch.autograd.grad(total, hc)[0]
            token_logps[s:s + chunk] = lp.detach()
        ctx.save_for_backward(grad)
        ctx.shape = targets.shape
        return token_logps.view(ctx.shape).sum(1)  # per row, in a fixed order (deterministic)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        B, T = ctx.shape
        gh = grad.view(B, T, -1) * g.view(B, 1, 1).to(grad.dtype)
        return gh, None, None, None, None, None, None, None


class PhantomModel(nn.Module):
    """A Llama model whose transformer blocks live in a block store and are streamed to `device`.

    Build it with `phantom.load(...)`. Parameters that train (LoRA A/B) are ordinary nn.Parameters
    of this module; base weights of streamed blocks are meta placeholders filled per use.

    Args:
        store: the block store. Streamed full finetuning rewrites it: pass a working copy
            (`phantom.load(..., work_dir=...)` makes one); the block optimizer's state lives beside
            it, in the folder `optim` next to the store's.
        device: where compute runs.
        dtype: compute dtype; fp32 runs exactly, bf16/fp16 run blocks and head under autocast.
        placement: where blocks live and how they stream (phantom.Placement; offload "none" is the
            resident model trained by plain autograd: the reference).
        activations: what blocks keep for backward and how they run (phantom.Activations).
        lora: the LoRA to train, or None (a frozen model, or full finetuning).
        optim: None trains what `lora` adds; an AdamWConfig trains every weight (full finetuning,
            `lora` must be None). Streamed blocks are then updated as soon as their backward is done
            (BlockAdamW on the write-back thread) and written back to the store or host RAM; head
            and embedding, and a resident model's blocks, are ordinary parameters for the caller's
            optimizer.
        trace: record a Chrome trace in the scheduler.
    """

    def __init__(self, store: BlockStore, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 placement: Placement = Placement(), activations: Activations = Activations(),
                 lora: LoraConfig | None = LoraConfig(), optim: AdamWConfig | None = None, trace: bool = False):
        super().__init__()
        self.cfg: ModelConfig = store.cfg
        self.store, self.device, self.dtype = store, torch.device(device), dtype
        self.lora_cfg = None if lora is None else for_family(lora, store.cfg)  # targets as the family's modules
        self.full = optim is not None
        activations = self._check(placement, activations)
        self.placement, self.activations = placement, activations
        self.amp = dtype != torch.float32
        # Slots hold the compute dtype: a store in another dtype is converted once per load in the
        # prefetch pipeline (never on the compute thread). Left to autocast, every weight would be cast
        # at every use, and with recompute="none" autograd would keep the cast copies (kept blocks
        # holding their weights); an fp16 store at bf16 would also promote the hidden state to fp32.
        self.weight_dtype = dtype
        self.micro_batch = activations.micro_batch
        self.loss_chunk = activations.loss_chunk or default_loss_chunk(self.cfg.vocab_size, self.device)
        self.layers = self._build_layers(activations)

        head = store.load_head()
        head_dtype = torch.float32 if self.full else self.weight_dtype  # trained ones keep fp32 masters
        self.norm_weight = nn.Parameter(head["norm.weight"].to(self.device, head_dtype), requires_grad=self.full)
        if self.cfg.tie_embeddings:  # the head is the embedding table: one tensor, one parameter
            head["output.weight"] = store.load_embed()["tok_embeddings.weight"]
        self.output_weight = nn.Parameter(head["output.weight"].to(self.device, head_dtype),
                                          requires_grad=self.full)
        self.register_buffer("rope", rope_table(self.cfg, self.cfg.max_seq_len, self.device), persistent=False)
        longrope = self.cfg.rope_scaling is not None and self.cfg.rope_scaling.rope_type == "longrope"
        self.register_buffer("rope_long", rope_table(self.cfg, self.cfg.max_seq_len, self.device, long=True)
                             if longrope else None, persistent=False)

        self.scheduler: BlockScheduler | None = None
        self.executor: BlockExecutor | None = None
        self.block_optimizer: BlockAdamW | None = None
        self.full_ft: FullFinetune | None = None  # streamed full finetuning: the blocks' updates
        # data parallel, full mode: grads -> a function that waits for their average (phantom.train.dist)
        self.grad_sync = None
        self.offload = placement.offload
        if placement.offload == "none":
            if not self.cfg.tie_embeddings:
                self.embed_table = store.load_embed()["tok_embeddings.weight"].to(self.device, head_dtype)
            self._load_resident_blocks()
        else:
            self.scheduler = BlockScheduler(store, self.device, placement, trace=trace, dtype=self.weight_dtype,
                                            device_reserve=self.device_reserve())
            try:  # a failed setup stops the loader threads (and frees the pinned memory they hold)
                self._stream(activations, optim, head_dtype)
            except BaseException:
                self.scheduler.close()
                raise
        if self.cfg.tie_embeddings:
            self.embed_table = self.output_weight  # one parameter: trained once, by both uses' gradients
        elif self.full:
            self.embed_table = nn.Parameter(self.embed_table)

    def _stream(self, activations: Activations, optim: AdamWConfig | None, head_dtype: torch.dtype) -> None:
        """The streamed model's parts beside its scheduler: embedding, executor, block optimizer."""
        self.offload = self.scheduler.offload  # what "auto" resolved to
        if not self.cfg.tie_embeddings:
            self.embed_table = self._place_embed(head_dtype)
        keep_budget = activations.keep_budget if activations.keep_budget is not None else \
            default_keep_budget(self.device)
        self.executor = BlockExecutor(self.layers, self.scheduler, activations.recompute, keep_budget,
                                      activations.micro_batch, self._on_block_grads if self.full else None)
        if self.full:
            self.full_ft = self._full_finetune(optim, self.store.path.parent / "optim")
            self.block_optimizer = self.full_ft.optimizer

    def _check(self, placement: Placement, activations: Activations) -> Activations:
        """Refuse what cannot work together; resolve the activation choices that depend on the run."""
        if self.full and self.store.quant is not None:
            raise ValueError(f"{self.store.path}: a {self.store.quant.method} store is frozen: full finetuning needs the "
                             f"16-bit weights (prepare the store without --quantize), or train LoRA on this one")
        if self.full and self.lora_cfg is not None:
            raise ValueError("full finetuning trains every weight: pass lora=None with an optim config")
        if self.full and activations.recompute == "none":
            raise ValueError("full finetuning needs recompute='all' (kept graphs hold no path to the weights)")
        if self.full and activations.recompute == "auto":
            activations = dataclasses.replace(activations, recompute="all")
        if activations.compile is None:  # the largest single speed-up measured on CUDA; slow to build elsewhere
            activations = dataclasses.replace(activations, compile=self.device.type == "cuda")
        if placement.shared_ram and self.full:
            raise ValueError("shared_ram is read-only: full finetuning needs private RAM blocks")
        return activations

    def device_reserve(self) -> int:
        """Device bytes this model needs beside blocks and activations, kept out of the blocks' budget:
        one loss chunk at its peak; in full mode also the head's three fp32 head-sized buffers
        (ChunkedHeadLoss: its gradient, one chunk's, the scaled copy it saves) and the fp32 gradients
        of the two blocks in flight (the one updating, the one the backward produces)."""
        if self.device.type != "cuda":
            return 0
        reserve = self.loss_chunk * LOSS_BYTES_PER_LOGIT * self.cfg.vocab_size
        if self.full:
            reserve += 3 * 4 * self.cfg.vocab_size * self.cfg.dim + 2 * 4 * self.cfg.block_params()
        return reserve

    def _build_layers(self, activations: Activations) -> nn.ModuleList:
        """The blocks, base weights as meta placeholders (frozen unless full), LoRA applied."""
        layers = nn.ModuleList(TransformerBlock(self.cfg, device="meta", dtype=self.weight_dtype, layer=i)
                               for i in range(self.cfg.n_layers))
        for p in layers.parameters():
            p.requires_grad_(False)
        for i, block in enumerate(layers):
            if self.lora_cfg is not None:
                apply_lora(block, self.lora_cfg, i)
            block.checkpoint_inner = activations.checkpoint_inner
            if activations.compile:
                block.compile()
        for name, p in layers.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(self.device)  # fp32 master weights on the device
        return layers

    def _load_resident_blocks(self) -> None:
        """offload="none": every block's weights on the device, in the file's layout (so frozen
        blocks run the same fused projections as streamed ones); separate tensors when trained."""
        for block_index, block in enumerate(self.layers):
            stored = self.store.load_block(block_index, self.weight_dtype)  # quantized: dequantized into it
            weights = packed_empty(stored, self.weight_dtype, self.device)
            for k, v in stored.items():
                weights[k].copy_(v)
            if self.full:
                weights = {k: v.clone() for k, v in weights.items()}
            block.load_state_dict(weights, strict=False, assign=True)  # keeps requires_grad=False
            for name, p in block.named_parameters():
                p.requires_grad_(self.full or "lora_" in name)
            if not self.full:
                for name, view in fuse_adjacent(weights).items():
                    if name not in weights:
                        owner, _, leaf = name.rpartition(".")
                        block.get_submodule(owner).register_parameter(leaf, nn.Parameter(view, requires_grad=False))

    def _full_finetune(self, optim: AdamWConfig, optim_dir: Path) -> FullFinetune:
        """The blocks' optimizer (state where optim.state says, phantom.stream.optim.state_tier) and the
        component that runs their updates beside the backward."""
        share = {i: self.cfg.block_params() / self.cfg.n_params() for i in range(self.cfg.n_layers)}
        state_bytes = 12 * self.cfg.block_params() * self.cfg.n_layers
        tier = state_tier(optim.state, self.device, state_bytes, free_device_bytes(self.device), free_host_bytes())
        optimizer = BlockAdamW(optim, share, tier, optim_dir, self.device)
        host_grads = None
        if self.device.type == "cuda" and tier != "device":  # gradients to pinned host buffers, own stream
            host_grads = HostGradients(self.device, lambda n: HostBuffer(n, pin=True))
        return FullFinetune(optimizer, self.scheduler, self.store, host_grads)

    def _on_block_grads(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        """Full mode: block i's AdamW step runs on the write-back thread while backward goes on."""
        self.full_ft.on_block_grads(i, grads, self.grad_sync)

    def _place_embed(self, dtype: torch.dtype) -> torch.Tensor:
        """The embedding table for a streamed model: on the device when it fits easily (no token
        round trip through the host), else in host memory (memory-mapped for a disk-tier model)."""
        nbytes = self.cfg.vocab_size * self.cfg.dim * dtype.itemsize
        if self.device.type == "cuda" and nbytes < free_device_bytes(self.device) // 8:
            return self.store.load_embed()["tok_embeddings.weight"].to(self.device, dtype)
        if self.offload == "disk" and not self.full:
            return self.store.mmap_embed()
        return self.store.load_embed()["tok_embeddings.weight"].to(dtype)

    # -- public API ----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) in fp32, or with targets the mean cross-entropy (a scalar).

        Tokens and targets may be on the host (pinned: their uploads overlap) or the device.
        segments: (B, T) example ids of packed rows (phantom.data.batches.Packed): each example attends only to
        itself and its positions start at 0, so a packed row computes what its examples do alone."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        if self.full and self.scheduler is not None:
            self.finish_step()  # the previous step's block updates must land before blocks are read
        h = self.embed(tokens)
        rope, mask = self.rope_for(T)[:T], None
        if segments is not None:
            segments = segments.to(self.device)
            rope, mask = packed_layout(self.rope_for(longest_example(segments) if self.rope_long is not None else T),
                                       segments)
        router = RouterLoss.attach(self.layers, self.cfg, self.device, on=self.full and targets is not None)
        with torch.autocast(**self.autocast_args()):
            h = self.blocks(h, rope, mask=mask)
            if targets is None:
                return self.logits(h)
            if targets.shape != tokens.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} differs from tokens {tuple(tokens.shape)}")
            targets = targets.to(self.device, non_blocking=targets.device.type == "cpu")
            loss = ChunkedHeadLoss.apply(h, self.norm_weight, self.output_weight, targets, self.cfg.norm_eps,
                                         self.loss_chunk, self.cfg.norm_offset, self.cfg.final_softcap)
            return loss if router is None else loss + router.term(h)  # full MoE finetuning: the routers' balance

    def sequence_logps(self, tokens: torch.Tensor, targets: torch.Tensor,
                       reference: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's summed log-probability of its targets (-100 ignored): (B,) fp32, with autograd
        to the LoRA weights. With `reference`, also the base model's (adapters off, no autograd) as
        the second value (else None): each block runs both while it is loaded, so the store is read
        exactly as for the policy alone."""
        if tokens.dim() != 2 or targets.shape != tokens.shape:
            raise ValueError(f"tokens and targets must be (batch, seq_len) alike, got {tuple(tokens.shape)} and "
                             f"{tuple(targets.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len "
                             f"{self.cfg.max_seq_len}")
        if self.full:
            raise ValueError("sequence log-probabilities are for LoRA training (the reference is the base model)")
        h = self.embed(tokens)
        rope = self.rope_for(tokens.shape[1])[:tokens.shape[1]]
        head = (self.norm_weight, self.output_weight, targets.to(self.device), self.cfg.norm_eps, self.loss_chunk,
                self.cfg.norm_offset, self.cfg.final_softcap)
        with torch.autocast(**self.autocast_args()):
            out = self.blocks(h, rope, reference=h.detach() if reference else None)
            h, h_ref = out if reference else (out, None)
            logps = ChunkedHeadLogps.apply(h, *head)
            if h_ref is None:
                return logps, None
            with torch.no_grad():
                return logps, ChunkedHeadLogps.apply(h_ref, *head)

    def rope_for(self, positions: int) -> torch.Tensor:
        """The RoPE table of a forward over positions 0 .. positions-1: longrope's long one past its
        original context (as transformers picks it by the batch's last position), else `rope`."""
        s = self.cfg.rope_scaling
        if self.rope_long is not None and positions > s.original_max_seq_len:
            return self.rope_long
        return self.rope

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the caller's optimizer updates: LoRA parameters, or in full mode everything that is
        not a streamed block (those are updated inside backward by `block_optimizer`)."""
        return [p for p in self.parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip gradients: globally for LoRA; in full mode per block with the documented rule
        (phantom.stream.optim: each group to max_norm * sqrt(its share of the parameters))."""
        if not self.full:
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
            return
        n = self.cfg.n_params()
        groups = [list({id(p): p for p in (self.embed_table, self.norm_weight, self.output_weight)}.values())]
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

    def save_full(self) -> None:
        """Make the store hold the trained model (full mode): head, embedding, and RAM-tier blocks."""
        if not self.full or self.scheduler is None:
            raise ValueError("save_full is for streamed full finetuning")
        self.full_ft.save()  # blocks and their optimizer state
        head = {"norm.weight": self.norm_weight.detach(), "output.weight": self.output_weight.detach()}
        self.store.write_head({k: v for k, v in head.items() if k in head_tensor_shapes(self.cfg)})
        self.store.write_embed({"tok_embeddings.weight": self.embed_table.detach()})

    def save_adapter(self, out: Path | str, base_model: str = "") -> Path:
        if self.lora_cfg is None:
            raise ValueError("this model has no LoRA to save")
        base, revision = (base_model, None) if base_model else provenance.base_model(self.store.manifest,
                                                                                      self.store.path)
        return save_adapter(self.layers, self.cfg, self.lora_cfg, Path(out), base, revision)

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

    def autocast_args(self) -> dict:
        return dict(device_type=self.device.type, dtype=self.dtype if self.amp else torch.bfloat16,
                    enabled=self.amp)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and soft-cap of hidden states h (..., dim): fp32 logits."""
        cfg = self.cfg
        normed = rms_norm(h, self.norm_weight, cfg.norm_eps, cfg.norm_offset)
        return softcap(F.linear(normed, self.output_weight).float(), cfg.final_softcap)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, dim) on the device. Pass host ids (the training loop does): a table
        kept on the host then takes them as they are. Ids on the device come back to a host table with
        a blocking copy: a non-blocking device-to-host copy returns before the ids land, and
        F.embedding would read whatever the buffer held (the previous batch's ids)."""
        table = self.embed_table
        if tokens.device.type == "cpu":  # checked before the upload: no device sync for it
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got [{lo}, {hi}]")
        ids = tokens.to(table.device, non_blocking=tokens.device.type == "cpu")  # only uploads overlap
        h = F.embedding(ids, table)  # (B, T, dim)
        h = h.to(self.device, self.weight_dtype, non_blocking=True)
        return h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype) if self.cfg.embed_scale else h

    def blocks(self, h: torch.Tensor, rope: torch.Tensor, caches: list[KVCache] | None = None,
               start_pos: int = 0, mask: torch.Tensor | None = None, reference: torch.Tensor | None = None):
        """Every block over h; with `reference`, also over that hidden state (the same rows) with the
        adapters off and no autograd, block by block beside h (returns both)."""
        if self.executor is not None:
            trained = [[p for n_, p in block.named_parameters() if "lora_" in n_] for block in self.layers]
            return self.executor(h, rope, trained, caches, start_pos, mask, reference)
        split = (lambda t: t.split(self.micro_batch)) if self.micro_batch else (lambda t: (t,))
        for i, block in enumerate(self.layers):
            if caches is not None:
                h = block(h, rope, caches[i], start_pos)
            else:
                ropes = split(rope) if mask is not None else [rope] * len(split(h))  # packed rows: a rope per row
                masks = split(mask) if mask is not None else [None] * len(split(h))
                h = torch.cat([block(hc, rc, mask=mc) for hc, rc, mc in zip(split(h), ropes, masks)])
                if reference is not None:
                    with torch.no_grad(), lora_disabled(block):
                        reference = torch.cat([block(r, rc, mask=mc)
                                               for r, rc, mc in zip(split(reference), ropes, masks)])
        return h if reference is None else (h, reference)


def default_loss_chunk(vocab_size: int, device: torch.device) -> int:
    """Tokens per chunk of the fused head + loss: ~64 MB of fp32 logits on a CPU; on CUDA a chunk whose
    peak (LOSS_BYTES_PER_LOGIT: ~4.5x its fp32 logits) takes phantom.stream.placement.loss_budget, an eighth
    of free memory (at most 2 GiB), so a 128k vocabulary runs a few large matmuls, not hundreds of thin
    ones. The model keeps that peak out of the blocks' device budget (device_reserve)."""
    if device.type == "cuda":
        return max(16, loss_budget(free_device_bytes(device)) // (LOSS_BYTES_PER_LOGIT * vocab_size))
    return max(16, (64 << 20) // (4 * vocab_size))


def default_keep_budget(device: torch.device) -> int:
    """Bytes of kept activations under recompute "auto": half of what is free on the compute side."""
    if device.type == "cuda":
        return free_device_bytes(device) // 2
    free = free_host_bytes()  # this rank's share of the host
    return free // 2 if free is not None else 4 << 30
