"""A clock the test moves by hand, for code that takes an injected ``clock`` callable."""

from __future__ import annotations


class FakeClock:
    """Returns ``t`` (also readable and settable as ``now``) until the test changes it."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    @property
    def now(self) -> float:
        return self.t

    @now.setter
    def now(self, value: float) -> None:
        self.t = value

    def __call__(self) -> float:
        return self.t
