"""Evaluate a prepared model, with or without a LoRA adapter, on lm-evaluation-harness tasks.

    python scripts/evaluate.py --model weights/7B --adapter runs/7b/adapter --tasks hellaswag,arc_easy \\
        --num-fewshot 0 --output-path evals/7b --log-samples
    python scripts/evaluate.py --model weights/7B --tasks my_task --include-path my_tasks/ --limit 20

lm-eval's own tasks and evaluator run on the model as lm-eval's `hf` model would run a transformers copy of
it (the model "phantom", phantom.train.lmeval), while the blocks stream: every log-likelihood request of a
wave goes through a block loaded once. Datasets are read from the local cache (offline). --output-path gets
lm-eval's own files (MODEL/results_DATE.json; with --log-samples samples_TASK_DATE.jsonl), each written whole.
Needs lm-eval: pip install 'phantom[eval]'.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from phantom.stream.placement import offload_choices  # noqa: E402
from phantom.train import cli  # noqa: E402


def batch_size(text: str) -> int | str:
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected a number of rows or auto, not {text!r}")


def limit(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of documents (or a fraction below 1) > 0, not {text!r}")
    return int(value) if value >= 1 and value == int(value) else value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset name (weights/NAME), a store folder or a Hub id in the "
                                                   "local cache")
    p.add_argument("--adapter", type=Path, default=None, help="LoRA adapter folder (PEFT layout) to apply")
    p.add_argument("--tasks", required=True, metavar="T1,T2", help="lm-eval task, group or tag names (or task YAML "
                                                                   "files), comma-separated")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a folder of task YAML files of your own")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="examples before each question "
                                                                              "(default: each task's own)")
    p.add_argument("--limit", type=limit, default=None, metavar="N", help="documents per task at most (a fraction "
                                                                          "below 1: that share of them); for tests")
    p.add_argument("--batch-size", type=batch_size, default="auto", metavar="N|auto",
                   help="rows of a scoring micro-batch and sequences of a generation batch (default: auto, by memory)")
    p.add_argument("--output-path", type=Path, default=None, metavar="DIR",
                   help="write lm-eval's results file (and with --log-samples its samples files) under DIR")
    p.add_argument("--log-samples", action="store_true", help="with --output-path: every document's requests and "
                                                              "answers, as lm-eval writes them")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.model or tokenizer.json (default: the "
                                                                "store's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--offload", choices=offload_choices(), default=None,
                   help="where the blocks live (default: auto, device then RAM then disk by budget)")
    p.add_argument("--dtype", choices=cli.DTYPES, default="auto", help="compute dtype (auto: bf16 on CUDA, else fp32)")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    """Flags that go together, checked before anything is read (one line each)."""
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.log_samples and args.output_path is None:
        raise ValueError("--log-samples writes samples files: give --output-path DIR")
    out = args.output_path
    if out is not None and out.suffix != ".json" and out.exists() and not out.is_dir():
        raise ValueError(f"--output-path {out} is a file; give a folder (or a NAME.json file name, as lm-eval takes)")


def run(argv=None) -> int:
    args = parse_args(argv)
    check(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from phantom.train import evaltasks
    except ImportError as e:
        raise ValueError(f"evaluate.py needs lm-eval ({e}); pip install 'phantom[eval]'") from None
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise ValueError("--tasks names no task")
    tasks = evaltasks.prepare(names, args.include_path)  # an unknown task, a missing dataset: before the model
    tracker = evaltasks.EvaluationTracker(output_path=str(args.output_path) if args.output_path else None)
    with evaltasks.PhantomLM(args.model, args.adapter, args.tokenizer, args.batch_size, args.device, args.dtype,
                             args.offload) as lm:
        results = evaltasks.evaluate(lm, tasks, args.model, num_fewshot=args.num_fewshot, limit=args.limit,
                                     log_samples=args.log_samples, evaluation_tracker=tracker)
    print(evaltasks.table(results))
    if args.output_path is not None:
        for path in evaltasks.save(results, args.output_path, tracker):
            print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
