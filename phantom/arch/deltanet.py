"""Gated DeltaNet: the linear attention of Qwen3-Next and Qwen3.5, as transformers' torch implementation
computes it (its GatedDeltaNet module with torch_chunk_gated_delta_rule).

Each token's q, k, v pass a short causal depthwise convolution and SiLU; q and k are L2-normalised per head,
q scaled by its width^-1/2. A state S (k_dim x v_dim per value head) is decayed by exp(g) and corrected
towards each value by the delta rule, S <- exp(g) S + beta k (v - k^T exp(g) S)^T; the output q^T S goes
through an RMSNorm gated by silu(z), then out_proj. Training computes it in chunks of 64 tokens (the UT
transform inside a chunk, one state update between chunks), as the recurrence written out per token would but
in a few matmuls. Imports phantom.arch.config and phantom.arch.ops only (phantom.arch.layers builds it into a
block in place of attention: a block is still the unit of streaming and recompute).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch.config import ModelConfig
from phantom.arch.ops import ACTIVATIONS, KVCache, linear

CHUNK = 64  # tokens per chunk of the delta rule (transformers' chunk_size)


def mixer_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the token mixing beyond the projections' matmuls, averaged over the layers: a
    full-attention layer's causal scores and weighted values (2 T q_dim), a Gated DeltaNet layer's chunked delta
    rule (per value head: k k^T, q k^T and the within-chunk values, 2 C (2 Dk + Dv), the two triangular solves,
    C (Dk + Dv), and three state products, 6 Dk Dv), independent of T; the conv's taps are few."""
    full = 2 * seq_len * cfg.q_dim
    chunk = min(CHUNK, seq_len)
    linear = cfg.linear_v_heads * (chunk * (5 * cfg.linear_k_dim + 3 * cfg.linear_v_dim)
                                   + 6 * cfg.linear_k_dim * cfg.linear_v_dim)
    n_linear = sum(cfg.linear(i) for i in range(cfg.n_layers))
    return (n_linear * linear + (cfg.n_layers - n_linear) * full) / cfg.n_layers


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk: int = CHUNK, state: torch.Tensor | None = None):
    """The gated delta rule over a sequence from a zero state (or `state`), in fp32, chunk tokens at a time.

    Args:
        q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv), each q/k head serving Hv / Hk consecutive value heads.
        g: (B, T, Hv) log decay (<= 0); beta: (B, T, Hv) write strength in (0, 1).
        state: (B, Hv, Dk, Dv) fp32, the state before the first token (a generation's cache), or None (zero).
    Returns:
        (B, T, Hv, Dv) in q's dtype; with `state` given, also the state after the last token (a padded chunk's
        tokens decay nothing and write nothing: g and k are zero there)."""
    dtype, (B, T, Hk, Dk), Hv = q.dtype, k.shape, v.shape[2]
    if Hk != Hv:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))  # (B, H, T, ...)
    q, k = l2norm(q), l2norm(k)
    q = q * Dk ** -0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(B, Hv, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(B, Hv, n, chunk).cumsum(-1)  # decay from the chunk's start to each token, in log space
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(later, float("-inf")).exp()  # token j -> token i
    # the UT transform: (I + tril(beta k k^T decay, -1)) solved against the writes, as one triangular solve
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # within the chunk, causal (the diagonal included)
    q_decayed = q * g.exp()[..., None]
    k_rest = k * (g[..., -1:] - g).exp()[..., None]  # each key decayed to the chunk's end
    chunk_decay = g[..., -1].exp()[..., None, None]
    given = state is not None
    state = q.new_zeros(B, Hv, Dk, v.shape[-1]) if state is None else state.float()
    out = []
    # each chunk's slices taken once by unbind: a slice indexed in the loop would, in backward, zero-fill a
    # tensor of the whole sequence for each chunk (quadratic in the length: 70% of a block's step at 8192 tokens)
    for u_i, w_i, qd_i, inner_i, decay_i, k_i in zip(*(t.unbind(2) for t in (u, w, q_decayed, inner, chunk_decay,
                                                                              k_rest))):
        v_new = u_i - w_i @ state  # what the state does not already predict
        out.append(qd_i @ state + inner_i @ v_new)
        state = state * decay_i + k_i.transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(B, Hv, n * chunk, -1)[:, :, :T].transpose(1, 2).to(dtype)
    return (o, state) if given else o


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token from `state` (transformers' torch_recurrent_gated_delta_rule, which
    its generation runs for each new token): shapes as chunk_gated_delta_rule's; returns the outputs and the
    state after the last token."""
    dtype, Hk, Dk, Hv = q.dtype, k.shape[2], k.shape[3], v.shape[2]
    if Hk != Hv:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).float() for t in (q, k, v, beta, g))  # (B, H, T, ...)
    q, k = l2norm(q) * Dk ** -0.5, l2norm(k)
    state, out = state.float(), []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype), state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) * silu(gate), over the last dim, in fp32 (transformers' RMSNormGated)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


class _Conv(nn.Module):
    """The depthwise causal convolution's weight (channels, 1, taps), named as the checkpoint's conv1d."""

    def __init__(self, channels: int, taps: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps, device=device, dtype=dtype))


class _GateNorm(nn.Module):
    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))


class GatedDeltaNet(nn.Module):
    """A linear-attention token mixer with attention's call signature (rope, cache and start_pos unused)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        self.hk, self.dk, self.hv, self.dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_heads, cfg.linear_v_dim
        self.key, self.value = self.hk * self.dk, self.hv * self.dv
        self.grouped, self.eps, self.act = cfg.linear_grouped, cfg.norm_eps, ACTIVATIONS[cfg.activation]
        if self.grouped:
            self.in_proj_qkvz = linear(cfg.dim, 2 * self.key + 2 * self.value, device, dtype)
            self.in_proj_ba = linear(cfg.dim, 2 * self.hv, device, dtype)
        else:
            self.in_proj_qkv = linear(cfg.dim, 2 * self.key + self.value, device, dtype)
            self.in_proj_z = linear(cfg.dim, self.value, device, dtype)
            self.in_proj_b = linear(cfg.dim, self.hv, device, dtype)
            self.in_proj_a = linear(cfg.dim, self.hv, device, dtype)
        self.conv1d = _Conv(2 * self.key + self.value, cfg.linear_conv, device, dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, device=device, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.hv, device=device, dtype=dtype))
        self.norm = _GateNorm(self.dv, device, dtype)
        self.out_proj = linear(self.value, cfg.dim, device, dtype)

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """qkv (B, T, 2 key + value) before the convolution, z (B, T, Hv, Dv), b and a (B, T, Hv)."""
        B, T, _ = x.shape
        if not self.grouped:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(B, T, self.hv, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        r = self.hv // self.hk  # value heads a key head serves: its q, k, then r v heads, r z heads; r b's, r a's
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv],
                                                                          dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, self.hk, 2 * r).split([r, r], -1)
        qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(B, T, self.hv, self.dv), b.reshape(B, T, self.hv), a.reshape(B, T, self.hv)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """One sequence (no packing) through the mixer: (B, T, dim) -> (B, T, dim)."""
        B, T, _ = x.shape
        qkv, z, b, a = self.inputs(x)
        w = self.conv1d.weight
        qkv = self.act(F.conv1d(qkv.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T])
        q, k, v = qkv.transpose(1, 2).split([self.key, self.key, self.value], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, Hv) log decay
        out = chunk_gated_delta_rule(q.reshape(B, T, self.hk, self.dk), k.reshape(B, T, self.hk, self.dk),
                                     v.reshape(B, T, self.hv, self.dv), g, b.sigmoid())
        return self.out_proj(gated_rms_norm(out, z, self.norm.weight, self.eps).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None, or (B, 1, T, T) bool of packed rows: each example then runs alone (its state from zero).
        With a cache (generation), mask is the batch's (B, 1, T, start_pos + T) of left-padded rows."""
        if cache is not None:
            return self.step(x, cache, start_pos, mask)
        if mask is None:
            return self.mix(x)
        starts = mask[:, 0].int().argmax(dim=-1)  # (B, T): the first key each token sees, its example's start
        rows = []
        for r in range(x.shape[0]):
            edges = [0, *(torch.nonzero(starts[r, 1:] != starts[r, :-1]).flatten() + 1).tolist(), x.shape[1]]
            rows.append(torch.cat([self.mix(x[r:r + 1, s:e]) for s, e in zip(edges, edges[1:])], dim=1))
        return torch.cat(rows)

    def step(self, x: torch.Tensor, cache: KVCache, start_pos: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The next T tokens of each row from the state in `cache` (updated in place): a prompt in chunks, a
        generated token by the recurrence, as transformers' generation runs them. A left-padded row's pads are
        zeroed first (its apply_mask_to_padding_states): zero inputs leave a zero state zero, so the row computes
        what it does alone; the last query's mask row tells which of the new tokens are real."""
        B, T, _ = x.shape
        if mask is not None:
            x = x * mask[:, 0, -1, start_pos:start_pos + T, None].to(x.dtype)
        qkv, z, b, a = self.inputs(x)
        w = self.conv1d.weight
        seq = torch.cat([cache.k[:B].to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # (B, C, taps - 1 + T)
        cache.k[:B] = seq[..., seq.shape[-1] - cache.k.shape[-1]:]
        qkv = self.act(F.conv1d(seq, w, groups=w.shape[0]))  # (B, C, T): the convolution's valid outputs
        q, k, v = qkv.transpose(1, 2).split([self.key, self.key, self.value], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        out, cache.v[:B] = rule(q.reshape(B, T, self.hk, self.dk), k.reshape(B, T, self.hk, self.dk),
                                v.reshape(B, T, self.hv, self.dv), g, b.sigmoid(), state=cache.v[:B])
        return self.out_proj(gated_rms_norm(out, z, self.norm.weight, self.eps).reshape(B, T, -1))
