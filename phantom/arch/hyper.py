"""DeepSeek-V4's block: hyper-connections around its compressed attention and its mixture of experts, as
transformers' DeepseekV4DecoderLayer computes them.

The residual is cfg.hc_mult streams, (B, T, hc_mult, dim), from the embedding (copied into each) to the head (mixed
into one by hyper_head). Before attention and before the MLP, a hyper-connection reads the streams (flattened,
normed without a weight) through one matrix (fn) into three sets of weights: `pre` mixes the streams into the
sublayer's input, `post` spreads its output back over them, and `comb`, a matrix made doubly stochastic by
hc_iters Sinkhorn steps, mixes the streams themselves: new streams = post * out + comb^T streams. Weights are
computed in fp32 and the streams kept in the block's dtype, as there. Blocks carry the streams between them as the
residual (the executor splits rows on dim 0 whatever the width). Imports config, ops, moe and compressed.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from phantom.arch.compressed import CompressedAttention, unweighted_norm
from phantom.arch.config import ModelConfig
from phantom.arch.moe import MoeFeedForward
from phantom.arch.ops import ACTIVATIONS, RMSNorm


class HyperConnection(nn.Module):
    """One hyper-connection's weights: fn ((2 + n) n, n dim), base ((2 + n) n), scale (3) (pre, post, comb)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.hc_iters, cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.dim, device=device, dtype=dtype))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, device=device, dtype=dtype))
        self.scale = nn.Parameter(torch.ones(3, device=device, dtype=dtype))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (B, T, n, dim) -> post (B, T, n), comb (B, T, n, n) in fp32 and the streams mixed by pre (B, T, dim)."""
        n = self.n
        mixes = F.linear(unweighted_norm(h.flatten(2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn: rows, then columns, to sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


def spread(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams: post * the sublayer's output (B, T, dim) plus comb^T (over the first axis) times h."""
    return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


def hyper_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               norm_eps: float) -> torch.Tensor:
    """The streams (B, T, n, dim) mixed into one (B, T, dim) before the final norm (DeepseekV4HyperHead)."""
    mixes = F.linear(unweighted_norm(h.flatten(2).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


class HyperBlock(nn.Module):
    """DeepSeek-V4's block `layer` over the streams (B, T, hc_mult, dim). Names as TransformerBlock's where they are
    the same things (attention, attention_norm, feed_forward, ffn_norm) beside hc_attn and hc_ffn. With
    checkpoint_inner, each half is checkpointed where a graph is built; mlp_chunk is not used (rows run whole)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        self.hc_attn = HyperConnection(cfg, device, dtype)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.attention = CompressedAttention(cfg, device, dtype, layer)
        self.hc_ffn = HyperConnection(cfg, device, dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.feed_forward = MoeFeedForward(cfg, ACTIVATIONS[cfg.activation], device, dtype, layer)
        self.checkpoint_inner = False
        self.mlp_chunk: int | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, start_pos: int = 0,
                mask: torch.Tensor | None = None, carry: dict | None = None) -> torch.Tensor:
        return self.residual_mlp(self.attention_half(x, rope, cache, start_pos, mask), carry)

    def attention_half(self, x: torch.Tensor, rope: torch.Tensor, cache=None, start_pos: int = 0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """The streams after attention: what the MLP half reads."""
        if self.checkpoint_inner and torch.is_grad_enabled() and cache is None:
            return checkpoint(self._attention_half, x, rope, mask, use_reentrant=False)
        return self._attention_half(x, rope, mask, cache, start_pos)

    def _attention_half(self, x, rope, mask=None, cache=None, start_pos: int = 0) -> torch.Tensor:
        post, comb, collapsed = self.hc_attn(x)
        return spread(x, self.attention(self.attention_norm(collapsed), rope, cache, start_pos, mask), post, comb)

    def router_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the router reads of the streams after attention: their mix, normed, (N, dim)."""
        return self.ffn_norm(self.hc_ffn(h)[2]).reshape(-1, h.shape[-1])

    def residual_mlp(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """The streams after the MLP half: the block's output."""
        if self.checkpoint_inner and torch.is_grad_enabled():
            return checkpoint(self._residual_mlp, h, carry, use_reentrant=False)
        return self._residual_mlp(h, carry)

    def _residual_mlp(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        post, comb, collapsed = self.hc_ffn(h)
        return spread(h, self.feed_forward(self.ffn_norm(collapsed), carry), post, comb)


class HyperHead(nn.Module):
    """The head's mix of the streams (hyper_head's weights: fn (n, n dim), base (n), scale (1)), named as the store's
    hc_head.*: the model holds it beside the final norm, trained with it in full finetuning."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], trained: bool):
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.norm_eps
        for name in ("fn", "base", "scale"):
            self.register_parameter(name, nn.Parameter(weights[f"hc_head.{name}"], requires_grad=trained))

    @classmethod
    def of(cls, cfg: ModelConfig, head: dict[str, torch.Tensor], device, dtype, trained: bool) -> "HyperHead | None":
        """The model's mix from its head's tensors (on device, in dtype); None without hyper-connections."""
        return cls(cfg, {k: v.to(device, dtype) for k, v in head.items()}, trained) if cfg.hc_mult else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return hyper_head(h, self.fn, self.base, self.scale, self.eps, self.norm_eps)

    def mix(self, out, pair: bool):
        """The blocks' output mixed: one hidden state, or each of a (policy, reference) pair."""
        return (self(out[0]), self(out[1])) if pair else self(out)


def streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """The embedding (B, T, dim) as n residual streams (B, T, n, dim), each a copy; n 0: h as it is."""
    return h[:, :, None].expand(-1, -1, n, -1).contiguous() if n else h
