"""What the job did about a fault: detection and recovery, from what it wrote to etcd.

``JobObserver`` reads the job through one job view (``launcher.jobview.WatchedJob``: the
``events/``, ``devices/``, ``workers/``, ``rdzv/`` and ``plan/head`` tables, one watch each,
every change in order across etcd restarts; ``wait_change`` wakes on any of them), keeps the
history of device verdicts the view delivered, and collects training progress from a
``ProgressSource`` (the ``workers/`` records, or the JSON-lines progress files a training script
writes). The decisions are pure functions of those
observations, so they are unit-tested without a job:

* ``match_detection``: the first reaction of the job after the injection that names the fault's
  target: a ``failure``/``stall`` event for a worker fault (by pid when the event lists pids),
  a ``leave`` or ``unreachable`` event about the node, or a ``failure`` of its peers, for an
  agent fault (its peers' probes may report the dead node before its lease expires); the
  device's verdict under ``devices/<node>/<device>`` (``failed``; ``degraded`` for thermal,
  ``suspect`` for suspect, ``healthy`` for recover) or the leader's event about the device
  (``failure``/``degrade``, ``drain``, ``recover``) for a device fault; a ``join`` event for a
  join; a ``partition`` of a node is matched like an agent fault (an ``unreachable`` event
  about it: its data link cut); a ``throttle`` (``unthrottle``) by the first ``replan`` with a
  ``degrade`` (``recover``) change naming the worker's device ``<node>:<local_rank>`` (the
  leader saw it compute slower, or fast again); an etcd restart or stall, a partition of an
  etcd member and an informational Xid expect no reaction (``reactions``: the journal must
  show none);
* ``match_recovery``: the ``switch-done`` event of the plan that handled the fault (elastic jobs:
  the first ``replan`` whose ``reason`` names the target, ``replan_changes``), else the first
  progress in a newer round or plan than the one the fault hit (restart-mode jobs); for faults
  the job should ride through: the first progress past the step the fault hit, once the fault
  ended;
* ``expects_rejoin`` / ``match_rejoin``: a node planned away by a fault that ended (a thawed
  agent, a healed partition) comes back: the ``switch-done`` of the first plan that takes it
  back (a ``join`` change);
* ``steps_lost`` / ``lineage_gaps``: steps recomputed after a fault, steps never trained.

Nothing here ever invents a detection: no matching record means "not detected".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import EventType, WatchEvent
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.ids import device_id, parse_device_id
from launcher.health.rules import classify_xid
from launcher.inject.api import (
    AGENT_FAULTS,
    DEVICE_FAULTS,
    ETCD_FAULTS,
    NETWORK_FAULTS,
    WORKER_FAULTS,
    ProgressPoint,
)
from launcher.inject import progress as _progress
from launcher.inject.progress import EtcdProgress, ProgressSource
from launcher.inject.scenario import SPEED_FAULTS
from launcher.jobview import Table, WatchedJob

# The progress sources, importable from here too (the observer's callers use them together).
FileProgress, default_progress = _progress.FileProgress, _progress.default_progress

# Faults that take a node away as a whole, as far as detection goes: its agent (killed, frozen)
# or its links (a partition: its lease expires, its peers' collectives fail, or the peers
# report it unreachable over the data network).
NODE_FAULTS = (*AGENT_FAULTS, *NETWORK_FAULTS)
# A device fault's verdict (``devices/<node>/<index>``), its journal events and the kind of the
# replan change that handles it; any other device fault fails the device.
DEVICE_VERDICT = {"thermal": "degraded", "suspect": "suspect", "recover": "healthy"}
DEVICE_EVENTS = {"thermal": ("failure", "degrade"), "suspect": ("drain",),
                 "recover": ("recover",)}
DEVICE_CHANGES = {"thermal": ("degrade",), "suspect": ("drain",), "recover": ("recover",)}
# The replan change that handles a worker's CPU capped, or the cap lifted.
SPEED_CHANGES = {"throttle": "degrade", "unthrottle": "recover"}
# Journal events that say a job reacted: a fault it should ride through must cause none.
REACTIONS = ("replan", "restart", "leave", "failure", "stall", "unreachable")

log = logging.getLogger(__name__)

WATCH_START_TIMEOUT_S = 10.0
# What the observer reads of the job view; its watches ask etcd for progress every second, so a
# stalled member is left quickly.
OBSERVED = (Table.EVENTS, Table.DEVICES, Table.WORKERS, Table.RDZV, Table.HEAD)
WATCH_PROGRESS_S = 1.0


# ------------------------------------------------------------------------------- observations
@dataclass(frozen=True)
class DeviceVerdictSeen:
    """A ``devices/<node>/<index>`` record as the observer saw it (``seen`` = order number)."""

    seen: int
    node: str
    index: int
    state: str
    reason: str
    at: float


@dataclass(frozen=True)
class Baseline:
    """The job as it was just before an injection."""

    at: float  # wall clock of the injection
    last_seq: int  # last event sequence number seen
    devices_seen: int  # how many device records were seen
    round: int  # newest round/plan version in the progress (or rdzv/plan), -1 if none
    step: int  # most steps completed so far, -1 if none


@dataclass(frozen=True)
class Detection:
    at: float  # wall clock (the writer's, for events and verdicts)
    by: str
    seq: Optional[int] = None


@dataclass(frozen=True)
class Recovery:
    at: float
    by: str
    round: Optional[int] = None


@dataclass
class Injected:
    """What an injection did, as detection needs it (``ended_at`` is set when a follow-up
    ends the fault)."""

    fault: str
    target: dict[str, Any]
    pids: tuple[int, ...] = ()
    xid: Optional[int] = None
    ended_at: Optional[float] = None  # wall clock the fault stopped acting (thaw, etcd back)


def expects_reaction(fault: str, xid: Optional[int] = None,
                     target: Optional[dict[str, Any]] = None) -> bool:
    """False for faults a job should ride through without reacting."""
    if fault in ETCD_FAULTS:
        return False
    if fault in NETWORK_FAULTS and target is not None and "node" not in target:
        return False  # an etcd member cut off: the clients fail over
    if fault == "xid" and xid is not None:
        return classify_xid(xid).fatal
    return True


# ------------------------------------------------------------------------------- pure matching
def _event_workers(detail: schema.Detail) -> tuple[set[int], set[int]]:
    """(pids, local ranks) of the workers a ``failure`` or ``stall`` event names."""
    if isinstance(detail, schema.FailureDetail):
        return {e.pid for e in detail.exits}, {e.local_rank for e in detail.exits}
    if isinstance(detail, schema.StallDetail):
        return ({detail.pid} if detail.pid is not None else set(),
                {detail.local_rank} if detail.local_rank is not None else set())
    return set(), set()


def _worker_event(ev: schema.EventRecord, inj: Injected) -> bool:
    if ev.type not in ("failure", "stall"):
        return False
    pids, slots = _event_workers(schema.event_detail(ev))
    if pids and inj.pids:
        return bool(pids & set(inj.pids))
    node, slot = inj.target.get("node"), inj.target.get("local_rank")
    if slots and slot is not None and slot not in slots:
        return False  # e.g. a stall event: node and slot, no pid
    return node is None or ev.node == node


def _agent_event(ev: schema.EventRecord, node: str) -> bool:
    """A ``leave`` about the node, an ``unreachable`` about it, or a ``failure`` anywhere. When
    an agent dies its workers die with it: the surviving ranks' collectives fail (a restart-mode
    job notices the loss that way before the node's lease expires), and their agents' probes
    find the node unreachable; whichever comes first, the lease's expiry or the probes' report,
    is how the job noticed (after an ``unreachable`` replan the node is out of the plan, so its
    expiring lease publishes nothing and journals no ``leave``). For a partition the
    ``unreachable`` report is the data link cut."""
    if ev.type == "leave":
        return ev.node == node or node in schema.event_detail(ev).nodes
    if ev.type == "unreachable":
        return ev.node == node
    return ev.type == "failure"


def _device_event(ev: schema.EventRecord, inj: Injected) -> bool:
    if ev.type not in DEVICE_EVENTS.get(inj.fault, ("failure", "degrade")) \
            or ev.node != inj.target.get("node"):
        return False
    want = str(inj.target.get("device"))
    devices = schema.event_detail(ev).devices  # every change event names its devices
    return not devices or any(_split_target(d)[1] == want for d in devices)


def _split_target(target: str) -> tuple[str, str]:
    """``(node, index)`` of a device id ``"<node>:<index>"`` (the index as text); a target that
    is not a device id (a node name, a bare index) is its own node and its own index."""
    try:
        node, index = parse_device_id(target)
    except ValueError:
        return target, target
    return node, str(index)


def switch_started(events: Sequence[schema.EventRecord], after_seq: int) -> Optional[float]:
    """When the job started switching plans after ``after_seq`` (elastic jobs): the ``replan``
    that replaces a plan (``contract.events.switch_of``)."""
    for ev in events:
        mark = schema.switch_of(ev) if ev.seq > after_seq else None
        if mark is not None and mark.phase == "start":
            return ev.at
    return None


def match_detection(inj: Injected, base: Baseline, events: Sequence[schema.EventRecord],
                    verdicts: Sequence[DeviceVerdictSeen] = ()) -> Optional[Detection]:
    """The job's first reaction to the fault after ``base``, or None (not detected)."""
    if not expects_reaction(inj.fault, inj.xid, inj.target):
        return None
    later = [e for e in events if e.seq > base.last_seq]
    fault = inj.fault
    if fault in DEVICE_FAULTS:
        want = DEVICE_VERDICT.get(fault, "failed")
        for v in verdicts:
            if (v.seen >= base.devices_seen and v.node == inj.target["node"]
                    and v.index == inj.target["device"] and v.state == want):
                return Detection(v.at, f"verdict {v.state} at devices/{v.node}/{v.index}")
    for ev in later:
        if fault in WORKER_FAULTS:
            hit = _worker_event(ev, inj)
        elif fault in NODE_FAULTS:
            hit = _agent_event(ev, inj.target["node"])
        elif fault in DEVICE_FAULTS:
            hit = _device_event(ev, inj)
        elif fault in SPEED_FAULTS:
            hit = any(_names_fault(inj, kind, targets) for kind, targets in replan_changes(ev))
        elif fault == "join":
            hit = ev.type == "join" and (ev.node in (None, inj.target["node"])
                                         or inj.target["node"] in schema.event_detail(ev).nodes)
        else:
            hit = False
        if hit:
            return Detection(ev.at, f"{ev.type} event #{ev.seq}", ev.seq)
    return None


