"""The cost model of routed expert reads (phantom.stream.experts): a mixture-of-experts step whose streamed
blocks read their non-expert bytes ahead of use and, after the router, the experts the step's tokens hit.

The forward's loads carry the non-expert bytes through the prefetch pipeline (phantom.plan.costmodel.pipe_s);
each routed block then reads its hit experts in series with its compute: their bytes, and a request for
each run of consecutive hit experts (`expected_runs`) at the profile's `disk_request_s` (cold disk; else
the tier's `round_trip_s`); the backward's loads carry the non-expert bytes and the same experts,
prefetched. The hit experts come from the router's measured distribution or uniform routing
(`expected_hits`). Pure functions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phantom.arch.config import ModelConfig, block_tensor_shapes
from phantom.base import dtypes
from phantom.plan.costinputs import LoadTimes, MachineProfile, Shape
from phantom.plan.costmodel import MARGIN, Prediction, block_compute, kept_blocks, layout, pipe_s, predict
from phantom.stream import tiers as T
from phantom.stream.experts import expected_hits, expected_runs
from phantom.stream.placement import Activations, Placement


@dataclass(frozen=True)
class ExpertPrediction:
    """Routed and whole reads of one step side by side: step seconds and bytes read from storage (or
    copied from RAM) by the streamed blocks, and the experts a block is expected to hit."""

    whole_s: float
    routed_s: float
    whole_bytes: int
    routed_bytes: int
    hits: float

    @property
    def choice(self) -> str:
        return "routed" if self.routed_s < self.whole_s else "whole"


def expert_bytes(cfg: ModelConfig, store_dtype: str) -> int:
    """One expert's stored bytes (its gate, down and up weights)."""
    size = dtypes.lookup(store_dtype).itemsize
    return sum(size * _numel(s) for n, s in block_tensor_shapes(cfg).items()
               if n.startswith("feed_forward.experts.0.")) if cfg.n_experts else 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def predict_expert_reads(profile: MachineProfile, shape: Shape, cfg: ModelConfig, store_dtype: str,
                         placement: Placement, activations: Activations, rows: int, probs=None) -> ExpertPrediction:
    """Whole and routed reads of a step of `rows` rows of shape.seq_len tokens (probs: the router's measured
    share of tokens per expert, None for uniform routing). Quantized stores read whole (no prediction)."""
    whole = predict(profile, shape, placement, activations, rows)
    activations = whole.activations  # as the placement runs it (a resident model keeps every graph)
    e_bytes = expert_bytes(cfg, store_dtype)
    hits = expected_hits(probs, rows * shape.seq_len, cfg.n_experts, cfg.experts_per_token)
    lay = layout(shape, profile, placement, None)
    base = shape.block_bytes - cfg.n_experts * e_bytes - (shape.base_bytes if lay.bases else 0)  # what a load reads
    fwd, bwd = (list(x) for x in lay.loaded())
    routed_block = base + round(hits * e_bytes)
    moved = lambda n: sum(n for _ in fwd) + sum(n for _ in bwd)  # noqa: E731
    if not lay.streamed:
        return ExpertPrediction(whole.step_s, whole.step_s, 0, 0, hits)
    keep = kept_blocks(shape, profile, activations, rows)
    cf, cb, head = block_compute(profile, shape, activations, rows, keep)
    warm = profile.disk_warm_gbps is not None and whole.tiers.count("disk") * shape.block_bytes <= \
        (profile.free_host_bytes or 0) * (1 - MARGIN) - whole.host_bytes
    times = lambda nbytes: LoadTimes.of_block(profile, dataclasses.replace(shape, block_bytes=nbytes),  # noqa: E731
                                              lay.tiers, warm)
    t_exp = times(round(hits * e_bytes))
    runs = expected_runs(probs, rows * shape.seq_len, cfg.n_experts, cfg.experts_per_token)
    request_s = lambda tier: profile.disk_request_s if tier == "disk" and profile.disk_request_s is not None \
        and not warm else T.get(tier).round_trip_s  # noqa: E731
    serial = [t_exp.of(lay.tiers[i]) + runs * request_s(lay.tiers[i]) if i in lay.streamed else 0.0
              for i in range(shape.n_blocks)]
    cf_routed = [c + s for c, s in zip(cf, serial)]
    still = set(range(shape.n_blocks)) - set(lay.streamed)
    routed = sum(cf[i] + cb[i] for i in still) + head + pipe_s(cf_routed, fwd, lay, times(base), profile) + \
        pipe_s(cb, bwd, lay, times(routed_block), profile)
    kept = shape.base_bytes if lay.bases else 0  # the rest of a block the device keeps: not read
    return ExpertPrediction(whole.step_s, routed, moved(shape.block_bytes - kept), moved(base) + len(fwd + bwd) *
                            round(hits * e_bytes), hits)


def describe_expert_reads(profile: MachineProfile, shape: Shape, cfg: ModelConfig, store_dtype: str,
                          chosen: Prediction) -> str:
    """One labelled line for a plan of a mixture of experts (what `scripts/tune.py` prints): the experts a
    block's tokens hit under uniform routing, the bytes and step of routed reads against whole blocks."""
    p = predict_expert_reads(profile, shape, cfg, store_dtype, chosen.placement, chosen.activations, chosen.rows)
    return (f"experts    {p.hits:.1f} of {cfg.n_experts} experts a block (uniform routing, {chosen.rows * shape.seq_len} "
            f"tokens): routed reads {p.routed_bytes / 1e9:.1f} GB per step against {p.whole_bytes / 1e9:.1f} GB whole, "
            f"{p.routed_s:.3f} s against {p.whole_s:.3f} s: expert reads {p.choice} pay (--expert-reads auto "
            f"measures the router and picks each step)")


def with_moe_base(profile: MachineProfile, shape: Shape, cfg: ModelConfig, store_dtype: str, chosen: Prediction,
                  quantized: bool = False) -> Prediction:
    """The chosen plan with `Placement.moe_base` decided (the tuner's choice): the streamed blocks' attention,
    norms, router and shared experts kept on the device ("device"), in the memory the plan leaves or in that of
    the fewest resident blocks given up for them, where that makes the step faster (routed or whole reads,
    whichever the run's `auto` picks; a quantized store reads whole); else "stream". Under whole reads a kept
    byte saves what a resident block's byte saves; under routed reads, where a step hits few experts, the
    rest of a block is a larger share of each load, and keeping it saves more than a resident block would."""
    if not shape.moe_blocks or not shape.sizes.base or not chosen.layout.streamed:
        return chosen

    def step(placement: Placement) -> tuple[float, Prediction]:
        p = predict(profile, shape, placement, chosen.activations, chosen.rows)
        e = predict_expert_reads(profile, shape, cfg, store_dtype, placement, chosen.activations, chosen.rows)
        return (e.whole_s if quantized else min(e.whole_s, e.routed_s)), p
    best_s, best = step(dataclasses.replace(chosen.placement, moe_base="stream"))
    resident = chosen.split["device"]
    for r in range(resident, -1, -1):  # the bases in what is left, else in place of r resident blocks
        ram = chosen.placement.ram_budget  # a block given up goes to the RAM tier where the plan capped it
        ram = None if ram is None else ram + (resident - r) * shape.tier_bytes
        kept_s, kept = step(dataclasses.replace(chosen.placement, moe_base="device", resident=r, ram_budget=ram))
        if kept.fits:
            return kept if kept_s < best_s else best
        if (resident - r + 1) * shape.sizes.resident > len(shape.moe_blocks) * shape.sizes.base:
            break  # giving up more blocks than the bases take cannot make them fit
    return best
