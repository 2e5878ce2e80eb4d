"""Waiting on communication without ever hanging on a dead peer, nor past a newer plan.

``Watchdog`` is a ``graph.comm.Waiter``: it waits for a pending ``Work`` until it completes, its
deadline passes (``CommTimeoutError``) or a plan newer than the one the worker runs is published
(``SwitchRequested``), whichever comes first. Newer plans come from a ``PlanWatcher``
(``plan_watch.py``, re-exported here): a lock-only check, fed by a watch on ``plan/stamp``.

What "completes" means depends on the backend, and the wait is written for the stricter one:

* **NCCL** (and any backend ``devices.completes_at_enqueue`` names): a ``Work``'s future is done
  as soon as the operation is enqueued (torch: "for GPU work, ``fut.done()`` returns true only
  whether the operation has been enqueued") and ``wait()`` only orders the current stream after
  it. Only ``is_completed()`` says the operation ended, so the watchdog polls it, between looks
  at the plan watch, and calls ``wait()`` once it is true. A wait it abandons goes to
  ``on_abandon`` (``GroupFormer.abandoned``), whose ``AbortMonitor`` aborts the plan's
  communicators on its own thread: the kernel that spins on the dead peer ends, and the rank is
  out of its collective within this limit. If the main thread is blocked elsewhere (a host sync,
  an enqueue), the monitor, armed around every step, aborts by itself; ``check()`` and every
  later wait then raise (``fired``). A wait that completes once an abort has begun raises too,
  whatever ``is_completed()`` says: NCCL completes an aborted work as a success, on partial
  data (``_trust``).
* **gloo**: a collective's future completes when the work ends (the watchdog sleeps on it,
  looking at the plan watch in between), and a dead peer fails it within the group's timeout. An abandoned collective keeps its group's worker busy until then, so ``on_abandon``
  only records it for the ``GroupReaper``. Point-to-point works have no future and progress only
  inside ``wait()``: they are waited on, once, with the whole deadline, by a helper thread.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Optional

from hspmd_elastic.elastic.api import SwitchRequested
from hspmd_elastic.elastic.monitor import AbortMonitor
from hspmd_elastic.elastic.plan_watch import PlanWatcher
from hspmd_elastic.graph.comm import CommTimeoutError

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often a pending wait looks at the plan watch
_POLL_FIRST_S = 0.0005  # the first poll of a device work's completion (then doubling)


class Watchdog:
    """A ``Waiter`` for ``graph.comm``: completion, deadline, or a newer plan.

    ``current_version()`` returns the plan version the worker runs; a published plan above it
    aborts the wait with ``SwitchRequested``. ``monitor`` (the ``GroupFormer``'s, on a backend
    that completes at enqueue) is told of every completed wait and, once it has aborted the
    communicators, makes every check and wait raise.
    """

    def __init__(self, plans: PlanWatcher, current_version: Callable[[], int], timeout_s: float,
                 inject: Optional[Callable[[str], None]] = None,
                 on_abandon: Optional[Callable[..., None]] = None,
                 monitor: Optional[AbortMonitor] = None):
        self.plans, self.current_version, self.timeout_s = plans, current_version, timeout_s
        self.inject = inject  # fault-injection seam: called before each wait, may raise
        # told of every collective left in flight (its completion event): GroupFormer.abandoned
        self.on_abandon = on_abandon
        self.monitor = monitor
        # NCCL's semantics (the monitor exists for them): completion is polled, never a future
        self.polled = monitor is not None
        self.failures = 0
        self.first_failure_at: Optional[float] = None  # monotonic time of the first failed wait

    def check(self, what: str) -> None:
        """Raise ``SwitchRequested`` if a newer plan exists (call between communications), or
        ``CommTimeoutError`` if the monitor aborted this plan's communicators."""
        newer = self.plans.newer_than(self.current_version())
        if newer is not None:
            raise SwitchRequested(newer.version, what)
        monitor = self.monitor
        if monitor is not None and monitor.broken is not None:
            self._failed()
            raise CommTimeoutError(f"{what}: this plan's communicators were aborted "
                                   f"({monitor.broken})")

    def superseded(self) -> bool:
        """True once a plan newer than the one the worker runs is known (lock-only)."""
        return self.plans.newer_than(self.current_version()) is not None

    def __call__(self, work, what: str) -> None:
        if self.inject is not None:
            self.inject(what)
        deadline = time.monotonic() + self.timeout_s
        done, error, waited = _completion(work, self.timeout_s)
        polled = self.polled and not waited
        delay = _POLL_FIRST_S
        while not (work.is_completed() if polled else done.is_set()):
            try:
                self.check(what)
            except SwitchRequested:
                self._abandon(done, waited)
                raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon(done, waited)
                self._failed()
                raise CommTimeoutError(f"{what} did not complete within {self.timeout_s:g}s")
            if polled:  # the future may say done at enqueue: only is_completed() tells
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _POLL_S)
            else:  # gloo: sleep on the future, the plan watch looked at in between
                done.wait(min(_POLL_S, remaining))
        self._trust(what)  # NCCL: an aborted work completes as a success
        try:
            if error:
                raise error[0]
            if not waited:  # surface its error; on NCCL, order this stream after it
                work.wait()
        except RuntimeError as exc:
            self._failed()
            raise CommTimeoutError(f"{what} failed: {str(exc).splitlines()[0][:200]}") from exc
        if self.monitor is not None:
            self.monitor.progress()

    def _trust(self, what: str) -> None:
        """A completed wait counts only if its communicators were not aborted: on NCCL an
        aborted work is completed with no error and ``wait()`` returns normally, on partial
        data. Raises ``SwitchRequested`` (a newer plan caused the abort) or
        ``CommTimeoutError`` once the monitor has begun an abort."""
        monitor = self.monitor
        reason = monitor.broken if monitor is not None else None
        if reason is None:
            return
        self._failed()
        newer = self.plans.newer_than(self.current_version())
        if newer is not None:
            raise SwitchRequested(newer.version, what)
        raise CommTimeoutError(f"{what} completed only because this plan's communicators were "
                               f"aborted ({reason}); its result is discarded")

    def _abandon(self, done: threading.Event, waited: bool) -> None:
        """Left in flight: a collective keeps its group's worker busy until gloo times it out
        (recorded for the reaper), and on NCCL its kernel spins until the communicators are
        aborted (``on_abandon`` does it, whatever the future says); point-to-point works on
        gloo (``waited``: on a helper thread) hold nothing."""
        if not waited and self.on_abandon is not None and (self.polled or not done.is_set()):
            self.on_abandon(done)

    def _failed(self) -> None:
        self.failures += 1
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def reset(self) -> None:
        self.first_failure_at = None


def _completion(work, timeout_s: float) -> tuple[threading.Event, list, bool]:
    """An event set when ``work`` completes, a list that receives its error, and whether
    ``wait()`` was already called (it must not be called twice on a point-to-point work: a
    second wait waits for another message).

    Collectives expose a future. Gloo's point-to-point works progress only inside ``wait()`` and
    a ``wait`` that times out closes the connection, so they are waited on, once, with the full
    deadline, by a helper thread; an abandoned helper ends when the group is destroyed.
    """
    event, error = threading.Event(), []
    try:
        future = work.get_future()
    except RuntimeError:
        def wait() -> None:
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            except RuntimeError as exc:
                error.append(exc)
            event.set()

        threading.Thread(target=wait, name="p2p-wait", daemon=True).start()
        return event, error, True
    future.add_done_callback(lambda _f: event.set())
    return event, error, False
