"""The pieces every block is made of, with no weights of their own to stream: RMSNorm, RoPE (frequencies,
tables, rotation, the packed-rows layout, the q/k row permutations to and from Hugging Face's), masks,
attention, the KV cache. Imports only phantom.arch.config; phantom.arch.layers and phantom.arch.mla build
blocks from them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch.config import ModelConfig

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * (offset + weight); offset 1 is Gemma's norm, whose zero weight is the identity."""
    xf = x.float()  # normalise in fp32 whatever the activation dtype, as Meta's reference does
    scale = weight + offset if offset else weight
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * scale


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): scores or logits squashed smoothly into (-cap, cap) (Gemma-2); None: x."""
    return x if cap is None else cap * torch.tanh(x / cap)


# ---------------------------------------------------------------------------------------------
# RoPE, in Meta's layout: dimensions (2i, 2i+1) of each head form one rotating pair.

def rope_frequencies(cfg: ModelConfig, theta: float | None = None, scaled: bool = True,
                     long: bool = False) -> torch.Tensor:
    """Rotation frequencies of each pair: base cfg.rope_theta (or theta), with cfg's scaling if scaled
    (longrope: its long factors if long, else its short ones)."""
    d = cfg.rope_dim
    freqs = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling if scaled else None
    if s is not None and s.rope_type == "linear":
        return freqs / s.factor
    if s is not None and s.rope_type == "longrope":
        factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float64)
        if factors.shape != freqs.shape:
            raise ValueError(f"longrope has {len(factors)} factors; {d} rotating dims have {d // 2} pairs")
        return freqs / factors
    if s is not None and s.rope_type == "yarn":
        return yarn_frequencies(freqs, d, theta or cfg.rope_theta, s)
    if s is not None:  # Llama-3.1: slow down low frequencies, keep high ones, blend in between
        wavelen = 2 * math.pi / freqs
        low_wavelen = s.original_max_seq_len / s.low_freq_factor
        high_wavelen = s.original_max_seq_len / s.high_freq_factor
        smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * freqs / s.factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / s.factor,
                            torch.where(wavelen < high_wavelen, freqs, blended))
    return freqs


def yarn_frequencies(freqs: torch.Tensor, d: int, theta: float, s) -> torch.Tensor:
    """YaRN: pairs turning fewer than beta_slow times over the original context are interpolated
    (freq / factor), more than beta_fast kept, a linear ramp between (transformers' yarn, as written)."""
    def pair_of(rotations: float) -> float:
        return d * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = pair_of(s.beta_fast), pair_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
    return freqs / s.factor * ramp + freqs * (1 - ramp)


def rope_table(cfg: ModelConfig, seq_len: int, device=None, long: bool = False) -> torch.Tensor:
    """(seq_len, head_dim/2, 2) table of cos and sin, fp32; with a local RoPE base (Gemma-3),
    (seq_len, 2, head_dim/2, 2): the global table, then the sliding layers' (see Attention.rope_index).
    long: longrope's table for sequences past its original context (see rope_frequencies)."""
    gain = cfg.rope_scaling.attention_factor if cfg.rope_scaling is not None else 1.0  # yarn's, longrope's; else 1

    def table(freqs, gain=gain):
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
        return (torch.stack([angles.cos(), angles.sin()], -1) * gain).float()
    if cfg.nope_full or cfg.attn_chunk:  # Llama 4: each position's number beside its table (Attention.positioned)
        t = table(rope_frequencies(cfg, long=long))
        return torch.stack([t, torch.arange(seq_len, dtype=torch.float32)[:, None, None].expand_as(t)], 1).to(device)
    if cfg.local_rope_theta is None:
        return table(rope_frequencies(cfg, long=long)).to(device)
    local = table(rope_frequencies(cfg, cfg.local_rope_theta, scaled=False), gain=1.0)
    return torch.stack([table(rope_frequencies(cfg)), local], 1).to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); rope: (T, R/2, 2) for x's positions, or (B, T, R/2, 2) for each row's own; the
    leading R dims of each head turn (R < D: partial rotary), the rest pass through."""
    if (turned := 2 * rope.shape[-2]) < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :turned], rope), x[..., turned:]], dim=-1)
    xp = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    r = rope if rope.dim() == 4 else rope[None]
    cos, sin = r[:, :, None, :, 0], r[:, :, None, :, 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2).type_as(x)


def apply_rope_halves(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """apply_rope for rows whose pairs are (i, i + D/2) rather than (2i, 2i+1): Hugging Face's rotate_half
    layout, which an MLA checkpoint with rope_interleave false keeps (its rows are not permuted); the
    leading R dims of each head turn (partial rotary), the rest pass through."""
    if (turned := 2 * rope.shape[-2]) < x.shape[-1]:
        return torch.cat([apply_rope_halves(x[..., :turned], rope), x[..., turned:]], dim=-1)
    x0, x1 = x.float().chunk(2, dim=-1)
    r = rope if rope.dim() == 4 else rope[None]
    cos, sin = r[:, :, None, :, 0], r[:, :, None, :, 1]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).type_as(x)


def longest_example(segments: torch.Tensor) -> int:
    """Tokens in the longest example of rows packed with segment ids (B, T) (runs of one id)."""
    B, T = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    idx = torch.arange(T, device=segments.device).expand(B, T)
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return int((idx - first).max()) + 1


def packed_layout(table: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE rows and the examples of rows that pack several (segment ids (B, T), equal within an example): each
    example's positions start at 0 and it attends only to itself, causally, so a packed row computes what its
    examples compute alone. A batch with no packed row gets the plain table and no mask (SDPA's causal kernel).

    Returns:
        rope (T, D/2, 2) or (B, T, D/2, 2); the mask: None, or (B, T) long in host memory, each token's example's
        first position: what `document_mask` expands to the (B, 1, T, T) bool mask it stands for. Attention runs
        each example alone from it (phantom.arch.tiled.by_documents), so no T x T mask is made at long rows.
    """
    B, T = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    if not starts[:, 1:].any():
        return table[:T], None
    idx = torch.arange(T, device=segments.device).expand(B, T)
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values  # (B, T) its example's start
    return table[(idx - first).to(table.device)], first.cpu()


