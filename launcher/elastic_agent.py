"""Elastic mode, node side: what a node agent does so the leader can plan and workers can switch.

In elastic mode (``--hspmd-elastic``) a worker slot is a device: slot ``<local_rank>`` of node
``<node_id>`` is device ``"<node_id>:<local_rank>"`` (a GPU slot uses the CUDA ordinal of the same
number). The pieces here are small and independent; ``ElasticNode`` bundles them into one
``start`` / ``tick`` / ``stop`` that the agent's loop calls. Promises:

* ``device_table`` gives the node's stable device table (index, type, memory, uuid; ``CPU``
  slots when no accelerator is seen), advertised in ``nodes/<node>`` with the endpoint of the
  TCPStore server this agent hosts (``StoreServer``: port 0 -> the bound port);
* a worker exit is reported once: an ``EventRecord`` (``failure``: pid, exit code, signal) and a
  failed verdict for its slot whose reason starts with ``leader.EXIT_PREFIX``; a worker whose
  progress heartbeat (``WorkerRecord.step`` / ``last_progress_at``) stalls is declared hung by a
  ``HangDetector`` (``ProgressMonitor``; a report with a new time but the same step, i.e. a
  state change, restarts the start-up grace): a ``stall`` event and a failed verdict with
  ``leader.STALL_PREFIX``, and the hung worker is SIGKILLed (its exit is not journaled
  again); such slot verdicts override the health source's (worst wins) and go
  to ``devices/<node>/<index>`` through the ``VerdictPublisher``;
* the agent owns ``workers/<node>/<local_rank>``: written when it starts a worker, updated from
  the report the worker runtime writes to ``HSPMD_PROGRESS_FILE`` (``read_progress``), deleted
  when the worker exits;
* surviving workers are never restarted: ``ElasticWorkers.apply_plan`` starts workers only for
  this node's devices that a plan adds (``new_local_ranks``, pure), spawning through
  ``launcher.workers``; workers get ``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``,
  ``HSPMD_NODE_ID``, ``LOCAL_RANK``, ``HSPMD_PLAN_VERSION`` (the plan that started them),
  ``HSPMD_PROGRESS_FILE`` and ``TORCHELASTIC_ERROR_FILE`` (for the failure summary); a slot whose worker exited (with any code) is not started again
  (a failed one is failed for the leader too);
* the agent acks every plan that uses its node in ``switch/<version>/<node>`` (under its lease):
  ``joined`` when it sees the plan, ``ready`` when every one of its slots in the plan has a live
  worker reporting that plan version, ``done`` when they all report a state at or past
  ``training`` for it, ``failed`` when one of those slots' workers exits non-zero or is killed as
  hung before ``done`` (``ack_state``, pure). An ack only moves forward and is written once per
  state reached (several states reached between two ticks: only the last); writing version
  ``v`` deletes this node's acks of versions below ``v - ACK_KEEP``;
* every etcd call has the client's deadline; nothing here blocks without a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.journal import append_event
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.plans import read_plan
from launcher.api import LaunchError
from launcher.health.api import DeviceState, HealthSource, Verdict
from launcher.health.progress import HangDetector
from launcher.health.verdicts import VerdictPublisher
from launcher.leader import EXIT_PREFIX, STALL_PREFIX, device_id, parse_device_id
from launcher.logs import WorkerLogPaths
from launcher.workers import Worker, WorkerGroup

log = logging.getLogger(__name__)

CPU_TYPE = "CPU"
_SEVERITY = {DeviceState.HEALTHY: 0, DeviceState.DEGRADED: 1, DeviceState.FAILED: 2}


class StoreHostError(LaunchError):
    """The agent could not host the workers' TCPStore (names the address and the cause)."""


# ----------------------------------------------------------------------------------- devices
def device_table(node: str, count: int, device_type: str = CPU_TYPE,
                 accelerators: Optional[Sequence[Any]] = None) -> list[schema.DeviceInfo]:
    """The node's worker slots as devices: from the health source's ``accelerators`` (their
    index, type, memory and uuid) when it sees some, else ``count`` slots of ``device_type``."""
    if accelerators:
        return [schema.DeviceInfo(index=a.index, type=a.type, memory_bytes=a.memory_bytes,
                                  uuid=a.uuid) for a in sorted(accelerators, key=lambda a: a.index)]
    if count < 1:
        raise ValueError(f"node {node}: need at least one worker slot, got {count}")
    return [schema.DeviceInfo(index=i, type=device_type, memory_bytes=0,
                              uuid=device_id(node, i)) for i in range(count)]


