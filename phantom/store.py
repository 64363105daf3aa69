"""The block store: one safetensors file per transformer block, plus embed, head and a manifest.

A store is written into a temporary folder and renamed into place, every file fsynced, so a crash
leaves no half-written store. It is read back block by block into reusable flat byte buffers:
one read per block, tensor views by offset. Imports phantom.config only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from phantom.config import ModelConfig, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes

log = logging.getLogger(__name__)

FORMAT = "phantom-store"
VERSION = 1
MANIFEST = "manifest.json"
MAX_HEADER_BYTES = 100 << 20  # a safetensors header is a few KB; refuse absurd claims before reading

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

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, fsync, rename, fsync the folder."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


# ---------------------------------------------------------------------------------------------
# safetensors, written and read directly so a block is one contiguous byte range we control

@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset inside the data section
    end: int


def _order(tensors: dict[str, torch.Tensor]) -> list[str]:
    # Larger elements first keeps every tensor aligned to its element size inside the data section.
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> dict:
    """Write a safetensors file (fsynced); returns {"size", "sha256"} of the bytes written."""
    header, offset = {}, 0
    for name in _order(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-(len(hbytes) + 8) % 8)  # pad so the data section starts 8-aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(hbytes)), hbytes):
            f.write(chunk)
            digest.update(chunk)
        for name in _order(tensors):
            t = tensors[name].detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
            f.write(raw)
            digest.update(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"size": 8 + len(hbytes) + offset, "sha256": digest.hexdigest()}


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


def check_specs(path: Path, specs: list[TensorSpec], expected: dict[str, tuple[int, ...]], dtype: torch.dtype):
    got = {s.name: s.shape for s in specs}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        detail = "; ".join(x for x in (missing and f"missing {missing}", extra and f"unexpected {extra}",
                                       wrong and f"wrong shape {[(n, got[n], expected[n]) for n in wrong]}") if x)
        raise StoreError(f"{path}: tensors do not match the model config ({detail})")
    bad = [s.name for s in specs if s.dtype != dtype]
    if bad:
        raise StoreError(f"{path}: tensors {bad} are not {dtype_name(dtype)} as the manifest says")


def views(buf: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Tensor views into a flat uint8 buffer holding a file's data section."""
    return {s.name: buf[s.start:s.end].view(s.dtype).view(s.shape) for s in specs}


