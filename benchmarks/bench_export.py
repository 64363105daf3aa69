"""Time merge_lora.py's exports side by side on one synthetic store: Hugging Face safetensors against GGUF.

A store of a preset's shapes (cut to --layers blocks) with random weights and the given tokenizer file, then
each format written from it in turn, twice (the faster kept), in one process; the table (wall and CPU
seconds, bytes written, ratio to the HF export) is printed and appended to --notes with the command and
the machine.

    python benchmarks/bench_export.py --preset 7B --layers 8 --tokenizer tokenizer.json --notes notes/bench-gguf.md
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from benchlib.common import machine, process_cpu_s  # noqa: E402
from phantom.arch.presets import preset  # noqa: E402
from phantom.files.tensorfile import parse_dtype  # noqa: E402
from phantom.convert.convert import disk_usage  # noqa: E402
from phantom.export.export import FormatOptions, export  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402
from phantom.train import cli  # noqa: E402

FORMATS = {"hf": ("hf", None), "gguf-bf16": ("gguf", "bf16"), "gguf-f16": ("gguf", "f16"),
           "gguf-q8_0": ("gguf", "q8_0")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="7B", help="the shapes (a phantom preset name)")
    p.add_argument("--layers", type=int, default=None, help="cut the preset to this many blocks")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the store's dtype")
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="tokenizer.model or tokenizer.json of the preset's vocabulary (GGUF carries it)")
    p.add_argument("--formats", default="hf,gguf-bf16,gguf-q8_0", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--work", type=Path, default=None, help="folder for the store and exports (default: a temp one)")
    p.add_argument("--notes", type=Path, default=None, help="append the table to this markdown file")
    return p.parse_args(argv)


def timed_export(store: Path, out: Path, fmt: str) -> tuple[float, float, int]:
    """(wall s, CPU s, bytes on disk) of one export, the faster of two runs."""
    kind, outtype = FORMATS[fmt]
    best = None
    for _ in range(2):
        shutil.rmtree(out, ignore_errors=True)
        wall, cpu = time.perf_counter(), process_cpu_s()
        export(store, out, fmt=kind, progress=False, options=FormatOptions(outtype=outtype))
        run = (time.perf_counter() - wall, process_cpu_s() - cpu, disk_usage(out))
        best = run if best is None or run[0] < best[0] else best
    shutil.rmtree(out)
    return best


def run(argv=None) -> int:
    args = parse_args(argv)
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        raise ValueError(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    cfg = preset(args.preset)
    cfg = dataclasses.replace(cfg, n_layers=args.layers) if args.layers else cfg
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-export-"))
    store = write_synthetic(work / f"{args.preset}-synthetic", cfg, parse_dtype(args.dtype), tokenizer=args.tokenizer,
                            overwrite=True, progress=False)
    rows = {fmt: timed_export(store, work / fmt, fmt) for fmt in formats}
    base = rows.get("hf", next(iter(rows.values())))[0]
    lines = [f"### {args.preset} shapes, {cfg.n_layers} blocks, {args.dtype} store ({disk_usage(store) / 1e9:.2f} GB)",
             "", "    python benchmarks/bench_export.py " + " ".join(argv if argv is not None else sys.argv[1:]), "",
             f"Machine: {machine()}.", "", "| format | wall s | CPU s | GB written | wall / hf |", "|---|---|---|---|---|"]
    lines += [f"| {fmt} | {w:.1f} | {c:.1f} | {b / 1e9:.2f} | {w / base:.2f} |" for fmt, (w, c, b) in rows.items()]
    print("\n".join(lines))
    if args.notes:
        with open(args.notes, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    if args.work is None:
        shutil.rmtree(work)
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