def node_record(host: str, devices: list[schema.DeviceInfo], state: str, started_at: float,
                store_endpoint: str = "", pid: Optional[int] = None) -> schema.NodeRecord:
    return schema.NodeRecord(host=host, agent_pid=os.getpid() if pid is None else pid,
                             devices=devices, state=state, started_at=started_at,
                             store_endpoint=store_endpoint)


class StoreServer:
    """A ``torch.distributed.TCPStore`` server hosted by this agent for the workers' groups."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._store: Any = None

    def start(self) -> "StoreServer":
        from datetime import timedelta

        from torch.distributed import TCPStore  # late: only elastic agents host a store

        try:
            self._store = TCPStore(self.host, self.port, None, True,
                                   timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise StoreHostError(f"cannot host the workers' store on {self.host}:{self.port}: "
                                 f"{exc}") from exc
        self.port = int(self._store.port)
        log.info("hosting the workers' store at %s", self.endpoint)
        return self

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}" if self._store is not None else ""

    @property
    def store(self) -> Any:
        return self._store

    def close(self) -> None:
        self._store = None  # the server thread ends with the last reference


# ----------------------------------------------------------------------------------- worker exits
@dataclass(frozen=True)
class WorkerExit:
    """A worker process that ended: ``exitcode`` (None when killed) or ``signal``."""

    local_rank: int
    pid: int
    exitcode: Optional[int]
    signal: Optional[int] = None

    @classmethod
    def from_returncode(cls, local_rank: int, pid: int, returncode: int) -> "WorkerExit":
        if returncode < 0:
            return cls(local_rank, pid, None, -returncode)
        return cls(local_rank, pid, returncode, None)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"worker pid {self.pid} killed by {name}"
        return f"worker pid {self.pid} exited with code {self.exitcode}"

    def verdict(self, at: float = 0.0) -> Verdict:
        return Verdict.failed(EXIT_PREFIX + self.describe(), at=at)


def report_worker_exit(client: EtcdClient, job: str, node: str, exit: WorkerExit,
                       plan_version: Optional[int] = None,
                       wall_clock: Callable[[], float] = time.time) -> schema.EventRecord:
    """Journal a worker exit as a ``failure`` event (pid, exit code, signal, device)."""
    return append_event(client, job, "failure", node=node, detail={
        "device": device_id(node, exit.local_rank), "local_rank": exit.local_rank,
        "pid": exit.pid, "exitcode": exit.exitcode, "signal": exit.signal,
        "plan_version": plan_version, "reason": exit.describe(),
    }, wall_clock=wall_clock)


class SlotVerdicts:
    """Verdicts the agent itself made about its slots (worker exit, hang); sticky, worst wins
    over what the health source says."""

    def __init__(self) -> None:
        self._failed: dict[int, Verdict] = {}

    def fail(self, local_rank: int, verdict: Verdict) -> None:
        self._failed.setdefault(local_rank, verdict)

    def clear(self, local_rank: int) -> None:
        self._failed.pop(local_rank, None)

    def failed(self) -> dict[int, Verdict]:
        return dict(self._failed)

    def merged(self, source: Mapping[int, Verdict], slots: Iterable[int]) -> dict[int, Verdict]:
        """One verdict per slot (healthy when nobody says otherwise), the worst one winning."""
        out = {i: Verdict.healthy() for i in slots}
        for verdicts in (source, self._failed):
            for i, v in verdicts.items():
                if i not in out or _SEVERITY[v.state] >= _SEVERITY[out[i].state]:
                    out[i] = v
        return out


# ----------------------------------------------------------------------------------- hangs
class ProgressMonitor:
    """Feeds worker progress records to a ``HangDetector``; reports each hang once."""

    def __init__(self, detector: Optional[HangDetector] = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.detector = detector or HangDetector(clock=clock)
        self._clock, self._wall = clock, wall_clock
        self._seen: dict[int, tuple[int, int, float]] = {}  # slot -> (pid, step, progress at)
        self._reported: set[int] = set()

    def observe(self, records: Mapping[int, schema.WorkerRecord]) -> None:
        """Heartbeats from the slots' records; a new pid (a new worker) starts afresh."""
        now, wall = self._clock(), self._wall()
        for lr in set(self._seen) - set(records):
            self.detector.forget(lr)
            self._seen.pop(lr)
            self._reported.discard(lr)
        for lr, rec in records.items():
            seen = self._seen.get(lr)
            if seen is not None and seen[0] != rec.pid:
                self.detector.forget(lr)
                self._reported.discard(lr)
            if seen == (rec.pid, rec.step, rec.last_progress_at):
                continue
            self._seen[lr] = (rec.pid, rec.step, rec.last_progress_at)
            # The record's wall time, moved onto our monotonic clock.
            t = now - max(wall - rec.last_progress_at, 0.0)
            if seen is not None and seen[0] == rec.pid and seen[1] == rec.step \
                    and rec.last_progress_at > seen[2]:
                # A new report without a new step: the worker changed state (its collective
                # timed out, it waits for a plan, it regroups). It is alive, and its own
                # watchdog bounds that wait: start-up grace again, like after a switch.
                self.detector.reset(lr, t)
                continue
            self.detector.heartbeat(lr, rec.step, t)

    def new_hangs(self) -> list:
        """Hangs not reported before (``launcher.health.progress.Hang``)."""
        out = [h for h in self.detector.hung(self._clock()) if h.worker not in self._reported]
        self._reported.update(h.worker for h in out)
        return out


