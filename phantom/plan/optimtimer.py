"""The rates full finetuning adds to a profile, measured here in a few seconds: each optimizer's update in
parameters/s (torch's fused AdamW; the compiled 8-bit update, its compilation not timed) on the device the
state would live on, and the disk's write rate with fsync (a disk-tier block and its state are written
back every step)."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from phantom.base import fileio
from phantom.plan.costfull import OptimRates
from phantom.stream import adam8bit
from phantom.stream.optim import AdamWConfig, adamw_step
from phantom.stream.adam8bit import OPTIMIZERS


def update_rate(optim: str, device: torch.device, params: int = 1 << 24, repeats: int = 3) -> float:
    """Parameters/s of one optimizer's update of `params` fp32 parameters (the best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(params, generator=gen).to(device)
    g = (torch.randn(params, generator=gen) * 1e-3).to(device)
    if optim == "adamw_8bit":
        state = adam8bit.new_state(p.shape, device)
        step = lambda t: adam8bit.update(p, g, state, adam8bit.hyper(1e-4, (0.9, 0.999), 1e-8, 0.0, t, 1.0, device))  # noqa: E731
    else:
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        step = lambda t: adamw_step([p], [g.clone()], [m], [v], t, AdamWConfig(), 1e-4)  # noqa: E731
    step(1)  # compiles the 8-bit kernel, faults the pages in
    best = float("inf")
    for t in range(2, 2 + repeats):
        _sync(device)
        t0 = time.perf_counter()
        step(t)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return params / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_write_gbps(folder: Path | str, nbytes: int = 128 << 20) -> float:
    """GB/s of writing `nbytes` to a new file in `folder` and fsyncing it (the file removed after)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        t0 = time.perf_counter()
        with fileio.new_file(Path(tmp) / "write-rate") as f:  # flushed and fsynced as the block ends
            f.write(data)
        return nbytes / (time.perf_counter() - t0) / 1e9


def measure(device: torch.device, folder: Path | str) -> OptimRates:
    """Both optimizers' update rates on `device` and the write rate of the disk under `folder`."""
    return OptimRates({o: update_rate(o, torch.device(device)) for o in OPTIMIZERS}, disk_write_gbps(folder))
