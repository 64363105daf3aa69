"""`bench.py --modes moe`: routed expert reads against whole blocks on a synthetic Qwen3-30B-A3B-shaped store
(128 experts, top-8) or a DeepSeek-V3-shaped one (`--moe-shape deepseek-v3-671B`: latent attention, 256 experts in
8 groups, top-8 from the best 4 groups, a shared expert), dim, heads and expert width scaled down by --dim;
every block sparse. LoRA steps streamed from disk: bytes
read per step and the step time beside the cost model's prediction (phantom.plan.costexperts), for each
batch of --moe-batches, with the random router and with a skewed one, the rest of each block (attention,
norms, router, shared expert) read at each load or kept on the device (`--moe-base stream,device`).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

import phantom
from phantom.arch.presets import PRESETS
from phantom.files.directio import readinto_exact
from phantom.files.store import BlockStore
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from phantom.plan import profiles
from phantom.plan.costexperts import predict_expert_reads
from phantom.stream.hostmem import HostBuffer
from phantom.stream.placement import Activations, Placement

HOT, HOT_SCALE = 16, 4.0  # the skewed router: 16 experts' router rows 4x as long
PREFETCH = 1  # two slots: blocks are read at each use (a few blocks, more than the slots)


def moe_config(dim: int, layers: int, shape: str = "qwen3-30B-A3B"):
    """The preset `shape` with dim (and heads, kv heads, expert width, latent ranks) scaled by dim over its own;
    its experts, top-k and groups as they are, every layer sparse."""
    big = PRESETS[shape]
    f = dim / big.dim
    shape = dict(dim=dim, n_layers=layers, n_heads=max(1, int(big.n_heads * f)), n_kv_heads=max(1, int(big.kv_heads * f)),
                 explicit_head_dim=64, expert_dim=int(big.expert_dim * f), shared_expert_dim=int(big.shared_expert_dim * f),
                 vocab_size=1024, max_seq_len=1024, dense_layers=())
    if big.kv_lora_rank:  # latent attention: 48-wide q/k heads (16 rotated), 32-wide v heads
        shape |= dict(n_kv_heads=None, explicit_head_dim=48, rotary_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                      kv_lora_rank=max(32, int(big.kv_lora_rank * f)), rope_scaling=None,
                      q_lora_rank=max(32, int(big.q_lora_rank * f)) if big.q_lora_rank else 0)
    return dataclasses.replace(big, **shape)


def skew(dst: Path, cfg) -> Path:
    """A copy of the store whose routers favour HOT experts (their rows HOT_SCALE times as long: their
    logits spread wider, so they top more tokens' choices), as trained routers favour some experts."""
    store = write_synthetic(dst, cfg, torch.float32, progress=False)
    s = BlockStore(store)
    for i in range(s.n_blocks):
        w = {k: v.clone() for k, v in s.load_block(i).items()}
        w["feed_forward.gate.weight"][:HOT] *= HOT_SCALE
        s.write_block(i, w)
    return store


def steps(store: Path, mode: str, rows: int, seq: int, cold: bool, n: int = 5,
          moe_base: str = "stream") -> tuple[float, dict]:
    """The fastest of the last n-1 of n LoRA steps (the first warms allocations up; the least disturbed by
    other work, as the profile), the last step's counters and the router's measured share of tokens per
    expert (averaged over the blocks)."""
    times, m = [], {}
    gen = torch.Generator().manual_seed(0)
    placement = Placement(offload="disk", prefetch=PREFETCH, expert_reads=mode, moe_base=moe_base)
    with phantom.PhantomModel(BlockStore(store, verify="none", drop_cache=cold), torch.device("cpu"), torch.float32,
                              placement, Activations(recompute="all"), phantom.LoraConfig()) as pm:
        for _ in range(n):
            tokens = torch.randint(0, pm.cfg.vocab_size, (rows, seq), generator=gen)
            t0 = time.perf_counter()
            pm(tokens, targets=tokens).backward()
            times.append(time.perf_counter() - t0)
            m = pm.backend.scheduler.take_metrics()
            hits = pm.backend.scheduler.routed.policy
    probs = torch.stack([hits.probs(i) for i in range(hits.n_blocks)]).mean(0) if hits and hits.rows.min() > 0 else None
    return min(times[1:]), dict(m, probs=probs)


def least_disturbed(store: BlockStore, rows: int, seq: int):
    """The profile at this batch measured twice, each rate the less disturbed of the two (the faster
    compute with its own ratios, the faster reads, the smaller jitter, request cost and slowdowns), as
    the step kept is the fastest: on a shared machine a measurement taken while other work runs reads
    the block's compute as several times slower, and the disk's rate differs by a third run to run."""
    a, b = (profiles.measure(store, torch.device("cpu"), torch.float32, rows, seq) for _ in range(2))
    best = a if a.fwd_flops >= b.fwd_flops else b
    least = lambda f: min(x for x in (getattr(a, f), getattr(b, f)) if x is not None)  # noqa: E731
    return dataclasses.replace(best, disk_gbps=max(a.disk_gbps, b.disk_gbps), disk_jitter=least("disk_jitter"),
                               busy_compute_slowdown=least("busy_compute_slowdown"),
                               busy_read_slowdown=least("busy_read_slowdown"),
                               disk_request_s=least("disk_request_s") if a.disk_request_s is not None else None)


def warm_gbps(store: BlockStore) -> float:
    """GB/s of the disk tier's block reads from the page cache (every block read once, then timed)."""
    buf = HostBuffer(store.block_nbytes, pin=False).tensor
    for _ in range(2):
        t0 = time.perf_counter()
        for e in store.blocks:
            readinto_exact(e.path, e.data_start, buf[: e.nbytes])
        secs = time.perf_counter() - t0
    return store.n_blocks * store.block_nbytes / secs / 1e9


def moe_bench(args, folder: Path) -> str:
    cfg = moe_config(args.dim, args.layers, args.moe_shape)
    store = write_synthetic(folder / "moe", cfg, torch.float32, progress=False)
    skewed = skew(folder / "moe-skewed", cfg)
    batches = [tuple(int(x) for x in b.split("x")) for b in args.moe_batches.split(",")]
    s = BlockStore(store)
    groups = f" in {cfg.router_groups} groups, the best {cfg.router_topk_groups}" if cfg.router_groups > 1 else ""
    lines = [f"### Routed expert reads, {s.n_blocks} blocks of a {args.moe_shape} shape scaled to dim {cfg.dim} "
             f"({cfg.n_heads} heads, {cfg.kv_heads} kv, expert width {cfg.expert_dim}, {cfg.n_experts} experts, "
             f"top-{cfg.experts_per_token}{groups}), fp32, disk tier ({'cold: O_DIRECT, page cache dropped' if args.cold else 'page cache warm'}), prefetch {PREFETCH}, recompute all, "
             f"LoRA q,v; block {s.block_nbytes / 2**20:.1f} MiB; {torch.get_num_threads()} torch threads", "",
             "| batch | router | mode | rest of a block | experts hit / block | MiB read / step | step s | predicted s | "
             "pred / meas |", "|---|---|---|---|---|---|---|---|---|"]
    for rows, seq in batches:
        profile = least_disturbed(s, rows, seq)
        if not args.cold:  # the runs read from the page cache
            profile = dataclasses.replace(profile, disk_warm_gbps=warm_gbps(s))
        lines.append(f"| {rows}x{seq} | profile | disk {profile.disk_gbps:.2f} GB/s, warm "
                     f"{profile.disk_warm_gbps or 0:.2f}, forward {profile.fwd_flops / 1e9:.1f} GFLOP/s | | | | | | |")
        print(lines[-1], flush=True)
        shape = ci.shape_of(cfg, "fp32", "fp32", seq_len=seq)
        for name, st in (("random", store), ("skewed", skewed)):
            for mode, base in ((m, b) for b in args.moe_base.split(",") for m in ("whole", "routed")):
                secs, m = steps(st, mode, rows, seq, args.cold, moe_base=base)
                pred = predict_expert_reads(profile, shape, cfg, "fp32", Placement(offload="disk", prefetch=PREFETCH,
                                                                                   moe_base=base),
                                            Activations(recompute="all"), rows, probs=m["probs"])
                p = pred.whole_s if mode == "whole" else pred.routed_s
                hit = f"{pred.hits:.1f}" if mode == "routed" else str(cfg.n_experts)
                rest = "kept on the device" if base == "device" else "read"
                lines.append(f"| {rows}x{seq} | {name} | {mode} | {rest} | {hit} | {m['bytes_read'] / 2**20:.1f} | "
                             f"{secs:.3f} | {p:.3f} | {p / secs:.2f} |")
                print(lines[-1], flush=True)
    return "\n".join(lines)
