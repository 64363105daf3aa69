"""What every benchmark shares: the machine line, peak memory, CPU time, FLOP counts, host speeds."""
from __future__ import annotations

import math
import os
import platform
import resource
import socket
import subprocess
import time

import torch

import phantom
from phantom.stream import adam8bit
import phantom.stream.optim
from phantom.arch.config import block_tensor_shapes
from phantom.files.store import BlockStore

MODES = {  # name -> load arguments
    "resident": dict(offload="none"),
    "ram": dict(offload="ram"),
    "disk": dict(offload="disk"),
    "naive": dict(offload="disk", prefetch=0, recompute="all"),  # slowllama's schedule: sync loads, rerun forward
    "auto": dict(offload="auto"),  # tiers by budget: --device-budget / --ram-budget
    "h2d": dict(),  # CUDA: the pinned host-to-device copy peak, one block at a time
    "matmul": dict(),  # the measured matmul rate at the block's shapes (for the FLOP floor)
    "hf-peft": dict(),  # transformers + peft, resident, if installed (the outside reference)
    "fsdp-offload": dict(),  # transformers + peft under FSDP2 with CPUOffloadPolicy (CUDA; plain FSDP2 on CPU)
    "diskread": dict(),  # disk tier vs raw O_DIRECT reads; half the blocks in RAM vs disk (own table)
    "quant": dict(),  # bf16 vs NF4 vs int8 stores, disk tier, with the cost model (own table)
    "generate": dict(),  # batched generation's tokens/s from RAM and disk beside the cost model (own table)
    "evaluate": dict(),  # lm-eval tasks: phantom's model against lm-eval's hf model with accelerate's offload
    "grpo": dict(),  # a GRPO step's generation, reference and training beside the cost model (own table)
    "costterms": dict(),  # the cost model's disk rows, each term timed alone, fastest of rounds (own table)
}
PEERS = ("hf-peft", "fsdp-offload")  # other tools' rows: no recompute policy, no streaming metrics


def shell(cmd: str) -> str:
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def process_cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used: on a shared machine a
    step's CPU time moves less with the load than its wall time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fastest_of_rounds(rows: list) -> list:
    """One row per configuration (in first-run order): the run with the shortest step."""
    best = {}
    for row in rows:
        key = (*row[:4], row[4].get("train", "lora"))
        if key not in best or row[4]["step_s"] < best[key][4]["step_s"]:
            best[key] = row
    return list(best.values())


def step_flops(cfg, batch: int, seq: int, recompute: str) -> float:
    """Matmul FLOPs of one LoRA step: forward 2PT, input gradients 2PT, a recomputed forward 2PT
    (recompute all); causal attention half of 4 B T^2 dim per pass; the head 2VdT forward + backward."""
    tokens = batch * seq
    per_block = sum(math.prod(shape) for shape in block_tensor_shapes(cfg).values())
    passes = 3 if recompute == "all" else 2
    attn = 2 * batch * seq * seq * cfg.dim
    return cfg.n_layers * passes * (2 * per_block * tokens + attn) + 4 * cfg.vocab_size * cfg.dim * tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_speeds(n: int = 64 << 20, rounds: int = 5) -> dict:
    """Host memory bandwidth (`a += b` over n fp32, in place like the optimizer: 12 bytes read and
    written per element, every thread) and torch's fused AdamW alone on n parameters (28 bytes each:
    read p, g, m, v; write p, m, v)."""
    a, b = torch.zeros(n), torch.zeros(n)
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)

    def best(fn) -> float:
        fn()  # first touch of the pages
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    add_s = best(lambda: a.add_(b))
    cfg = phantom.AdamWConfig(lr=1e-4, weight_decay=0.1)
    adamw_s = best(lambda: phantom.stream.optim.adamw_step([p], [g], [m], [v], 1, cfg, cfg.lr))
    state = adam8bit.new_state(p.shape, p.device)
    h = adam8bit.hyper(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, 2, 1.0, p.device)
    adamw8_s = best(lambda: adam8bit.update(p, g, state, h))
    return {"threads": torch.get_num_threads(), "n": n, "mem_gbps": 12 * n / add_s / 1e9,
            "adamw_params_per_s": n / adamw_s, "adamw8_params_per_s": n / adamw8_s}


def lora_steps(store: BlockStore, placement, rows: int, seq: int, args) -> tuple[list, list, tuple]:
    """(step times, scheduler metrics, tiers) of LoRA steps after one warm-up step (recompute none:
    every block keeps its activations, as the cost model is told); the warm-up is left out."""
    model = phantom.PhantomModel(store, torch.device("cpu"), store.dtype, placement,
                                 phantom.Activations(recompute="none"), lora=phantom.LoraConfig(rank=args.lora_rank))
    tokens = torch.randint(0, model.cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    times, metrics = [], []
    with model:
        for s in range(args.steps + 1):
            model.scheduler.take_metrics()
            t0 = time.perf_counter()
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            times.append(time.perf_counter() - t0)
            metrics.append(model.scheduler.take_metrics())
        return times[1:], metrics[1:], model.scheduler.tiers
