"""The cost model of batched generation (phantom.model.generate), as pure functions.

A decode step of B live sequences runs every block over B tokens while each block is loaded once, so a streamed
step costs what a training forward's pass costs in loads and what B tokens cost in compute:

    step(B) = rest(B) + sum over resident blocks of c(B) + pipe(c(B))       (phantom.plan.costmodel.pipe_s)
    c(B)    = a block's decode call over B sequences                        measured on held blocks (GenRates)
    prefill = the same with c over the prompts' tokens (a batch's P tokens a row, B rows)

rest(B) is what runs outside the blocks (embedding, head, sampling), measured beside them. A batch of N new
tokens takes a prefill and N - 1 steps, and reads each streamed block N times whatever B is: the reads are
shared, the compute grows with B, so tokens/s grows with B until the compute is as long as the reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from phantom.plan import costmodel
from phantom.plan.costinputs import LoadTimes, MachineProfile, Shape
from phantom.stream.placement import Placement, cycle_loads


@dataclass(frozen=True)
class GenRates:
    """Seconds measured on a resident model (phantom.plan.gentimer) at a few sizes each, read between them on
    the line through the two nearest (beyond them, through the last two): one block's decode call over B
    sequences (`decode`: (B, s) points), what runs beside the blocks in that step (`rest`), one block's prefill
    over T prompt tokens (`prefill`: (T, s) points). A matmul over a few rows is not a line in the rows (an
    8-row call ran 1.5x what the line through 1 and 64 rows said), hence points, not a slope."""
    decode: tuple[tuple[int, float], ...]
    rest: tuple[tuple[int, float], ...]
    prefill: tuple[tuple[int, float], ...]

    def block_s(self, rows: int) -> float:
        return between(self.decode, rows)

    def rest_s(self, rows: int) -> float:
        return between(self.rest, rows)

    def prefill_s(self, tokens: int) -> float:
        return between(self.prefill, tokens)


def between(points: tuple[tuple[int, float], ...], x: int) -> float:
    """y at x on the line through the two measured points around it (the last two past the ends), not below 0."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    k = next((i for i in range(1, len(pts)) if x <= pts[i][0]), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[k - 1], pts[k]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class GenPrediction:
    """A generation run predicted: seconds, new tokens per second, the block loads over the run (in the rhythm
    of steps that follow one another: phantom.stream.placement.cycle_loads), its batches and passes."""
    seconds: float
    tokens_per_s: float
    loads: int
    batches: int
    steps: int
    step_s: float  # a full batch's decode step
    prefill_s: float  # a full batch's prefill


def step_s(rates: GenRates, profile: MachineProfile, shape: Shape, placement: Placement, rows: int,
           tokens: int | None = None) -> float:
    """Seconds of one pass over the blocks for `rows` sequences: a decode step, or with `tokens` (the
    tokens of every row together) a prefill."""
    lay = costmodel.layout(shape, profile, placement)
    c = rates.prefill_s(tokens) if tokens is not None else rates.block_s(rows)
    cs = [c] * shape.n_blocks
    cold = profile.disk_warm_gbps is None or lay.tiers.count("disk") * shape.block_bytes > \
        (profile.free_host_bytes or 0) * (1 - costmodel.MARGIN)
    t = LoadTimes.of_block(profile, shape, lay.tiers, warm=not cold)
    still = shape.n_blocks - len(lay.streamed)
    rest = rates.rest_s(rows)
    return rest + still * c + costmodel.pipe_s(cs, list(cycle_loads(lay.streamed, lay.slots)), lay, t, profile)


def predict_generation(rates: GenRates, profile: MachineProfile, shape: Shape, placement: Placement,
                       prompts: int, prompt_len: int, new_tokens: int, batch_size: int) -> GenPrediction:
    """`prompts` prompts of prompt_len tokens, new_tokens each (no sequence stops early), in batches of
    batch_size: every batch a prefill and new_tokens - 1 decode steps."""
    sizes = [min(batch_size, prompts - i) for i in range(0, prompts, batch_size)]
    seconds = 0.0
    for b in sizes:
        seconds += step_s(rates, profile, shape, placement, b, tokens=b * prompt_len) + \
            (new_tokens - 1) * step_s(rates, profile, shape, placement, b)
    full = sizes[0]
    lay = costmodel.layout(shape, profile, placement)
    loads = len(cycle_loads(lay.streamed, lay.slots)) * len(sizes) * new_tokens
    return GenPrediction(seconds=seconds, tokens_per_s=prompts * new_tokens / seconds,
                         loads=loads, batches=len(sizes),
                         steps=len(sizes) * new_tokens, step_s=step_s(rates, profile, shape, placement, full),
                         prefill_s=step_s(rates, profile, shape, placement, full, tokens=full * prompt_len))
