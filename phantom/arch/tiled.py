"""Tiled compute of a block's token-wise parts over chunks of a row's tokens: the MLP and its norms, and what
attention takes from each token (its norm, projections, q/k norms, RoPE).

A row of T tokens through a gated MLP of width H makes (T, H) activations: gate, up, act(gate) and their
product, and as many gradients in the backward; at long rows they dwarf the (T, dim) hidden state. The MLP
is token-wise, so it can run a chunk of tokens at a time: `tiled` runs fn over chunks of the sequence, and
under autograd as one `TiledCompute` node that keeps only its input, runs the chunks without a graph in its
forward, and in its backward recomputes each chunk with a graph and backpropagates it before the next
(Arctic Long Sequence Training's TiledMLP). The node's gradients go to its input and to the trained
tensors it is given (LoRA's, and the weights themselves in full finetuning), summed over the chunks, so
`torch.autograd.grad` over explicit inputs and `.backward()` into leaves both see them. The recompute
replays the forward's random draws (dropout) and autocast. A residual part (the MLP: h + mlp(h), the block's
output) adds its input inside the node, so the row's gradient is written once, chunk by chunk, and a recompute
only backpropagated makes no full-length output at all; where the caller gives the block's output gradient up
(`consumed`: a streamed block's backward), that gradient's own memory takes the row's gradient. Imports torch only.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.nn as nn


Outputs = torch.Tensor | tuple[torch.Tensor, ...]
_graph_only = threading.local()  # .on: the graph being built is only backpropagated (outputs_unused)
_given_up: list[torch.Tensor] = []  # gradients their callers read no more (consumed), on any thread's backward
_given_up_lock = threading.Lock()


@contextlib.contextmanager
def outputs_unused():
    """While a block's forward is rerun only to backpropagate its output (a recompute in the backward: the graph
    is used, the output's values are not), its residual tiled part (tiled(..., residual=True): the MLP and the
    residual, the block's output) computes nothing in its forward and returns zeros that hold no memory (one
    value, expanded); its backward recomputes every chunk as always. Not where it draws random numbers: the
    recompute of the next micro-batch continues the same stream."""
    before = getattr(_graph_only, "on", False)
    _graph_only.on = True
    try:
        yield
    finally:
        _graph_only.on = before


@contextlib.contextmanager
def consumed(grad: torch.Tensor):
    """While the caller backpropagates `grad` through a graph and reads it no more (a streamed block's incoming
    gradient, phantom.stream.executor), a residual tiled part whose output it is the gradient of writes its input's
    gradient into it, chunk by chunk (each chunk's rows are read before they are written), instead of into a tensor
    beside it: one full-length tensor less held through the rest of the block's backward. Known by its memory
    (address, shape, strides, dtype), as the engine hands it on, on whichever thread runs the node; one that is
    not contiguous (an expanded gradient) is not written."""
    with _given_up_lock:
        _given_up.append(grad)
    try:
        yield
    finally:
        with _given_up_lock:
            del _given_up[next(i for i, g in enumerate(_given_up) if g is grad)]


def _writable(grad: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether grad (a residual part's output gradient) is one a caller gave up (consumed) and can take h's."""
    key = lambda t: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)  # noqa: E731
    with _given_up_lock:
        given = any(key(grad) == key(g) for g in _given_up)
    return given and grad.is_contiguous() and (grad.shape, grad.dtype, grad.device) == (h.shape, h.dtype, h.device)


def tiled(fn: Callable[[torch.Tensor, int], Outputs], h: torch.Tensor, chunk: int | None,
          modules: list[nn.Module], residual: bool = False, tensors: tuple[torch.Tensor, ...] = ()) -> Outputs:
    """fn(h, 0) for a token-wise fn over h (B, T, ...), `chunk` tokens of each row at a time where T is longer
    (None or 0: at once): fn(h[:, a:a + chunk], a) gives the chunk's output(s), each (B, chunk, ...) (fn reads
    the rows of position tables it needs from a). `modules`: those fn computes with; their tensors that need a
    gradient (read when called: bound weights included) are the node's trained inputs, and a dropout among
    them is replayed. `tensors`: other whole tensors fn reads (the keys every chunk of queries attends to,
    phantom.arch.dsa); those that need a gradient are inputs too. `residual`: h + fn(h) (fn's one output, h's
    shape), the block's output (see outputs_unused)."""
    if not chunk or h.shape[1] <= chunk:
        return h + fn(h, 0) if residual else fn(h, 0)
    trained = [p for m in modules for p in m.parameters() if p.requires_grad] + [t for t in tensors if t.requires_grad]
    if not torch.is_grad_enabled() or not (h.requires_grad or trained):
        return _chunked(fn, h, chunk, residual=residual)
    draws = any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for mod in modules for m in mod.modules())
    skip = residual and not draws and getattr(_graph_only, "on", False)
    return _node(fn, chunk, (draws, residual, skip), h, trained)


