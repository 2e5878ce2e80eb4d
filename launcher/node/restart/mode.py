"""Restart mode of the node agent: torchrun's semantics for any script.

The mode's lifecycle is ``RestartState`` with the table ``TRANSITIONS`` (INIT -> RENDEZVOUS ->
RUNNING -> RESTARTING/EXIT_BARRIER -> ... -> SUCCEEDED/FAILED/INTERRUPTED), run on the one
``coord.lifecycle.StateMachine``. Promises:

* the node record ``nodes/<node>`` and the worker records ``workers/<node>/<local_rank>`` live
  under the agent's lease, so they vanish when the agent dies; events go to ``events/<seq>``;
* every tick is level-triggered: it re-reads the workers (exit codes, signals, zombies) and the
  rendezvous state, and converges; nothing depends on having seen a notification;
* workers get torchrun's environment (``env.worker_env``), with the store hosted by node 0's
  agent (``TORCHELASTIC_USE_AGENT_STORE=True``, like torchrun's c10d/standalone);
* a worker failure restarts every worker through a new round and counts against
  ``--max-restarts``; a node joining or leaving bumps the round without counting; when the
  restarts are used up the agent prints torchrun's failure summary and fails;
* while workers run, an etcd outage is ridden out as the agent's ``EtcdOutagePolicy`` says:
  the workers keep running, and a node whose records vanished with an expired lease during
  the outage is not taken for a node that left while it reconciles (its agent re-creates them
  under a new lease); only a round that really moved on stops this node's workers;
* the health source (``--hspmd-health-source``) is polled while workers run: a device with a
  fatal verdict stops the workers and the node joins the next round without it (fewer local
  workers, ``CUDA_VISIBLE_DEVICES`` naming the usable devices; counted as a restart); with no
  usable device left the node leaves (when the other nodes still meet ``--nnodes`` MIN) or the
  job fails, the verdict being the root cause (``restart_health.py``);
* a worker that calls ``hspmd_elastic.heartbeat(step)`` is watched for hangs
  (``HSPMD_HANG_*`` limits): a hung worker gets a ``stall`` event, is SIGKILLed and counts as a
  worker failure; without heartbeats restart mode has no hang rule;
* each non-terminal state is bounded: RENDEZVOUS by ``join_timeout`` (and the master wait by
  ``close_timeout``), RESTARTING by the shutdown grace plus the SIGKILL wait, EXIT_BARRIER by
  ``exit_barrier_timeout``; RUNNING lasts as long as the workers do.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError, LeaseLostError
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.coord.lifecycle import StateMachine
from launcher.api import LaunchError, RendezvousConnectionError
from launcher.health.api import HealthConfigError, HealthSource
from launcher.health.progress import hang_detector_from_env
from launcher.health.verdicts import VerdictPublisher, select_health_source
from launcher.logs import WorkerLogPaths
from launcher.node.api import AgentContext, End, ModeOutcome, StopCause
from launcher.node.env import worker_argv, worker_env
from launcher.node.hangs import ProgressMonitor
from launcher.node.restart.rendezvous import (
    CLOSED,
    FAILED,
    SUCCEEDED,
    EtcdRendezvous,
    RoundInfo,
    RoundMoved,
    append_event,
)
from launcher.node.restart.health import (
    FAIL,
    LEAVE,
    DeviceWatch,
    HeartbeatWatch,
    Slot,
    after_device_loss,
    node_slots,
)
from launcher.node.store import StoreServer
from launcher.node.workers import KILL_WAIT_S, Worker, WorkerGroup, WorkerGroupState
from launcher.summary import WorkerFailure, format_summary

log = logging.getLogger(__name__)

ETCD_CHECK_S = 0.25  # rendezvous re-read period while workers run


class RestartState(enum.Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"  # stopping workers before the next round
    EXIT_BARRIER = "exit_barrier"  # our workers succeeded; waiting for the other nodes
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # a handled signal


_R = RestartState
TERMINAL_STATES = frozenset({_R.SUCCEEDED, _R.FAILED, _R.INTERRUPTED})
_ENDS = {_R.FAILED, _R.INTERRUPTED}
TRANSITIONS: dict[RestartState, frozenset[RestartState]] = {
    _R.INIT: frozenset({_R.RENDEZVOUS, *_ENDS}),
    _R.RENDEZVOUS: frozenset({_R.RUNNING, _R.RENDEZVOUS, *_ENDS}),
    _R.RUNNING: frozenset({_R.RESTARTING, _R.EXIT_BARRIER, *_ENDS}),
    _R.RESTARTING: frozenset({_R.RENDEZVOUS, *_ENDS}),
    _R.EXIT_BARRIER: frozenset({_R.SUCCEEDED, _R.RENDEZVOUS, *_ENDS}),
    _R.SUCCEEDED: frozenset(),
    _R.FAILED: frozenset(),
    _R.INTERRUPTED: frozenset(),
}
_END_OF = {_R.SUCCEEDED: End.SUCCEEDED, _R.FAILED: End.FAILED, _R.INTERRUPTED: End.INTERRUPTED}


class RestartMode:
    """Runs one node's workers through rendezvous rounds (see the module docstring)."""

    def __init__(self, ctx: AgentContext):
        self.ctx, self.config, self.client = ctx, ctx.config, ctx.client
        self.job, self.node_id = ctx.job, ctx.node_id
        self.machine = StateMachine("agent", TRANSITIONS, RestartState.INIT, "created",
                                    clock=ctx.clock)
        self.rdzv = EtcdRendezvous(ctx.client, ctx.session, self.config.rdzv, self.node_id,
                                   ctx.host, self.config.nproc_per_node, abort=ctx.abort,
                                   clock=ctx.clock,
                                   on_wait=ctx.bar.update if ctx.bar.enabled else None,
                                   outage=ctx.outage)
        self.group: Optional[WorkerGroup] = None
        self.round: Optional[RoundInfo] = None
        self.failures: list[WorkerFailure] = []
        self.store: Optional[StoreServer] = None  # hosted while this node is node 0 of a round
        self._fresh = True
        self._next_check = 0.0
        self._barrier_deadline = 0.0
        self._error = ""
        self.health: Optional[HealthSource] = None
        self.devices: Optional[DeviceWatch] = None
        self.heartbeats: Optional[HeartbeatWatch] = None
        self._running: list[Slot] = []  # the slots the current workers run on

    @property
    def state(self) -> RestartState:
        return self.machine.state

    def transition(self, new: RestartState, reason: str = "") -> None:
        log.debug("[%s] node %s: %s -> %s (%s)", self.job, self.node_id, self.state.value,
                  new.value, reason)
        self.machine.to(new, reason)

    # ------------------------------------------------------------------ the Mode protocol
    def start(self) -> None:
        self._start_watches()
        self._put_node("joining")
        self.transition(RestartState.RENDEZVOUS, "start")

    def tick(self) -> Optional[ModeOutcome]:
        steps = {
            RestartState.RENDEZVOUS: self._step_rendezvous,
            RestartState.RUNNING: self._step_running,
            RestartState.RESTARTING: self._step_restarting,
            RestartState.EXIT_BARRIER: self._step_exit_barrier,
        }
        if self.state not in TERMINAL_STATES:
            steps[self.state]()
        if self.state in TERMINAL_STATES:
            reason = self.machine.history[-1].reason
            return ModeOutcome(_END_OF[self.state], reason, self._error)
        return None

    def stop(self, cause: Optional[StopCause]) -> ModeOutcome:
        """Stop the workers (the signal's own, else SIGTERM), record the end, and leave the
        node record as ``failed`` or ``leaving`` (the shell revokes the lease after)."""
        signum = cause.signum if cause is not None and cause.signum is not None else None
        if signum is not None:
            log.warning("[%s] node %s: received %s, shutting down workers", self.job,
                        self.node_id, signal.Signals(signum).name)
        elif cause is not None:
            log.error("[%s] node %s: %s", self.job, self.node_id, cause.error)
        try:
            self._stop_workers(signum or signal.SIGTERM)
        finally:
            if self.health is not None:
                self.health.stop()
        if cause is not None and self.state not in TERMINAL_STATES:
            outcome = cause.outcome()
            self.transition(RestartState.INTERRUPTED if signum is not None
                            else RestartState.FAILED, outcome.reason)
        elif cause is not None:
            outcome = cause.outcome()
        else:
            outcome = ModeOutcome(_END_OF[self.state], self.machine.history[-1].reason,
                                  self._error)
        log.debug("[%s] node %s: state history %s", self.job, self.node_id,
                  self.machine.describe())
        if self.ctx.session.started:
            try:
                self._put_node("failed" if self.state is RestartState.FAILED else "leaving")
            except LaunchError:
                pass
        return outcome

    # ------------------------------------------------------------------ steps
    def _step_rendezvous(self) -> None:
        if not self._fit_slots():
            return
        self._put_node("joining")
        try:
            info = self.rdzv.next_round(fresh=self._fresh)
        finally:
            self.ctx.bar.clear()
        self._fresh = False
        self.round = info
        a = info.assignment
        log.info("[%s] node %s: round %d, group_rank=%d/%d, ranks %d..%d of %d, restart %d/%d",
                 self.job, self.node_id, info.round, a.group_rank, a.group_world_size,
                 a.base_global_rank, a.base_global_rank + a.local_world_size - 1, a.world_size,
                 info.restart_count, self.config.max_restarts)
        try:
            master = self._master(info)
        except RoundMoved as exc:
            log.info("[%s] node %s: %s; joining the next round", self.job, self.node_id, exc)
            self.transition(RestartState.RENDEZVOUS, str(exc))
            return
        self._start_workers(info, master)
        self._put_node("running")
        self._next_check = self.ctx.clock() + ETCD_CHECK_S
        self.transition(RestartState.RUNNING, f"round {info.round}")

    def _step_running(self) -> None:
        if self.ctx.wait(self.config.monitor_interval_s):
            return
        state = self.group.poll()
        if state is WorkerGroupState.FAILED:
            self._on_worker_failure()
            return
        if state is WorkerGroupState.HEALTHY and self._check_watches():
            return
        if state is WorkerGroupState.SUCCEEDED:
            log.info("[%s] node %s: worker group successfully finished; waiting for the other "
                     "nodes", self.job, self.node_id)
            self.rdzv.mark_done(self.round)
            self._barrier_deadline = self.ctx.clock() + self.config.rdzv.exit_barrier_timeout_s
            self.transition(RestartState.EXIT_BARRIER, "workers succeeded")
            return
        if self.ctx.clock() < self._next_check:
            return
        self._next_check = self.ctx.clock() + ETCD_CHECK_S
        started = self.ctx.clock()
        try:
            what, st = self.rdzv.observe(self.round)
        except RendezvousConnectionError as exc:
            self.ctx.outage.unreachable(exc)
            return
        self.ctx.outage.reachable(started)
        if what == "ok" or what == SUCCEEDED:
            return
        if what.startswith("left:") and self.ctx.outage.reconciling():
            # After an etcd outage, leases that expired are being re-granted: a node whose
            # record is missing now is not a node that left until the window is over.
            log.debug("[%s] node %s: %s missing while reconciling after an etcd outage",
                      self.job, self.node_id, what[5:])
            return
        if what == FAILED:
            log.error("[%s] node %s: job failed (%s); stopping workers", self.job, self.node_id,
                      st.reason if st else "")
            self._stop_workers()
            self.transition(RestartState.FAILED, "job failed elsewhere")
            return
        if what != "moved":
            reason = "node joined" if what == "join" else f"node {what[5:]} left"
            log.info("[%s] node %s: %s; re-rendezvous (no restart consumed)", self.job,
                     self.node_id, reason)
            _, ours = self.rdzv.move_on(st, reason, count_restart=False,
                                        max_restarts=self.config.max_restarts)
            if ours:  # one event per membership change, from the node that acted on it
                if what == "join":
                    nodes = sorted({p.node for p in self.rdzv.joined(self.round.round + 1)})
                else:
                    nodes = [what[5:]]
                append_event(self.client, self.job, "join" if what == "join" else "leave",
                             self.node_id, schema.ChangeDetail(
                                 reason=reason, round=self.round.round, nodes=nodes))
        self.transition(RestartState.RESTARTING, what)

    def _on_worker_failure(self, cause: str = "") -> None:
        info = self.round
        self.failures = [
            WorkerFailure(local_rank=w.local_rank, global_rank=w.global_rank, pid=w.pid,
                          exitcode=w.exitcode, error_file=w.logs.error_file,
                          observed_at=w.exited_at or time.time())
            for w in self.group.failed_workers()
        ]
        if cause:
            reason = cause
        else:
            first = min(self.failures, key=lambda f: (f.timestamp, f.global_rank))
            reason = (f"worker failure on {self.node_id}: rank {first.global_rank} "
                      f"exitcode {first.exitcode}")
        for f in self.failures:  # torchrun's line, for log scrapers that know it
            log.error("failed (exitcode: %d) local_rank: %d (pid: %d) of binary: %s",
                      f.exitcode, f.local_rank, f.pid, self.config.entrypoint[0])
        append_event(self.client, self.job, "failure", self.node_id, schema.FailureDetail(
            devices=[device_id(self.node_id, f.local_rank) for f in self.failures],
            reason=reason, round=info.round, exits=[f.exit_info() for f in self.failures]))
        st, ours = self.rdzv.read_state(), False
        if st is not None and st.round == info.round and st.state == CLOSED:
            st, ours = self.rdzv.move_on(st, reason, count_restart=True,
                                         max_restarts=self.config.max_restarts)
        self._stop_workers()
        if st is not None and st.round > info.round:
            log.info("[%s] node %s: worker group FAILED; restart %d/%d (%s)", self.job,
                     self.node_id, st.restart_count, self.config.max_restarts,
                     "this node's failure" if ours else st.reason)
            if ours:
                append_event(self.client, self.job, "restart", self.node_id,
                             schema.RestartDetail(st.round, st.restart_count, st.reason))
            self.transition(RestartState.RESTARTING, reason)
            return
        summary = format_summary(self.config.entrypoint_name, self.failures, self.ctx.host)
        print(summary, file=sys.stderr, flush=True)
        if cause:
            self._error = cause
        self.transition(RestartState.FAILED, reason)

    def _step_restarting(self) -> None:
        self._stop_workers()
        self._put_node("joining")
        self.transition(RestartState.RENDEZVOUS, "restart")

    def _step_exit_barrier(self) -> None:
        st = self.rdzv.settle(self.round)
        if st is not None and st.round == self.round.round and st.state == SUCCEEDED:
            self.transition(RestartState.SUCCEEDED, "all nodes done")
            return
        if st is not None and st.state == FAILED:
            log.error("[%s] node %s: job failed on another node (%s)", self.job, self.node_id,
                      st.reason)
            self.transition(RestartState.FAILED, "job failed elsewhere")
            return
        if st is None or st.round > self.round.round:
            log.info("[%s] node %s: the job moved to round %s; running again", self.job,
                     self.node_id, st.round if st else "?")
            self.transition(RestartState.RENDEZVOUS, "round moved during exit barrier")
            return
        if self.ctx.clock() >= self._barrier_deadline:
            log.warning("[%s] node %s: exit barrier timed out after %.0fs; exiting", self.job,
                        self.node_id, self.config.rdzv.exit_barrier_timeout_s)
            self.transition(RestartState.SUCCEEDED, "exit barrier timeout")
            return
        self.ctx.wait(0.1)

    # ------------------------------------------------------------------ health and hangs
    def _start_watches(self) -> None:
        """The health source (``--hspmd-health-source``), the slots it watches, the verdict
        publisher and the hang detector (``HSPMD_HANG_*``)."""
        cfg, session = self.config, self.ctx.session
        try:
            detector = hang_detector_from_env(os.environ, clock=self.ctx.clock)
            self.health = select_health_source(cfg.health_source, node=self.node_id,
                                               devices=cfg.nproc_per_node, job=self.job,
                                               etcd=self.client, clock=self.ctx.clock)
        except HealthConfigError as exc:
            raise LaunchError(str(exc)) from exc
        self.health.start()
        publisher = VerdictPublisher(self.client, self.job, self.node_id,
                                     lease=lambda: session.lease_id or 0, clock=self.ctx.clock)
        leases = [0]

        def publish(verdicts) -> None:
            lease = session.lease_id or 0
            if not lease:
                return  # device records live under the node's lease
            if lease != leases[0]:
                leases[0] = lease
                publisher.republish_all()
            publisher.publish(verdicts)

        slots = node_slots(cfg.nproc_per_node, os.environ.get("CUDA_VISIBLE_DEVICES"),
                           self.health.devices())
        self.devices = DeviceWatch(self.health, slots, publish=publish, clock=self.ctx.clock)
        self.heartbeats = HeartbeatWatch(ProgressMonitor(detector, clock=self.ctx.clock))

    def _fit_slots(self) -> bool:
        """Before joining a round: join with the usable slots only. False when none is left
        (the mode has then ended)."""
        self.devices.refresh()
        usable = len(self.devices.usable())
        if usable == self.rdzv.local_world_size:
            return True
        if usable >= 1:
            log.warning("[%s] node %s: joining with %d of %d device(s): %s", self.job,
                        self.node_id, usable, self.config.nproc_per_node,
                        self.devices.root_cause(self.devices.out()))
            self.rdzv.local_world_size = usable
            return True
        participants = len(self.round.participants) if self.round is not None else 1
        self._no_device_left(self.devices.root_cause(self.devices.out()), participants)
        return False

    def _check_watches(self) -> bool:
        """While the workers run: a failed device they use, or a hung worker, ends the round
        (True)."""
        self.devices.refresh()
        bad = [s for s in self._running if s.position in self.devices.failed]
        if bad:
            self._on_device_failure(bad)
            return True
        live = {w.local_rank: w.pid for w in self.group.workers if w.exitcode is None}
        hangs = self.heartbeats.check(live)
        if hangs:
            self._on_hang(hangs)
            return True
        return False

    def _on_device_failure(self, bad: list[Slot]) -> None:
        info, cfg = self.round, self.config
        reason = f"{self.devices.root_cause(bad)} on node {self.node_id}"
        log.error("[%s] node %s: %s; stopping workers", self.job, self.node_id, reason)
        append_event(self.client, self.job, "failure", self.node_id, schema.FailureDetail(
            devices=[device_id(self.node_id, s.position) for s in bad], reason=reason,
            round=info.round))
        self._stop_workers()
        usable = len(self.devices.usable())
        if usable == 0:
            self._no_device_left(reason, len(info.participants))
            return
        self.rdzv.local_world_size = usable
        st, ours = self.rdzv.read_state(), False
        if st is not None and st.round == info.round and st.state == CLOSED:
            st, ours = self.rdzv.move_on(st, reason, count_restart=True,
                                         max_restarts=cfg.max_restarts)
        if st is not None and st.round > info.round:
            log.warning("[%s] node %s: restarting without %s: %d worker(s) here; restart %d/%d",
                        self.job, self.node_id, ", ".join(f"GPU {s.token}" for s in bad),
                        usable, st.restart_count, cfg.max_restarts)
            if ours:
                append_event(self.client, self.job, "restart", self.node_id,
                             schema.RestartDetail(st.round, st.restart_count, reason))
            self.transition(RestartState.RESTARTING, reason)
            return
        used = f" (restarts used up: {st.restart_count}/{cfg.max_restarts})" if st else ""
        self._error = reason + used
        self.transition(RestartState.FAILED, reason)

    def _no_device_left(self, reason: str, participants: int) -> None:
        """Every slot of this node failed: leave the job to the other nodes when ``--nnodes``
        MIN allows, else fail the job; the verdict is the root cause either way."""
        decision = after_device_loss(0, participants, self.config.rdzv.min_nodes)
        if decision == LEAVE:
            self._error = f"{reason}; no usable device left: this node leaves the job"
        else:
            assert decision == FAIL
            self._error = f"{reason}; no usable device left"
            st = self.rdzv.read_state()
            if st is not None and st.state not in (SUCCEEDED, FAILED):
                self.rdzv.move_on(st, self._error, count_restart=True, max_restarts=0)
        self.transition(RestartState.FAILED, reason)

    def _on_hang(self, hangs: list) -> None:
        """Hung workers: a ``stall`` event each, SIGKILL (a frozen process never exits by
        itself), then a worker failure like any other (counted)."""
        workers = {w.local_rank: w for w in self.group.workers}
        causes = []
        for hang in hangs:
            w = workers[hang.worker]
            cause = (f"hang on {self.node_id}: local rank {w.local_rank} (rank {w.global_rank}, "
                     f"pid {w.pid}) made no progress for {hang.stalled_s:.1f}s at step "
                     f"{hang.step} (limit {hang.limit_s:.1f}s)")
            causes.append(cause)
            log.error("[%s] node %s: %s; killing it", self.job, self.node_id, cause)
            append_event(self.client, self.job, "stall", self.node_id, schema.StallDetail(
                devices=[device_id(self.node_id, w.local_rank)], reason=cause,
                round=self.round.round, local_rank=w.local_rank, pid=w.pid, step=hang.step,
                stalled_s=round(hang.stalled_s, 3)))
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
                try:
                    w.proc.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    log.warning("[%s] node %s: hung pid %d not reaped after SIGKILL", self.job,
                                self.node_id, w.pid)
        self.group.poll()
        self._on_worker_failure(cause=causes[0])

    def _progress_files(self, info: RoundInfo, count: int) -> dict[int, str]:
        """Where each worker of the round writes its heartbeats (``HSPMD_PROGRESS_FILE``)."""
        folder = os.path.join(self.ctx.logdir.run_dir, "progress")
        os.makedirs(folder, exist_ok=True)
        return {lr: os.path.join(folder, f"round{info.round}_local{lr}.json")
                for lr in range(count)}

    # ------------------------------------------------------------------ workers
    def _master(self, info: RoundInfo) -> tuple[str, int]:
        self._drop_store()
        if info.assignment.group_rank != 0:
            return self.rdzv.wait_master(info.round, self.config.rdzv.close_timeout_s)
        cfg = self.config
        if cfg.master_addr is not None:
            addr = cfg.master_addr
        elif cfg.local_addr:
            addr = cfg.local_addr
        elif cfg.rdzv.standalone:
            addr = "localhost"
        else:
            addr = self.ctx.host
        self.store = StoreServer(addr, cfg.master_port or 0).start()
        self.rdzv.publish_master(info.round, addr, self.store.port)
        return addr, self.store.port

    def _drop_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _start_workers(self, info: RoundInfo, master: tuple[str, int]) -> None:
        cfg = self.config
        count = info.assignment.local_world_size
        paths = self.ctx.logdir.attempt(info.restart_count, count)
        progress = self._progress_files(info, count)
        self._running = self.devices.running(count)
        visible = [s.token for s in self._running] if self.devices.failed else None
        self.heartbeats.watch(progress)
        base = dict(os.environ)
        workers = []
        for lr in range(count):
            p: WorkerLogPaths = paths[lr]
            env = worker_env(base, cfg, info, lr, master, p.error_file, self.client.endpoints,
                             progress_file=progress[lr], visible_devices=visible)
            workers.append(Worker(local_rank=lr, global_rank=info.assignment.global_rank(lr),
                                  argv=worker_argv(cfg.entrypoint, lr), env=env, logs=p))
        self.group = WorkerGroup(role=cfg.role, workers=workers)
        self.group.start()
        log.info("[%s] node %s: started %d worker(s) pids=%s (master %s:%d)", self.job,
                 self.node_id, len(workers), self.group.pids(), master[0], master[1])
        for w in workers:
            rec = schema.WorkerRecord(pid=w.pid, global_rank=w.global_rank,
                                      local_rank=w.local_rank, plan_version=info.round, step=0,
                                      last_progress_at=time.time(), steps_per_s=0.0)
            self._put(schema.worker_key(self.job, self.node_id, w.local_rank),
                      schema.encode(rec))

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.group is not None and self.group.state is not WorkerGroupState.STOPPED:
            self.group.stop(signum, self.config.shutdown_timeout_s)
        self._drop_store()

    # ------------------------------------------------------------------ etcd
    def _put(self, key: str, value: bytes) -> None:
        """Write an owned key. While the lease is being replaced the session writes it once a
        new lease exists; while etcd is away the outage policy decides how long that is fine."""
        try:
            self.ctx.session.put(key, value)
        except LeaseLostError:
            log.debug("[%s] node %s: %s is written when the lease is re-granted", self.job,
                      self.node_id, key)
        except CoordinationError as exc:
            if self.state is not RestartState.RUNNING:
                raise RendezvousConnectionError(f"write {key}: {exc}") from exc
            self.ctx.outage.unreachable(RendezvousConnectionError(f"write {key}: {exc}"))

    def _put_node(self, state: str) -> None:
        rec = schema.NodeRecord(host=self.ctx.host, agent_pid=os.getpid(), devices=[],
                                state=state, started_at=self.ctx.started_at)
        self._put(schema.node_key(self.job, self.node_id), schema.encode(rec))
