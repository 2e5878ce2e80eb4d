"""Bounded waits for the tests: a polling ``wait_for`` and a ``Recorder`` that callbacks append to.

Both return whether the condition held in time (False at the deadline), so a test can assert
that something happens (``assert wait_for(...)``) or that it does not (``assert not ...``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (monotonic deadline).

    Returns the last value of the predicate: True when it held in time.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(interval, max(deadline - time.monotonic(), 0)))


class Recorder:
    """Thread-safe list of items (watch events, errors, callbacks) with bounded waits on it."""

    def __init__(self) -> None:
        self._items: list = []
        self._cond = threading.Condition()

    def __call__(self, item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    @property
    def items(self) -> list:
        with self._cond:
            return list(self._items)

    def wait_for(self, predicate: Callable[[list], bool], timeout: float) -> bool:
        """Wait until ``predicate(items)`` holds, at most ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(list(self._items)), timeout)

    def wait_len(self, n: int, timeout: float) -> bool:
        return self.wait_for(lambda items: len(items) >= n, timeout)


def all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (a SIGSTOP has taken effect): wait on this before
    treating a frozen process as frozen."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(s in ("T", "t") for s in states)
