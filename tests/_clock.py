"""A clock the test moves by hand, for code that takes an injected ``clock`` callable."""

from __future__ import annotations

import threading


class FakeClock:
    """Returns ``t`` (also readable and settable as ``now``) until the test changes it.

    The test moves it by assigning ``t``/``now`` or with ``advance(dt)``; reads and ``advance``
    hold a lock, so code under test may read it from its own threads (a leader's loop).
    """

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._lock = threading.Lock()

    @property
    def now(self) -> float:
        return self()

    @now.setter
    def now(self, value: float) -> None:
        with self._lock:
            self.t = value

    def advance(self, dt: float) -> None:
        with self._lock:
            self.t += dt

    def __call__(self) -> float:
        with self._lock:
            return self.t
