"""Fault injection for the crash tests: `point(name)` SIGKILLs the process at the Nth time it is reached,
`io_point(path)` fails the Nth write of a matching file as a full disk would.

Set PHANTOM_FAULT="name:N" (e.g. "checkpoint.rename:2") in a process's environment to kill it there;
PHANTOM_IO_FAULT="glob:N" (e.g. "*/checkpoint.tmp/state.pt:2", matched against the whole path) to
raise OSError(ENOSPC) there. Unset, each is a lookup and nothing else. Points are listed in
notes/reliability.md.
"""
from __future__ import annotations

import errno
import fnmatch
import os
import signal
import threading

_spec = os.environ.get("PHANTOM_FAULT", "")
_name, _, _n = _spec.rpartition(":")
TARGET = {_name: int(_n)} if _name and _n.isdigit() else {}
_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Kill this process (SIGKILL: no cleanup, no flush) if PHANTOM_FAULT names this point and count."""
    if name in TARGET:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] == TARGET[name]:
            os.kill(os.getpid(), signal.SIGKILL)


_io_glob, _, _io_n = os.environ.get("PHANTOM_IO_FAULT", "").rpartition(":")
IO_TARGET: tuple[str, int] | None = (_io_glob, int(_io_n)) if _io_glob and _io_n.isdigit() else None
io_hits = 0
_io_lock = threading.Lock()  # writes happen on the training and the write-back threads


def io_point(path) -> None:
    """Raise OSError(ENOSPC) (as write() does: no file name) if IO_TARGET's glob matches the path
    being written and this is its Nth matching write. Tests set IO_TARGET (and io_hits = 0) directly
    for a run in the same process."""
    global io_hits
    if IO_TARGET is None or not fnmatch.fnmatch(str(path), IO_TARGET[0]):
        return
    with _io_lock:
        io_hits += 1
        hit = io_hits == IO_TARGET[1]
    if hit:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