@torch.compiler.disable  # a compiled block runs this part eagerly: its backward calls autograd itself
def _node(fn, chunk: int, how: tuple[bool, bool, bool], h: torch.Tensor, trained: list[torch.Tensor]) -> Outputs:
    out = TiledCompute.apply(fn, (chunk, *how), h, *trained)
    return out[0] if len(out) == 1 else out


def _chunked(fn: Callable[[torch.Tensor, int], Outputs], h: torch.Tensor, chunk: int, as_tuple: bool = False,
             residual: bool = False) -> Outputs:
    """fn over h's chunks of tokens, each output written into one tensor (no list of chunk outputs beside it);
    residual: h + fn's output."""
    outs = None
    for a in range(0, h.shape[1], chunk):
        hc = h[:, a:a + chunk]
        ys = fn(hc, a)
        ys = (hc + ys,) if residual else (ys,) if isinstance(ys, torch.Tensor) else ys
        if outs is None:
            outs = [y.new_empty(*h.shape[:2], *y.shape[2:]) for y in ys]
        for out, y in zip(outs, ys):
            out[:, a:a + chunk] = y
    return tuple(outs) if as_tuple or len(outs) > 1 else outs[0]


def _unused_output(fn: Callable[[torch.Tensor, int], Outputs], h: torch.Tensor) -> torch.Tensor:
    """Zeros of h + fn(h)'s shape and dtype, one value expanded: the output of a residual part whose values are
    not used (outputs_unused). The dtype is read from one token (autocast or mixed dtypes may widen it)."""
    with torch.no_grad():
        dtype = (h[:, :1] + fn(h[:, :1], 0)).dtype
    return torch.zeros((), dtype=dtype, device=h.device).expand(h.shape)


class _Replay:
    """The CPU (and CUDA) generator state and the autocast in force when a tiled forward starts, put back
    around its recompute so each chunk draws what it drew and computes in the dtype it computed in."""

    def __init__(self, device: torch.device, draws: bool):
        self.device = device
        self.cpu = torch.get_rng_state() if draws else None
        self.cuda = torch.cuda.get_rng_state(device) if draws and device.type == "cuda" else None
        kind = device.type
        self.autocast = dict(device_type=kind, dtype=torch.get_autocast_dtype(kind),
                             enabled=torch.is_autocast_enabled(kind))

    @contextlib.contextmanager
    def replayed(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda", enabled=self.cpu is not None), \
                torch.enable_grad(), torch.autocast(**self.autocast):
            if self.cpu is not None:
                torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class TiledCompute(torch.autograd.Function):
    """fn over chunks of h's tokens as one autograd node that keeps only h (see the module's docstring), its
    outputs a tuple; `trained`: the tensors fn computes with whose gradients are wanted, summed over the chunks."""

    @staticmethod
    def forward(ctx, fn, how: tuple[int, bool, bool, bool], h, *trained):
        (ctx.chunk, draws, ctx.residual, skip), ctx.fn, ctx.trained = how, fn, trained
        ctx.replay = _Replay(h.device, draws)
        ctx.save_for_backward(h)
        if skip:
            return (_unused_output(fn, h),)
        return _chunked(fn, h, ctx.chunk, as_tuple=True, residual=ctx.residual)

    @staticmethod
    def backward(ctx, *grad):
        (h,) = ctx.saved_tensors
        needs_h = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(ctx.trained, ctx.needs_input_grad[3:]) if need]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        into_grad = needs_h and ctx.residual and _writable(grad[0], h)  # the row's gradient where the output's was
        dh = grad[0] if into_grad else torch.empty_like(h) if needs_h else None  # every chunk writes its rows
        with ctx.replay.replayed():
            for a in range(0, h.shape[1], ctx.chunk):
                hc = h[:, a:a + ctx.chunk].detach().requires_grad_(needs_h)
                out = ctx.fn(hc, a)
                out = (out,) if isinstance(out, torch.Tensor) else out
                # outputs no input or trained tensor reaches (k, under a LoRA on q and v alone) have no graph
                live = [(y, g[:, a:a + ctx.chunk]) for y, g in zip(out, grad) if y.requires_grad]
                grads = torch.autograd.grad([y for y, _ in live], ([hc] if needs_h else []) + wanted,
                                            [g for _, g in live], allow_unused=True) if live else [None] * (
                    needs_h + len(wanted))
                if into_grad and grads[0] is not None:  # the residual's own gradient is already there
                    dh[:, a:a + ctx.chunk].add_(grads[0])
                elif needs_h and not into_grad:  # the residual's own gradient beside the chunk's
                    _write(dh[:, a:a + ctx.chunk], grads[0], grad[0][:, a:a + ctx.chunk] if ctx.residual else None)
                for j, g in enumerate(grads[1:] if needs_h else grads):
                    if g is not None:
                        sums[j] = g if sums[j] is None else sums[j].add_(g)
                del out, grads
        it = iter(sums)
        return (None, None, dh, *(next(it) if need else None for need in ctx.needs_input_grad[3:]))


