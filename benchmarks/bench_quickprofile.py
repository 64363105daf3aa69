"""A quick profile against a full one: how far `tune.py --quick`'s plan (a block's compute timed on a
slice of it and scaled by FLOPs, phantom.plan.quickslice) is from the plan of a full measurement of the
whole block, and how long each takes. Each measurement is its own `tune.py --json --remeasure` process
with its own profile folder, quick then full for each case, side by side under the same conditions:

    python benchmarks/bench_quickprofile.py --presets 7B,70B --dtypes fp32,bf16 --isas native,AVX512_CORE

`--isas`: oneDNN's ISA cap per case (ONEDNN_MAX_CPU_ISA; `native` leaves it unset): AVX512_CORE keeps
oneDNN from a CPU's bf16 instructions, so bf16 is emulated as on a CPU without them. Prints a markdown
table (and appends it to --notes).

`--ab ROUNDS` isolates the scaling: in one process per case, one block of the shape and the quick
profile's slice of it, their compute timed alternately (slice, whole, slice, whole, ...: a shared
machine's load drifts alike over both), each round's rates giving the whole model's compute per step
(every block in RAM, recompute all, `cm.predict`); the error is of the medians.

    python benchmarks/bench_quickprofile.py --ab 2 --presets 7B,70B --dtypes fp32,bf16 --isas native,AVX512_CORE

`--slices K,K,...` times each call kind (forward, graph forward, backward) of one block of each slice 1/K of the
shape (1: the whole block) in one process per case, as GFLOP/s of the block's forward FLOPs: whether the call
kinds scale with the slice alike (what the quick profile's line through two slices assumes).

    python benchmarks/bench_quickprofile.py --slices 64,16,4,1 --presets 70B --dtypes bf16 --isas native,AVX512_CORE
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUNE = ROOT / "scripts" / "tune.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="7B,70B", help="comma list of presets to plan")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of compute dtypes")
    p.add_argument("--isas", default="native,AVX512_CORE", help="comma list of oneDNN ISA caps (native: none)")
    p.add_argument("--batch-size", type=int, default=1, help="tune.py --batch-size")
    p.add_argument("--seq-len", type=int, default=128, help="tune.py --seq-len")
    p.add_argument("--disk-budget", default="300G", help="tune.py --disk-budget")
    p.add_argument("--quick-only", action="store_true", help="time the quick plans alone (no full measurement)")
    p.add_argument("--notes", type=Path, default=None, help="append the table to this markdown file")
    p.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="compute alone, slice and whole block "
                                                                      "alternately in one process, ROUNDS times")
    p.add_argument("--slices", default=None, help="time each call kind on slices 1/K of a block (comma list of K)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one --ab case, in its own process
    return p.parse_args(argv)


def tune(args, preset: str, dtype: str, isa: str, quick: bool) -> dict:
    """One `tune.py --json --remeasure` process: its plan, profile and wall seconds."""
    env = dict(os.environ)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    with tempfile.TemporaryDirectory(prefix="bench-quick-") as profiles:
        cmd = [sys.executable, str(TUNE), "--preset", preset, "--dtype", dtype, "--device", "cpu", "--batch-size",
               str(args.batch_size), "--seq-len", str(args.seq_len), "--disk-budget", args.disk_budget, "--json",
               "--remeasure", "--profile-dir", profiles] + (["--quick"] if quick else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return {**json.loads(r.stdout.splitlines()[-1]), "wall_s": wall}


def at_placement(preset: str, dtype: str, seq_len: int, quick: dict, full: dict) -> float:
    """The quick profile's predicted step for the full plan's placement and activations (with the full
    measurement's free memory): the two plans may choose differently where free memory moved between them."""
    sys.path.insert(0, str(ROOT))
    from phantom.arch import presets as config
    from phantom.plan import costinputs as ci, costmodel as cm

    plan = cm.Prediction.from_dict(full)
    profile = ci.MachineProfile.from_dict({**quick["profile"], **{k: full["profile"][k] for k in (
        "free_host_bytes", "free_device_bytes", "free_disk_bytes")}})
    shape = ci.shape_of(config.preset(preset), "bf16", dtype, seq_len)
    return cm.predict(profile, shape, plan.placement, plan.activations, plan.rows, tiers=plan.tiers).step_s


def row(preset: str, dtype: str, isa: str, quick: dict, full: dict | None, seq_len: int = 128) -> str:
    q = quick["profile"]
    timed = q["measured_on"].partition("(compute timed on ")[2].rstrip(")") or "the whole block"
    cells = [preset, dtype, isa, f"{quick['wall_s']:.0f}", timed, f"{q['fwd_flops'] / 1e9:.0f}", f"{quick['step_s']:.2f}"]
    if full is None:
        cells += ["", "", "", "", "", ""]
    else:
        f = full["profile"]
        same = at_placement(preset, dtype, seq_len, quick, full)
        cells += [f"{full['wall_s']:.0f}", f"{f['fwd_flops'] / 1e9:.0f}", f"{full['step_s']:.2f}",
                  f"{quick['step_s'] / full['step_s'] - 1:+.1%}", f"{same / full['step_s'] - 1:+.1%}",
                  f"{quick['compute_s'] / full['compute_s'] - 1:+.1%}"]
    emulated = quick.get("fp32_step_s")
    cells.append(f"yes (fp32 {emulated:.2f} s)" if quick.get("bf16_emulated") and emulated else
                 "yes" if quick.get("bf16_emulated") else "")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| preset | dtype | oneDNN ISA | quick wall s | compute timed on | quick fwd GFLOP/s | quick step s | full wall s "
          "| full fwd GFLOP/s | full step s | step error | step error at the full plan's placement | compute error | "
          "emulated bf16 warning |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


AB_HEADER = ("| preset | dtype | oneDNN ISA | slice | slice s (each round) | whole s (each round) | slice fwd GFLOP/s | "
             "whole fwd GFLOP/s | slice compute s/step | whole compute s/step | compute error | load after |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|")
SLICES_HEADER = ("| preset | dtype | oneDNN ISA | slice | forward GFLOP/s | graph forward GFLOP/s | backward GFLOP/s |\n"
                 "|---|---|---|---|---|---|---|")


def ab_case(args, preset: str, dtype: str) -> dict:
    """One case of --ab, in this process: the slice and the whole block timed alternately."""
    import dataclasses
    import statistics

    import torch

    sys.path.insert(0, str(ROOT))
    from phantom.arch import presets as config
    from phantom.files.store import BlockStore
    from phantom.convert.synthetic import write_synthetic
    from phantom.plan import computetimer as ct, costinputs as ci, costmodel as cm, profiles, quickslice as qs
    from phantom.stream.placement import Activations, Placement

    cfg, device, dt = config.preset(preset), torch.device("cpu"), getattr(torch, {"fp32": "float32"}.get(dtype, "bfloat16"))
    work = ci.Workload(args.batch_size, args.seq_len, dtype, "bf16")
    timed, _ = profiles.quick_points(cfg, work, device, dt)  # as a quick profile chooses them
    whole = ci.shape_of(cfg, "bf16", dtype, args.seq_len)
    out = {"k": "+".join(f"1/{k}" if t == args.seq_len else f"{t} tokens" for k, t in timed), "slice": [], "whole": []}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        def store(name, c):
            return BlockStore(write_synthetic(Path(tmp) / name, dataclasses.replace(c, n_layers=1), torch.bfloat16,
                                              progress=False), verify="none")
        by_k = {k: store(f"slice{k}", qs.slice_config(cfg, k)) for k in dict.fromkeys(k for k, _ in timed)}
        stores = {"slice": [(by_k[k], t) for k, t in timed],
                  "whole": [(by_k[1] if 1 in by_k else store("whole", cfg), args.seq_len)]}
        for _ in range(args.ab):
            for name, repeats in (("slice", qs.QUICK_REPEATS), ("whole", 4)):  # as a quick and a full profile
                t0 = time.perf_counter()
                points = [(ct.measure_compute(s, device, dt, t, args.batch_size if name == "whole" else 1, None,
                                              repeats), ci.shape_of(s.cfg, "bf16", dtype, t)) for s, t in stores[name]]
                wall = time.perf_counter() - t0
                rates = profiles.compute_rates(qs.scaled_times(points, whole), whole)
                profile = ci.MachineProfile(machine="ab", device="cpu", dtype=dtype, **rates)
                pred = cm.predict(profile, whole, Placement(offload="ram", prefetch=0), Activations(recompute="all"),
                                  args.batch_size)
                out[name].append({"wall_s": wall, "fwd_flops": rates["fwd_flops"], "compute_s": pred.compute_s})
    for name in ("slice", "whole"):
        out[f"{name}_compute_s"] = statistics.median(r["compute_s"] for r in out[name])
    return out


def slices_case(args, preset: str, dtype: str) -> list[dict]:
    """Per slice 1/K: GFLOP/s of the block's forward FLOPs over each call kind's seconds."""
    import dataclasses

    import torch

    sys.path.insert(0, str(ROOT))
    from phantom.arch import presets as config
    from phantom.files.store import BlockStore
    from phantom.convert.synthetic import write_synthetic
    from phantom.plan import computetimer as ct, costinputs as ci, quickslice as qs

    cfg, device, dt = config.preset(preset), torch.device("cpu"), getattr(torch, {"fp32": "float32"}.get(dtype, "bfloat16"))
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-slices-") as tmp:
        for k in (int(x) for x in args.slices.split(",")):
            c = dataclasses.replace(qs.slice_config(cfg, k) if k > 1 else cfg, n_layers=1)
            store = BlockStore(write_synthetic(Path(tmp) / f"k{k}", c, torch.bfloat16, progress=False), verify="none")
            r = ct.measure_compute(store, device, dt, args.seq_len, 1, None, 3)
            flops = ci.shape_of(c, "bf16", dtype, args.seq_len).flops_per_row
            out.append({"k": k, **{name: flops / r[f"{name}_row_s"] / 1e9 for name in ("fwd", "fwd_grad", "bwd")}})
            shutil.rmtree(store.path)
    return out


def slices(args, preset: str, dtype: str, isa: str) -> list[str]:
    """One --slices case in its own process (oneDNN reads its ISA cap when the process starts): table rows."""
    env = dict(os.environ)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    cmd = [sys.executable, __file__, "--case", f"{preset},{dtype}", "--slices", args.slices, "--seq-len",
           str(args.seq_len)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return [f"| {preset} | {dtype} | {isa} | 1/{x['k']} | {x['fwd']:.1f} | {x['fwd_grad']:.1f} | {x['bwd']:.1f} |"
            for x in json.loads(r.stdout.splitlines()[-1])]


def ab_row(preset: str, dtype: str, isa: str, r: dict) -> str:
    import statistics
    cells = [preset, dtype, isa, r["k"], ", ".join(f"{x['wall_s']:.0f}" for x in r["slice"]),
             ", ".join(f"{x['wall_s']:.0f}" for x in r["whole"]),
             f"{statistics.median(x['fwd_flops'] for x in r['slice']) / 1e9:.0f}",
             f"{statistics.median(x['fwd_flops'] for x in r['whole']) / 1e9:.0f}",
             f"{r['slice_compute_s']:.1f}", f"{r['whole_compute_s']:.1f}",
             f"{r['slice_compute_s'] / r['whole_compute_s'] - 1:+.1%}"]
    return "| " + " | ".join(cells) + " |"


def ab(args, preset: str, dtype: str, isa: str) -> str:
    """One --ab case in its own process (oneDNN reads its ISA cap when the process starts)."""
    env = dict(os.environ)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    cmd = [sys.executable, __file__, "--case", f"{preset},{dtype}", "--ab", str(args.ab), "--batch-size",
           str(args.batch_size), "--seq-len", str(args.seq_len)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return ab_row(preset, dtype, isa, json.loads(r.stdout.splitlines()[-1]))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(slices_case(args, *args.case.split(",")) if args.slices else
                         ab_case(args, *args.case.split(","))))
        return 0
    lines = [f"`python benchmarks/bench_quickprofile.py {' '.join(argv if argv is not None else sys.argv[1:])}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, load average before {os.getloadavg()[0]:.2f}", "",
             SLICES_HEADER if args.slices else AB_HEADER if args.ab else HEADER]
    print("\n".join(lines), flush=True)
    for preset in args.presets.split(","):
        for isa in args.isas.split(","):
            for dtype in args.dtypes.split(","):
                if args.slices:
                    lines.extend(slices(args, preset, dtype, isa))
                    print("\n".join(lines[-len(args.slices.split(",")):]), flush=True)
                    continue
                if args.ab:
                    lines.append(ab(args, preset, dtype, isa) + f" {os.getloadavg()[0]:.1f} |")
                    print(lines[-1], flush=True)
                    continue
                quick = tune(args, preset, dtype, isa, quick=True)
                full = None if args.quick_only else tune(args, preset, dtype, isa, quick=False)
                lines.append(row(preset, dtype, isa, quick, full, args.seq_len))
                print(lines[-1], flush=True)
    if args.notes is not None:
        with open(args.notes, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
