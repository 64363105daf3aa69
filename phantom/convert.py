"""Checkpoints into block stores: synthetic weights, the embedded tiny model, (Meta and HF readers).

Every writer streams one block at a time into a `StoreWriter`, so peak memory is about one block.
Imports config, store, tokenizer.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from phantom.config import ModelConfig, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes, preset
from phantom.store import StoreWriter
from phantom.tokenizer import train_tiny_tokenizer

log = logging.getLogger(__name__)


def _random_tensors(shapes: dict[str, tuple[int, ...]], gen: torch.Generator, std: float,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norm weights
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen) * std).to(dtype)
    return out


def write_synthetic(out: Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    tokenizer: Path | None = None, overwrite: bool = False, progress: bool = True) -> Path:
    """A store of random weights with cfg's exact shapes, written block by block (never the whole model).

    Weights are N(0, 0.02) as in GPT-2/Llama init, with residual projections (wo, w2) scaled by
    1/sqrt(2 * n_layers); the same seed gives the same store.
    """
    resid_std = 0.02 / (2 * cfg.n_layers) ** 0.5
    with StoreWriter(out, cfg, dtype, overwrite=overwrite) as w:
        gen = torch.Generator().manual_seed(seed)
        w.write_embed(_random_tensors(embed_tensor_shapes(cfg), gen, 0.02, dtype))
        for i in tqdm(range(cfg.n_layers), desc="writing blocks", unit="block", disable=not progress or None):
            gen = torch.Generator().manual_seed(seed * 1000003 + i + 1)
            block = _random_tensors(block_tensor_shapes(cfg), gen, 0.02, dtype)
            for name in ("attention.wo.weight", "feed_forward.w2.weight"):
                block[name] = (block[name].float() * (resid_std / 0.02)).to(dtype)
            w.write_block(i, block)
        gen = torch.Generator().manual_seed(seed * 1000003)
        w.write_head(_random_tensors(head_tensor_shapes(cfg), gen, 0.02, dtype))
        if tokenizer is not None:
            w.add_tokenizer(tokenizer)
        return w.finish({"source": "synthetic", "seed": seed})


def ensure_tiny(out: Path) -> Path:
    """The embedded `tiny` model: random weights and a tokenizer trained on the shipped text.

    Generated deterministically on first use, so a fresh checkout trains with no download.
    """
    out = Path(out)
    if (out / "manifest.json").is_file():
        return out
    log.info("generating the tiny model in %s", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = out.parent / f".{out.name}.tokenizer.model"
    cfg = preset("tiny")
    try:
        train_tiny_tokenizer(tok, vocab_size=cfg.vocab_size)
        return write_synthetic(out, cfg, torch.float32, seed=0, tokenizer=tok, progress=False)
    finally:
        tok.unlink(missing_ok=True)
