"""Shared fixtures: small random stores written per session (GQA, several blocks, fixed seeds).

Every run of the suite is a first run: PHANTOM_CACHE (tuning profiles) and PHANTOM_WEIGHTS (the
generated tiny model) point at a temporary folder, so no test reads or writes the user's own.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from phantom.config import ModelConfig
from phantom.convert import write_synthetic

# GQA (2 kv heads for 4 query heads), 4 blocks, a vocabulary that is not a power of two.
SMALL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
# Set on import, before any test module is imported (some read the environment at import time).
_HOME = tempfile.mkdtemp(prefix="phantom-tests-")
os.environ["PHANTOM_CACHE"] = os.path.join(_HOME, "cache")
os.environ["PHANTOM_WEIGHTS"] = os.path.join(_HOME, "weights")


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("stores") / "small", SMALL, torch.float32, seed=1, progress=False)


@pytest.fixture(scope="session")
def small_store_bf16(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("stores") / "small_bf16", SMALL, torch.bfloat16, seed=1,
                           progress=False)


def randomize_lora(model, seed: int = 0) -> None:
    """LoRA B starts at zero, which would make every A gradient zero; give both random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def batch(cfg: ModelConfig, b: int = 3, t: int = 24, seed: int = 0, ignore_frac: float = 0.2):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets[torch.rand(b, t, generator=gen) < ignore_frac] = -100
    return tokens, targets


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: a relative error that does not blow up on entries near zero."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
