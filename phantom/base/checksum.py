"""Checksums of store files: sha256 of every byte, and crc32 of fixed-size pieces that the reads
themselves check as the bytes land (ISA-L's crc32 where the isal package is installed, zlib's
otherwise: the same values). `CRC32_IMPLS` names each implementation, so a store can be read with
either (`BlockStore(..., crc32="zlib")`: benchmarks compare them).
"""
from __future__ import annotations

import hashlib
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

CHECK_CHUNK = 16 << 20  # verify "fast": one crc32 per this many bytes of a file's data section (see Checksums)
CHECK_THREADS = 2  # crc32 of a block's chunks in parallel where the read did not hash them (crc32_chunks)
CRC32_IMPLS: dict[str, Callable] = {"zlib": zlib.crc32}
try:  # ISA-L's crc32 (isal, a dependency): zlib's values, several times faster; both release the GIL
    from isal.isal_zlib import crc32 as _isal_crc32
    CRC32_IMPLS["isal"] = _isal_crc32
except ImportError:
    pass
CRC32 = "isal" if "isal" in CRC32_IMPLS else "zlib"  # the fastest here: what reads use by default
crc32 = CRC32_IMPLS[CRC32]


def crc32_impl(name: str | None) -> Callable:
    """The crc32 function of that name (None: the default, CRC32)."""
    if name is None:
        return crc32
    if name not in CRC32_IMPLS:
        raise ValueError(f"crc32 implementation {name!r} is not available here (have: {', '.join(CRC32_IMPLS)})")
    return CRC32_IMPLS[name]


# A file's manifest entry carries two checksums of the same bytes:
#   "sha256": of the whole file (a linked file: of its data section). verify "full" checks it, and
#       verify "fast" does on stores written before "crc32" was recorded (they open and verify as ever).
#   "crc32": {"chunk": C, "header": crc32 of the bytes before the data section (absent for a linked
#       file, which has no header of its own), "data": [crc32 of data bytes [k*C, (k+1)*C), for every k]}:
#       what verify "fast" checks on a file's first read. crc32 releases the GIL and is cheaper than
#       sha256, ISA-L's far cheaper where `isal` is installed (same values; one core of the AMD EPYC of
#       notes/bench-tiers.md, 256 MiB: sha256 1.8 GB/s, zlib 2.9-4.2, isal 17-28): each read request's
#       thread hashes its pieces as they land, beside the requests still in flight (phantom.files.directio.readinto_exact), so
#       checking takes a fraction of the CPU that sha256 took from the compute. Linked files, and mapped
#       ones, are hashed after the read, their pieces in parallel (crc32_chunks).
# crc32 finds every error burst of up to 32 bits and other damage but for a 2^-32 chance per chunk; it
# is no defence against deliberate tampering (sha256, verify "full", is).


class Checksums:
    """A file's checksums as it is written: sha256 of every byte (unless sha256=False), crc32 of the
    header (bytes given to update_header) and of each `chunk` bytes of the data (given to update)."""

    def __init__(self, chunk: int | None = None, sha256: bool = True, crc: Callable | None = None):
        self.sha = hashlib.sha256() if sha256 else None
        self.crc = crc or crc32
        self.chunk, self.header, self.data = chunk or CHECK_CHUNK, None, []
        self._crc, self._fill = 0, 0

    def update_header(self, b) -> None:
        if self.sha is not None:
            self.sha.update(b)
        self.header = self.crc(b, self.header or 0)

    def update(self, b) -> None:
        if self.sha is not None:
            self.sha.update(b)
        mv = memoryview(b).cast("B")
        while len(mv):
            take = min(self.chunk - self._fill, len(mv))
            self._crc = self.crc(mv[:take], self._crc)
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
_pool_lock = threading.Lock()


def crc32_chunks(mv: memoryview, chunk: int, crc: Callable | None = None) -> list[int]:
    """crc32 of each `chunk` bytes of mv (the last piece may be shorter), CHECK_THREADS at once."""
    global _check_pool
    crc = crc or crc32
    pieces = [mv[a:a + chunk] for a in range(0, len(mv), chunk)]
    if len(pieces) <= 1 or CHECK_THREADS <= 1:
        return [crc(p) for p in pieces]
    with _pool_lock:
        if _check_pool is None:
            _check_pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="phantom-crc32")
    return list(_check_pool.map(crc, pieces))
