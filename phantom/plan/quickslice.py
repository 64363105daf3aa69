"""A quick profile in bounded time: a block's compute measured on a slice of it and scaled by FLOPs.

A 70B-shaped block's forward over one row of 128 tokens is ~220 GFLOP; a profile times dozens of such
calls, which on a 2-core CPU with bf16 emulated in software (~30 GFLOP/s) is many minutes. The rates a
profile keeps are per FLOP and per byte (phantom.plan.costinputs), so they can be measured on a block
of the same width, narrower: the same dim (every matmul's inner or outer size, the residual stream),
1/k of the attention heads and of the MLP's hidden width (each matmul with 1/k of its rows or
columns), 1/k of the vocabulary for the head. `slice_factor` chooses k from a matmul rate timed first
so that the compute measurement takes about `QUICK_COMPUTE_S` (phantom.plan.computetimer.matmul_rate
times that rate). Where bf16 is emulated on a CPU, a block's matmuls run at a rate that falls with their
width (a 1/64 70B block's backward at a tenth of the whole block's per FLOP), so no line through narrow slices
finds the whole block: there the whole block is timed over two shorter rows (`token_lengths`) and put on the
line in FLOPs through them, as slices are. Pure functions: no clocks here. notes/quick-profile.md records the
error of this scaling against full measurements (7B and 70B shapes, fp32, bf16 native and emulated).
"""
from __future__ import annotations

import dataclasses

from phantom.arch.config import ModelConfig
from phantom.plan import costinputs as ci

QUICK_COMPUTE_S = 12.0  # what a quick profile's compute measurement aims to take (it may take ~2x)
SHORT_ROWS_S = 4 * QUICK_COMPUTE_S  # the whole block over two short rows (bf16 emulated) may take this long
MIN_TOKENS = 8  # the shorter of those rows, at least
MIN_WIDTH = 64  # a sliced hidden width stays a multiple of this (the quantized formats' block size)
MAX_FACTOR = 64
QUICK_REPEATS = 3  # timed calls of each kind a quick profile takes the median of: one disturbed call of three
# (a shared machine's other work) does not move it, where the mean of two moves with it
CALLS_PER_ROW = 5 * QUICK_REPEATS + 6  # forwards' worth of block calls a quick profile makes per row (measured_fwds)


def measured_fwds(rows: int) -> int:
    """Forwards of one row the compute measurement runs, roughly: at 1 row and at `rows` (the largest power
    of two dividing them), per row and r = QUICK_REPEATS: r + 2 forwards (warm-ups and timed), r + 1 graph
    forwards with their backwards (~2 forwards each), r + 1 forwards beside a reader."""
    hi = rows & -rows  # the largest power of two dividing rows
    return CALLS_PER_ROW * (1 + (hi if hi > 1 else 0))


def estimate_s(shape: ci.Shape, rows: int, rate: float) -> float:
    """Seconds the compute measurement of `shape` takes at `rate` FLOP/s (a matmul's: blocks run slower)."""
    return (measured_fwds(rows) * shape.flops_per_row + (QUICK_REPEATS + 1) * shape.head_flops_per_row) / rate


