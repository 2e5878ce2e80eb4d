"""Progress heartbeats and the hang rule: silent GPU freezes that the driver does not report.

Every worker reports ``(step, t)``. ``HangDetector`` is pure (no threads, no I/O; the clock is
injected) and promises:

* the step-time estimate is the median of the last ``window`` per-step intervals of all workers
  (workers of one SPMD job advance together; the median ignores a stray slow step);
* a worker that has advanced since its start (or ``reset``) is hung when its step has not
  advanced for longer than ``max(min_timeout_s, multiple * estimate)``;
* before that (start-up, compilation, the first step after a plan switch) and while no estimate
  exists, the limit is ``startup_grace_s``; the first interval after a start is not used for the
  estimate (it holds the warm-up);
* a step that goes backwards (a restart resumed from an earlier step) counts as a new start;
* a hung worker's device is treated as failed: ``Hang.verdict()``;
* ``hang_detector_from_env`` reads the limits from ``HSPMD_HANG_MULTIPLE``,
  ``HSPMD_HANG_TIMEOUT_S`` (``min_timeout_s``) and ``HSPMD_HANG_STARTUP_S``
  (``startup_grace_s``) with the one parser, ``hspmd_elastic.contract.env.HangRule``; a bad value
  (not a finite number > 0) raises ``HealthConfigError`` naming the variable and the value.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional

from hspmd_elastic.contract.env import EnvError, HangRule
from launcher.health.api import Clock, HealthConfigError, Verdict


@dataclass(frozen=True)
class Hang:
    """A worker whose step did not advance in time."""

    worker: Hashable
    step: Optional[int]
    since: float
    stalled_s: float
    limit_s: float
    starting: bool

    def reason(self) -> str:
        phase = "before its first step" if self.starting else f"at step {self.step}"
        return (f"worker {self.worker} hung {phase}: no progress for {self.stalled_s:.1f}s "
                f"(limit {self.limit_s:.1f}s)")

    def verdict(self) -> Verdict:
        """The failed verdict of the hung worker's device, dated when progress stopped."""
        return Verdict.failed(self.reason(), at=self.since)


@dataclass
class _Worker:
    step: Optional[int]
    last_advance: float
    advanced: bool = False


class HangDetector:
    """Declares workers hung from their step heartbeats (see the module docstring)."""

    def __init__(self, multiple: float = 10.0, min_timeout_s: float = 60.0,
                 startup_grace_s: float = 600.0, window: int = 32,
                 clock: Clock = time.monotonic):
        for name, value in (("multiple", multiple), ("min_timeout_s", min_timeout_s),
                            ("startup_grace_s", startup_grace_s)):
            if not value > 0:
                raise HealthConfigError(f"hang detector {name} must be > 0, got {value!r}")
        if window < 1:
            raise HealthConfigError(f"hang detector window must be >= 1, got {window!r}")
        self.multiple = float(multiple)
        self.min_timeout_s = float(min_timeout_s)
        self.startup_grace_s = float(startup_grace_s)
        self._clock = clock
        self._intervals: deque[float] = deque(maxlen=window)
        self._workers: dict[Hashable, _Worker] = {}

    def heartbeat(self, worker: Hashable, step: Optional[int], t: Optional[float] = None) -> None:
        """``worker`` is at ``step`` at time ``t`` (None: alive, no step yet)."""
        now = self._clock() if t is None else t
        state = self._workers.get(worker)
        if state is None:
            self._workers[worker] = _Worker(step, now)
            return
        if step is None:
            return
        if state.step is None or step < state.step:
            self._workers[worker] = _Worker(step, now)
            return
        if step == state.step:
            return
        if state.advanced:
            self._intervals.append((now - state.last_advance) / (step - state.step))
        state.step, state.last_advance, state.advanced = step, now, True

    def reset(self, worker: Optional[Hashable] = None, t: Optional[float] = None) -> None:
        """Start-up grace again for ``worker`` (all workers when None), e.g. after a plan switch."""
        now = self._clock() if t is None else t
        targets = list(self._workers) if worker is None else [worker]
        for w in targets:
            step = self._workers[w].step if w in self._workers else None
            self._workers[w] = _Worker(step, now)

    def forget(self, worker: Hashable) -> None:
        self._workers.pop(worker, None)

    def step_time(self) -> Optional[float]:
        """The recent per-step time (median of the window), None before any interval."""
        return statistics.median(self._intervals) if self._intervals else None

    def limit(self, starting: bool) -> float:
        estimate = self.step_time()
        if starting or estimate is None:
            return self.startup_grace_s
        return max(self.min_timeout_s, self.multiple * estimate)

    def hung(self, now: Optional[float] = None) -> list[Hang]:
        """Workers whose step has not advanced within their limit at ``now``."""
        now = self._clock() if now is None else now
        out = []
        for worker, state in self._workers.items():
            starting = not state.advanced
            limit = self.limit(starting)
            stalled = now - state.last_advance
            if stalled > limit:
                out.append(Hang(worker, state.step, state.last_advance, stalled, limit, starting))
        return out


def hang_detector_from_env(env: Mapping[str, str], clock: Clock = time.monotonic) -> HangDetector:
    """A ``HangDetector`` with the limits the environment sets (``HangRule``; the detector's
    defaults for the others); ``HealthConfigError`` naming a bad variable and its value."""
    try:
        rule = HangRule.from_env(env)
    except EnvError as exc:
        raise HealthConfigError(str(exc)) from None
    return HangDetector(clock=clock, **rule.limits())
