"""--modes quant: the bench model stored bf16, NF4 and int8 (or --quant-methods: fp8-block too), read from disk,
beside the cost model."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

import phantom
from benchlib.common import lora_steps, machine, shell
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name
from phantom.plan import costinputs as ci
from phantom.plan import costmodel as cm
from phantom.plan import profiles


def quant_steps(store: BlockStore, placement, rows: int, seq: int, args) -> dict:
    """Median step time and per-step metrics of LoRA steps (lora_steps)."""
    times, metrics, _ = lora_steps(store, placement, rows, seq, args)
    med = {k: statistics.median(m[k] for m in metrics) for k in ("bytes_read", "dequant_s", "stall_s", "loads")}
    return {"step_s": statistics.median(times), "times": times, **med}


def quant_bench(args, store: BlockStore) -> str:
    """Mode quant: the bench model stored bf16 (this store), NF4 (double-quantized scales) and int8, each
    read from disk (prefetch K, cold: O_DIRECT and the page cache dropped) at each of --quant-batches.
    The cost model's profile is measured on the bf16 store before each batch's rows (a full profiles.measure:
    disk, compute); each quantized store adds its own dequantization rate, measured before its row
    (profiles.measure_dequant: on a CPU the compute's threads dequantize each loaded block when it is acquired).
    """
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    if store.dtype.itemsize != 2 or store.quant is not None:
        print("error: --modes quant needs a 16-bit store to quantize (--dtype bf16)", file=sys.stderr)
        sys.exit(2)
    k = int(args.prefetch.split(",")[0])
    if store.n_blocks <= k + 1:  # every block stays in a slot after the warm-up: no step would read
        print(f"error: --modes quant needs more blocks than the {k + 1} slots of prefetch {k} (the steps would read "
              f"nothing); use --layers {k + 2} or more", file=sys.stderr)
        sys.exit(2)
    batches = [tuple(int(x) for x in b.split("x")) for b in args.quant_batches.split(",")]
    load = [shell("cat /proc/loadavg")]
    t0 = time.perf_counter()
    stores = {"bf16": store}
    methods = args.quant_methods.split(",")
    for method in methods:
        out = store.path.parent / f"{store.path.name}-{method}"
        if not (out / "manifest.json").is_file():
            quantize_store(store.path, out, QuantFormat(method), progress=False)
        stores[method] = BlockStore(out, drop_cache=args.cold)
    stores["bf16"] = BlockStore(store.path, drop_cache=args.cold)
    quantize_s = time.perf_counter() - t0
    cpu = torch.device("cpu")
    # Each row's cost-model inputs are measured just before its steps: the compute and disk once per batch's
    # length on the bf16 store (a full profiles.measure, as tune.py keeps one per profiles.length_bucket), each
    # quantized store's dequantization rate (profiles.measure_dequant) right before its own steps. This CPU's rates
    # drift by tens of percent over a minute (a memory-bound dequantization most), which a profile taken once
    # at the start would charge to the model.
    place = phantom.Placement(offload="disk", prefetch=k)
    acts = phantom.Activations(recompute="none")
    rows, rates, profile = [], {m: [] for m in methods}, None
    for _ in range(args.rounds):  # rounds interleave the rows (A B A B): a drift of the machine reaches every row
        for rows_, seq in batches:
            profile = profiles.measure(stores["bf16"], cpu, store.dtype, rows_, seq)
            for name, st in stores.items():
                rate = profile.dequant_gbps  # bf16: none to measure
                if name in rates:
                    rate = profiles.measure_dequant(st, cpu, store.dtype)
                    rates[name].append(rate)
                r = quant_steps(st, place, rows_, seq, args)
                dt = dtype_name(store.dtype)
                pred = cm.predict(dataclasses.replace(profile, dequant_gbps=rate),
                                  ci.shape_of(st.cfg, dt, dt, seq, st.quant), place, acts, rows_)
                rows.append((name, rows_, seq, st, r, pred.step_s))
                print(f"{name} {rows_}x{seq}: {r['step_s']:.3f} s/step (predicted {pred.step_s:.3f}), "
                      f"{r['bytes_read'] / 1e6:.0f} MB read", flush=True)
    load.append(shell("cat /proc/loadavg"))
    return quant_lines(args, store, QuantRun(stores, rows, rates, profile, k, load, quantize_s))


@dataclasses.dataclass(frozen=True)
class QuantRun:
    """What quant_bench measured, for its lines in the notes."""

    stores: dict  # name -> BlockStore (bf16, nf4, int8)
    rows: list  # (store name, rows, tokens, store, step figures, predicted step s), each round's
    rates: dict  # method -> GB/s of weights its dequantization produces, measured before each of its rows
    profile: object  # the cost model's profile of the last batch (measured on the bf16 store)
    prefetch: int
    load: list  # /proc/loadavg before and after
    quantize_s: float  # seconds to write the quantized stores


def quant_lines(args, store, run: QuantRun) -> str:
    """The notes' entry: command, machine, stores, dequantization rates, a table of steps against predictions."""
    stores, rows, rates, profile, k, load = run.stores, run.rows, run.rates, run.profile, run.prefetch, run.load
    cfg, dense, quantize_s = store.cfg, store.block_nbytes * 1.0, run.quantize_s
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; torch threads {torch.get_num_threads()}",
             f"- load (/proc/loadavg) before `{load[0]}`; after `{load[1]}` (the CPU is shared)",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}; compute {dtype_name(store.dtype)}; "
             f"disk tier, prefetch {k}, {'cold (O_DIRECT; page cache dropped)' if args.cold else 'warm'}; LoRA rank "
             f"{args.lora_rank} (q, v), recompute none; {args.steps} timed steps after a warm-up, medians; {args.rounds} "
             f"round(s), the rows interleaved, each round's inputs measured before its row: medians over rounds",
             "- stores: " + "; ".join(f"{n} {s.block_nbytes / 2**20:.1f} MiB/block ({s.block_nbytes / dense:.3f}x), "
                                       f"RAM tier {s.block_nbytes * cfg.n_layers / 1e9:.2f} GB" for n, s in stores.items())
             + f" ({', '.join(rates)} written from the bf16 store in {quantize_s:.0f} s)",
             "- dequantization (per block, into the compute dtype, over the cores as a CPU run does it when a block "
             "is acquired; profiles.measure_dequant, just before each row's steps, in the rows' order): "
             + "; ".join(f"{m} {', '.join(f'{g:.2f}' for g in gs)} GB/s of weights produced" for m, gs in rates.items())
             + f"; disk read {profile.disk_gbps:.2f} GB/s cold (profiles.measure_disk, the last batch's profile)", "",
             "| store | rows x tokens | MB read/step | vs bf16 | dequant s/step | stall | step s | predicted s | "
             "error | error by round |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_row: dict = {}  # (store name, rows, tokens) -> that row's rounds, in the first round's order
    for name, r, s, st, res, pred in rows:
        by_row.setdefault((name, r, s), []).append((res, pred))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    base = {(r, s): med([res["bytes_read"] for res, _ in runs]) for (n, r, s), runs in by_row.items() if n == "bf16"}
    for (name, r, s), runs in by_row.items():
        step, pred = med([res["step_s"] for res, _ in runs]), med([p for _, p in runs])
        read = med([res["bytes_read"] for res, _ in runs])
        by_round = ", ".join(f"{res['step_s'] / p - 1:+.0%}" for res, p in runs)
        lines.append(f"| {name} | {r} x {s} | {read / 1e6:.0f} | {read / base[(r, s)]:.3f} | "
                     f"{med([res['dequant_s'] for res, _ in runs]):.3f} | "
                     f"{med([res['stall_s'] / res['step_s'] for res, _ in runs]):.0%} | {step:.3f} | {pred:.3f} | "
                     f"{step / pred - 1:+.1%} | {by_round} |")
    for m in rates:
        saved = (dense - stores[m].block_nbytes) / (profile.disk_gbps * 1e9)
        spent = dense / (statistics.median(rates[m]) * 1e9)
        lines.append(f"- {m}: dequantizing a block takes {spent * 1e3:.0f} ms, the read it saves "
                     f"{saved * 1e3:.0f} ms: the dequantization is {'slower' if spent > saved else 'faster'} than "
                     f"the read it saves on this CPU")
    return "\n".join(lines) + "\n"
