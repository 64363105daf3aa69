"""Linked files (prepare_model.py --link): a store that leaves tensors where they are, inside a
checkpoint's safetensors files, instead of copying them. Apart from the store because both its writer
(the record) and its reader (the checks on open) follow the same rules, kept here in one place.

The manifest's "links" section holds:
  "sources": {file: {"size", "header_sha256"}}: every file linked from. A file is an absolute path
      (a checkpoint's file, resolved when the store was made) or a path inside the store (safe_join
      rules). Absolute paths are allowed here and nowhere else in a manifest.
  "files": {store file: {"size", "sha256", "crc32", "tensors": [{"name", "dtype", "shape", "file",
      "offset"}]}}: a store file that is not on disk; its data section is its tensors' byte ranges, in order.
On open, each source must be a well-formed safetensors file with the recorded size and header hash
(so the recorded offsets still hold); a linked file's sha256 and crc32 record (no "header") are of its
data section, checked as any file's (phantom.files.storeverify). Sources are only ever read. A name in
"files" takes precedence over a link of the same name.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import torch

from phantom.arch.moe import expert_ranges
from phantom.base.checksum import Checksums
from phantom.files.storeformat import (MANIFEST, FileEntry, crc_record, expert_entries, expert_record, rest_entry,
                                       safe_join)
from phantom.files.tensorfile import (
    CODE_DTYPES,
    DTYPE_CODES,
    StoreError,
    TensorSpec,
    check_disjoint,
    check_specs,
    experts_together,
    header_digest,
    read_header,
    segment_pieces,
    tensor_order,
)


def segments_digest(segments) -> str:
    """sha256 of the bytes of (file, offset, nbytes) ranges, concatenated."""
    h = hashlib.sha256()
    for chunk in segment_pieces(segments):
        h.update(chunk)
    return h.hexdigest()


# -- writing: the records -----------------------------------------------------------------------

def _source(folder: Path, name: str) -> Path:
    return Path(name) if os.path.isabs(name) else folder / name


def add_sources(sources: dict[str, dict], located: dict[str, tuple], folder: Path) -> None:
    """Record the size and header hash of each file `located` reads from that `sources` lacks (a name
    inside the store is relative to folder, the store being written)."""
    for name in {v[0] for v in located.values()} - set(sources):
        path = _source(folder, name)
        sources[name] = {"size": path.stat().st_size, "header_sha256": header_digest(path)}


def file_record(located: dict[str, tuple], folder: Path, n_experts: int = 0) -> dict:
    """The "files" record of one linked file: its tensors' ranges in the order write_safetensors
    writes them, the checksums of the data they make, and (n_experts) each expert's byte range in it.

    Args:
        located: name -> (file (absolute, or inside folder), byte offset, dtype, shape).
        folder: the store being written.
        n_experts: a mixture-of-experts block's experts (0: none).
    """
    itemsize = {n: v[2].itemsize for n, v in located.items()}
    order = experts_together(tensor_order(itemsize), {n: v[2].itemsize * math.prod(v[3]) for n, v in located.items()},
                             itemsize)  # as write_safetensors orders
    segments = [(_source(folder, located[n][0]), located[n][1], located[n][2].itemsize * math.prod(located[n][3]))
                for n in order]
    sums = Checksums()
    for piece in segment_pieces(segments):
        sums.update(piece)
    record = {"size": sum(n for _, _, n in segments), **sums.record(),
              "tensors": [{"name": n, "dtype": DTYPE_CODES[located[n][2]], "shape": list(located[n][3]),
                           "file": located[n][0], "offset": located[n][1]} for n in order]}
    if n_experts:  # each expert's range in the assembled data
        pos, specs = 0, []
        for name, (_, _, n) in zip(order, segments):
            specs.append(TensorSpec(name, located[name][2], tuple(located[name][3]), pos, pos + n))
            pos += n
        try:
            ranges = expert_ranges(specs, n_experts)
        except ValueError:  # quantized experts whose parts experts_together could not keep together: read whole
            if len(set(itemsize.values())) == 1:
                raise
            return record
        record.update(expert_record(ranges, lambda a, b: segments_read(segments, a, b), pos))
    return record


def segments_read(segments, a: int, b: int) -> bytes:
    """Bytes [a, b) of the data that segments ((file, offset, nbytes) ranges, in order) assemble."""
    out, pos = [], 0
    for path, offset, n in segments:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            with open(path, "rb") as f:
                f.seek(offset + lo - pos)
                out.append(f.read(hi - lo))
        pos += n
    return b"".join(out)


# -- reading: the checks ------------------------------------------------------------------------

class LinkedFiles:
    """The linked files of an open store: each as a FileEntry of byte ranges, each source checked once.

    Args:
        path: the store folder.
        manifest: its manifest (read live: a working copy's rewrite drops a link it replaced).
    """

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self._sources: dict[str, Path] = {}

    def has(self, rel: str) -> bool:
        return rel in self.manifest.get("links", {}).get("files", {})

    def entry(self, rel: str, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
              dtypes: dict[str, torch.dtype] | None = None) -> FileEntry:
        """A file that the manifest's "links" section assembles from byte ranges of (checked) safetensors
        files; its tensors must be expected's, in dtype (dtypes: each stored part's, in a shipped format)."""
        info, specs, segments, pos, ranges = self.manifest["links"]["files"][rel], [], [], 0, {}
        try:
            for t in info["tensors"]:
                dt, shape = CODE_DTYPES[t["dtype"]], tuple(int(x) for x in t["shape"])
                n = dt.itemsize * math.prod(shape)
                specs.append(TensorSpec(t["name"], dt, shape, pos, pos + n))
                path, offset = self.source(t["file"]), int(t["offset"])
                if offset < 0 or offset + n > path.stat().st_size:
                    raise StoreError(f"{path}: linked tensor {t['name']} lies outside the file")
                ranges.setdefault(path, []).append((t["name"], offset, offset + n))
                if segments and segments[-1][0] == path and segments[-1][1] + segments[-1][2] == offset:
                    segments[-1] = (path, segments[-1][1], segments[-1][2] + n)  # adjacent: one read
                else:
                    segments.append((path, offset, n))
                pos += n
            sha256 = str(info["sha256"])
            crc = crc_record(self.path / MANIFEST, rel, info, pos, header=False)
            for path, r in ranges.items():
                check_disjoint(path, sorted(r, key=lambda x: x[1:]))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"{self.path / MANIFEST}: bad links entry for {rel} ({type(e).__name__}: {e})") from None
        check_specs(self.path / rel, specs, expected, dtype, dtypes)
        return FileEntry(self.path / rel, specs, 0, pos, sha256, tuple(segments), crc,
                         expert_entries(self.path / MANIFEST, rel, info, pos), rest_entry(self.path / MANIFEST, rel, info))

    def source(self, name: str) -> Path:
        """A linked file, checked once: listed in links.sources, absolute or inside the store, same size
        and header as when the store was made, and a well-formed safetensors file."""
        if name in self._sources:
            return self._sources[name]
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
        self._sources[name] = path
        return path
