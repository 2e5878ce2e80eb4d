"""The leader's effect loop: election, watches, debounce, replan, fenced publication.

Every node agent runs a ``Leader``; it campaigns through ``coord.Election`` and only the elected
one acts. While leading it holds the tables ``nodes/``, ``devices/``, ``workers/``, ``reach/``,
``retry/`` and ``plan/current`` of the process's one job view (``launcher.jobview.WatchedJob``:
list-then-watch, shared with the agent's elastic mode; a leader given none makes its own) and
runs a level-triggered loop over the pure ``decide``, woken by the view's changes; the snapshot
is built again only after one of its tables changed. Promises:

* each tick is one line: the view's tables -> the measured speeds to plan for (a value:
  ``StragglerWatch.observe`` returns it; nothing reads it back from the watch) -> the snapshot
  with them (``build_snapshot(..., measured=...)``, the only place a measured speed enters the
  planner's inventory) -> ``decide`` -> (debounce) plan -> publish;
* changes are debounced: a replan waits until the decision has been stable for ``debounce_s``
  (at most ``max_debounce_s`` after the first change), on the injected ``clock``; a storm of
  failures yields one publication, or a few; while the injected ``hold()`` is true (the agent's
  etcd-outage policy reconciling: records that expired with their leases during an outage are
  being re-created) a due replan waits, and is decided again once it ends, so an etcd outage
  alone switches nothing;
* each replan re-reads ``plan/current``, decides again from it, plans (``make_layout``: the
  planner, else the fallback DP plan) and publishes version+1 with ``coord.publish_plan`` (one
  transaction fenced on leadership and on the revision decided from); a conflict re-reads and
  decides again; a rejected fence means leadership is lost: the leader steps down and the next
  one re-reads the world and converges; a plan the planner finds infeasible is not retried
  until the cluster changes again (the current plan stays), unless the cluster is already the
  largest the job can have (``decide.largest_cluster``): then no change can help, and
  ``impossible`` says why in one line (the planner's shortfall: memory needed against
  available), which ends the job at once (the agent's judge);
* the store of a new plan is the TCPStore a live agent advertises in its node record: the
  leader's own when it has one, else the lowest node id's (deterministic);
* a decision made only of ``retry`` changes (workers wait after a switch that failed with no
  change to explain it) is published at most ``MAX_SWITCH_RETRIES`` times for the same
  furthest step; then the leader says so once and waits for the cluster to change (the
  workers' plan wait ends the job with that root cause);
* nodes beyond ``max_nodes`` are logged once each as spares; running out of usable devices is
  logged once per outage (the plan stays);
* after a publication the journal gets the change events and one ``replan`` event
  (``journal_publication``);
* the leader's lifecycle is ``LeaderState`` under its own ``TRANSITIONS`` table, run by
  ``coord.lifecycle.StateMachine`` (an illegal move raises ``IllegalTransition``; a move to the
  current state is a no-op) with a timestamped ``history``; every etcd call has a deadline,
  every wait a timeout, ``stop`` joins within its own.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import (
    ConflictError,
    CoordinationError,
    FencedWriteRejected,
)
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.ids import node_of
from hspmd_elastic.coord.election import Election
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.lifecycle import StateMachine, Transition
from hspmd_elastic.coord.plans import publish_plan, read_plan
from hspmd_elastic.coord.journal import append_event
from launcher.jobview import Table, WatchedJob
from launcher.leader.decide import (ChangeKind, PlanDecision, decide, largest_cluster,
                                    select_nodes)
from launcher.leader.journal import journal_publication
from launcher.leader.planning import (
    PlannerFn,
    PlanningFailed,
    make_layout,
    plan_record,
)
from launcher.leader.snapshot import ClusterSnapshot, build_snapshot

if TYPE_CHECKING:
    from hspmd_elastic.planner import ModelProfile, PlannerOptions
    from launcher.leader.stragglers import StragglerWatch

log = logging.getLogger(__name__)

DEFAULT_DEBOUNCE_S = 1.0
DEFAULT_MAX_DEBOUNCE_S = 10.0
TICK_S = 0.05  # re-check period while debouncing (real seconds; the debounce clock is injected)
IDLE_RECHECK_S = 1.0  # level-triggered re-check even without watch events
# A tick woken by a watch event is followed by a pause of COALESCE x its own cost (snapshot and
# decision, O(devices)), at most MAX_COALESCE_S: a burst of events (a thousand agents starting,
# 8 verdicts each) is taken in a few ticks, not one per event.
COALESCE = 3.0
MAX_COALESCE_S = 0.25
WATCH_START_S = 5.0
STOP_TIMEOUT_S = 5.0
MAX_SWITCH_RETRIES = 3  # publications of the same plan again, per furthest step
HISTORY_KEEP = 256  # transitions kept in the leader's history
# What the leader reads of the job view, held only while it leads.
LEADER_TABLES = (Table.NODES, Table.DEVICES, Table.WORKERS, Table.REACH, Table.RETRY,
                 Table.PLAN)

Clock = Callable[[], float]


class LeaderState(str, enum.Enum):
    """Where the leader of one node agent is; its moves are ``TRANSITIONS``."""

    FOLLOWER = "follower"  # not elected (or not yet watching)
    WATCHING = "watching"  # leading; the cluster matches the current plan
    DEBOUNCING = "debouncing"  # a change was seen; waiting for the cluster to settle
    PLANNING = "planning"  # re-reading the plan and asking the planner
    PUBLISHING = "publishing"  # the fenced write of plan/current
    STOPPED = "stopped"


_S = LeaderState
# Bounds per state: DEBOUNCING ends within max_debounce_s of the first change; PLANNING is one
# pure planner call; PUBLISHING and every etcd read have the client's deadline.
TRANSITIONS: dict[LeaderState, frozenset[LeaderState]] = {
    _S.FOLLOWER: frozenset({_S.WATCHING, _S.STOPPED}),
    _S.WATCHING: frozenset({_S.DEBOUNCING, _S.FOLLOWER, _S.STOPPED}),
    _S.DEBOUNCING: frozenset({_S.PLANNING, _S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.PLANNING: frozenset({_S.PUBLISHING, _S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.PUBLISHING: frozenset({_S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.STOPPED: frozenset(),
}


class Outcome(str, enum.Enum):
    """How one replan attempt ended."""

    PUBLISHED = "published"
    NO_CHANGE = "no-change"  # a fresh read showed nothing to do (someone published already)
    CONFLICT = "conflict"  # plan/current changed under us: re-read and decide again
    DEPOSED = "deposed"  # the fenced write was rejected: we no longer lead
    INFEASIBLE = "infeasible"  # the planner found no plan for these devices
    ETCD_ERROR = "etcd-error"  # etcd did not answer in time: the next tick re-reads


@dataclass(frozen=True)
class Publication:
    """One plan this leader published: version, reason, devices, planner and timings."""

    version: int
    reason: str
    devices: tuple[str, ...]
    planner: str
    timings: dict[str, float] = field(default_factory=dict)


class Leader:
    """The leader side of one node agent (see the module docstring). ``start`` / ``stop``."""

    def __init__(self, client: EtcdClient, session: LeasedSession, job: str, node: str,
                 planner_fn: Optional[PlannerFn], model_profile: ModelProfile, global_batch: int,
                 debounce_s: float = DEFAULT_DEBOUNCE_S, clock: Clock = time.monotonic, *,
                 max_debounce_s: float = DEFAULT_MAX_DEBOUNCE_S, min_nodes: int = 1,
                 max_nodes: Optional[int] = None,
                 planner_options: Optional[PlannerOptions] = None,
                 wall_clock: Clock = time.time, election_recheck_s: float = 1.0,
                 hold: Optional[Callable[[], bool]] = None, view: Optional[WatchedJob] = None,
                 stragglers: Optional["StragglerWatch"] = None,
                 lengths: tuple[tuple[int, float], ...] = (),
                 optimizer_shards: str = "replicated"):
        if debounce_s < 0 or max_debounce_s < debounce_s:
            raise ValueError(f"need 0 <= debounce_s ({debounce_s}) <= max_debounce_s "
                             f"({max_debounce_s})")
        if min_nodes < 1:
            raise ValueError(f"min_nodes={min_nodes} must be >= 1")
        if max_nodes is not None and max_nodes < min_nodes:
            raise ValueError(f"need min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        self.client, self.job, self.node = client, job, node
        self.planner_fn, self.profile, self.global_batch = planner_fn, model_profile, global_batch
        self.planner_options = planner_options
        self.lengths = tuple(lengths)  # --hspmd-lengths: each plan's length buckets
        # --hspmd-optimizer-shards: every plan planned for and published with this mode
        self.optimizer_shards = optimizer_shards
        self.debounce_s, self.max_debounce_s, self.min_nodes = debounce_s, max_debounce_s, min_nodes
        self.max_nodes = max_nodes
        # ``hold()`` true: a due replan waits (the agent's etcd-outage policy while records
        # that expired with their leases are re-created); the decision is made again after.
        self.hold, self._held = hold, False
        self._clock, self._wall = clock, wall_clock
        self.election = Election(client, session, job, node, on_change=self._on_leadership,
                                 recheck_s=election_recheck_s, wall_clock=wall_clock)
        self._lock = threading.Lock()  # held around every move of the state machine
        self._machine: StateMachine[LeaderState] = StateMachine(
            "leader", TRANSITIONS, LeaderState.FOLLOWER, "created", clock=clock,
            wall_clock=wall_clock, keep=HISTORY_KEEP)
        self.publications: list[Publication] = []
        self.outcomes: list[Outcome] = []
        self.pending: Optional[PlanDecision] = None  # the decision being debounced
        self._first_at = self._last_at = 0.0
        self._fingerprint: Optional[tuple] = None
        self._infeasible: Optional[tuple] = None
        # Why no plan can ever run the model ("" while one may): the agent ends the job.
        self.impossible = ""
        self._no_devices = False
        self._retries = (-1, 0)  # (furthest step, retry-only publications at that step)
        self._spares: set[str] = set()  # nodes said to be spares (logged once each)
        # measured speeds (``stragglers``): ``observe`` returns the speeds to plan for, which
        # go into the snapshot (``build_snapshot(..., measured=...)``) and nowhere else
        self.stragglers = stragglers
        self.measured: dict[str, float] = {}
        if stragglers is not None and stragglers.journal is None:
            stragglers.journal = self._journal_speeds
        # The process's job view (the agent's, shared); without one the leader makes its own.
        self.view = view if view is not None else WatchedJob(client, job, name=f"leader {node}")
        self._own_view = view is None
        self._listener: Optional[int] = None  # the view listener while its tables are held
        self._cached: Optional[tuple[tuple[int, ...], ClusterSnapshot,
                                     Optional[schema.PlanRecord]]] = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._tick_cost = 0.0  # real seconds of the last tick's snapshot and decision

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> LeaderState:
        with self._lock:
            return self._machine.state

    def history(self) -> list[Transition[LeaderState]]:
        """The state changes so far (the latest ``HISTORY_KEEP``), oldest first."""
        with self._lock:
            return list(self._machine.history)

    def start(self) -> "Leader":
        """Join the election and start the loop. Raises CoordinationError if etcd is away."""
        self.election.campaign(0.0)
        self._thread = threading.Thread(target=self._run, name=f"leader-{self.node}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the loop and the watches and leave the election, within about ``timeout``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("[%s] leader %s: loop did not stop within %.1fs", self.job,
                            self.node, timeout)
        self._release_view(timeout)
        if self._own_view:
            self.view.close(timeout)
        self.election.resign(timeout)
        if self.state is not LeaderState.STOPPED:
            self._transition(LeaderState.STOPPED, "stopped")

    def poke(self) -> None:
        """Re-check now (e.g. after a test advanced the injected clock)."""
        self._wake.set()

    def _transition(self, new: LeaderState, reason: str) -> None:
        """Move to ``new`` (a no-op when already there); ``IllegalTransition`` is a bug."""
        with self._lock:
            old = self._machine.state
            if new is old:
                return
            self._machine.to(new, reason)
        log.info("[%s] leader %s: %s -> %s (%s)", self.job, self.node, old.value, new.value,
                 reason)

    def _on_leadership(self, leading: bool) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._tick_cost = 0.0
            try:
                delay = self._tick()
            except CoordinationError as exc:
                log.info("[%s] leader %s: %s; retrying", self.job, self.node, exc)
                delay = 4 * TICK_S
            except Exception:  # noqa: BLE001 - the loop must survive a bug in one tick
                log.exception("[%s] leader %s: unexpected error", self.job, self.node)
                delay = IDLE_RECHECK_S
            if self._wake.wait(delay) and self._tick_cost > 0:
                # Woken early (a watch event, most likely one of a burst): let the burst
                # gather, so the loop spends at most 1 / (1 + COALESCE) of its time rebuilding.
                self._stop.wait(min(MAX_COALESCE_S, COALESCE * self._tick_cost))

    def _tick(self) -> float:
        """One level-triggered step; returns how long to wait (real seconds) at most."""
        if not self.election.is_leader:
            if self.state is not LeaderState.FOLLOWER:
                self._step_down("leadership lost")
            return IDLE_RECHECK_S
        if self.state is LeaderState.FOLLOWER:
            self._take_office()
        started = time.monotonic()
        # view -> measured speeds -> snapshot with them -> decide (-> plan -> publish)
        snap, current = self._snapshot(self.measured)
        if self.stragglers is not None:
            self.measured = self.stragglers.observe(self._workers, current, snap.usable())
            snap, current = self._snapshot(self.measured)  # the same one unless they changed
        self._note_spares(snap, current)
        decision = decide(snap, current, self.min_nodes, self.max_nodes)
        self._tick_cost = time.monotonic() - started
        fp = decision.fingerprint() if decision else None
        if decision is None or fp == self._infeasible:
            self._note_no_devices(snap, current)
            self.pending = None
            if self.state is LeaderState.DEBOUNCING:
                self._transition(LeaderState.WATCHING, "change gone")
            return IDLE_RECHECK_S
        now = self._clock()
        if self.state is LeaderState.WATCHING:
            self._first_at = self._last_at = now
            self._transition(LeaderState.DEBOUNCING, decision.reason)
        elif fp != self._fingerprint:
            self._last_at = now
        self._fingerprint, self.pending = fp, decision
        due = min(self._last_at + self.debounce_s, self._first_at + self.max_debounce_s)
        if now < due:
            return TICK_S
        if self.hold is not None and self.hold():
            if not self._held:
                log.info("[%s] leader %s: holding the replan (%s) while the cluster reconciles "
                         "after an etcd outage", self.job, self.node, decision.reason)
            self._held = True
            return TICK_S
        self._held = False
        self._replan(self._first_at)
        return TICK_S

    def _note_no_devices(self, snap: ClusterSnapshot, current: Optional[schema.PlanRecord]
                         ) -> None:
        """Say once (per outage) that nothing is left to plan on; the plan stays as it is."""
        empty = current is not None and not snap.usable()
        if empty and not self._no_devices:
            log.error("[%s] leader %s: no usable device left; keeping plan v%d until one "
                      "returns", self.job, self.node, current.version)
        self._no_devices = empty

    def _note_spares(self, snap: ClusterSnapshot, current: Optional[schema.PlanRecord]
                     ) -> None:
        """Say once per node (again only after it was planned in meanwhile) that it is a spare,
        so an operator who started more nodes than ``--nnodes`` allows sees why one idles."""
        if self.max_nodes is None:
            return
        _, spares = select_nodes(snap, current, self.max_nodes)
        for node in spares:
            if node not in self._spares:
                log.info("[%s] leader %s: node %s is a spare: --nnodes max %d reached", self.job,
                         self.node, node, self.max_nodes)
        self._spares = set(spares)

    def _take_office(self) -> None:
        self.view.acquire(LEADER_TABLES, WATCH_START_S)
        self._listener = self.view.subscribe(lambda _ev: self._wake.set(), LEADER_TABLES)
        self._infeasible = None
        self._transition(LeaderState.WATCHING, f"elected (term {self.election.term})")

    def _snapshot(self, measured: Mapping[str, float]
                  ) -> tuple[ClusterSnapshot, Optional[schema.PlanRecord]]:
        """The cluster as the view has it, with the ``measured`` speeds to plan for; built
        again only after one of its tables or the speeds changed."""
        cached = self._cached
        key = (self.view.generations(LEADER_TABLES), tuple(sorted(measured.items())))
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        gens, t = self.view.copy(LEADER_TABLES)
        plan = t[Table.PLAN].get("current")
        planned = frozenset(node_of(d) for d in plan.devices) if plan else frozenset()
        snap = build_snapshot(t[Table.NODES], t[Table.DEVICES], self.node, t[Table.WORKERS],
                              reach=t[Table.REACH], planned=planned, retry=t[Table.RETRY],
                              measured=dict(measured))
        self._cached = ((gens, tuple(sorted(measured.items()))), snap, plan)
        return snap, plan

    def _workers(self) -> dict:
        """The workers' records (the measured busy times), as the view has them."""
        return self.view.copy((Table.WORKERS,))[1][Table.WORKERS]

    def _journal_speeds(self, detail: schema.SpeedsDetail) -> None:
        """One ``speeds`` event: a decision on measured speeds, with its numbers."""
        try:
            append_event(self.client, self.job, schema.EventType.SPEEDS.value, self.node,
                         detail, wall_clock=self._wall)
        except CoordinationError as exc:
            log.warning("[%s] leader %s: could not journal measured speeds: %s", self.job,
                        self.node, exc)

    def _step_down(self, reason: str) -> None:
        self._release_view(STOP_TIMEOUT_S)
        self.pending = None
        self._transition(LeaderState.FOLLOWER, reason)

    def _release_view(self, timeout: float) -> None:
        token, self._listener = self._listener, None
        if token is not None:
            self.view.unsubscribe(token)
            self.view.release(LEADER_TABLES, timeout)
        self._cached = None

    # ------------------------------------------------------------------ replan
    def _replan(self, first_at: float) -> Outcome:
        """Re-read, decide, plan, publish (fenced), journal; the outcome is in ``outcomes``
        before the state leaves PUBLISHING. Never raises CoordinationError."""
        self._transition(LeaderState.PLANNING, "debounce over")
        t0 = self._clock()
        try:
            current, rev = read_plan(self.client, self.job)
        except CoordinationError as exc:
            return self._back(Outcome.ETCD_ERROR, f"reading the plan: {exc}")
        self.view.note_plan(current, rev)
        snap, _ = self._snapshot(self.measured)
        decision = decide(snap, current, self.min_nodes, self.max_nodes)
        if decision is None:
            return self._back(Outcome.NO_CHANGE, "nothing to do after a fresh read")
        if decision.changes and all(c.kind is ChangeKind.RETRY for c in decision.changes):
            step = snap.step or 0
            done = self._retries[1] if self._retries[0] == step else 0
            if done >= MAX_SWITCH_RETRIES:
                log.error("[%s] leader %s: the switch into plan v%d failed again after %d "
                          "retries at step %d with no change in the cluster; not retrying "
                          "until it changes", self.job, self.node, current.version, done, step)
                self._infeasible = decision.fingerprint()
                return self._back(Outcome.INFEASIBLE, "switch retries exhausted")
            self._retries = (step, done + 1)
        try:
            layout = make_layout(decision, current, self.planner_fn, self.profile,
                                 self.global_batch, self.planner_options, self.lengths,
                                 optimizer_shards=self.optimizer_shards)
        except PlanningFailed as exc:
            whole = largest_cluster(snap, self.max_nodes)
            if whole:
                self.impossible = (f"no plan fits the model even on the largest cluster this "
                                   f"job can have ({whole}): {exc}")
                log.error("[%s] leader %s: %s", self.job, self.node, self.impossible)
            else:
                log.error("[%s] leader %s: %s; waiting for the cluster to change", self.job,
                          self.node, exc)
            self._infeasible = decision.fingerprint()
            return self._back(Outcome.INFEASIBLE, str(exc))
        t1 = self._clock()
        # The furthest step known: a worker's record goes with it, so a plan made after every
        # holder died still says how far the job had got (carried from the previous plan).
        step = max(snap.step or 0, current.step if current else 0)
        # the sequence length planned for (a worker whose model has another refuses the plan)
        # and the job's optimizer shards
        layout = replace(layout, plan=layout.plan.at_seq_len(self.profile.seq_len)
                         .with_optimizer_shards(self.optimizer_shards))
        record = plan_record(decision, layout, self._wall(), step=step)
        self._transition(LeaderState.PUBLISHING, f"v{decision.version}: {decision.reason}")
        try:
            revision = publish_plan(self.election, record, rev, current.version if current else 0)
        except FencedWriteRejected as exc:
            log.warning("[%s] leader %s: plan v%d rejected, no longer leader: %s", self.job,
                        self.node, decision.version, exc)
            self.outcomes.append(Outcome.DEPOSED)
            self._step_down("publish rejected: deposed")
            return Outcome.DEPOSED
        except ConflictError as exc:
            return self._back(Outcome.CONFLICT, str(exc))
        except CoordinationError as exc:
            return self._back(Outcome.ETCD_ERROR, f"publishing v{decision.version}: {exc}")
        t2 = self._clock()
        self.view.note_plan(record, revision)
        timings = {"debounce_s": t0 - first_at, "plan_s": t1 - t0, "publish_s": t2 - t1,
                   "detect_to_publish_s": t2 - first_at}
        log.info("[%s] leader %s: published plan v%d over %d device(s) (%s, store %s, step %s) "
                 "in %.3fs: %s", self.job, self.node, decision.version, len(layout.devices),
                 layout.planner, decision.store_endpoint or "none", snap.step,
                 timings["detect_to_publish_s"], decision.reason)
        self.publications.append(Publication(decision.version, decision.reason, layout.devices,
                                             layout.planner, timings))
        self.outcomes.append(Outcome.PUBLISHED)
        journal_publication(self.client, self.job, self.node, decision, layout, current, snap,
                            timings, self._wall)
        self.pending = None
        self._transition(LeaderState.WATCHING, f"published v{decision.version}")
        return Outcome.PUBLISHED

    def _back(self, outcome: Outcome, why: str) -> Outcome:
        log.info("[%s] leader %s: replan %s: %s", self.job, self.node, outcome.value, why)
        self.outcomes.append(outcome)
        self._transition(LeaderState.WATCHING, outcome.value)
        return outcome