_RECORD_FIELDS = ("pid", "global_rank", "plan_version", "step", "last_progress_at",
                  "steps_per_s")


@dataclass(frozen=True)
class ProgressReport:
    """One progress report of a worker: its ``WorkerRecord`` and its lifecycle ``state`` (a
    ``hspmd_elastic.elastic.api.WorkerState`` value, "" when the report has none). The state is
    kept beside the record, not in it: ``workers/<node>/<slot>`` stays the documented heartbeat,
    and only this agent's switch acks need the state."""

    record: schema.WorkerRecord
    state: str


def read_report(path: str, local_rank: int) -> Optional[ProgressReport]:
    """The worker's latest progress report (``HSPMD_PROGRESS_FILE``, one JSON object written
    atomically by the worker runtime); None while absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        fields = {k: data[k] for k in _RECORD_FIELDS}
        rec = schema.WorkerRecord(local_rank=local_rank, **fields)
        schema.encode(rec)  # validates the field types
        state = data.get("state", "")
        if not isinstance(state, str):
            raise TypeError(f"state {state!r} is not a string")
        return ProgressReport(rec, state)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CoordinationError) as exc:
        log.debug("progress file %s not readable yet: %s", path, exc)
        return None


def read_progress(path: str, local_rank: int) -> Optional[schema.WorkerRecord]:
    """The worker's latest progress report as its ``WorkerRecord`` (see ``read_report``)."""
    report = read_report(path, local_rank)
    return None if report is None else report.record


# ----------------------------------------------------------------------------------- switch acks
# Worker lifecycle states (``WorkerState`` values, spelled out so the agent needs no torch) at or
# past training: a worker in one of them has switched into the plan its report names.
TRAINED_STATES = ("training", "finishing", "done")
ACK_ORDER = ("joined", "ready", "done")  # the forward path; ``failed`` ends it from any of them
ACK_KEEP = 4  # writing the ack of version v deletes this node's acks of versions below v - 4


def ack_state(version: int, slots: Iterable[int], running: Mapping[int, int],
              reports: Mapping[int, ProgressReport], succeeded: Iterable[int],
              failed: Iterable[int]) -> str:
    """Pure: how far this node got into plan ``version`` (a ``schema.SWITCH_STATES`` value).

    ``slots``: the node's slots in the plan; ``running``: slot -> pid of its live worker;
    ``reports``: slot -> its worker's latest report (an exited worker's final one); ``succeeded``
    / ``failed``: slots whose worker exited 0 / exited non-zero or was declared hung. A failed
    slot fails the node (it cannot take part). Otherwise the node is as far as its least
    advanced slot: ``done`` when the slot's worker reports this version in a state at or past
    training (or exited 0 after such a report, or exited 0 reporting nothing at all: a script
    without a progress reporter has no other way to say it finished), ``ready`` when its live
    worker reports this version in another state (it is switching or starting), else ``joined``.
    """
    failed, succeeded = set(failed), set(succeeded)
    least = len(ACK_ORDER) - 1
    for lr in slots:
        if lr in failed:
            return "failed"
        rep = reports.get(lr)
        ours = rep is not None and rep.record.plan_version == version
        if lr in running:
            if not ours or rep.record.pid != running[lr]:
                level = 0
            else:
                level = 2 if rep.state in TRAINED_STATES else 1
        elif lr in succeeded:
            level = 2 if rep is None or (ours and rep.state in TRAINED_STATES) else 0
        else:  # no worker (yet)
            level = 0
        least = min(least, level)
    return ACK_ORDER[least]


