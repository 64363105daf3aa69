"""Every block's generation cache for one batch of sequences, each block's on the device where the budget holds
it and in host memory where not, as blocks are kept by budget.

A host block's cache comes to the device with the block that uses it: a small ring of device buffers (two per
cache shape) is filled on a copy stream from page-locked host memory, the next host block's while this one
computes, and after the block the columns it wrote (a Gated DeltaNet layer's whole state) go back to the host on
the same stream. The compute stream waits for each upload by an event; a write-back waits for the compute by
another; the host touches a cache only after the copy stream has drained (`keep`). On a CPU the device is the
host: every cache stays where it is, nothing is copied.
"""
from __future__ import annotations

import contextlib
import math

import torch

from phantom.arch.config import ModelConfig
from phantom.arch.ops import KVCache
from phantom.stream.hostmem import HostBuffer


class CacheSet:
    """The caches of `batch` sequences of up to `max_len` tokens over every block of cfg.

    Args:
        device_budget: device bytes the caches may take (None: all of them on the device). Blocks take them in
            order until the next does not fit; the rest are host blocks (page-locked on CUDA).
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 device_budget: int | None = None):
        self.cfg, self.device = cfg, torch.device(device)
        self.caches: list[KVCache] = []
        self.on_host: list[bool] = []
        self._buffers: list[HostBuffer] = []  # what keeps the host caches' memory (and its registration)
        used, cuda = 0, self.device.type == "cuda"
        for i in range(cfg.n_layers):
            nbytes = KVCache.nbytes(cfg, batch, max_len, dtype, i)
            host = device_budget is not None and (used + nbytes > device_budget or any(self.on_host))
            used += 0 if host else nbytes
            self.on_host.append(host)
            self.caches.append(KVCache(*(self._alloc(shape, d, host, cuda)
                                         for shape, d in KVCache.layout(cfg, batch, max_len, dtype, i))))
        self.host_blocks = [i for i, h in enumerate(self.on_host) if h]
        self.device_bytes = used
        self.copy_stream = torch.cuda.Stream(self.device) if cuda and self.host_blocks else None
        self._ring: dict[tuple, list[KVCache]] = {}  # a cache shape's two device buffers, made here (this stream's)
        for i in self.host_blocks:
            host = self.caches[i]
            if _key(host) not in self._ring:
                self._ring[_key(host)] = [KVCache(torch.empty_like(host.k, device=self.device),
                                                  torch.empty_like(host.v, device=self.device)) for _ in range(2)]
        self._turn: dict[tuple, int] = {}  # which of them the next upload of that shape fills
        self._ready: dict[int, tuple[KVCache, object]] = {}  # host block -> (its device copy, upload event)

    def _alloc(self, shape: tuple, dtype: torch.dtype, host: bool, cuda: bool) -> torch.Tensor:
        if not host:
            return torch.zeros(shape, device=self.device, dtype=dtype)
        if not cuda:
            return torch.zeros(shape, dtype=dtype)
        buf = HostBuffer(math.prod(shape) * dtype.itemsize, pin=True)
        self._buffers.append(buf)
        return buf.tensor.view(dtype).view(shape).zero_()

    def __len__(self) -> int:
        return len(self.caches)

    def __getitem__(self, i: int) -> KVCache:
        return self.caches[i]

    @contextlib.contextmanager
    def use(self, i: int, start_pos: int, n_new: int):
        """Block i's cache on the device while its block writes columns start_pos..+n_new and reads those
        before: the cache itself, or a host block's uploaded copy, its new columns written back after."""
        if not self.on_host[i]:
            yield self.caches[i]
            return
        length = start_pos + n_new
        if self.copy_stream is None:  # a CPU: the host is the device, the copy a plain one
            on_device = self._upload(i, start_pos)
            yield on_device
            self._write_back(i, on_device, start_pos, length)
            return
        if i not in self._ready:
            self._prefetch(i, start_pos)
        on_device, uploaded = self._ready.pop(i)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(uploaded)
        later = [j for j in self.host_blocks if j > i]
        if later:  # the next host block's cache comes up while this one computes
            self._prefetch(later[0], start_pos)
        yield on_device
        computed = torch.cuda.Event()
        computed.record(compute)
        self.copy_stream.wait_event(computed)
        with torch.cuda.stream(self.copy_stream):
            self._write_back(i, on_device, start_pos, length)

    def _prefetch(self, i: int, start_pos: int) -> None:
        with torch.cuda.stream(self.copy_stream):
            on_device = self._upload(i, start_pos)
            uploaded = torch.cuda.Event()
            uploaded.record(self.copy_stream)
        self._ready[i] = (on_device, uploaded)

    def _upload(self, i: int, start_pos: int) -> KVCache:
        """Block i's cache copied into a device buffer of its shape (the columns before start_pos: the block
        writes the next ones itself and reads no later one), non-blocking from page-locked memory."""
        host, linear = self.caches[i], self.cfg.linear(i)
        key = _key(host)
        turn = self._turn.get(key, 0)
        self._turn[key] = 1 - turn
        buf = self._ring[key][turn]
        B = host.k.shape[0]
        if linear:
            buf.k[:B].copy_(host.k, non_blocking=True)
            buf.v[:B].copy_(host.v, non_blocking=True)
            return KVCache(buf.k[:B], buf.v[:B])
        cols = slice(0, start_pos)
        buf.k[:B, :, cols].copy_(host.k[:, :, cols], non_blocking=True)
        buf.v[:B, :, cols].copy_(host.v[:, :, cols], non_blocking=True)
        return KVCache(buf.k[:B], buf.v[:B])

    def _write_back(self, i: int, on_device: KVCache, start_pos: int, length: int) -> None:
        host = self.caches[i]
        if self.cfg.linear(i):
            host.k.copy_(on_device.k, non_blocking=True)
            host.v.copy_(on_device.v, non_blocking=True)
            return
        new = slice(start_pos, length)
        host.k[:, :, new].copy_(on_device.k[:, :, new], non_blocking=True)
        host.v[:, :, new].copy_(on_device.v[:, :, new], non_blocking=True)

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows (sequences) from now on, in every block's cache; a host cache is compacted in place
        (it stays page-locked) once the copy stream's write-backs have landed."""
        if self.copy_stream is not None:
            drained = torch.cuda.Event()
            drained.record(self.copy_stream)
            drained.synchronize()
        for c, host in zip(self.caches, self.on_host):
            c.keep(rows if not host else rows.cpu())


def _key(c: KVCache) -> tuple:
    """A cache's shape and dtypes but its rows (they only shrink: a buffer of the first rows serves later steps)."""
    return tuple(c.k.shape[1:]), tuple(c.v.shape[1:]), c.k.dtype, c.v.dtype


def block_cache(caches, i: int, start_pos: int, n_new: int):
    """Block i's cache on the device for one call (a CacheSet's `use`; a plain list's item as it is)."""
    if isinstance(caches, CacheSet):
        return caches.use(i, start_pos, n_new)
    return contextlib.nullcontext(caches[i])