def slice_config(cfg: ModelConfig, k: int) -> ModelConfig:
    """cfg with 1/k of its heads (kv heads at least 1, the q heads a multiple of them), MLP and experts'
    widths and vocabulary; the same dim, head width and depth. k = 1: cfg itself."""
    if k == 1:
        return cfg
    kv = max(1, cfg.kv_heads // k)
    heads = kv * max(1, round(cfg.n_heads / k / kv))
    return dataclasses.replace(
        cfg, n_heads=heads, n_kv_heads=kv, explicit_head_dim=cfg.head_dim, intermediate_size=cfg.hidden_dim // k,
        vocab_size=max(MIN_WIDTH, cfg.vocab_size // k), expert_dim=cfg.expert_dim // k,
        shared_expert_dim=cfg.shared_expert_dim // k)


def can_slice(cfg: ModelConfig, k: int) -> bool:
    """The widths 1/k keeps are whole: the hidden widths multiples of MIN_WIDTH, at least one head."""
    widths = [w for w in (cfg.hidden_dim, cfg.expert_dim, cfg.shared_expert_dim) if w]
    return k <= MAX_FACTOR and cfg.n_heads >= k and all(w % (k * MIN_WIDTH) == 0 for w in widths)


def slice_factor(cfg: ModelConfig, work: ci.Workload, rate: float, budget_s: float | None = None) -> int:
    """The smallest power of two k for which the sliced block's compute measures within budget_s
    (default QUICK_COMPUTE_S) at `rate` FLOP/s (1 where the whole block does; the largest that slices
    evenly where none does), made 4x wider where that leaves room for a `lever_slice` beside it."""
    budget_s = QUICK_COMPUTE_S if budget_s is None else budget_s
    k = 1
    while estimate_s(ci.shape_of(slice_config(cfg, k), work.store_dtype, work.dtype, work.seq_len), work.rows,
                     rate) > budget_s and can_slice(cfg, 2 * k):
        k *= 2
    if k > 1 and lever_slice(cfg, k) is None and lever_slice(cfg, max(1, k // 4)) is not None:
        k = max(2, k // 4)  # wider than the budget asks, with a narrower slice beside it: the narrowest
        # slices alone are mostly what does not shrink (a 1/64 70B block's bf16 step scaled alone: 3x too slow)
    return k


def token_lengths(cfg: ModelConfig, work: ci.Workload, rate: float) -> tuple[int, int] | None:
    """The two row lengths, a quarter and an eighth of work.seq_len, over which the whole block is timed where its
    width must not be sliced, or None where the shorter is under MIN_TOKENS or timing both would take longer
    than SHORT_ROWS_S at `rate`."""
    lengths = (work.seq_len // 4, work.seq_len // 8)
    if lengths[1] < MIN_TOKENS:
        return None
    est = sum(estimate_s(ci.shape_of(cfg, work.store_dtype, work.dtype, t), 1, rate) for t in lengths)
    return lengths if est <= SHORT_ROWS_S else None


def points(cfg: ModelConfig, work: ci.Workload, rate: float, emulated: bool = False) -> list[tuple[int, int]]:
    """What a quick profile times, as (slice k, tokens a row), the most FLOPs first: [(1, seq_len)] where the
    whole block times quickly; else two slices 1/k and the lever beside it (one where there is none), timed at
    one row; where bf16 is `emulated` on a CPU, the whole block over two short rows (token_lengths) if that
    fits."""
    if slice_factor(cfg, work, rate) == 1:
        return [(1, work.seq_len)]
    if emulated and (lengths := token_lengths(cfg, work, rate)) is not None:
        return [(1, t) for t in lengths]
    k = max(2, slice_factor(cfg, dataclasses.replace(work, rows=1), rate))
    return [(n, work.seq_len) for n in (k, lever_slice(cfg, k)) if n is not None]


def lever_slice(cfg: ModelConfig, k: int) -> int | None:
    """The second, narrower slice a quick profile times beside 1/k: the narrowest that slices evenly, if it
    has at most a quarter of 1/k's width (a lever long enough to tell what shrinks from what does not);
    None where there is none (a 7B's MLP halves evenly only twice)."""
    if k == 1:
        return None
    narrow = k
    while can_slice(cfg, 2 * narrow):
        narrow *= 2
    return narrow if narrow >= 4 * k else None


def scaled_times(points: list[tuple[dict, ci.Shape]], whole: ci.Shape) -> dict:
    """computetimer.measure_compute's times of the whole block from those of its slices (or of itself over
    shorter rows: `points`).

    One slice (or the block itself): each kind of call's per-row seconds and the head's scaled by FLOPs.
    Two: on the line through them in FLOPs, so what a slice does not shrink (norms and residual adds
    over the full width, LoRA's input projections, the casts and per-call work: ~0.4 s of a 1/64 70B
    block's bf16 forward here, most of it) is counted once, not k times; the line falls back to the
    scaling where noise makes it slope down. Kept bytes per row are on the line through the two in the config's
    estimate of them (one point: scaled by it); per-call seconds are kept."""
    (c1, s1), rest = points[0], points[1:]
    out = dict(c1)
    # kept bytes in the config's estimate of them: a slice keeps full-width tensors its estimate scales down (70B
    # fp32: 1/4 and 1/64 keep 0.84x and 0.74x their estimates, the whole block 0.99x; the line gives it within 0.1%)
    for name, size in (("keep_bytes_per_row", "keep_bytes_per_row"), ("fwd_row_s", "flops_per_row"),
                       ("fwd_grad_row_s", "flops_per_row"), ("bwd_row_s", "flops_per_row"),
                       ("head_row_s", "head_flops_per_row")):
        x1, x = getattr(s1, size), getattr(whole, size)
        out[name] = c1[name] * x / x1
        if rest and getattr(rest[0][1], size) < x1:  # (a vocabulary at its floor does not shrink)
            (c2, s2), = rest
            slope = (c1[name] - c2[name]) / (x1 - getattr(s2, size))
            if slope > 0:
                out[name] = c1[name] + slope * (x - x1)
    return out