"""Stores phantom makes up: random weights with a config's exact shapes (benchmarks, tests, `--synthetic`),
written block by block, and the embedded `tiny` model (a tokenizer trained on the shipped text, its chat
template, fan_in weights) generated on first use so a fresh checkout trains with no download.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from phantom.arch.config import ModelConfig, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.arch.presets import preset
from phantom.arch.quantformat import QuantFormat
from phantom.base import provenance, safejson
from phantom.data.chat import TINY_CHAT_TEMPLATE
from phantom.data.tokenizer import train_tiny_tokenizer
from phantom.files.storewriter import StoreWriter
from phantom.convert.convert import keep_tokenizer_files

log = logging.getLogger(__name__)


TILE = 1 << 16  # init "tiled": one pattern of this many values repeated through each matrix


def _random_tensors(shapes: dict[str, tuple[int, ...]], gen: torch.Generator, std,
                    dtype: torch.dtype, offset: float = 0.0, tiled: bool = False) -> dict[str, torch.Tensor]:
    """Norm weights 1 (0 where the norm scales by 1 + w: the same identity; Gated DeltaNet's gated output norm
    scales by w alone), biases 0 (its decay's A_log and dt_bias too), matrices N(0, std^2); std is a number or a
    function of the shape. `tiled`: each matrix one N(0, std^2) pattern of TILE values repeated."""
    out = {}
    for name, shape in shapes.items():
        gated = name == "attention.norm.weight"  # Gated DeltaNet's output norm
        if name.endswith((".bias", "A_log", "dt_bias")) or (len(shape) == 1 and offset and not gated):
            out[name] = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 1:  # norm weights
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            n = torch.Size(shape).numel()
            values = torch.randn(min(n, TILE) if tiled else n, generator=gen)
            values = (values * (std(shape) if callable(std) else std)).to(dtype)
            out[name] = (values.repeat(-(-n // TILE))[:n] if tiled else values).view(shape)
    return out


# "tiled": "normal"'s values, one pattern repeated through each matrix: a block to time (as the profiles write),
# where only the shapes, dtype and scale matter, written in about half the time (most of it was drawing values)
SYNTHETIC_INITS = ("normal", "fan_in", "tiled")


def write_synthetic(out: Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    tokenizer: Path | None = None, overwrite: bool = False, progress: bool = True,
                    init: str = "normal", extra: dict | None = None, tokenizer_extra: tuple[Path, ...] = (),
                    quant: QuantFormat | None = None) -> Path:
    """A store of random weights with cfg's exact shapes, written block by block (never the whole model).

    init "normal": every matrix N(0, 0.02) as in GPT-2/Llama init; "fan_in": the block and head
    matrices N(0, 1/in_features) (nn.Linear's scale; at dim 128 that is 0.088, so attention scores
    and logits are not all near zero), the embedding N(0, 0.02); "tiled": "normal"'s values, a pattern of
    TILE repeated through each matrix (timing stores). Either way the residual projections
    (wo, w2) are scaled by 1/sqrt(2 * n_layers); the same seed and init give the same store. extra:
    more manifest fields; tokenizer_extra: more tokenizer files to keep (TOKENIZER_FILES names);
    quant: the blocks' linear weights quantized from those values.
    """
    if init not in SYNTHETIC_INITS:
        raise ValueError(f"unknown init {init!r}; choose from {', '.join(SYNTHETIC_INITS)}")
    std = (lambda shape: shape[1] ** -0.5) if init == "fan_in" else 0.02
    tiled = init == "tiled"
    resid_std = 0.02 / (2 * cfg.n_layers) ** 0.5
    with StoreWriter(out, cfg, dtype, overwrite=overwrite, quant=quant) as w:
        gen = torch.Generator().manual_seed(seed)
        w.write_embed(_random_tensors(embed_tensor_shapes(cfg), gen, 0.02, dtype, tiled=tiled))
        for i in tqdm(range(cfg.n_layers), desc="writing blocks", unit="block", disable=not progress or None):
            gen = torch.Generator().manual_seed(seed * 1000003 + i + 1)
            block = _random_tensors(block_tensor_shapes(cfg, i), gen, std, dtype, cfg.norm_offset, tiled)
            for name in [n for n in block if n == "attention.wo.weight" or n.endswith(".w2.weight")]:  # experts' too
                block[name] = (block[name].float() * (resid_std / 0.02)).to(dtype)
            w.write_block(i, block)
        gen = torch.Generator().manual_seed(seed * 1000003)
        w.write_head(_random_tensors(head_tensor_shapes(cfg), gen, std, dtype, cfg.norm_offset, tiled))
        if tokenizer is not None:
            w.add_tokenizer(tokenizer)
        kept = keep_tokenizer_files(w, ([w.tmp / w.tokenizer] if tokenizer is not None else []) + list(tokenizer_extra))
        return w.finish({"source": "synthetic", "origin": provenance.SYNTHETIC, "seed": seed,
                         **({"init": init} if init != "normal" else {}), "tokenizer_files": kept, **(extra or {})})


TINY_RECIPE = 3  # in the tiny store's manifest; a weights/tiny made by another recipe is made again


def ensure_tiny(out: Path) -> Path:
    """The embedded `tiny` model: a tokenizer trained on the shipped text and random weights.

    Generated deterministically on first use, so a fresh checkout trains with no download. Recipe 2
    (the README's first command must visibly learn): 64 tokenizer pieces (the text's 48
    characters and its commonest pairs), so held-out text shares most of its statistics with the
    5 KB of training text (with 512 word-sized pieces it does not, and no model gets far below the
    uniform loss); fan_in weights, so a frozen random head can express the text's distributions
    (N(0, 0.02) caps its logits near 2.6). Recipe 3 adds the model's chat template (chat_template.jinja,
    phantom.data.chat.TINY_CHAT_TEMPLATE). A store made by an older recipe is made again.
    """
    out = Path(out)
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            recipe = safejson.load(manifest)
        except (OSError, ValueError):
            return out  # damaged: opening the store says how
        if isinstance(recipe, dict) and recipe.get("tiny_recipe") == TINY_RECIPE:
            return out
        log.info("making the tiny model in %s again (it was made by an older recipe)", out)
    else:
        log.info("generating the tiny model in %s", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = out.parent / f".{out.name}.tokenizer.model"
    template = out.parent / f".{out.name}.chat" / "chat_template.jinja"
    cfg = preset("tiny")
    for stale in (tok, template.parent):  # a killed run's leftovers; a link planted there goes, never followed
        stale.unlink() if stale.is_symlink() or stale.is_file() else shutil.rmtree(stale, ignore_errors=True)
    try:
        train_tiny_tokenizer(tok, vocab_size=cfg.vocab_size)
        template.parent.mkdir(exist_ok=True)
        template.write_text(TINY_CHAT_TEMPLATE)
        return write_synthetic(out, cfg, torch.float32, seed=0, tokenizer=tok, progress=False, init="fan_in",
                               overwrite=manifest.is_file(), extra={"tiny_recipe": TINY_RECIPE},
                               tokenizer_extra=(template,))
    finally:
        tok.unlink(missing_ok=True)
        shutil.rmtree(template.parent, ignore_errors=True)
