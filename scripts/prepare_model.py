"""Write a block store from a downloaded Llama (Meta or Hugging Face format), or random weights.

    python scripts/prepare_model.py --src ~/Llama-2-70b --out weights/70B --dtype bf16
    python scripts/prepare_model.py --synthetic --preset 70B --layers 4 --out weights/x --dtype bf16
    python scripts/prepare_model.py --src ~/Llama-2-70b --out weights/70B-nf4 --quantize nf4
    python scripts/prepare_model.py --src weights/70B --out weights/70B-nf4 --quantize nf4   # from a store
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from phantom.arch.presets import preset  # noqa: E402
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import METHODS, QuantFormat  # noqa: E402
from phantom.files.tensorfile import parse_dtype  # noqa: E402
from phantom.convert.convert import convert_checkpoint, disk_usage  # noqa: E402
from phantom.convert.quantstore import quantize_store  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402
from phantom.train import cli
from phantom.train.cli import STORE_DTYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, help="checkpoint folder: Meta (params.json + consolidated.NN.pth) or "
                                            "Hugging Face (config.json + *.safetensors); the format is detected. "
                                            "With --quantize also a 16-bit phantom store")
    p.add_argument("--out", type=Path, required=True, help="store folder to create, e.g. weights/70B")
    p.add_argument("--dtype", choices=STORE_DTYPES, default=None,
                   help="store dtype (default: the checkpoint's; bf16 for --synthetic)")
    p.add_argument("--link", action="store_true",
                   help="Hugging Face safetensors only: point the store at the tensors inside the original files "
                        "instead of copying them (they must stay in place, unchanged)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the phantom store at --out (a folder that is not one is refused, never removed)")
    p.add_argument("--synthetic", action="store_true", help="random weights with --preset's shapes instead of --src")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="shapes for --synthetic")
    p.add_argument("--layers", type=int, default=None, help="with --synthetic: cut the model to N blocks")
    p.add_argument("--seed", type=int, default=0, help="with --synthetic: the random seed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--quantize", choices=METHODS, default=None,
                   help="store every block's linear weights quantized: nf4 (QLoRA's 4-bit NormalFloat, 64 values "
                        "per absmax scale) or int8 (one absmax scale per output channel); norms, embedding and "
                        "head stay 16-bit. For LoRA: a quantized store is frozen")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True,
                   help="nf4: store the block scales as 8-bit codes too (QLoRA's double quantization)")
    args = p.parse_args(argv)
    if args.synthetic == (args.src is not None):
        p.error("give either --src DIR or --synthetic")
    if args.layers is not None and (not args.synthetic or args.layers < 1):
        p.error("--layers N (N >= 1) goes with --synthetic")
    return args


def size(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def run(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    quant = QuantFormat(args.quantize, double_quant=args.double_quant) if args.quantize else None
    if quant is not None and args.src is not None and (args.src / "manifest.json").is_file():
        info = quantize_store(args.src, args.out, quant, parse_dtype(args.dtype) if args.dtype else None,
                              overwrite=args.overwrite, progress=not args.quiet)
    elif args.synthetic:
        overrides = {"n_layers": args.layers} if args.layers else {}
        cfg = preset(args.preset, **overrides)
        dtype = parse_dtype(args.dtype or "bf16")
        out = write_synthetic(args.out, cfg, dtype, seed=args.seed, overwrite=args.overwrite,
                              progress=not args.quiet, quant=quant)
        info = {"out": out, "format": f"synthetic {args.preset}", "config": cfg, "dtype": dtype,
                "disk_bytes": disk_usage(out), "linked_bytes": 0}
    else:
        info = convert_checkpoint(args.src, args.out, parse_dtype(args.dtype) if args.dtype else None,
                                  link=args.link, overwrite=args.overwrite, progress=not args.quiet, quant=quant)
    cfg = info["config"]
    print(f"wrote {info['out']} from {info['format']} in {time.perf_counter() - t0:.1f} s: {cfg.n_layers} blocks, "
          f"{cfg.n_params():,} parameters, {str(info['dtype']).removeprefix('torch.')}"
          + (f", linear weights {quant.method}" if quant else "")
          + (f", linear weights {shipped.method} as the checkpoint ships them" if (shipped := info.get("quant"))
             and shipped.shipped else ""))
    linked = info.get("linked_bytes", 0)
    print(f"disk: the store takes {size(info['disk_bytes'])}"
          + (f"; {size(linked)} more are read in place from the checkpoint's files (--link)" if linked else ""))
    if args.link and not linked:
        print("note: nothing was linked (Meta shards must be merged, or the dtype differs): the store is a copy")
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
