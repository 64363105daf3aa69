"""The cost model of scoring many sequences (phantom.train.score), as pure functions a test can check.

Requests are sorted longest first and cut into micro-batches of similar lengths (right padding stays
short); micro-batches are grouped into waves whose hidden states fit a memory budget. Every request of
a wave goes through a block while that block is loaded once, so a wave reads the store once: the
number of waves is the number of passes over the weights, known before any is read.
"""
from __future__ import annotations

from dataclasses import dataclass

from phantom.arch.config import ModelConfig
from phantom.plan.costinputs import keep_elems_per_token
from phantom.stream.placement import CPU_CALL_TOKENS

WAVE_SHARE = 4  # a wave's hidden states take at most 1/4 of free memory
MICRO_SHARE = 8  # one micro-batch's activations inside a block at most 1/8
UNKNOWN_FREE = 4 << 30  # free bytes assumed where no probe answers
CPU_MICRO_TOKENS = CPU_CALL_TOKENS  # an lm-eval task ran 1.5x slower with micro-batches by memory alone


@dataclass(frozen=True)
class ScorePlan:
    """Which requests run together: `micro_batches` holds request indices (longest first), `waves` the
    indices of the micro-batches each wave runs; `padded` the padded tokens of each micro-batch."""

    micro_batches: tuple[tuple[int, ...], ...]
    waves: tuple[tuple[int, ...], ...]
    padded: tuple[int, ...]


@dataclass(frozen=True)
class ScoreBudget:
    """What bounds a plan: bytes a token's hidden states take during a wave, the wave's bytes, the padded
    tokens of one micro-batch and (a batch size asked for) its rows. `boundary`: a length no micro-batch
    straddles (longrope's original context: past it a whole batch turns by the long factors, as transformers
    picks them by the padded length, so a row shares its micro-batch only with rows on its own side)."""

    token_bytes: int
    wave_bytes: int
    micro_tokens: int
    max_rows: int | None = None
    boundary: int | None = None


def token_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """A token's hidden states during a wave: its embedding (kept until the wave ends), a block's input
    and that block's output."""
    return 3 * cfg.dim * itemsize


def budget(cfg: ModelConfig, itemsize: int, free: int | None, max_rows: int | None = None,
           wave_bytes: int | None = None, cpu: bool = False) -> ScoreBudget:
    """The budget from free memory (None: unknown): waves take 1/WAVE_SHARE of it (or `wave_bytes`), a
    micro-batch's activations inside a block 1/MICRO_SHARE (the elements autograd would keep per token
    bound what a forward holds), on a CPU CPU_MICRO_TOKENS tokens at most; a micro-batch has at most `max_rows`
    rows where given."""
    free = free if free is not None else UNKNOWN_FREE
    per_token = max(1, int(keep_elems_per_token(cfg) * itemsize))
    s = cfg.rope_scaling
    boundary = s.original_max_seq_len if s is not None and s.rope_type == "longrope" else None
    return ScoreBudget(token_bytes(cfg, itemsize), wave_bytes if wave_bytes is not None else free // WAVE_SHARE,
                       max(1, min(free // MICRO_SHARE // per_token, CPU_MICRO_TOKENS if cpu else free)), max_rows,
                       boundary)


def plan_scoring(lengths: list[int], b: ScoreBudget) -> ScorePlan:
    """Requests of these token lengths as micro-batches and waves: sorted longest first (ties by index), a
    micro-batch takes the next requests while its rows times its first (longest) length stay within
    b.micro_tokens (its rows within b.max_rows, all on one side of b.boundary), a wave the next micro-batches
    while their padded tokens' hidden states stay within b.wave_bytes. Each holds one at least, whatever its
    size."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last and (len(last) + 1) * lengths[last[0]] <= b.micro_tokens and \
                (b.max_rows is None or len(last) < b.max_rows) and \
                (b.boundary is None or (lengths[last[0]] > b.boundary) == (lengths[i] > b.boundary)):
            last.append(i)
        else:
            batches.append([i])
    padded = [len(m) * lengths[m[0]] for m in batches]
    waves: list[list[int]] = []
    held = 0
    for k, tokens in enumerate(padded):
        if waves and (held + tokens) * b.token_bytes <= b.wave_bytes:
            waves[-1].append(k)
            held += tokens
        else:
            waves.append([k])
            held = tokens
    return ScorePlan(tuple(map(tuple, batches)), tuple(map(tuple, waves)), tuple(padded))


def describe(plan: ScorePlan, requests: int, b: ScoreBudget) -> str:
    """The plan in one line: requests, micro-batches, waves (each one read of every block), the largest
    wave's hidden states."""
    largest = max((sum(plan.padded[k] for k in w) for w in plan.waves), default=0) * b.token_bytes
    counts = [_count(requests, "request", "requests"), _count(len(plan.micro_batches), "micro-batch", "micro-batches"),
              _count(len(plan.waves), "wave", "waves")]
    return f"scoring {counts[0]} in {counts[1]} and {counts[2]} (each reads every block once; the largest holds " \
           f"{largest / 2**20:.1f} MiB of hidden states)"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
