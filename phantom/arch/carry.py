"""State carried from block to block beside the residual: what a later block needs of an earlier one, or of the
batch, that is not the hidden state (GLM-5's shared layers take the top-k keys of the indexer layer before them;
DeepSeek-V4's hashed layers the batch's token ids).

A carry is a dict name -> tensor, or None where the model carries nothing (`carries`): every tensor has the batch's
rows on dim 0 and its tokens on dim 1, no gradient, and is never changed in place. A block receives its
micro-batch's own dict (phantom.arch.layers.TransformerBlock.forward's `carry`), reads entries and may set entries
for the blocks after it; the modules in it that say `takes_carry` get it by keyword. Whoever runs the blocks
(phantom.model.backends, phantom.stream.executor) starts it (`start`), splits it into micro-batches with the
hidden state (`split`), joins what the block leaves (`join`), and keeps each block's incoming carry for that
block's recompute in the backward. Imports phantom.arch.config only.
"""
from __future__ import annotations

from typing import Callable

import torch

from phantom.arch.config import ModelConfig

Carry = dict[str, torch.Tensor] | None


def carries(cfg: ModelConfig) -> bool:
    """Whether blocks of this model hand state to later blocks (GLM-5's layers sharing an indexer) or read the
    batch's token ids (DeepSeek-V4's hashed layers)."""
    return bool(cfg.index_shared or cfg.hash_layers)


def start(cfg: ModelConfig, tokens: torch.Tensor | None = None) -> Carry:
    """The carry the first block receives: None where the model carries nothing, else a dict; DeepSeek-V4's holds
    the batch's token ids (B, T) as input_ids, which its hashed layers route by (none given: they refuse to run)."""
    if not carries(cfg):
        return None
    return {"input_ids": tokens} if cfg.hash_layers and tokens is not None else {}


def split(carry: Carry, rows: Callable[[torch.Tensor], list[torch.Tensor]], n: int) -> list[Carry]:
    """One dict per micro-batch, each entry split by `rows` as the hidden state is (n micro-batches); fresh dicts
    (a block may set entries in its own), the tensors views of the carry's."""
    if carry is None:
        return [None] * n
    parts = [rows(t) for t in carry.values()]
    return [dict(zip(carry, each)) for each in zip(*parts)] if parts else [{} for _ in range(n)]


def join(parts: list[Carry]) -> Carry:
    """The micro-batches' dicts as one (rows concatenated), as the next block receives it."""
    if not parts or parts[0] is None:
        return None
    return {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}


def tokens(carry: Carry, a: int, n: int) -> Carry:
    """The carry of tokens a .. a + n of each row (a tiled part's chunk)."""
    return None if carry is None else {k: v[:, a:a + n] for k, v in carry.items()}


def kwargs(module, carry: Carry) -> dict:
    """`carry=` for a module that takes it (its class says takes_carry) where there is one; else nothing."""
    return {"carry": carry} if carry is not None and getattr(module, "takes_carry", False) else {}


def bytes_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Bytes per token of carried state a training step holds (kept from the block that sets it to the last
    backward that reads it): GLM-5's top-k (index_topk int32 indices a token) of each indexer layer with shared
    layers after it, at rows longer than index_topk (shorter ones attend densely and carry nothing); DeepSeek-V4's
    token ids (int64) where it has hashed layers."""
    ids = 8 if cfg.hash_layers else 0
    if not cfg.index_shared or seq_len <= cfg.index_topk:
        return ids
    handing = {max(j for j in range(i) if j not in cfg.index_shared) for i in cfg.index_shared}
    return ids + len(handing) * cfg.index_topk * 4
