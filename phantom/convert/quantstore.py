"""Quantized copies of a store (`prepare_model.py --quantize` on a store): its blocks read and checked
as any read, their linear weights quantized (phantom.arch.quant) into a new store, one block at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from phantom.arch.quantformat import QuantFormat
from phantom.files.store import BlockStore
from phantom.files.storewriter import StoreWriter
from phantom.convert import visionlanguage
from phantom.convert.convert import disk_usage, keep_tokenizer_files, tokenizer_files


def quantize_store(src: Path | str, out: Path | str, quant: QuantFormat, dtype: torch.dtype | None = None,
                   overwrite: bool = False, progress: bool = True) -> dict:
    """A quantized copy of a store, one block at a time (its weights read and checked as any read).
    Embedding, head and norms are kept in dtype (default: the store's if 16-bit, else bf16); the
    linear weights are quantized from their values in dtype.

    Returns:
        {"out", "format", "config", "dtype", "disk_bytes", "linked_bytes"}, as convert_checkpoint.
    """
    store = BlockStore(src)
    if store.quant is not None:
        raise ValueError(f"{src}: already quantized ({store.quant.method}); quantize the 16-bit store it came from")
    dtype = dtype or (store.dtype if store.dtype.itemsize == 2 else torch.bfloat16)
    keep = {k: v for k, v in store.manifest.items() if k in ("source", "origin", "seed", "init")}
    with StoreWriter(out, store.cfg, dtype, overwrite=overwrite, quant=quant) as w:
        w.write_embed(store.load_embed())
        for i in tqdm(range(store.n_blocks), desc="quantizing", unit="block", disable=not progress or None):
            w.write_block(i, store.load_block(i))
        w.write_head(store.load_head())
        if store.tokenizer_path is not None:
            w.add_tokenizer(store.tokenizer_path)
        files = list(tokenizer_files(store).values())
        vision = visionlanguage.carry(w, store)  # a vision-language checkpoint's vision tower, as shipped
        path = w.finish({**keep, "quantized_from": str(Path(src).resolve()),
                         "tokenizer_files": keep_tokenizer_files(w, files),
                         **({visionlanguage.RECORD: vision} if vision is not None else {})})
    return {"out": path, "format": f"store {src}", "config": store.cfg, "dtype": dtype,
            "disk_bytes": disk_usage(path), "linked_bytes": 0}
