"""The block scheduler: reuse at the forward/backward turn, errors from its threads, the trace."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

import phantom
from phantom.convert.synthetic import write_synthetic
from phantom.stream.scheduler import BlockScheduler
from phantom.stream.writeback import WriteBackQueue
from phantom.stream.placement import Placement
from phantom.files.store import BlockStore
from conftest import SMALL, batch


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_blocks_still_on_the_device_are_reused_at_the_turn(small_store, prefetch):
    model = phantom.load(small_store, offload="disk", prefetch=prefetch)
    tokens, targets = batch(SMALL)
    n, slots = SMALL.n_layers, min(prefetch + 1, SMALL.n_layers)
    # step 1 reuses the last blocks of the forward; later steps also start with the first blocks,
    # which the previous backward left on the device
    for expected_loads in (2 * n - slots, 2 * n - 2 * slots, 2 * n - 2 * slots):
        model.scheduler.take_metrics()
        model(tokens, targets=targets).backward()
        m = model.scheduler.take_metrics()
        assert m["loads"] == expected_loads
        assert m["bytes_read"] == m["loads"] * model.store.block_nbytes
    model.close()


def never_time_out(cv: threading.Condition, monkeypatch, on_wait=None) -> list[bool]:
    """Every wait on the scheduler's condition waits for a notification (the acquire loop's 0.1 s
    poll becomes LONG_S), and what each wait returned is recorded: False means it timed out, i.e. a
    state change was not signalled. `on_wait` runs (lock held) before each wait of the caller."""
    real_wait, woke = cv.wait, []

    def wait(timeout=None):
        if on_wait is not None:
            on_wait()
        got = real_wait(None if timeout is None else LONG_S)
        woke.append(got)
        return got

    monkeypatch.setattr(cv, "wait", wait)
    return woke


LONG_S = 10.0  # a hang guard, never a performance bound: nothing waits this long when things work


def test_prefetch_io_error_reaches_the_training_thread_fast(small_store, monkeypatch):
    """The failure is signalled: acquire() waiting for block 2 is woken by the loader that failed
    (no poll timeout), and the read fails only once the training thread is waiting for it."""
    store = BlockStore(small_store)
    real, attempts = store.read_block_into, []
    waiting = threading.Event()  # the training thread is inside acquire(2), waiting

    def failing(i, buf, **kw):
        if i == 2:
            attempts.append(i)
            assert waiting.wait(LONG_S), "acquire(2) never waited"
            raise OSError(5, "Input/output error (injected)")
        return real(i, buf, **kw)

    monkeypatch.setattr(store, "read_block_into", failing)
    with BlockScheduler(store, "cpu", Placement(offload="disk", prefetch=2)) as sched:
        sched.plan([0, 1, 2, 3])
        for i in (0, 1):
            sched.acquire(i)
            sched.release(i)
        trainer = threading.current_thread()
        woke = never_time_out(sched._cv, monkeypatch,
                              on_wait=lambda: waiting.set() if threading.current_thread() is trainer else None)
        with pytest.raises(OSError, match="injected"):
            sched.acquire(2)
        assert waiting.is_set() and attempts == [2]
        assert all(woke), f"a wait timed out instead of being notified: {woke}"


def test_resident_blocks_are_never_reloaded(small_store):
    model = phantom.load(small_store, offload="disk", prefetch=1, resident=2)
    tokens, targets = batch(SMALL)
    model.scheduler.take_metrics()
    model(tokens, targets=targets).backward()
    assert model.scheduler.take_metrics()["loads"] == 2 * 2 - 2  # blocks 2, 3: forward, 3 reused
    model.close()


def test_writeback_queue_reraises_errors_in_the_caller():
    q = WriteBackQueue(maxsize=2)
    assert q.submit(lambda: 41 + 1).result(timeout=5) == 42

    def boom():
        raise OSError(28, "No space left on device (injected)")

    q.submit(boom)
    with pytest.raises(OSError, match="No space left"):
        q.flush()
    q.close()


def test_writeback_queue_applies_back_pressure():
    """With the worker busy and the queue full, a third submit blocks in put() until the worker
    frees room: checked by the queue's own waiters, not by a sleep."""
    q = WriteBackQueue(maxsize=1)
    gate, running = threading.Event(), threading.Event()
    q.submit(lambda: (running.set(), gate.wait(LONG_S)))  # the worker is busy with this one
    assert running.wait(LONG_S)
    q.submit(lambda: None)  # this one waits in the queue
    blocked = threading.Thread(target=q.submit, args=(lambda: None,))
    blocked.start()
    deadline = time.monotonic() + LONG_S  # until the submit blocks or (back-pressure broken) returns
    while blocked.is_alive() and not q._q.not_full._waiters and time.monotonic() < deadline:
        time.sleep(0.001)
    assert blocked.is_alive() and q._q.not_full._waiters  # a third submit waits for room
    gate.set()
    blocked.join(LONG_S)
    assert not blocked.is_alive()
    q.flush()
    q.close()


def test_trace_has_a_lane_per_kind_of_work(small_store, tmp_path):
    model = phantom.load(small_store, offload="disk", prefetch=1, trace=True)
    tokens, targets = batch(SMALL)
    model(tokens, targets=targets).backward()
    model.scheduler.tracer.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"compute", "read", "copy", "write-back"} <= lanes
    reads = [e for e in events if e["ph"] == "X" and e["name"].startswith("read")]
    assert len(reads) == 2 * SMALL.n_layers - 2
    model.close()


def test_close_stops_the_prefetch_threads(small_store):
    model = phantom.load(small_store, offload="disk")
    threads = model.scheduler._threads
    assert threads
    model.close()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("held", [(5, 6), (6, 5), (4, 6), (6, 4)])
def test_eviction_keeps_the_blocks_the_next_step_reads_first(tmp_path, held):
    """Belady over the plan, taken to repeat past its end: in the backward of 8 streamed blocks, two
    slots hold blocks this step no longer needs, and the next load evicts the one the next forward
    reads last, whatever the slots' order. (A tie broken by slot order, when a loader ran late, kept
    block 6 over block 4 in a CI run: one extra read the next step.)"""
    cfg = dataclasses.replace(SMALL, n_layers=8)
    store = BlockStore(write_synthetic(tmp_path / "s", cfg, torch.float32, seed=0, progress=False))
    n = cfg.n_layers
    plan = list(range(n)) + list(range(n - 1, -1, -1))
    with BlockScheduler(store, "cpu", Placement(offload="disk", prefetch=1)) as sched:
        with sched._cv:  # the loaders wait on this lock; they find an empty plan after it
            for slot, block in zip(sched.slots, held):
                slot.block, slot.state = block, "ready"
            load = min(held) - 1  # the block the backward needs next, not in a slot
            sched._plan, sched._pos = plan, plan.index(load, n)
            slot, block = sched._next_load()
            evicted = slot.block
            sched._plan, sched._pos = [], 0
            for s in sched.slots:
                s.block, s.state = None, "empty"
    assert (block, evicted) == (load, max(held))
