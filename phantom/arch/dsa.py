"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) as transformers' DeepseekV32Attention and GlmMoeDsaAttention
compute it, for rows longer than index_topk keys (at most index_topk keys: the indexer picks every one, and
phantom.arch.mla attends densely).

The lightning indexer scores every key for each query, sum_h w_h relu(q_h . k) / sqrt(D): q_h from the q
bottleneck, one key from the hidden state (LayerNorm), RoPE on their leading rope_dim dims (in halves on V3.2,
in pairs on GLM-5, each laid out as transformers lays it), w from the hidden state in fp32. transformers runs it
under torch.no_grad, and so does phantom: its weights never train, its choice passes no gradient. Each query
then attends to its index_topk best keys alone (those it may see: a query near the row's start picks fewer real
ones), in latent space: every head's key and value is wkv_b times one latent per token, so a query's plain part
is taken into the latent's space (q W_k), its output out of it (W_v o), and only the chosen tokens' latents and
rotated keys are gathered, never the heads' keys and values.

Both run a chunk of queries at a time, sized to CHUNK_BYTES: the indexer's scores are (chunk, heads, keys), the
attention's gathered latents (chunk, topk, kv_lora_rank + rope_dim); the attention is one phantom.arch.tiled node
that keeps its inputs and recomputes each chunk in its backward, so memory grows as T * topk, not T^2.
Imports phantom.arch.config, phantom.arch.ops and phantom.arch.tiled.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch.config import ModelConfig, indexer_shapes
from phantom.arch.ops import apply_rope_halves
from phantom.arch.tiled import tiled

CHUNK_BYTES = 128 << 20  # a chunk of queries' scores (indexer) or gathered latents and scores (attention)
SHARED = "index_topk"  # the carried top-k (phantom.arch.carry) a GLM-5 indexer layer hands to its shared layers


class Indexer(nn.Module):
    """The lightning indexer's weights as buffers under transformers' names (wq_b.weight, wk.weight, k_norm.weight,
    k_norm.bias, weights_proj.weight): the model swaps them in as any weight, and nothing trains them."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.heads, self.head_dim, self.pairs = cfg.index_heads, cfg.index_head_dim, cfg.index_pairs
        for name, shape in indexer_shapes(cfg).items():
            part, leaf = name.removeprefix("attention.indexer.").split(".")
            if not hasattr(self, part):
                self.add_module(part, nn.Module())
            getattr(self, part).register_buffer(leaf, torch.zeros(shape, device=device, dtype=dtype))

    @torch.no_grad()
    def inputs(self, x: torch.Tensor, q_resid: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the indexer takes from each token (no autograd): its queries (B, T, H, D) and key (B, T, D), rotated,
        and the heads' weights (B, T, H) in fp32, times H^-1/2."""
        B, T, _ = x.shape
        q = F.linear(q_resid, self.wq_b.weight).view(B, T, self.heads, self.head_dim)
        k = F.layer_norm(F.linear(x, self.wk.weight), (self.head_dim,), self.k_norm.weight, self.k_norm.bias, 1e-6)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.heads ** -0.5  # fp32, as transformers keeps it
        return rotate(q, rope, self.pairs), rotate(k[:, :, None], rope, self.pairs)[:, :, 0], w


def rotate(x: torch.Tensor, rope: torch.Tensor, pairs: bool) -> torch.Tensor:
    """RoPE on x's leading rope dims (the rest pass), laid out as transformers lays them: halves (i, i + R/2) in
    place; pairs (2i, 2i+1) rotated into halves (evens then odds), as its apply_rotary_pos_emb_interleave returns them."""
    r = 2 * rope.shape[-2]
    turned = torch.cat([x[..., 0:r:2], x[..., 1:r:2]], dim=-1) if pairs else x[..., :r]
    return torch.cat([apply_rope_halves(turned, rope), x[..., r:]], dim=-1)


