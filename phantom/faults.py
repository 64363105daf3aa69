"""Fault injection for the crash tests: `point(name)` SIGKILLs the process at the Nth time it is reached.

Set PHANTOM_FAULT="name:N" (e.g. "checkpoint.rename:2") in a process's environment to kill it there;
unset, `point` is a dict lookup and nothing else. Points are listed in notes/reliability.md. Imports nothing from phantom.
"""
from __future__ import annotations

import os
import signal

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