def document_mask(first: torch.Tensor, device=None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where a query may see a key: its own example's, at or before it; `first` (B, T) is
    packed_layout's mask (each token's example's first position). For the mixers that take a dense mask."""
    T = first.shape[1]
    first = first.to(device)
    causal = torch.ones(T, T, dtype=torch.bool, device=first.device).tril()
    return ((first[:, :, None] == first[:, None, :]) & causal)[:, None]


def document_spans(first: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of each example of packed rows, from packed_layout's mask `first` (B, T)."""
    T = first.shape[1]
    rows, begins = (first == torch.arange(T, device=first.device)).nonzero(as_tuple=True)  # row-major order
    same_row = torch.cat([rows[1:] == rows[:-1], rows.new_zeros(1, dtype=torch.bool)])
    ends = torch.where(same_row, torch.cat([begins[1:], begins.new_full((1,), T)]), T)
    return list(zip(rows.tolist(), begins.tolist(), ends.tolist()))


def permute_for_hf(w: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """Meta's interleaved q/k rows -> Hugging Face's half-split rows (its conversion script's permute),
    over the leading `rotary` rows of each head (None: all)."""
    return _permute_heads(w, n_heads, rotary, to_hf=True)


def permute_from_hf(w: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """Inverse of permute_for_hf."""
    return _permute_heads(w, n_heads, rotary, to_hf=False)


def rope_rows(cfg: ModelConfig) -> dict[str, int]:
    """Block tensors whose rows (per head) are in RoPE's pair layout -> heads they split into.

    A store's rows are in the layout its config's rope_interleave says: Meta's interleaved pairs (a Meta
    checkpoint's, a synthetic store's, a store converted before the layout was recorded), or Hugging Face's
    half-split pairs, as a Hugging Face checkpoint ships them (phantom.convert.checkpoints.as_shipped: none is
    permuted, so --link reads them in place). Where a store is in pairs the exporter and the adapter writer
    permute these rows to Hugging Face's (the leading cfg.rope_dim of each head; a per-head norm's weight is one
    head's row order, a whole-projection norm's (OLMoE) is the projection's); in halves there is nothing to
    permute ({}). Latent attention keeps the checkpoint's rows as they are (phantom.arch.mla rotates either
    layout)."""
    if cfg.kv_lora_rank or not cfg.rope_interleave or cfg.family == "llama4" or cfg.hc_mult:  # Llama 4, V4 ship pairs
        return {}
    per_head = cfg.qk_norm_over == "head"
    return {"attention.wq.weight": cfg.n_heads, "attention.wk.weight": cfg.kv_heads,
            "attention.wq.bias": cfg.n_heads, "attention.wk.bias": cfg.kv_heads,
            "attention.q_norm.weight": 1 if per_head else cfg.n_heads,
            "attention.k_norm.weight": 1 if per_head else cfg.kv_heads}


def _permute_heads(w: torch.Tensor, n_heads: int, rotary: int | None, to_hf: bool) -> torch.Tensor:
    head = w.shape[0] // n_heads
    r = rotary or head
    heads = w.reshape(n_heads, head, *w.shape[1:])
    split = (r // 2, 2) if to_hf else (2, r // 2)
    turned = heads[:, :r].reshape(n_heads, *split, *w.shape[1:]).transpose(1, 2).reshape(n_heads, r, *w.shape[1:])
    return torch.cat([turned, heads[:, r:]], dim=1).reshape(w.shape) if r < head else turned.reshape(w.shape)


# ---------------------------------------------------------------------------------------------

@dataclass
class KVCache:
    """What one block keeps of the tokens before for generation, rows (dim 0) the sequences: keys and values
    (B, n_kv_heads, max_len, head_dim); for latent attention (cfg.kv_lora_rank) each token's latent (B, 1,
    max_len, kv_lora_rank) and shared rotated key (B, 1, max_len, rope_dim), from which every head's keys and
    values are made (phantom.arch.mla); for a Gated DeltaNet layer (cfg.linear) its state, not the tokens: k
    the convolution's last taps - 1 inputs (B, channels, taps - 1), v the delta rule's fp32 state (B, v_heads,
    k_dim, v_dim) (phantom.arch.deltanet), so its size does not grow with max_len."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, device=None, dtype=None, layer: int = 0) -> "KVCache":
        return cls(*(torch.zeros(shape, device=device, dtype=d)
                     for shape, d in cls.layout(cfg, batch, max_len, dtype or torch.get_default_dtype(), layer)))

    @staticmethod
    def layout(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, layer: int = 0
               ) -> tuple[tuple[tuple, torch.dtype], tuple[tuple, torch.dtype]]:
        """((k shape, dtype), (v shape, dtype)) of block `layer`'s cache for `batch` sequences of up to max_len
        tokens in `dtype` (a Gated DeltaNet layer's state in fp32)."""
        if cfg.linear(layer):
            channels = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
            return (((batch, channels, cfg.linear_conv - 1), dtype),
                    ((batch, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), torch.float32))
        if cfg.kv_lora_rank:
            return ((batch, 1, max_len, cfg.kv_lora_rank), dtype), ((batch, 1, max_len, cfg.rope_dim), dtype)
        kv = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        return (kv, dtype), (kv, dtype)

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, layer: int = 0) -> int:
        """Bytes of block `layer`'s cache (KVCache.layout)."""
        return sum(math.prod(shape) * d.itemsize for shape, d in KVCache.layout(cfg, batch, max_len, dtype, layer))

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows (sequences) from now on: the finished ones are dropped from later steps, the rows
        moved up in place (the memory stays where it is: page-locked host memory stays page-locked)."""
        n = rows.numel()
        self.k[:n], self.v[:n] = self.k.index_select(0, rows), self.v.index_select(0, rows)
        self.k, self.v = self.k[:n], self.v[:n]


def linear(in_features: int, out_features: int, device=None, dtype=None, bias: bool = False) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,  # transformers' "gelu" is the exact (erf) one
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def attention_mask(q_len: int, start_pos: int, window: int | None, device=None) -> torch.Tensor | None:
    """Which keys each query sees: a (q_len, start_pos + q_len) bool mask for queries at positions
    start_pos.., or None where that is plain causal attention (sdpa's is_causal). With a window, a
    query sees the last `window` keys up to its own position, itself included."""
    k_len = start_pos + q_len
    if start_pos == 0 and (window is None or k_len <= window):
        return None
    pos_q = torch.arange(start_pos, k_len, device=device)[:, None]
    pos_k = torch.arange(k_len, device=device)[None, :]
    seen = pos_k <= pos_q
    return seen & (pos_k > pos_q - window) if window is not None else seen


def chunk_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, chunk: int) -> torch.Tensor:
    """(.., Tq, Tk) bool: a query sees the keys at or before its position in its own chunk of `chunk` positions
    (Llama 4's chunked attention; positions (.., T): each example's own in packed rows)."""
    pq, pk = pos_q.long()[..., :, None], pos_k.long()[..., None, :]
    return (pk <= pq) & (pk // chunk == pq // chunk)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None, cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap(q k^T * scale, cap) + mask) v over (B, heads, T, D), scale 1/sqrt(D) unless
    given; k, v may have fewer heads (GQA). mask None: causal. Soft-capped scores are written out
    (sdpa has no such step); everything else is sdpa's. sinks (heads,): a logit per head in each
    softmax's denominator that no value goes with (gpt-oss; attend_with_sinks)."""
    if sinks is not None:
        assert cap is None, "no family has both sinks and soft-capped scores"
        return attend_with_sinks(q, k, v, mask, scale or q.shape[-1] ** -0.5, sinks)
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = softcap(q @ k.transpose(-2, -1) * (scale or q.shape[-1] ** -0.5), cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores.float(), dim=-1).type_as(q) @ v


SINK_DIMS = 8  # the columns a sink adds to q and k (one carries it; eight keep the head width a multiple of 8)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, sinks[h], with a zero value: transformers'
    GptOssAttention, through sdpa (no (T, S) scores written out). The sink is one more key every query sees,
    zero in q and k's own dims and 1 in a column where each query holds sinks[h] / scale, so its score is
    sinks[h] and the real keys' are unchanged; its value is zero. v is widened as q and k are (zeros, cut off
    after): sdpa's fused CPU kernel takes one head width (2.7x faster than the math path it falls back to
    otherwise, notes/gpt-oss.md). mask None: causal."""
    B, H, T, D = q.shape
    S, Dv, pad = k.shape[2], v.shape[-1], (0, SINK_DIMS)
    q = torch.cat([q, (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, T, 1),
                   q.new_zeros(B, H, T, SINK_DIMS - 1)], dim=-1)
    k = torch.cat([F.pad(k, pad), F.pad(k.new_ones(B, k.shape[1], 1, 1), (D, SINK_DIMS - 1))], dim=2)
    v = torch.cat([F.pad(v, pad), v.new_zeros(B, v.shape[1], 1, Dv + SINK_DIMS)], dim=2)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)  # every query sees the sink
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != H)
    return out[..., :Dv]
