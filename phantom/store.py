"""The block store: one safetensors file per transformer block, plus embed, head and a manifest.

A store is written into a temporary folder and renamed into place, every file fsynced, so a crash
leaves no half-written store. It is read back block by block into reusable flat byte buffers:
one read per block, tensor views by offset.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phantom.config import (FUSED_PROJECTIONS, ModelConfig, block_tensor_shapes, embed_tensor_shapes,
                            head_tensor_shapes)
from phantom import faults, fileio, quant
from phantom.quant import QuantError, QuantFormat

log = logging.getLogger(__name__)

FORMAT = "phantom-store"
VERSION = 1
MANIFEST = "manifest.json"
MAX_HEADER_BYTES = 100 << 20  # a safetensors header is a few KB; refuse absurd claims before reading
DATA_ALIGN = 4096  # file offset and buffer alignment of O_DIRECT reads
READ_CHUNK = 16 << 20  # bytes per read request; several are in flight at once
READ_THREADS = 8  # requests in flight, all loaders together (a deep queue rides out threads waiting for a CPU)
CHECK_CHUNK = 16 << 20  # verify "fast": one crc32 per this many bytes of a file's data section (see Checksums)
CHECK_THREADS = 2  # crc32 of a block's chunks in parallel where the read did not hash them (crc32_chunks)
try:  # ISA-L's crc32 (isal, a dependency): zlib's values, several times faster; both release the GIL
    from isal.isal_zlib import crc32
    CRC32 = "isal"
except ImportError:
    from zlib import crc32
    CRC32 = "zlib"

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
               torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
               "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


class StoreError(ValueError):
    """A store (or a file in it) is missing, corrupt or does not match its manifest."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16")
    return DTYPE_NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Atomic files

# One rule for every file written (phantom.fileio): temp in the same folder, fsync, rename, fsync the folder.
fsync_dir, atomic_write_bytes, atomic_write_json = fileio.fsync_dir, fileio.atomic_write, fileio.atomic_write_json


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
    return tensor_order({n: t.element_size() for n, t in tensors.items()})


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> dict:
    """Write a safetensors file (fsynced); returns {"size", "sha256", "crc32"} of the bytes written
    (the manifest's entry for it: see Checksums)."""
    header, offset = {}, 0
    for name in _order(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    # Pad (spaces are valid JSON whitespace) so the data section starts on a 4 KiB boundary: block
    # reads can then bypass the page cache with O_DIRECT, which needs aligned file offsets.
    hbytes += b" " * (-(len(hbytes) + 8) % DATA_ALIGN)
    digest = Checksums()
    try:
        _write_safetensors(path, hbytes, tensors, digest)
    except OSError as e:  # disk full: no half-written file stays, and the error names the file
        Path(path).unlink(missing_ok=True)
        raise e if e.filename else OSError(e.errno, e.strerror, str(path)) from None
    return {"size": 8 + len(hbytes) + offset, **digest.record()}


def _write_safetensors(path: Path, hbytes: bytes, tensors: dict[str, torch.Tensor], digest) -> None:
    with open(path, "wb") as f:
        faults.io_point(path)  # tests: a full disk here
        for chunk in (struct.pack("<Q", len(hbytes)), hbytes):
            f.write(chunk)
            digest.update_header(chunk)
        faults.point("file.write")  # crash tests: a file with its header and no data
        for name in _order(tensors):
            t = tensors[name].detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
            f.write(raw)
            digest.update(raw)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Checksums
#
# A file's manifest entry carries two checksums of the same bytes:
#   "sha256": of the whole file (a linked file: of its data section). verify "full" checks it, and
#       verify "fast" does on stores written before "crc32" was recorded (they open and verify as ever).
#   "crc32": {"chunk": C, "header": crc32 of the bytes before the data section (absent for a linked
#       file, which has no header of its own), "data": [crc32 of data bytes [k*C, (k+1)*C), for every k]}:
#       what verify "fast" checks on a file's first read. crc32 releases the GIL and is cheaper than
#       sha256, ISA-L's far cheaper where `isal` is installed (same values; one core of the AMD EPYC of
#       notes/bench-tiers.md, 256 MiB: sha256 1.8 GB/s, zlib 2.9-4.2, isal 17-28): each read request's
#       thread hashes its pieces as they land, beside the requests still in flight (readinto_exact), so
#       checking takes a fraction of the CPU that sha256 took from the compute. Linked files, and mapped
#       ones, are hashed after the read, their pieces in parallel (crc32_chunks).
# crc32 finds every error burst of up to 32 bits and other damage but for a 2^-32 chance per chunk; it
# is no defence against deliberate tampering (sha256, verify "full", is).

class Checksums:
    """A file's checksums as it is written: sha256 of every byte (unless sha256=False), crc32 of the
    header (bytes given to update_header) and of each `chunk` bytes of the data (given to update)."""

    def __init__(self, chunk: int | None = None, sha256: bool = True):
        self.sha = hashlib.sha256() if sha256 else None
        self.chunk, self.header, self.data = chunk or CHECK_CHUNK, None, []
        self._crc, self._fill = 0, 0

    def update_header(self, b) -> None:
        if self.sha is not None:
            self.sha.update(b)
        self.header = crc32(b, self.header or 0)

    def update(self, b) -> None:
        if self.sha is not None:
            self.sha.update(b)
        mv = memoryview(b).cast("B")
        while len(mv):
            take = min(self.chunk - self._fill, len(mv))
            self._crc = crc32(mv[:take], self._crc)
            self._fill += take
            mv = mv[take:]
            if self._fill == self.chunk:
                self.data.append(self._crc)
                self._crc, self._fill = 0, 0

    def crc32(self) -> dict:
        """The manifest's "crc32" record of the bytes so far."""
        data = self.data + ([self._crc] if self._fill else [])
        return {"chunk": self.chunk, **({"header": self.header} if self.header is not None else {}), "data": data}

    def record(self) -> dict:
        return {"sha256": self.sha.hexdigest(), "crc32": self.crc32()}


_check_pool: ThreadPoolExecutor | None = None


def crc32_chunks(mv: memoryview, chunk: int) -> list[int]:
    """crc32 of each `chunk` bytes of mv (the last piece may be shorter), CHECK_THREADS at once."""
    global _check_pool
    pieces = [mv[a:a + chunk] for a in range(0, len(mv), chunk)]
    if len(pieces) <= 1 or CHECK_THREADS <= 1:
        return [crc32(p) for p in pieces]
    with _pool_lock:
        if _check_pool is None:
            _check_pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="phantom-crc32")
    return list(_check_pool.map(crc32, pieces))


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
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header (not a JSON object)")
    specs = []
    try:
        for name, h in header.items():
            if name == "__metadata__":
                continue
            dtype = CODE_DTYPES[h["dtype"]]
            start, end = (int(x) for x in h["data_offsets"])
            shape = tuple(int(s) for s in h["shape"])
            numel = 1
            for s in shape:
                numel *= s
            if start < 0 or end - start != numel * torch.empty((), dtype=dtype).element_size():
                raise StoreError(f"{path}: tensor {name} has offsets {start}..{end} that do not fit its shape")
            specs.append(TensorSpec(name, dtype, shape, start, end))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, StoreError):
            raise
        raise StoreError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    data_start = 8 + n
    data_len = max((s.end for s in specs), default=0)
    if data_start + data_len > size:
        raise StoreError(f"{path}: truncated ({size} bytes, header needs {data_start + data_len})")
    return sorted(specs, key=lambda s: s.start), data_start


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
    flat = torch.empty(sum(t.numel() for t in like.values()), dtype=dtype, device=device)
    out, start = {}, 0
    for name, t in like.items():
        out[name] = flat[start:start + t.numel()].view(t.shape)
        start += t.numel()
    return out