def replan_changes(ev: schema.EventRecord) -> list[tuple[str, tuple[str, ...]]]:
    """Pure: the changes a ``replan`` event lists (``ReplanDetail.changes``), as ``(kind,
    targets)``: the node of a join/leave, else the devices (``[]`` for any other event)."""
    if ev.type != "replan":
        return []
    return [(c.kind, (c.node,) if c.kind in ("join", "leave") else tuple(c.devices))
            for c in schema.event_detail(ev).changes]


def _names_fault(inj: Injected, kind: str, targets: tuple[str, ...]) -> bool:
    """Does one change of a replan's reason handle the injected fault?"""
    t = inj.target
    node = t.get("node")
    if inj.fault in WORKER_FAULTS:
        slot = t.get("local_rank")
        return kind in ("failure", "stall", "leave") and any(
            d == node or (slot is not None and d == device_id(node, slot)) or
            (slot is None and _split_target(d)[0] == node) for d in targets)
    if inj.fault in NODE_FAULTS:
        return kind in ("leave", "failure", "stall", "unreachable") and any(
            d == node or _split_target(d)[0] == node for d in targets)
    if inj.fault in DEVICE_FAULTS:
        if inj.fault == "recover" and kind == "join" and node in targets:
            return True  # the node had no usable device left: it comes back as a join
        return kind in DEVICE_CHANGES.get(inj.fault, ("failure",)) and \
            device_id(node, t.get("device")) in targets
    if inj.fault in SPEED_FAULTS:
        return kind == SPEED_CHANGES[inj.fault] and \
            device_id(node, t.get("local_rank")) in targets
    if inj.fault == "join":
        return kind == "join" and node in targets
    return False


