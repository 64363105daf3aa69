"""Checkpoints into block stores: a Meta or Hugging Face folder (phantom.convert.checkpoints) converted
one part at a time into a `StoreWriter`, copied or linked in place (--link), so peak memory is about one
block; and the tokenizer files a store keeps (checksummed in its manifest) and hands back checked.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import torch
from tqdm import tqdm

from phantom.arch.quantformat import QuantFormat
from phantom.base import provenance
from phantom.files.store import BlockStore
from phantom.files.storeformat import block_file, safe_join
from phantom.files.storewriter import StoreWriter
from phantom.files.tensorfile import StoreError, dtype_name
from phantom.convert import visionlanguage
from phantom.convert.checkpoints import TOKENIZER_FILES, open_checkpoint, part_shapes


def disk_usage(path: Path) -> int:
    """Bytes a folder takes on disk (allocated blocks; linked source files are not in it)."""
    return sum(p.lstat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def part_file(part: str | int) -> str:
    return {"embed": "embed.safetensors", "head": "head.safetensors"}.get(part) or block_file(part)


def _write_part(w: StoreWriter, ckpt, part: str | int, link: bool) -> int:
    """Write (or link) one part; returns the bytes linked rather than copied."""
    if not link:
        tensors = ckpt.part(part)
        if part == "embed":
            w.write_embed(tensors)
        elif part == "head":
            w.write_head(tensors)
        else:
            w.write_block(part, tensors)
        return 0
    located = ckpt.located(part, w.dtype)
    copied = ckpt.part(part, [n for n in ckpt.shapes(part) if n not in located])
    w.link_file(part_file(part), part_shapes(ckpt.cfg, part), located, copied)
    return sum(dtype.itemsize * math.prod(shape) for _, _, dtype, shape in located.values())


def convert_checkpoint(src: Path | str, out: Path | str, dtype: torch.dtype | None = None, link: bool = False,
                       overwrite: bool = False, progress: bool = True, quant: QuantFormat | None = None,
                       root: Path | None = None) -> dict:
    """Convert a Meta or Hugging Face checkpoint folder into a block store, one block at a time.

    Args:
        src: the checkpoint folder.
        out: the store folder to create (written to a temporary folder, renamed when complete).
        dtype: the store's dtype (default: the checkpoint's).
        link: Hugging Face safetensors only: the store points at the tensors inside the checkpoint's
            files instead of copying them (they must stay, unchanged; the store checks their size and
            header when opened and their checksum when read: the manifest records a sha256 and a crc32
            record of every file, copied or linked; see store.Checksums). q/k rows stay in the layout they
            ship in (checkpoints.as_shipped), so they are linked too; what needs converting (gpt-oss's
            alternating gate and up rows) is still copied. Meta shards must be merged: always copied.
        overwrite: replace the phantom store at out (a folder that is not one is refused).
        progress: a tqdm bar over the blocks.
        quant: store every block's linear weights quantized (phantom.arch.quant; the rest in dtype, bf16
            unless the checkpoint is 16-bit). A checkpoint that ships FP8 (its config.json's
            quantization_config) makes an fp8-block store of its own bytes, copied or linked.
        root: Hugging Face folders whose shards are links (the hub cache): the folder they may lead into.
            The manifest's origin (phantom.base.provenance) is the hub id and commit when src is a snapshot
            under a hub cache root (models--OWNER--NAME), else src's folder.

    Returns:
        {"out", "format", "config", "dtype", "disk_bytes", "linked_bytes", "quant"} (quant: the store's
        QuantFormat, the checkpoint's own where it ships FP8, or None).

    Raises:
        FileNotFoundError: a missing file. ValueError (StoreError): a corrupt or unsupported checkpoint.
    """
    ckpt = open_checkpoint(src, root)
    if quant is not None and ckpt.quant is not None:
        raise ValueError(f"{src}: the checkpoint ships {ckpt.quant.method} weights, read as they are; drop --quantize")
    if quant is not None and link:
        raise ValueError("--link and --quantize: a quantized store holds its own (quantized) copy; drop one")
    quant = quant or ckpt.quant
    dtype = dtype or (ckpt.dtype if quant is None or ckpt.dtype.itemsize == 2 else torch.bfloat16)
    if link and ckpt.format == "hf" and dtype != ckpt.dtype:
        raise ValueError(f"{src}: --link reads the tensors as they are, in {ckpt.dtype}; drop --dtype or drop --link")
    cfg, linked = ckpt.cfg, 0
    with StoreWriter(out, cfg, dtype, overwrite=overwrite, quant=quant) as w:
        for part in tqdm(["embed", *range(cfg.n_layers), "head"], desc="converting", unit="part",
                         disable=not progress or None):
            linked += _write_part(w, ckpt, part, link and ckpt.format == "hf")
        if ckpt.tokenizer is not None:
            w.add_tokenizer(ckpt.tokenizer)
        vision = visionlanguage.keep(w, ckpt, link and ckpt.format == "hf")  # what the text model leaves out
        path = w.finish({"source": ckpt.format, "origin": provenance.of_checkpoint(src, ckpt.format, root),
                         "tokenizer_files": keep_tokenizer_files(w, ckpt.tokenizer_files),
                         **({"shipped_quantization": shipped_record(ckpt)} if ckpt.quant is not None else {}),
                         **({visionlanguage.RECORD: vision} if vision is not None else {})})
    return {"out": path, "format": ckpt.format, "config": cfg, "dtype": dtype, "disk_bytes": disk_usage(path),
            "linked_bytes": linked, "quant": quant}


def shipped_record(ckpt) -> dict:
    """What a checkpoint shipped quantized says of itself, for merge_lora.py --requantize to write it back:
    config.json's quantization_config as it is, an FP8 checkpoint's weight_scale_inv dtype (the store widens
    16-bit ones to float32), and the block tensors it ships wider than its 16-bit weights (DeepSeek-V3's float32
    router bias; the store holds them in its dtype)."""
    scale = sorted(ckpt.scale_dtypes)
    wider = {name: dtype_name(spec.dtype) for (part, name), (_, spec, _) in ckpt.index.items()
             if isinstance(part, int) and spec.dtype.is_floating_point and spec.dtype.itemsize > ckpt.dtype.itemsize}
    return {"quantization_config": ckpt.quantization_config, "scale_dtype": scale[0] if len(scale) == 1 else None,
            "wider": wider}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def keep_tokenizer_files(w: StoreWriter, files: list[Path]) -> dict[str, dict]:
    """Copy the tokenizer's files into the store being written; {name: {"size", "sha256"}} for its manifest."""
    kept = {}
    for src in files:
        dst = w.tmp / src.name
        if not dst.exists():  # the main tokenizer file is already there (add_tokenizer)
            dst.write_bytes(src.read_bytes())
            with open(dst, "rb") as f:
                os.fsync(f.fileno())
        kept[src.name] = {"size": dst.stat().st_size, "sha256": _sha256(dst)}
    return kept


def tokenizer_files(store: BlockStore) -> dict[str, Path]:
    """{name: path} of the store's tokenizer files, each checked against the manifest's size and sha256.

    Stores written before the manifest listed them give their one tokenizer file, unchecked.

    Raises:
        StoreError: a listed file that is missing, changed, or not a tokenizer file name (no escaping the folder).
    """
    listed = store.manifest.get("tokenizer_files")
    if listed is None:
        return {store.tokenizer_path.name: store.tokenizer_path} if store.tokenizer_path else {}
    out = {}
    for name, info in listed.items():
        if name not in TOKENIZER_FILES:
            raise StoreError(f"{store.path}: manifest lists {name!r} as a tokenizer file; expected one of "
                             f"{', '.join(TOKENIZER_FILES)}")
        path = safe_join(store.path, name)
        if not path.is_file() or path.stat().st_size != info.get("size") or _sha256(path) != info.get("sha256"):
            raise StoreError(f"{path}: missing or changed since the store was written (checksum differs); "
                             f"prepare the store again")
        out[name] = path
    return out
