"""Bounded waits for the tests: ``wait_for`` (poll until a condition holds, or fail), ``never``
(a condition that must not hold during a while) and a ``Recorder`` that callbacks append to.

``wait_for`` is the one polling wait of the suite (``tests/_elastic.py``, the launch tests and
the elastic-job harness all use it): it returns the predicate's truthy value, so a wait can
also fetch (``pids = wait_for(paused, 60, "the workers at step 3")``), and it fails with an
``AssertionError`` that names what it waited for, at the deadline or as soon as the process
it watches (``proc``) has exited.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, TypeVar, Union

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A ``wait_for`` ran out of time, or the process it watched exited first."""


def _describe(what: Union[str, Callable[[], str]]) -> str:
    return what() if callable(what) else what


def wait_for(predicate: Callable[[], T], timeout: float, what: Union[str, Callable[[], str]], *,
             interval: float = 0.02, proc=None) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    ``timeout``: seconds, on a monotonic deadline; the predicate is checked at least once, and
    once more at the deadline. ``what`` names the condition in the failure (a string, or a
    callable that returns one, evaluated when the wait fails: to report the state then).
    ``proc`` (a ``subprocess.Popen``): fail at once when it has exited. A failure is a
    ``WaitTimeout`` (an ``AssertionError``); an exception of the predicate propagates.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise WaitTimeout(f"process {proc.pid} exited with {proc.returncode} while waiting "
                              f"for {_describe(what)}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {_describe(what)}")
        time.sleep(min(interval, left))


def never(predicate: Callable[[], object], duration: float, what: str, *,
          interval: float = 0.02) -> None:
    """Poll ``predicate`` for ``duration`` seconds; ``AssertionError`` naming ``what`` (the thing
    that must not happen) if it returns a truthy value meanwhile."""
    try:
        value = wait_for(predicate, duration, what, interval=interval)
    except WaitTimeout:
        return
    raise AssertionError(f"{what} within {duration:g}s (it must not): {value!r}")


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