def handling_plan(inj: Injected, events: Sequence[schema.EventRecord],
                  after_seq: int) -> Optional[int]:
    """The version of the first plan published after ``after_seq`` whose ``replan`` event's
    reason names the fault's target (elastic jobs); None when there is none (yet)."""
    for ev in events:
        if ev.seq > after_seq and ev.type == "replan" and any(
                _names_fault(inj, kind, targets) for kind, targets in replan_changes(ev)):
            return schema.event_detail(ev).version
    return None


def _switch_version(ev: schema.EventRecord) -> Optional[int]:
    """The plan version a ``switch-done`` event switched to."""
    mark = schema.switch_of(ev)
    return mark.to_version if mark is not None and mark.phase == "done" else None


def match_recovery(inj: Injected, base: Baseline, detection: Optional[Detection],
                   events: Sequence[schema.EventRecord],
                   points: Sequence[ProgressPoint]) -> Optional[Recovery]:
    """When training went on after the fault, or None. Elastic jobs: the ``switch-done`` of
    the plan that handled the fault (the first ``replan`` naming its target) or of a later
    plan; when no replan names it, the first ``switch-done`` after the detection."""
    if detection is not None:
        after_seq = detection.seq if detection.seq is not None else base.last_seq
        version = handling_plan(inj, events, base.last_seq)
        for ev in events:
            if ev.seq > after_seq and ev.type == "switch-done":
                got = _switch_version(ev)
                if version is not None and (got is None or got < version):
                    continue
                return Recovery(ev.at, f"switch-done event #{ev.seq}", got)
        since = max(detection.at, inj.ended_at or 0.0)
        newer = [p for p in points if p.round > base.round and p.t >= since]
        if newer:
            first = min(newer, key=lambda p: p.t)
            return Recovery(first.t, f"progress in round {first.round} (step {first.step})",
                            first.round)
        return None
    if expects_reaction(inj.fault, inj.xid, inj.target):
        return None
    return progress_after(inj, base, points)


