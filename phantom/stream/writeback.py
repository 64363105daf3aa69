"""The write-back queue: work that moves data off the device or to disk (full finetuning's updated
blocks, optimizer state) runs on one worker thread, bounded, its first error raised in the caller.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import torch

from phantom.base import faults
from phantom.stream.trace import Metrics, Tracer


class WriteBackQueue:
    """A bounded queue of work moving data off the device (or to disk), run by one worker thread.

    submit() blocks when `maxsize` items are pending (back-pressure) and re-raises the first error
    a previous item hit, so a failed write-back stops training in the training thread.
    """

    def __init__(self, tracer: Tracer | None = None, metrics: Metrics | None = None, maxsize: int = 4,
                 name: str = "phantom-writeback", device: torch.device | str = "cpu"):
        self.tracer, self.metrics = tracer or Tracer(False), metrics
        self.device = torch.device(device)  # CUDA: made the worker thread's current device
        self._q: queue.Queue = queue.Queue(maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, name: str = "write-back") -> Future:
        self._raise_error()
        fut: Future = Future()
        self._q.put((fn, args, name, fut))
        return fut

    def flush(self) -> None:
        """Wait until every submitted item is done; re-raise the first error."""
        self._q.join()
        self._raise_error()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        self._raise_error()

    def _raise_error(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _loop(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            fn, args, name, fut = item
            faults.point("writeback.item")  # crash tests: a write-back about to run
            t0 = time.perf_counter()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                if self._error is None:
                    self._error = e
                fut.set_exception(e)
            self.tracer.span("write-back", name, t0, time.perf_counter())
            self._q.task_done()
