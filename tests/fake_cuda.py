"""A recording stand-in for CUDA on a machine without one: pins what the CUDA path asks of streams,
events, copies and pinned memory.

`FakeCuda` replaces torch.cuda's streams, events, `current_stream`, `stream()`, `synchronize`,
`mem_get_info` and cudart's host registration by recorders, and (in the thread that enters it) maps
every tensor asked for on "cuda" to host memory with a TorchFunctionMode, so the real code runs its
CUDA branches on real values. Each call lands in `log` as a tuple whose first item names it:

    ("copy", dst, src, non_blocking, stream)   a Tensor.copy_ / Tensor.to across "devices"
    ("record", event, stream)                  Event.record
    ("wait_event", stream, event)              Stream.wait_event
    ("wait_stream", stream, other)             Stream.wait_stream
    ("event_sync", event) / ("stream_sync", stream) / ("device_sync",)   host waits
    ("register", ptr, nbytes, flags) / ("unregister", ptr)              cudaHostRegister / Unregister
    ("set_device", device, thread name)         torch.cuda.set_device
    ("h2d_value", name, stream)                 torch.tensor(..., device="cuda"): a blocking upload
    ("op", name, stream)                        any other torch call, with the stream it was issued on

Inside `tensors_to_host()` a tensor's `.device` and `.is_cuda` say where it was asked for (`fc.on_cuda(t)`),
while its bytes are in host memory.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode


class FakeStream:
    def __init__(self, fc: "FakeCuda", name: str):
        self.fc, self.name = fc, name

    def wait_event(self, event):
        self.fc.log.append(("wait_event", self, event))

    def wait_stream(self, other):
        self.fc.log.append(("wait_stream", self, other))

    def synchronize(self):
        self.fc.log.append(("stream_sync", self))

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, fc: "FakeCuda"):
        self.fc, self.stream = fc, None

    def record(self, stream=None):
        self.stream = stream or self.fc.current_stream()
        self.fc.log.append(("record", self, self.stream))

    def synchronize(self):
        self.fc.log.append(("event_sync", self))

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _Cudart:
    def __init__(self, fc: "FakeCuda"):
        self.fc = fc

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.fc.log.append(("register", ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.fc.log.append(("unregister", ptr))
        return 0


def _is_cuda(d) -> bool:
    return (isinstance(d, torch.device) and d.type == "cuda") or (isinstance(d, str) and d.startswith("cuda"))


class _ToHost(TorchFunctionMode):
    """Every tensor asked for on cuda is made in host memory and remembered as a cuda one."""

    def __init__(self, fc: "FakeCuda"):
        super().__init__()
        self.fc = fc

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        fc = self.fc
        if func is torch.device:
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device:  # what the code sees: the device it asked for
            return torch.device("cuda", 0) if fc.on_cuda(args[0]) else func(*args)
        if owner is torch.Tensor.is_cuda:
            return fc.on_cuda(args[0])
        to_cuda = any(_is_cuda(a) for a in args[1:]) or _is_cuda(kwargs.get("device"))
        args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        name = getattr(func, "__name__", str(func))
        if name == "to":
            src = args[0]
            out = func(*args, **kwargs)
            dst_cuda = to_cuda or (fc.on_cuda(src) and not _names_host(args[1:], kwargs))
            if dst_cuda != fc.on_cuda(src):  # a copy between host and device
                out = out.clone() if out is src else out
                fc.log.append(("copy", out, src, bool(kwargs.get("non_blocking", False)), fc.current_stream()))
            if dst_cuda:
                fc.mark(out)
            return out
        out = func(*args, **kwargs)
        if to_cuda and name in ("tensor", "as_tensor"):  # a blocking copy of host values
            fc.log.append(("h2d_value", name, fc.current_stream()))
        if name == "copy_":
            fc.log.append(("copy", args[0], args[1], bool(kwargs.get("non_blocking", len(args) > 2 and args[2])),
                           fc.current_stream()))
        else:
            fc.log.append(("op", name, fc.current_stream()))
            if to_cuda or (isinstance(out, torch.Tensor) and any(fc.on_cuda(a) for a in _tensors(args))):
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        fc.mark(t)
        return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def _names_host(args, kwargs) -> bool:
    d = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str))), None))
    return d is not None and torch.device(d).type == "cpu"


def _tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


class FakeCuda:
    """Use as a pytest fixture through `fake_cuda(monkeypatch)`; see the module docstring."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        self.default = FakeStream(self, "default")
        self._local = threading.local()
        self._cuda_ptrs: set[int] = set()
        self._keep = weakref.WeakValueDictionary()
        fc = self
        mp = monkeypatch
        mp.setattr(torch.cuda, "Stream", lambda device=None, **kw: FakeStream(fc, f"side{len(fc.log)}"))
        mp.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(fc))
        mp.setattr(torch.cuda, "current_stream", lambda device=None: fc.current_stream())
        mp.setattr(torch.cuda, "stream", self.stream)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: fc.log.append(("device_sync",)))
        mp.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        mp.setattr(torch.cuda, "cudart", lambda: _Cudart(fc))
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "set_device",
                   lambda d: fc.log.append(("set_device", torch.device(d), threading.current_thread().name)))
        mp.setattr(torch.Tensor, "record_stream", lambda t, s: fc.log.append(("record_stream", t, s)))
        self.free = self.total = 80 << 30

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, s):
        prev = self.current_stream()
        self._local.stream = s if s is not None else prev
        try:
            yield
        finally:
            self._local.stream = prev

    def mark(self, t: torch.Tensor) -> None:
        self._cuda_ptrs.add(id(t))
        self._keep[id(t)] = t

    def on_cuda(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._keep.get(id(t)) is t

    @contextlib.contextmanager
    def tensors_to_host(self):
        """Inside: tensors asked for on cuda live in host memory (this thread only)."""
        with _ToHost(self):
            yield

    # -- queries --------------------------------------------------------------------------------

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[0] == kind]

    def index(self, entry) -> int:
        return next(k for k, e in enumerate(self.log) if e is entry)

    def unordered(self) -> list[str]:
        """Copies that touch bytes another stream touched before, with nothing ordering the two: no
        event recorded on that stream after the first access and waited for (by the second stream, or
        the host) before the second, nor a device synchronize between them."""
        last: list[tuple[int, int, FakeStream, int]] = []  # (start, end, stream, log index) per access
        bad = []
        for k, e in enumerate(self.log):
            if e[0] != "copy":
                continue
            _, dst, src, _, stream = e
            for t in (dst, src):
                lo, hi = _span(t)
                for lo2, hi2, s2, j in last:
                    if s2 is not stream and lo < hi2 and lo2 < hi and not self._ordered(j, k, s2, stream):
                        bad.append(f"copy #{k} on {stream} touches bytes of copy #{j} on {s2} unordered")
                last.append((lo, hi, stream, k))
        return bad

    def _ordered(self, j: int, k: int, first: FakeStream, second: FakeStream) -> bool:
        for m in range(j + 1, k):
            e = self.log[m]
            if e[0] == "device_sync" or (e[0] == "stream_sync" and e[1] is first):
                return True
            if e[0] == "record" and e[2] is first:
                ev = e[1]
                if any((w[0] == "wait_event" and w[1] is second and w[2] is ev) or (w[0] == "event_sync" and w[1] is ev)
                       for w in self.log[m + 1:k]):
                    return True
        return False


def fake_cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)
