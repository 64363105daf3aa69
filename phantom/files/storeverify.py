"""Checking a store's files against their manifest records, each file once: apart from the reader
because when and how a file is checked (its first read, beside the compute, on open) is a policy
of its own, with three modes and two kinds of record.

A file's crc32 record (chunked, so a check can run in parallel or as the read lands) is checked
under verify "fast"; its sha256 where the manifest has no crc32 record (an older store) or under
"full"; "none" checks nothing. A linked file's records are of its data section alone.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from phantom.base.checksum import Checksums, crc32_chunks
from phantom.files.directio import readinto_exact
from phantom.files.storeformat import FileEntry, between
from phantom.files.storelinks import segment_pieces, segments_digest
from phantom.files.tensorfile import StoreError

MODES = ("fast", "full", "none")


class Verifier:
    """A store's checks: the mode, the crc32 implementation, and the files already checked.

    Args:
        mode: "fast", "full" or "none" (see phantom.files.store.BlockStore).
        crc: the crc32 function (phantom.base.checksum.crc32_impl).
    """

    def __init__(self, mode: str, crc):
        if mode not in MODES:
            raise ValueError(f"verify must be fast, full or none, not {mode!r}")
        self.mode, self.crc = mode, crc
        self.checked: set[str] = set()
        self.partial: dict[str, set] = {}  # a file read routed: its experts (ids) and "rest" checked so far

    def pending(self, e: FileEntry) -> bool:
        """Whether e still has a check to pass."""
        return self.mode != "none" and str(e.path) not in self.checked

    def routable(self, e: FileEntry) -> bool:
        """Whether a read of some of e's experts (and the rest of its bytes) can be checked by itself, so a
        routed read need not read the file whole first: verify "fast" and the manifest records a crc32 of
        each expert and of the rest (stores written before it was recorded read whole once)."""
        return self.mode == "fast" and bool(e.experts) and e.rest_crc is not None

    def check_pieces(self, e: FileEntry, buf: torch.Tensor, ranges) -> None:
        """Check what a routed read put into buf (e's data section offsets): every expert whose range `ranges`
        cover, and the rest of the bytes where they cover it all, each once a run; the file counts as
        checked once all of it has been. Nothing to do for a file already checked or not `routable`.

        Raises:
            StoreError: an expert's bytes, or the rest's, differ from the manifest's crc32."""
        if not self.pending(e) or not self.routable(e):
            return
        done = self.partial.setdefault(str(e.path), set())
        covered = lambda a, b: any(x <= a and b <= y for x, y in ranges)  # noqa: E731
        for x, ((a, b), want) in enumerate(e.experts):
            if x not in done and covered(a, b):
                if self.crc(memoryview(buf[a:b].numpy()).cast("B")) != want:
                    raise StoreError(f"{e.path}: expert {x}'s bytes {a}..{b} differ from their crc32 in the manifest "
                                     f"(changed or damaged since written); prepare the store again")
                done.add(x)
        rest = between([r for r, _ in e.experts], e.nbytes)
        if "rest" not in done and all(covered(a, b) for a, b in rest):
            got = 0
            for a, b in rest:
                got = self.crc(memoryview(buf[a:b].numpy()).cast("B"), got)
            if got != e.rest_crc:
                raise StoreError(f"{e.path}: its bytes outside the experts differ from their crc32 in the manifest "
                                 f"(changed or damaged since written); prepare the store again")
            done.add("rest")
        if len(done) == len(e.experts) + 1:
            self.checked.add(str(e.path))

    def mark(self, path: Path) -> None:
        """path holds bytes phantom just wrote: nothing to check."""
        self.checked.add(str(path))

    def read(self, e: FileEntry, buf: torch.Tensor, drop_cache: bool = False) -> None:
        """A file's data section into buf: one read, or one per linked range. Under verify "fast" a
        file with a crc32 record is checked by the read itself on its first read (readinto_exact)."""
        if self.mode == "fast" and e.crc is not None and not e.segments and str(e.path) not in self.checked:
            self._compare(e, readinto_exact(e.path, e.data_start, buf, drop_cache, crc_chunk=e.crc[0], crc=self.crc))
            self.checked.add(str(e.path))
            return
        pos = 0
        for path, offset, n in e.segments or ((e.path, e.data_start, e.nbytes),):
            readinto_exact(path, offset, buf[pos:pos + n], drop_cache)
            pos += n

    def check(self, e: FileEntry, data: torch.Tensor | None = None) -> None:
        """Check a file's checksum (data, if given, is its data section in memory): under verify "fast"
        its crc32 record where the manifest has one, else its sha256 (see Checksums)."""
        if not self.pending(e):
            return
        if self.mode == "fast" and e.crc is not None:
            self._check_crc(e, data)
        elif e.segments:  # linked: the hash is of the data section alone
            raw = memoryview(data.numpy()).cast("B") if data is not None else None
            if (hashlib.sha256(raw).hexdigest() if raw is not None else segments_digest(e.segments)) != e.sha256:
                files = sorted({str(p) for p, _, _ in e.segments})
                raise StoreError(f"{e.path}: checksum mismatch in its linked files {files} (changed since the "
                                 f"store was made; re-create the store)")
        elif self._sha256(e, data) != e.sha256:
            raise StoreError(f"{e.path}: checksum mismatch (the file is corrupt; re-create the store)")
        self.checked.add(str(e.path))

    @staticmethod
    def _sha256(e: FileEntry, data: torch.Tensor | None) -> str:
        """The whole file's sha256 (its header read again when its data section is in memory)."""
        h = hashlib.sha256()
        with open(e.path, "rb") as f:
            if data is None:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            else:
                h.update(f.read(e.data_start))
                h.update(memoryview(data.numpy()).cast("B"))
        return h.hexdigest()

    def _check_crc(self, e: FileEntry, data: torch.Tensor | None) -> None:
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
        self._compare(e, got)

    def _compare(self, e: FileEntry, got: list[int]) -> None:
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