def expects_rejoin(inj: Injected, events: Sequence[schema.EventRecord],
                   after_seq: int) -> Optional[int]:
    """The version of the plan that took the node away, when the fault ended (a thaw, a heal)
    and the node should come back (elastic jobs: a frozen agent or a cut node re-registers);
    None when nothing is to come back (a killed agent, a job that never dropped the node)."""
    if inj.fault not in NODE_FAULTS or inj.ended_at is None or "node" not in inj.target:
        return None
    return handling_plan(inj, events, after_seq)


def match_rejoin(inj: Injected, events: Sequence[schema.EventRecord],
                 away_version: int) -> Optional[Recovery]:
    """The ``switch-done`` of the first plan after ``away_version`` that takes the node back (a
    ``join <node>`` or ``recover <node>:<index>`` change), or of a later plan; None until then."""
    node = inj.target["node"]
    version = None
    for ev in events:
        if ev.type == "replan" and schema.event_detail(ev).version > away_version and any(
                (kind == "join" and node in targets) or
                (kind == "recover" and any(_split_target(d)[0] == node for d in targets))
                for kind, targets in replan_changes(ev)):
            version = schema.event_detail(ev).version
            break
    if version is None:
        return None
    for ev in events:
        got = _switch_version(ev) if ev.type == "switch-done" else None
        if got is not None and got >= version:
            return Recovery(ev.at, f"switch-done event #{ev.seq}", got)
    return None


def reactions(events: Sequence[schema.EventRecord], after_seq: int,
              until_seq: Optional[int] = None) -> list[schema.EventRecord]:
    """The events in ``(after_seq, until_seq]`` that say the job reacted (``REACTIONS``): a
    fault the job should ride through (an etcd restart or stall, an etcd member cut off)
    must leave none."""
    return [e for e in events if e.type in REACTIONS and e.seq > after_seq
            and (until_seq is None or e.seq <= until_seq)]


def progress_after(inj: Injected, base: Baseline,
                   points: Sequence[ProgressPoint]) -> Optional[Recovery]:
    """The first progress past the step the fault hit, once the fault ended: the job rode
    through it (or went on unaware after a resume)."""
    since = max(base.at, inj.ended_at or base.at)
    later = [p for p in points if p.step > base.step and p.t >= since]
    if later:
        first = min(later, key=lambda p: p.t)
        return Recovery(first.t, f"progress to step {first.step}", first.round)
    return None


def steps_lost(points: Sequence[ProgressPoint], recovered_round: Optional[int],
               base: Baseline) -> Optional[int]:
    """Steps trained before the fault and trained again after it (0 when nothing restarted)."""
    if recovered_round is None:
        return None
    if recovered_round <= base.round:
        return 0
    newer = sorted({p.round for p in points if p.round >= recovered_round})
    if not newer:
        return None
    first = newer[0]  # the plan that handled it, or the next one when it trained no step
    mine = [p.step for p in points if p.round == first]
    before = [p.step for p in points if p.round < recovered_round]
    if not mine or not before:
        return None
    return max(0, max(before) - (min(mine) - 1))


