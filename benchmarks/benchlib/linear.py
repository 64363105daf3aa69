"""`bench.py --modes linear`: a Gated DeltaNet block's LoRA step against a gated full-attention block's, on two
synthetic stores of the Qwen3.5-35B-A3B shape scaled to --dim (its heads' widths kept: 256-wide attention heads, a
quarter rotated; 128-wide delta-rule heads), every block of one kind, the MLP dense and as wide as the experts a
token runs (a mixture's per-expert calls would hide the mixers), in the RAM tier (used in place on a CPU) and run
by the streaming executor with recompute all, as a profile times a block (a resident model is plain autograd, which
keeps every graph); LoRA on the query and value projections (q, v: the default, what a profile's block carries) or
on the delta rule's fused q/k/v input (in_proj_qkv). For each batch of --linear-batches: the fastest step of each,
their ratio, and each beside the cost model's prediction (phantom.plan.costmodel.predict) from a profile of its own
store measured at that batch, as tune.py keeps a profile per power of two of tokens a row.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

import phantom
from phantom.arch.presets import PRESETS
from phantom.files.store import BlockStore
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from benchlib.moe import least_disturbed
from phantom.plan.costmodel import predict
from phantom.stream.placement import Activations, Placement

KINDS = {"linear_attention": ("in_proj_qkv",), "full_attention": ("q", "v")}
ACTS = Activations(recompute="all")
PLACE = Placement(offload="ram")  # not "none": a resident model is plain autograd, which keeps every graph


def linear_config(dim: int, layers: int, kind: str, seq: int):
    """Qwen3.5-35B-A3B scaled to dim (heads and delta-rule heads by dim / 2048), every layer `kind`, a dense MLP
    as wide as a token's experts and the shared one."""
    big = PRESETS["qwen3.5-35B-A3B"]
    f = dim / big.dim
    return dataclasses.replace(big, dim=dim, n_layers=layers, n_heads=max(1, int(big.n_heads * f)),
                               linear_k_heads=max(1, int(big.linear_k_heads * f)),
                               linear_v_heads=max(1, int(big.linear_v_heads * f)), n_experts=0, experts_per_token=0,
                               expert_dim=0, shared_expert_dim=0, intermediate_size=int(big.token_hidden_dim * f),
                               vocab_size=1024, max_seq_len=seq, layer_types=(kind,))


def steps(store: Path, kind: str, rows: int, seq: int, n: int = 3) -> float:
    """The fastest of the last n-1 of n LoRA steps (the first warms allocations up)."""
    times = []
    gen = torch.Generator().manual_seed(0)
    with phantom.PhantomModel(BlockStore(store, verify="none"), torch.device("cpu"), torch.float32,
                              PLACE, ACTS, phantom.LoraConfig(targets=KINDS[kind])) as pm:
        for _ in range(n):
            tokens = torch.randint(0, pm.cfg.vocab_size, (rows, seq), generator=gen)
            t0 = time.perf_counter()
            pm(tokens, targets=tokens).backward()
            times.append(time.perf_counter() - t0)
    return min(times[1:])


def linear_bench(args, folder: Path) -> str:
    batches = [tuple(int(x) for x in b.split("x")) for b in args.linear_batches.split(",")]
    seq_max = max(s for _, s in batches)
    cfgs = {k: linear_config(args.dim, args.layers, k, seq_max) for k in KINDS}
    stores = {k: write_synthetic(folder / k, c, torch.float32, progress=False) for k, c in cfgs.items()}
    c = cfgs["linear_attention"]
    lines = [f"### Gated DeltaNet against gated full attention: {args.layers} blocks of each, Qwen3.5-35B-A3B's shape "
             f"scaled to dim {c.dim} ({c.n_heads} attention heads of {c.head_dim}, rotary {c.rope_dim}; "
             f"{c.linear_k_heads} q/k and {c.linear_v_heads} v delta-rule heads of {c.linear_k_dim}; a dense MLP of "
             f"{c.hidden_dim}), fp32, RAM tier, recompute all, LoRA on q, v / in_proj_qkv; {torch.get_num_threads()} torch "
             f"threads; each prediction from a profile of its store measured at its batch", "",
             "| batch | block | step s | linear / full | predicted s | pred / meas |", "|---|---|---|---|---|---|"]
    for rows, seq in batches:  # a profile per length, as tune.py keeps them (profiles.length_bucket)
        profile = {k: least_disturbed(BlockStore(stores[k], verify="none"), rows, seq) for k in KINDS}
        measured = {k: steps(stores[k], k, rows, seq) for k in KINDS}  # (the less disturbed: see least_disturbed)
        for k in KINDS:
            shape = ci.shape_of(cfgs[k], "fp32", "fp32", seq_len=seq)
            p = predict(profile[k], shape, PLACE, ACTS, rows).step_s
            linear = k == "linear_attention"
            ratio = f"{measured['linear_attention'] / measured['full_attention']:.2f}" if linear else ""
            lines.append(f"| {rows}x{seq} | {k} | {measured[k]:.3f} | {ratio} | {p:.3f} | {p / measured[k]:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)
