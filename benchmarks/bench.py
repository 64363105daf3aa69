"""Benchmark one LoRA training step of the same synthetic model under several placements, side by side.

    python benchmarks/bench.py --dim 1024 --layers 8 --batch-size 4 --seq-len 256 --cold

Modes: resident (offload=none, plain autograd), ram and disk (phantom streaming with prefetch K),
naive (disk, prefetch 0: load each block synchronously before use, as slowllama does). Each mode
runs in its own process so peak memory is its own. The table goes to stdout and to
notes/bench-<device>.md with the command line and the machine.

    python benchmarks/bench.py --modes disk --prefetch 0,1,2,4 --micro-batch 1,2 --tuned --cold

sweeps prefetch depth x micro-batch, then runs the tuner's choice (phantom.plan.tune, searching the
swept tiers and recompute policies with no resident blocks) and prints each row's predicted step.

    python benchmarks/bench.py --modes resident+leaky,resident+mask,disk+leaky,disk+mask --packed 8

packs 8 examples into each row, stepping with the document mask (segment ids: block-diagonal causal
attention, positions from 0 per example) or without it (the leaky plain causal mask), side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench.py --modes diskread --dim 1024 --layers 12 --vocab 1024 --batch-size 1 --seq-len 8

(alone) races the disk tier's first pass (crc32 checked) against raw O_DIRECT reads of the same
files, then half the blocks in RAM against pure disk with the cost model's predictions; to notes/bench-tiers.md.

    python benchmarks/bench.py --modes quant --dim 2048 --layers 8 --dtype bf16 --quant-batches 1x32,8x256 --cold

(alone) the same model stored bf16, NF4 and int8 (prepare_model.py --quantize; --quant-methods adds fp8-block,
int4-group and mxfp4, the formats checkpoints ship), disk tier: bytes read per step, the dequantization (a CPU's on the compute's
threads), step time beside the cost model's prediction from inputs measured just before each row (--rounds N: the rows
interleaved N times, medians); to notes/bench-quant.md.

    python benchmarks/bench.py --modes moe --dim 256 --layers 4 --moe-batches 1x8,1x32,1x128,1x1024,4x1024

(alone) a Qwen3-30B-A3B-shaped store scaled to --dim (128 experts, top-8), random and skewed routers:
routed expert reads against whole blocks, bytes read per step and step time beside the cost model's
prediction; to notes/moe.md.

    python benchmarks/bench.py --modes linear --dim 256 --layers 2 --linear-batches 1x1024,1x8192

(alone) a Gated DeltaNet block's LoRA step against a gated full-attention block's (Qwen3.5-35B-A3B's shape
scaled to --dim), each beside the cost model's prediction from a profile measured on the other; to notes/linear.md.

    python benchmarks/bench.py --modes generate --dim 1024 --layers 8 --heads 16 --vocab 4096 --gen-prompts 1,8,64,256

(alone) batched generation's new tokens/s at each number of prompts from the RAM and the disk tier, beside the
cost model of generation's prediction; to notes/bench-generate.md.

    python benchmarks/bench.py --modes evaluate --dim 1024 --layers 8 --heads 16 --eval-docs 64

(alone) the same lm-eval tasks on the same weights: phantom's model streaming from disk against lm-eval's hf
model with accelerate's offload; to notes/bench-generate.md.

    python benchmarks/bench.py --modes grpo --layers 2 --dtype bf16 --grpo-generations 8,16 --grpo-tokens 128

(alone) a GRPO step's generation, reference and training seconds and bytes read on 7B-shaped blocks from RAM and
disk, beside the cost model of a GRPO step; to notes/bench-grpo.md.

    python benchmarks/bench.py --modes costterms --dim 1024 --layers 6 --heads 8 --vocab 4096 --batch-size 2 --seq-len 256 --prefetch 1,2,4 --rounds 4

(alone) the cost model's disk rows (each --recompute policy and --prefetch depth, and a RAM row that reads nothing)
beside their steps, with each term of the prediction timed on its own: the profile's block calls, the disk's rate,
the blocks a run keeps; every figure timed in one process, rounds interleaved, the fastest kept; to
notes/costmodel-disk.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # phantom, from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib

from benchlib.common import MODES, PEERS, fastest_of_rounds, host_speeds  # noqa: E402
from benchlib.costterms import costterms_bench  # noqa: E402
from benchlib.diskread import diskread  # noqa: E402
from benchlib.evalpeer import evaluate_bench  # noqa: E402
from benchlib.generate import add_generate_flags, generate_bench  # noqa: E402
from benchlib.grpo import add_grpo_flags, grpo_bench  # noqa: E402
from benchlib.linear import linear_bench  # noqa: E402
from benchlib.moe import moe_bench  # noqa: E402
from benchlib.quant import quant_bench  # noqa: E402
from benchlib.steps import run_worker, step_table, worker  # noqa: E402

import phantom  # noqa: E402
import phantom.files.tensorfile  # noqa: E402
from phantom.arch.config import ModelConfig  # noqa: E402
from phantom.files.store import BlockStore  # noqa: E402
from phantom.files.tensorfile import dtype_name  # noqa: E402
from phantom.convert.synthetic import write_synthetic  # noqa: E402
from phantom.plan import costinputs as ci
from phantom.plan import planner, profiles, tune
from phantom.train import cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--layers", type=int, default=8, help="number of blocks")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: heads")
    p.add_argument("--preset", default=None, help="take the shapes of a preset (e.g. 70B); --layers still cuts depth")
    p.add_argument("--batch-size", type=int, default=4, help="rows per step")
    p.add_argument("--micro-batch", default="", help="comma list of micro-batch sizes to sweep (layer-major accumulation)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--dtype", default="fp32", choices=cli.STORE_DTYPES, help="store and compute dtype")
    p.add_argument("--prefetch", default="2", help="comma list of prefetch depths K for ram/disk (a sweep)")
    p.add_argument("--tuned", action="store_true", help="measure a tuning profile, run the tuner's choice too and "
                                                         "print each row's predicted step time")
    p.add_argument("--recompute", default="auto", help="comma list of recompute policies to run (auto, the API's "
                                                         "default; all; none)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the synthetic model")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (q and v, as PEFT's default targets)")
    p.add_argument("--moe-batches", default="1x8,1x32,1x128,1x1024,4x1024",
                   help="--modes moe: ROWSxTOKENS per step, comma list")
    p.add_argument("--moe-base", default="stream",
                   help="--modes moe: comma list of stream (the rest of a block read at each load) and device "
                        "(kept on the device after its first load)")
    p.add_argument("--moe-shape", default="qwen3-30B-A3B", choices=("qwen3-30B-A3B", "deepseek-v3-671B", "kimi-k2-1T",
                                                                   "glm-4.5-355B"),
                   help="--modes moe: the preset whose experts, routing and attention the store has (scaled to --dim)")
    p.add_argument("--linear-batches", default="1x1024,1x8192", help="--modes linear: ROWSxTOKENS per step, comma list")
    add_generate_flags(p)
    add_grpo_flags(p)
    p.add_argument("--modes", default="resident,ram,disk,naive", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--train", default="lora", help="comma list of what a step trains: lora, full (every weight: "
                   "per-block AdamW beside the backward), full-8bit (the same with --optim adamw_8bit); with full, rows for the optimizer's parameters/s and "
                   "the host memory bandwidth measured in the same run; dpo: the same rows as --batch-size / 2 "
                   "preference pairs (LoRA, the reference beside the policy), with its ratio to the lora row")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=1, help="run every row this many times, interleaved, and keep "
                   "each row's fastest: on a shared machine rows measured minutes apart differ by the load (--modes quant: "
                   "the medians over rounds, each round's cost-model inputs measured before its row)")
    p.add_argument("--cold", action="store_true", help="evict block files from the page cache after each read")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps")
    p.add_argument("--store", default=None, help="use this store instead of writing a synthetic one")
    p.add_argument("--out", default=None, help="notes file to append to (default notes/bench-<device>.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile blocks")
    p.add_argument("--device-budget", default=None, help="bytes for resident blocks in mode auto (e.g. 20G)")
    p.add_argument("--ram-budget", default=None, help="bytes of RAM tier in mode auto (e.g. 8G)")
    p.add_argument("--packed", type=int, default=8, help="modes suffixed +mask or +leaky (e.g. disk+mask): each row "
                   "packs this many examples, with the document mask (segment ids) or without (default: 8)")
    p.add_argument("--quant-batches", default="1x32,8x256", help="mode quant: rows x tokens per step to run, "
                                                                   "e.g. a read-bound and a compute-bound one")
    p.add_argument("--quant-methods", default="nf4,int8", help="mode quant: the formats stored beside bf16 (nf4, int8, "
                                                              "fp8-block: DeepSeek-V3's FP8 tiles; int4-group: "
                                                              "compressed-tensors' INT4 in groups of 32; mxfp4)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


NOTES = Path(__file__).resolve().parent.parent / "notes"


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        if args.modes == "moe":  # its own synthetic MoE stores and table, in notes/moe.md
            append_note(moe_bench(args, Path(tmp)), args.out or NOTES / "moe.md")
            return
        if args.modes == "linear":  # its own synthetic stores and table, in notes/linear.md
            append_note(linear_bench(args, Path(tmp)), args.out or NOTES / "linear.md")
            return
        if args.store is None:
            args.store = str(synthetic_store(args, Path(tmp)))
        store = BlockStore(args.store)
        if args.modes == "grpo":  # its own store and table, in notes/bench-grpo.md
            append_note(grpo_bench(args, Path(tmp)), args.out or NOTES / "bench-grpo.md")
            return
        if args.modes == "evaluate":  # its own store, tasks and table, in notes/bench-generate.md
            append_note(evaluate_bench(args, Path(tmp)), args.out or NOTES / "bench-generate.md")
            return
        if args.modes == "generate":  # its own table, in notes/bench-generate.md
            append_note(generate_bench(args, store), args.out or NOTES / "bench-generate.md")
            return
        if args.modes == "costterms":  # its own table, in notes/costmodel-disk.md
            append_note(costterms_bench(args, store), args.out or NOTES / "costmodel-disk.md")
            return
        if args.modes in ("diskread", "quant"):  # their own tables, in notes/bench-tiers.md, notes/bench-quant.md
            text = diskread(args, store) if args.modes == "diskread" else quant_bench(args, store)
            append_note(text, args.out or NOTES / f"bench-{'tiers' if args.modes == 'diskread' else 'quant'}.md")
            return
        profile = None
        if args.tuned:  # measured first, so the sweep below runs under the same conditions it saw
            profile = profiles.measure(store, phantom.resolve_device(args.device), store.dtype, args.batch_size,
                                       args.seq_len)
        host = host_speeds() if {"full", "full-8bit"} & set(args.train.split(",")) else None  # same run, before the rows' processes
        rows = fastest_of_rounds(sweep(args, argv))
        best = None
        if profile is not None:
            best = tuned_plan(args, store, profile)
            p, a = best.placement, best.activations
            rows.append(run_worker(f"tuned-{p.offload}:{a.recompute}:{a.micro_batch or '-'}:{p.prefetch}",
                                   argv, args))
    text = step_table(args, store, rows, profile, best, host)
    append_note(text, args.out or NOTES / f"bench-{torch.device(args.device).type}.md")


def check_args(args) -> None:
    """Bad flag combinations: one line, exit 2."""
    def refuse(msg: str):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    for alone in ("diskread", "quant", "moe", "linear", "generate", "evaluate", "grpo", "costterms"):
        if alone in args.modes.split(",") and args.modes != alone:
            refuse(f"--modes {alone} runs alone (its own tables); give it in a run of its own")
    trains = args.train.split(",")
    if set(trains) - {"lora", "full", "full-8bit", "dpo"}:
        refuse(f"--train takes lora, full, full-8bit and/or dpo, not {args.train!r}")
    if "dpo" in trains and args.batch_size % 2:
        refuse(f"--train dpo needs an even --batch-size (pairs of rows), not {args.batch_size}")
    if args.rounds < 1:
        refuse(f"--rounds must be at least 1, not {args.rounds}")


def synthetic_store(args, folder: Path) -> Path:
    """The bench model: a preset cut to --layers, or --dim/--layers/--heads/--vocab, random weights."""
    if args.preset:
        cfg = phantom.preset(args.preset, n_layers=args.layers)
    else:
        cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                          vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))
    return write_synthetic(folder / "bench", cfg, phantom.files.tensorfile.parse_dtype(args.dtype))


def sweep(args, argv) -> list:
    """Every row the flags ask for, each in a process of its own; rounds interleave them (A B A B)."""
    policies, trains, rows = args.recompute.split(","), args.train.split(","), []
    for _ in range(args.rounds):
        for recompute in policies:
            for micro in (args.micro_batch.split(",") if args.micro_batch else ["-"]):
                for mode, train in ((mo, t) for mo in args.modes.split(",") for t in trains):
                    if not wanted(mode, train, recompute, policies):
                        continue
                    for k in (args.prefetch.split(",") if mode.partition("+")[0] in ("ram", "disk", "auto") else ["-"]):
                        rows.append(run_worker(f"{mode}:{recompute}:{micro}:{k}", argv, args, train))
    return rows


def wanted(mode: str, train: str, recompute: str, policies: list) -> bool:
    """Whether a (mode, train, recompute) row is run: other tools and rates are LoRA-only rows without a
    recompute policy (one row each), and need their libraries."""
    if train != "lora" and mode in (*PEERS, "h2d", "matmul"):
        return False
    if mode in ("resident", *PEERS, "h2d", "matmul", "naive") and recompute != policies[0]:
        return False
    if mode in PEERS and not all(importlib.util.find_spec(m) for m in ("peft", "transformers")):
        print(f"{mode}: transformers/peft not installed, skipped")
        return False
    return True


def tuned_plan(args, store: BlockStore, profile):
    """The tuner's choice among the swept tiers and recompute policies, with no resident blocks."""
    offloads = tuple(m for m in ("ram", "disk") if m in args.modes.split(","))
    name = dtype_name(store.dtype)
    return tune.plan(profile, store.cfg, ci.Workload(args.batch_size, args.seq_len, name, name),
                     planner.SearchSpace(offloads=offloads, recompute=tuple(args.recompute.split(",")),
                                    budgets=phantom.Placement(resident=0)))[0]


def append_note(text: str, out: Path | str) -> None:
    """Print the run's text and append it to its note."""
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
