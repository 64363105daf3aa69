"""A mixture-of-experts block run in two halves, so its experts can be read after its router: the
attention half (with its residual), the router over the hidden state it gives, then the MLP half.

The halves are phantom.arch.layers.TransformerBlock.forward's own (its `_attention` and `mlp`, tiled and
checkpointed as it runs them), so a block run in halves gives the bits its forward gives; the
executor (phantom.stream.executor) runs the attention half of every micro-batch, reads the experts
their tokens route to, then the MLP halves. Imports arch only.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from phantom.arch import carry as C
from phantom.arch.hyper import HyperBlock
from phantom.arch.ops import KVCache
from phantom.arch.moe import MoeFeedForward


def is_moe(block: nn.Module) -> bool:
    return isinstance(getattr(block, "feed_forward", None), MoeFeedForward)


def _inner(block: nn.Module, cache: KVCache | None) -> bool:
    return block.checkpoint_inner and torch.is_grad_enabled() and cache is None


def attention_half(block: nn.Module, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                   start_pos: int = 0, mask: torch.Tensor | None = None, carry: C.Carry = None) -> torch.Tensor:
    """x plus the block's attention: the hidden state its MLP sees (as TransformerBlock.forward); `carry`: the
    micro-batch's carried state (phantom.arch.carry), which the attention may add to."""
    if isinstance(block, HyperBlock):  # DeepSeek-V4's streams after its attention: its own half
        return block.attention_half(x, rope, cache, start_pos, mask)
    if _inner(block, cache):
        return x + checkpoint(block._attention, x, rope, mask, None, 0, carry, use_reentrant=False)
    return x + block._attention(x, rope, mask, cache, start_pos, carry)


def routed_experts(block: nn.Module, h: torch.Tensor, carry: C.Carry = None) -> torch.Tensor:
    """The expert ids (N, k) the block's router picks for the hidden state h (no autograd)."""
    with torch.no_grad():
        ffn = block.feed_forward
        x = block.router_input(h) if isinstance(block, HyperBlock) else block.ffn_norm(h).reshape(-1, h.shape[-1])
        return ffn.route(x, **C.kwargs(ffn, carry))


def mlp_half(block: nn.Module, h: torch.Tensor, cache: KVCache | None = None, carry: C.Carry = None) -> torch.Tensor:
    """h plus the block's MLP (as TransformerBlock.forward: tiled over a long row's tokens)."""
    return block.residual_mlp(h, carry)