# ----------------------------------------------------------------------------------- workers
def plan_rank(plan: schema.PlanRecord, node: str, local_rank: int) -> Optional[int]:
    """The rank of slot ``local_rank`` of ``node`` in ``plan`` (None when not in it)."""
    try:
        return plan.devices.index(device_id(node, local_rank))
    except ValueError:
        return None


def new_local_ranks(plan: schema.PlanRecord, node: str, running: Iterable[int]) -> list[int]:
    """Pure: this node's slots that ``plan`` uses and that run no worker yet."""
    mine = sorted(parse_device_id(d)[1] for d in plan.devices if parse_device_id(d)[0] == node)
    have = set(running)
    return [lr for lr in mine if lr not in have]


def elastic_worker_env(base: Mapping[str, str], endpoints: Sequence[str], job: str, node: str,
                       local_rank: int, plan_version: int,
                       progress_file: Optional[str] = None) -> dict[str, str]:
    env = dict(base)
    env.update({"HSPMD_ETCD_ENDPOINTS": ",".join(endpoints), "HSPMD_JOB_ID": job,
                "HSPMD_NODE_ID": node, "LOCAL_RANK": str(local_rank),
                "HSPMD_PLAN_VERSION": str(plan_version)})
    if progress_file:
        env["HSPMD_PROGRESS_FILE"] = progress_file
    return env


class ElasticWorkers:
    """This node's workers in elastic mode: started per plan for new slots only, each exit
    reported once by ``poll``."""

    def __init__(self, job: str, node: str, entrypoint: Sequence[str], endpoints: Sequence[str],
                 log_paths: Callable[[int, int], WorkerLogPaths],
                 base_env: Optional[Mapping[str, str]] = None, role: str = "default",
                 progress_dir: Optional[str] = None):
        self.job, self.node, self.role = job, node, role
        self.progress_dir = progress_dir or tempfile.mkdtemp(prefix=f"hspmd_progress_{node}_")
        self.entrypoint, self.endpoints = tuple(entrypoint), tuple(endpoints)
        self._log_paths = log_paths  # (plan version, local rank) -> paths
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._groups: list[WorkerGroup] = []
        self._running: dict[int, Worker] = {}
        self._ended: set[int] = set()  # slots whose worker exited: never started again

    def progress_file(self, local_rank: int) -> str:
        """Where slot ``local_rank``'s worker writes its progress (``HSPMD_PROGRESS_FILE``)."""
        return os.path.join(self.progress_dir, f"progress_{local_rank}.json")

    def running(self) -> dict[int, int]:
        """local rank -> pid of the workers alive now."""
        return {lr: w.pid for lr, w in self._running.items()}

    def apply_plan(self, plan: schema.PlanRecord) -> list[Worker]:
        """Start workers for the slots ``plan`` adds on this node; survivors are left alone."""
        new = new_local_ranks(plan, self.node, set(self._running) | self._ended)
        if not new:
            return []
        workers = []
        for lr in new:
            argv = tuple(a.replace("${local_rank}", str(lr)) for a in self.entrypoint)
            progress = self.progress_file(lr)
            if os.path.exists(progress):  # a previous worker's last report
                os.unlink(progress)
            env = elastic_worker_env(self._base_env, self.endpoints, self.job, self.node, lr,
                                     plan.version, progress)
            logs = self._log_paths(plan.version, lr)
            env["TORCHELASTIC_ERROR_FILE"] = logs.error_file  # for torchrun's failure summary
            workers.append(Worker(local_rank=lr, global_rank=plan_rank(plan, self.node, lr),
                                  argv=argv, env=env, logs=logs))
        group = WorkerGroup(role=self.role, workers=workers)
        group.start()
        self._groups.append(group)
        self._running.update({w.local_rank: w for w in workers})
        log.info("[%s] node %s: plan v%d adds slot(s) %s: started pid(s) %s", self.job,
                 self.node, plan.version, new, [w.pid for w in workers])
        return workers

    def poll(self) -> list[WorkerExit]:
        """Workers that ended since the last poll (each reported once)."""
        for group in self._groups:
            group.poll()
        out = []
        for lr, w in sorted(self._running.items()):
            if w.exitcode is not None:
                out.append(WorkerExit.from_returncode(lr, w.pid, w.exitcode))
                del self._running[lr]
                self._ended.add(lr)
        self._groups = [g for g in self._groups
                        if any(w.local_rank in self._running and self._running[w.local_rank] is w
                               for w in g.workers)]
        return out

    def stop(self, grace_s: float = 30.0) -> None:
        for group in self._groups:
            group.stop(signal.SIGTERM, grace_s)
        self._groups, self._running = [], {}


