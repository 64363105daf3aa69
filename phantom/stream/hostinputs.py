"""Block inputs kept in page-locked host memory while a CUDA device computes: long rows.

Under recompute a block keeps only its input for its backward; at long rows those inputs, one (rows, T, dim)
tensor per block, outgrow the device (a 70B at 131072 tokens a row: 80 x 2 GiB in bf16, beside a 24 GB card).
A row the blocks tile (longer than their `mlp_chunk`, phantom.arch.tiled) has each recomputed block's input
copied to page-locked host memory on a side stream as soon as the forward has made it (the device's copy is
freed as the forward moves on), and copied back when the block after it is done with its backward, so the
copy runs while the backward moves on to it. Events order each copy after what made its source and before
what reads its destination; record_stream keeps the caching allocator from giving a source's memory to
another tensor while a copy still reads it. On a CPU the inputs are in host memory already: nothing moves.
The cost model counts the same rule (phantom.plan.costmodel.inputs_on_host).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from phantom.stream.hostmem import HostBuffer


def to_host(inputs: "HostInputs | None", x: torch.Tensor, chunk: int | None) -> "HostCopy | None":
    """A recomputed block's input x (B, T, dim) on its way to host memory where its row is tiled (longer than the
    block's chunk) and `inputs` is a CUDA run's; None: x is saved where it is."""
    if inputs is None or not x.is_cuda or x.dim() != 3 or not chunk or x.shape[1] <= chunk:
        return None
    return inputs.put(x)


class HostCopy:
    """One block input in host memory (`host`, a view of a pooled page-locked buffer), the event its copy there
    records, and once asked for, its way back (`back`: the device tensor and the event its copy records).
    `before`: the input saved before it (weakly), the next one a backward reads: the block before in the same
    pass, or the last block of the pass before (one backward over two passes runs the later one first)."""

    def __init__(self, host: torch.Tensor, done, before: Callable[[], "HostCopy | None"]):
        self.host, self.done, self.back, self.before = host, done, None, before


class HostInputs:
    """The side stream and the pool of page-locked buffers the inputs of a CUDA run's blocks pass through."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool: list[HostBuffer] = []  # buffers no input holds: registering page-locked memory is slow
        self.last: Callable[[], HostCopy | None] = lambda: None  # the input saved last (weakly)

    @classmethod
    def on(cls, device: torch.device | None) -> "HostInputs | None":
        """A CUDA device's; None elsewhere (a CPU's inputs are in host memory already)."""
        return cls(device) if device is not None and device.type == "cuda" else None

    def put(self, x: torch.Tensor) -> HostCopy:
        """x (made on the current stream) on its way to host memory; the caller drops its device copy."""
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(made)
        buf = self._buffer(x.numel() * x.element_size())
        host = buf.tensor[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        with torch.cuda.stream(self.stream):
            host.copy_(x, non_blocking=True)
        x.record_stream(self.stream)  # its memory is not handed out again before the copy has read it
        done = torch.cuda.Event()
        done.record(self.stream)
        copy = HostCopy(host, done, self.last)
        weakref.finalize(copy, self.pool.append, buf)  # back to the pool with the last reference to the copy
        self.last = weakref.ref(copy)
        return copy

    def fetch(self, copy: HostCopy | None) -> None:
        """Start copy's way back to the device, after its way out (the same stream), unless started."""
        if copy is None or copy.back is not None:
            return
        with torch.cuda.stream(self.stream):
            dev = torch.empty(copy.host.shape, dtype=copy.host.dtype, device=self.device)
            dev.copy_(copy.host, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record(self.stream)
        copy.back = (dev, arrived)

    def take(self, copy: HostCopy) -> torch.Tensor:
        """copy's input on the device, for the current stream (which waits for it to arrive); the copy saved
        before it starts its way back once this block's backward is done (`fetch_next`)."""
        self.fetch(copy)
        dev, arrived = copy.back
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(arrived)
        dev.record_stream(compute)  # made on the side stream, read on this one
        copy.back = None
        return dev

    def fetch_next(self, copy: HostCopy) -> None:
        """The input the backward reads next (saved before copy) on its way to the device."""
        self.fetch(copy.before())

    def _buffer(self, nbytes: int) -> HostBuffer:
        """The smallest pooled buffer that holds nbytes, else a new one (pooled ones too small for the rows
        now run are freed first, after the side stream's copies from them are done)."""
        fits = [b for b in self.pool if b.tensor.numel() >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.tensor.numel())
            self.pool.remove(buf)
            return buf
        if self.pool:
            self.stream.synchronize()
            self.pool.clear()
        return HostBuffer(nbytes, pin=True)
