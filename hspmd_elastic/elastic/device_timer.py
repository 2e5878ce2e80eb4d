"""A rank's busy time per training step, measured where its compute runs: the host, or a GPU.

The busy time of a step is the rank's own compute, without its waits on other ranks
(``elastic/busy.py`` says why that, not the step time, tells which device is slow). Every wait on
communication goes through ``graph.comm.Comm.wait``; the timer measures around those waits.

* **CPU** (``HostTimer``): the compute runs on the host thread, so the host's clock is the
  device's: busy = the step's wall time (``time.perf_counter``) minus what ``Comm.waited_s``
  grew by, exactly what the runtime measured before this module.
* **CUDA** (``CudaEventTimer``): the host only enqueues kernels, so its clock is not the GPU's.
  A step is cut into compute segments at every wait on communication: one event on the current
  (compute) stream at the step's start, one before each wait (after the operation was posted:
  it completes when the stream has run every kernel enqueued before the operation), one after
  each wait (the watchdog's ``wait()`` has made the stream wait for the operation, so it
  completes after the operation ended), and one at the step's end. The busy time is the sum of
  the compute segments' elapsed times ``[start, before 1] + [after 1, before 2] + ... +
  [after k, end]``. Everything between a "before" and its "after" on the stream is the
  operation (the peers' lateness, the transfer, the host's return from its wait) and is left
  out; everything in a compute segment is this rank's (its kernels, and the stream's idle gaps
  while the host launches them: a slow host is a slow rank). Host-side ``waited_s`` is not used
  on CUDA: a wait that polls ``Work.is_completed()`` also waits for this rank's own kernels
  enqueued before the operation, so ``wall - waited`` misses GPU compute.

Promises (both timers; the caller runs ``with timer.step(plan_version, comm): ...`` around each
training step and then takes ``timer.finished()``):

* ``finished()`` returns each step that ended normally, once, oldest first, as
  ``StepBusy(plan_version, busy_s)`` with ``busy_s`` >= 0, or NaN where the clocks gave no
  usable figure (``BusyMeter.add_busy`` counts such a step as seen and keeps nothing, as ``add``
  always did). A step that raised (abandoned) is never reported (``abandoned`` counts them);
* ``HostTimer``: a step is finished when it ends;
* ``CudaEventTimer``: no synchronisation, ever: events are only recorded (``record()``), polled
  (``query()``) and read (``elapsed_time``, which needs both events complete). Step N's events
  are polled when step N+1 ends (``lag=1``); a step whose events are not all complete yet stays
  pending, with every later step behind it (a stream completes in order), and is reported at a
  later step's end. At most ``max_pending`` steps wait: beyond that the oldest is dropped
  (``dropped`` counts them). Events of reported steps are reused (a free list of bounded size);
* waits are bracketed only on the thread that runs the step, and only while a step is open
  (``graph.comm.bracket_waits``: waits of a switch, a reaper or another thread are not seen);
* ``step_timer(device)`` chooses by the device's type: CUDA events on ``cuda``, the host clock
  elsewhere. The event class is a parameter (``event_factory``), so tests pass a double with
  CUDA events' semantics.

What the CUDA scheme does not see: communication that waits neither through ``Comm.wait`` nor
inside ``graph.comm.waiting()`` (a fused BSR inside a step, whose caller counts it into
``waited_s`` on the host) is counted as compute there; kernels on other streams count only where
they delay the current stream.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from hspmd_elastic.graph.comm import bracket_waits


@dataclass(frozen=True)
class StepBusy:
    """One finished step: the plan version it ran under, and this rank's busy seconds in it."""

    plan_version: int
    busy_s: float


