"""Apple silicon (`mps`): the device and the host share one memory, and the run is planned from one
probe of it. No Mac is at hand, so the probes are patched to a 16 GB M1 (Metal recommends ~10.7 GiB to
one process; macOS leaves ~12 GiB available) and a 70B is placed as `--offload auto` would place it:
what fits in that one memory is kept, the rest is read from disk, and the scheduler and the tuner
agree. (The scheduler once asked mps for no free memory at all, and put every block on the device.)
"""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import phantom.stream.memory
from phantom.arch import presets as config
from phantom.plan import costinputs as ci, costmodel as cm, planner
from phantom.stream import placement as P
from phantom.stream.residency import resolve_layout

GiB = 1 << 30
M1_RECOMMENDED, M1_AVAILABLE = int(10.67 * GiB), 12 * GiB  # a 16 GB M1


@pytest.fixture
def m1(monkeypatch):
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: M1_RECOMMENDED)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 0)
    monkeypatch.setattr(phantom.stream.memory, "mem_available", lambda: M1_AVAILABLE)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def scheduler_layout(store_dtype: torch.dtype, dtype: torch.dtype, cfg, placement: P.Placement) -> P.Layout:
    """The layout BlockScheduler resolves on `mps` for a store of cfg (its tier choice alone: nothing is
    allocated on a device that is not here)."""
    shape = ci.shape_of(cfg, str(store_dtype).removeprefix("torch.").replace("float32", "fp32")
                        .replace("bfloat16", "bf16"), "fp32")
    store = types.SimpleNamespace(block_nbytes=shape.block_bytes, dense_nbytes=shape.block_bytes, dtype=store_dtype,
                                  quant=None, n_blocks=cfg.n_layers, cfg=cfg)
    return resolve_layout(store, torch.device("mps"), dtype, placement, zero_copy=None, device_reserve=0)


def test_the_probe_sees_one_memory(m1):
    free = phantom.stream.memory.free_memory("mps")
    assert free == P.FreeMemory(device=M1_RECOMMENDED, host=M1_AVAILABLE, unified=True)
    assert phantom.stream.memory.free_memory("cpu").unified is False


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_70b_on_a_16gb_m1_keeps_what_fits_and_reads_the_rest_from_disk(m1, prefetch):
    cfg = config.preset("70B")
    place = P.Placement(offload="auto", prefetch=prefetch)
    layout = scheduler_layout(torch.bfloat16, torch.float32, cfg, place)  # mps computes in fp32
    split, slots = layout.split, layout.slots * layout.sizes.slot
    assert split["device"] < cfg.n_layers and split["disk"] > 0, split
    kept = split["device"] * layout.sizes.resident + split["ram"] * layout.sizes.stored  # blocks, not slots
    assert kept == 0 or kept + slots <= M1_AVAILABLE, \
        f"{kept / GiB:.1f} GiB of blocks beside {slots / GiB:.1f} GiB of slots in {M1_AVAILABLE / GiB:.0f} GiB"
    # the tuner plans the same layout from the same probes
    profile = ci.MachineProfile(machine="m1", device="mps", dtype="fp32", free_device_bytes=M1_RECOMMENDED,
                                free_host_bytes=M1_AVAILABLE)
    assert cm.layout(ci.shape_of(cfg, "bf16", "fp32"), profile, place) == layout


def test_a_model_that_fits_stays_in_memory(m1):
    """A 1B model fits the M1 whole: its blocks stay on the device, none read from disk."""
    cfg = config.preset("llama3.2-1B")
    layout = scheduler_layout(torch.bfloat16, torch.float32, cfg, P.Placement(offload="auto", prefetch=1))
    assert layout.split["disk"] == 0 and layout.split["device"] > 0, layout.split


def test_the_ram_tier_counts_what_the_device_tier_took(m1):
    """Unified: blocks kept on the device leave less for the RAM tier; on CUDA, with the same numbers,
    the two memories are separate and the RAM tier is larger."""
    cfg = config.preset("7B")
    sizes = ci.shape_of(cfg, "bf16", "bf16").sizes
    place = P.Placement(offload="auto", prefetch=1, device_budget=6 * GiB)
    unified = P.resolve(cfg.n_layers, sizes, place, P.FreeMemory(device=M1_RECOMMENDED, host=M1_AVAILABLE,
                                                                 unified=True))
    separate = P.resolve(cfg.n_layers, sizes, place, P.FreeMemory(device=M1_RECOMMENDED, host=M1_AVAILABLE))
    assert unified.split["device"] == separate.split["device"] > 0
    assert unified.split["ram"] < separate.split["ram"]


def test_the_tuner_plans_a_70b_on_the_m1_within_its_memory(m1):
    """The tuner's choice for the 70B fits the one memory (its slots and the host's share included)
    and reads the rest from disk, in bf16 and in fp32 (a slot then holds the block and its fp32 copy)."""
    cfg = config.preset("70B")
    profile = ci.MachineProfile(machine="m1", device="mps", dtype="bf16", free_device_bytes=M1_RECOMMENDED,
                                free_host_bytes=M1_AVAILABLE, free_disk_bytes=1 << 42)
    best = planner.choose(planner.search(profile, ci.shape_of(cfg, "bf16", "bf16", seq_len=256), rows=1))
    assert best.fits and best.split["disk"] > 0 and best.split["device"] < cfg.n_layers, best.describe()
    assert best.device_bytes <= M1_RECOMMENDED and best.device_bytes + best.host_bytes <= M1_AVAILABLE
    fp32 = planner.choose(planner.search(dataclasses.replace(profile, dtype="fp32"), ci.shape_of(cfg, "bf16", "fp32", 256), 1))
    assert fp32.fits and fp32.device_bytes + fp32.host_bytes <= M1_AVAILABLE  # a slot holds the fp32 copy too
    assert fp32.split["device"] <= best.split["device"]
