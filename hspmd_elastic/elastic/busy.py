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

An idle device (the plan leaves it out: the planner found it costs more than it adds) is
measured by a *probe* while its worker waits for a plan that uses it: ``probe(config, rows,
device)`` runs the forward and backward of one micro-batch of ``rows`` rows
(``probe_rows(plan)``: the plan's largest micro-batch) through a one-layer copy of the model
(``PROBE_LAYERS``; embedding and head included, the dense reference's functions), on the device
alone: no process group, no store, no state of the job; repeated for ``PROBE_MIN_S`` at least
(``PROBE_MOST`` times at most), its time is the mean of one, so a device shared in time slices
(a CPU quota, a time-sliced GPU) is measured at its average speed, not at a burst's.
``ProbeSchedule`` bounds it: one probe at most every ``every_s``, and never more than ``duty``
of the device's time (the wait after a probe is at least ``(1 - duty) / duty`` times the
probe's own time, every repetition counted). The leader predicts the
same workload with the cost model (``launcher.leader.stragglers.probe_predicted_s``), so the
probe's time is a speed sample like a training step's.

The runtime measures each step with ``elastic.device_timer``. On CPU workers the times come from
``time.perf_counter`` (busy = wall - waited, as above). On CUDA workers they come from CUDA events
on the compute stream around the compute segments between waits on communication, the device's
own clock, read back a step or more later without a synchronisation and fed in through
``add_busy``: the window then trails the newest step by a step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
import time
from typing import Optional

PROBE_LAYERS = 1  # layers of the probe's model (its embedding and head run too)
PROBE_MIN_S = 0.2  # a probe repeats its micro-batch for this long at least (time-sliced devices)
PROBE_MOST = 64  # ... and at most this many times


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


def probe_rows(plan) -> int:
    """The rows of a probe under ``plan`` (an ``hspmd_elastic.plan.Plan``): its largest
    micro-batch; the worker and the leader both take it from here."""
    return max(p.microbatch_size for p in plan.pipelines)


def probe_config(config):
    """The probe's model: ``config`` with ``PROBE_LAYERS`` layers."""
    return dataclasses.replace(config, num_layers=min(PROBE_LAYERS, config.num_layers))


def probe(config, rows: int, device, seed: int = 0, min_s: float = PROBE_MIN_S,
          most: int = PROBE_MOST) -> float:
    """Seconds of one forward and backward of ``rows`` rows through ``probe_config(config)``
    on ``device`` (see the module docstring), the mean over repetitions that last ``min_s``
    at least (at most ``most`` of them): a device shared in time slices (a CPU quota's CFS
    period, a time-sliced GPU) runs a short burst at full speed, and only a probe longer than
    its slices sees its average speed. Touches no process group."""
    import torch  # torch

    from hspmd_elastic.graph.init import full_params  # torch
    from hspmd_elastic.graph.reference import reference_loss  # torch

    small = probe_config(config)
    params = {k: v.to(device).requires_grad_(True) for k, v in full_params(small, seed).items()}
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, small.vocab_size, (rows, small.seq_len + 1),
                          generator=gen).to(device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start, done = time.perf_counter(), 0
    while True:
        reference_loss(params, batch, small).backward()
        if cuda:
            torch.cuda.synchronize(device)
        done += 1
        took = time.perf_counter() - start
        if took >= min_s or done >= most:
            return took / done


class ProbeSchedule:
    """When an idle worker may probe next: at most every ``every_s``, and at most ``duty`` of
    the time (pure: the caller passes the clock)."""

    def __init__(self, every_s: float = 2.0, duty: float = 0.1):
        if not (math.isfinite(every_s) and every_s > 0 and 0 < duty <= 1):
            raise ValueError(f"ProbeSchedule(every_s={every_s}, duty={duty}): need every_s > 0 "
                             "and 0 < duty <= 1")
        self.every_s, self.duty = every_s, duty
        self.next_at = -math.inf

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def done(self, now: float, took_s: float) -> None:
        """A probe that took ``took_s`` ended at ``now``."""
        self.next_at = now + max(self.every_s, took_s * (1 - self.duty) / self.duty)

    def wait_s(self, now: float) -> float:
        """Seconds until the next probe is due (0: now)."""
        return max(0.0, self.next_at - now)
