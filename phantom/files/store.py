"""Reading a block store: one safetensors file per transformer block, plus embed, head and a manifest
(phantom.files.storeformat), written by phantom.files.storewriter.

It is read back block by block into reusable flat byte buffers: one read per block
(phantom.files.directio), tensor views by offset (phantom.files.tensorfile), each file's checksum
checked on its first read (phantom.files.storeverify); linked files are assembled from a checkpoint's
(phantom.files.storelinks); a working copy's files are rewritten through phantom.files.workingcopy.
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from phantom.arch import quant
from phantom.arch.config import block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.arch.ops import permute_from_hf, rope_rows
from phantom.arch.quantformat import QuantError, QuantFormat, block_layout
from phantom.base.checksum import crc32_impl
from phantom.files import workingcopy
from phantom.files.storeformat import (
    MANIFEST,
    FileEntry,
    block_file,
    crc_record,
    expert_entries,
    rest_entry,
    quant_record,
    read_manifest,
    safe_join,
)
from phantom.files.storelinks import LinkedFiles
from phantom.files.storeverify import Verifier
from phantom.files.tensorfile import (
    StoreError,
    check_specs,
    dtype_name,
    packed_empty,
    parse_stored,
    read_header,
    tensor_order,
    views,
)


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
        self.checks = Verifier(verify, crc32_impl(crc32))
        self.manifest, self.cfg, self.dtype = read_manifest(self.path)
        self.links = LinkedFiles(self.path, self.manifest)
        self.manifest_lock = threading.Lock()  # a working copy's rewrites (phantom.files.workingcopy)
        self.quant = self._quant_format()
        self.embed = self._entry("embed.safetensors", embed_tensor_shapes(self.cfg))
        self.head = self._entry("head.safetensors", head_tensor_shapes(self.cfg))
        self.blocks = [self._entry(block_file(i), *self._stored_shapes(i)) for i in range(self.cfg.n_layers)]
        for i, b in enumerate(self.blocks):  # blocks of one kind (sparse, or dense among sparse) share a layout
            first = self.blocks[self._first_alike(i)]
            if [(s.name, s.start, s.end) for s in b.specs] != [(s.name, s.start, s.end) for s in first.specs]:
                raise StoreError(f"{self.path}: block files do not share one tensor layout "
                                 f"({b.path.name} differs from {first.path.name})")
        # the layout of a mixture of experts' sparse blocks (where dense layers sit among them), else every block's
        self.block_specs = self.blocks[next((i for i in range(self.n_blocks) if self.cfg.sparse(i)), 0)].specs
        # a slot's bytes: the largest block's (a dense layer's block among sparse ones is smaller)
        self.block_nbytes = max(b.nbytes for b in self.blocks)
        self.two_layouts = any(self.layout_index(i) for i in range(self.n_blocks))
        if verify == "full":
            for e in [self.embed, self.head, *self.blocks]:
                self.checks.check(e)

    @property
    def n_blocks(self) -> int:
        return self.cfg.n_layers

    def _first_alike(self, i: int) -> int:
        """The first block with block i's tensor layout (blocks differ where dense layers sit among a mixture of
        experts' sparse ones, cfg.dense_layers, or linear attention among full attention: cfg.layout_key)."""
        return next(j for j in range(self.cfg.n_layers) if self.cfg.layout_key(j) == self.cfg.layout_key(i))

    def layout_index(self, i: int) -> int:
        """Which of the store's block layouts block i has, numbered as they first appear: 0 for every block of a
        store with one layout, 0 for the first block's kind and 1, 2 for the others (slots keep their views per
        layout; GLM-5 has three: dense and sparse layers with an indexer, sparse ones sharing it)."""
        if getattr(self, "_layout_of", None) is None:
            firsts = [self._first_alike(j) for j in range(self.n_blocks)]
            self._layout_of = [sorted(set(firsts)).index(f) for f in firsts]
        return self._layout_of[i]

    def block_size(self, i: int) -> int:
        """Bytes of block i's data section (at most block_nbytes)."""
        return self.blocks[i].nbytes

    def _stored_shapes(self, i: int) -> tuple[dict, dict | None]:
        """Block i's tensors as its file holds them: name -> shape, and name -> dtype where quantized."""
        shapes = block_tensor_shapes(self.cfg, i)
        if self.quant is None:
            return shapes, None
        layout = block_layout(self.quant, shapes, dtype_name(self.dtype))
        return {n: s for n, (s, _) in layout.items()}, {n: parse_stored(d) for n, (_, d) in layout.items()}

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
        """Bytes of the largest block's weights in the store's dtype (= block_nbytes unless quantized)."""
        return max(self.cfg.block_params(i) for i in {self._first_alike(j) for j in range(self.n_blocks)}) * \
            self.dtype.itemsize

    def dense_empty(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                    block: int = 0) -> dict[str, torch.Tensor]:
        """Uninitialized dense tensors of `block`, back to back in the order a 16-bit store lays them out
        (so the fused projection groups are adjacent, layers.fuse_adjacent): what a quantized block is
        dequantized into."""
        return packed_empty(self.dense_like(block), dtype, device)

    def dense_like(self, block: int = 0) -> dict[str, torch.Tensor]:
        """Meta tensors shaped as `block`'s dense weights, in dense_empty's order."""
        shapes = block_tensor_shapes(self.cfg, block)
        order = tensor_order({n: self.dtype.itemsize for n in shapes})
        return {n: torch.empty(shapes[n], device="meta") for n in order}

    def dequantize_block(self, i: int, stored: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        """Block i's stored views (quantized) into out's dense tensors; scales no quantizer writes are
        refused naming the file."""
        try:
            quant.dequantize_block(self.quant, stored, out)
        except QuantError as e:
            raise StoreError(f"{self.blocks[i].path}: {e}; re-create the store") from None
        if self.quant.shipped:  # a store made before its layout was recorded: q/k rows shipped in halves, into pairs
            for name, heads in rope_rows(self.cfg).items():
                if name in out and name not in stored and self.quant.quantizes(name, tuple(out[name].shape)):
                    out[name].copy_(permute_from_hf(out[name], heads, self.cfg.rope_dim))

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.manifest.get("tokenizer")
        return safe_join(self.path, name) if name else None

    def _entry(self, rel: str, expected: dict[str, tuple[int, ...]],
               dtypes: dict[str, torch.dtype] | None = None) -> FileEntry:
        files = self.manifest.get("files", {})
        if rel not in files and self.links.has(rel):
            if rel.startswith("blocks/") and dtypes is not None and not self.quant.shipped:
                raise StoreError(f"{self.path / MANIFEST}: {rel} is linked, but a {self.quant.method} store holds its "
                                 f"own blocks")
            return self.links.entry(rel, expected, self.dtype, dtypes)
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
                         crc=crc_record(self.path / MANIFEST, rel, info, size - data_start, header=True),
                         experts=expert_entries(self.path / MANIFEST, rel, info, size - data_start),
                         rest_crc=rest_entry(self.path / MANIFEST, rel, info))

    def read_block_into(self, i: int, buf: torch.Tensor, defer_verify: bool = False):
        """Read block i's data section into buf (a CPU uint8 tensor of block_nbytes), verified.

        A file with a crc32 record (verify "fast") is checked by the read itself (readinto_exact).
        Otherwise (a sha256, or a linked file), with defer_verify the checksum is not computed here:
        the return value is a function that checks it (or None when nothing is left to check), for
        the caller to run off the read path while the buffer is still untouched (the scheduler hashes
        beside the compute)."""
        e = self.blocks[i]
        self.checks.read(e, buf[: e.nbytes], self.drop_cache)
        check = (lambda: self.checks.check(e, buf[: e.nbytes])) if self.checks.pending(e) else None
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
        self.checks.check(e, buf)
        return buf

    def block_views(self, buf: torch.Tensor, block: int | None = None) -> dict[str, torch.Tensor]:
        """Block `block`'s tensors as views of buf (its bytes, or a slot's, which may be longer); block
        None: block_specs' layout (a sparse block's where dense layers sit among sparse ones)."""
        return views(buf, self.block_specs if block is None else self.blocks[block].specs)

    def _load(self, e: FileEntry) -> dict[str, torch.Tensor]:
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        self.checks.read(e, buf)
        self.checks.check(e, buf)
        return views(buf, e.specs)

    def load_kept(self, rel: str, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> dict:
        """A file the store keeps beside the model's parts (a vision-language checkpoint's vision tower, tensors
        of any dtype: phantom.convert.visionlanguage), checked as any store file and read whole: only an export
        reads it, a run never opens it."""
        return self._load(self._entry(rel, shapes, dtypes))

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
        out = self.dense_empty(dtype or self.dtype, block=i)
        self.dequantize_block(i, stored, out)
        return out

    def mmap_embed(self) -> torch.Tensor:
        """The embedding table memory-mapped from disk: a lookup touches only the rows it needs."""
        self.checks.check(self.embed)
        spec = self.embed.specs[0]
        path, start = (self.embed.path, self.embed.data_start) if not self.embed.segments else self.embed.segments[0][:2]
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=start + self.embed.nbytes)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        return raw[start + spec.start: start + spec.end].view(spec.dtype).view(spec.shape)

    # -- rewriting a working copy (full finetuning): phantom.files.workingcopy ----------------------

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self.blocks[i] = workingcopy.rewrite(self, block_file(i), tensors)

    def write_head(self, tensors: dict[str, torch.Tensor]) -> None:
        self.head = workingcopy.rewrite(self, "head.safetensors", tensors)

    def write_embed(self, tensors: dict[str, torch.Tensor]) -> None:
        self.embed = workingcopy.rewrite(self, "embed.safetensors", tensors)