@dataclass(frozen=True)
class Lineage:
    steps_skipped: int  # steps no round trained (a resume past the last completed step)
    samples_lost: Optional[int]  # steps_skipped x global batch, when the batch is known
    final_step: Optional[int]


def lineage_gaps(points: Sequence[ProgressPoint]) -> Lineage:
    """Walk the rounds in order: a round that resumes past the last step its predecessor
    completed skipped those steps' samples."""
    rounds = sorted({p.round for p in points})
    skipped, prev_max = 0, None
    for r in rounds:
        steps = [p.step for p in points if p.round == r]
        if prev_max is not None:
            skipped += max(0, (min(steps) - 1) - prev_max)
        prev_max = max(steps)
    batches = {p.batch for p in points if p.batch is not None}
    samples = skipped * batches.pop() if len(batches) == 1 else (0 if skipped == 0 else None)
    return Lineage(skipped, samples, prev_max)


# ------------------------------------------------------------------------------------ observer
class JobObserver:
    """Watches one job through its job view; thread-safe snapshots of what it saw. ``view``:
    a view to share (None: the observer makes, and closes, its own)."""

    def __init__(self, client: EtcdClient, job: str, progress: Optional[ProgressSource] = None,
                 view: Optional[WatchedJob] = None):
        self.client = client
        self.job = job
        self.view = view if view is not None else WatchedJob(client, job, name="inject",
                                                             progress_s=WATCH_PROGRESS_S)
        self._own_view = view is None
        self._etcd_progress = EtcdProgress()
        self.progress: ProgressSource = progress or self._etcd_progress
        self._verdicts: list[DeviceVerdictSeen] = []
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._holding = False

    def start(self, timeout: float = WATCH_START_TIMEOUT_S) -> "JobObserver":
        # listeners first: the tables' initial listings reach them too
        self._tokens = [self.view.subscribe(self._on_device, [Table.DEVICES]),
                        self.view.subscribe(self._etcd_progress.on_worker, [Table.WORKERS])]
        try:
            self.view.acquire(OBSERVED, timeout)
        except BaseException:
            self._unsubscribe()
            raise
        self._holding = True
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._unsubscribe()
        if self._holding:
            self._holding = False
            self.view.release(OBSERVED, timeout)
        if self._own_view:
            self.view.close(timeout)

    def _unsubscribe(self) -> None:
        tokens, self._tokens = self._tokens, []
        for token in tokens:
            self.view.unsubscribe(token)

    def _on_device(self, ev: WatchEvent) -> None:
        if ev.type is not EventType.PUT or not isinstance(ev.record, schema.DeviceHealthRecord):
            return
        node, _, index = ev.key[len(schema.devices_prefix(self.job)):].partition("/")
        with self._lock:
            self._verdicts.append(DeviceVerdictSeen(
                len(self._verdicts), node, int(index), ev.record.state, ev.record.reason,
                ev.record.at))

    def wait_change(self, since: int, timeout: float) -> int:
        """Wait (at most ``timeout``) for the view to change after generation ``since``
        (``self.view.generation``); returns the generation then."""
        return self.view.wait(since, timeout)

    # ---------------------------------------------------------------------------- snapshots
    def events(self) -> list[schema.EventRecord]:
        return self.view.events_after(0)

    def verdicts(self) -> list[DeviceVerdictSeen]:
        with self._lock:
            return list(self._verdicts)

    def points(self) -> list[ProgressPoint]:
        return self.progress.poll()

    def max_step(self) -> int:
        return max((p.step for p in self.points()), default=-1)

    def baseline(self) -> Baseline:
        events, points = self.events(), self.points()
        rnd = max((p.round for p in points), default=-1)
        rnd = max(rnd, self._etcd_round())
        return Baseline(at=time.time(), last_seq=max((e.seq for e in events), default=0),
                        devices_seen=len(self.verdicts()), round=rnd,
                        step=max((p.step for p in points), default=-1))

    def _etcd_round(self) -> int:
        """The restart round (rdzv/state) or the plan version, whichever the job has."""
        state, head = self.view.round_state(), self.view.head()
        return max(state.round if state is not None else -1,
                   head.version if head is not None else -1)

    def job_ended(self) -> Optional[str]:
        """``succeeded``/``failed`` once ``rdzv/state`` says so, else None."""
        ended = self.view.job_end()
        return ended.state if ended is not None else None

    def job_end(self):
        """``rdzv/state`` once it records the job's end (state, reason, at), else None."""
        return self.view.job_end()
