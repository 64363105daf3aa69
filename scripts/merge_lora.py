"""Merge a LoRA adapter into its base model and write a full checkpoint (Hugging Face, Meta or GGUF format).

    python scripts/merge_lora.py --model weights/7B --adapter out/adapter --out merged/7B-tuned --format hf
    python scripts/merge_lora.py --model weights/7B --adapter out/adapter --out gguf/7B-tuned --format gguf --outtype q8_0
    python scripts/merge_lora.py --model weights/dsv3-fp8 --adapter out/adapter --out merged/dsv3-fp8-tuned --requantize
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from phantom import resolve_model  # noqa: E402
from phantom.files.hfshards import DEFAULT_MAX_SHARD_SIZE  # noqa: E402
from phantom.files.tensorfile import parse_dtype  # noqa: E402
from phantom.convert.convert import disk_usage  # noqa: E402
from phantom.export.export import FormatOptions, export  # noqa: E402
from phantom.train import cli
from phantom.train.cli import STORE_DTYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="base model: a preset name (weights/NAME) or a store folder")
    p.add_argument("--adapter", type=Path, default=None,
                   help="LoRA adapter folder (PEFT layout, e.g. OUT/adapter from finetune.py); "
                        "without it the base model is exported as it is")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to create")
    p.add_argument("--format", choices=["hf", "meta", "gguf", "gguf-lora"], default="hf",
                   help="hf: config.json + safetensors shards (transformers, vLLM, llama.cpp's converter); "
                        "meta: params.json + consolidated.00.pth (Meta's reference code); "
                        "gguf: one Name-Size-Type.gguf file for llama.cpp, Ollama and LM Studio, and a Modelfile "
                        "(needs pip install 'phantom[gguf]'); gguf-lora: the adapter alone as a GGUF LoRA adapter, for "
                        "llama.cpp's --lora over a base GGUF of the model")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default=None,
                   help="gguf: the file's weight type, as llama.cpp's convert_hf_to_gguf.py --outtype "
                        "(default: bf16 for a bf16 store, else f16); made from the --dtype weights")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help=f"hf: the most bytes of one safetensors shard, as transformers' save_pretrained takes it "
                        f"(default: its {DEFAULT_MAX_SHARD_SIZE}; e.g. 5GB, 500MB or bytes): one model.safetensors "
                        f"below it, else numbered shards and model.safetensors.index.json")
    p.add_argument("--dtype", choices=STORE_DTYPES, default=None,
                   help="dtype of the written weights (default: the store's)")
    p.add_argument("--requantize", action="store_true",
                   help="hf, a store of a checkpoint shipped quantized (FP8 in blocks, compressed-tensors INT4, "
                        "gpt-oss's MXFP4): write that format again, as transformers loads it (the merged weights "
                        "requantized by the published rule, the weights the adapter leaves as they are in their "
                        "shipped bytes, config.json's quantization_config as shipped); default: 16-bit weights")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the phantom export at --out (a folder that is not one is refused, never removed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(argv=None) -> int:
    args = parse_args(argv)
    if args.max_shard_size is not None and args.format != "hf":
        raise ValueError("--max-shard-size is for --format hf (Meta's format is one consolidated.00.pth)")
    t0 = time.perf_counter()
    out = export(resolve_model(args.model), args.out, args.adapter, args.format,
                 parse_dtype(args.dtype) if args.dtype else None, args.overwrite, progress=not args.quiet,
                 options=FormatOptions(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, args.outtype,
                                       args.requantize))
    what = "adapter alone" if args.format == "gguf-lora" else "base + adapter" if args.adapter else "base model"
    what += ", requantized" if args.requantize else ""
    print(f"wrote {out} ({args.format} format, {what}) in {time.perf_counter() - t0:.1f} s, "
          f"{disk_usage(out) / 1e9:.2f} GB on disk")
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
