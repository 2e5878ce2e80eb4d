"""One small state-machine helper for every lifecycle in hspmd-elastic.

The node agent's modes, the leader and the worker runtime each keep their own enum of states and
their own table of allowed transitions; this module gives them one way to run it. Promises:

* ``StateMachine(table, initial)`` accepts a transition only when ``table[state]`` holds it; any
  other raises ``IllegalTransition`` at once, naming the machine, both states and what is
  allowed (an illegal transition is a bug, never a user error);
* a transition to the state the machine is already in is accepted only when the table lists
  it (some machines repeat a state on purpose, e.g. a new rendezvous round);
* every accepted transition is appended to ``history`` as a ``Transition`` (state, monotonic
  time, wall time, reason), the same format in every machine; ``keep`` bounds the history of
  long-lived machines;
* it does no I/O and takes no lock: a machine driven from several threads holds its own lock
  around ``to``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Optional, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A state change the machine's table does not allow (a bug, not a user error)."""


@dataclass(frozen=True)
class Transition(Generic[S]):
    """One entry of a machine's history."""

    state: S
    at: float  # monotonic seconds (the machine's clock)
    wall: float  # wall-clock seconds, for logs and etcd records
    reason: str = ""


class StateMachine(Generic[S]):
    """A state, a transition table, and a timestamped history (see the module docstring)."""

    def __init__(self, name: str, table: Mapping[S, frozenset], initial: S, reason: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, keep: Optional[int] = None):
        missing = [s for s in type(initial) if s not in table]
        if missing:
            raise ValueError(f"{name}: transition table lacks states {[s.value for s in missing]}")
        self.name, self.table, self.keep = name, table, keep
        self._clock, self._wall = clock, wall_clock
        self.state: S = initial
        self.history: list[Transition[S]] = [Transition(initial, clock(), wall_clock(), reason)]

    def allows(self, new: S) -> bool:
        return new in self.table[self.state]

    def to(self, new: S, reason: str = "") -> S:
        """Move to ``new``; returns the state left. Raises ``IllegalTransition``."""
        old = self.state
        if new not in self.table[old]:
            allowed = sorted(s.value for s in self.table[old])
            raise IllegalTransition(f"{self.name} state {old.value} -> {new.value} is not "
                                    f"allowed; allowed: {allowed}")
        self.state = new
        self.history.append(Transition(new, self._clock(), self._wall(), reason))
        if self.keep is not None:
            del self.history[:-self.keep]
        return old

    @property
    def since(self) -> float:
        """Monotonic time of the last transition."""
        return self.history[-1].at

    def describe(self) -> list[tuple[str, float, str]]:
        """The history as (state, monotonic time, reason), for debug logs."""
        return [(t.state.value, round(t.at, 3), t.reason) for t in self.history]
