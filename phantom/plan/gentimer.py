"""Timing generation on a resident model: a block's decode call and prefill at two sizes each, fitted to
`call + n * per`, and what a step runs beside its blocks (embedding, head, sampling): the rates the cost model
of generation (phantom.plan.costgen) adds the streaming to.
"""
from __future__ import annotations

import torch

from phantom.files.store import BlockStore
from phantom.model.generate import Sampling, next_logits, pick
from phantom.model.phantom_model import PhantomModel
from phantom.plan.computetimer import timed
from phantom.plan.costgen import GenRates
from phantom.stream.kvcache import CacheSet
from phantom.stream.placement import Placement


def measure_generation(store: BlockStore, device: torch.device, dtype: torch.dtype, prompt_len: int,
                       rows: tuple[int, int] = (1, 64), context: int = 48, repeats: int = 5) -> GenRates:
    """GenRates of store's blocks on device: decode steps over rows[0] and rows[1] sequences at `context`
    cached tokens, prefills of rows[0] and rows[1] // 4 prompts of prompt_len tokens. The blocks run as a run
    streams them (the executor binding each block's weights, q/k/v and gate/up fused), every one held on the
    device (a CPU: the RAM tier where it lies), so nothing is loaded while they are timed."""
    everything = Placement(offload="auto", resident=store.cfg.n_layers, ram_budget=0)
    model = PhantomModel(store, device, dtype, everything, lora=None)
    try:
        with torch.no_grad():
            decode = {b: _decode_times(model, b, context, repeats) for b in rows}
            pre_rows = (rows[0], max(rows[0] + 1, rows[1] // 4))
            prefill = {b * prompt_len: _prefill_s(model, b, prompt_len, repeats) for b in pre_rows}
    finally:
        model.close()
    n = model.cfg.n_layers
    block = _line({b: t[0] / n for b, t in decode.items()})
    rest = _line({b: max(t[1] - t[0], 0.0) for b, t in decode.items()})
    pre = _line({k: t / n for k, t in prefill.items()})
    return GenRates(block_call_s=block[0], block_row_s=block[1], rest_call_s=rest[0], rest_row_s=rest[1],
                    prefill_call_s=pre[0], prefill_token_s=pre[1])


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) through two points, neither below zero."""
    (x0, y0), (x1, y1) = sorted(points.items())
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope


def _decode_times(model: PhantomModel, rows: int, context: int, repeats: int) -> tuple[float, float]:
    """(the blocks' seconds, the whole step's) of one decode step over `rows` sequences at `context`."""
    cfg, device = model.cfg, model.device
    caches = CacheSet(cfg, rows, context + 1, device, model.dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen)
    h = model.embed(tokens)
    rope = model.rope_for(context + 1)[context:context + 1]
    sampling, gens = [Sampling()] * rows, [gen] * rows

    def blocks():
        with torch.autocast(**model.autocast_args()):
            model.blocks(h, rope, caches=caches, start_pos=context)

    def step():
        pick(next_logits(model, tokens, caches, context), sampling, gens)
    return timed(blocks, device, repeats), timed(step, device, repeats)


def _prefill_s(model: PhantomModel, rows: int, prompt_len: int, repeats: int) -> float:
    """The blocks' seconds over `rows` prompts of prompt_len tokens from an empty cache."""
    cfg, device = model.cfg, model.device
    caches = CacheSet(cfg, rows, prompt_len, device, model.dtype)
    h = model.embed(torch.randint(0, cfg.vocab_size, (rows, prompt_len), generator=torch.Generator().manual_seed(1)))
    rope = model.rope_for(prompt_len)[:prompt_len]

    def blocks():
        with torch.autocast(**model.autocast_args()):
            model.blocks(h, rope, caches=caches, start_pos=0)
    return timed(blocks, device, repeats)
