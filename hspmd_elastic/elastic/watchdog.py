"""Noticing plan changes, and waiting on communication without ever hanging on a dead peer.

``PlanWatcher`` keeps the newest ``plan/current`` record of the job, fed by a ``PrefixWatch`` on a
background thread (list, then watch) and re-read from etcd while a caller waits for a plan, so a
missed event is repaired on the next poll. ``Watchdog`` is a ``graph.comm.Waiter``: it waits for a
pending ``Work`` until it completes, its deadline passes (``CommTimeoutError``) or a plan newer than
the one the worker runs is published (``SwitchRequested``), whichever comes first.

A collective it leaves in flight goes to ``on_abandon`` (the runtime passes
``GroupFormer.abandoned``): on gloo the reaper keeps its groups until gloo ends it; on NCCL, whose
kernel would spin until NCCL's own timeout, the plan's communicators are aborted there and then
(``elastic.group.end_process_groups``), so the rank is out of its collective within this limit.
Waits work the same on both backends: completion is a ``Work``'s future (NCCL completes it when
the GPU work ends), never a blocking ``wait``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Optional

from hspmd_elastic.coord import EtcdClient, PrefixWatch, read_plan, schema
from hspmd_elastic.coord.api import CoordinationError, EventType, WatchEvent
from hspmd_elastic.elastic.api import SwitchRequested
from hspmd_elastic.graph.comm import CommTimeoutError

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often a pending wait looks at the plan watch


class PlanWatcher:
    """The newest published plan of ``job``, and when this process first saw each version."""

    def __init__(self, client: EtcdClient, job: str, wall_clock: Callable[[], float] = time.time):
        self.client, self.job = client, job
        self._wall = wall_clock
        self._cond = threading.Condition()
        self._latest: Optional[schema.PlanRecord] = None
        self._seen_at: dict[int, float] = {}
        self._watch = PrefixWatch(client, schema.plan_current_key(job), self._on_event,
                                  decode=True, initial=True, name=f"plan watch {job}")

    def start(self, timeout: Optional[float] = None) -> "PlanWatcher":
        self._watch.start(timeout)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._watch.stop(timeout)

    def _on_event(self, event: WatchEvent) -> None:
        if event.type is EventType.PUT and isinstance(event.record, schema.PlanRecord):
            self._offer(event.record)

    def _offer(self, record: schema.PlanRecord) -> None:
        with self._cond:
            if self._latest is not None and record.version <= self._latest.version:
                return
            self._latest = record
            self._seen_at.setdefault(record.version, self._wall())
            self._cond.notify_all()

    @property
    def latest(self) -> Optional[schema.PlanRecord]:
        with self._cond:
            return self._latest

    def seen_at(self, version: int) -> Optional[float]:
        with self._cond:
            return self._seen_at.get(version)

    def newer_than(self, version: int) -> Optional[schema.PlanRecord]:
        """The newest plan if its version is above ``version`` (a cheap, lock-only check)."""
        latest = self.latest
        return latest if latest is not None and latest.version > version else None

    def wait_newer(self, version: int, timeout: float,
                   poll_s: float = 1.0) -> Optional[schema.PlanRecord]:
        """Block until a plan newer than ``version`` is known (None after ``timeout`` seconds).

        Re-reads ``plan/current`` every ``poll_s`` in case the watch stream lost an event."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                found = self._cond.wait_for(
                    lambda: self._latest is not None and self._latest.version > version,
                    max(0.0, min(poll_s, deadline - time.monotonic())))
                if found:
                    return self._latest
            if time.monotonic() >= deadline:
                return None
            try:
                record, _ = read_plan(self.client, self.job)
            except CoordinationError as exc:
                log.warning("job %s: reading plan/current failed (%s); still waiting", self.job,
                            exc)
                continue
            if record is not None:
                self._offer(record)


class Watchdog:
    """A ``Waiter`` for ``graph.comm``: completion, deadline, or a newer plan.

    ``current_version()`` returns the plan version the worker runs; a published plan above it
    aborts the wait with ``SwitchRequested``. The wait sleeps on the work's completion and looks
    at the plan watch every ``_POLL_S`` seconds.
    """

    def __init__(self, plans: PlanWatcher, current_version: Callable[[], int], timeout_s: float,
                 inject: Optional[Callable[[str], None]] = None,
                 on_abandon: Optional[Callable[[threading.Event], None]] = None):
        self.plans, self.current_version, self.timeout_s = plans, current_version, timeout_s
        self.inject = inject  # fault-injection seam: called before each wait, may raise
        # told of every collective left in flight (its completion event): see GroupReaper
        self.on_abandon = on_abandon
        self.failures = 0
        self.first_failure_at: Optional[float] = None  # monotonic time of the first failed wait

    def check(self, what: str) -> None:
        """Raise ``SwitchRequested`` if a newer plan exists (call between communications)."""
        newer = self.plans.newer_than(self.current_version())
        if newer is not None:
            raise SwitchRequested(newer.version, what)

    def __call__(self, work, what: str) -> None:
        if self.inject is not None:
            self.inject(what)
        deadline = time.monotonic() + self.timeout_s
        done, error, waited = _completion(work, self.timeout_s)
        while not done.is_set():
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
            done.wait(min(_POLL_S, remaining))  # the plan watch is checked between sleeps
        try:
            if error:
                raise error[0]
            if not waited:  # a collective: surface its error (a second wait is a no-op)
                work.wait()
        except RuntimeError as exc:
            self._failed()
            raise CommTimeoutError(f"{what} failed: {str(exc).splitlines()[0][:200]}") from exc

    def _abandon(self, done: threading.Event, waited: bool) -> None:
        """A collective left in flight keeps its group's worker busy until gloo times it out;
        point-to-point works (``waited``: on a helper thread) do not."""
        if not waited and not done.is_set() and self.on_abandon is not None:
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
