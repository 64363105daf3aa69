"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3, Kimi-K2), as transformers' DeepseekV3Attention
computes it.

Queries go through a low-rank bottleneck (wq_a, its RMSNorm, wq_b; one wq where q_lora_rank is 0, as
DeepSeek-V2-Lite); keys and values come from one latent per token (wkv_a's first kv_lora_rank outputs,
normalised, expanded per head by wkv_b) plus one rotated key shared by every head (wkv_a's last rope_dim
outputs). Each q/k head is qk_nope_head_dim plain dims then rope_dim rotated ones, each v head
v_head_dim wide. DeepSeek-V3.2 and GLM-5 add DeepSeek Sparse Attention (phantom.arch.dsa): past index_topk keys a
query attends to the keys its layer's lightning indexer picks (a GLM-5 layer without one: the picks its indexer
layer carried to it, phantom.arch.carry). Imports phantom.arch.config, phantom.arch.dsa and phantom.arch.ops
(phantom.arch.layers builds it into a block). Parameter names are DeepSeek's own inference code's (wq_a, wkv_b, ...).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from phantom.arch import dsa
from phantom.arch.config import ModelConfig
from phantom.arch.ops import (KVCache, RMSNorm, apply_rope, apply_rope_halves, attend, attention_mask, document_mask,
                              document_spans, linear)
from phantom.arch.tiled import by_documents


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
    takes_carry = True  # a GLM-5 indexer layer's top-k for the layers that share it (phantom.arch.carry)

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
        self.index_topk = cfg.index_topk  # DeepSeek Sparse Attention past this many keys (0: none)
        self.indexer = dsa.Indexer(cfg, device, dtype) if cfg.index_topk and layer not in cfg.index_shared else None

    def sparse(self, keys: int) -> bool:
        """Whether attention over `keys` keys is sparse (more than index_topk: the indexer picks index_topk)."""
        return bool(self.index_topk) and keys > self.index_topk

    def inputs(self, x: torch.Tensor, rope: torch.Tensor, indexed: bool = False) -> tuple[torch.Tensor, ...]:
        """What attention takes from each token, token by token: the queries (B, T, H, nope + R), their last R
        dims rotated, the normalised latent (B, T, kv_lora_rank) and the rotated shared key (B, T, 1, R); with
        `indexed` (a sparse row), this layer's indexer's inputs after them (dsa.Indexer.inputs), if it has one."""
        B, T, _ = x.shape
        q_resid = self.q_a_norm(self.wq_a(x)) if hasattr(self, "wq_a") else None
        q = (self.wq_b(q_resid) if q_resid is not None else self.wq(x)).view(B, T, self.n_heads, self.nope + self.rope_dim)
        q_pass, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.latent, self.rope_dim], dim=-1)
        q = torch.cat([q_pass, self.rotate(q_rot, rope)], dim=-1)
        index = self.indexer.inputs(x, q_resid, rope) if indexed and self.indexer is not None else ()
        return q, self.kv_a_norm(latent), self.rotate(k_rot[:, :, None], rope), *index

    def forward(self, x: torch.Tensor | None, rope: torch.Tensor, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None,
                inputs: tuple[torch.Tensor, ...] | None = None, carry: dict | None = None) -> torch.Tensor:
        """mask: None (causal); packed rows' examples (B, T) (packed_layout: each example attends alone, by_documents,
        no T x T mask; the sparse path alone expands it to the dense mask); or a (B, 1, T, S) bool mask (generation's
        left-padded rows). The cache holds each token's
        normalised latent (k) and rotated shared key (v), not the heads' keys and values. `inputs`:
        self.inputs(x, rope, indexed) computed already (tiled over the row), x then unused. `carry`: where a
        GLM-5 indexer layer leaves its top-k for the layers sharing it, and they find it."""
        if inputs is None:
            inputs = self.inputs(x, rope, indexed=cache is None and self.sparse(x.shape[1]))
        q, latent, k_rot, *index = inputs
        B, T = q.shape[:2]
        if cache is not None:  # queries at start_pos.. see the cached tokens before them
            cache.k[:B, 0, start_pos:start_pos + T] = latent
            cache.v[:B, 0, start_pos:start_pos + T] = k_rot[:, :, 0]
            latent, k_rot = cache.k[:B, 0, :start_pos + T], cache.v[:B, 0, :start_pos + T, None]
        S = latent.shape[1]
        packed = mask is not None and mask.dim() == 2  # packed rows' examples: each token's example's first position
        if self.sparse(S):
            mask = document_mask(mask, q.device) if packed else mask
            if cache is not None:
                raise ValueError(f"{S} keys in a generation's cache: DeepSeek Sparse Attention past index_topk "
                                 f"({self.index_topk}) keys needs its indexer's key cache, which is not kept; "
                                 f"generate up to {self.index_topk} tokens")
            return self.wo(self.attend_sparse(q, latent, k_rot, index, mask, carry).reshape(B, T, -1))
        kv = self.wkv_b(latent).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_pass, k_rot.expand(B, S, self.n_heads, self.rope_dim)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T or S, D)
        if packed:
            out = by_documents(self.alone, q, k, v, document_spans(mask), [])
        else:
            window = attention_mask(T, start_pos if cache is not None else 0, self.window, q.device)
            out = attend(q, k, v, window if mask is None else mask if window is None else mask & window, self.scale)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def alone(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one packed example's (1, H, L, D) q, k, v, its positions from 0, within the layer's window."""
        return attend(q, k, v, attention_mask(q.shape[2], 0, self.window, q.device), self.scale)

    def attend_sparse(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, index: list,
                      mask: torch.Tensor | None, carry: dict | None) -> torch.Tensor:
        """Attention over the keys the indexer picks (dsa.attend_selected): this layer's own picks, left in
        `carry` for the layers sharing them, or (a layer without an indexer) the picks found there."""
        if self.indexer is not None:
            chosen = dsa.select(*index, self.index_topk, mask)
            if carry is not None:
                carry[dsa.SHARED] = chosen
        elif carry is None or dsa.SHARED not in carry:
            raise ValueError("a layer sharing its indexer needs the top-k of the indexer layer before it; run the "
                             "model's blocks in order, from its first")
        else:
            chosen = carry[dsa.SHARED]
        return dsa.attend_selected(q, latent, k_rot[:, :, 0], chosen, mask, self.kv_b_weight(), self.nope, self.scale)

    def kv_b_weight(self) -> torch.Tensor:
        """wkv_b's weight as its forward computes with it: plus its LoRA's update (B A times the scale) where one is
        on (sparse attention multiplies by the weight, not the latents of every key: a LoRA's dropout cannot be)."""
        w, lora = self.wkv_b.weight, self.wkv_b
        if getattr(lora, "lora_A", None) is None or not lora.enabled:
            return w
        if isinstance(lora.dropout, nn.Dropout) and lora.dropout.training and lora.dropout.p > 0:
            raise ValueError("LoRA dropout on kv_b is not computed at rows longer than index_topk (sparse attention "
                             "runs in latent space); train kv_b without dropout, or leave kv_b out of the targets")
        return w + lora.delta_weight()
