"""`PhantomModel`: a Llama (embedding, blocks, final norm, head) whose blocks may live off the device.

With `offload="none"` it is an ordinary resident model trained by plain autograd: the reference.
Otherwise a BlockExecutor runs its blocks on weights streamed by a BlockScheduler. Which of the two
is one backend object chosen when the model is built (phantom.model.backends); full finetuning's
wiring is phantom.model.fullmode's, the head and loss phantom.model.heads' fused Functions, which
never hold the (B, T, vocab) logits.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch import carry as C
from phantom.arch.config import ModelConfig
from phantom.arch.hyper import HyperHead, streams
from phantom.arch.ops import KVCache, longest_example, packed_layout, rope_table
from phantom.arch.moe import RouterLoss
from phantom.base import provenance
from phantom.files.store import BlockStore
from phantom.model import fullmode
from phantom.model.backends import ResidentBlocks, StreamedBlocks, build_layers
from phantom.model.heads import ChunkedHeadLogps, ChunkedHeadLoss, ChunkedHeadTokenLogps, default_loss_chunk, \
    head_logits
from phantom.model.lora import LoraConfig, for_family
from phantom.model.adapterfiles import load_adapter, save_adapter
from phantom.stream.optim import AdamWConfig, BlockAdamW, FullFinetune
from phantom.stream.placement import LOSS_BYTES_PER_LOGIT, Activations, Placement
from phantom.stream.lanes import Lane
from phantom.stream.scheduler import BlockScheduler

MODES = ("lora", "full")


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
        activations = checked(self, placement, activations)
        self.placement, self.activations = placement, activations
        self.amp = dtype != torch.float32
        # Slots hold the compute dtype: a store in another dtype is converted once per load in the
        # prefetch pipeline (never on the compute thread). Left to autocast, every weight would be cast
        # at every use, and with recompute="none" autograd would keep the cast copies (kept blocks
        # holding their weights); an fp16 store at bf16 would also promote the hidden state to fp32.
        self.weight_dtype = dtype
        self.micro_batch = activations.micro_batch
        self.loss_chunk = activations.loss_chunk or default_loss_chunk(self.cfg.vocab_size, self.device)
        self.layers = build_layers(self.cfg, self.lora_cfg, activations, self.weight_dtype, self.device)
        self.adapters = nn.ModuleList()  # the block modules of adapters added (phantom.model.adaptermodel)
        head_dtype = torch.float32 if self.full else self.weight_dtype  # trained ones keep fp32 masters
        self._load_head(head_dtype)

        self.full_ft: FullFinetune | None = None  # streamed full finetuning: the blocks' updates
        self.block_optimizer: BlockAdamW | None = None  # and their optimizer
        self.grad_sync = None  # data parallel, full mode: grads -> a wait for their average (phantom.train.dist)
        self.backend = self._backend(placement, activations, trace)  # resident or streamed, chosen once
        self.scheduler, self.executor = self.backend.scheduler, self.backend.executor  # None when resident
        self.offload = self.backend.offload  # what "auto" resolved to
        try:  # a failed setup stops a streamed backend's loader threads (and frees the pinned memory they hold)
            if self.full and self.scheduler is not None:
                self.full_ft = fullmode.block_updates(self.cfg, optim, self.scheduler)
                self.block_optimizer = self.full_ft.optimizer
            if self.cfg.tie_embeddings:
                self.embed_table = self.output_weight  # one parameter: trained once, by both uses' gradients
            else:
                table = self.backend.embed_table(head_dtype, self.full)
                self.embed_table = nn.Parameter(table) if self.full else table
        except BaseException:
            self.backend.close()
            raise

    def _backend(self, placement: Placement, activations: Activations, trace: bool) -> ResidentBlocks | StreamedBlocks:
        """Where the blocks run: on the device (offload "none", the reference) or streamed by a scheduler."""
        if placement.offload == "none":
            return ResidentBlocks(self.layers, self.store, self.device, self.weight_dtype, self.micro_batch, self.full)
        scheduler = BlockScheduler(self.store, self.device, placement, trace=trace, dtype=self.weight_dtype,
                                   device_reserve=self.device_reserve())
        # full mode: block i's AdamW step runs on the write-back thread while backward goes on
        on_block_grads = (lambda i, grads: self.full_ft.on_block_grads(i, grads, self.grad_sync)) if self.full else None
        return StreamedBlocks(self.layers, scheduler, activations, on_block_grads)

    def device_reserve(self) -> int:
        """Device bytes this model keeps out of the blocks' budget (the module's device_reserve)."""
        return device_reserve(self.cfg, self.device, self.loss_chunk, self.full)

    def _load_head(self, dtype: torch.dtype) -> None:
        """The final norm and output projection (trained in full mode), and the RoPE tables."""
        head = self.store.load_head()
        self.norm_weight = nn.Parameter(head["norm.weight"].to(self.device, dtype), requires_grad=self.full)
        if self.cfg.tie_embeddings:  # the head is the embedding table: one tensor, one parameter
            head["output.weight"] = self.store.load_embed()["tok_embeddings.weight"]
        self.output_weight = nn.Parameter(head["output.weight"].to(self.device, dtype), requires_grad=self.full)
        self.hc_head = HyperHead.of(self.cfg, head, self.device, dtype, self.full)  # DeepSeek-V4's mix of its streams
        self.register_buffer("rope", rope_table(self.cfg, self.cfg.max_seq_len, self.device), persistent=False)
        longrope = self.cfg.rope_scaling is not None and self.cfg.rope_scaling.rope_type == "longrope"
        self.register_buffer("rope_long", rope_table(self.cfg, self.cfg.max_seq_len, self.device, long=True)
                             if longrope else None, persistent=False)

    # -- public API ----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, lanes: list[Lane] | None = None):
        """Logits (B, T, vocab) in fp32, or with targets the mean cross-entropy (a scalar).

        Tokens and targets may be on the host (pinned: their uploads overlap) or the device. lanes: each adapter's
        rows (phantom.model.adaptermodel.add_adapter), one loss each. segments: (B, T) example ids of packed rows
        (phantom.data.batches.Packed): each example attends only to itself and its positions start at 0, so a
        packed row computes what its examples do alone."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        if self.full:
            self.finish_step()  # the previous step's block updates must land before blocks are read
        h = self.embed(tokens)
        rope, mask = self.rope_for(T)[:T], None
        if segments is not None:  # the mask: each token's example (packed_layout), in host memory
            segments = segments.cpu()
            rope, mask = packed_layout(self.rope_for(longest_example(segments) if self.rope_long is not None else T),
                                       segments)
        router = RouterLoss.attach(self.layers, self.cfg, self.device, on=self.full and targets is not None)
        with torch.autocast(**self.autocast_args()):
            h = self.blocks(h, rope, mask=mask, lanes=lanes, carry=C.start(self.cfg, tokens))
            if targets is None:
                return self.logits(h)
            if targets.shape != tokens.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} differs from tokens {tuple(tokens.shape)}")
            targets = targets.to(self.device, non_blocking=targets.device.type == "cpu")
            tail = (self.cfg.norm_eps, self.loss_chunk, self.cfg.norm_offset, self.cfg.final_softcap)
            loss = lambda h, t: ChunkedHeadLoss.apply(h, self.norm_weight, self.output_weight, t, *tail)  # noqa: E731
            if lanes:  # each adapter's loss over its own rows, as its own run computes it
                return per_lane(loss, lanes, h, targets)
            return loss(h, targets) if router is None else loss(h, targets) + router.term(h)  # MoE: routers' balance

    def sequence_logps(self, tokens: torch.Tensor, targets: torch.Tensor, reference: bool = False,
                       lanes: list[Lane] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's summed log-probability of its targets (-100 ignored): (B,) fp32, with autograd
        to the LoRA weights. With `reference`, also the base model's (adapters off, no autograd) as
        the second value (else None): each block runs both while it is loaded, so the store is read
        exactly as for the policy alone. `lanes`: as forward's; one (policy, reference) pair per lane."""
        head = _head_args(self, tokens, targets, "sequence")
        with torch.autocast(**self.autocast_args()):
            h, h_ref = _blocks_for_targets(self, tokens, reference, lanes)
            logps = lambda h, targets, h_ref: head_logps(h, (*head[:2], targets, *head[3:]), h_ref)  # noqa: E731
            return per_lane(logps, lanes, h, head[2], h_ref) if lanes else logps(h, head[2], h_ref)

    def token_logps(self, tokens: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    reference: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each token's log-probability of its target under softmax(logits / temperature) (B, T) fp32 (-100: 0), with
        autograd to the LoRA weights, and its entropy (no autograd); with `reference`, the base model's too (adapters
        off, no autograd; else None), each loaded block running both: what GRPO's non-linear objective takes."""
        head = (*_head_args(self, tokens, targets, "token"), temperature)
        with torch.autocast(**self.autocast_args()):
            h, h_ref = _blocks_for_targets(self, tokens, reference)
            with torch.no_grad():  # the reference's without autograd
                ref = ChunkedHeadTokenLogps.apply(h_ref, *head)[0] if h_ref is not None else None
            return (*ChunkedHeadTokenLogps.apply(h, *head), ref)

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
        """Clip gradients: globally for LoRA; in full mode per group with the documented rule
        (phantom.stream.optim: each group to max_norm * sqrt(its share of the parameters))."""
        if not self.full:
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
            return
        fullmode.clip([head_parameters(self)] + self.backend.block_groups(), max_norm, self.cfg.n_params())

    def set_lr(self, lr: float) -> None:
        """The learning rate of the block optimizer (full mode) for the next backward."""
        if self.block_optimizer is not None:
            self.block_optimizer.lr = lr

    def finish_step(self) -> None:
        """Wait for this step's block updates (full mode) and re-raise any error they hit."""
        self.backend.finish_step()

    def save_full(self) -> None:
        """Make the store hold the trained model (full mode): head, embedding, and RAM-tier blocks."""
        if self.full_ft is None:
            raise ValueError("save_full is for streamed full finetuning")
        head = {"norm.weight": self.norm_weight.detach(), "output.weight": self.output_weight.detach(),
                **{f"hc_head.{k}": v.detach() for k, v in (self.hc_head or nn.Module()).named_parameters()}}
        fullmode.save(self.full_ft, self.store, head, self.embed_table.detach())

    def save_adapter(self, out: Path | str, base_model: str = "") -> Path:
        if self.lora_cfg is None:
            raise ValueError("this model has no LoRA to save")
        base, revision = (base_model, None) if base_model else \
            provenance.base_model(self.store.manifest, self.store.path)
        return save_adapter(self.layers, self.cfg, self.lora_cfg, Path(out), base, revision)

    def load_adapter(self, path: Path | str) -> None:
        load_adapter(self.layers, self.cfg, Path(path))

    def close(self) -> None:
        """Stop the scheduler's threads (and drain its write-back queue)."""
        self.backend.close()

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
        return head_logits(h, self.norm_weight, self.output_weight, self.cfg)

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
        h = h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype) if self.cfg.embed_scale else h
        return streams(h, self.cfg.hc_mult)  # DeepSeek-V4's residual: hc_mult streams, each the embedding at first

    def blocks(self, h: torch.Tensor, rope: torch.Tensor, caches: list[KVCache] | None = None, start_pos: int = 0,
               mask: torch.Tensor | None = None, reference: torch.Tensor | None = None, lanes: list | None = None,
               carry: C.Carry = None):
        """Every block over h; with `reference`, also over that hidden state (the same rows) with the
        adapters off and no autograd, block by block beside h (returns both); `lanes` as forward's; `carry` what the
        first block receives (phantom.arch.carry.start). DeepSeek-V4's streams come out mixed into one (hc_head)."""
        out = self.backend(h, rope, caches, start_pos, mask, reference, lanes, carry)
        return out if self.hc_head is None else self.hc_head.mix(out, reference is not None)


