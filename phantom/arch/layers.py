"""The decoder building blocks: grouped-query attention, a gated MLP, the block, LoRA.

Llama's maths, plus what ModelConfig's other fields switch on (biases, q/k norms, a sliding window,
the MLP's activation). Parameter names follow Meta's checkpoints (attention.wq, feed_forward.w1, ...),
and q/k rows are in Meta's interleaved RoPE layout. Blocks hold no I/O: the model swaps weights in.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from phantom.arch import carry as C
from phantom.arch.config import FUSED_PROJECTIONS, ModelConfig
from phantom.arch.deltanet import GatedDeltaNet
from phantom.arch.hyper import HyperBlock
from phantom.arch.mla import LatentAttention
from phantom.arch.moe import MoeFeedForward
from phantom.arch.tiled import by_documents, tiled
from phantom.arch.ops import ACTIVATIONS, KVCache, RMSNorm, apply_rope, apply_rope_halves, attend, attention_mask, \
    chunk_mask, document_mask, document_spans, linear, rms_norm


def fuse_adjacent(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """weights plus, for each group of FUSED_PROJECTIONS whose tensors lie back to back in one
    storage (as phantom's stores write them), one view over the group ("attention.wqkv", ...): the
    block then runs the group as one matmul. No copy; a group that is not adjacent stays unfused.
    Only for frozen weights: a gradient would reach the fused view, not the named tensors."""
    out = dict(weights)
    for fused, names in FUSED_PROJECTIONS.items():
        ts = [weights.get(n) for n in names]
        if any(t is None or not t.is_contiguous() or t.dim() != 2 for t in ts):
            continue
        first = ts[0]
        same = all(t.dtype == first.dtype and t.device == first.device and t.shape[1] == first.shape[1]
                   and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in ts)
        if same and all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(ts, ts[1:])):
            out[fused] = first.as_strided((sum(t.shape[0] for t in ts), first.shape[1]), first.stride())
    return out


def project(x: torch.Tensor, projs: list[nn.Module], fused: torch.Tensor | None) -> list[torch.Tensor]:
    """Each projection of x: one matmul over `fused` (their weights back to back, fuse_adjacent) or
    one per weight, then each one's bias and LoRA update (where it has them and the LoRA is on).
    Projections that share a LoRA A (the parts of a module the checkpoint fuses: peft's one LoRA on
    Phi-3's qkv_proj) share dropout(x) A^T, computed once as peft computes it."""
    if fused is None:
        ys = [F.linear(x, p.weight) for p in projs]
    else:
        ys = F.linear(x, fused).split([p.weight.shape[0] for p in projs], dim=-1)
    inputs: list[tuple[nn.Parameter, torch.Tensor]] = []  # (A, dropout(x) A^T), one per distinct A
    out = []
    for p, y in zip(projs, ys):
        if p.bias is not None:
            y = y + p.bias
        if isinstance(p, LoraLinear) and p.enabled:
            xa = next((xa for a, xa in inputs if a is p.lora_A), None)
            if xa is None:
                xa = p.lora_input(x)
                inputs.append((p.lora_A, xa))
            y = y + p.lora_output(xa)
        out.append(y)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.window = cfg.window(layer)  # keys each query sees (itself included); None: all before it
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None  # None: sdpa's
        self.softcap = cfg.attn_softcap
        # which of a two-base RoPE table this layer reads (rope_table); None: the table is one base
        self.rope_index = None if cfg.local_rope_theta is None else int(self.window is not None)
        # Llama 4: the table carries each position (rope_table); chunked layers attend within chunks, norm q/k after
        # RoPE; with nope_full, full-attention layers have no RoPE and scale q by the position's temperature
        kind = cfg.layer_types[layer % len(cfg.layer_types)] if cfg.layer_types else None
        self.positioned = bool(cfg.nope_full or cfg.attn_chunk)
        self.rope_index = 0 if self.positioned else self.rope_index
        self.chunk = cfg.attn_chunk if kind == "chunked_attention" else 0
        self.nope = cfg.nope_full and kind == "full_attention"
        self.l2_eps = cfg.norm_eps if cfg.qk_l2 and not self.nope else None
        self.temper = (cfg.attn_scale, cfg.floor_scale) if self.nope and cfg.attn_scale else None
        kv = cfg.kv_heads * cfg.head_dim
        self.gated = cfg.attn_output_gate  # wq: each head's query then its output gate (Qwen3-Next)
        self.rotate = apply_rope if cfg.rope_interleave else apply_rope_halves  # halves: HF's rows, unpermuted
        self.wq = linear(cfg.dim, cfg.q_dim * (2 if self.gated else 1), device, dtype, cfg.qkv_bias)
        self.wk = linear(cfg.dim, kv, device, dtype, cfg.qkv_bias)
        self.wv = linear(cfg.dim, kv, device, dtype, cfg.qkv_bias)
        self.wo = linear(cfg.q_dim, cfg.dim, device, dtype, cfg.o_bias)
        self.register_parameter("wqkv", None)  # a view over wq, wk, wv when bound adjacent (fuse_adjacent)
        # gpt-oss: a logit per head in each softmax's denominator (ops.attend_with_sinks)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads, device=device, dtype=dtype)) if cfg.attn_sinks else None
        self.norm_heads = cfg.qk_norm_over == "head"  # else q/k norms span the whole projection (OLMoE)
        if cfg.qk_norm:  # RMSNorm of q and k (per head, or over the projection) before RoPE
            self.q_norm = RMSNorm(cfg.head_dim if self.norm_heads else cfg.q_dim, cfg.norm_eps, device, dtype,
                                  cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim if self.norm_heads else kv, cfg.norm_eps, device, dtype,
                                  cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def inputs(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What attention takes from each token, token by token: q (B, T, H, D) and k (B, T, KV, D) normed and
        rotated, v (B, T, KV, D), and where gated each head's output gate (B, T, H * D)."""
        B, T, _ = x.shape
        q, k, v = project(x, [self.wq, self.wk, self.wv], self.wqkv)
        gate = ()
        if self.gated:  # (B, T, H, 2D): each head's query, then its gate
            q, g = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(B, T, -1), (g.reshape(B, T, -1),)
        positions = rope.select(-3, 1)[..., 0, 0] if self.positioned else None  # (T,) or (B, T)
        if self.rope_index is not None:  # (.., 2, D/2, 2): the table of this layer's RoPE base
            rope = rope.select(-3, self.rope_index)
        if not self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.nope:
            q, k = self.rotate(q, rope), self.rotate(k, rope)
        if self.l2_eps is not None:  # Llama 4's weightless q/k norm, after RoPE
            q, k = rms_norm(q, 1.0, self.l2_eps), rms_norm(k, 1.0, self.l2_eps)
        if self.temper is not None:  # Llama 4's attention temperature on RoPE-less layers, by each token's position
            scale, floor = self.temper
            q = (q * (torch.log1p(torch.floor((positions + 1.0) / floor)) * scale + 1.0)[..., None, None]).to(q.dtype)
        return q, k, v.view(B, T, self.n_kv_heads, self.head_dim), *gate

    def forward(self, x: torch.Tensor | None, rope: torch.Tensor, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None,
                inputs: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """mask: None (causal); packed rows' examples (B, T) (packed_layout: each example attends alone,
        by_documents, no T x T mask); or a (B, 1, T, S) bool mask (generation's left-padded rows). `inputs`:
        self.inputs(x, rope) computed already (tiled over the row), x then unused."""
        q, k, v, *gate = inputs if inputs is not None else self.inputs(x, rope)
        B, T = q.shape[:2]
        gate = gate[0] if gate else None
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if mask is not None and mask.dim() == 2:
            sinks = [self.sinks] if self.sinks is not None and self.sinks.requires_grad else []
            out = by_documents(self.alone, q, k, v, document_spans(mask), sinks)
        else:
            out = self.attend_row(q, k, v, rope, cache, start_pos, mask)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.wo(out if gate is None else out * torch.sigmoid(gate))

    def attend_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor,
                   cache: KVCache | None, start_pos: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of whole rows (B, heads, T, D), under the layer's window or chunks and a dense mask."""
        B, T = q.shape[0], q.shape[2]
        if cache is not None:  # queries at start_pos.. see the cached keys before them
            cache.k[:B, :, start_pos:start_pos + T] = k
            cache.v[:B, :, start_pos:start_pos + T] = v
            k, v = cache.k[:B, :, :start_pos + T], cache.v[:B, :, :start_pos + T]
        window = attention_mask(T, start_pos if cache is not None else 0, self.window, q.device)
        if self.chunk and start_pos + T > self.chunk:  # Llama 4's chunks, by each example's own positions
            pos = rope.select(-3, 1)[..., 0, 0]
            window = chunk_mask(pos, pos if cache is None else torch.arange(start_pos + T, device=q.device), self.chunk)
            window = window[:, None] if window.dim() == 3 else window
        if mask is None:
            mask = window
        elif window is not None:  # a left-padded row under a sliding window: both apply
            mask = mask & window
        return attend(q, k, v, mask, self.scale, self.softcap, self.sinks)

    def alone(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one packed example's (1, heads, L, D) q, k, v, its positions from 0: what it computes alone
        (the layer's window or chunks within it)."""
        L = q.shape[2]
        mask = attention_mask(L, 0, self.window, q.device)
        if self.chunk and L > self.chunk:
            pos = torch.arange(L, device=q.device)
            mask = chunk_mask(pos, pos, self.chunk)
        return attend(q, k, v, mask, self.scale, self.softcap, self.sinks)


TILED_MIXERS = (Attention, LatentAttention)  # their inputs() tile (Gated DeltaNet runs its own chunks)
DOCUMENT_MIXERS = (Attention, LatentAttention)  # packed rows' examples attend alone in them (by_documents)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.w1 = linear(cfg.dim, cfg.hidden_dim, device, dtype, cfg.mlp_bias)  # gate
        self.w2 = linear(cfg.hidden_dim, cfg.dim, device, dtype, cfg.mlp_bias)  # down
        self.w3 = linear(cfg.dim, cfg.hidden_dim, device, dtype, cfg.mlp_bias)  # up
        self.register_parameter("w13", None)  # a view over w1, w3 when bound adjacent (fuse_adjacent)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, [self.w1, self.w3], self.w13)
        return self.w2(self.act(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm block `layer` of the model (its attention window is the layer's). A row longer than
    `mlp_chunk` tokens runs its MLP and the MLP's norms, and attention's token-wise inputs, `mlp_chunk` tokens
    at a time, forward and backward (phantom.arch.tiled: one chunk's (chunk, hidden) activations at once,
    not the row's). With
    `checkpoint_inner` set, attention and the MLP are each checkpointed when a graph is built, so the
    backward holds one of them at a time."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        norm = lambda: RMSNorm(cfg.dim, cfg.norm_eps, device, dtype, cfg.norm_offset)  # noqa: E731
        self.attention_norm = norm()
        mixer = GatedDeltaNet if cfg.linear(layer) else LatentAttention if cfg.kv_lora_rank else Attention
        self.attention = mixer(cfg, device, dtype, layer)
        self.attention_post_norm = norm() if cfg.post_norms else nn.Identity()
        self.ffn_norm = norm()
        self.feed_forward = MoeFeedForward(cfg, ACTIVATIONS[cfg.activation], device, dtype) if cfg.sparse(layer) \
            else FeedForward(cfg, device, dtype)
        self.ffn_post_norm = norm() if cfg.post_norms else nn.Identity()
        self.checkpoint_inner = False
        self.mlp_chunk: int | None = None  # tokens per MLP chunk of a longer row (None or 0: whole rows)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None, carry: C.Carry = None) -> torch.Tensor:
        """`carry`: this micro-batch's state carried from the blocks before (phantom.arch.carry), None where the
        model carries none; the block may set entries in it for the blocks after."""
        if self.checkpoint_inner and torch.is_grad_enabled() and cache is None:
            h = x + checkpoint(self._attention, x, rope, mask, None, 0, carry, use_reentrant=False)
        else:
            h = x + self._attention(x, rope, mask, cache, start_pos, carry)
        return self.residual_mlp(h, carry)

    def residual_mlp(self, h: torch.Tensor, carry: C.Carry = None) -> torch.Tensor:
        """h plus the MLP half's output for h (B, T, dim), its norms included: the block's output. In chunks of
        mlp_chunk tokens where the row is longer (tiled, the residual added inside the tiled node), else at once
        (the MLP checkpointed under checkpoint_inner)."""
        if self.mlp_chunk and h.shape[1] > self.mlp_chunk:
            return tiled(lambda hc, a: self._mlp(hc, C.tokens(carry, a, hc.shape[1])), h, self.mlp_chunk,
                         [self.ffn_norm, self.feed_forward, self.ffn_post_norm], residual=True)
        if self.checkpoint_inner and torch.is_grad_enabled():
            return h + checkpoint(self._mlp, h, carry, use_reentrant=False)
        return h + self._mlp(h, carry)

    def _attention(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None,
                   cache: KVCache | None = None, start_pos: int = 0, carry: C.Carry = None) -> torch.Tensor:
        """The attention half's output for x, its norms included. A row longer than mlp_chunk computes what
        attention takes from each token (the norm, projections, q/k norms, RoPE) in chunks too (tiled), so the
        row keeps q, k, v and not the norm's output or the projections' before RoPE."""
        att = self.attention
        if mask is not None and mask.dim() == 2 and not isinstance(att, DOCUMENT_MIXERS):
            mask = document_mask(mask, x.device)  # packed rows' examples as the dense mask the other mixers take
        if self.mlp_chunk and x.shape[1] > self.mlp_chunk and cache is None and isinstance(att, TILED_MIXERS):
            # (T, ..) a table for every row, or (B, T, ..) each row's own positions (packed rows); a local base's
            # tables have one more dim (Attention.rope_index)
            per_row = rope.dim() > (4 if getattr(att, "rope_index", None) is not None else 3)

            indexed = {"indexed": True} if getattr(att, "sparse", lambda _: False)(x.shape[1]) else {}

            def token_wise(xc: torch.Tensor, a: int) -> tuple[torch.Tensor, ...]:
                rows = rope[:, a:a + xc.shape[1]] if per_row else rope[a:a + xc.shape[1]]
                return att.inputs(self.attention_norm(xc), rows, **indexed)
            inputs = tiled(token_wise, x, self.mlp_chunk, [self.attention_norm, att])
            return self.attention_post_norm(att(None, rope, mask=mask, inputs=inputs, **C.kwargs(att, carry)))
        return self.attention_post_norm(att(self.attention_norm(x), rope, cache, start_pos, mask, **C.kwargs(att, carry)))

    def _mlp(self, h: torch.Tensor, carry: C.Carry = None) -> torch.Tensor:
        return self.ffn_post_norm(self.feed_forward(self.ffn_norm(h), **C.kwargs(self.feed_forward, carry)))


def make_block(cfg: ModelConfig, device=None, dtype=None, layer: int = 0) -> nn.Module:
    """Block `layer` of the model: DeepSeek-V4's HyperBlock where cfg has hyper-connections, else a TransformerBlock."""
    return (HyperBlock if cfg.hc_mult else TransformerBlock)(cfg, device, dtype, layer)


# ---------------------------------------------------------------------------------------------
# LoRA

class LoraLinear(nn.Module):
    """y = x W^T + scale * dropout(x) A^T B^T, with W frozen; A random (Kaiming, as PEFT), B zero.

    Takes over the base layer's weight Parameter, so the weight keeps its name (`...wq.weight`)
    and the model can still swap streamed weights in by that name. With `enabled` False it is the
    base layer alone (see lora_disabled).
    """

    enabled = True

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None, lora_A: nn.Parameter | None = None, rslora: bool = False):
        super().__init__()
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias  # frozen with the weight, or None
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scale = rank, alpha / (math.sqrt(rank) if rslora else rank)  # rslora: peft's use_rslora
        if lora_A is not None:  # one A for the parts of a fused module (phantom.model.lora.apply_lora)
            self.lora_A = lora_A
        else:
            self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
            bound = 1 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
            with torch.no_grad():
                self.lora_A.uniform_(-bound, bound, generator=generator)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))  # after A: the parameters' order
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def in_features(self) -> int:
        return self.lora_A.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_B.shape[0]

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.dropout(x), self.lora_A)

    def lora_output(self, xa: torch.Tensor) -> torch.Tensor:
        return F.linear(xa, self.lora_B) * self.scale

    def lora_update(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_output(self.lora_input(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + self.lora_update(x) if self.enabled else y

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale


@contextlib.contextmanager
def lora_disabled(module: nn.Module):
    """Every LoraLinear inside `module` runs as its base layer until the `with` ends (the frozen
    reference model of preference training: the base with the adapters off, as peft's disable_adapter)."""
    loras = [m for m in module.modules() if isinstance(m, LoraLinear)]
    for m in loras:
        m.enabled = False
    try:
        yield
    finally:
        for m in loras:
            m.enabled = True
