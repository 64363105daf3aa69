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
    The cost model's profile is measured once on the bf16 store (a full profiles.measure: disk, compute); each
    quantized store adds its own measured dequantization rate (profiles.measure_dequant: on a CPU the compute's
    threads dequantize each loaded block when it is acquired).
    """
    from phantom.arch.quantformat import QuantFormat
    from phantom.model.quantstore import quantize_store
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
    big, cpu = max(batches), torch.device("cpu")
    # full profiles, one per batch's length as tune.py keeps them (profiles.length_bucket); per method, the
    # dequantization's rate
    by_batch = {b: profiles.measure(stores["bf16"], cpu, store.dtype, *b) for b in batches}
    profile = by_batch[big]
    rates = {m: profiles.measure_dequant(stores[m], cpu, store.dtype) for m in methods}
    place = phantom.Placement(offload="disk", prefetch=k)
    acts = phantom.Activations(recompute="none")
    rows = []
    for rows_, seq in batches:
        for name, st in stores.items():
            r = quant_steps(st, place, rows_, seq, args)
            prof = dataclasses.replace(by_batch[(rows_, seq)], dequant_gbps=rates.get(name, profile.dequant_gbps))
            dt = dtype_name(store.dtype)
            pred = cm.predict(prof, ci.shape_of(st.cfg, dt, dt, seq, st.quant),
                              place, acts, rows_)
            rows.append((name, rows_, seq, st, r, pred))
            print(f"{name} {rows_}x{seq}: {r['step_s']:.3f} s/step (predicted {pred.step_s:.3f}), "
                  f"{r['bytes_read'] / 1e6:.0f} MB read", flush=True)
    load.append(shell("cat /proc/loadavg"))
    return quant_lines(args, store, QuantRun(stores, rows, rates, profile, k, load, quantize_s))


@dataclasses.dataclass(frozen=True)
class QuantRun:
    """What quant_bench measured, for its lines in the notes."""

    stores: dict  # name -> BlockStore (bf16, nf4, int8)
    rows: list  # (store name, rows, tokens, store, step figures, prediction)
    rates: dict  # method -> GB/s of weights its dequantization produces
    profile: object  # the cost model's profile (measured on the bf16 store)
    prefetch: int
    load: list  # /proc/loadavg before and after
    quantize_s: float  # seconds to write the quantized stores


def quant_lines(args, store, run: QuantRun) -> str:
    """The notes' entry: command, machine, stores, dequantization rates, a table of steps against predictions."""
    stores, rows, rates, profile, k, load = run.stores, run.rows, run.rates, run.profile, run.prefetch, run.load
    cfg, dense, quantize_s = store.cfg, store.block_nbytes * 1.0, run.quantize_s
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python scripts/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; torch threads {torch.get_num_threads()}",
             f"- load (/proc/loadavg) before `{load[0]}`; after `{load[1]}` (the CPU is shared)",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}; compute {dtype_name(store.dtype)}; "
             f"disk tier, prefetch {k}, {'cold (O_DIRECT; page cache dropped)' if args.cold else 'warm'}; LoRA rank "
             f"{args.lora_rank} (q, v), recompute none; {args.steps} timed steps after a warm-up, medians",
             "- stores: " + "; ".join(f"{n} {s.block_nbytes / 2**20:.1f} MiB/block ({s.block_nbytes / dense:.3f}x), "
                                       f"RAM tier {s.block_nbytes * cfg.n_layers / 1e9:.2f} GB" for n, s in stores.items())
             + f" ({', '.join(rates)} written from the bf16 store in {quantize_s:.0f} s)",
             "- dequantization (per block, into the compute dtype, over the cores as a CPU run does it when a block "
             "is acquired; profiles.measure_dequant): "
             + "; ".join(f"{m} {g:.2f} GB/s of weights produced" for m, g in rates.items())
             + f"; disk read {profile.disk_gbps:.2f} GB/s cold (profiles.measure_disk)", "",
             "| store | rows x tokens | MB read/step | vs bf16 | dequant s/step | stall | step s | predicted s | "
             "error |", "|---|---|---|---|---|---|---|---|---|"]
    base = {(r, s): res["bytes_read"] for n, r, s, _, res, _ in rows if n == "bf16"}
    for name, r, s, st, res, pred in rows:
        lines.append(f"| {name} | {r} x {s} | {res['bytes_read'] / 1e6:.0f} | {res['bytes_read'] / base[(r, s)]:.3f} | "
                     f"{res['dequant_s']:.3f} | {res['stall_s'] / res['step_s']:.0%} | {res['step_s']:.3f} | "
                     f"{pred.step_s:.3f} | {res['step_s'] / pred.step_s - 1:+.1%} |")
    for m in rates:
        saved = (dense - stores[m].block_nbytes) / (profile.disk_gbps * 1e9)
        spent = dense / (rates[m] * 1e9)
        lines.append(f"- {m}: dequantizing a block takes {spent * 1e3:.0f} ms, the read it saves "
                     f"{saved * 1e3:.0f} ms: the dequantization is {'slower' if spent > saved else 'faster'} than "
                     f"the read it saves on this CPU")
    return "\n".join(lines) + "\n"