def checked(model: PhantomModel, placement: Placement, activations: Activations) -> Activations:
    """Refuse what cannot work together; resolve the activation choices that depend on the run."""
    if model.full:
        activations = fullmode.checked(model.store, model.lora_cfg, placement, activations)
    if activations.compile is None:  # the largest single speed-up measured on CUDA; slow to build elsewhere
        activations = dataclasses.replace(activations, compile=model.device.type == "cuda")
    return activations


def head_parameters(model: PhantomModel) -> list[nn.Parameter]:
    """The embedding's and the head's parameters (DeepSeek-V4's mix of the streams too), each once (a tied table)."""
    head = (model.embed_table, model.norm_weight, model.output_weight, *(model.hc_head or nn.Module()).parameters())
    return list({id(p): p for p in head}.values())


def _head_args(model: PhantomModel, tokens: torch.Tensor, targets: torch.Tensor, what: str) -> tuple:
    """The fused head's arguments for log-probabilities of targets, the rows checked first."""
    if tokens.dim() != 2 or targets.shape != tokens.shape:
        raise ValueError(f"tokens and targets must be (batch, seq_len) alike, got {tuple(tokens.shape)} and "
                         f"{tuple(targets.shape)}")
    if tokens.shape[1] > model.cfg.max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    if model.full:
        raise ValueError(f"{what} log-probabilities are for LoRA training (the reference is the base model)")
    return (model.norm_weight, model.output_weight, targets.to(model.device), model.cfg.norm_eps, model.loss_chunk,
            model.cfg.norm_offset, model.cfg.final_softcap)