_read_pool: ThreadPoolExecutor | None = None
_direct_ok: dict[int, bool] = {}  # st_dev -> O_DIRECT works there
_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _read_pool
    with _pool_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="phantom-read")
        return _read_pool


def _open_direct(path: Path) -> int | None:
    """An O_DIRECT descriptor of path, or None where the filesystem refuses it (tmpfs, some FUSE)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    dev = path.stat().st_dev
    if _direct_ok.get(dev) is False:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        log.info("%s: O_DIRECT not supported on this filesystem; reading through the page cache", path)
        _direct_ok[dev] = False
        return None
    _direct_ok[dev] = True
    return fd


def _pread_exact(fd: int, mv: memoryview, offset: int, path: Path, crc_chunk: int = 0) -> list[int] | None:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if not n:
            raise StoreError(f"{path}: truncated while reading ({got} of {len(mv)} bytes at offset {offset})")
        got += n
    if crc_chunk:  # hashed by this request's thread while the other requests are still in flight
        return [crc32(mv[a:a + crc_chunk]) for a in range(0, len(mv), crc_chunk)]
    return None


def _read_jobs(jobs: list[tuple[int, int, int, int]], mv: memoryview, offset: int, path: Path) -> list:
    """Run (fd, start, end, crc_chunk) reads into mv, in parallel; every read has ended before an error
    is raised, so a caller may reuse (or re-read into) the buffer at once. Returns each job's crc32s."""
    if len(jobs) == 1:
        fd, a, b, c = jobs[0]
        return [_pread_exact(fd, mv[a:b], offset + a, path, c)]
    futures = [_pool().submit(_pread_exact, f, mv[a:b], offset + a, path, c) for f, a, b, c in jobs]
    errors = [fut.exception() for fut in futures]
    if err := next((e for e in errors if e is not None), None):
        raise err
    return [fut.result() for fut in futures]


