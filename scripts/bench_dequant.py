"""Where a quantized block is dequantized: a whole block in the loader thread (phantom's choice) or
one projection at a time just before its matmul on the compute thread.

Measures, on a synthetic store of the bench model quantized to NF4 or int8:
  1. the dequantization rate on one thread, a whole block at once (into the slot's dense block) and
     projection by projection into one buffer of the largest projection (what per-projection
     dequantization would hold), and the device memory each holds;
  2. LoRA steps from the RAM tier with the loader dequantizing a block beside the compute (prefetch 2)
     and with every load, dequantization included, in line with the compute (prefetch 0): the time a
     compute-thread dequantization, per projection or per block, would add to each step.

    python scripts/bench_dequant.py --dim 2048 --layers 8 --heads 16 --method nf4 --batches 1x8,2x128
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import phantom  # noqa: E402
from phantom.arch import quant
from phantom.arch.config import ModelConfig  # noqa: E402
from phantom.arch.quantformat import METHODS, QuantFormat  # noqa: E402
from phantom.files.store import BlockStore  # noqa: E402
from phantom.model.quantstore import quantize_store  # noqa: E402
from phantom.model.synthetic import write_synthetic  # noqa: E402
from phantom.stream.hostmem import HostBuffer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--method", choices=METHODS, default="nf4")
    p.add_argument("--batches", default="1x8,2x128", help="rows x tokens per step, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up (medians)")
    p.add_argument("--repeats", type=int, default=5, help="timed dequantizations of block 0 (medians)")
    p.add_argument("--out", default=None, help="append the results to this markdown file")
    return p.parse_args(argv)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dequant_rates(store: BlockStore, dtype: torch.dtype, repeats: int) -> dict:
    """GB/s of dense weights produced on one thread, whole block vs projection by projection."""
    raw = HostBuffer(store.block_nbytes, pin=False).tensor
    store.read_block_into(0, raw)
    stored = store.block_views(raw)
    block = store.dense_empty(dtype)
    quantized = {n: t for n, t in block.items() if f"{n}.{store.quant.method}" in stored}
    largest = max(t.numel() for t in quantized.values())
    one = torch.empty(largest, dtype=dtype)

    def per_projection():
        for name, t in quantized.items():
            prefix = name + "."
            parts = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
            quant.dequantize_into(store.quant, parts, one[:t.numel()].view(t.shape), name)
    nbytes = sum(t.numel() for t in quantized.values()) * dtype.itemsize
    with quant.one_thread():
        whole = timed(lambda: store.dequantize_block(0, stored, block), repeats)
        parts = timed(per_projection, repeats)
    return {"block_gbps": nbytes / whole / 1e9, "projection_gbps": nbytes / parts / 1e9,
            "block_bytes": sum(t.numel() for t in block.values()) * dtype.itemsize, "projection_bytes": largest * dtype.itemsize}


def steps(store: Path, prefetch: int, rows: int, seq: int, n: int) -> dict:
    """Median seconds and loader dequantization seconds of LoRA steps from the RAM tier."""
    gen = torch.Generator().manual_seed(0)
    times, dequant = [], []
    with phantom.load(store, dtype="bf16", offload="ram", prefetch=prefetch, recompute="none") as model:
        for s in range(n + 1):
            tokens = torch.randint(0, model.cfg.vocab_size, (rows, seq), generator=gen)
            t0 = time.perf_counter()
            model(tokens, targets=tokens).backward()
            m = model.scheduler.take_metrics()
            if s:
                times.append(time.perf_counter() - t0)
                dequant.append(m["dequant_s"])
    return {"step_s": statistics.median(times), "dequant_s": statistics.median(dequant)}


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab)
    load = [open("/proc/loadavg").read().strip() if Path("/proc/loadavg").exists() else "?"]
    with tempfile.TemporaryDirectory(prefix="bench-dequant-", dir=".") as tmp:
        base = write_synthetic(Path(tmp) / "bf16", cfg, torch.bfloat16, progress=False)
        path = Path(tmp) / args.method
        quantize_store(base, path, QuantFormat(args.method), progress=False)
        rates = dequant_rates(BlockStore(path), torch.bfloat16, args.repeats)
        rows = []
        for batch in args.batches.split(","):
            r, t = (int(x) for x in batch.split("x"))
            rows.append((r, t, steps(path, 2, r, t, args.steps), steps(path, 0, r, t, args.steps)))
    load.append(open("/proc/loadavg").read().strip() if Path("/proc/loadavg").exists() else "?")
    text = report(args, cfg, rates, rows, load)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


def report(args, cfg, rates: dict, rows: list, load: list) -> str:
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python scripts/bench_dequant.py {' '.join(sys.argv[1:])}`", "",
             f"- torch {torch.__version__}, {torch.get_num_threads()} threads; load before `{load[0]}`, after `{load[1]}`",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks, {args.method}, compute bf16, RAM tier, LoRA, recompute none",
             f"- one thread: a whole block {rates['block_gbps']:.2f} GB/s of bf16 weights produced, projection by "
             f"projection {rates['projection_gbps']:.2f} GB/s; held on the device: a block "
             f"{rates['block_bytes'] / 2**20:.0f} MiB, the largest projection {rates['projection_bytes'] / 2**20:.0f} MiB",
             "", "| rows x tokens | step s, loader dequantizes beside compute | step s, in line with compute | "
             "added | dequant s/step |", "|---|---|---|---|---|"]
    for r, t, beside, inline in rows:
        lines.append(f"| {r} x {t} | {beside['step_s']:.3f} | {inline['step_s']:.3f} | "
                     f"{inline['step_s'] / beside['step_s'] - 1:+.0%} | {beside['dequant_s']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
