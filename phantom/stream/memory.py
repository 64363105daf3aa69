"""Free memory, one probe per kind: the host's available memory and the device's free memory.

Every placement decision (the scheduler's tiers, the tuner's profile, the optimizer state's tier, the
loss chunk, the keep budget) reads these, so a run and its plan see the same numbers. On Apple
silicon the device and the host share one memory: `free_memory` says so (`FreeMemory.unified`).
"""
from __future__ import annotations

import os

import torch

from phantom.stream.placement import FreeMemory


def mem_available() -> int | None:
    """The machine's available host memory: Linux's MemAvailable; elsewhere (macOS) half the physical
    memory (the rest is the system's and the page cache's); None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, OSError, ValueError):
        return None


def local_ranks() -> int:
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 when run alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def free_host_bytes(shared: bool = False) -> int | None:
    """This process's share of the available host memory: local ranks size their RAM tiers (and host
    optimizer state) from the same MemAvailable, so each takes 1 / local_ranks() of it, or N ranks
    would pin N machine-sized tiers (cudaHostRegister fails, or the OOM killer fires). `shared`: for
    what one copy serves every local rank (the shared RAM tier), the whole of it."""
    free = mem_available()
    return free if free is None or shared else free // local_ranks()


def free_device_bytes(device: torch.device | str) -> int | None:
    """Free device memory: CUDA's free bytes; on `mps` what Metal recommends this process use less what
    it holds; None on a CPU (its blocks live in host memory, counted there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return max(0, torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return None


def free_compute_bytes(device: torch.device | str) -> int | None:
    """Free memory where blocks compute: the device's (CUDA, `mps`), a CPU's this rank's share of the host; None
    where no probe answers."""
    free = free_device_bytes(device)
    return free if free is not None else free_host_bytes()


def free_memory(device: torch.device | str, shared: bool = False, reserve: int = 0) -> FreeMemory:
    """Both probes at once, as phantom.stream.placement.resolve takes them; `reserve` device bytes the caller
    needs beside blocks and activations come off the device's free memory."""
    device = torch.device(device)
    free_device = free_device_bytes(device)
    if free_device is not None:
        free_device = max(0, free_device - reserve)
    return FreeMemory(device=free_device, host=free_host_bytes(shared), unified=device.type == "mps")
