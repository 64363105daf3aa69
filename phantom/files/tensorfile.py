"""The safetensors format as phantom writes and reads it: dtype tables, tensor specs, a header
reader that refuses what does not fit, and a writer whose data section starts on a 4 KiB boundary
(so a block is one contiguous, O_DIRECT-readable byte range) with its tensors in the order that
keeps fused projections adjacent.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from phantom.arch.config import FUSED_PROJECTIONS
from phantom.base import dtypes, faults, fileio, safejson
from phantom.base.checksum import Checksums

MAX_HEADER_BYTES = 100 << 20  # a safetensors header is a few KB; refuse absurd claims before reading
DATA_ALIGN = 4096  # file offset and buffer alignment of O_DIRECT reads

DTYPE_CODES = {getattr(torch, t.torch_name): t.code for t in dtypes.ALL}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class StoreError(ValueError):
    """A store (or a file in it) is missing, corrupt or does not match its manifest."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, dtypes.lookup(name).torch_name)


def parse_stored(name: str) -> torch.dtype:
    """Any element type a file may hold (integer codes and scales included), by torch's name."""
    return getattr(torch, dtypes.stored(name).torch_name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# safetensors, written and read directly so a block is one contiguous byte range we control

@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset inside the data section
    end: int


_GROUP_RANK = {n: k for k, n in enumerate(n for group in FUSED_PROJECTIONS.values() for n in group)}


def tensor_order(itemsize: dict[str, int]) -> list[str]:
    """The order tensors are laid out in a file written by phantom (name -> element size in bytes).

    Larger elements first keeps every tensor aligned to its element size inside the data section;
    then each group of FUSED_PROJECTIONS back to back, in its order, so a block reads them as one
    matrix (older stores, ordered by name alone, still load: unfused)."""
    return sorted(itemsize, key=lambda n: (-itemsize[n], _GROUP_RANK.get(n, len(_GROUP_RANK)), n))


def _order(tensors: dict[str, torch.Tensor]) -> list[str]:
    itemsize = {n: t.element_size() for n, t in tensors.items()}
    return experts_together(tensor_order(itemsize), {n: t.numel() * t.element_size() for n, t in tensors.items()},
                            itemsize)


def experts_together(order: list[str], nbytes: dict[str, int], itemsize: dict[str, int]) -> list[str]:
    """order with a mixture of experts' quantized tensors (each expert's codes, scales and offsets, of
    several element sizes, which tensor_order would part) regrouped: each expert's back to back, its
    largest elements first, the experts ahead of the rest, so a reader can fetch one expert's bytes alone
    (the manifest's range: phantom.arch.moe.expert_ranges) and every tensor keeps its alignment. Where
    an expert's bytes are not a whole number of the largest element, order stays as it is (no ranges)."""
    experts: dict[int, list[str]] = {}
    for n in order:
        parts = n.split(".")
        if parts[:2] == ["feed_forward", "experts"]:
            experts.setdefault(int(parts[2]), []).append(n)
    sizes = {itemsize[n] for names in experts.values() for n in names}
    if len(sizes) < 2 or max(sizes) < max(itemsize.values()) or \
            any(sum(nbytes[n] for n in names) % max(sizes) for names in experts.values()):
        return order  # one element size (16-bit experts are together already), or no aligned grouping
    grouped = [n for e in sorted(experts) for n in experts[e]]  # within an expert: tensor_order's order
    taken = set(grouped)
    return grouped + [n for n in order if n not in taken]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> dict:
    """Write a safetensors file (fsynced); returns {"size", "sha256", "crc32"} of the bytes written
    (the manifest's entry for it: see Checksums)."""
    order = _order(tensors)
    data = (_raw(tensors[name]) for name in order)
    return _write_file(path, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in order], data, metadata)


def write_copied(path: Path, located: dict[str, tuple]) -> dict:
    """Write a safetensors file of tensors copied byte for byte from other files (located: name -> (file, byte
    offset, dtype, shape)), in tensor_order, 16 MB in memory at a time; its manifest entry, as write_safetensors'."""
    order = tensor_order({n: v[2].itemsize for n, v in located.items()})
    segments = [(located[n][0], located[n][1], located[n][2].itemsize * math.prod(located[n][3])) for n in order]
    return _write_file(path, [(n, located[n][2], tuple(located[n][3])) for n in order], segment_pieces(segments))


def _raw(t: torch.Tensor):
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""