def _blocks_for_targets(model: PhantomModel, tokens: torch.Tensor, reference: bool, lanes: list[Lane] | None = None):
    """(hidden states, the reference's or None) of every block over tokens (autocast: the caller's)."""
    h = model.embed(tokens)
    rope = model.rope_for(tokens.shape[1])[:tokens.shape[1]]
    out = model.blocks(h, rope, reference=h.detach() if reference else None, lanes=lanes,
                       carry=C.start(model.cfg, tokens))
    return out if reference else (out, None)


def per_lane(fn, lanes: list[Lane], *tensors: torch.Tensor | None) -> list:
    """fn over each lane's rows of the tensors (None stays None): an adapter's head runs on its rows alone."""
    sizes = [lane.rows for lane in lanes]
    parts = [t.split(sizes) if t is not None else [None] * len(sizes) for t in tensors]
    return [fn(*args) for args in zip(*parts)]


def head_logps(h: torch.Tensor, head: tuple, h_ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ChunkedHeadLogps of h (with autograd) and of the reference hidden state (without), or None."""
    logps = ChunkedHeadLogps.apply(h, *head)
    if h_ref is None:
        return logps, None
    with torch.no_grad():
        return logps, ChunkedHeadLogps.apply(h_ref, *head)


def device_reserve(cfg: ModelConfig, device: torch.device, loss_chunk: int, full: bool) -> int:
    """Device bytes a model needs beside blocks and activations, kept out of the blocks' budget: one loss
    chunk at its peak (phantom.model.heads); in full mode also what fullmode.device_reserve counts."""
    if device.type != "cuda":
        return 0
    reserve = loss_chunk * LOSS_BYTES_PER_LOGIT * cfg.vocab_size
    return reserve + (fullmode.device_reserve(cfg) if full else 0)
