"""Where a CPU dequantizes a quantized block: over every core when the training thread acquires it (phantom's
choice, phantom.stream.transfer.DequantPool), or in a loader thread on one core beside the compute (what phantom
did before).

Measures, on a synthetic store of the bench model quantized (--method: nf4, int8, fp8-block, int4-group, mxfp4):
  1. the dequantization rate, a whole block at once over the cores (into the slot's dense block) and
     projection by projection into one buffer of the largest projection (what per-projection
     dequantization would hold), and the memory each holds;
  2. LoRA steps (prefetch 2, --offload ram or disk) with each loaded block dequantized at its acquire, and with
     a loader thread dequantizing it on one core beside the compute, side by side.

    python benchmarks/bench_dequant.py --dim 2048 --layers 8 --heads 16 --method nf4 --batches 1x8,2x128
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import phantom  # noqa: E402
from phantom.arch import quant  # noqa: E402
from phantom.arch.config import ModelConfig  # noqa: E402
from phantom.arch.quantformat import METHODS, SHIPPED, QuantFormat  # noqa: E402
from phantom.files.store import BlockStore  # noqa: E402
from phantom.convert.quantstore import quantize_store  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402
from phantom.stream.hostmem import HostBuffer  # noqa: E402
from phantom.stream.transfer import DequantPool, Transfer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--method", choices=METHODS + SHIPPED, default="nf4")
    p.add_argument("--batches", default="1x8,2x128", help="rows x tokens per step, comma-separated")
    p.add_argument("--offload", choices=("ram", "disk"), default="ram", help="the tier the blocks stream from")
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
    """GB/s of dense weights produced: a whole block over the cores (as a run does: DequantPool), a whole block in
    one call on torch's threads, projection by projection (one call each)."""
    raw = HostBuffer(store.block_nbytes, pin=False).tensor
    store.read_block_into(0, raw)
    stored = store.block_views(raw)
    block = store.dense_empty(dtype)
    quantized = {n: t for n, t in block.items() if n not in stored}  # stored as parts: "{n}.{part}"
    largest = max(t.numel() for t in quantized.values())
    one = torch.empty(largest, dtype=dtype)

    def per_projection():
        for name, t in quantized.items():
            prefix = name + "."
            parts = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
            quant.dequantize_into(store.quant, parts, one[:t.numel()].view(t.shape), name)
    nbytes = sum(t.numel() for t in quantized.values()) * dtype.itemsize
    pool = DequantPool(torch.get_num_threads())
    whole = timed(lambda: pool.dequantize(store, 0, stored, block), repeats)
    one_call = timed(lambda: store.dequantize_block(0, stored, block), repeats)
    parts = timed(per_projection, repeats)
    pool.close()
    return {"block_gbps": nbytes / whole / 1e9, "call_gbps": nbytes / one_call / 1e9, "projection_gbps": nbytes / parts / 1e9,
            "block_bytes": sum(t.numel() for t in block.values()) * dtype.itemsize, "projection_bytes": largest * dtype.itemsize}


@contextlib.contextmanager
def loader_dequantizes():
    """The transfer stage as it was: a CPU's loader thread dequantizes each block it loads, on one core."""
    real, defers = Transfer._dequantize, Transfer.__dict__["defers_dequant"]

    def on_one_core(self, *a, **k):
        with quant.one_thread():
            return real(self, *a, **k)
    Transfer.defers_dequant, Transfer._dequantize = property(lambda self: False), on_one_core
    try:
        yield
    finally:
        Transfer.defers_dequant, Transfer._dequantize = defers, real


def steps(store: Path, offload: str, rows: int, seq: int, n: int, loader: bool) -> dict:
    """Median seconds and dequantization seconds of LoRA steps (prefetch 2); `loader`: a loader thread
    dequantizes, as before."""
    gen = torch.Generator().manual_seed(0)
    times, dequant = [], []
    with loader_dequantizes() if loader else contextlib.nullcontext(), \
            phantom.load(store, dtype="bf16", offload=offload, prefetch=2, recompute="none") as model:
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
            rows.append((r, t, steps(path, args.offload, r, t, args.steps, loader=False),
                         steps(path, args.offload, r, t, args.steps, loader=True)))
    load.append(open("/proc/loadavg").read().strip() if Path("/proc/loadavg").exists() else "?")
    text = report(args, cfg, rates, rows, load)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


def report(args, cfg, rates: dict, rows: list, load: list) -> str:
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench_dequant.py {' '.join(sys.argv[1:])}`", "",
             f"- torch {torch.__version__}, {torch.get_num_threads()} threads; load before `{load[0]}`, after `{load[1]}`",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks, {args.method}, compute bf16, {args.offload} tier, "
             "prefetch 2, LoRA, recompute none",
             f"- {torch.get_num_threads()} threads: a whole block over the cores {rates['block_gbps']:.2f} GB/s of "
             f"bf16 weights produced, in one call on torch's threads {rates['call_gbps']:.2f} GB/s, projection by projection {rates['projection_gbps']:.2f} GB/s; held: a block "
             f"{rates['block_bytes'] / 2**20:.0f} MiB, the largest projection {rates['projection_bytes'] / 2**20:.0f} MiB",
             "", "| rows x tokens | step s, compute's threads at acquire | step s, a loader on one core beside | "
             "loader / acquire | dequant s/step (acquire, loader) |", "|---|---|---|---|---|"]
    for r, t, acquire, loader in rows:
        lines.append(f"| {r} x {t} | {acquire['step_s']:.3f} | {loader['step_s']:.3f} | "
                     f"{loader['step_s'] / acquire['step_s']:.2f} | {acquire['dequant_s']:.3f}, {loader['dequant_s']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
