"""Host memory for blocks: exact-size buffers, 4 KiB aligned for O_DIRECT, backed by huge pages from
HUGE_MIN, page-locked for CUDA copies with cudaHostRegister (never the caching host allocator), and
kept out of forked children. The scheduler's RAM tier and staging buffers, the tuner and the
benchmarks allocate through here.
"""
from __future__ import annotations

import logging
import mmap
import weakref

import torch

from phantom.files.tensorfile import DATA_ALIGN

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64; arm64 with 4 KiB base pages)
HUGE_MIN = 16 << 20  # host buffers from this size are backed by huge pages (phantom.files.directio.READ_CHUNK: O_DIRECT)


def huge_page_memory(nbytes: int, dontfork: bool = False) -> torch.Tensor | None:
    """nbytes of fresh anonymous memory, 2 MiB aligned and advised for transparent huge pages, or None
    where the platform has no madvise(MADV_HUGEPAGE) (macOS, Windows). `dontfork`: see mapped_memory.

    Why: an O_DIRECT read DMAs straight into the destination's pages. Over 4 KiB pages scattered in
    physical memory each request is split into many segments (a virtio disk takes 254 a request), and
    the rate depends on how fragmented the buffer happened to be: on the dev VM reads into 4 KiB pages
    ran at 0.8-2.4 GB/s from one buffer to the next, into huge pages at 2.0-2.7 every time
    (notes/bench-tiers.md). Where THP is off ("never") the advice is a no-op: plain pages, as before.
    At most one huge page past nbytes becomes resident (the last one touched).
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    return mapped_memory(nbytes, huge=True, dontfork=dontfork)


def mapped_memory(nbytes: int, huge: bool, dontfork: bool) -> torch.Tensor:
    """nbytes of a fresh anonymous mapping (page aligned; 2 MiB aligned and advised for huge pages when
    `huge`). `dontfork` marks it MADV_DONTFORK: a forked child (a DataLoader worker) gets none of it.
    Pinned memory needs that: drivers pin long-term, and since Linux 5.9 fork copies every pinned
    anonymous page into the child at once (huge pages split first), so each worker would hold a copy
    of the pinned RAM tier."""
    pad = HUGE_PAGE if huge else 0
    mapping = mmap.mmap(-1, max(1, nbytes + pad), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice, wanted in ((getattr(mmap, "MADV_HUGEPAGE", None), huge), (getattr(mmap, "MADV_DONTFORK", None), dontfork)):
        if wanted and advice is not None:
            try:
                mapping.madvise(advice)  # before any page is touched
            except OSError:  # a kernel built without THP (EINVAL): 4 KiB pages, still aligned
                pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped with the last tensor
    skip = -raw.data_ptr() % HUGE_PAGE if huge else 0
    return raw[skip: skip + nbytes]


def aligned_memory(nbytes: int) -> torch.Tensor:
    """nbytes of host memory at a 4 KiB boundary (O_DIRECT's alignment), in the allocator's pages."""
    raw = torch.empty(nbytes + DATA_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DATA_ALIGN
    return raw[skip: skip + nbytes]


class HostBuffer:
    """A host allocation of exactly `nbytes` (4 KiB aligned; huge pages from HUGE_MIN), page-locked for
    CUDA when `pin`, and then marked MADV_DONTFORK (see mapped_memory).

    `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds each
    request up to a power of two (pytorch#150517): 80 blocks of 1.71 GB would pin 160 GiB for 137 GB.
    Here one plain allocation is registered with cudaHostRegister instead, so what is pinned is what
    is needed, and copies from it run at the link's full speed.
    """

    def __init__(self, nbytes: int, pin: bool):
        huge = huge_page_memory(nbytes, dontfork=pin) if nbytes >= HUGE_MIN else None
        if huge is None and pin and hasattr(mmap, "MADV_DONTFORK"):  # a mapping of its own: no fork copies it
            huge = mapped_memory(nbytes, huge=False, dontfork=True)
        self.tensor = huge if huge is not None else aligned_memory(nbytes)  # a view: it keeps the memory
        self.pinned = False
        if pin and nbytes:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (error {int(err)}): "
                                   f"lower the RAM budget (--ram-budget)")
            self.pinned = True
            self._unregister = weakref.finalize(self, cudart.cudaHostUnregister, self.tensor.data_ptr())

    def block(self, offset: int, nbytes: int) -> torch.Tensor:
        """A tensor over bytes [offset, offset + nbytes) that is not a view: it has a version counter
        of its own, so autograd does not see block j's update (full finetuning) as a change of block i."""
        t = torch.empty(0, dtype=torch.uint8)
        return t.set_(self.tensor.untyped_storage(), self.tensor.storage_offset() + offset, (nbytes,))


CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA >= 11.1)


def register_read_only(t: torch.Tensor):
    """Page-lock the pages under a read-only tensor (a file mapping shared by the local ranks) for
    CUDA copies; returns the finalizer that unregisters them, or None where the driver refuses (then
    copies from it stay pageable: slower, correct)."""
    start = t.data_ptr() - t.data_ptr() % DATA_ALIGN
    nbytes = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // DATA_ALIGN) * DATA_ALIGN
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(start, nbytes, CUDA_HOST_REGISTER_READ_ONLY))
    if err != 0:
        log.warning("cudaHostRegister (read-only) of a shared RAM-tier block failed (error %d): its copies "
                    "go through pageable memory", err)
        return None
    return weakref.finalize(t, cudart.cudaHostUnregister, start)