class TimingEvent(Protocol):
    """What the CUDA timer needs of an event (``torch.cuda.Event(enable_timing=True)``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: "TimingEvent") -> float: ...  # milliseconds


class HostTimer:
    """Busy time on the host's clock: the step's wall time minus its waits (``Comm.waited_s``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._ready: list[StepBusy] = []
        self.abandoned = 0
        self.dropped = 0

    @contextlib.contextmanager
    def step(self, plan_version: int, comm) -> Iterator[None]:
        began, waited = self._clock(), comm.waited_s
        try:
            yield
        except BaseException:
            self.abandoned += 1
            raise
        wall, waited = self._clock() - began, comm.waited_s - waited
        usable = math.isfinite(wall) and math.isfinite(waited) and wall >= 0 and waited >= 0
        self._ready.append(StepBusy(plan_version, max(wall - waited, 0.0) if usable else math.nan))

    def finished(self) -> list[StepBusy]:
        ready, self._ready = self._ready, []
        return ready


@dataclass
class _Pending:
    plan_version: int
    events: list  # start, then pairs (before a wait, after it), then the end


class CudaEventTimer:
    """Busy time on the GPU's clock: events on the current stream around the compute segments,
    read back at a later step's end without a synchronisation (see the module's promises)."""

    def __init__(self, event_factory: Callable[[], TimingEvent], lag: int = 1,
                 max_pending: int = 4, max_free: int = 1024):
        if lag < 0 or max_pending < max(lag, 1) or max_free < 0:
            raise ValueError(f"CudaEventTimer(lag={lag}, max_pending={max_pending}, "
                             f"max_free={max_free}): need lag >= 0, max_pending >= max(lag, 1) "
                             "and max_free >= 0")
        self.event_factory, self.lag = event_factory, lag
        self.max_pending, self.max_free = max_pending, max_free
        self.abandoned = 0  # steps that raised: never reported
        self.dropped = 0  # steps still pending when max_pending newer ones ended
        self._open: Optional[_Pending] = None
        self._paused = False
        self._pending: deque[_Pending] = deque()
        self._ready: list[StepBusy] = []
        self._free: list[TimingEvent] = []

    @contextlib.contextmanager
    def step(self, plan_version: int, comm=None) -> Iterator[None]:
        self._open, self._paused = _Pending(plan_version, []), False
        self._mark()
        try:
            with bracket_waits(self):
                yield
        except BaseException:
            self.abandoned += 1  # its events are not reused: the stream may never reach them
            self._open = None
            raise
        if self._paused:  # a wait that raised and was caught inside the step
            self.resume()
        self._mark()
        done, self._open = self._open, None
        self._pending.append(done)
        self._poll(len(self._pending) - self.lag)  # lag 1: the steps before this one
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1

    # the brackets ``Comm.wait`` calls on the step's thread (``graph.comm.bracket_waits``)
    def pause(self) -> None:
        if self._open is not None and not self._paused:
            self._mark()
            self._paused = True

    def resume(self) -> None:
        if self._open is not None and self._paused:
            self._mark()
            self._paused = False

    def finished(self) -> list[StepBusy]:
        ready, self._ready = self._ready, []
        return ready

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _mark(self) -> None:
        event = self._free.pop() if self._free else self.event_factory()
        event.record()
        self._open.events.append(event)

    def _poll(self, count: int) -> None:
        """Read back the oldest ``count`` pending steps, in order, up to the first incomplete."""
        for _ in range(count):
            step = self._pending[0]
            if not (step.events[-1].query() and all(e.query() for e in step.events[:-1])):
                return
            self._pending.popleft()
            ev = step.events
            busy_ms = sum(ev[i].elapsed_time(ev[i + 1]) for i in range(0, len(ev), 2))
            busy_s = max(busy_ms / 1000.0, 0.0) if math.isfinite(busy_ms) else math.nan
            self._ready.append(StepBusy(step.plan_version, busy_s))
            self._free.extend(ev[:max(self.max_free - len(self._free), 0)])


def cuda_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)


def step_timer(device: torch.device | str,
               event_factory: Callable[[], TimingEvent] = cuda_event):
    """The timer for a worker computing on ``device``: CUDA events on a GPU, else the host."""
    if torch.device(device).type == "cuda":
        return CudaEventTimer(event_factory)
    return HostTimer()
