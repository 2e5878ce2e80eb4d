"""Elastic mode of the node agent (``hspmd-launch --hspmd-elastic``): follow the leader's plans,
never restart a surviving worker, and end as one job.

The agent hosts the workers' store, advertises its device slots, campaigns for leadership (the
elected agent's ``launcher.leader.Leader`` plans with ``hspmd_elastic.planner.plan_for`` for the
``--hspmd-model`` and ``--hspmd-global-batch``) and runs ``launcher.node.elastic.node.ElasticNode``
every tick. Its lifecycle is ``ElasticState`` (WAITING_PLAN -> RUNNING -> FINISHING ->
SUCCEEDED, or FAILED / INTERRUPTED) with its own ``TRANSITIONS`` table on the one
``coord.lifecycle.StateMachine``. Promises:

* a worker exit is an event, not a restart: the slot gets a failed verdict, the leader replans,
  the survivors switch in memory; workers are started only for slots a plan adds (joins);
  a node whose agent dies loses its lease, and the leader replans without it;
* the job's end is one shared fact, ``rdzv/state`` (``RdzvStateRecord``, round = the plan
  version it was decided under), written once by compare-and-set, so every agent ends the same
  way. It succeeds when a worker reports (in its final progress) that it finished: the runtime
  finishes a worker only after every rank of its plan finished the last step; or, for scripts
  that report no progress, when every node of the current plan marked its slots done
  (``rdzv/rounds/<version>/done/<node>``). It fails when a switch failed for good (a
  ``switch-failed`` event: state with no live owner and no checkpoint), the same error killed
  two workers (the script's error, ``exits.ScriptErrors`` over the journal's ``failure``
  events: on two devices, or again after a replan), no usable device is left, or this agent's
  leader found no plan that keeps ``--hspmd-redundancy`` (``RedundantPlanner.shortfall``), no
  plan for the model even on the largest cluster the job can have (``Leader.impossible``), or
  (``--hspmd-enforce-memory``) the OOM killer ended a worker of this node: the plan does not fit
  the enforced memory (``elastic.memory``; that worker's failure carries the one-line error);
  the agents then stop their workers, print torchrun's failure summary of their own failed
  workers (with the script's error, the job's first such exit as the root cause, whichever
  node it was on), and exit 1;
* after success the agents stop leading and wait (at most ``FINISH_WAIT_S``) until every worker
  of the job has exited by itself, so the store a plan uses outlives every rank that needs it;
* on a terminal (stderr), a progress bar shows the wait for the first plan (nodes up of
  ``min_nodes``, time left) and a switch in progress (plan version, the ``replan``
  seen, nodes acked when acks are written); without a terminal nothing is read for it;
* the agent reads the job through ONE job view (``launcher.jobview.WatchedJob``: one watch per
  prefix, made at ``start``, closed at ``stop``), shared by this mode (node records and verdicts
  for the usable devices, the journal's ``switch-failed`` events paired by
  ``contract.events.switch_of``, ``rdzv/`` for the job's end and the nodes done), the node (the
  plan's head), the leader while it leads, and the progress bar; the view does no I/O on a
  read, so the ``EtcdOutagePolicy`` is fed by the agent's own round trips: its tick's, and a
  count-only read (no record: ``EtcdClient.revision``) with every judgement, which keeps an
  outage seen within the client's deadline in a quiet agent, as before;
* every wait is bounded: the first plan by ``join_timeout``, an etcd outage by the agent's
  ``EtcdOutagePolicy``,
  stopping workers by ``--shutdown-timeout``; signals stop the workers and exit 1.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
import time
from typing import Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import Compare, CompareTarget, CoordinationError, PutOp, RecordError
from hspmd_elastic.contract.progress import DONE_STATES, LEFT_STATES
from hspmd_elastic.coord.journal import read_events
from hspmd_elastic.coord.lifecycle import StateMachine
from hspmd_elastic.coord.plans import plan_nodes
from hspmd_elastic.contract.schema import switch_of
from hspmd_elastic.planner import plan_for, register_device_type
from launcher.api import (
    LaunchError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from launcher.console import ElasticWaits
from launcher.health.api import HealthConfigError, HealthSource
from launcher.health.nvml import NvmlHealthSource
from launcher.health.progress import hang_detector_from_env
from launcher.health.verdicts import select_health_source
from launcher.jobview import Table, WatchedJob
from launcher.leader import Leader, RedundantPlanner, build_snapshot
from launcher.leader.planning import AllDevicesPlanner, UniformPlanner, default_planner_options
from launcher.leader.speeds import StragglerPolicy
from launcher.leader.stragglers import StragglerWatch
from launcher.node.api import AgentContext, End, ModeOutcome, StopCause
from launcher.node.elastic.devices import device_table
from launcher.node.elastic.node import ElasticNode
from launcher.node.elastic.workers import ElasticWorkers
from launcher.node.env import node_address_env
from launcher.node.hangs import ProgressMonitor
from launcher.node.elastic.exits import ScriptErrors
from launcher.node.elastic.judge import JobView, judge
from launcher.node.elastic.memory import WorkerMemory
from hspmd_elastic.contract.rounds import FAILED, SUCCEEDED, TERMINAL, RoundState
from launcher.summary import WorkerFailure, format_summary

log = logging.getLogger(__name__)

JUDGE_S = 0.25  # how often the job-wide state is judged again (from the job view)
FINISH_WAIT_S = 30.0  # after success: how long workers get to exit by themselves
END_WAIT_S = 1.0  # after a lost compare-and-set of the job's end: the winner's, from the view
# What the mode reads of the job view (the node adds the plan's head, the leader its tables, the
# progress bar the switch acks).
MODE_TABLES = (Table.NODES, Table.DEVICES, Table.EVENTS, Table.RDZV)


class ElasticState(enum.Enum):
    """WAITING_PLAN is bounded by ``join_timeout``; RUNNING lasts as long as the job (an etcd
    outage past the agent's ``EtcdOutagePolicy`` ends it); FINISHING by ``FINISH_WAIT_S`` plus
    the shutdown grace."""

    WAITING_PLAN = "waiting_plan"  # no plan uses the cluster yet
    RUNNING = "running"  # following plans
    FINISHING = "finishing"  # the job succeeded; waiting for the workers to exit
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


_E = ElasticState
_ENDS = frozenset({_E.FAILED, _E.INTERRUPTED})
TRANSITIONS: dict[ElasticState, frozenset] = {
    _E.WAITING_PLAN: frozenset({_E.RUNNING, _E.FINISHING, *_ENDS}),
    _E.RUNNING: frozenset({_E.FINISHING, *_ENDS}),
    _E.FINISHING: frozenset({_E.SUCCEEDED, *_ENDS}),
    _E.SUCCEEDED: frozenset(),
    _E.FAILED: frozenset(),
    _E.INTERRUPTED: frozenset(),
}
TERMINAL_STATES = frozenset({_E.SUCCEEDED, _E.FAILED, _E.INTERRUPTED})
_END_OF = {_E.SUCCEEDED: End.SUCCEEDED, _E.FAILED: End.FAILED, _E.INTERRUPTED: End.INTERRUPTED}


# ----------------------------------------------------------------------------------- the mode
class ElasticMode:
    """One node agent in elastic mode (the ``launcher.node.api.Mode`` protocol)."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx, self.cfg = ctx, ctx.config
        self.settings = ctx.config.elastic
        self.client, self.session, self.job = ctx.client, ctx.session, ctx.job
        self.node_id, self.clock = ctx.node_id, ctx.clock
        self.machine = StateMachine("elastic", TRANSITIONS, ElasticState.WAITING_PLAN, "start",
                                    clock=ctx.clock)
        self.failures: list[WorkerFailure] = []
        self.reason = ""
        self.node: Optional[ElasticNode] = None
        self.health: Optional[HealthSource] = None
        self._seen_exits = 0
        self._finished_worker = ""
        self._event_seq = 0
        self._switch_failed = ""
        self._memory_error = ""  # --hspmd-enforce-memory: the plan that did not fit
        self._script_errors = ScriptErrors()  # the journal's worker exits, by error
        self._planner: Optional[RedundantPlanner] = None  # with --hspmd-redundancy
        self._marked_done: set[int] = set()
        self._bad_records: set[str] = set()  # bad records logged (once each)
        self._next_judge = 0.0
        self._unused_since = 0  # the plan version since which plans give this node no device
        self._started = self._plan_deadline = 0.0
        self._waits: Optional[ElasticWaits] = None
        self.view: Optional[WatchedJob] = None  # the process's one job view
        self._usable: tuple[tuple[int, ...], int] = ((), -1)  # (view generations, usable)

    @property
    def state(self) -> ElasticState:
        return self.machine.state

    def transition(self, new: ElasticState, reason: str) -> None:
        log.info("[%s] node %s: elastic %s -> %s (%s)", self.job, self.node_id,
                 self.state.value, new.value, reason)
        self.machine.to(new, reason)

    # ------------------------------------------------------------------ the Mode protocol
    def start(self) -> None:
        try:
            self.health = select_health_source(self.cfg.health_source, node=self.node_id,
                                               devices=self.cfg.nproc_per_node, job=self.job,
                                               etcd=self.client)
        except HealthConfigError as exc:
            raise LaunchError(str(exc)) from exc
        self.health.start()
        self._check_job_open()
        self.view = WatchedJob(self.client, self.job, name=f"agent {self.node_id}")
        tables = MODE_TABLES + ((Table.SWITCH,) if self.ctx.bar.enabled else ())
        self.view.acquire(tables, self.client.timeout)
        self.node = self._build_node(self.health)
        self.node.start()
        self._started = self.clock()
        self._plan_deadline = self._started + self.cfg.rdzv.join_timeout_s
        if self.ctx.bar.enabled:  # a progress bar only on a terminal
            self._waits = ElasticWaits(self.view, self.cfg.rdzv.min_nodes)
        log.info("[%s] node %s: elastic mode, %d slot(s), store %s, planning for %s with global "
                 "batch %d", self.job, self.node_id, self.cfg.nproc_per_node,
                 self.node.store.endpoint, self.settings.model_spec, self.settings.global_batch)

    def tick(self) -> Optional[ModeOutcome]:
        """One round: follow the plan, collect exits, judge the job's end every ``JUDGE_S``
        (success waits in FINISHING for the workers to exit, bounded), then wait one monitor
        interval."""
        node = self.node
        self._tick()
        self._note_unused()
        if self.state is ElasticState.WAITING_PLAN:
            if node.plan_version:
                self.transition(ElasticState.RUNNING, f"plan v{node.plan_version}")
            elif self.clock() >= self._plan_deadline:
                raise RendezvousTimeoutError(
                    f"no plan for job {self.job!r} within {self.cfg.rdzv.join_timeout_s:.0f}s "
                    f"(--rdzv-conf join_timeout): the leader needs {self.cfg.rdzv.min_nodes} "
                    "node(s) and a feasible plan")
        if self.clock() >= self._next_judge:
            self._next_judge = self.clock() + JUDGE_S
            outcome, reason = self._judge()
            if outcome == SUCCEEDED:
                self._finish(reason)
                return ModeOutcome(End.SUCCEEDED, reason)
            if outcome == FAILED:
                self._fail(reason)
                return ModeOutcome(End.FAILED, reason, self.reason)
        if self._waits is not None:
            now = self.clock()
            self.ctx.bar.update(self._waits.poll(self.state is ElasticState.WAITING_PLAN,
                                                 now - self._started, self._plan_deadline - now,
                                                 time.time()))
        self.ctx.wait(self.cfg.monitor_interval_s)
        return None

    def stop(self, cause: Optional[StopCause]) -> ModeOutcome:
        """Stop the leader, the workers, the store and the health source; record the end."""
        self.ctx.bar.clear()
        if cause is not None and cause.signum is not None:
            log.warning("[%s] node %s: received %s, shutting down workers", self.job,
                        self.node_id, cause.outcome().reason)
        elif cause is not None:
            log.error("[%s] node %s: %s", self.job, self.node_id, cause.error)
        try:
            self._stop_workers()
        finally:
            if self.health is not None:
                self.health.stop()
            if self.view is not None:
                self.view.close()
        if cause is not None:
            outcome = cause.outcome()
            self.reason = outcome.error_line
            if self.state not in TERMINAL_STATES:
                self.transition(ElasticState.INTERRUPTED if cause.signum is not None
                                else ElasticState.FAILED, outcome.reason)
            return outcome
        end = _END_OF.get(self.state, End.FAILED)
        return ModeOutcome(end, self.machine.history[-1].reason,
                           "" if end is End.SUCCEEDED else self.reason)

    def _build_node(self, health: HealthSource) -> ElasticNode:
        cfg, ctx = self.cfg, self.ctx
        attempts = functools.lru_cache(maxsize=None)(  # attempt() recreates its directory
            lambda version: ctx.logdir.attempt(version, cfg.nproc_per_node))
        progress_dir = os.path.join(ctx.logdir.run_dir, "progress")
        os.makedirs(progress_dir, exist_ok=True)
        gpus = (health.devices()[:cfg.nproc_per_node] if isinstance(health, NvmlHealthSource)
                else None)
        base = dict(os.environ, **node_address_env(cfg.local_addr, os.environ))
        base.update(cfg.extra_env)
        settings = self.settings
        memory = WorkerMemory(self.job, self.node_id, settings.device_memory_bytes) \
            if settings.enforce_memory else None
        workers = ElasticWorkers(self.job, self.node_id, cfg.entrypoint, self.client.endpoints,
                                   lambda version, lr: attempts(version)[lr], base_env=base,
                                   role=cfg.role, progress_dir=progress_dir, memory=memory)
        for spec in settings.device_types:  # the constants measured on this job's machines
            register_device_type(spec)
        planner = plan_for
        if settings.redundancy:
            planner = self._planner = RedundantPlanner(plan_for, settings.redundancy)
        if settings.planner == "uniform":
            planner = UniformPlanner(planner)
        if settings.all_devices:
            planner = AllDevicesPlanner(planner)
        stragglers = None
        if settings.straggler_replans:
            # its own planner for predictions: a prediction never sets the leader's shortfall
            predict = RedundantPlanner(plan_for, settings.redundancy) if settings.redundancy \
                else plan_for
            predict = UniformPlanner(predict) if settings.planner == "uniform" else predict
            predict = AllDevicesPlanner(predict) if settings.all_devices else predict
            stragglers = StragglerWatch(settings.model_profile, settings.global_batch, predict,
                                        functools.partial(
                                            default_planner_options,
                                            optimizer_shards=settings.optimizer_shards),
                                        StragglerPolicy(dwell_s=settings.straggler_dwell_s))
        leader = Leader(self.client, self.session, self.job, self.node_id, planner,
                        self.settings.model_profile, self.settings.global_batch,
                        debounce_s=self.settings.debounce_s, min_nodes=cfg.rdzv.min_nodes,
                        max_nodes=cfg.rdzv.max_nodes, hold=ctx.outage.reconciling,
                        view=self.view, stragglers=stragglers, lengths=settings.lengths,
                        optimizer_shards=settings.optimizer_shards)
        store_host = cfg.local_addr or ("localhost" if cfg.rdzv.standalone else ctx.host)
        try:
            monitor = ProgressMonitor(hang_detector_from_env(os.environ))
        except HealthConfigError as exc:
            raise LaunchError(str(exc)) from exc
        return ElasticNode(self.client, self.session, self.job, self.node_id, ctx.host,
                           device_table(self.node_id, cfg.nproc_per_node, accelerators=gpus,
                                        memory_bytes=settings.device_memory_bytes,
                                        speed=settings.device_speed),
                           workers, leader=leader, health=health, store_host=store_host,
                           monitor=monitor, view=self.view)

    def _check_job_open(self) -> None:
        st = self._read_end()
        if st is not None:
            raise RendezvousClosedError(f"job {self.job!r} already {st.state} ({st.reason}); "
                                        "use another --rdzv-id")

    # ------------------------------------------------------------------ one tick
    def _tick(self) -> None:
        started = self.clock()
        try:
            self.node.tick()
            self.ctx.outage.reachable(started)
        except RecordError as exc:  # etcd answered: a bad record is skipped, not an outage
            self.ctx.outage.reachable(started)
            self._bad_record(exc)
        except CoordinationError as exc:
            self.ctx.outage.unreachable(RendezvousConnectionError(str(exc)))
        self._collect_exits()

    def _bad_record(self, exc: RecordError) -> None:
        """Log a bad record once (by its message), and go on."""
        if str(exc) not in self._bad_records:
            self._bad_records.add(str(exc))
            log.warning("[%s] node %s: skipping a bad record: %s", self.job, self.node_id, exc)

    def _note_unused(self) -> None:
        """Say once when the plans start to give this node no device (a hot spare beyond the
        maximum of ``--nnodes``, or a node whose devices all failed): its agent then waits, with
        no worker, for a plan that needs it, and should not look hung."""
        node = self.node
        if not node.plan_version or node.slot_plan:
            self._unused_since = 0
        elif not self._unused_since:
            self._unused_since = node.plan_version
            log.info("[%s] node %s: plan v%d gives this node no device (a spare: --nnodes max %d "
                     "reached, or its devices failed); waiting for a plan that needs it",
                     self.job, self.node_id, node.plan_version, self.cfg.rdzv.max_nodes)

    def _collect_exits(self) -> None:
        exits = self.node.workers.exits
        for ex, worker, final in exits[self._seen_exits:]:
            if final in LEFT_STATES:  # not a failure, whatever the code (see elastic/node.py)
                continue
            if ex.ok:
                if final in DONE_STATES and not self._finished_worker:
                    self._finished_worker = f"{self.node_id}:{ex.local_rank} {final}"
                log.info("[%s] node %s: slot %d (pid %d) exited 0 (%s)", self.job, self.node_id,
                         ex.local_rank, ex.pid, final or "no progress report")
                continue
            code = ex.exitcode if ex.exitcode is not None else -(ex.signal or 0)
            log.error("failed (exitcode: %d) local_rank: %d (pid: %d) of binary: %s", code,
                      ex.local_rank, ex.pid, self.cfg.entrypoint[0])
            self.failures.append(WorkerFailure(
                local_rank=ex.local_rank, global_rank=getattr(worker, "global_rank", None) or 0,
                pid=ex.pid, exitcode=code,
                error_file=worker.logs.error_file if worker is not None else "",
                observed_at=getattr(worker, "exited_at", None) or time.time()))
            self._note_oom(ex.local_rank, ex.pid)
        self._seen_exits = len(exits)

    def _note_oom(self, local_rank: int, pid: int) -> None:
        """An OOM kill under ``--hspmd-enforce-memory``: the plan's error, on its failure."""
        workers = self.node.workers
        if pid not in workers.oom_killed:
            return
        error = workers.memory.describe(self.node.plan_version, local_rank)
        self._memory_error = self._memory_error or error
        self.failures[-1].message = error
        log.error("[%s] node %s: %s", self.job, self.node_id, error)

    # ------------------------------------------------------------------ the job's end
    def _judge(self) -> tuple[str, str]:
        """The job's end as the view shows it, declared once when this agent sees it first.
        The view's reads do no I/O; etcd's liveness for the outage policy is one count-only
        read (no record read: every fact comes from the view), then the writes (the done mark,
        the declaration)."""
        started = self.clock()
        try:
            self.client.revision(prefix=schema.rdzv_state_key(self.job))  # etcd answers?
            view = self._facts()
            outcome, reason = judge(view)
            if outcome != "running" and view.ended is None:
                outcome, reason = self._declare(outcome, reason)
        except RecordError as exc:
            self.ctx.outage.reachable(started)
            self._bad_record(exc)
            return "running", ""
        except (CoordinationError, RendezvousConnectionError) as exc:
            self.ctx.outage.unreachable(exc if isinstance(exc, RendezvousConnectionError)
                                        else RendezvousConnectionError(str(exc)))
            return "running", ""
        self.ctx.outage.reachable(started)
        return outcome, reason

    def _facts(self) -> JobView:
        """What the job view says about the job's end (marks this node done first, once)."""
        ended = self.view.job_end()
        if ended is not None:
            return JobView(ended=ended)
        version, nodes_done = self.node.plan_version, False
        if version and self.node.done:
            self._mark_done(version)
            try:  # the plan's head the node applied: its nodes, not the full record
                need = plan_nodes(self.node.plan) if self.node.plan is not None else None
            except ValueError as exc:  # bad: no verdict yet
                log.warning("[%s] node %s: %s", self.job, self.node_id, exc)
                need = None
            nodes_done = need is not None and need <= self.view.done_nodes(version)
        self._read_switch_failures()
        gens, tables = self.view.copy((Table.NODES, Table.DEVICES))
        if gens != self._usable[0]:  # the snapshot only after a change of nodes or verdicts
            snap = build_snapshot(tables[Table.NODES], tables[Table.DEVICES], self.node_id)
            self._usable = (gens, len(snap.usable()))
        if tables[Table.NODES] and self._usable[1] == 0:
            # The verdicts may be seen before the exits' events (another watch): read the
            # journal itself, so a script's error is not taken for its consequence.
            self._read_journal()
        leader = self.node.leader
        found = self._script_errors.found
        return JobView(finished_worker=self._finished_worker, nodes_done=nodes_done,
                       switch_failed=self._switch_failed, nodes=len(tables[Table.NODES]),
                       plan_shortfall=self._planner.shortfall if self._planner else "",
                       usable_devices=self._usable[1],
                       script_error=found.describe() if found is not None else "",
                       plan_impossible=leader.impossible if leader is not None else "",
                       memory_error=self._memory_error)

    def _mark_done(self, version: int) -> None:
        """Record (once per plan version) that this node's slots of the plan all exited 0."""
        if version in self._marked_done:
            return
        rec = schema.RdzvDoneRecord(node=self.node_id, at=time.time())
        self.client.put(schema.rdzv_done_key(self.job, version, self.node_id),
                        schema.encode(rec))
        self._marked_done.add(version)
        log.info("[%s] node %s: all slots of plan v%d finished", self.job, self.node_id,
                 version)

    def _read_switch_failures(self) -> None:
        """The first ``switch-failed`` in the journal since the last look (``switch_of``), and
        the worker exits' errors (``ScriptErrors``)."""
        for ev in self.view.events_after(self._event_seq):
            self._note_event(ev)

    def _read_journal(self) -> None:
        """Catch up on the journal with one read of etcd (not the view), unless a script's
        error is known already; a failed read leaves what the view gave."""
        if self._script_errors.found is not None:
            return
        try:
            for ev in read_events(self.client, self.job, self._event_seq):
                self._note_event(ev)
        except (RecordError, CoordinationError) as exc:  # a bad record, etcd away
            log.warning("[%s] node %s: reading the journal: %s", self.job, self.node_id, exc)

    def _note_event(self, ev: schema.EventRecord) -> None:
        self._event_seq = max(self._event_seq, ev.seq)
        if ev.type == schema.EventType.FAILURE.value:
            self._script_errors.note(ev, schema.event_detail(ev))
        mark = switch_of(ev)
        if mark is not None and mark.phase == "failed" and not self._switch_failed:
            self._switch_failed = mark.reason or f"plan v{mark.to_version}"
        leader = self.node.leader if self.node is not None else None
        if ev.type == schema.EventType.SWITCH_DONE.value and leader is not None \
                and leader.stragglers is not None and "total_s" in ev.timings:
            leader.stragglers.switched(float(ev.timings["total_s"]))  # the next switch's cost

    def _read_end(self) -> Optional[RoundState]:
        """``rdzv/state`` when it records the job's end, else None: one read, before the job
        view runs (is the job open?) and after a lost compare-and-set (whose end won)."""
        key = schema.rdzv_state_key(self.job)
        try:
            kv = self.client.get(key)
        except CoordinationError as exc:
            raise RendezvousConnectionError(f"read {key}: {exc}") from exc
        if kv is None:
            return None
        try:
            st = RoundState.decode(key, kv.value, kv.mod_revision)
        except RecordError as exc:
            raise RendezvousClosedError(f"unreadable job state {key}: {exc}") from exc
        if st.state not in TERMINAL:
            raise RendezvousClosedError(f"job {self.job!r} runs in restart mode (rendezvous "
                                        f"round {st.round} {st.state}); elastic agents cannot "
                                        "join it: use another --rdzv-id")
        return st

    def _declare(self, outcome: str, reason: str) -> tuple[str, str]:
        """Write the job's end once (compare-and-set); the first writer's verdict wins."""
        key = schema.rdzv_state_key(self.job)
        new = RoundState(round=self.node.plan_version, state=outcome, restart_count=0,
                         reason=reason, at=time.time())
        res = self.client.txn([Compare(key, CompareTarget.MOD, "==", 0)],
                              [PutOp(key, new.encode())])
        if res.succeeded:
            log.info("[%s] node %s: job %s under plan v%d: %s", self.job, self.node_id,
                     outcome, new.round, reason)
            return outcome, reason
        ended = self.view.wait_for(self.view.job_end, END_WAIT_S) or self._read_end()
        return (ended.state, ended.reason) if ended is not None else ("running", "")

    # ------------------------------------------------------------------ endings
    def _finish(self, reason: str) -> None:
        """Success: stop leading, let every worker of the job exit by itself (bounded)."""
        node = self.node
        self.ctx.bar.clear()
        self.transition(ElasticState.FINISHING, reason)
        try:  # every worker of the job, from the view (a bad key is no worker); held before
            # the leader lets go of it, so a leading agent's watch just goes on
            self.view.acquire((Table.WORKERS,), self.client.timeout)
            job_workers = self.view.workers
        except CoordinationError as exc:
            log.warning("[%s] node %s: finishing: %s", self.job, self.node_id, exc)
            job_workers = None
        self._stop_leading()
        deadline = self.clock() + FINISH_WAIT_S
        while self.clock() < deadline and not self.ctx.abort.is_set():
            try:
                for ex in node.workers.poll():
                    self.session.delete(schema.worker_key(self.job, self.node_id, ex.local_rank))
                self._collect_exits()
                if not node.workers.running() and (job_workers is None or not job_workers()):
                    break
            except CoordinationError as exc:
                log.warning("[%s] node %s: finishing: %s", self.job, self.node_id, exc)
                if not node.workers.running():
                    break
            self.ctx.wait(self.cfg.monitor_interval_s)
        else:
            self.ctx.check_abort()
            log.warning("[%s] node %s: workers still running %.0fs after the job finished; "
                        "stopping them", self.job, self.node_id, FINISH_WAIT_S)
        self._stop_workers()
        if self.failures:
            log.info("[%s] node %s: the job recovered from %d worker failure(s) on this node",
                     self.job, self.node_id, len(self.failures))
        self.reason = reason
        self.transition(ElasticState.SUCCEEDED, reason)

    def _fail(self, reason: str) -> None:
        self.ctx.bar.clear()
        log.error("[%s] node %s: job failed: %s; stopping workers", self.job, self.node_id,
                  reason)
        self._stop_workers()
        self._collect_exits()
        self._read_journal()  # the job's first error, when another agent declared the end
        found = self._script_errors.found
        root = None if found is None else next(
            (f for f in self.failures if found.node == self.node_id and f.pid == found.first.pid),
            WorkerFailure.from_exit(found.first, found.node, found.at))
        if self.failures or root is not None:
            print(format_summary(self.cfg.entrypoint_name, self.failures, self.ctx.host, root),
                  file=sys.stderr, flush=True)
        self.reason = f"job failed: {reason}"
        self.transition(ElasticState.FAILED, reason)

    def _stop_leading(self) -> None:
        """The job ended: nothing is left to plan (and leaving nodes must not cause replans)."""
        if self.node is not None and self.node.leader is not None:
            self.node.leader.stop()
            self.node.leader = None

    def _stop_workers(self) -> None:
        """Stop the leader, the workers and the store (idempotent); the agent revokes the
        lease afterwards, which is how the other nodes learn that this one left."""
        if self.node is None:
            return
        self._stop_leading()
        self.node.stop(grace_s=self.cfg.shutdown_timeout_s)
