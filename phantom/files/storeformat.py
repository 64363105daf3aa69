"""What a block store is on disk, shared by its writer, its reader, its links and its working copies:
the manifest's name, format and version, the paths inside the folder (none escapes it), one file's
entry as the reader checked it, and the records the manifest keeps (quantization, crc32).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from phantom.arch.config import ModelConfig, block_tensor_shapes
from phantom.arch.quantformat import QuantFormat
from phantom.base import safejson
from phantom.base.checksum import crc32
from phantom.files.tensorfile import StoreError, TensorSpec, dtype_name, parse_dtype

FORMAT = "phantom-store"
VERSION = 1
MANIFEST = "manifest.json"


def safe_join(root: Path, rel: str) -> Path:
    """root/rel, refusing absolute paths, '..' and symbolic links that leave root."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise StoreError(f"{root}: manifest path {rel!r} escapes the store folder")
    path = root / rel
    real_root = root.resolve()
    if path.is_symlink() or not path.resolve().is_relative_to(real_root):
        raise StoreError(f"{root}: manifest path {rel!r} escapes the store folder")
    return path


def block_file(i: int) -> str:
    return f"blocks/{i:03d}.safetensors"


@dataclass(frozen=True)
class FileEntry:
    """One store file as its reader checked it on open: where its tensors lie and what its checksums must be."""

    path: Path
    specs: list[TensorSpec]
    data_start: int
    nbytes: int  # length of the data section
    sha256: str
    segments: tuple = ()  # linked entries (phantom.files.storelinks): (file, offset, nbytes) ranges, in order
    crc: tuple | None = None  # (chunk, header crc32 or None, data crc32s): see Checksums; None in older stores
    experts: tuple = ()  # a mixture-of-experts block: each expert's ([start, end) in the data, crc32 of its bytes)
    rest_crc: int | None = None  # and the crc32 of its other bytes (None in stores written before it was recorded)


def read_manifest(path: Path) -> tuple[dict, ModelConfig, torch.dtype]:
    """A store folder's manifest, its model config and its dtype, checked to be a phantom store's.

    Raises:
        FileNotFoundError: no manifest. StoreError: not a store manifest, another version, a bad config or dtype.
    """
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise FileNotFoundError(f"no phantom store at {path} (missing {MANIFEST}); create it with "
                                f"python scripts/prepare_model.py --src CHECKPOINT_DIR --out {path}")
    m = safejson.load(mpath, what="store manifest", error=StoreError)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StoreError(f"{mpath}: not a phantom store manifest")
    if m.get("version") != VERSION:
        raise StoreError(f"{mpath}: store version {m.get('version')} is not supported (expected {VERSION})")
    try:
        return m, ModelConfig.from_dict(m["config"]), parse_dtype(m["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{mpath}: bad config or dtype ({e})") from None


def quant_record(fmt: QuantFormat, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The manifest's "quantization" record: the format, and how each block tensor is stored (the
    method's name for a quantized weight, the store's dtype for the rest). Embedding and head are
    always in the store's dtype (a shipped format's float32 tensors in float32). Dense layers among sparse
    ones add their MLP's names."""
    kinds = {cfg.layout_key(i): i for i in range(cfg.n_layers)}.values()  # one block of each layout
    shapes = {n: s for i in (None, *kinds) for n, s in block_tensor_shapes(cfg, i).items()}
    return {**fmt.record(), "tensors": {n: fmt.method if fmt.quantizes(n, shape) else
                                        "float32" if n in fmt.float32 else dtype_name(dtype)
                                        for n, shape in shapes.items()}}


def crc_record(mpath: Path, rel: str, info: dict, nbytes: int, header: bool) -> tuple | None:
    """A file's "crc32" record as FileEntry.crc (None where the manifest has none: an older store);
    mpath names the manifest in the error."""
    rec = info.get("crc32")
    if rec is None:
        return None
    try:
        chunk, data = int(rec["chunk"]), tuple(int(x) for x in rec["data"])
        head = int(rec["header"]) if header else None
        ok = chunk > 0 and len(data) == -(-nbytes // chunk)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise StoreError(f"{mpath}: bad crc32 record for {rel} ({rec!r:.100}); re-create the store")
    return chunk, head, data


def expert_record(ranges: list[list[int]], read, nbytes: int) -> dict:
    """A block file's record of its experts: each one's [start, end) in the data section and the crc32 of
    those bytes (read(a, b) gives them), and the crc32 of the rest of its nbytes of data (attention, norms,
    router: the ranges between, in order), so a routed read, which fetches the rest and some experts, can
    check what it read."""
    rest = 0
    for a, b in between(ranges, nbytes):
        rest = crc32(read(a, b), rest)
    return {"experts": ranges, "experts_crc32": [crc32(read(a, b)) for a, b in ranges], "experts_rest_crc32": rest}


def between(ranges, nbytes: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of [0, nbytes) that none of `ranges` covers, in order."""
    out, pos = [], 0
    for a, b in sorted(tuple(r) for r in ranges):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    return out + ([(pos, nbytes)] if pos < nbytes else [])


def expert_entries(mpath: Path, rel: str, info: dict, nbytes: int) -> tuple:
    """A file's expert records as FileEntry.experts (empty where the manifest has none: a dense block, an
    older store); mpath names the manifest in the error."""
    ranges, crcs = info.get("experts"), info.get("experts_crc32")
    if ranges is None or crcs is None:
        return ()
    try:
        out = tuple(((int(a), int(b)), int(c)) for (a, b), c in zip(ranges, crcs, strict=True))
        ok = all(0 <= a < b <= nbytes for (a, b), _ in out)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise StoreError(f"{mpath}: bad expert records for {rel} ({ranges!r:.100}); re-create the store")
    return out


def rest_entry(mpath: Path, rel: str, info: dict) -> int | None:
    """A file's crc32 of the bytes outside its experts (FileEntry.rest_crc), None where not recorded."""
    rest = info.get("experts_rest_crc32")
    if rest is None:
        return None
    if not isinstance(rest, int) or isinstance(rest, bool) or not 0 <= rest < 1 << 32:
        raise StoreError(f"{mpath}: bad experts_rest_crc32 for {rel} ({rest!r:.40}); re-create the store")
    return rest
