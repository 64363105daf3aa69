"""`BlockExecutor`: runs a model's transformer blocks on weights streamed by a BlockScheduler.

The model (phantom.model.phantom_model) is a plain Llama whose blocks hold meta placeholders for their base
weights. For each use the executor acquires the block's weights from the scheduler, binds them in
place of the placeholders while they are held (torch's own reparametrization, the mechanism of
`torch.func.functional_call`, kept for the whole hold because checkpointed sub-blocks re-read
their weights in backward) and releases them. Under autograd each block is one `StreamedBlock`
Function whose backward acquires the block again:

- recompute: the forward keeps only the block's input; the backward reruns the forward with the
  forward's RNG state and autocast (activation checkpointing).
- keep: the forward keeps the block's autograd graph and activations but not its weights (saved
  weights become handles into the slot, see WeightHandles); the backward only runs the backward.

State carried between blocks beside the hidden state (phantom.arch.carry: GLM-5's shared top-k) is the pass's
`carry`: each micro-batch of a block gets its rows of it, what the block leaves is joined for the next, and a
recomputed block is given again the carry it received.

Keeping and recomputing give the same bits, so "auto" (keep while a byte budget allows) is free to
choose differently from run to run. In full finetuning the weights are leaves too, and each block's
weight gradients go to `on_block_grads` as soon as its backward is done.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from phantom.arch import carry as C
from phantom.arch.layers import fuse_adjacent, lora_disabled
from phantom.arch.ops import KVCache
from phantom.arch.tiled import consumed, outputs_unused
from phantom.stream.kvcache import block_cache
from phantom.stream import lanes as L
from phantom.stream import moeblock
from phantom.stream.hostinputs import HostInputs, to_host
from phantom.stream.placement import CPU_CALL_TOKENS
from phantom.stream.scheduler import BlockScheduler

log = logging.getLogger(__name__)


class RngState:
    """CPU (and CUDA) RNG state at a block's forward, replayed in its recompute so dropout matches."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class WeightHandles:
    """saved_tensors_hooks that keep activations but not weights.

    A tensor autograd saves that lives in the block's weight buffer (a weight, or a view of one) is
    packed as a handle (byte offset from the block's first weight, dtype, shape, stride); in
    backward the block is acquired again and the handle is rebuilt on whatever slot now holds it.
    Offsets are relative: two slots' buffers may start at different offsets of their storages (an
    aligned host buffer is a view into a larger allocation). Everything else is kept as is.
    """

    def __init__(self, weights: dict[str, torch.Tensor]):
        storage = self._slot(weights)
        self.storage_ptr = storage.data_ptr()
        self.base = self._base(weights, storage)
        # tensors the device keeps beyond the slot (a MoE block's attention and shared experts, Placement.moe_base):
        # the same tensors at every load, saved as they are and not counted as kept activations
        self.persistent = {w.untyped_storage().data_ptr() for w in weights.values()} - {self.storage_ptr}
        self.storage = None
        self.kept_bytes = 0
        self.weight_handles = 0

    @staticmethod
    def _slot(weights: dict[str, torch.Tensor]):
        """The storage of the slot: the one holding most of the weights' bytes (a kept base's are a few)."""
        held: dict[int, list] = {}
        for w in weights.values():
            entry = held.setdefault(w.untyped_storage().data_ptr(), [w.untyped_storage(), 0])
            entry[1] += w.numel() * w.element_size()
        return max(held.values(), key=lambda e: e[1])[0]

    @staticmethod
    def _base(weights: dict[str, torch.Tensor], storage) -> int:
        return min(w.storage_offset() * w.element_size() for w in weights.values()
                   if w.untyped_storage().data_ptr() == storage.data_ptr())

    def bind(self, weights: dict[str, torch.Tensor] | None) -> None:
        self.storage = self._slot(weights) if weights else None
        self.base = self._base(weights, self.storage) if weights else None

    def pack(self, t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() == self.storage_ptr:
            self.weight_handles += 1
            return (WeightHandles, t.dtype, t.storage_offset() * t.element_size() - self.base, t.shape, t.stride())
        if t.device.type == "meta" or t.untyped_storage().data_ptr() not in self.persistent:
            self.kept_bytes += t.numel() * t.element_size()
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and packed[0] is WeightHandles:
            _, dtype, offset, shape, stride = packed
            assert self.storage is not None, "weight handle used outside the block's backward"
            return torch.empty(0, dtype=dtype, device=self.storage.device).set_(
                self.storage, (self.base + offset) // dtype.itemsize, shape, stride)
        return packed


class StreamedBlock(torch.autograd.Function):
    """Block i of `ex` as one autograd node; `params` are its trained parameters (LoRA A/B), passed
    so autograd returns their gradients. The batch runs in micro-batches while the block is on the
    device, forward and backward (layer-major accumulation): one load per direction per step."""

    @staticmethod
    def forward(ctx, x, rope, mask, ex: "BlockExecutor", i: int, *params):
        ctx.ex, ctx.i, ctx.lanes = ex, i, ex.lanes
        ctx.autocast = _autocast_state(x.device)
        ctx.keep = ex.keeps(i)
        ctx.rng = RngState(x.device) if ex.has_dropout and not ctx.keep else None
        ctx.streams = L.replay_streams(ex.lanes) if not ctx.keep else None  # each adapter's, to replay
        ctx.carry = ex.carry  # what block i received, for its recompute (each micro-batch gets its own copy)
        with ex.block_weights(i, lanes=ex.lanes) as weights, ex.first_pass(i):
            if not ctx.keep:
                out = _pass_rows(ex, i, x, rope, mask)
                ex.run_reference(i, weights, rope, mask)
                ctx.experts = ex.used_experts(i)
                ctx.host = to_host(ex.host_inputs, x, getattr(ex.layers[i], "mlp_chunk", None))  # None: kept as is
                ctx.save_for_backward(None if ctx.host else x, rope, mask, *params)
                return out
            ctx.hooks, ctx.host = WeightHandles(weights), None
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(ctx.hooks.pack, ctx.hooks.unpack):
                rows = [(xc.detach().requires_grad_(x.requires_grad), *rest)
                        for xc, *rest in ex.rows(x, rope, mask, ex.lanes, ex.carry)]
                ctx.graphs = list(zip([r[0] for r in rows], ex.run_rows(i, rows)))
                ex.carry = C.join([r[4] for r in rows])
            ex.run_reference(i, weights, rope, mask)
            ctx.experts = ex.used_experts(i)
        ex.count_kept(ctx.hooks)
        ctx.save_for_backward(*params)
        return torch.cat([out.detach() for _, out in ctx.graphs])

    @staticmethod
    def backward(ctx, grad_out):
        ex, needs_x = ctx.ex, ctx.needs_input_grad[0]
        saved = ctx.saved_tensors
        params = saved if ctx.keep else saved[3:]
        trained = [p for p in params if p.requires_grad]
        param_grads = [torch.zeros_like(p) for p in trained]
        x_grads = []
        rng = ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext()
        # The weights stay acquired until the gradients are computed: autograd reads them.
        with ex.block_weights(ctx.i, ex.trains_weights, ctx.experts, ctx.lanes) as weights, rng:
            # fp32 sums, set by the first chunk; a block's buffers (DeepSeek-V3's router correction bias) do not train
            weight_grads = dict.fromkeys(k for k, v in weights.items() if v.requires_grad) if ex.trains_weights else {}
            wrt = trained + [weights[k] for k in weight_grads] if ex.trains_weights else trained
            if ctx.keep:
                ctx.hooks.bind(weights)
            else:
                x = ex.host_inputs.take(ctx.host) if ctx.host is not None else saved[0]
                chunks = list(ex.rows(x, *saved[1:3], ctx.lanes, ctx.carry))
            for k, gc in enumerate(ex.split_batch(grad_out, ctx.lanes)):
                if ctx.keep:
                    xc, out = ctx.graphs[k]
                else:
                    xc, rc, mc, lane, cc = chunks[k]
                    xc = xc.detach().requires_grad_(needs_x)
                    with torch.enable_grad(), torch.autocast(**ctx.autocast), _drawing(lane, ctx.streams), \
                            outputs_unused():  # only its graph is used: a tiled MLP computes its chunks once
                        out = ex.run_block(ctx.i, xc, rc, mask=mc, lane=lane, carry=cc)
                with consumed(gc):  # read no more: a tiled block's residual part writes x's gradient into it
                    grads = torch.autograd.grad(out, ([xc] if needs_x else []) + wrt, gc, allow_unused=True)
                if needs_x:
                    x_grads.append(grads[0])
                grads = grads[1:] if needs_x else grads
                for acc, g in zip(param_grads, grads):
                    if g is not None:
                        acc += g
                for k, g in zip(weight_grads, grads[len(param_grads):]):
                    weight_grads[k] = _accumulate(weight_grads[k], g, weights[k])
            if ctx.keep:
                ctx.hooks.bind(None)
                ctx.graphs = None
            elif ctx.host is not None:  # the input the backward reads next on its way to the device
                ex.host_inputs.fetch_next(ctx.host)
            ctx.carry = None
        if ex.trains_weights:
            ex.on_block_grads(ctx.i, weight_grads)
        it = iter(param_grads)
        gparams = [next(it) if p.requires_grad else None for p in params]
        return (joined(x_grads) if needs_x else None, None, None, None, None, *gparams)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' rows as one tensor: one micro-batch is returned as it is (no copy of a row at a time:
    at long rows the copy is a full-length tensor beside the original)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pass_rows(ex: "BlockExecutor", i: int, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None):
    """Block i (held) over x in micro-batches (the pass's lanes), each with its rows of the pass's carry; the carry
    the block leaves becomes the pass's."""
    rows = list(ex.rows(x, rope, mask, ex.lanes, ex.carry))
    out = joined(ex.run_rows(i, rows))
    ex.carry = C.join([r[4] for r in rows])
    return out


def _accumulate(total: torch.Tensor | None, g: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    """A weight's fp32 gradient sum over micro-batches. The first chunk's gradient becomes the sum
    (no zero-filled block-sized buffer: on a host those are fresh pages, faulted in at every step)."""
    g = g.float() if g is not None else torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return g if total is None else total.add_(g)


def _drawing(lane: L.Lane | None, streams: dict | None = None):
    """Dropout draws from the lane's adapter's own stream (a replay's copy in `streams`); without lanes, from
    the global generators as they stand."""
    return contextlib.nullcontext() if lane is None else lane.adapter.rng_for(streams)


def _autocast_state(device: torch.device) -> dict:
    """The autocast in force now on device's type, to rerun a forward under the same one."""
    kind = device.type
    return dict(device_type=kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind))


class BlockExecutor:
    """Runs `layers` (meta placeholders for base weights) on weights acquired from `scheduler`.

    Args:
        layers: the model's blocks.
        scheduler: where each block's weights come from (and go back to).
        recompute: "all", "none" or "auto" (keep while `keep_budget` bytes of activations allow).
        keep_budget: bytes of kept activations allowed under "auto".
        micro_batch: rows run through a block at once (None: the whole batch).
        on_block_grads: full finetuning: called with (i, fp32 weight gradients of block i) as soon
            as block i's backward is done; None for frozen base weights (LoRA, inference).
    """

    def __init__(self, layers: nn.ModuleList, scheduler: BlockScheduler, recompute: str, keep_budget: int,
                 micro_batch: int | None = None,
                 on_block_grads: Callable[[int, dict[str, torch.Tensor]], None] | None = None):
        self.layers, self.scheduler = layers, scheduler
        self.recompute, self.keep_budget, self.micro_batch = recompute, keep_budget, micro_batch
        self.on_block_grads = on_block_grads
        self.trains_weights = on_block_grads is not None
        self.host_inputs = HostInputs.on(getattr(scheduler, "device", None))  # CUDA: long rows' inputs in host memory
        self.has_dropout = any(isinstance(m, nn.Dropout) for m in layers.modules())
        # compiled blocks are tried once: a backend that cannot compile them falls back to eager
        self.compile_unchecked = any(getattr(b, "_compiled_call_impl", None) is not None for b in layers)
        self.kept_bytes = 0  # activations kept by `keep` blocks in the current step
        self.kept_blocks = 0
        self.kept_per_block = 0  # the most one block kept (the estimate for "auto")
        self.weight_handles = 0  # weights saved by autograd as handles, not tensors (for tests)
        self.reference: torch.Tensor | None = None  # the reference hidden state of this pass (run_reference)
        self.lanes: list[L.Lane] | None = None  # this pass's adapters and their rows (phantom.stream.lanes)
        self.carry = self.reference_carry = None  # this pass's carried state (phantom.arch.carry), the reference's
        self._used: dict[int, frozenset] = {}  # experts each block read routed in this step's forward
        self._fill_s = 0.0  # seconds the current block waited for its routed experts
        policy = scheduler.routed.policy
        if self.trains_weights and policy is not None:
            if policy.mode == "routed":
                raise ValueError("expert_reads routed needs frozen experts: full finetuning updates every expert "
                                 "(AdamW decays those no token routes to), so it reads whole blocks; use "
                                 "expert_reads auto or whole")
            scheduler.routed.policy = None
        if self.trains_weights and scheduler.transfer.bases is not None:
            if scheduler.placement.moe_base == "device":
                raise ValueError("moe_base device needs frozen weights: full finetuning trains the attention and "
                                 "shared experts a kept copy would hold; use moe_base auto or stream")
            scheduler.routed.drop_bases()

    def __call__(self, h: torch.Tensor, rope: torch.Tensor, trained: list[list[torch.Tensor]],
                 caches: list[KVCache] | None = None, start_pos: int = 0,
                 mask: torch.Tensor | None = None, reference: torch.Tensor | None = None,
                 lanes: list[L.Lane] | None = None, carry: C.Carry = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Every block over h, in order; `trained[i]` are block i's trained parameters; rope and mask
        as phantom.arch.layers.packed_layout gives them for packed rows.

        `reference`: a second hidden state of the same rows run through each block while it is
        loaded, adapters off and without autograd (the reference model of preference training): the
        pair (h, reference out) is returned, and the store is read as for h alone. Without a KV
        cache the rows run in micro-batches. `lanes`: the rows of each adapter of a multi-adapter model, each
        run through its own blocks while the block is loaded once (phantom.stream.lanes). `carry`: the state the
        first block receives (phantom.arch.carry.start), the reference's a copy of it."""
        n = len(self.layers)
        self.lanes = lanes
        self.kept_bytes = self.kept_blocks = 0
        self.reference = reference
        self.carry, self.reference_carry = carry, (dict(carry) if carry is not None and reference is not None else None)
        training = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for ps in trained for p in ps))
        tokens = h.shape[0] * h.shape[1] if h.dim() == 3 else h.shape[0]
        self.scheduler.plan(list(range(n)) + (list(range(n - 1, -1, -1)) if training else []), tokens)
        for i in range(n):
            if training:
                h = StreamedBlock.apply(h, rope, mask, self, i, *trained[i])
            else:
                with self.block_weights(i, lanes=lanes) as weights, self.first_pass(i):
                    if caches:
                        with block_cache(caches, i, start_pos, h.shape[1]) as cache:
                            h = self.run_cached(i, weights, h, rope, cache, start_pos, mask)
                    else:
                        h = _pass_rows(self, i, h, rope, mask)
                    self.run_reference(i, weights, rope, mask)
        reference, self.reference, self.lanes = self.reference, None, None
        self.carry = self.reference_carry = None
        return h if reference is None else (h, reference)

    def run_cached(self, i: int, weights: dict[str, torch.Tensor], h: torch.Tensor, rope: torch.Tensor,
                   cache: KVCache, start_pos: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Block i over the rows of a generation step with their cache: on a CPU, a prefill of many rows in groups
        of about CPU_CALL_TOKENS tokens (each group's rows of the cache), the block still loaded once; left-padded
        rows' rope and mask (phantom.model.generate.padded_layout gives both or neither) split with them."""
        B, T = h.shape[:2]
        rows = B if h.device.type != "cpu" else max(1, CPU_CALL_TOKENS // T)
        if rows >= B:
            return self.run_block(i, h, rope, cache, start_pos, mask, carry=self.carry)
        out, carries = [], C.split(self.carry, lambda t: list(t.split(rows)), -(-B // rows))
        for a, carry in zip(range(0, B, rows), carries):
            part, own = slice(a, a + rows), mask is not None
            rows_cache = KVCache(cache.k[part], cache.v[part])
            out.append(self.run_block(i, h[part], rope[part] if own else rope, rows_cache, start_pos,
                                      mask[part] if own else None, carry=carry))
        self.carry = C.join(carries)
        return torch.cat(out)

    def run_reference(self, i: int, weights: dict[str, torch.Tensor], rope: torch.Tensor,
                      mask: torch.Tensor | None) -> None:
        """Block i (held, its weights bound) over the reference hidden state, if one travels with
        this pass: adapters off, no autograd; the backward never sees it."""
        if self.reference is None:
            return
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for block in self.blocks_at(i, self.lanes):
                stack.enter_context(lora_disabled(block))
            rows = list(self.rows(self.reference, rope, mask, self.lanes, self.reference_carry))
            self.reference = torch.cat(self.run_rows(i, rows))
            self.reference_carry = C.join([r[4] for r in rows])


    def run_rows(self, i: int, rows) -> list[torch.Tensor]:
        """Block i (held) over each micro-batch of rows ((x, rope, mask, lane, carry) each): a block read routed runs
        the attention half of every micro-batch, reads the experts any of their tokens routes to (one
        request), then the MLP halves. A lane's micro-batch runs through its adapter's block, drawing dropout
        from its adapter's stream."""
        if self.scheduler.routed.reads(i):
            return self._run_halves(i, list(rows))
        out = []
        for xc, rc, mc, lane, cc in rows:
            with _drawing(lane):
                out.append(self.run_block(i, xc, rc, mask=mc, lane=lane, carry=cc))
        return out

    def block(self, i: int, lane: L.Lane | None = None) -> nn.Module:
        """Block i's module: the model's own, or a lane's adapter's."""
        return self.layers[i] if lane is None else lane.adapter.layers[i]

    def blocks_at(self, i: int, lanes: list[L.Lane] | None) -> list[nn.Module]:
        """Every module block i's weights are bound into: the model's and each lane's adapter's."""
        return list({id(b): b for b in [self.layers[i]] + [lane.adapter.layers[i] for lane in lanes or ()]}.values())

    def _run_halves(self, i: int, rows, cache: KVCache | None = None, start_pos: int = 0) -> list[torch.Tensor]:
        blocks = [self.block(i, lane) for *_, lane, _ in rows]
        hs = []
        for block, (x, rope, mask, lane, carry) in zip(blocks, rows):
            with _drawing(lane):
                hs.append(moeblock.attention_half(block, x, rope, cache, start_pos, mask, carry))
        experts = set().union(*(moeblock.routed_experts(block, h, row[4]).unique().tolist()
                                for block, h, row in zip(blocks, hs, rows)))
        self._used[i] = self._used.get(i, frozenset()) | frozenset(experts)
        t0 = time.perf_counter()
        self.scheduler.routed.ensure(i, experts)
        self._fill_s += time.perf_counter() - t0
        out = []
        for block, h, (*_, lane, carry) in zip(blocks, hs, rows):
            with _drawing(lane):
                out.append(moeblock.mlp_half(block, h, cache, carry))
        return out

    def used_experts(self, i: int) -> frozenset | None:
        """The experts block i read routed this step (kept with its saved input); None where it read whole."""
        return self._used.get(i)

    @contextlib.contextmanager
    def first_pass(self, i: int):
        """Block i's forward: its router's choices and its compute seconds go to the scheduler's
        routed-read policy (`auto` decides by them); a recompute in the backward does not count again."""
        policy, ffn = self.scheduler.routed.policy, getattr(self.layers[i], "feed_forward", None)
        if policy is None or not moeblock.is_moe(self.layers[i]):
            yield
            return
        self._used.pop(i, None)
        ffn.observer = lambda chosen: policy.observe(i, chosen)
        self._fill_s, t0 = 0.0, time.perf_counter()
        try:
            yield
        finally:
            ffn.observer = None
        policy.observe_times(compute_s=time.perf_counter() - t0 - self._fill_s)

    def keeps(self, i: int) -> bool:
        """Whether block i keeps its activations this step (else it is recomputed in backward)."""
        if self.recompute != "auto":
            return self.recompute == "none"
        return self.kept_bytes + self.kept_per_block <= self.keep_budget

    def count_kept(self, hooks: WeightHandles) -> None:
        self.kept_bytes += hooks.kept_bytes
        self.kept_blocks += 1
        self.kept_per_block = max(self.kept_per_block, hooks.kept_bytes)
        self.weight_handles += hooks.weight_handles

    def split_batch(self, x: torch.Tensor, lanes: list[L.Lane] | None = None) -> list[torch.Tensor]:
        return L.split_rows(x, lanes, self.micro_batch)

    def rows(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None, lanes: list[L.Lane] | None = None,
             carry: C.Carry = None):
        """(x, rope, mask, lane, carry) per micro-batch (each lane's rows split on their own; lane None without
        lanes); packed rows' per-row rope (B, T, ..) and mask (packed_layout gives both or neither), and the
        carried state (a fresh dict each), are split with x."""
        xs = self.split_batch(x, lanes)
        ropes = self.split_batch(rope, lanes) if mask is not None else [rope] * len(xs)
        masks = self.split_batch(mask, lanes) if mask is not None else [None] * len(xs)
        carries = C.split(carry, lambda t: self.split_batch(t, lanes), len(xs))
        return zip(xs, ropes, masks, L.chunk_lanes(lanes, self.micro_batch, x.shape[0]), carries)

    @contextlib.contextmanager
    def block_weights(self, i: int, trainable: bool = False, experts: frozenset | None = None,
                      lanes: list[L.Lane] | None = None):
        """Block i's weights (views into its slot) until the `with` ends; autograd may read them
        until then, so backward passes run inside it. Frozen weights get fused views (fuse_adjacent);
        `trainable` ones are leaves whose gradients the backward asks for (full finetuning). `experts`:
        those its forward routed to (a routed read reads them with the block: the backward's reload). `lanes`:
        their adapters' modules are bound to the same weights."""
        weights = self.scheduler.acquire(i)
        t0 = time.perf_counter()
        try:
            if trainable:
                buffers = {name for name, _ in self.layers[i].named_buffers()}
                weights = {k: v.detach().requires_grad_(k not in buffers) for k, v in weights.items()}
            elif not self.trains_weights:
                weights = fuse_adjacent(weights)
            if experts is not None:
                self.scheduler.routed.ensure(i, experts)
            self.scheduler.routed.settle(i)
            with contextlib.ExitStack() as bound:
                for block in self.blocks_at(i, lanes):  # the model's module, and each lane's adapter's
                    bound.enter_context(_reparametrize_module(block, weights, strict=False))
                yield weights
        finally:
            self.scheduler.tracer.span("compute", f"block {i}", t0, time.perf_counter())  # the time it is held
            self.scheduler.release(i)

    def run_block(self, i: int, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                  start_pos: int = 0, mask: torch.Tensor | None = None, lane: L.Lane | None = None,
                  carry: C.Carry = None) -> torch.Tensor:
        """Block i (a lane's adapter's) over x, its weights bound (inside block_weights(i)); `carry`: the
        micro-batch's carried state (phantom.arch.carry). A block read routed runs in halves: its experts are read
        after its router (phantom.stream.moeblock)."""
        if self.scheduler.routed.reads(i):
            return self._run_halves(i, [(x, rope, mask, lane, carry)], cache, start_pos)[0]
        block = self.block(i, lane)
        kw = {} if carry is None else {"carry": carry}  # the carried state where the model has one
        call = lambda: block(x, rope, cache, start_pos, mask, **kw)  # noqa: E731
        if not self.compile_unchecked:
            return call()
        try:  # the first call compiles: fall back to eager if the backend cannot
            out = call()
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly
            log.warning("torch.compile failed (%s: %s); running blocks eagerly", type(e).__name__, str(e)[:200])
            for layers in [self.layers] + [lane.adapter.layers for lane in self.lanes or ()]:
                for b in layers:
                    b._compiled_call_impl = None
            out = call()
        self.compile_unchecked = False
        return out
