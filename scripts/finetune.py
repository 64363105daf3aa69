"""Finetune a Llama model with LoRA while its blocks stream from disk: `python scripts/finetune.py`.

With no flags it trains the embedded tiny model on the shipped text. Writes adapter/ (PEFT),
checkpoint/ (for --resume), metrics.jsonl and, with --trace, trace.json into --out.
"""
import argparse
import dataclasses
import functools
import logging
import shutil
import sys
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
import torch  # noqa: E402
from phantom import tune  # noqa: E402
from phantom.dist import init_from_env  # noqa: E402
from phantom import data  # noqa: E402
from phantom.tokenizer import Tokenizer  # noqa: E402
from phantom.train import TrainConfig, restore_full_snapshot, train  # noqa: E402

D = TrainConfig()
DEFAULT_LR = {("lora", True): 1e-2, ("lora", False): 2e-4, ("full", True): 1e-3, ("full", False): 1e-5}  # (mode, tiny)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", help="preset name (prepared under weights/) or a store folder")
    a("--offload", default="disk", choices=["disk", "ram", "none"], help="where blocks wait between uses")
    a("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="compute dtype (auto: bf16 on CUDA)")
    a("--prefetch", default="auto", help="blocks read ahead of the one computing, or auto: the tuner's choice of "
                                          "prefetch and resident blocks (python scripts/tune.py measures; else a quick profile)")
    a("--recompute", default="all", choices=["all", "none", "auto"],
      help="rerun each block's forward in backward (all), keep activations without weights (none), or keep "
           "what fits host memory (auto)")
    a("--checkpoint-inner", action="store_true", help="also checkpoint attention and MLP inside blocks (long seqs)")
    a("--compile", action="store_true", help="torch.compile the block once for all layers (eager fallback)")
    a("--mode", default="lora", choices=["lora", "full"], help="train a LoRA or all weights")
    a("--lora-rank", type=int, default=8, help="LoRA rank r")
    a("--lora-alpha", type=float, default=16.0, help="LoRA scale is alpha / r")
    a("--lora-targets", default="q,v", help="comma-separated projections: q,k,v,o,gate,up,down")
    a("--data", default=None, help="plain text, or JSONL (prompt/response, Alpaca, chat messages); "
                                   "default: the shipped tiny text")
    a("--val-data", default=None, help="held-out data file (default: split off --val-split of --data)")
    a("--val-split", type=float, default=0.1, help="fraction of --data held out for evaluation (0: none)")
    a("--iters", type=int, default=D.iters, help="optimizer steps")
    a("--batch-size", type=int, default=D.batch_size, help="rows per micro-batch")
    a("--grad-accum", type=int, default=D.grad_accum, help="micro-batches per step (layer-major)")
    a("--seq-len", type=int, default=D.seq_len, help="tokens per row")
    a("--lr", type=float, default=None,
      help="peak learning rate (default: LoRA 1e-2 for tiny, 2e-4 otherwise; full 1e-3 / 1e-5)")
    a("--min-lr", type=float, default=None, help="end of the cosine decay (default: lr / 10)")
    a("--warmup", type=int, default=D.warmup, help="linear warmup steps")
    a("--weight-decay", type=float, default=D.weight_decay, help="AdamW weight decay")
    a("--grad-clip", type=float, default=D.grad_clip, help="max gradient norm (0: off)")
    a("--eval-every", type=int, default=D.eval_every, help="evaluate every N steps (0: at the end only)")
    a("--eval-iters", type=int, default=D.eval_iters, help="batches per evaluation")
    a("--save-every", type=int, default=D.save_every, help="checkpoint every N steps (0: at the end only)")
    a("--sample-every", type=int, default=D.sample_every, help="print a greedy sample every N steps (0: off)")
    a("--prompt", default="The keeper", help="prompt of the samples")
    a("--sequential", action="store_true", help="read the data in order instead of random windows/rows")
    a("--workers", type=int, default=D.workers, help="DataLoader worker processes")
    a("--out", default=D.out, help="output folder")
    a("--resume", action="store_true", help="continue from --out/checkpoint")
    a("--seed", type=int, default=D.seed, help="seed of the LoRA init, batch order and dropout")
    a("--trace", action="store_true", help="write --out/trace.json (Chrome trace of the scheduler)")
    a("-q", "--quiet", action="store_true", help="no progress bar or log lines")
    return p.parse_args(argv)


def load_model(args, lr: float):
    device = phantom.resolve_device(args.device)
    ddp = init_from_env(device.type)  # under torchrun: one rank per device, one host copy per machine
    if ddp.enabled and device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    lora = phantom.LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, seed=args.seed,
                              targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    full = {}
    if args.mode == "full":  # blocks are updated inside backward; the working copy of the store is --out/store
        work_dir = args.out if not ddp.enabled else f"{args.out}/rank{ddp.rank}"  # one working store per rank
        if args.resume and args.offload != "none":
            restore_full_snapshot(Path(args.out), Path(work_dir))
        elif (Path(work_dir) / "store").exists():  # a new run starts from the base model, not the last run's
            logging.getLogger("finetune").warning("%s holds a previous run's weights; starting again from %s",
                                                  Path(work_dir) / "store", args.model)
            for sub in ("store", "optim"):
                shutil.rmtree(Path(work_dir) / sub, ignore_errors=True)
        full = dict(mode="full", work_dir=work_dir, optim=phantom.AdamWConfig(
            lr=lr, betas=D.betas, weight_decay=args.weight_decay, max_grad_norm=args.grad_clip or None))
    place = dict(prefetch=int(args.prefetch) if args.prefetch != "auto" else 2)
    if args.prefetch == "auto" and args.offload != "none":
        # only what cannot change the numbers: the micro-batch and recompute policy stay as given
        args.placement = tune.auto_placement(phantom.resolve_model(args.model), device,
                                             args.batch_size * args.grad_accum, args.seq_len, dtype,
                                             offloads=(args.offload,), micro_batch=args.batch_size,
                                             recompute=(args.recompute,))
        place = dict(prefetch=args.placement.prefetch, resident=args.placement.resident)
    place.update(recompute=args.recompute, checkpoint_inner=args.checkpoint_inner, compile=args.compile)
    return phantom.load(args.model, device=device, offload=args.offload, dtype=dtype, **place,
                        lora=lora, micro_batch=args.batch_size, trace=args.trace,
                        shared_ram=ddp.local_world_size > 1 and args.offload == "ram" and args.mode == "lora", **full)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.mode, args.model == "tiny"]
    try:
        cfg = TrainConfig(iters=args.iters, batch_size=args.batch_size, grad_accum=args.grad_accum,
                          seq_len=args.seq_len, lr=lr, min_lr=args.min_lr, warmup=args.warmup,
                          weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
                          eval_iters=args.eval_iters, save_every=args.save_every, sample_every=args.sample_every,
                          prompt=args.prompt, seed=args.seed, shuffle=not args.sequential, out=args.out,
                          resume=args.resume, mode=args.mode, workers=args.workers, trace=args.trace,
                          progress=not args.quiet)
        if args.prefetch != "auto" and not args.prefetch.isdigit():
            raise ValueError(f"--prefetch must be >= 0 or auto, not {args.prefetch!r}")
        args.placement = None
        model = load_model(args, lr)
        if args.placement is not None:
            cfg = dataclasses.replace(cfg, check_step=functools.partial(tune.check_prediction, args.placement))
    except (ValueError, FileNotFoundError, OSError) as e:  # StoreError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    with model:
        try:
            if model.store.tokenizer_path is None:
                raise FileNotFoundError(f"{model.store.path} has no tokenizer; prepare the store with one")
            tok = Tokenizer(model.store.tokenizer_path)
            train_data, val_data = data.split(data.load(args.data, tok), 0 if args.val_data else args.val_split)
            val_data = data.load(args.val_data, tok) if args.val_data else val_data
            cfg = dataclasses.replace(cfg, prompt=data.render_prompt(args.prompt, train_data.fmt))
            with logging_redirect_tqdm():
                s = train(model, train_data, val_data, cfg, tok)
        except (ValueError, FileNotFoundError, OSError) as e:
            shutil.rmtree(Path(args.out) / "checkpoint.tmp", ignore_errors=True)  # one cut short (disk full)
            print(f"error: {e}", file=sys.stderr)
            return 2
    print_summary(s)
    return {"done": 0, "interrupted": 0}.get(s["status"], 1)


def print_summary(s: dict) -> None:
    best = f"{s['best_val_loss']:.4f}" if s["best_val_loss"] is not None else "-"
    print(f"\n{'finetune ' + s['status']:-^60}\n"
          f"steps        {s['steps']}\n"
          f"tokens       {s['tokens']:,} in {s['time_s']:.1f} s ({s['tokens'] / max(s['time_s'], 1e-9):,.0f} tok/s)\n"
          f"loss         final {s['final_loss']:.4f}, best eval {best}\n"
          f"{'weights' if s['weights'] else 'adapter':<13}{s['weights'] or s['adapter'] or '(not written)'}\n"
          f"checkpoint   {s['checkpoint'] + '  (continue with --resume)' if s['checkpoint'] else '-'}\n"
          f"metrics      {s['metrics']}  (plot: python scripts/plot.py --out {s['out']})")


if __name__ == "__main__":
    sys.exit(main())