def _write_file(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], data, metadata: dict | None = None):
    """specs' tensors back to back, their bytes the chunks `data` yields; the manifest's entry of the file."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    # Pad (spaces are valid JSON whitespace) so the data section starts on a 4 KiB boundary: block
    # reads can then bypass the page cache with O_DIRECT, which needs aligned file offsets.
    hbytes += b" " * (-(len(hbytes) + 8) % DATA_ALIGN)
    digest = Checksums()
    try:
        _write_safetensors(path, hbytes, data, digest)
    except OSError as e:  # disk full: no half-written file stays, and the error names the file
        Path(path).unlink(missing_ok=True)
        raise e if e.filename else OSError(e.errno, e.strerror, str(path)) from None
    return {"size": 8 + len(hbytes) + offset, **digest.record()}


def _write_safetensors(path: Path, hbytes: bytes, data, digest) -> None:
    with fileio.new_file(path) as f:  # never through a link; fsynced
        faults.io_point(path)  # tests: a full disk here
        for chunk in (struct.pack("<Q", len(hbytes)), hbytes):
            f.write(chunk)
            digest.update_header(chunk)
        faults.point("file.write")  # crash tests: a file with its header and no data
        for raw in data:
            f.write(raw)
            digest.update(raw)


def segment_pieces(segments):
    """The bytes of (file, offset, nbytes) ranges, in order, 16 MB at a time."""
    for path, offset, n in segments:
        with open(path, "rb") as f:
            f.seek(offset)
            while n > 0:
                chunk = f.read(min(n, 16 << 20))
                if not chunk:
                    raise StoreError(f"{path}: truncated while reading")
                yield chunk
                n -= len(chunk)


def read_header(path: Path) -> tuple[list[TensorSpec], int]:
    """Tensor specs and the byte offset of the data section; raises StoreError on a bad header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise StoreError(f"{path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise StoreError(f"{path}: corrupt safetensors header (claims {n} bytes in a {size}-byte file)")
        header = safejson.loads(f.read(n), f"{path}: corrupt safetensors header", line=None, error=StoreError)
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header (not a JSON object)")
    try:
        specs = [_spec(path, name, h) for name, h in header.items() if name != "__metadata__"]
    except (KeyError, TypeError) as e:
        raise StoreError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    specs.sort(key=lambda s: (s.start, s.end))
    check_disjoint(path, [(s.name, s.start, s.end) for s in specs])
    data_start = 8 + n
    data_len = max((s.end for s in specs), default=0)
    if data_start + data_len > size:
        raise StoreError(f"{path}: truncated ({size} bytes, header needs {data_start + data_len})")
    return specs, data_start


def _spec(path: Path, name: str, h: dict) -> TensorSpec:
    """One header entry, as safetensors reads it: offsets and shape are lists of non-negative
    integers (not 1.5, "2" or true), and the offsets span exactly the shape's bytes."""
    offsets, shape = h["data_offsets"], h["shape"]
    if not (_naturals(offsets) and len(offsets) == 2 and _naturals(shape)):
        raise StoreError(f"{path}: tensor {name} has offsets {offsets!r:.60} or shape {shape!r:.60} that are not "
                         f"non-negative integers")
    dtype, (start, end), shape = CODE_DTYPES[h["dtype"]], offsets, tuple(shape)
    if end - start != math.prod(shape) * dtype.itemsize:
        raise StoreError(f"{path}: tensor {name} has offsets {start}..{end} that do not fit its shape")
    return TensorSpec(name, dtype, shape, start, end)


def _naturals(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def check_disjoint(path: Path, ranges: list[tuple[str, int, int]]) -> None:
    """Refuse byte ranges (name, start, end), sorted by start, that overlap: two tensors reading the
    same bytes (safetensors refuses them too; each tensor of a store has bytes of its own)."""
    last, last_end = None, 0
    for name, start, end in ranges:
        if end > start:
            if start < last_end:
                raise StoreError(f"{path}: tensors {last} and {name} overlap in bytes (..{last_end} and "
                                 f"{start}..{end}); each tensor needs bytes of its own")
            last, last_end = name, end


def check_specs(path: Path, specs: list[TensorSpec], expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                dtypes: dict[str, torch.dtype] | None = None):
    """Refuse a file whose tensors are not expected's names and shapes, each in dtype (or dtypes[name])."""
    got = {s.name: s.shape for s in specs}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        detail = "; ".join(x for x in (missing and f"missing {missing}", extra and f"unexpected {extra}",
                                       wrong and f"wrong shape {[(n, got[n], expected[n]) for n in wrong]}") if x)
        raise StoreError(f"{path}: tensors do not match the model config ({detail})")
    bad = [s.name for s in specs if s.dtype != (dtypes or {}).get(s.name, dtype)]
    if bad:
        want = sorted({dtype_name((dtypes or {}).get(n, dtype)) for n in bad})
        raise StoreError(f"{path}: tensors {bad} are not {'/'.join(want)} as the manifest says")


def views(buf: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Tensor views into a flat uint8 buffer holding a file's data section."""
    return {s.name: buf[s.start:s.end].view(s.dtype).view(s.shape) for s in specs}


def packed_empty(like: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Uninitialized tensors shaped as `like`, back to back in one buffer in like's order: a block
    converted to another dtype or device keeps its file layout (and so its fused groups)."""
    return packed_views(torch.empty(sum(t.numel() for t in like.values()), dtype=dtype, device=device), like)


def packed_views(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of flat (at least as many elements) shaped as `like`, back to back in like's order."""
    out, start = {}, 0
    for name, t in like.items():
        out[name] = flat[start:start + t.numel()].view(t.shape)
        start += t.numel()
    return out

def header_digest(path: Path) -> str:
    """sha256 of a safetensors file's length prefix and JSON header (what fixes its tensors' offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        return hashlib.sha256(raw + f.read(min(n, MAX_HEADER_BYTES))).hexdigest()