def readinto_exact(path: Path, offset: int, buf: torch.Tensor, drop_cache: bool = False) -> None:
    """Read len(buf) bytes at offset into a contiguous CPU uint8 tensor.

    drop_cache asks the kernel to forget the file's pages afterwards, so the next read comes from
    the disk again (benchmarks of cold reads; also keeps a huge model from churning the page cache).
    """
    mv = memoryview(buf.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < len(mv):
            n = f.readinto(mv[got:])
            if not n:
                raise StoreError(f"{path}: truncated while reading ({got} of {len(mv)} bytes)")
            got += n
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


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

    def __init__(self, out: Path, cfg: ModelConfig, dtype: torch.dtype, overwrite: bool = False):
        self.out, self.cfg, self.dtype, self.overwrite = Path(out), cfg, dtype, overwrite
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} already exists; remove it or choose another --out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.", suffix=".tmp"))
        (self.tmp / "blocks").mkdir()
        self.files: dict[str, dict] = {}
        self.tokenizer: str | None = None

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
        tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
        self.files[rel] = write_safetensors(self.tmp / rel, tensors)

    def write_embed(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("embed.safetensors", tensors, embed_tensor_shapes(self.cfg))

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self._write(block_file(i), tensors, block_tensor_shapes(self.cfg))

    def write_head(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("head.safetensors", tensors, head_tensor_shapes(self.cfg))

    def add_tokenizer(self, src: Path) -> None:
        name = "tokenizer.json" if Path(src).suffix == ".json" else "tokenizer.model"
        shutil.copyfile(src, self.tmp / name)
        with open(self.tmp / name, "rb") as f:
            os.fsync(f.fileno())
        self.tokenizer = name

    def finish(self, extra: dict | None = None) -> Path:
        needed = ["embed.safetensors", "head.safetensors"] + [block_file(i) for i in range(self.cfg.n_layers)]
        missing = [f for f in needed if f not in self.files]
        if missing:
            raise ValueError(f"store incomplete: {missing[:3]} not written")
        manifest = {"format": FORMAT, "version": VERSION, "config": self.cfg.to_dict(),
                    "dtype": dtype_name(self.dtype), "tokenizer": self.tokenizer, "files": self.files,
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


# ---------------------------------------------------------------------------------------------
# Reading a store

@dataclass(frozen=True)
class FileEntry:
    path: Path
    specs: list[TensorSpec]
    data_start: int
    nbytes: int  # length of the data section
    sha256: str


class BlockStore:
    """Read access to a store: config, manifest checks, and block reads into caller buffers.

    Args:
        path: the store folder (holding manifest.json).
        verify: "fast" checks sizes and headers of every file on open and the sha256 of each file
            the first time it is read; "full" hashes every file on open; "none" skips hashes.
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
        self._manifest_lock = threading.Lock()
        self.embed = self._entry("embed.safetensors", embed_tensor_shapes(self.cfg))
        self.head = self._entry("head.safetensors", head_tensor_shapes(self.cfg))
        shapes = block_tensor_shapes(self.cfg)
        self.blocks = [self._entry(block_file(i), shapes) for i in range(self.cfg.n_layers)]
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

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.manifest.get("tokenizer")
        return safe_join(self.path, name) if name else None

    def _entry(self, rel: str, expected: dict[str, tuple[int, ...]]) -> FileEntry:
        files = self.manifest.get("files", {})
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
        check_specs(path, specs, expected, self.dtype)
        return FileEntry(path, specs, data_start, size - data_start, info.get("sha256", ""))

    def verify_file(self, e: FileEntry, data: torch.Tensor | None = None) -> None:
        """Check a file's sha256 (of the whole file; data, if given, is its data section in memory)."""
        if self.verify == "none" or str(e.path) in self._verified:
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

    def read_block_into(self, i: int, buf: torch.Tensor) -> None:
        """Read block i's data section into buf (a CPU uint8 tensor of block_nbytes), verified."""
        e = self.blocks[i]
        readinto_exact(e.path, e.data_start, buf[: e.nbytes], self.drop_cache)
        self.verify_file(e, buf[: e.nbytes])

    def block_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return views(buf, self.block_specs)

    def _load(self, e: FileEntry) -> dict[str, torch.Tensor]:
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        readinto_exact(e.path, e.data_start, buf)
        self.verify_file(e, buf)
        return views(buf, e.specs)

    def load_head(self) -> dict[str, torch.Tensor]:
        return self._load(self.head)

    def load_embed(self) -> dict[str, torch.Tensor]:
        return self._load(self.embed)

    def load_block(self, i: int) -> dict[str, torch.Tensor]:
        return self._load(self.blocks[i])

    def mmap_embed(self) -> torch.Tensor:
        """The embedding table memory-mapped from disk: a lookup touches only the rows it needs."""
        self.verify_file(self.embed)
        spec = self.embed.specs[0]
        storage = torch.UntypedStorage.from_file(str(self.embed.path), shared=False,
                                                 nbytes=self.embed.data_start + self.embed.nbytes)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        return raw[self.embed.data_start + spec.start: self.embed.data_start + spec.end].view(spec.dtype).view(spec.shape)

    # -- writing into an open store (full finetuning) -------------------------------------------

    def _rewrite(self, rel: str, tensors: dict[str, torch.Tensor]) -> FileEntry:
        """Replace one file atomically with new values of the same tensors; update the manifest."""
        old = next(e for e in [self.embed, self.head, *self.blocks] if e.path == safe_join(self.path, rel))
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != {s.name: s.shape for s in old.specs}:
            raise ValueError(f"{rel}: new tensors {got} do not match the file's layout")
        tmp = old.path.with_name(f".{old.path.name}.tmp")
        info = write_safetensors(tmp, {k: v.to(self.dtype) for k, v in tensors.items()})
        os.replace(tmp, old.path)
        fsync_dir(old.path.parent)
        with self._manifest_lock:
            self.manifest["files"][rel] = info
            atomic_write_json(self.path / MANIFEST, self.manifest)
            self._verified.add(str(old.path))
        return FileEntry(old.path, old.specs, old.data_start, old.nbytes, info["sha256"])

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
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp"))
    try:
        for f in sorted(src.rglob("*")):
            if f.is_symlink():
                raise StoreError(f"{f}: symbolic links are not allowed in a store")
            target = tmp / f.relative_to(src)
            if f.is_dir():
                target.mkdir(exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dst.parent)
    return dst
