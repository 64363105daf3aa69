"""What the block pipeline did: a Chrome trace of compute, reads, routed expert reads, copies,
dequantization and write-back (one lane each), and the counters of one training step.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from phantom.base import fileio


class Tracer:
    """Chrome trace events (open in Perfetto / chrome://tracing), one lane per kind of work.

    The lanes are LANES, and a lane of its own for each other name a span gives (a tier's reads are
    drawn in the lane its phantom.stream.tiers.Tier names), numbered in order of first use."""

    LANES = {"compute": 1, "read": 2, "copy": 3, "dequant": 4, "write-back": 5, "stall": 6, "experts": 7}

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: list[dict] = []
        self.lanes = dict(self.LANES)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def span(self, lane: str, name: str, start: float, end: float, **args) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "ph": "X", "pid": 0, "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6,
              "args": args}
        with self._lock:
            ev["tid"] = self.lanes.setdefault(lane, len(self.lanes) + 1)
            self.events.append(ev)

    def write(self, path: Path) -> None:
        with self._lock:
            meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
                    for lane, tid in self.lanes.items()]
            events = meta + list(self.events)
        fileio.atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())


@dataclass
class Metrics:
    """Counters of one step, reset by `BlockScheduler.take_metrics()`."""

    loads: int = 0
    bytes_read: int = 0  # from disk (the disk tier)
    bytes_ram: int = 0  # served from the RAM tier
    bytes_h2d: int = 0  # host -> device copies
    read_s: float = 0.0
    copy_s: float = 0.0  # CPU/MPS: copy time; CUDA: the copy stream's time by events (see copy_events)
    stall_s: float = 0.0  # training thread waiting for a block
    dequant_s: float = 0.0  # quantized stores: loader time dequantizing (CUDA: queueing it on the copy stream)
    bytes_experts: int = 0  # experts read routed (phantom.stream.experts): also in bytes_read / bytes_ram
    expert_reads: int = 0  # round trips reading experts after a router
    copy_events: list = field(default_factory=list)  # CUDA: (start, end, bytes) of copies not yet counted

    def add(self, load: "LoadStats", fill: bool = False) -> None:
        """Count one finished load, or a routed slot's expert read (`fill`); the caller holds the
        scheduler's lock: loaders count concurrently."""
        self.loads += not fill
        self.expert_reads += fill
        self.bytes_read += load.bytes_read
        self.read_s += load.read_s
        self.bytes_ram += load.bytes_ram
        self.bytes_h2d += load.bytes_h2d
        self.copy_s += load.copy_s
        self.dequant_s += load.dequant_s
        self.bytes_experts += load.bytes_experts
        if load.copy_event is not None:
            self.copy_events.append(load.copy_event)
            if len(self.copy_events) > 1024:  # nobody takes metrics (generation): fold finished ones in
                self.copy_events = self.count_finished_copies()

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "copy_events"}

    def count_finished_copies(self) -> list:
        """Adds the finished CUDA copies' device time and bytes (no host sync); returns the unfinished."""
        pending = []
        for start, end, nbytes in self.copy_events:
            if end.query():
                self.copy_s += start.elapsed_time(end) / 1e3
                self.bytes_h2d += nbytes
            else:
                pending.append((start, end, nbytes))
        self.copy_events = []
        return pending


@dataclass
class LoadStats:
    """What one block load did, counted into the step's Metrics by the scheduler in one place."""

    bytes_read: int = 0
    read_s: float = 0.0
    bytes_ram: int = 0
    bytes_h2d: int = 0
    copy_s: float = 0.0
    dequant_s: float = 0.0
    bytes_experts: int = 0
    requests: int = 0  # a routed read of experts: the ranges it read (touching experts' joined)
    copy_event: tuple | None = None  # CUDA: (start, end, bytes) of the copy, timed by its events
