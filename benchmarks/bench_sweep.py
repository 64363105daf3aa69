"""Benchmark several LoRA adapters trained in one run against the same adapters trained one run each.

    python benchmarks/bench_sweep.py --dim 1024 --layers 8 --batch-size 1 --seq-len 4 --offload disk --throttle 0.1
    python benchmarks/bench_sweep.py --dim 512 --layers 4 --batch-size 4 --seq-len 128 --offload ram --adapters 4

--throttle GBPS reads the disk tier's blocks no faster than GBPS in all (one read at a time, each padded with a
sleep: a slow disk or a network store, where streaming bounds the step; registered as the tier `slowdisk`,
which the cost model plans from its declared rate).

A synthetic store of that shape (fp32), random token data; each adapter has its own learning rate and seed.
The sweep (phantom.train.sweep: each loaded block serves every adapter) and the separate runs
(phantom.train.loop, one adapter each) run the same steps; the table gives the median step of each (steps
after the first), the bytes read per step, the measured ratio and the cost model's (phantom.plan.costsweep,
on a quick profile of this machine measured for the shape). Appended to notes/bench-sweep.md with the
command line and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # phantom, from a checkout

import phantom  # noqa: E402
from phantom.arch.config import ModelConfig  # noqa: E402
from phantom.base.cpufeatures import cpu_flags  # noqa: E402
from phantom.data.dataset import TokenData  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402
from phantom.plan import costinputs as ci, costsweep, profiles  # noqa: E402
from phantom.stream import tiers  # noqa: E402
from phantom.stream.placement import Activations, Placement  # noqa: E402
from phantom.train.loop import train  # noqa: E402
from phantom.train.sweep import Job, train_adapters  # noqa: E402
from phantom.train.trainconfig import TrainConfig  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--dim", type=int, default=1024)
    a("--layers", type=int, default=8)
    a("--heads", type=int, default=8)
    a("--vocab", type=int, default=1024)
    a("--batch-size", type=int, default=1)
    a("--seq-len", type=int, default=16)
    a("--offload", default="disk", choices=("disk", "ram", "none"), help="where the blocks stream from")
    a("--prefetch", type=int, default=2)
    a("--adapters", type=int, default=4)
    a("--throttle", type=float, default=None, metavar="GBPS", help="with --offload disk: read no faster than this")
    a("--steps", type=int, default=5, help="timed steps of each run (after one untimed)")
    a("--out", default="notes/bench-sweep.md")
    return p.parse_args(argv)


class SlowDiskTier(tiers.DiskTier):
    """The disk tier read no faster than `gbps` in all: one read at a time (the reader threads queue for the
    link), each padded with a sleep to that rate."""

    name = "slowdisk"

    def __init__(self, gbps: float):
        self.gbps, self.link = gbps, threading.Lock()

    def read_s(self, nbytes: int, profile) -> float:
        return max(nbytes / (self.gbps * tiers.GB), super().read_s(nbytes, profile))

    def open(self, ctx: tiers.TierContext, blocks: list[int]) -> tiers.Held:
        return SlowDiskHeld(self, ctx)


class SlowDiskHeld(tiers.DiskHeld):
    def read_into(self, block: int, into: torch.Tensor):
        with self.tier.link:
            t0 = time.perf_counter()
            check = super().read_into(block, into)
            floor = into.numel() * into.element_size() / (self.tier.gbps * tiers.GB)
            time.sleep(max(0.0, floor - (time.perf_counter() - t0)))
        return check


def config(args, out: Path, name: str, k: int) -> TrainConfig:
    return TrainConfig(iters=args.steps + 1, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3 * (k + 1),
                       seed=k, warmup=1, eval_every=0, save_every=0, workers=0, progress=False, out=str(out / name))


def step_figures(out: Path) -> tuple[float, float]:
    """(median step seconds past the first, median bytes read from disk per step) of a run's metrics.jsonl."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 1]
    return median(r["step_s"] for r in steps), median(r.get("bytes_read", 0) for r in steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.throttle:
        tiers.register(SlowDiskTier(args.throttle), replace=True)
        args.offload = "slowdisk"
    torch.manual_seed(0)
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads,
                      vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))
    with tempfile.TemporaryDirectory(dir=os.environ.get("PHANTOM_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        store = write_synthetic(tmp / "store", cfg, torch.float32, progress=False)
        ids = np.random.default_rng(0).integers(0, args.vocab, 200_000).astype(np.int64)
        data = TokenData(ids, ids.copy(), np.zeros(1, np.int64), "text", "bench-random")
        load = dict(offload=args.offload, micro_batch=args.batch_size, recompute="all")
        if args.offload != "none":
            load["prefetch"] = args.prefetch
        names = [f"a{k}" for k in range(args.adapters)]
        with phantom.load(store, lora=None, **load) as model:
            train_adapters(model, [Job(n, phantom.LoraConfig(seed=k), config(args, tmp / "sweep", n, k), data)
                                   for k, n in enumerate(names)])
        together, read_together = step_figures(tmp / "sweep" / names[0])
        separate, read_one = [], 0.0
        for k, n in enumerate(names):
            with phantom.load(store, lora=phantom.LoraConfig(seed=k), **load) as model:
                train(model, data, None, config(args, tmp / "alone", n, k))
            s, read_one = step_figures(tmp / "alone" / n)
            separate.append(s)
        predicted = predicted_ratio(args, cfg)
    ratio = together / sum(separate)
    flags = sorted(f for f in (cpu_flags() or ()) if f.startswith(("avx", "amx")))
    cpu = f"{cpu_model()}, {os.cpu_count()} cores ({' '.join(flags)}); load average " \
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    text = "\n".join([
        f"\n### {args.adapters} adapters in one run against {args.adapters} runs: {args.offload}, dim {args.dim}, "
        f"{args.layers} layers, {args.batch_size} x {args.seq_len} tokens per adapter-step, fp32",
        "", f"    python benchmarks/bench_sweep.py {' '.join(sys.argv[1:] if argv is None else argv)}", "",
        f"machine: {cpu}; torch {torch.__version__}", "",
        "| | step (s) | read per step (MB) |", "|---|---|---|",
        f"| one run of {args.adapters} adapters | {together:.3f} | {read_together / 1e6:,.0f} |",
        f"| {args.adapters} separate runs (sum of their steps) | {sum(separate):.3f} "
        f"({' + '.join(f'{s:.3f}' for s in separate)}) | {args.adapters} x {read_one / 1e6:,.0f} |", "",
        f"measured ratio {ratio:.2f}; the cost model predicts {predicted:.2f} (quick profile of this machine)"])
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text + "\n")
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def predicted_ratio(args, cfg: ModelConfig) -> float:
    """phantom.plan.costsweep's ratio for the benchmark's placement, on a quick profile of this machine."""
    work = ci.Workload(args.batch_size, args.seq_len, "fp32", "fp32")
    profile = profiles.probe(cfg, torch.device("cpu"), work, None, True, False)
    shape = ci.shape_of(cfg, "fp32", "fp32", args.seq_len)
    placement = Placement(offload=args.offload, prefetch=args.prefetch if args.offload != "none" else None)
    acts = Activations(recompute="all", micro_batch=args.batch_size, compile=False)
    state = costsweep.lora_params(cfg) * costsweep.LORA_STATE_BYTES
    return costsweep.predict_sweep(profile, shape, placement, acts, args.batch_size, args.adapters, state).ratio


if __name__ == "__main__":
    sys.exit(main())
