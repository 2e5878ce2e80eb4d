"""The node agent's hang monitor: worker progress heartbeats fed to a ``HangDetector``.

Promises: every progress record the agent relays is a heartbeat (moved from the record's wall
time onto the monotonic clock); a report with a new time but the same step (the worker changed
state: its collective timed out, it waits for a plan, it regroups) restarts the start-up grace;
a new pid in a slot starts afresh; each hang is reported once (``new_hangs``); elastic mode
watches only ``watched_slots``: a worker in a switch (waiting for a plan, regrouping with a
joiner that still starts, resharding) or finishing is bounded by its own deadlines, not by the
hang rule, so survivors waiting for a slow fresh worker are never taken for hung.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

from hspmd_elastic.contract import schema
from launcher.health.progress import Hang, HangDetector


_WATCHED_STATES = frozenset({"training"})


def watched_slots(records: Mapping[int, schema.WorkerRecord],
                  reports: Mapping[int, object]) -> dict[int, schema.WorkerRecord]:
    """Pure: the slots whose worker trains (or has not reported yet: the start-up grace covers
    it); ``reports``: slot -> the worker's latest progress report (with ``state``)."""
    return {lr: rec for lr, rec in records.items()
            if lr not in reports or getattr(reports[lr], "state", None) in _WATCHED_STATES}


class ProgressMonitor:
    """Feeds worker progress records to a ``HangDetector``; reports each hang once."""

    def __init__(self, detector: Optional[HangDetector] = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.detector = detector or HangDetector(clock=clock)
        self._clock, self._wall = clock, wall_clock
        self._seen: dict[int, tuple[int, int, float]] = {}  # slot -> (pid, step, progress at)
        self._reported: set[int] = set()

    def observe(self, records: Mapping[int, schema.WorkerRecord]) -> None:
        """Heartbeats from the slots' records; a new pid (a new worker) starts afresh."""
        now, wall = self._clock(), self._wall()
        for lr in set(self._seen) - set(records):
            self.detector.forget(lr)
            self._seen.pop(lr)
            self._reported.discard(lr)
        for lr, rec in records.items():
            seen = self._seen.get(lr)
            if seen is not None and seen[0] != rec.pid:
                self.detector.forget(lr)
                self._reported.discard(lr)
            if seen == (rec.pid, rec.step, rec.last_progress_at):
                continue
            self._seen[lr] = (rec.pid, rec.step, rec.last_progress_at)
            # The record's wall time, moved onto our monotonic clock.
            t = now - max(wall - rec.last_progress_at, 0.0)
            if seen is not None and seen[0] == rec.pid and seen[1] == rec.step \
                    and rec.last_progress_at > seen[2]:
                # A new report without a new step: the worker changed state (its collective
                # timed out, it waits for a plan, it regroups). It is alive, and its own
                # watchdog bounds that wait: start-up grace again, like after a switch.
                self.detector.reset(lr, t)
                continue
            self.detector.heartbeat(lr, rec.step, t)

    def new_hangs(self) -> list[Hang]:
        """Hangs not reported before."""
        out = [h for h in self.detector.hung(self._clock()) if h.worker not in self._reported]
        self._reported.update(h.worker for h in out)
        return out
