"""The cost model of batched generation (phantom.model.generate), as pure functions.

A decode step of B live sequences runs every block over B tokens while each block is loaded once, so a streamed
step costs what a training forward's pass costs in loads and what B tokens cost in compute:

    step(B) = rest(B) + sum over resident blocks of c(B) + pipe(c(B))       (phantom.plan.costmodel.pipe_s)
    c(B)    = (block_call_s + B * block_row_s) per block                    measured on the resident model
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
    """Seconds measured on a resident model (phantom.plan.gentimer): one block's decode call over B sequences is
    block_call_s + B * block_row_s, what runs beside the blocks in a step rest_call_s + B * rest_row_s; a
    block's prefill over T prompt tokens prefill_call_s + T * prefill_token_s."""
    block_call_s: float
    block_row_s: float
    rest_call_s: float
    rest_row_s: float
    prefill_call_s: float
    prefill_token_s: float


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
    c = rates.prefill_call_s + tokens * rates.prefill_token_s if tokens is not None else \
        rates.block_call_s + rows * rates.block_row_s
    cs = [c] * shape.n_blocks
    cold = profile.disk_warm_gbps is None or lay.tiers.count("disk") * shape.block_bytes > \
        (profile.free_host_bytes or 0) * (1 - costmodel.MARGIN)
    t = LoadTimes.of_block(profile, shape, lay.tiers, warm=not cold)
    still = shape.n_blocks - len(lay.streamed)
    rest = rates.rest_call_s + rows * rates.rest_row_s
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
