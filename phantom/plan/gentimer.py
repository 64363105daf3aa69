"""Timing generation on a model whose blocks are all held: a block's decode call and prefill at the sizes a run
will have, and what a step runs beside its blocks (embedding, head, sampling): the rates the cost model of
generation (phantom.plan.costgen) adds the streaming to.

Each kind of block (the same tensors, the same mixer: a hybrid has two) is timed once and counted as many
times as the model has it, so a prefill of many prompts costs one block's time, not the model's: prefills grow
faster than their tokens (a dim-1024 block over 8192 tokens took 1.36x what the line through 512 and 2048
said), so a run's sizes are measured, not reached by a line.
"""
from __future__ import annotations

from collections import Counter

import torch

from phantom.arch.config import block_tensor_shapes
from phantom.files.store import BlockStore
from phantom.model.generate import Sampling, next_logits, pick
from phantom.model.phantom_model import PhantomModel
from phantom.plan.computetimer import timed
from phantom.plan.costgen import GenRates
from phantom.stream.kvcache import CacheSet
from phantom.stream.placement import Placement


def measure_generation(store: BlockStore, device: torch.device, dtype: torch.dtype, rows: tuple[int, ...],
                       prompt_tokens: tuple[int, ...], prompt_len: int, context: int = 48,
                       repeats: int = 3) -> GenRates:
    """GenRates of store's blocks on device: decode steps over each number of sequences in `rows` at `context`
    cached tokens, prefills of each number of tokens in `prompt_tokens` (prompts of prompt_len tokens). The
    blocks run as a run streams them (the executor binding each block's weights, q/k/v and gate/up fused),
    every one held on the device (a CPU: the RAM tier where it lies), so nothing is loaded while they are
    timed."""
    everything = Placement(offload="auto", resident=store.cfg.n_layers, ram_budget=0)
    model = PhantomModel(store, device, dtype, everything, lora=None)
    try:
        with torch.no_grad():
            decode = {b: _decode_times(model, b, context, repeats) for b in rows}
            prefill = {t: _blocks_s(model, max(1, t // prompt_len), prompt_len, 0, repeats) for t in prompt_tokens}
    finally:
        model.close()
    n = model.cfg.n_layers
    return GenRates(decode=tuple((b, blocks / n) for b, (blocks, _) in decode.items()),
                    rest=tuple((b, max(step - blocks, 0.0)) for b, (blocks, step) in decode.items()),
                    prefill=tuple((t, s / n) for t, s in prefill.items()))


def block_kinds(cfg) -> Counter:
    """One block of each kind (its tensors' names and shapes, its mixer) and how many blocks are of it."""
    kinds = {}
    for i in range(cfg.n_layers):
        key = (tuple(sorted(block_tensor_shapes(cfg, i).items())), cfg.linear(i), cfg.window(i))
        kinds.setdefault(key, []).append(i)
    return Counter({blocks[0]: len(blocks) for blocks in kinds.values()})


def _blocks_s(model: PhantomModel, rows: int, tokens: int, context: int, repeats: int) -> float:
    """Seconds of every block over `rows` rows of `tokens` new tokens each after `context` cached ones: each
    kind of block timed once, times its count."""
    cfg, device, ex = model.cfg, model.device, model.executor
    caches = CacheSet(cfg, rows, context + tokens, device, model.dtype)
    x = model.embed(torch.randint(0, cfg.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(1)))
    rope = model.rope_for(context + tokens)[context:context + tokens]

    def block(i: int):
        with ex.block_weights(i) as weights, torch.autocast(**model.autocast_args()):
            ex.run_cached(i, weights, x, rope, caches[i], context, None)  # as a run calls it
    return sum(count * timed(lambda: block(i), device, repeats) for i, count in block_kinds(cfg).items())


def _decode_times(model: PhantomModel, rows: int, context: int, repeats: int) -> tuple[float, float]:
    """(the blocks' seconds, the whole step's) of one decode step over `rows` sequences at `context`."""
    cfg, device = model.cfg, model.device
    caches = CacheSet(cfg, rows, context + 1, device, model.dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen)
    sampling, gens = [Sampling()] * rows, [gen] * rows

    def step():
        pick(next_logits(model, tokens, caches, context), sampling, gens)
    return _blocks_s(model, rows, 1, context, repeats), timed(step, device, repeats)
