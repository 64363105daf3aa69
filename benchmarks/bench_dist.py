"""Data-parallel benchmark: tokens/s and host memory of 1 vs N local ranks (torchrun, gloo on CPU).

    python benchmarks/bench_dist.py --dim 1024 --layers 8 --ranks 2 --offload ram

Each configuration runs under `python -m torch.distributed.run --standalone`; every rank trains its
slice of the same global batch (LoRA, gradients averaged by phantom.train.dist) and reports its peak RSS
and PSS. RSS counts shared page-cache pages once per process; PSS splits them between the processes
that map them, so the sum of PSS is what the machine really holds. Appends to notes/bench-dist.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phantom  # noqa: E402
from phantom.arch.config import ModelConfig  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--layers", type=int, default=8, help="blocks")
    p.add_argument("--ranks", type=int, default=2, help="local ranks to compare with 1")
    p.add_argument("--offload", default="ram", choices=["ram", "disk"], help="tier")
    p.add_argument("--batch-size", type=int, default=4, help="global rows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--store", default=None, help="use this store")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shared", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args()


def memory_kb() -> dict:
    """Peak RSS (VmHWM) and current PSS of this process, in kB, from /proc."""
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            out["rss_kb"] = int(line.split()[1])
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            out["pss_kb"] = int(line.split()[1])
    return out


def worker(args) -> None:
    import torch.distributed as dist

    from phantom.train.dist import average_gradients, init_from_env
    info = init_from_env("cpu")
    model = phantom.load(args.store, offload=args.offload, lora=phantom.LoraConfig(rank=8),
                         shared_ram=bool(args.shared) and args.offload == "ram")
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4)
    rows = args.batch_size // info.world_size
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))[info.rank * rows:(info.rank + 1) * rows]
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        average_gradients(model.trainable_parameters(), float(tokens[:, 1:].numel()))
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
    mem = memory_kb()
    gathered = [None] * info.world_size
    if info.enabled:
        dist.all_gather_object(gathered, mem)
    else:
        gathered = [mem]
    if info.is_main:
        step_s = statistics.median(times)
        print(json.dumps({"step_s": step_s, "tokens_per_s": args.batch_size * args.seq_len / step_s,
                          "rss_gb": sum(m["rss_kb"] for m in gathered) / 2**20,
                          "pss_gb": sum(m["pss_kb"] for m in gathered) / 2**20}))
    model.close()


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        if args.store is None:
            cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=16, vocab_size=32000, max_seq_len=1024)
            args.store = str(write_synthetic(Path(tmp) / "s", cfg, torch.float32, progress=False))
        rows = []
        for ranks, shared in [(1, 1), (args.ranks, 1), (args.ranks, 0)]:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   __file__, "--worker", "--store", args.store, "--offload", args.offload, "--shared", str(shared),
                   "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"error: {ranks} ranks failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((ranks, shared, r))
            print(f"ranks={ranks} shared={shared} {r}", flush=True)
    base = rows[0][2]["tokens_per_s"]
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench_dist.py {' '.join(sys.argv[1:])}`", "",
             f"- {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo; offload {args.offload}; global batch "
             f"{args.batch_size} x {args.seq_len}; OMP threads split between the ranks", "",
             "| ranks | RAM tier | step s | tokens/s | vs 1 rank | sum of peak RSS GB | sum of PSS GB |",
             "|---|---|---|---|---|---|---|"]
    for ranks, shared, r in rows:
        tier = "shared (mmap)" if shared and args.offload == "ram" else "private" if args.offload == "ram" else "disk"
        lines.append(f"| {ranks} | {tier} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['rss_gb']:.2f} | {r['pss_gb']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(Path(__file__).resolve().parent.parent / "notes" / "bench-dist.md", "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
