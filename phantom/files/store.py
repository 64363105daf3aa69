"""The block store: one safetensors file per transformer block, plus embed, head and a manifest.

A store is written into a temporary folder and renamed into place, every file fsynced, so a crash
leaves no half-written store. It is read back block by block into reusable flat byte buffers:
one read per block (phantom.files.directio), tensor views by offset (phantom.files.tensorfile), each file's
checksum checked on its first read (phantom.base.checksum).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phantom.base import faults, fileio, safejson
from phantom.arch import quant
from phantom.files import runfolder
from phantom.base.checksum import Checksums, crc32_chunks, crc32_impl
from phantom.arch.config import ModelConfig, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.files.directio import readinto_exact
from phantom.base.fileio import atomic_write_json
from phantom.arch.moe import expert_ranges
from phantom.arch.quantformat import QuantError, QuantFormat, block_layout, quantized
from phantom.files.tensorfile import (CODE_DTYPES, DTYPE_CODES, StoreError, TensorSpec, check_disjoint, check_specs,
                                dtype_name, header_digest, packed_empty, parse_dtype, parse_stored, read_header, tensor_order, views,
                                write_safetensors)

log = logging.getLogger(__name__)

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
        runfolder.check_replaceable(self.out, "store")  # overwrite: only a store phantom wrote goes
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = fileio.temp_folder(self.out)
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
        if self.cfg.n_experts and rel.startswith("blocks/") and self.quant is None:  # each expert's byte range
            self.files[rel]["experts"] = expert_ranges(read_header(self.tmp / rel)[0], self.cfg.n_experts)

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
        if self.cfg.n_experts and rel.startswith("blocks/"):  # each expert's range in the assembled data
            pos, specs = 0, []
            for name, (_, _, n) in zip(order, segments):
                specs.append(TensorSpec(name, located[name][2], tuple(located[name][3]), pos, pos + n))
                pos += n
            self.links["files"][rel]["experts"] = expert_ranges(specs, self.cfg.n_experts)

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
        return fileio.swap_folder(self.tmp, self.out)  # overwrite: the old store goes only once this one is complete


def quant_record(fmt: QuantFormat, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The manifest's "quantization" record: the format, and how each block tensor is stored (the
    method's name for a quantized weight, the store's dtype for the rest). Embedding and head are
    always in the store's dtype."""
    return {**fmt.record(), "tensors": {n: fmt.method if quantized(n, shape) else dtype_name(dtype)
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
        crc32: the crc32 implementation reads check with (phantom.base.checksum.CRC32_IMPLS; default the
            fastest here): the values are the same, the speed is not (benchmarks compare them).
    """

    def __init__(self, path: Path | str, verify: str = "fast", drop_cache: bool = False, crc32: str | None = None):
        self.path = Path(path)
        self.drop_cache = drop_cache
        self.crc = crc32_impl(crc32)
        if verify not in ("fast", "full", "none"):
            raise ValueError(f"verify must be fast, full or none, not {verify!r}")
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(f"no phantom store at {self.path} (missing {MANIFEST}); create it with "
                                    f"python scripts/prepare_model.py --src CHECKPOINT_DIR --out {self.path}")
        self.manifest = m = safejson.load(mpath, what="store manifest", error=StoreError)
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
            layout = block_layout(self.quant, shapes, dtype_name(self.dtype))
            shapes, dtypes = {n: s for n, (s, _) in layout.items()}, {n: parse_stored(d) for n, (_, d) in layout.items()}
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
        info, specs, segments, pos, ranges = self.manifest["links"]["files"][rel], [], [], 0, {}
        try:
            for t in info["tensors"]:
                dtype, shape = CODE_DTYPES[t["dtype"]], tuple(int(x) for x in t["shape"])
                n = dtype.itemsize * math.prod(shape)
                specs.append(TensorSpec(t["name"], dtype, shape, pos, pos + n))
                path, offset = self._link_source(t["file"]), int(t["offset"])
                if offset < 0 or offset + n > path.stat().st_size:
                    raise StoreError(f"{path}: linked tensor {t['name']} lies outside the file")
                ranges.setdefault(path, []).append((t["name"], offset, offset + n))
                if segments and segments[-1][0] == path and segments[-1][1] + segments[-1][2] == offset:
                    segments[-1] = (path, segments[-1][1], segments[-1][2] + n)  # adjacent: one read
                else:
                    segments.append((path, offset, n))
                pos += n
            sha256 = str(info["sha256"])
            crc = self._crc_record(rel, info, pos, header=False)
            for path, r in ranges.items():
                check_disjoint(path, sorted(r, key=lambda x: x[1:]))
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
            self._check_crc(e, readinto_exact(e.path, e.data_start, buf, drop_cache, crc_chunk=e.crc[0], crc=self.crc))
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
            got = crc32_chunks(memoryview(data.numpy()).cast("B"), chunk, self.crc)
        else:
            sums = Checksums(chunk, sha256=False, crc=self.crc)
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
                if self.crc(f.read(e.data_start)) != header:
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
        with fileio.replacing(old.path) as tmp:
            info = write_safetensors(tmp, {k: v.to(self.dtype) for k, v in tensors.items()})
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
    with fileio.replacing_folder(dst) as tmp:
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
