"""``Harness``: drive a running job through a scenario, one fault at a time, and report.

For each entry, in order: wait for its trigger (seconds since the start, or the job's current
step), take a baseline of the job, inject, then wait (bounded by the entry's
``detect_timeout_s``, counted again from an escalation) for the job's reaction and (bounded by
``recover_timeout_s``) for training to go on; follow-ups (resume, thaw, escalation) fire on
time meanwhile; the next fault starts once the previous one is settled and its follow-ups that
end it have fired (or the job ended, or the run was stopped: ``close`` then ends the fault). A node that a fault took away and that should come back once the fault
ended (a thawed agent, a healed partition, in an elastic job) is waited for too
(``recover_timeout_s``): the fault is ``recovered`` only once a plan took the node back and was
switched to. A fault the job should ride through (an etcd restart or stall, an etcd member cut
off) is ``survived`` only when training went on after it and the journal shows no reaction to it
(no replan, restart, leave, failure, stall or unreachable event before the next fault). With
``wait_end_s`` the run then waits (bounded) for the job to end, so that the totals (samples lost,
last step) cover the whole run. The report carries how the job stood at the end (``JobEnd``,
from ``rdzv/state``); a job that failed is no recovery: the last fault injected before its end
is ``not recovered`` whatever was seen before, with the recorded reason in its note.

Promises: every wait has a deadline on ``time.monotonic``, and waits on the observer's job
view (``JobObserver.wait_change``: woken by the job's next change, at most ``poll_s`` so that
follow-ups, progress files and ``stop`` are checked that often), never a plain sleep; a fault
that cannot be applied (its target is gone, the harness does not own the etcd) or whose trigger
never comes (the job ended) is reported ``not injected`` with the reason (a process a record names that is not provably
the job's is refused, never signalled, and the refusal is in the row's note), and the run goes
on; nothing is marked detected that the job did not record itself; ``run`` always ends with
``InjectContext.close`` (stopped processes resumed, started agents stopped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from hspmd_elastic.coord.api import CoordinationError
from launcher.inject.api import (
    NOT_DETECTED,
    NOT_RECOVERED,
    RECOVERED,
    SURVIVED,
    JOB_FAILED,
    JOB_RUNNING,
    FaultRow,
    InjectError,
    JobEnd,
    Report,
    TargetNotFound,
)
from launcher.inject.detect import (
    Baseline,
    Detection,
    JobObserver,
    Recovery,
    expects_reaction,
    expects_rejoin,
    match_detection,
    match_recovery,
    match_rejoin,
    progress_after,
    reactions,
    replan_changes,
    switch_started,
)
from launcher.inject.faults import InjectContext, Injection, make_fault
from launcher.inject.report import finalize
from launcher.inject.scenario import FaultSpec, Scenario

log = logging.getLogger(__name__)

POLL_S = 0.05
TARGET_WAIT_S = 10.0


class Harness:
    """Runs ``scenario`` against the job that ``ctx`` and ``observer`` point at."""

    def __init__(self, scenario: Scenario, ctx: InjectContext, observer: JobObserver,
                 poll_s: float = POLL_S, on_row: Optional[Callable[[FaultRow], None]] = None,
                 wait_end_s: float = 0.0):
        self.scenario = scenario
        self.wait_end_s = wait_end_s
        self.ctx = ctx
        self.observer = observer
        self.poll_s = poll_s
        self.on_row = on_row
        self._stop = threading.Event()
        self._start_mono = 0.0
        self._start_wall = 0.0
        self._ended: Optional[str] = None
        self._stopped_by = ""
        self._generation = 0  # the observer's view generation last waited from

    def stop(self, why: str = "stopped") -> None:
        """Ask a running ``run`` to stop at its next wait (remaining faults: not injected;
        ``close`` lifts what the faults still hold). Safe from a signal handler."""
        self._stopped_by = self._stopped_by or why
        self._stop.set()

    # ------------------------------------------------------------------------------- run
    def run(self) -> Report:
        self._start_mono, self._start_wall = time.monotonic(), time.time()
        report = Report(self.scenario.name, self.ctx.job, [], self._start_wall)
        bases: dict[int, tuple[Baseline, Optional[int]]] = {}
        try:
            for spec in self.scenario.faults:
                row, base, rnd = self._one(spec)
                report.rows.append(row)
                if base is not None:
                    bases[row.index] = (base, rnd)
                log.info("[%s] fault %s: %s%s", self.ctx.job, spec.describe(), row.outcome,
                         f" ({row.note})" if row.note else "")
                if self.on_row is not None:
                    self.on_row(row)
            self._wait_end()
        finally:
            self.ctx.close()
        self._rode_through(report.rows, bases)
        report = finalize(report, self.observer.points(), bases)
        report.job_end, report.stopped = self._job_end(), self._stopped_by
        _blame_failed_end(report)
        return report

    def _job_end(self) -> JobEnd:
        ended = self.observer.job_end()
        if ended is None:
            return JobEnd(JOB_RUNNING)
        return JobEnd(ended.state, ended.reason, self._rel(ended.at) if ended.at else None)

    def _rode_through(self, rows: list[FaultRow], bases: dict) -> None:
        """A fault the job should ride through (``survived``) that the job reacted to anyway,
        before the next fault (a replan, a restart, a node seen leaving), is not survived. The
        late echoes of an agent killed earlier (its lease expiring: a ``leave`` and its
        replan) are not reactions to it."""
        events = self.observer.events()
        injected = [r for r in rows if r.index in bases]
        killed: set[str] = set()  # nodes whose agent a fault killed and no join brought back
        for row, nxt in zip(injected, injected[1:] + [None]):
            if row.fault == "kill-agent":
                killed.add(row.target.get("node"))
            elif row.fault == "join":
                killed.discard(row.target.get("node"))
            if row.outcome != SURVIVED:
                continue
            until = bases[nxt.index][0].last_seq if nxt is not None else None
            seen = [e for e in reactions(events, bases[row.index][0].last_seq, until)
                    if not _about(e, killed)]
            if seen:
                row.outcome = NOT_RECOVERED
                row.note = "; ".join([row.note] * bool(row.note) + [
                    "the job reacted to a fault it should ride through: " + ", ".join(
                        f"{e.type} event #{e.seq}" for e in seen[:3])])

    def _wait_end(self) -> None:
        """With ``wait_end_s``: let the job finish, so the totals cover the whole run, and the
        agents this harness started end by themselves (``close`` stops what is left)."""
        deadline = time.monotonic() + self.wait_end_s
        while self.wait_end_s > 0 and not self._job_ended() and not self._stop.is_set():
            if time.monotonic() >= deadline:
                log.warning("[%s] job still running %.0fs after the last fault; reporting "
                            "progress so far", self.ctx.job, self.wait_end_s)
                return
            self._await(deadline)
        while self.wait_end_s > 0 and time.monotonic() < deadline and not self._stop.is_set() \
                and any(p.poll() is None for p in self.ctx.spawned.values()):
            self._stop.wait(self.poll_s * 4)

    def _rel(self, wall: Optional[float]) -> Optional[float]:
        return None if wall is None else round(wall - self._start_wall, 3)

    def _one(self, spec: FaultSpec) -> tuple[FaultRow, Optional[Baseline], Optional[int]]:
        row = FaultRow(spec.index, spec.fault, dict(spec.target))
        why = self._wait_trigger(spec)
        if why:
            row.note = why
            return row, None, None
        try:
            base, inj = self._inject(spec)
        except (InjectError, CoordinationError, OSError) as exc:
            row.note = str(exc)
            return row, None, None
        row.injected_at, row.target, row.detail = self._rel(base.at), inj.injected.target, \
            inj.detail
        row.note = str(inj.detail.get("done_by", ""))  # how it was done, when it has a choice
        if inj.detail.get("refused"):  # records that named processes not the job's
            row.note = "; ".join([row.note] * bool(row.note) + [
                "refused (not signalled): " + "; ".join(inj.detail["refused"])])
        det = self._wait_detection(spec, base, inj, row)
        rec: Optional[Recovery] = None
        reaction = expects_reaction(inj.injected.fault, inj.injected.xid, inj.injected.target)
        if det is not None or not reaction:
            rec = self._wait_recovery(spec, base, inj, det, row)
        self._finish_timers(inj, base, det, row)
        if det is None and reaction and inj.injected.ended_at is not None:
            rec = self._went_on(spec, base, inj)
        if rec is None and not reaction and inj.injected.ended_at is not None \
                and self._job_ended() == "succeeded":
            # The job ended well after the fault (an etcd fault near the last step: no
            # progress record came after it, but the end record needs etcd back): it survived.
            rec = Recovery(time.time(), "the job succeeded after the fault ended")
        back = det is None or rec is None or self._rejoined(spec, base, inj, row)
        if det is not None:
            row.detected_at, row.detected_by = self._rel(det.at), det.by
            started = switch_started(self.observer.events(),
                                     det.seq if det.seq is not None else base.last_seq)
            if started is not None and rec is not None and started <= rec.at:
                row.detail["switch_started_at"] = self._rel(started)
        if rec is not None:
            row.recovered_at, row.recovered_by = self._rel(rec.at), rec.by
        if not reaction:
            row.outcome = SURVIVED if rec else NOT_RECOVERED
            row.detected_by = row.detected_by or "n/a (no reaction expected)"
        elif det is None:
            row.outcome = NOT_DETECTED
            if rec is not None:
                row.note = "the job never noticed; it went on once the fault ended"
        else:
            row.outcome = RECOVERED if rec and back else NOT_RECOVERED
        if self._ended and row.outcome not in (RECOVERED, SURVIVED):
            row.note = (row.note + "; " if row.note else "") + f"job {self._ended}"
        return row, base, rec.round if rec else None

    # ---------------------------------------------------------------------------- phases
    def _await(self, deadline: Optional[float] = None) -> None:
        """Wait for the job's next change (the observer's view), at most ``poll_s`` and never
        past ``deadline``; at once when it changed since the last wait."""
        left = self.poll_s if deadline is None else \
            min(self.poll_s, max(deadline - time.monotonic(), 0.0))
        if self._stop.is_set():
            return
        self._generation = self.observer.wait_change(self._generation, left)

    def _job_ended(self) -> Optional[str]:
        if self._ended is None:  # the observer's view: no etcd read
            self._ended = self.observer.job_ended()
        return self._ended

    def _current_step(self) -> int:
        points = self.observer.points()
        if not points:
            return -1
        newest = max(p.round for p in points)
        return max(p.step for p in points if p.round == newest)

    def _wait_trigger(self, spec: FaultSpec) -> str:
        """'' once the entry is due; otherwise why it never came. A time trigger fires at its
        time; a step trigger waits at most the scenario's ``trigger_timeout_s``."""
        if spec.at_step is None:
            deadline = self._start_mono + (spec.at_s or 0.0)
        else:
            deadline = time.monotonic() + self.scenario.trigger_timeout_s
        while True:
            if self._stop.is_set():
                return "the harness was stopped"
            ended = self._job_ended()
            if ended:
                return f"job {ended} before the trigger"
            if spec.at_step is not None and self._current_step() >= spec.at_step:
                return ""
            if time.monotonic() >= deadline:
                if spec.at_step is None:
                    return ""
                return (f"trigger (step {spec.at_step}) did not come within "
                        f"{self.scenario.trigger_timeout_s:.0f}s")
            self._await(deadline)

    def _inject(self, spec: FaultSpec) -> tuple[Baseline, Injection]:
        """Inject, retrying a little while the target is between restarts (or etcd blinks)."""
        deadline = time.monotonic() + TARGET_WAIT_S
        fault = make_fault(spec)
        while True:
            base = self.observer.baseline()
            try:
                inj = fault.inject(self.ctx)
                log.info("[%s] injected %s: %s", self.ctx.job, spec.describe(), inj.detail)
                return base, inj
            except (TargetNotFound, CoordinationError) as exc:
                if time.monotonic() >= deadline or self._job_ended() or self._stop.is_set():
                    raise
                log.debug("[%s] %s: retrying the injection: %s", self.ctx.job,
                          spec.describe(), exc)
            self._stop.wait(self.poll_s * 4)

    def _fire_timers(self, inj: Injection, base: Baseline, detected: bool,
                     row: FaultRow) -> bool:
        """Fire the follow-ups that are due; True when an escalation fired."""
        elapsed = time.time() - base.at
        escalated = False
        for timer in inj.timers:
            if timer.done or elapsed < timer.after_s:
                continue
            timer.done = True
            if timer.only_if_undetected and detected:
                continue
            timer.action()
            if timer.only_if_undetected:
                row.escalated = escalated = True
                row.note = f"the job had not reacted after {timer.after_s:.1f}s: sent " \
                           f"{timer.label}"
            if timer.ends_fault:
                inj.injected.ended_at = time.time()
        return escalated

    def _wait_detection(self, spec: FaultSpec, base: Baseline, inj: Injection,
                        row: FaultRow) -> Optional[Detection]:
        if not expects_reaction(inj.injected.fault, inj.injected.xid, inj.injected.target):
            return None
        deadline = time.monotonic() + spec.detect_timeout_s
        while True:
            if self._fire_timers(inj, base, False, row):  # the job gets time to see the kill
                deadline = time.monotonic() + spec.detect_timeout_s
            det = match_detection(inj.injected, base, self.observer.events(),
                                  self.observer.verdicts())
            if det is not None:
                if row.escalated:
                    det = Detection(det.at, det.by + " (after the escalation)", det.seq)
                return det
            escalation_due = any(t.only_if_undetected and not t.done for t in inj.timers)
            if (time.monotonic() >= deadline and not escalation_due) or self._job_ended() \
                    or self._stop.is_set():
                return None
            self._await()

    def _wait_recovery(self, spec: FaultSpec, base: Baseline, inj: Injection,
                       det: Optional[Detection], row: FaultRow) -> Optional[Recovery]:
        deadline = time.monotonic() + spec.recover_timeout_s
        while True:
            self._fire_timers(inj, base, det is not None, row)
            rec = match_recovery(inj.injected, base, det, self.observer.events(),
                                 self.observer.points())
            if rec is not None:
                return rec
            if time.monotonic() >= deadline or self._job_ended() or self._stop.is_set():
                return None
            self._await(deadline)

    def _went_on(self, spec: FaultSpec, base: Baseline, inj: Injection) -> Optional[Recovery]:
        """After an unnoticed fault that ended (resume, thaw): did training go on?"""
        deadline = time.monotonic() + spec.recover_timeout_s
        while True:
            rec = progress_after(inj.injected, base, self.observer.points())
            if rec is not None or time.monotonic() >= deadline or self._job_ended() \
                    or self._stop.is_set():
                return rec
            self._await(deadline)

    def _rejoined(self, spec: FaultSpec, base: Baseline, inj: Injection, row: FaultRow) -> bool:
        """After a fault that planned a node away and ended (thaw, heal): wait (bounded by
        ``recover_timeout_s``) until a plan takes the node back and is switched to; False when
        it did not come (the row says so)."""
        away = expects_rejoin(inj.injected, self.observer.events(), base.last_seq)
        if away is None:
            return True
        deadline = time.monotonic() + spec.recover_timeout_s
        while True:
            back = match_rejoin(inj.injected, self.observer.events(), away)
            if back is not None:
                row.detail.update(rejoined_at=self._rel(back.at), rejoined_by=back.by)
                row.note = "; ".join([row.note] * bool(row.note) + [
                    f"node {inj.injected.target['node']} back at {back.by} "
                    f"(+{back.at - self._start_wall:.2f}s)"])
                return True
            if time.monotonic() >= deadline or self._job_ended() or self._stop.is_set():
                row.note = "; ".join([row.note] * bool(row.note) + [
                    f"node {inj.injected.target['node']} did not come back within "
                    f"{spec.recover_timeout_s:g}s after the fault ended"])
                return False
            self._await(deadline)

    def _finish_timers(self, inj: Injection, base: Baseline, det: Optional[Detection],
                       row: FaultRow) -> None:
        """Follow-ups that end the fault (resume, thaw) fire before the next fault starts."""
        pending = [t for t in inj.timers if not t.done and t.ends_fault]
        if not pending:
            return
        deadline = time.monotonic() + max(t.after_s for t in pending) + 1.0
        while any(not t.done for t in pending) and time.monotonic() < deadline:
            self._fire_timers(inj, base, det is not None, row)
            if self._stop.is_set() or self._job_ended():
                return  # nothing left to wait for: ``close`` ends the fault (unthrottles...)
            self._await(deadline)


def _blame_failed_end(report: Report) -> None:
    """Pure: a job that ended ``failed`` did not recover from the last fault injected before
    its end, whatever the rows saw before (a switch that began, a step that resumed)."""
    end = report.job_end
    if end is None or end.state != JOB_FAILED:
        return
    before = [r for r in report.rows if r.injected_at is not None
              and (end.at is None or r.injected_at <= end.at)]
    if not before:
        return
    row = before[-1]
    if row.outcome in (RECOVERED, SURVIVED):
        row.outcome = NOT_RECOVERED
    when = "" if end.at is None else f" at +{end.at:.2f}s"
    row.note = "; ".join([n for n in row.note.split("; ") if n and n != "job failed"] + [
        f"job failed{when}: {end.reason or 'no reason recorded'}"])


def _about(ev, nodes: set) -> bool:
    """Whether journal event ``ev`` concerns only ``nodes`` (its node, or every change its
    replan names)."""
    if ev.type != "replan":
        return ev.node in nodes
    changes = replan_changes(ev)
    return bool(changes) and all(
        targets and all(t.split(":")[0] in nodes for t in targets) for _, targets in changes)
