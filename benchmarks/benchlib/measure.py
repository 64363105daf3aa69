"""Measurements that import nothing heavy at module level, so every benchmark process can use them,
slowllama's included: peak memory of this process, and the matmul rate a step's FLOPs are set against."""
from __future__ import annotations

import resource
import time


def peak_rss_gb() -> float:
    """This process's own peak RSS. Not ru_maxrss: a child started by subprocess reports its parent's
    peak there until it exceeds it (Linux keeps the high-water mark across exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_rate(tokens: int, dim: int, hidden: int, reps: int = 10) -> float:
    """fp32 FLOP/s of the block's largest matmul (tokens x dim @ dim x hidden), (bench.py's matmul mode times the model's own layout)."""
    import torch
    a, w = torch.randn(tokens, dim), torch.randn(dim, hidden)
    a @ w
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ w
    return 2 * tokens * dim * hidden * reps / (time.perf_counter() - t0)