def visible(mask: torch.Tensor | None, a: int, b: int, keys: int, device) -> torch.Tensor:
    """Which keys queries a..b-1 may see: (1, b - a, keys) causal, or the packed rows' mask (B, b - a, keys)."""
    if mask is not None:
        return mask[:, 0, a:b]
    return (torch.arange(keys, device=device)[None, :] <= torch.arange(a, b, device=device)[:, None])[None]


def rows_per_chunk(per_query: int) -> int:
    """Queries a chunk holds within CHUNK_BYTES (at least one), per_query bytes each (the batch's rows together)."""
    return max(1, CHUNK_BYTES // max(per_query, 1))


@torch.no_grad()
def select(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Each query's top-k keys by the indexer's scores (B, T, topk) int32, as DeepseekV32Indexer.forward ranks them
    (fp32 scores, ReLU, the heads' weighted sum; keys a query may not see at -inf), a chunk of queries at a time."""
    B, T, H, D = q.shape
    S = k.shape[1]
    keys = k.transpose(-1, -2).float().unsqueeze(1)  # (B, 1, D, S)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=q.device)
    chunk = rows_per_chunk(8 * B * H * S)
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        scores = F.relu(torch.matmul(q[:, a:b].float(), keys) * D ** -0.5)  # (B, Q, H, S)
        index = torch.matmul(w[:, a:b].unsqueeze(-2), scores).squeeze(-2)  # (B, Q, S)
        index = index.masked_fill(~visible(mask, a, b, S, q.device), float("-inf"))
        out[:, a:b] = index.topk(topk, dim=-1).indices
    return out


def attend_selected(q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, chosen: torch.Tensor,
                    mask: torch.Tensor | None, kv_b: torch.Tensor, nope: int, scale: float) -> torch.Tensor:
    """Latent attention of each query over its chosen keys alone: q (B, T, H, nope + R) rotated, latent (B, S, L)
    normalised, k_rot (B, S, R) rotated, chosen (B, T, K) key indices, kv_b (H * (nope + V), L) wkv_b's weight (its
    LoRA's update added). Returns (B, T, H, V): softmax over the chosen keys a query may see, as transformers' mask
    of the unchosen gives it, its keys and values computed in latent space."""
    B, T, H, _ = q.shape
    K, L, R = chosen.shape[-1], latent.shape[-1], k_rot.shape[-1]
    heads = kv_b.view(H, -1, L)
    w_k, w_v = heads[:, :nope], heads[:, nope:]  # (H, nope, L), (H, V, L)
    rows = torch.arange(B, device=q.device)[:, None, None]

    def chunk_out(qc: torch.Tensor, a: int) -> torch.Tensor:
        ids = chosen[:, a:a + qc.shape[1]].long()
        seen = visible(mask, a, a + qc.shape[1], latent.shape[1], q.device)
        seen = seen.expand(B, -1, -1).gather(-1, ids)  # (B, Q, K): chosen keys it may see
        keys, rot = latent[rows, ids], k_rot[rows, ids]  # (B, Q, K, L), (B, Q, K, R)
        q_nope, q_rot = qc.split([nope, qc.shape[-1] - nope], dim=-1)
        q_latent = torch.einsum("bqhn,hnl->bqhl", q_nope, w_k)  # the plain part in the latent's space
        scores = (torch.einsum("bqhl,bqkl->bqhk", q_latent, keys) + torch.einsum("bqhr,bqkr->bqhk", q_rot, rot)) * scale
        probs = F.softmax(scores.masked_fill(~seen[:, :, None], float("-inf")).float(), dim=-1).type_as(qc)
        return torch.einsum("bqhl,hvl->bqhv", torch.einsum("bqhk,bqkl->bqhl", probs, keys), w_v)
    per_query = B * (K * (L + R) * latent.element_size() + 3 * H * K * 4)
    return tiled(chunk_out, q, rows_per_chunk(per_query), [], tensors=(latent, k_rot, w_k, w_v))
