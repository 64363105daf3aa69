"""`bench.py --modes generate`: batched generation's tokens/s at each number of prompts of --gen-prompts, from the
RAM tier and from the disk tier, each beside the cost model's prediction (phantom.plan.costgen) from the machine's
profile (disk, link: phantom.plan.profiles) and the generation rates of held blocks at the rows' batch sizes
(phantom.plan.gentimer), measured before the rows; the loads of each block counted by the scheduler beside the prediction's. Greedy, no
stop id: every prompt gets --gen-new tokens; prompts of --gen-prompt-len random tokens; one batch of all prompts
(--gen-batch to cap it).
"""
from __future__ import annotations

import time

import torch

import phantom
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name
from phantom.model.generate import Request, generate_many
from phantom.plan import costinputs as ci
from phantom.plan import profiles
from phantom.plan.costgen import predict_generation
from phantom.plan.gentimer import measure_generation
from benchlib.common import machine

TIERS = ("ram", "disk")


def add_generate_flags(p) -> None:
    """bench.py's flags of --modes generate and --modes evaluate (benchlib.evalpeer)."""
    p.add_argument("--gen-prompts", default="1,8,64,256", help="--modes generate: numbers of prompts, comma list")
    p.add_argument("--gen-prompt-len", type=int, default=32, help="--modes generate: tokens a prompt")
    p.add_argument("--gen-new", type=int, default=16, help="--modes generate: new tokens a prompt")
    p.add_argument("--gen-batch", type=int, default=None, help="--modes generate: sequences a batch at most")
    p.add_argument("--gen-prefetch", type=int, default=2, help="--modes generate: prefetch depth of the streamed tiers")
    p.add_argument("--eval-docs", type=int, default=64, help="--modes evaluate: multiple-choice documents")
    p.add_argument("--eval-batch", type=int, default=16, help="--modes evaluate: lm-eval's batch size, both models")
    p.add_argument("--eval-words", type=int, default=0,
                   help="--modes evaluate: words of each line the tasks keep (0: whole lines; few: short requests)")


def generate_bench(args, store: BlockStore) -> str:
    device, dtype = phantom.resolve_device(args.device), store.dtype
    counts = [int(n) for n in args.gen_prompts.split(",")]
    plen, new = args.gen_prompt_len, args.gen_new
    profile = profiles.with_free_memory(profiles.measure(store, device, dtype, 1, plen + new), device)
    batches = sorted({min(n, args.gen_batch or n) for n in counts})  # the rates at the run's own sizes
    rates = measure_generation(store, device, dtype, tuple(batches), tuple(b * plen for b in batches), plen)
    name = dtype_name(dtype)
    shape = ci.shape_of(store.cfg, name, name, seq_len=1)
    gen = torch.Generator().manual_seed(0)
    lines = [f"\n## Batched generation, {time.strftime('%Y-%m-%d %H:%M')}\n",
             f"Machine: {machine()}; {phantom.__name__} on {device.type}, {name}.",
             f"Model: dim {store.cfg.dim}, {store.cfg.n_layers} blocks, {store.cfg.n_heads} heads, "
             f"{shape.block_bytes / 2**20:.1f} MiB a block; prompts of {plen} tokens, {new} new tokens each, greedy.",
             f"Profile: disk {profile.disk_gbps:.2f} GB/s, link {profile.h2d_gbps:.1f} GB/s; a held block's decode "
             f"call {_ms(rates.decode)}, prefill {_ms(rates.prefill, 'tokens')}; beside the blocks a step "
             f"{_ms(rates.rest)}.\n",
             "| tier | prompts | batch | new tokens/s | predicted | error | block loads (predicted) | s |",
             "|---|---|---|---|---|---|---|---|"]
    for tier in TIERS:
        placement = phantom.Placement(offload=tier, prefetch=args.gen_prefetch)
        with phantom.PhantomModel(store, device, dtype, placement, lora=None) as model:
            generate_many(model, [Request(torch.randint(0, store.cfg.vocab_size, (plen,), generator=gen).tolist(), 2)])
            for n in counts:
                reqs = [Request(torch.randint(0, store.cfg.vocab_size, (plen,), generator=gen).tolist(), new)
                        for _ in range(n)]
                batch = min(n, args.gen_batch or n)
                model.scheduler.take_metrics()
                t0 = time.perf_counter()
                out = generate_many(model, reqs, batch_size=batch)
                seconds = time.perf_counter() - t0
                loads = model.scheduler.take_metrics()["loads"]
                assert all(len(c.ids) == new for c in out)
                p = predict_generation(rates, profile, shape, model.placement, n, plen, new, batch)
                measured = n * new / seconds
                lines.append(f"| {tier} | {n} | {batch} | {measured:.1f} | {p.tokens_per_s:.1f} | "
                             f"{(p.tokens_per_s - measured) / measured:+.1%} | {loads} ({p.loads}) | {seconds:.2f} |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def _ms(points, unit: str = "rows") -> str:
    return ", ".join(f"{t * 1e3:.2f} ms at {n} {unit}" for n, t in points)