# ----------------------------------------------------------------------------------- the node
class ElasticNode:
    """The agent's elastic mode in one object: ``start()``, ``tick()`` every monitor interval,
    ``stop()``. ``leader`` is this agent's ``launcher.leader.Leader`` (None: never leads)."""

    def __init__(self, client: EtcdClient, session: LeasedSession, job: str, node: str,
                 host: str, devices: list[schema.DeviceInfo], workers: ElasticWorkers,
                 leader: Any = None, health: Optional[HealthSource] = None,
                 monitor: Optional[ProgressMonitor] = None, store_host: Optional[str] = None,
                 store_port: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.client, self.session, self.job, self.node, self.host = client, session, job, node, host
        self.devices, self.workers, self.leader, self.health = devices, workers, leader, health
        self.monitor = monitor or ProgressMonitor(clock=clock, wall_clock=wall_clock)
        self.slots = SlotVerdicts()
        self.store = StoreServer(store_host or host, store_port)
        self.plan_version = 0
        self.slot_plan: list[int] = []  # this node's slots in the current plan
        self.succeeded: set[int] = set()  # slots whose worker exited 0
        self.records: dict[int, schema.WorkerRecord] = {}  # what workers/<node>/<slot> holds
        self.reports: dict[int, ProgressReport] = {}  # slot -> its worker's latest report
        self.acks: dict[int, str] = {}  # plan version -> the ack this node wrote for it
        self._clock, self._wall = clock, wall_clock
        self._started_at = wall_clock()
        self._state = "joining"
        self._killed_hung: set[int] = set()  # pids of workers killed because they hung
        self.publisher = VerdictPublisher(client, job, node, lease=lambda: session.lease_id or 0,
                                          clock=clock, wall_clock=wall_clock)

    def start(self, state: str = "ready") -> "ElasticNode":
        self.store.start()
        self.put_node(state)
        self.publish_verdicts()
        if self.leader is not None:
            self.leader.start()
        return self

    def put_node(self, state: str) -> None:
        self._state = state
        rec = node_record(self.host, self.devices, state, self._started_at, self.store.endpoint)
        self.session.put(schema.node_key(self.job, self.node), schema.encode(rec))

    def tick(self) -> None:
        """One level-triggered round: follow the plan, report exits and hangs, publish
        verdicts, move this node's switch ack forward. Raises CoordinationError when etcd
        cannot be reached (the agent decides how long to tolerate that)."""
        plan, _ = read_plan(self.client, self.job)
        if plan is not None and plan.version > self.plan_version:
            for w in self.workers.apply_plan(plan):
                self._put_worker(w, plan.version)
            self.plan_version = plan.version
            self.slot_plan = new_local_ranks(plan, self.node, ())
            if self.workers.running() and self._state != "running":
                self.put_node("running")
        exits = self.workers.poll()
        # Every exit's verdict is sticky before any etcd call: a failed call must not lose one
        # (poll reports each exit only once).
        for ex in exits:
            log.warning("[%s] node %s: %s (slot %d)", self.job, self.node, ex.describe(),
                        ex.local_rank)
            self.records.pop(ex.local_rank, None)
            self._final_report(ex)
            if ex.ok:
                self.succeeded.add(ex.local_rank)
            else:
                self.slots.fail(ex.local_rank, ex.verdict(self._clock()))
        for ex in exits:
            self.session.delete(schema.worker_key(self.job, self.node, ex.local_rank))
            if not ex.ok and ex.pid not in self._killed_hung:  # a hang is journaled already
                report_worker_exit(self.client, self.job, self.node, ex, self.plan_version,
                                   self._wall)
        self._relay_progress()
        self.monitor.observe(self.records)
        for hang in self.monitor.new_hangs():
            log.warning("[%s] node %s: %s", self.job, self.node, hang.reason())
            self.slots.fail(hang.worker, Verdict.failed(STALL_PREFIX + hang.reason(),
                                                        at=hang.since))
            pid = self.workers.running().get(hang.worker)
            append_event(self.client, self.job, "stall", node=self.node, detail={
                "device": device_id(self.node, hang.worker), "local_rank": hang.worker,
                "pid": pid, "step": hang.step, "stalled_s": round(hang.stalled_s, 3),
                "plan_version": self.plan_version}, wall_clock=self._wall)
            self._kill_hung(hang.worker, pid)
        self.publish_verdicts()
        self._ack()  # last: whatever happens to this write, the verdicts above are out

    def _kill_hung(self, local_rank: int, pid: Optional[int]) -> None:
        """A hung worker never exits by itself (frozen, stopped, deadlocked): SIGKILL it, so
        its slot is freed and nothing is left behind; its exit is not journaled again."""
        if pid is None:
            return
        self._killed_hung.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("[%s] node %s: killed hung worker pid %d (slot %d)", self.job,
                        self.node, pid, local_rank)
        except ProcessLookupError:
            pass

    @property
    def done(self) -> bool:
        """Every slot of this node in the current plan ran its worker to exit code 0."""
        return bool(self.slot_plan) and set(self.slot_plan) <= self.succeeded

    def _put_worker(self, w: Worker, plan_version: int) -> None:
        """The worker's record: its start is its first progress heartbeat."""
        rec = schema.WorkerRecord(pid=w.pid, global_rank=w.global_rank, local_rank=w.local_rank,
                                  plan_version=plan_version, step=0,
                                  last_progress_at=self._wall(), steps_per_s=0.0)
        self._put_record(rec)

    def _put_record(self, rec: schema.WorkerRecord) -> None:
        self.records[rec.local_rank] = rec
        self.session.put(schema.worker_key(self.job, self.node, rec.local_rank),
                         schema.encode(rec))

    def _relay_progress(self) -> None:
        """Copy each live worker's latest progress report into its etcd record when it changed
        (a report of another pid, e.g. a previous worker's, is ignored)."""
        for lr, pid in self.workers.running().items():
            report = read_report(self.workers.progress_file(lr), lr)
            if report is None or report.record.pid != pid:
                continue
            self.reports[lr] = report  # before the etcd write: the acks need it either way
            if report.record != self.records.get(lr):
                self._put_record(report.record)

    def _final_report(self, ex: WorkerExit) -> None:
        """Keep what an exited worker reported last (it may have written it after our last
        read): its final state says whether it finished the plan (``ack_state``)."""
        lr = ex.local_rank
        report = read_report(self.workers.progress_file(lr), lr)
        if report is not None and report.record.pid == ex.pid:
            self.reports[lr] = report
        elif lr in self.reports and self.reports[lr].record.pid != ex.pid:
            del self.reports[lr]  # another worker's report says nothing about this one

    def _ack(self) -> None:
        """Move this node's ack of the current plan forward (``ack_state``), if the plan uses
        the node. Level-triggered: a state is remembered only once etcd took it, so a failed
        write is retried next tick, and a state already written is never written again. The
        ack is an owned key of the session: it goes with the node, and comes back after a
        lease loss. Then the node's acks of old versions are deleted (keys stay bounded; the
        console and the ops views read the version of the switch in progress)."""
        version = self.plan_version
        written = self.acks.get(version)
        if version and self.slot_plan and written not in ("done", "failed"):
            state = ack_state(version, self.slot_plan, self.workers.running(), self.reports,
                              self.succeeded, self.slots.failed())
            if written is None or state == "failed" or \
                    ACK_ORDER.index(state) > ACK_ORDER.index(written):
                rec = schema.SwitchAckRecord(node=self.node, plan_version=version, state=state,
                                             at=self._wall())
                self.session.put(schema.switch_ack_key(self.job, version, self.node),
                                 schema.encode(rec))
                self.acks[version] = state
                log.debug("[%s] node %s: switch ack of plan v%d: %s", self.job, self.node,
                          version, state)
        for old in sorted(v for v in self.acks if v < version - ACK_KEEP):
            self.session.delete(schema.switch_ack_key(self.job, old, self.node))
            del self.acks[old]

    def publish_verdicts(self) -> None:
        source = self.health.poll(self._clock()) if self.health is not None else {}
        self.publisher.publish(self.slots.merged(source, [d.index for d in self.devices]))

    def stop(self, grace_s: float = 30.0, timeout: float = 5.0) -> None:
        """Stop the workers and the leader, close the store (the agent owns the session)."""
        self.workers.stop(grace_s)
        if self.leader is not None:
            self.leader.stop(timeout)
        self.store.close()