def _write(rows: torch.Tensor, g: torch.Tensor | None, through: torch.Tensor | None) -> None:
    """A chunk's input gradient into its rows: g (None: zeros), plus `through` (a residual's) where given."""
    if g is None and through is None:
        rows.zero_()
    elif g is None or through is None:
        rows.copy_(g if g is not None else through)
    else:
        torch.add(g, through, out=rows)


def by_documents(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spans: list[tuple[int, int, int]], trained: list[torch.Tensor]) -> torch.Tensor:
    """Attention of packed rows, each example alone: fn(q, k, v) (one row's (1, heads, L, D) each, positions from
    0, causal) over each example's span (row, start, end) of q, k, v (B, heads, T, D), written into one output
    (B, heads, T, Dv). No (T, T) mask is made: an example sees only its own keys. Under autograd one node keeps
    q, k and v, and its backward recomputes each example's attention with a graph and backpropagates it before
    the next (an example's attention costs its length squared, not the row's); `trained`: tensors fn computes
    with whose gradients are wanted (attention sinks in full finetuning)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v, *trained)):
        return _by_spans(fn, q, k, v, spans)
    return _documents(fn, spans, q, k, v, trained)


@torch.compiler.disable  # a compiled block runs this part eagerly: its backward calls autograd itself
def _documents(fn, spans, q, k, v, trained) -> torch.Tensor:
    return DocumentAttention.apply(fn, spans, q, k, v, *trained)


def _by_spans(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans) -> torch.Tensor:
    out = None
    for b, s, e in spans:
        y = fn(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e])
        if out is None:
            out = y.new_empty(q.shape[0], y.shape[1], q.shape[2], y.shape[3])
        out[b:b + 1, :, s:e] = y
    return out


class DocumentAttention(torch.autograd.Function):
    """by_documents' node: keeps q, k, v; its backward recomputes each example's attention and backpropagates it."""

    @staticmethod
    def forward(ctx, fn, spans, q, k, v, *trained):
        ctx.fn, ctx.spans, ctx.trained = fn, spans, trained
        ctx.replay = _Replay(q.device, False)
        ctx.save_for_backward(q, k, v)
        return _by_spans(fn, q, k, v, spans)

    @staticmethod
    def backward(ctx, dout):
        qkv = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:5]
        wanted = [p for p, need in zip(ctx.trained, ctx.needs_input_grad[5:]) if need]
        grads = [torch.zeros_like(t) if need else None for t, need in zip(qkv, needs)]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with ctx.replay.replayed():
            for b, s, e in ctx.spans:
                parts = [t[b:b + 1, :, s:e].detach().requires_grad_(need) for t, need in zip(qkv, needs)]
                y = ctx.fn(*parts)
                got = torch.autograd.grad(y, [p for p, need in zip(parts, needs) if need] + wanted,
                                          dout[b:b + 1, :, s:e], allow_unused=True)
                it = iter(got)
                for g, need in zip(grads, needs):
                    if need and (gp := next(it)) is not None:
                        g[b:b + 1, :, s:e] = gp
                for j, gp in enumerate(it):
                    if gp is not None:
                        sums[j] = gp if sums[j] is None else sums[j].add_(gp)
        it = iter(sums)
        return (None, None, *grads, *(next(it) if need else None for need in ctx.needs_input_grad[5:]))
