"""Direct reads: a byte range of a file into an aligned host buffer with several requests in flight,
O_DIRECT where the filesystem allows it (no page-cache copy; a model larger than RAM does not evict
everything else), each request's thread hashing its pieces as they land.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from phantom.base import checksum
from phantom.files.tensorfile import DATA_ALIGN, StoreError

log = logging.getLogger(__name__)

READ_CHUNK = 16 << 20  # bytes per read request; several are in flight at once
READ_THREADS = 8  # requests in flight, all loaders together (a deep queue rides out threads waiting for a CPU)

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


def _pread_exact(fd: int, mv: memoryview, offset: int, path: Path, crc_chunk: int = 0,
                 crc: Callable = checksum.crc32) -> list[int] | None:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if not n:
            raise StoreError(f"{path}: truncated while reading ({got} of {len(mv)} bytes at offset {offset})")
        got += n
    if crc_chunk:  # hashed by this request's thread while the other requests are still in flight
        return [crc(mv[a:a + crc_chunk]) for a in range(0, len(mv), crc_chunk)]
    return None


def _read_jobs(jobs: list[tuple[int, int, int, int, int]], mv: memoryview, path: Path,
               crc: Callable = checksum.crc32) -> list:
    """Run (fd, file offset, start, end, crc_chunk) reads into mv[start:end], in parallel; every read has
    ended before an error is raised, so a caller may reuse (or re-read into) the buffer at once. Returns
    each job's crc32s."""
    if len(jobs) == 1:
        fd, off, a, b, c = jobs[0]
        return [_pread_exact(fd, mv[a:b], off, path, c, crc)]
    futures = [_pool().submit(_pread_exact, f, mv[a:b], off, path, c, crc) for f, off, a, b, c in jobs]
    errors = [fut.exception() for fut in futures]
    if err := next((e for e in errors if e is not None), None):
        raise err
    return [fut.result() for fut in futures]


@contextlib.contextmanager
def _opened(path: Path, direct: bool, drop_cache: bool):
    """A buffered descriptor of path and, where `direct` and the filesystem allows, an O_DIRECT one (else
    None), both closed at the end; with drop_cache the file's pages leave the page cache after the reads."""
    dfd = _open_direct(Path(path)) if direct else None
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, dfd
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)


def _refused(e: OSError, dfd: int | None, path: Path) -> None:
    """Re-raise e unless it is O_DIRECT refused by reads its open accepted (some FUSE, network filesystems):
    then remember that filesystem reads through the page cache."""
    if dfd is None or e.errno != errno.EINVAL:
        raise e
    log.info("%s: O_DIRECT reads refused (%s); reading through the page cache", path, e)
    _direct_ok[os.fstat(dfd).st_dev] = False


def readinto_exact(path: Path, offset: int, buf: torch.Tensor, drop_cache: bool = False,
                   direct: bool = True, crc_chunk: int = 0, crc: Callable | None = None) -> list[int] | None:
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
    `crc`: the crc32 function (default: phantom.base.checksum.crc32, the fastest here).
    """
    crc = crc or checksum.crc32
    mv = memoryview(buf.numpy()).cast("B")
    n = len(mv)
    if crc_chunk and (crc_chunk % DATA_ALIGN or crc_chunk > READ_CHUNK):
        readinto_exact(path, offset, buf, drop_cache, direct)
        return checksum.crc32_chunks(mv, crc_chunk, crc)
    step = READ_CHUNK // crc_chunk * crc_chunk if crc_chunk else READ_CHUNK  # requests hold whole pieces
    aligned = (n // DATA_ALIGN * DATA_ALIGN) if direct and offset % DATA_ALIGN == 0 and \
        buf.data_ptr() % DATA_ALIGN == 0 else 0
    with _opened(path, aligned >= READ_CHUNK, drop_cache) as (fd, dfd):
        if dfd is None:
            aligned = 0
        tail = 0 < aligned < n  # the last few bytes past O_DIRECT's reach, hashed below onto their piece's crc32
        jobs = [(dfd, offset + a, a, min(a + step, aligned), crc_chunk) for a in range(0, aligned, step)]
        jobs += [(fd, offset + a, a, min(a + step, n), 0 if tail else crc_chunk) for a in range(aligned, n, step)]
        try:
            sums = _read_jobs(jobs, mv, path, crc)
        except OSError as e:  # open accepted O_DIRECT but reads refuse it (some FUSE, network filesystems)
            _refused(e, dfd, path)
            sums, tail = _read_jobs([(fd, offset + a, a, min(a + step, n), crc_chunk) for a in range(0, n, step)],
                                    mv, path, crc), False
    if not crc_chunk:
        return None
    crcs = [c for job in sums if job for c in job]
    if tail:  # under 4 KiB, inside one piece (pieces are 4 KiB multiples): continue that piece's crc32
        if aligned % crc_chunk:
            crcs[-1] = crc(mv[aligned:], crcs[-1])
        else:
            crcs.append(crc(mv[aligned:]))
    return crcs


def readinto_pieces(path: Path, pieces, buf: torch.Tensor, drop_cache: bool = False) -> None:
    """Read many byte ranges of one file into a contiguous CPU uint8 tensor: pieces are (file offset,
    start, end), file[offset : offset + end - start] -> buf[start:end]. A routed expert read is dozens of
    ranges of a few hundred KiB each; one descriptor serves them all, every 4 KiB-aligned part is read with
    O_DIRECT (a buffered read of such a range pulls its readahead in too, then drop_cache evicts the whole
    file once per range), and the requests run READ_THREADS at a time on the shared pool."""
    mv = memoryview(buf.numpy()).cast("B")
    base = buf.data_ptr()
    with _opened(path, any(e - s >= DATA_ALIGN for _, s, e in pieces), drop_cache) as (fd, dfd):
        jobs = []
        for off, s, e in pieces:
            lo = s + (-off % DATA_ALIGN)  # the first buffer index whose file offset is aligned
            hi = lo + (e - lo) // DATA_ALIGN * DATA_ALIGN if lo < e else lo
            if dfd is None or (base + lo) % DATA_ALIGN or hi <= lo:
                jobs.append((fd, off, s, e, 0))
                continue
            jobs += [(fd, off, s, lo, 0)] if lo > s else []
            jobs += [(dfd, off + a - s, a, min(a + READ_CHUNK, hi), 0) for a in range(lo, hi, READ_CHUNK)]
            jobs += [(fd, off + hi - s, hi, e, 0)] if e > hi else []
        try:
            _read_jobs(jobs, mv, path)
        except OSError as err:
            _refused(err, dfd, path)
            _read_jobs([(fd, off, s, e, 0) for off, s, e in pieces], mv, path)
