"""The node agent of ``hspmd-launch``: rendezvous, run the workers, restart, report, clean up.

One agent runs per node. Its lifecycle is the state machine of ``launcher.api.AgentState``
(INIT -> RENDEZVOUS -> RUNNING -> RESTARTING/EXIT_BARRIER -> ... -> SUCCEEDED/FAILED/INTERRUPTED)
with a timestamped history; with ``--hspmd-elastic`` it is INIT -> ELASTIC -> SUCCEEDED/FAILED/
INTERRUPTED, and ``launcher.elastic_mode`` drives the node (workers are never restarted: the
leader replans and the survivors switch in memory). Promises:

* the node record ``nodes/<node>`` and the worker records ``workers/<node>/<local_rank>`` live
  under the agent's lease, so they vanish when the agent dies; events go to ``events/<seq>``;
* every loop is level-triggered: each tick re-reads the workers (exit codes, signals, zombies)
  and the rendezvous state, and converges; nothing depends on having seen a notification;
* workers get torchrun's environment (``worker_env``), with the store hosted by node 0's agent
  (``TORCHELASTIC_USE_AGENT_STORE=True``, like torchrun's c10d/standalone);
* a handled signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default) is forwarded to the workers,
  which get ``--shutdown-timeout`` seconds before SIGKILL; the agent then leaves the job and exits
  1, like torchrun; when workers fail for good it prints torchrun's failure summary and exits 1;
* torchrun's c10d and static backends on several nodes are served the way torchrun serves
  them: the node at the endpoint (c10d) or node rank 0 (static) runs the rendezvous store, an
  etcd member on that port, and keeps it until the other nodes left;
* while it waits in a rendezvous (and, in elastic mode, for the first plan or a switch), an
  agent whose stderr is a terminal shows one progress bar there (``launcher.console``); without
  a terminal it writes only its log lines, as before;
* on every exit path the workers are stopped and reaped, the lease is revoked, and an etcd this
  agent runs (``--standalone``, or the c10d/static store) is stopped; every process the agent
  starts dies with it, even on SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.lease import LeasedSession

from launcher.api import (
    ALLOWED_TRANSITIONS,
    EXIT_FAILED,
    EXIT_OK,
    TERMINAL_STATES,
    AgentState,
    IllegalTransition,
    LaunchConfig,
    LaunchError,
    RendezvousConnectionError,
    SignalReceived,
)
from launcher.console import WaitBar
from launcher.logs import RunLogDir, WorkerLogPaths
from launcher.rendezvous import (
    CLOSED,
    FAILED,
    SUCCEEDED,
    AgentEtcd,
    EtcdRendezvous,
    RoundInfo,
    RoundMoved,
    append_event,
    is_local_address,
)
from launcher.standalone import EtcdNotFoundError, EtcdStartError
from launcher.summary import WorkerFailure, format_summary
from launcher.workers import Worker, WorkerGroup, WorkerGroupState

log = logging.getLogger(__name__)

ETCD_TIMEOUT_S = 5.0
ETCD_CHECK_S = 0.25  # rendezvous re-read period while workers run
ETCD_OUTAGE_MIN_S = 30.0  # how long workers run on while etcd cannot be reached
STORE_WAIT_S = 60.0  # c10d/static: how long a node waits for the serving node's etcd
LINGER_S = 30.0  # the serving node waits this long at most for the others to leave
LOCAL_RANK_MACRO = "${local_rank}"


def worker_env(base: dict[str, str], config: LaunchConfig, info: RoundInfo, local_rank: int,
               master: tuple[str, int], error_file: str, endpoints: tuple[str, ...]) -> dict:
    """The environment of one worker (ARCHITECTURE.md, CONTRACT: worker environment)."""
    a = info.assignment
    env = dict(base)
    env.update({
        "LOCAL_RANK": str(local_rank),
        "RANK": str(a.global_rank(local_rank)),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(a.role_rank(local_rank)),
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.role_world_size),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RESTART_COUNT": str(info.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.rdzv.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(config.signals),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "HSPMD_ETCD_ENDPOINTS": ",".join(endpoints),
        "HSPMD_JOB_ID": config.rdzv.run_id,
        "HSPMD_NODE_ID": config.node_id,
        "HSPMD_ROUND": str(info.round),
        "HSPMD_HEALTH_SOURCE": config.health_source,
    })
    if "OMP_NUM_THREADS" in base:
        env["OMP_NUM_THREADS"] = base["OMP_NUM_THREADS"]
    env.update(config.extra_env)
    return env


class NodeAgent:
    """Runs one node's workers through rounds until the job ends or a signal arrives."""

    def __init__(self, config: LaunchConfig, client: EtcdClient,
                 clock: Callable[[], float] = time.monotonic, hostname: Optional[str] = None):
        self.config = config
        self.client = client
        self.clock = clock
        self.host = hostname or socket.getfqdn()
        self.abort = threading.Event()
        self.signum: Optional[int] = None
        self.state = AgentState.INIT
        self.history: list[tuple[AgentState, float, float, str]] = [
            (AgentState.INIT, clock(), time.time(), "created")]
        self.session = LeasedSession(client, ttl=config.rdzv.lease_ttl_s,
                                     name=f"agent-{config.node_id}")
        self.bar = WaitBar()  # draws only when stderr is a terminal
        self.rdzv = EtcdRendezvous(client, self.session, config.rdzv, config.node_id, self.host,
                                   config.nproc_per_node, abort=self.abort, clock=clock,
                                   on_wait=self.bar.update if self.bar.enabled else None)
        self.logdir = RunLogDir(config.logs, config.rdzv.run_id)
        self.group: Optional[WorkerGroup] = None
        self.round: Optional[RoundInfo] = None
        self.failures: list[WorkerFailure] = []
        self._store: Any = None  # the TCPStore this agent hosts as node 0 of a round
        self._fresh = True
        self._next_check = 0.0
        self._barrier_deadline = 0.0
        self.error_line: Optional[str] = None
        self._etcd_lost_since: Optional[float] = None

    @property
    def job(self) -> str:
        return self.config.rdzv.run_id

    # -------------------------------------------------------------------------- state machine
    def transition(self, new: AgentState, reason: str = "") -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(f"agent state {self.state.value} -> {new.value} not allowed")
        log.debug("[%s] node %s: %s -> %s (%s)", self.job, self.config.node_id,
                  self.state.value, new.value, reason)
        self.state = new
        self.history.append((new, self.clock(), time.time(), reason))

    def on_signal(self, signum: int, _frame=None) -> None:
        if self.signum is None:
            self.signum = signum
        self.abort.set()

    def run(self) -> int:
        """Drive the state machine to a terminal state; returns the exit code."""
        if self.config.elastic is not None:
            return self._run_elastic()
        steps = {
            AgentState.INIT: self._step_init,
            AgentState.RENDEZVOUS: self._step_rendezvous,
            AgentState.RUNNING: self._step_running,
            AgentState.RESTARTING: self._step_restarting,
            AgentState.EXIT_BARRIER: self._step_exit_barrier,
        }
        try:
            while self.state not in TERMINAL_STATES:
                if self.abort.is_set():
                    raise SignalReceived(self.signum or 0, "abort")
                steps[self.state]()
        except SignalReceived:
            self._interrupted()
        except LaunchError as exc:
            log.error("[%s] node %s: %s", self.job, self.config.node_id, exc)
            self._stop_workers()
            if self.state not in TERMINAL_STATES:
                self.transition(AgentState.FAILED, str(exc))
            self.error_line = str(exc)
        finally:
            self._shutdown()
        return EXIT_OK if self.state is AgentState.SUCCEEDED else EXIT_FAILED

    def _run_elastic(self) -> int:
        """Elastic mode (``--hspmd-elastic``): ``launcher.elastic_mode`` drives the node."""
        from launcher.elastic_mode import ElasticRun, ElasticState

        self.transition(AgentState.ELASTIC, "elastic mode")
        run = ElasticRun(self)
        try:
            end = run.run()
        except LaunchError as exc:
            log.error("[%s] node %s: %s", self.job, self.config.node_id, exc)
            end, run.reason = ElasticState.FAILED, str(exc)
        finally:
            self._shutdown()
        final = {ElasticState.SUCCEEDED: AgentState.SUCCEEDED,
                 ElasticState.INTERRUPTED: AgentState.INTERRUPTED}.get(end, AgentState.FAILED)
        self.transition(final, run.reason)
        if final is not AgentState.SUCCEEDED:
            self.error_line = run.reason
        return EXIT_OK if final is AgentState.SUCCEEDED else EXIT_FAILED

    # ---------------------------------------------------------------------------------- steps
    def _step_init(self) -> None:
        self._put_node("joining")
        self.transition(AgentState.RENDEZVOUS, "start")

    def _step_rendezvous(self) -> None:
        self._put_node("joining")
        try:
            info = self.rdzv.next_round(fresh=self._fresh)
        finally:
            self.bar.clear()
        self._fresh = False
        self.round = info
        a = info.assignment
        log.info("[%s] node %s: round %d, group_rank=%d/%d, ranks %d..%d of %d, restart %d/%d",
                 self.job, self.config.node_id, info.round, a.group_rank, a.group_world_size,
                 a.base_global_rank, a.base_global_rank + a.local_world_size - 1, a.world_size,
                 info.restart_count, self.config.max_restarts)
        try:
            master = self._master(info)
        except RoundMoved as exc:
            log.info("[%s] node %s: %s; joining the next round", self.job, self.config.node_id,
                     exc)
            self.transition(AgentState.RENDEZVOUS, str(exc))
            return
        self._start_workers(info, master)
        self._put_node("running")
        self._next_check = self.clock() + ETCD_CHECK_S
        self.transition(AgentState.RUNNING, f"round {info.round}")

    def _step_running(self) -> None:
        self.abort.wait(self.config.monitor_interval_s)
        if self.abort.is_set():
            return
        state = self.group.poll()
        if state is WorkerGroupState.FAILED:
            self._on_worker_failure()
            return
        if state is WorkerGroupState.SUCCEEDED:
            log.info("[%s] node %s: worker group successfully finished; waiting for the other "
                     "nodes", self.job, self.config.node_id)
            self.rdzv.mark_done(self.round)
            self._barrier_deadline = self.clock() + self.config.rdzv.exit_barrier_timeout_s
            self.transition(AgentState.EXIT_BARRIER, "workers succeeded")
            return
        if self.clock() < self._next_check:
            return
        self._next_check = self.clock() + ETCD_CHECK_S
        try:
            what, st = self.rdzv.observe(self.round)
        except RendezvousConnectionError as exc:
            self._etcd_unreachable(exc)
            return
        self._etcd_lost_since = None
        if what == "ok" or what == SUCCEEDED:
            return
        if what == FAILED:
            log.error("[%s] node %s: job failed (%s); stopping workers", self.job,
                      self.config.node_id, st.reason if st else "")
            self._stop_workers()
            self.transition(AgentState.FAILED, "job failed elsewhere")
            return
        if what != "moved":
            reason = "node joined" if what == "join" else f"node {what[5:]} left"
            log.info("[%s] node %s: %s; re-rendezvous (no restart consumed)", self.job,
                     self.config.node_id, reason)
            _, ours = self.rdzv.move_on(st, reason, count_restart=False,
                                        max_restarts=self.config.max_restarts)
            if ours:  # one event per membership change, from the node that acted on it
                append_event(self.client, self.job, "join" if what == "join" else "leave",
                             self.config.node_id, {"round": self.round.round, "reason": reason})
        self.transition(AgentState.RESTARTING, what)

    def _etcd_unreachable(self, exc: RendezvousConnectionError) -> None:
        """Workers keep running through a short etcd outage; a long one ends the agent."""
        now = self.clock()
        if self._etcd_lost_since is None:
            self._etcd_lost_since = now
            log.warning("[%s] node %s: etcd unreachable, workers keep running: %s", self.job,
                        self.config.node_id, exc)
        tolerance = max(ETCD_OUTAGE_MIN_S, 3 * self.config.rdzv.lease_ttl_s)
        if now - self._etcd_lost_since > tolerance:
            raise RendezvousConnectionError(
                f"etcd unreachable for more than {tolerance:.0f}s: {exc}") from exc

    def _on_worker_failure(self) -> None:
        info = self.round
        self.failures = [
            WorkerFailure(local_rank=w.local_rank, global_rank=w.global_rank, pid=w.pid,
                          exitcode=w.exitcode, error_file=w.logs.error_file,
                          observed_at=w.exited_at or time.time())
            for w in self.group.failed_workers()
        ]
        first = min(self.failures, key=lambda f: (f.timestamp, f.global_rank))
        reason = (f"worker failure on {self.config.node_id}: rank {first.global_rank} "
                  f"exitcode {first.exitcode}")
        for f in self.failures:  # torchrun's line, for log scrapers that know it
            log.error("failed (exitcode: %d) local_rank: %d (pid: %d) of binary: %s",
                      f.exitcode, f.local_rank, f.pid, self.config.entrypoint[0])
        append_event(self.client, self.job, "failure", self.config.node_id,
                     {"round": info.round, "failures": [f.to_dict() for f in self.failures]})
        st, ours = self.rdzv.read_state(), False
        if st is not None and st.round == info.round and st.state == CLOSED:
            st, ours = self.rdzv.move_on(st, reason, count_restart=True,
                                         max_restarts=self.config.max_restarts)
        self._stop_workers()
        if st is not None and st.round > info.round:
            log.info("[%s] node %s: worker group FAILED; restart %d/%d (%s)", self.job,
                     self.config.node_id, st.restart_count, self.config.max_restarts,
                     "this node's failure" if ours else st.reason)
            if ours:
                append_event(self.client, self.job, "restart", self.config.node_id,
                             {"round": st.round, "restart_count": st.restart_count,
                              "reason": st.reason})
            self.transition(AgentState.RESTARTING, reason)
            return
        summary = format_summary(self.config.entrypoint_name, self.failures, self.host)
        print(summary, file=sys.stderr, flush=True)
        self.transition(AgentState.FAILED, reason)

    def _step_restarting(self) -> None:
        self._stop_workers()
        self._put_node("joining")
        self.transition(AgentState.RENDEZVOUS, "restart")

    def _step_exit_barrier(self) -> None:
        st = self.rdzv.settle(self.round)
        if st is not None and st.round == self.round.round and st.state == SUCCEEDED:
            self.transition(AgentState.SUCCEEDED, "all nodes done")
            return
        if st is not None and st.state == FAILED:
            log.error("[%s] node %s: job failed on another node (%s)", self.job,
                      self.config.node_id, st.reason)
            self.transition(AgentState.FAILED, "job failed elsewhere")
            return
        if st is None or st.round > self.round.round:
            log.info("[%s] node %s: the job moved to round %s; running again", self.job,
                     self.config.node_id, st.round if st else "?")
            self.transition(AgentState.RENDEZVOUS, "round moved during exit barrier")
            return
        if self.clock() >= self._barrier_deadline:
            log.warning("[%s] node %s: exit barrier timed out after %.0fs; exiting", self.job,
                        self.config.node_id, self.config.rdzv.exit_barrier_timeout_s)
            self.transition(AgentState.SUCCEEDED, "exit barrier timeout")
            return
        self.abort.wait(0.1)

    # ------------------------------------------------------------------------------- workers
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
            addr = self.host
        from torch.distributed import TCPStore  # late: only node 0 hosts a store

        try:
            self._store = TCPStore(addr, cfg.master_port or 0, None, True,
                                   wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise LaunchError(f"cannot host the workers' store on {addr}:"
                              f"{cfg.master_port or 0}: {exc}") from exc
        port = int(self._store.port)
        self.rdzv.publish_master(info.round, addr, port)
        return addr, port

    def _drop_store(self) -> None:
        self._store = None

    def _start_workers(self, info: RoundInfo, master: tuple[str, int]) -> None:
        cfg = self.config
        paths = self.logdir.attempt(info.restart_count, cfg.nproc_per_node)
        base = dict(os.environ)
        workers = []
        for lr in range(cfg.nproc_per_node):
            p: WorkerLogPaths = paths[lr]
            argv = tuple(a.replace(LOCAL_RANK_MACRO, str(lr)) for a in cfg.entrypoint)
            env = worker_env(base, cfg, info, lr, master, p.error_file, self.client.endpoints)
            workers.append(Worker(local_rank=lr, global_rank=info.assignment.global_rank(lr),
                                  argv=argv, env=env, logs=p))
        self.group = WorkerGroup(role=cfg.role, workers=workers)
        self.group.start()
        log.info("[%s] node %s: started %d worker(s) pids=%s (master %s:%d)", self.job,
                 cfg.node_id, len(workers), self.group.pids(), master[0], master[1])
        for w in workers:
            rec = schema.WorkerRecord(pid=w.pid, global_rank=w.global_rank,
                                      local_rank=w.local_rank, plan_version=info.round, step=0,
                                      last_progress_at=time.time(), steps_per_s=0.0)
            self._put(schema.worker_key(self.job, cfg.node_id, w.local_rank), schema.encode(rec))

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.group is not None and self.group.state is not WorkerGroupState.STOPPED:
            self.group.stop(signum, self.config.shutdown_timeout_s)
        self._drop_store()

    def _interrupted(self) -> None:
        signum = self.signum or signal.SIGTERM
        name = signal.Signals(signum).name
        log.warning("[%s] node %s: received %s, shutting down workers", self.job,
                    self.config.node_id, name)
        self._stop_workers(signum)
        if self.state not in TERMINAL_STATES:
            self.transition(AgentState.INTERRUPTED, name)
        self.error_line = f"process {os.getpid()} got signal: {signum} ({name})"

    # -------------------------------------------------------------------------------- etcd
    def _put(self, key: str, value: bytes) -> None:
        try:
            self.session.put(key, value)
        except CoordinationError as exc:
            raise RendezvousConnectionError(f"write {key}: {exc}") from exc

    def _put_node(self, state: str) -> None:
        rec = schema.NodeRecord(host=self.host, agent_pid=os.getpid(), devices=[], state=state,
                                started_at=self.history[0][2])
        self._put(schema.node_key(self.job, self.config.node_id), schema.encode(rec))

    def _shutdown(self) -> None:
        self.bar.clear()
        self._stop_workers()
        log.debug("[%s] node %s: state history %s", self.job, self.config.node_id,
                  [(s.value, round(t, 3), why) for s, t, _, why in self.history])
        try:
            if self.session.started and self.config.elastic is None:
                state = "failed" if self.state is AgentState.FAILED else "leaving"
                try:
                    self._put_node(state)
                except LaunchError:
                    pass
            self.session.stop(revoke=True, timeout=ETCD_TIMEOUT_S)
        except CoordinationError as exc:
            log.warning("[%s] node %s: leaving etcd: %s", self.job, self.config.node_id, exc)


# ------------------------------------------------------------------------------------ launch
def _install_signals(config: LaunchConfig, handler) -> dict[int, Any]:
    previous = {}
    for name in config.signals:
        signum = getattr(signal, name, None)
        if signum is None or signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        previous[signum] = signal.signal(signum, handler)
    return previous


def _omp_default(config: LaunchConfig) -> None:
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        log.warning("Setting OMP_NUM_THREADS environment variable for each process to be 1 in "
                    "default, to avoid your system being overloaded, please further tune the "
                    "variable for optimal performance in your application as needed.")
        os.environ["OMP_NUM_THREADS"] = "1"


def _serve_store(config: LaunchConfig) -> Optional[AgentEtcd]:
    """c10d/static: start the rendezvous etcd when this node is the one that serves it."""
    if not config.rdzv.host_etcd:
        return None
    host, _, port = config.rdzv.endpoints[0].rpartition(":")
    if config.rdzv.backend == "c10d" and not is_local_address(host):
        return None
    hosted = AgentEtcd(host, int(port))
    if not hosted.start():
        return None
    log.info("serving the rendezvous store (etcd) at %s:%s for --rdzv-backend %s", host, port,
             config.rdzv.backend)
    return hosted


def _connect(config: LaunchConfig, endpoints: tuple[str, ...], abort: list[int]) -> EtcdClient:
    """A client that reached etcd; c10d/static nodes wait for the serving node to come up."""
    client = EtcdClient(list(endpoints), timeout=ETCD_TIMEOUT_S)
    patient = config.rdzv.backend in ("c10d", "static") and not config.rdzv.standalone
    deadline = time.monotonic() + (min(config.rdzv.join_timeout_s, STORE_WAIT_S) if patient
                                   else 0.0)
    waited = False
    while True:
        try:
            client.revision()
            return client
        except CoordinationError as exc:
            if abort:
                client.close()
                raise SignalReceived(abort[0], signal.Signals(abort[0]).name) from exc
            if time.monotonic() >= deadline:
                client.close()
                hint = ""
                if patient:
                    hint = (f" (--rdzv-backend {config.rdzv.backend}: the node at the endpoint "
                            "serves an etcd there; is it up?)")
                raise RendezvousConnectionError(
                    f"cannot reach etcd at {','.join(endpoints)}: {exc}{hint}") from exc
            if not waited:
                log.info("waiting for the rendezvous store at %s", ",".join(endpoints))
            waited = True
            time.sleep(0.5)


def _linger(client: EtcdClient, config: LaunchConfig) -> None:
    """The node serving the store stays until the other nodes left (bounded)."""
    prefix = schema.nodes_prefix(config.rdzv.run_id)
    mine = schema.node_key(config.rdzv.run_id, config.node_id)
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if not [kv for kv in client.get_prefix(prefix) if kv.key != mine]:
                return
        except CoordinationError:
            return
        time.sleep(0.1)
    log.warning("other nodes still registered after %.0fs; stopping the rendezvous store",
                LINGER_S)


def launch(config: LaunchConfig) -> int:
    """Run one node agent to the end; returns torchrun's exit code. Raises LaunchError."""
    _omp_default(config)
    embedded = hosted = client = None
    pending: list[int] = []
    previous = _install_signals(config, lambda signum, _f: pending.append(signum))
    try:
        endpoints = config.rdzv.endpoints
        try:
            if config.rdzv.standalone:
                embedded = AgentEtcd()
                embedded.start()
                endpoints = (embedded.endpoint,)
                log.info("standalone: embedded etcd at %s, --rdzv-id=%s", embedded.endpoint,
                         config.rdzv.run_id)
            hosted = _serve_store(config)
        except (EtcdNotFoundError, EtcdStartError) as exc:
            raise LaunchError(str(exc)) from exc
        client = _connect(config, endpoints, pending)
        agent = NodeAgent(config, client)
        _install_signals(config, agent.on_signal)
        for signum in pending:
            agent.on_signal(signum)
        code = agent.run()
        if agent.error_line:
            print(f"hspmd-launch: error: {agent.error_line}", file=sys.stderr, flush=True)
        return code
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        if hosted is not None and client is not None:
            _linger(client, config)
        if client is not None:
            client.close()
        if hosted is not None:
            hosted.stop()
        if embedded is not None:
            embedded.stop()
