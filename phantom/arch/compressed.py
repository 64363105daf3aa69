"""DeepSeek-V4's attention, as transformers' DeepseekV4Attention computes it over whole rows (no cache).

Queries go through a bottleneck (wq_a, its norm, wq_b) and a weightless norm per head; one key-value head (wkv, its
norm) is both the keys and the values. The last rope_dim dims of each head turn in pairs (the layer's RoPE table:
sliding layers the main base, compressed layers the compress base), and the output's turn back at the query's
position (the values carried their keys' rotation). A query sees the last sliding_window keys and, by the layer's
kind (cfg.kind):
- heavily_compressed_attention: one entry per hca_rate tokens (a softmax-gated sum over the window, normed, turned at
  the window's first position), every entry whose window has ended by the query;
- compressed_sparse_attention: one entry per csa_rate tokens over windows of 2 * csa_rate (each token gives a series
  to its window and one to the next), of which the lightning indexer picks index_topk per query (a compressor of
  its own at index_head_dim, scored by ReLU(q . k) weighted per head). The choice has no gradient, so the indexer's
  weights get none, as in transformers.
Each head's softmax has a sink logit (attend_with_sinks). The heads' outputs go through a grouped low-rank projection:
o_groups groups of heads, each to o_lora_rank by its own rows of wo_a, then wo_b. A LoRA on wo_a is peft's on the
weight (target_parameters' W + scale B A), its rows in the same groups: each group its rows of B after the one A.
Imports config and ops only.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch.config import ModelConfig
from phantom.arch.ops import RMSNorm, apply_rope, attend, attention_mask, document_spans, linear


def rope_tail(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) with its last rope_dim dims turned in pairs (2i, 2i+1) by rope (T, R/2, 2); the rest as is."""
    turned = 2 * rope.shape[-2]
    return torch.cat([x[..., :-turned], apply_rope(x[..., -turned:], rope)], dim=-1)


def unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) without a weight, as DeepseekV4UnweightedRMSNorm: the scale in fp32, the product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """Entries of `width` from windows of `rate` tokens: each token's series (wkv) weighted by a softmax over the
    window of its gates (wgate) plus a bias per slot (ape), summed, normed, their tail turned at the window's first
    position. wide 2 (CSA): each token gives two series, the first to the next window, so an entry spans 2 * rate
    tokens (the first window's earlier half is empty)."""

    def __init__(self, dim: int, width: int, wide: int, rate: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.width, self.wide, self.rate = width, wide, rate
        self.wkv = linear(dim, wide * width, device, dtype)
        self.wgate = linear(dim, wide * width, device, dtype)
        self.ape = nn.Parameter(torch.zeros(rate, wide * width, device=device, dtype=dtype))
        self.norm = RMSNorm(width, eps, device, dtype)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim), rope the compress table (T, R/2, 2) -> entries (B, T // rate, width)."""
        B, T, _ = x.shape
        n, r, D = T // self.rate, self.rate, self.width
        kv, gate = self.wkv(x), self.wgate(x)
        if n == 0:
            return kv.new_zeros(B, 0, D)
        kv = kv[:, :n * r].view(B, n, r, -1)
        gate = gate[:, :n * r].view(B, n, r, -1) + self.ape
        if self.wide == 2:  # [the previous window's first series, this window's second]
            kv = torch.cat([torch.cat([kv.new_zeros(B, 1, r, D), kv[:, :-1, :, :D]], 1), kv[..., D:]], 2)
            gate = torch.cat([torch.cat([gate.new_full((B, 1, r, D), float("-inf")), gate[:, :-1, :, :D]], 1),
                              gate[..., D:]], 2)
        entries = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        return rope_tail(entries[:, :, None], rope[::r][:n])[:, :, 0]


def before(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:
    """(T, n) bool: which of n entries of windows of `rate` have ended by each query position."""
    return torch.arange(n, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]


class Indexer(nn.Module):
    """The lightning indexer: for each query, the index_topk compressed entries it scores highest among those
    before it (transformers' DeepseekV4Indexer), as a (B, T, n) bool of the entries chosen. Its weights are buffers:
    the choice has no gradient, so transformers gives them none and AdamW leaves them as they are."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.heads, self.head_dim, self.topk = cfg.index_heads, cfg.index_head_dim, cfg.index_topk
        self.compressor = Compressor(cfg.dim, cfg.index_head_dim, 2, cfg.csa_rate, cfg.norm_eps, device, dtype)
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, device, dtype)
        self.weights_proj = linear(cfg.dim, cfg.index_heads, device, dtype)
        for module in list(self.modules()):  # buffers: nothing trains them (full finetuning leaves them as they are)
            for name, p in list(module._parameters.items()):
                if p is not None:  # a linear's absent bias stays None
                    del module._parameters[name]
                    module.register_buffer(name, p.data)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_res: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        keys = self.compressor(x, rope)
        q = rope_tail(self.wq_b(q_res).view(B, T, -1, self.head_dim), rope)
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, T, n)
        seen = before(torch.arange(T, device=x.device), keys.shape[1], self.compressor.rate)
        chosen = torch.zeros_like(index, dtype=torch.bool)
        if keys.shape[1]:
            top = index.masked_fill(~seen, float("-inf")).topk(min(self.topk, keys.shape[1]), dim=-1).indices
            chosen.scatter_(-1, top, True)
        return chosen & seen


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention of layer `layer`'s kind (see the module's docstring); parameter names DeepSeek's."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        self.kind, self.n_heads, self.head_dim = cfg.kind(layer), cfg.n_heads, cfg.head_dim
        self.groups, self.window, self.eps = cfg.o_groups, cfg.sliding_window, cfg.norm_eps
        self.table = 1 if self.kind == "sliding_attention" else 0  # rope_table's local (main) or global (compress)
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank, device, dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device, dtype)
        self.wq_b = linear(cfg.q_lora_rank, cfg.q_dim, device, dtype)
        self.wkv = linear(cfg.dim, cfg.head_dim, device, dtype)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, dtype)
        self.wo_a = linear(cfg.q_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, device, dtype)  # grouped
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, device, dtype)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads, device=device, dtype=dtype))
        self.compressor = self.indexer = None
        if self.kind == "compressed_sparse_attention":
            self.compressor = Compressor(cfg.dim, cfg.head_dim, 2, cfg.csa_rate, cfg.norm_eps, device, dtype)
            self.indexer = Indexer(cfg, device, dtype)
        elif self.kind == "heavily_compressed_attention":
            self.compressor = Compressor(cfg.dim, cfg.head_dim, 1, cfg.hca_rate, cfg.norm_eps, device, dtype)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, start_pos: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) normed; rope (T, 2, R/2, 2): the compress table, then the main one (ops.rope_table). Rows
        packing several examples (mask: packed_layout's each token's example's first position; rope then each row's
        own) run each example alone, its windows and compressed entries its own, as transformers runs it alone."""
        if cache is not None:
            raise ValueError("DeepSeek-V4's compressed attention keeps no cache: generation is not supported")
        if mask is None:
            return self.example(x, rope[:x.shape[1]])
        spans = document_spans(mask)
        return torch.cat([torch.cat([self.example(x[r:r + 1, a:b], rope[r, a:b]) for s, a, b in spans if s == r], 1)
                          for r in range(x.shape[0])])

    def example(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The attention of rows x (B, T, dim) of one example each; rope (T, 2, R/2, 2) from position 0."""
        B, T, _ = x.shape
        own, compress = rope.select(-3, self.table), rope.select(-3, 0)
        q_res = self.q_a_norm(self.wq_a(x))
        q = rope_tail(unweighted_norm(self.wq_b(q_res).view(B, T, self.n_heads, self.head_dim), self.eps), own)
        kv = rope_tail(self.kv_norm(self.wkv(x)).view(B, T, 1, self.head_dim), own).transpose(1, 2)
        seen = attention_mask(T, 0, self.window, x.device)
        seen = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if seen is None else seen
        if self.compressor is not None:
            entries = self.compressor(x, compress)
            n = entries.shape[1]
            chosen = self.indexer(x, q_res, compress) if self.indexer is not None else \
                before(torch.arange(T, device=x.device), n, self.compressor.rate).expand(B, T, n)
            kv = torch.cat([kv, entries[:, None]], dim=2)
            seen = torch.cat([seen.expand(B, T, T), chosen], dim=-1)[:, None]
        out = attend(q.transpose(1, 2), kv, kv, seen, self.head_dim ** -0.5, sinks=self.sinks).transpose(1, 2)
        out = rope_tail(out, own * own.new_tensor([1.0, -1.0]))  # turned back: cos, -sin
        return self.wo_b(self.grouped_output(out.reshape(B, T, self.groups, -1)).flatten(2))

    def grouped_output(self, grouped: torch.Tensor) -> torch.Tensor:
        """wo_a on grouped (B, T, groups, in): each group by its own rows of the weight, as transformers'
        DeepseekV4GroupedLinear views it. With a LoRA (phantom.arch.layers.LoraLinear) the weight is peft's
        W + scale B A, computed low-rank: the one A on every group, then each group's rows of B."""
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        out = torch.einsum("btgi,gri->btgr", grouped, w)
        lora = self.wo_a
        if getattr(lora, "lora_A", None) is None or not lora.enabled:
            return out
        b = lora.lora_B.view(self.groups, -1, lora.lora_B.shape[1])
        return out + torch.einsum("btgk,grk->btgr", lora.lora_input(grouped), b) * lora.scale