def readinto_exact(path: Path, offset: int, buf: torch.Tensor, drop_cache: bool = False,
                   direct: bool = True, crc_chunk: int = 0) -> list[int] | None:
    """Read len(buf) bytes at offset into a contiguous CPU uint8 tensor, several requests in flight.

    Where the file offset and the buffer are 4 KiB aligned the aligned part is read with O_DIRECT:
    no copy through the page cache, and a model larger than RAM does not evict everything else (the
    block tier's access is cyclic, the worst case for an LRU cache). Elsewhere, buffered reads;
    drop_cache then asks the kernel to forget the pages afterwards (cold-read benchmarks).
    `os.preadv` releases the GIL, so the chunks are read in parallel by a small thread pool.

    With crc_chunk, returns the crc32 of each crc_chunk bytes of buf (the last piece may be shorter):
    each request covers whole pieces and its thread hashes them as soon as its bytes are in, beside
    the requests still in flight, so checking adds about one piece's hash to the read (crc32 releases
    the GIL). A crc_chunk that is not a multiple of 4 KiB or exceeds READ_CHUNK is hashed after the read.
    """
    mv = memoryview(buf.numpy()).cast("B")
    n = len(mv)
    if crc_chunk and (crc_chunk % DATA_ALIGN or crc_chunk > READ_CHUNK):
        readinto_exact(path, offset, buf, drop_cache, direct)
        return crc32_chunks(mv, crc_chunk)
    step = READ_CHUNK // crc_chunk * crc_chunk if crc_chunk else READ_CHUNK  # requests hold whole pieces
    aligned = (n // DATA_ALIGN * DATA_ALIGN) if direct and offset % DATA_ALIGN == 0 and \
        buf.data_ptr() % DATA_ALIGN == 0 else 0
    dfd = _open_direct(Path(path)) if aligned >= READ_CHUNK else None
    if dfd is None:
        aligned = 0
    fd = os.open(path, os.O_RDONLY)
    tail = 0 < aligned < n  # the last few bytes past O_DIRECT's reach, hashed below onto their piece's crc32
    try:
        jobs = [(dfd, a, min(a + step, aligned), crc_chunk) for a in range(0, aligned, step)]
        jobs += [(fd, a, min(a + step, n), 0 if tail else crc_chunk) for a in range(aligned, n, step)]
        try:
            sums = _read_jobs(jobs, mv, offset, path)
        except OSError as e:  # open accepted O_DIRECT but reads refuse it (some FUSE, network filesystems)
            if dfd is None or e.errno != errno.EINVAL:
                raise
            log.info("%s: O_DIRECT reads refused (%s); reading through the page cache", path, e)
            _direct_ok[os.fstat(dfd).st_dev] = False
            sums, tail = _read_jobs([(fd, a, min(a + step, n), crc_chunk) for a in range(0, n, step)], mv, offset,
                                    path), False
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    if not crc_chunk:
        return None
    crcs = [c for job in sums if job for c in job]
    if tail:  # under 4 KiB, inside one piece (pieces are 4 KiB multiples): continue that piece's crc32
        if aligned % crc_chunk:
            crcs[-1] = crc32(mv[aligned:], crcs[-1])
        else:
            crcs.append(crc32(mv[aligned:]))
    return crcs


def safe_join(root: Path, rel: str) -> Path:
    """root/rel, refusing absolute paths, '..' and symbolic links that leave root."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise StoreError(f"{root}: manifest path {rel!r} escapes the store folder")
    path = root / rel
    real_root = root.resolve()
    if path.is_symlink() or not path.resolve().is_relative_to(real_root):
        raise StoreError(f"{root}: manifest path {rel!r} escapes the store folder")
    return path


# ---------------------------------------------------------------------------------------------
# Writing a store

def block_file(i: int) -> str:
    return f"blocks/{i:03d}.safetensors"


class StoreWriter:
    """Writes a store into a temporary sibling folder; `finish()` renames it into place.

    Used as a context manager: an exception inside the `with` removes the temporary folder, so a
    failed conversion leaves nothing behind.
    """

    def __init__(self, out: Path, cfg: ModelConfig, dtype: torch.dtype, overwrite: bool = False,
                 quant: QuantFormat | None = None):
        self.out, self.cfg, self.dtype, self.overwrite, self.quant = Path(out), cfg, dtype, overwrite, quant
        if quant is not None and dtype.itemsize != 2:
            raise ValueError(f"a quantized store keeps norms, embedding and head in 16 bits: use --dtype bf16 or fp16, "
                             f"not {dtype_name(dtype)}")
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} already exists; remove it or choose another --out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.", suffix=".tmp"))
        (self.tmp / "blocks").mkdir()
        self.files: dict[str, dict] = {}
        self.tokenizer: str | None = None
        self.links: dict[str, dict] = {"sources": {}, "files": {}}  # see link_file

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def _write(self, rel: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]):
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != expected:
            raise ValueError(f"{rel}: tensors {got} do not match the config's {expected}")
        if self.quant is not None and rel.startswith("blocks/"):
            tensors = quant.quantize_block(self.quant, tensors, self.dtype)
        else:
            tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
        self.files[rel] = write_safetensors(self.tmp / rel, tensors)

    def write_embed(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("embed.safetensors", tensors, embed_tensor_shapes(self.cfg))

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self._write(block_file(i), tensors, block_tensor_shapes(self.cfg))

    def write_head(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("head.safetensors", tensors, head_tensor_shapes(self.cfg))

    def link_file(self, rel: str, expected: dict[str, tuple[int, ...]], located: dict[str, tuple],
                  copied: dict[str, torch.Tensor]) -> None:
        """Record rel as a linked file instead of writing it (see "Linked files" below).

        Args:
            rel: the store file it stands for, e.g. "blocks/000.safetensors".
            expected: its tensor names and shapes.
            located: name -> (safetensors file (absolute Path), byte offset, dtype, shape): tensors read in place.
            copied: name -> tensor: the rest (e.g. rows that needed a permutation), written into the store
                as rel's ".local.safetensors" and linked from there.
        """
        if self.quant is not None:
            raise ValueError(f"{rel}: a quantized store is a copy; it cannot link the checkpoint's files")
        got = {**{k: tuple(v[3]) for k, v in located.items()}, **{k: tuple(v.shape) for k, v in copied.items()}}
        if got != expected or len(got) != len(located) + len(copied):
            raise ValueError(f"{rel}: tensors {got} do not match the config's {expected}")
        if any(v[2] != self.dtype for v in located.values()):
            raise ValueError(f"{rel}: linked tensors must be {dtype_name(self.dtype)}, as the store")
        located = {k: (str(Path(v[0]).resolve()), *v[1:]) for k, v in located.items()}
        if copied:
            local = rel.removesuffix(".safetensors") + ".local.safetensors"
            self.files[local] = write_safetensors(self.tmp / local, {k: v.to(self.dtype) for k, v in copied.items()})
            specs, start = read_header(self.tmp / local)
            located.update({t.name: (local, start + t.start, t.dtype, t.shape) for t in specs})
        for name in {v[0] for v in located.values()} - set(self.links["sources"]):
            path = Path(name) if os.path.isabs(name) else self.tmp / name
            self.links["sources"][name] = {"size": path.stat().st_size, "header_sha256": header_digest(path)}
        order = tensor_order({n: v[2].itemsize for n, v in located.items()})  # as write_safetensors orders
        segments = [(Path(located[n][0]) if os.path.isabs(located[n][0]) else self.tmp / located[n][0],
                     located[n][1], located[n][2].itemsize * math.prod(located[n][3])) for n in order]
        sums = Checksums()
        for piece in segment_pieces(segments):
            sums.update(piece)
        self.links["files"][rel] = {
            "size": sum(n for _, _, n in segments), **sums.record(),
            "tensors": [{"name": n, "dtype": DTYPE_CODES[located[n][2]], "shape": list(located[n][3]),
                         "file": located[n][0], "offset": located[n][1]} for n in order]}

    def add_tokenizer(self, src: Path) -> None:
        name = "tokenizer.json" if Path(src).suffix == ".json" else "tokenizer.model"
        shutil.copyfile(src, self.tmp / name)
        with open(self.tmp / name, "rb") as f:
            os.fsync(f.fileno())
        self.tokenizer = name

    def finish(self, extra: dict | None = None) -> Path:
        needed = ["embed.safetensors", "head.safetensors"] + [block_file(i) for i in range(self.cfg.n_layers)]
        missing = [f for f in needed if f not in self.files and f not in self.links["files"]]
        if missing:
            raise ValueError(f"store incomplete: {missing[:3]} not written")
        manifest = {"format": FORMAT, "version": VERSION, "config": self.cfg.to_dict(),
                    "dtype": dtype_name(self.dtype), "tokenizer": self.tokenizer, "files": self.files,
                    **({"links": self.links} if self.links["files"] else {}),
                    **({"quantization": quant_record(self.quant, self.cfg, self.dtype)} if self.quant else {}),
                    **(extra or {})}
        atomic_write_json(self.tmp / MANIFEST, manifest)
        fsync_dir(self.tmp / "blocks")
        if self.out.exists():  # overwrite: move the old store aside only once the new one is complete
            old = self.out.with_name(f".{self.out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.out, old)
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        fsync_dir(self.out.parent)
        return self.out


def quant_record(fmt: QuantFormat, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The manifest's "quantization" record: the format, and how each block tensor is stored (the
    method's name for a quantized weight, the store's dtype for the rest). Embedding and head are
    always in the store's dtype."""
    return {**fmt.record(), "tensors": {n: fmt.method if quant.quantized(n, shape) else dtype_name(dtype)
                                        for n, shape in block_tensor_shapes(cfg).items()}}


# ---------------------------------------------------------------------------------------------
# Reading a store

@dataclass(frozen=True)
class FileEntry:
    path: Path
    specs: list[TensorSpec]
    data_start: int
    nbytes: int  # length of the data section
    sha256: str
    segments: tuple = ()  # linked entries (see "Linked files"): (file, offset, nbytes) ranges, in order
    crc: tuple | None = None  # (chunk, header crc32 or None, data crc32s): see Checksums; None in older stores


class BlockStore:
    """Read access to a store: config, manifest checks, and block reads into caller buffers.

    Args:
        path: the store folder (holding manifest.json).
        verify: "fast" checks sizes and headers of every file on open and each file's checksum the
            first time it is read (its crc32 record, or its sha256 where the manifest has none: see
            Checksums); "full" checks every file's sha256 on open; "none" skips checksums.
        drop_cache: evict each block file from the page cache after reading it (cold reads).
    """

    def __init__(self, path: Path | str, verify: str = "fast", drop_cache: bool = False):
        self.path = Path(path)
        self.drop_cache = drop_cache
        if verify not in ("fast", "full", "none"):
            raise ValueError(f"verify must be fast, full or none, not {verify!r}")
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(f"no phantom store at {self.path} (missing {MANIFEST}); create it with "
                                    f"python scripts/prepare_model.py --src CHECKPOINT_DIR --out {self.path}")
        try:
            self.manifest = json.loads(mpath.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{mpath}: not valid JSON ({e})") from None
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise StoreError(f"{mpath}: not a phantom store manifest")
        if m.get("version") != VERSION:
            raise StoreError(f"{mpath}: store version {m.get('version')} is not supported (expected {VERSION})")
        try:
            self.cfg = ModelConfig.from_dict(m["config"])
            self.dtype = parse_dtype(m["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{mpath}: bad config or dtype ({e})") from None
        self.verify = verify
        self._verified: set[str] = set()
        self._link_sources: dict[str, Path] = {}
        self._manifest_lock = threading.Lock()
        self.quant = self._quant_format()
        self.embed = self._entry("embed.safetensors", embed_tensor_shapes(self.cfg))
        self.head = self._entry("head.safetensors", head_tensor_shapes(self.cfg))
        shapes, dtypes = block_tensor_shapes(self.cfg), None
        if self.quant is not None:
            layout = quant.block_layout(self.quant, shapes, self.dtype)
            shapes, dtypes = {n: s for n, (s, _) in layout.items()}, {n: d for n, (_, d) in layout.items()}
        self.blocks = [self._entry(block_file(i), shapes, dtypes) for i in range(self.cfg.n_layers)]
        layouts = {tuple((s.name, s.start, s.end) for s in b.specs) for b in self.blocks}
        if len(layouts) != 1:
            raise StoreError(f"{self.path}: block files do not share one tensor layout")
        self.block_specs = self.blocks[0].specs
        self.block_nbytes = self.blocks[0].nbytes
        if verify == "full":
            for e in [self.embed, self.head, *self.blocks]:
                self.verify_file(e)

    @property
    def n_blocks(self) -> int:
        return self.cfg.n_layers

    def _quant_format(self) -> QuantFormat | None:
        """The manifest's "quantization" record, checked against the model (None: a 16-bit store)."""
        rec = self.manifest.get("quantization")
        if rec is None:
            return None
        mpath = self.path / MANIFEST
        try:
            if not isinstance(rec, dict):
                raise QuantError("not a JSON object")
            fmt = QuantFormat.from_record(rec)
        except QuantError as e:
            raise StoreError(f"{mpath}: bad quantization record ({e}); re-create the store") from None
        if self.dtype.itemsize != 2:
            raise StoreError(f"{mpath}: a quantized store keeps its other tensors in 16 bits, not {self.manifest['dtype']}")
        expected = quant_record(fmt, self.cfg, self.dtype)["tensors"]
        if rec.get("tensors") != expected:
            raise StoreError(f"{mpath}: the quantization record's tensors {rec.get('tensors')!r:.200} do not match "
                             f"a {fmt.method} store of this model ({expected!r:.200}); re-create the store")
        return fmt

    @property
    def dense_nbytes(self) -> int:
        """Bytes of one block's weights in the store's dtype (= block_nbytes unless quantized)."""
        return sum(math.prod(s) for s in block_tensor_shapes(self.cfg).values()) * self.dtype.itemsize

    def dense_empty(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Uninitialized dense block tensors, back to back in the order a 16-bit store lays them out
        (so the fused projection groups are adjacent, layers.fuse_adjacent): what a quantized block is
        dequantized into."""
        shapes = block_tensor_shapes(self.cfg)
        order = tensor_order({n: self.dtype.itemsize for n in shapes})
        return packed_empty({n: torch.empty(shapes[n], device="meta") for n in order}, dtype, device)

    def dequantize_block(self, i: int, stored: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        """Block i's stored views (quantized) into out's dense tensors; scales no quantizer writes are
        refused naming the file."""
        try:
            quant.dequantize_block(self.quant, stored, out)
        except QuantError as e:
            raise StoreError(f"{self.blocks[i].path}: {e}; re-create the store") from None

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.manifest.get("tokenizer")
        return safe_join(self.path, name) if name else None

    def _entry(self, rel: str, expected: dict[str, tuple[int, ...]],
               dtypes: dict[str, torch.dtype] | None = None) -> FileEntry:
        files = self.manifest.get("files", {})
        if rel not in files and rel in self.manifest.get("links", {}).get("files", {}):
            if dtypes is not None:
                raise StoreError(f"{self.path / MANIFEST}: {rel} is linked, but a quantized store holds its own blocks")
            return self._linked_entry(rel, expected)
        if rel not in files:
            raise StoreError(f"{self.path}: manifest lists no {rel}")
        path = safe_join(self.path, rel)
        info = files[rel]
        if not path.is_file():
            raise StoreError(f"{path}: missing from the store")
        size = path.stat().st_size
        if size != info.get("size"):
            raise StoreError(f"{path}: size {size} differs from the manifest's {info.get('size')} "
                             f"(truncated or modified)")
        specs, data_start = read_header(path)
        check_specs(path, specs, expected, self.dtype, dtypes)
        return FileEntry(path, specs, data_start, size - data_start, info.get("sha256", ""),
                         crc=self._crc_record(rel, info, size - data_start, header=True))

    def _crc_record(self, rel: str, info: dict, nbytes: int, header: bool) -> tuple | None:
        """A file's "crc32" record as FileEntry.crc (None where the manifest has none: an older store)."""
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
            raise StoreError(f"{self.path / MANIFEST}: bad crc32 record for {rel} ({rec!r:.100}); re-create the store")
        return chunk, head, data

    def _linked_entry(self, rel: str, expected: dict[str, tuple[int, ...]]) -> FileEntry:
        """A file that the manifest's "links" section assembles from byte ranges of (checked) safetensors files."""
        info, specs, segments, pos = self.manifest["links"]["files"][rel], [], [], 0
        try:
            for t in info["tensors"]:
                dtype, shape = CODE_DTYPES[t["dtype"]], tuple(int(x) for x in t["shape"])
                n = dtype.itemsize * math.prod(shape)
                specs.append(TensorSpec(t["name"], dtype, shape, pos, pos + n))
                path, offset = self._link_source(t["file"]), int(t["offset"])
                if offset < 0 or offset + n > path.stat().st_size:
                    raise StoreError(f"{path}: linked tensor {t['name']} lies outside the file")
                if segments and segments[-1][0] == path and segments[-1][1] + segments[-1][2] == offset:
                    segments[-1] = (path, segments[-1][1], segments[-1][2] + n)  # adjacent: one read
                else:
                    segments.append((path, offset, n))
                pos += n
            sha256 = str(info["sha256"])
            crc = self._crc_record(rel, info, pos, header=False)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"{self.path / MANIFEST}: bad links entry for {rel} ({type(e).__name__}: {e})") from None
        check_specs(self.path / rel, specs, expected, self.dtype)
        return FileEntry(self.path / rel, specs, 0, pos, sha256, tuple(segments), crc)

    def _link_source(self, name: str) -> Path:
        """A linked file, checked once: listed in links.sources, absolute or inside the store, same size
        and header as when the store was made, and a well-formed safetensors file."""
        if name in self._link_sources:
            return self._link_sources[name]
        rec = self.manifest["links"].get("sources", {}).get(name)
        if not isinstance(rec, dict):
            raise StoreError(f"{self.path / MANIFEST}: linked file {name!r} is not listed in links.sources")
        path = Path(name) if os.path.isabs(name) else safe_join(self.path, name)
        if not path.is_file():
            raise StoreError(f"{path}: missing; the store {self.path} reads it in place (--link): put it back or "
                             f"re-create the store")
        read_header(path)
        if path.stat().st_size != rec.get("size") or header_digest(path) != rec.get("header_sha256"):
            raise StoreError(f"{path}: changed since the store {self.path} linked it; re-create the store")
        self._link_sources[name] = path
        return path

    def _read_data(self, e: FileEntry, buf: torch.Tensor, drop_cache: bool = False) -> None:
        """A file's data section into buf: one read, or one per linked range. Under verify "fast" a
        file with a crc32 record is checked by the read itself on its first read (readinto_exact)."""
        if self.verify == "fast" and e.crc is not None and not e.segments and str(e.path) not in self._verified:
            self._check_crc(e, readinto_exact(e.path, e.data_start, buf, drop_cache, crc_chunk=e.crc[0]))
            self._verified.add(str(e.path))
            return
        pos = 0
        for path, offset, n in e.segments or ((e.path, e.data_start, e.nbytes),):
            readinto_exact(path, offset, buf[pos:pos + n], drop_cache)
            pos += n

    def verify_file(self, e: FileEntry, data: torch.Tensor | None = None) -> None:
        """Check a file's checksum (data, if given, is its data section in memory): under verify "fast"
        its crc32 record where the manifest has one, else its sha256 (see Checksums)."""
        if self.verify == "none" or str(e.path) in self._verified:
            return
        if self.verify == "fast" and e.crc is not None:
            self._verify_crc(e, data)
            self._verified.add(str(e.path))
            return
        if e.segments:  # linked: the hash is of the data section alone
            raw = memoryview(data.numpy()).cast("B") if data is not None else None
            if (hashlib.sha256(raw).hexdigest() if raw is not None else segments_digest(e.segments)) != e.sha256:
                files = sorted({str(p) for p, _, _ in e.segments})
                raise StoreError(f"{e.path}: checksum mismatch in its linked files {files} (changed since the "
                                 f"store was made; re-create the store)")
            self._verified.add(str(e.path))
            return
        h = hashlib.sha256()
        if data is None:
            with open(e.path, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
        else:
            with open(e.path, "rb") as f:
                h.update(f.read(e.data_start))
            h.update(memoryview(data.numpy()).cast("B"))
        if h.hexdigest() != e.sha256:
            raise StoreError(f"{e.path}: checksum mismatch (the file is corrupt; re-create the store)")
        self._verified.add(str(e.path))

    def _verify_crc(self, e: FileEntry, data: torch.Tensor | None) -> None:
        """Check a file's crc32 record: its data section's chunks (in parallel when in memory), then
        its header (read again: a few KB, in the page cache since open)."""
        chunk = e.crc[0]
        if data is not None:
            got = crc32_chunks(memoryview(data.numpy()).cast("B"), chunk)
        else:
            sums = Checksums(chunk, sha256=False)
            for piece in segment_pieces(e.segments or ((e.path, e.data_start, e.nbytes),)):
                sums.update(piece)
            got = sums.crc32()["data"]
        self._check_crc(e, got)

    def _check_crc(self, e: FileEntry, got: list[int]) -> None:
        """Compare a file's data crc32s with its record, then its header's; StoreError naming the file."""
        chunk, header, expected = e.crc
        bad = next((f"data bytes {k * chunk}..{min((k + 1) * chunk, e.nbytes)}"
                    for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if bad is None and len(got) != len(expected):
            bad = f"data ({len(got)} pieces, not {len(expected)})"
        if bad is None and header is not None:
            with open(e.path, "rb") as f:
                if crc32(f.read(e.data_start)) != header:
                    bad = "header"
        if bad is None:
            return
        if e.segments:
            files = sorted({str(p) for p, _, _ in e.segments})
            raise StoreError(f"{e.path}: checksum mismatch in its linked files {files} (crc32 of {bad}: changed "
                             f"since the store was made; re-create the store)")
        raise StoreError(f"{e.path}: checksum mismatch (crc32 of its {bad}: the file is corrupt; re-create the store)")

    def read_block_into(self, i: int, buf: torch.Tensor, defer_verify: bool = False):
        """Read block i's data section into buf (a CPU uint8 tensor of block_nbytes), verified.

        A file with a crc32 record (verify "fast") is checked by the read itself (readinto_exact).
        Otherwise (a sha256, or a linked file), with defer_verify the checksum is not computed here:
        the return value is a function that checks it (or None when nothing is left to check), for
        the caller to run off the read path while the buffer is still untouched (the scheduler hashes
        beside the compute)."""
        e = self.blocks[i]
        self._read_data(e, buf[: e.nbytes], self.drop_cache)
        check = None if self.verify == "none" or str(e.path) in self._verified else \
            (lambda: self.verify_file(e, buf[: e.nbytes]))
        if check is not None and not defer_verify:
            check()
            check = None
        return check

    def map_block(self, i: int) -> torch.Tensor:
        """Block i's data section memory-mapped read-only (verified): pages live in the page cache,
        shared by every process that maps the same file. Never write through it."""
        e = self.blocks[i]
        if e.segments:  # linked (several byte ranges): a private copy, not a shared mapping
            buf = torch.empty(e.nbytes, dtype=torch.uint8)
            self.read_block_into(i, buf)
            return buf
        arr = np.memmap(e.path, dtype=np.uint8, mode="r", offset=e.data_start, shape=(e.nbytes,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": it is read-only on purpose
            buf = torch.from_numpy(arr)
        self.verify_file(e, buf)
        return buf

    def block_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return views(buf, self.block_specs)

    def _load(self, e: FileEntry) -> dict[str, torch.Tensor]:
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        self._read_data(e, buf)
        self.verify_file(e, buf)
        return views(buf, e.specs)

    def load_head(self) -> dict[str, torch.Tensor]:
        return self._load(self.head)

    def load_embed(self) -> dict[str, torch.Tensor]:
        return self._load(self.embed)

    def load_block(self, i: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Block i's weights in the store's dtype; a quantized block dequantized (into dtype if given: the
        values a run in that dtype computes with), in dense_empty's layout."""
        stored = self._load(self.blocks[i])
        if self.quant is None:
            return stored
        out = self.dense_empty(dtype or self.dtype)
        self.dequantize_block(i, stored, out)
        return out

    def mmap_embed(self) -> torch.Tensor:
        """The embedding table memory-mapped from disk: a lookup touches only the rows it needs."""
        self.verify_file(self.embed)
        spec = self.embed.specs[0]
        path, start = (self.embed.path, self.embed.data_start) if not self.embed.segments else self.embed.segments[0][:2]
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=start + self.embed.nbytes)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        return raw[start + spec.start: start + spec.end].view(spec.dtype).view(spec.shape)

    # -- writing into an open store (full finetuning) -------------------------------------------

    def _rewrite(self, rel: str, tensors: dict[str, torch.Tensor]) -> FileEntry:
        """Replace one file atomically with new values of the same tensors; update the manifest."""
        if self.quant is not None:
            raise ValueError(f"{self.path}: a quantized store's weights are frozen (not rewritten)")
        old = next(e for e in [self.embed, self.head, *self.blocks] if e.path == safe_join(self.path, rel))
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != {s.name: s.shape for s in old.specs}:
            raise ValueError(f"{rel}: new tensors {got} do not match the file's layout")
        tmp = old.path.with_name(f".{old.path.name}.tmp")
        info = write_safetensors(tmp, {k: v.to(self.dtype) for k, v in tensors.items()})
        os.replace(tmp, old.path)
        fsync_dir(old.path.parent)
        faults.point("store.rewrite")  # crash tests: new file in place, manifest not yet updated
        with self._manifest_lock:
            self.manifest["files"][rel] = info
            self.manifest.get("links", {}).get("files", {}).pop(rel, None)  # was linked, now a file
            atomic_write_json(self.path / MANIFEST, self.manifest)
            self._verified.add(str(old.path))
        return FileEntry(old.path, old.specs, read_header(old.path)[1], old.nbytes, info["sha256"],
                         crc=self._crc_record(rel, info, old.nbytes, header=True))

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self.blocks[i] = self._rewrite(block_file(i), tensors)

    def write_head(self, tensors: dict[str, torch.Tensor]) -> None:
        self.head = self._rewrite("head.safetensors", tensors)

    def write_embed(self, tensors: dict[str, torch.Tensor]) -> None:
        self.embed = self._rewrite("embed.safetensors", tensors)

    def set_fields(self, **fields) -> None:
        """Record fields (e.g. the training step) in the manifest, atomically."""
        with self._manifest_lock:
            self.manifest.update(fields)
            atomic_write_json(self.path / MANIFEST, self.manifest)


def clone_store(src: Path, dst: Path) -> Path:
    """A working copy of a store for full finetuning: hard links where possible, else copies.

    Safe because files in a store are only ever replaced by rename, never modified in place, so a
    rewrite in the copy never touches the original's data.
    """
    src, dst = Path(src), Path(dst)
    BlockStore(src, verify="none")  # refuse to clone something that is not a store
    return link_tree(src, dst)


def link_tree(src: Path, dst: Path) -> Path:
    """Replace dst by a copy of the folder src made of hard links (copies across filesystems).

    A snapshot for free where files are only ever replaced by rename: later rewrites in either tree
    create new files and leave the other's untouched. Built under a temporary name, then renamed.
    """
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp"))
    try:
        for f in sorted(src.rglob("*")):
            if f.is_symlink():
                raise StoreError(f"{f}: symbolic links are not allowed in a store")
            if f.name.endswith(".tmp"):
                continue  # an unfinished write of a crashed run
            target = tmp / f.relative_to(src)
            if f.is_dir():
                target.mkdir(exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dst.parent)
    return dst


# ---------------------------------------------------------------------------------------------
# Linked files (prepare_model.py --link)
#
# A store may leave tensors where they are, inside a checkpoint's safetensors files, instead of
# copying them. The manifest's "links" section then holds:
#   "sources": {file: {"size", "header_sha256"}}: every file linked from. A file is an absolute path
#       (a checkpoint's file, resolved when the store was made) or a path inside the store (safe_join
#       rules). Absolute paths are allowed here and nowhere else in a manifest.
#   "files": {store file: {"size", "sha256", "crc32", "tensors": [{"name", "dtype", "shape", "file",
#       "offset"}]}}: a store file that is not on disk; its data section is its tensors' byte ranges, in order.
# On open, each source must be a well-formed safetensors file with the recorded size and header hash
# (so the recorded offsets still hold); a linked file's sha256 and crc32 record (no "header") are of its
# data section, checked as any file's. Sources are only ever read. A name in "files" takes precedence
# over a link of the same name.

def header_digest(path: Path) -> str:
    """sha256 of a safetensors file's length prefix and JSON header (what fixes its tensors' offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        return hashlib.sha256(raw + f.read(min(n, MAX_HEADER_BYTES))).hexdigest()


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


def segments_digest(segments) -> str:
    """sha256 of the bytes of (file, offset, nbytes) ranges, concatenated."""
    h = hashlib.sha256()
    for chunk in segment_pieces(segments):
        h.update(chunk)
    return h.hexdigest()
