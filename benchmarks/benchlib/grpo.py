"""`bench.py --modes grpo`: one GRPO step's generation, reference and training seconds and its bytes read, on a
synthetic store of a preset's blocks (--preset, default 7B, cut to --layers), from the RAM tier and from the disk
tier, at each number of completions of --grpo-generations (one prompt a step, --grpo-tokens tokens each), beside
the cost model of a GRPO step (phantom.plan.costgrpo) from two profiles of the machine (at the training step's
shape, and beside a light compute for the generation) and the generation rates measured before the rows. Each row is a two-step run through the training loop (phantom.train.loop.train, a LoRA of rank 8 on
q and v, a reward of the completion's length); the second step is measured (the first warms up).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

import phantom
from phantom.arch.presets import preset
from phantom.data.tokenizer import Tokenizer, train_tiny_tokenizer
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name, parse_dtype
from phantom.convert.synthetic import write_synthetic
from phantom.plan import profiles
from phantom.plan.costgrpo import GrpoWork, predict_grpo_step
from phantom.plan.gentimer import measure_generation
from phantom.train.grpo import GrpoConfig
from phantom.train.grpoloop import load_prompts
from phantom.train.loop import train
from phantom.train.trainconfig import TrainConfig
from benchlib.common import machine

REWARD = "def length(completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
PROMPT = "The keeper"


def grpo_bench(args, folder: Path) -> str:
    device, dtype = phantom.resolve_device(args.device), parse_dtype(args.dtype)
    cfg = preset(args.preset or "7B", n_layers=args.layers)
    tok_path = train_tiny_tokenizer(folder / "tokenizer.model")
    store = BlockStore(write_synthetic(folder / "store", cfg, dtype, tokenizer=tok_path, progress=False))
    tok, name, new = Tokenizer(tok_path), dtype_name(dtype), args.grpo_tokens
    (folder / "reward.py").write_text(REWARD)
    (folder / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    plen = len(tok.encode(PROMPT, bos=True))
    lines = [f"\n## GRPO steps, {time.strftime('%Y-%m-%d %H:%M')}\n",
             f"Machine: {machine()}; {device.type}, {name}. Model: {args.preset or '7B'}-shaped blocks, {cfg.n_layers} "
             f"of them (dim {cfg.dim}, vocabulary {cfg.vocab_size}); one prompt of {plen} tokens a step, "
             f"{new} new tokens a completion at most (temperature 1); LoRA rank 8 on q, v; prefetch {args.grpo_prefetch}.\n",
             "| tier | G | generation s (pred.) | reference s (pred.) | training s (pred.) | step s (pred.) | error | "
             "GB read (pred.) | completion tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for g in [int(x) for x in args.grpo_generations.split(",")]:
        profile = profiles.with_free_memory(profiles.measure(store, device, dtype, g, plen + new), device)
        gen_profile = profiles.with_free_memory(profiles.measure(store, device, dtype, 1, plen + 1), device)
        rates = measure_generation(store, device, dtype, (g,), (g * plen,), plen)
        for tier in ("ram", "disk"):
            rec = _run_steps(store, tok, folder, g, new, tier, device, dtype, args)
            work = GrpoWork(prompts=1, num_generations=g, prompt_len=plen,
                            completion_len=int(rec["completions/max_length"]))
            placement = phantom.Placement(offload=tier, prefetch=args.grpo_prefetch)
            acts = phantom.Activations(recompute="none", micro_batch=g)
            p = predict_grpo_step(rates, profile, cfg, (store.manifest["dtype"], name), placement, acts, work,
                                  gen_profile)
            step = rec["generation_s"] + rec["reference_s"] + rec["train_s"]
            lines.append(f"| {tier} | {g} | {rec['generation_s']:.2f} ({p.generation_s:.2f}) | "
                         f"{rec['reference_s']:.2f} ({p.reference_s:.2f}) | {rec['train_s']:.2f} ({p.train_s:.2f}) | "
                         f"{step:.2f} ({p.step_s:.2f}) | {(p.step_s - step) / step:+.1%} | "
                         f"{rec.get('bytes_read', 0) / 1e9:.2f} ({p.bytes_read / 1e9:.2f}) | "
                         f"{rec['completions/mean_length']:.0f} mean, {rec['completions/max_length']:.0f} max |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _run_steps(store: BlockStore, tok, folder: Path, g: int, new: int, tier: str, device, dtype, args) -> dict:
    """Two GRPO steps through the training loop; the second's record."""
    grpo = GrpoConfig(num_generations=g, max_completion_length=new, rewards=(f"{folder / 'reward.py'}:length",))
    with tempfile.TemporaryDirectory(dir=folder) as out:
        cfg = TrainConfig(mode="grpo", grpo=grpo, iters=2, batch_size=g, lr=1e-4, warmup=0, save_every=0,
                          eval_every=0, progress=False, out=out)
        data = load_prompts(folder / "prompts.jsonl", tok, None, grpo, store.cfg.max_seq_len)
        placement = phantom.Placement(offload=tier, prefetch=args.grpo_prefetch)
        acts = phantom.Activations(recompute="none", micro_batch=g)
        lora = phantom.LoraConfig(rank=8, targets=("q", "v"))
        with phantom.PhantomModel(store, device, dtype, placement, acts, lora=lora) as model:
            train(model, data, None, cfg, tok)
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][-1]


def add_grpo_flags(p) -> None:
    p.add_argument("--grpo-generations", default="8,16", help="--modes grpo: completions a step, comma list")
    p.add_argument("--grpo-tokens", type=int, default=128, help="--modes grpo: new tokens a completion at most")
    p.add_argument("--grpo-prefetch", type=int, default=1,
                   help="--modes grpo: prefetch depth (slots: one more; fewer than the blocks: every step reads them)")
