"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3, Kimi-K2), as transformers' DeepseekV3Attention
computes it.

Queries go through a low-rank bottleneck (wq_a, its RMSNorm, wq_b; one wq where q_lora_rank is 0, as
DeepSeek-V2-Lite); keys and values come from one latent per token (wkv_a's first kv_lora_rank outputs,
normalised, expanded per head by wkv_b) plus one rotated key shared by every head (wkv_a's last rope_dim
outputs). Each q/k head is qk_nope_head_dim plain dims then rope_dim rotated ones, each v head
v_head_dim wide. Imports phantom.arch.config and phantom.arch.ops only (phantom.arch.layers builds it into
a block). Parameter names are DeepSeek's own inference code's (wq_a, wkv_b, ...).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from phantom.arch.config import ModelConfig, indexer_shapes
from phantom.arch.ops import KVCache, RMSNorm, apply_rope, apply_rope_halves, attend, attention_mask, linear


def softmax_scale(cfg: ModelConfig) -> float:
    """head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim) squared where the rope scaling has one
    (transformers' yarn_apply_mscale: DeepSeek-V3's 40x context makes it 1.37^2)."""
    scale = cfg.head_dim ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim and s.factor > 1:
        m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
        scale *= m * m
    return scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        self.n_heads, self.nope, self.rope_dim = cfg.n_heads, cfg.qk_nope_head_dim, cfg.rope_dim
        self.v_dim, self.latent = cfg.v_head_dim, cfg.kv_lora_rank
        self.scale, self.window = softmax_scale(cfg), cfg.window(layer)
        self.rotate = apply_rope if cfg.rope_interleave else apply_rope_halves
        if cfg.q_lora_rank:
            self.wq_a = linear(cfg.dim, cfg.q_lora_rank, device, dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6, device, dtype)  # transformers' default eps, as it builds it
            self.wq_b = linear(cfg.q_lora_rank, cfg.q_dim, device, dtype)
        else:
            self.wq = linear(cfg.dim, cfg.q_dim, device, dtype)
        self.wkv_a = linear(cfg.dim, cfg.kv_lora_rank + cfg.rope_dim, device, dtype)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, 1e-6, device, dtype)
        self.wkv_b = linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), device, dtype)
        self.wo = linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, device, dtype)
        self.index_topk = cfg.index_topk
        for name, shape in indexer_shapes(cfg).items():  # buffers, unused: at rows of <= index_topk keys it picks all
            *path, leaf = name.removeprefix("attention.").split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, torch.zeros(shape, device=device, dtype=dtype))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)

    def inputs(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What attention takes from each token, token by token: the queries (B, T, H, nope + R), their last R
        dims rotated, the normalised latent (B, T, kv_lora_rank) and the rotated shared key (B, T, 1, R)."""
        B, T, _ = x.shape
        q = self.query(x).view(B, T, self.n_heads, self.nope + self.rope_dim)
        q_pass, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.latent, self.rope_dim], dim=-1)
        q = torch.cat([q_pass, self.rotate(q_rot, rope)], dim=-1)
        return q, self.kv_a_norm(latent), self.rotate(k_rot[:, :, None], rope)

    def forward(self, x: torch.Tensor | None, rope: torch.Tensor, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None,
                inputs: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """mask: None (causal), or (B, 1, T, T) bool for packed rows. The cache holds each token's
        normalised latent (k) and rotated shared key (v), not the heads' keys and values. `inputs`:
        self.inputs(x, rope) computed already (tiled over the row), x then unused."""
        q, latent, k_rot = inputs if inputs is not None else self.inputs(x, rope)
        B, T = q.shape[:2]
        if cache is not None:  # queries at start_pos.. see the cached tokens before them
            cache.k[:B, 0, start_pos:start_pos + T] = latent
            cache.v[:B, 0, start_pos:start_pos + T] = k_rot[:, :, 0]
            latent, k_rot = cache.k[:B, 0, :start_pos + T], cache.v[:B, 0, :start_pos + T, None]
        S = latent.shape[1]
        if self.index_topk and S > self.index_topk:
            raise ValueError(f"{S} keys: DeepSeek Sparse Attention's top-{self.index_topk} selection is not computed; "
                             f"rows up to index_topk ({self.index_topk}) keys attend densely, as it chooses every key")
        kv = self.wkv_b(latent).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_pass, k_rot.expand(B, S, self.n_heads, self.rope_dim)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T or S, D)
        window = attention_mask(T, start_pos if cache is not None else 0, self.window, q.device)
        if mask is None:
            mask = window
        elif window is not None:
            mask = mask & window
        out = attend(q, k, v, mask, self.scale)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))
