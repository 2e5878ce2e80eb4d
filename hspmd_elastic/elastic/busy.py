"""A rank's busy time per step: its own compute, without its waits on the other ranks.

In synchronous training every rank's step takes as long as the slowest rank's, so the step time
(and the step rate) cannot say *which* device is slow. What does say it is the time a rank
spends on its own work: the step's wall time minus the time it waited on communication
(``hspmd_elastic.graph.comm.Comm.waited_s``: every collective, receive and send completion is
waited on through it). A fast rank waits for the slow one at the next collective; the slow rank
does not wait.

Promises (``BusyMeter``, pure: the caller passes the times):

* ``add(plan_version, wall_s, waited_s)`` takes one finished step; the busy time is
  ``max(wall_s - waited_s, 0)``; non-finite or negative inputs are ignored;
  ``add_busy(plan_version, busy_s)`` takes a step's busy time measured otherwise (a non-finite
  or negative one is ignored); steps must come in the order they ran;
* the first ``skip`` steps after a change of plan version are left out (warm-up: new groups,
  caches, a first step that reads its state), and a new plan version starts a new window;
* ``busy_s`` is the median of the last ``window`` kept steps of the current plan, 0.0 while
  fewer than ``min_steps`` are kept (not measured yet): robust to a step slowed by a one-off
  (a checkpoint write, the garbage collector).

The runtime measures each step with ``elastic.device_timer``. On CPU workers the times come from
``time.perf_counter`` (busy = wall - waited, as above). On CUDA workers they come from CUDA events
on the compute stream around the compute segments between waits on communication, the device's
own clock, read back a step or more later without a synchronisation and fed in through
``add_busy``: the window then trails the newest step by a step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional


class BusyMeter:
    """The median busy time per step over the current plan's recent steps."""

    def __init__(self, window: int = 8, skip: int = 2, min_steps: int = 2):
        if window < 1 or skip < 0 or not 1 <= min_steps <= window:
            raise ValueError(f"BusyMeter(window={window}, skip={skip}, min_steps={min_steps}): "
                             "need window >= 1, skip >= 0, 1 <= min_steps <= window")
        self.window, self.skip, self.min_steps = window, skip, min_steps
        self._version: Optional[int] = None
        self._seen = 0  # steps of the current plan version, skipped ones included
        self._kept: deque[float] = deque(maxlen=window)

    def add(self, plan_version: int, wall_s: float, waited_s: float) -> None:
        if not (math.isfinite(wall_s) and math.isfinite(waited_s)) or wall_s < 0 \
                or waited_s < 0:
            self.add_busy(plan_version, math.nan)  # counted as seen, not kept
            return
        self.add_busy(plan_version, max(wall_s - waited_s, 0.0))

    def add_busy(self, plan_version: int, busy_s: float) -> None:
        if plan_version != self._version:
            self._version, self._seen = plan_version, 0
            self._kept.clear()
        self._seen += 1
        if self._seen <= self.skip or not math.isfinite(busy_s) or busy_s < 0:
            return
        self._kept.append(busy_s)

    @property
    def busy_s(self) -> float:
        return statistics.median(self._kept) if len(self._kept) >= self.min_steps else 0.0

    @property
    def steps(self) -> int:
        """Steps in the current window."""
        return len(self._kept)
