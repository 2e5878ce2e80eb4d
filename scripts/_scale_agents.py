#!/usr/bin/env python3
"""Simulated node agents and one real leader, as OS processes for ``scripts/bench_scale`` and
``tests/test_scale_small.py``.

    python scripts/_scale_agents.py agents --endpoints E --job J --first I --count M --ttl T \
        [--lease agent|process] [--nice K]
    python scripts/_scale_agents.py leader --endpoints E --job J --ttl T --model M \
        --global-batch B --min-nodes N [--debounce S]

``agents``: ``M`` agents named ``agent-<I..I+M-1>`` on one shared ``EtcdClient``. Each is what an
elastic node agent puts in etcd, without workers: its own ``LeasedSession`` (real lease, real
keep-alive every TTL/3), its node record (``launcher.node.elastic.devices.node_record``, 8 ``H100``
devices, a loopback store endpoint that nothing dials), its device verdicts through the real
``VerdictPublisher`` (re-published after a lease re-grant), a ``PrefixWatch`` on ``plan/head``
of its own (the plan's head, as a real agent follows it: ``coord.plans``), and a switch ack
(``launcher.node.elastic.acks.ack_state``: ``joined``, no worker ever reports) under its lease for each plan that uses it, old acks deleted as a real agent does.
Every agent receives every head on its own stream; the JSON of one revision is decoded once per
process (a real agent decodes on its own host; 1,000 decodes on a 2-core machine would measure
the machine, not etcd). Not simulated: a real agent's read of the head every 5 s besides its
watch (``read_plan_head``: one small read and one compare).

``--workers K`` adds K simulated workers per agent (``scripts/_scale_workers.py``): they follow
the plans as ``--worker-path`` says (``stamp``: real ``PlanWatcher``s, their agents relaying each
plan's layout; ``current``: a watch of ``plan/current`` each, as workers did before stamps), and
the process reports what etcd sent them and its agents when its stdin says ``counters``.

``--lease process`` gives the agents of the process one shared lease (one keep-alive thread
instead of one per agent) and ``--nice`` lowers the process's priority: for machines too small
to simulate a thousand agents beside etcd and the leader.

``leader``: one ``launcher.leader.Leader`` with the real planner (``planner.plan_for``) on its
own session; it has no node record (it plans over the agents only).

Both speak JSON lines on stdout: ``{"ready": ...}`` once started; agents then ``{"seen":
[[node, version, wall time], ...]}`` and ``{"status": {"losses": n, ...}}``; the leader
``{"cpu": ...}`` samples and one ``{"published": ...}`` per plan; with workers, agents also say
``{"wseen": [[node, local_rank, version, wall time], ...]}`` and ``{"counters": ...}`` with its timings and the CPU
its loop thread and its process had used by then. A process exits when its stdin closes (its
parent is gone), on SIGTERM, or after ``--max-s`` seconds: every loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hspmd_elastic.contract import schema  # noqa: E402
from hspmd_elastic.coord.api import CoordinationError, EventType, WatchEvent  # noqa: E402
from hspmd_elastic.coord.client import EtcdClient  # noqa: E402
from hspmd_elastic.contract.ids import node_of  # noqa: E402
from hspmd_elastic.coord.lease import LeasedSession  # noqa: E402
from hspmd_elastic.coord.plans import expand_runs  # noqa: E402
from hspmd_elastic.coord.watch import PrefixWatch  # noqa: E402
from launcher.health.api import Verdict  # noqa: E402
from launcher.health.verdicts import VerdictPublisher  # noqa: E402
from launcher.node.elastic.acks import ACK_KEEP, ack_state  # noqa: E402
from launcher.node.elastic.devices import node_record  # noqa: E402

DEVICES_PER_AGENT = 8
DEVICE_TYPE = "H100"
DEVICE_MEMORY = 80 << 30
STORE_PORT_BASE = 20000  # advertised store ports: strings in records, nothing listens
START_S = 60.0
REPORT_S = 0.05
STATUS_S = 1.0

_out_lock = threading.Lock()


def emit(obj: dict) -> None:
    line = json.dumps(obj, separators=(",", ":"))
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def agent_name(i: int) -> str:
    return f"agent-{i:05d}"


class PlanCache:
    """One decode per ``plan/head`` revision per process, and who the plan uses."""

    def __init__(self, job: str):
        self._key = schema.plan_head_key(job)
        self._lock = threading.Lock()
        self._rev = -1
        self._plan = None
        self._nodes: dict[str, list[int]] = {}

    def get(self, ev: WatchEvent):
        with self._lock:
            if ev.revision != self._rev:
                plan = schema.decode(self._key, ev.value)
                nodes: dict[str, list[int]] = {}
                for dev in expand_runs(plan.devices):  # what node_ranks reads, once for all
                    node, _, index = dev.rpartition(":")
                    nodes.setdefault(node, []).append(int(index))
                self._rev, self._plan, self._nodes = ev.revision, plan, nodes
            return self._plan, self._nodes


class SimAgent:
    """One simulated node agent (see the module docstring)."""

    def __init__(self, client: EtcdClient, job: str, index: int, ttl: float, cache: PlanCache,
                 seen: list, seen_lock: threading.Lock,
                 session: Optional[LeasedSession] = None):
        self.client, self.job, self.index = client, job, index
        self.node = agent_name(index)
        self.cache, self._seen, self._seen_lock = cache, seen, seen_lock
        self.own_session = session is None
        self.session = session or LeasedSession(client, ttl, name=self.node)
        self.publisher = VerdictPublisher(client, job, self.node,
                                          lease=lambda: self.session.lease_id or 0)
        self.republish = threading.Event()
        self.session.add_listener(on_regranted=lambda _id: self.republish.set())
        self.version = 0
        self.acks: set[int] = set()
        self.ack_errors = 0
        self.watch = None
        self.on_head = None  # (node, head) -> None: the agent relays the plan to its workers

    def start(self) -> None:
        devices = [schema.DeviceInfo(index=i, type=DEVICE_TYPE, memory_bytes=DEVICE_MEMORY,
                                     uuid=f"GPU-sim-{self.index:05d}-{i}")
                   for i in range(DEVICES_PER_AGENT)]
        rec = node_record("127.0.0.1", devices, "ready", time.time(),
                          f"127.0.0.1:{STORE_PORT_BASE + self.index % 40000}")
        self.session.put(schema.node_key(self.job, self.node), schema.encode(rec))
        self.publish_verdicts()
        self.watch = PrefixWatch(self.client, schema.plan_head_key(self.job), self._on_plan,
                                 initial=True, name=f"{self.node} plan")
        self.watch.start(START_S)

    def publish_verdicts(self) -> None:
        self.publisher.publish({i: Verdict.healthy() for i in range(DEVICES_PER_AGENT)})

    def _on_plan(self, ev: WatchEvent) -> None:
        if ev.type is not EventType.PUT:
            return
        now = time.time()
        plan, nodes = self.cache.get(ev)
        if plan.version <= self.version:
            return
        self.version = plan.version
        with self._seen_lock:
            self._seen.append([self.node, plan.version, now])
        if self.on_head is not None:
            self.on_head(self.node, plan)
        slots = nodes.get(self.node)
        try:
            if slots:
                state = ack_state(plan.version, slots, {}, {}, (), ())
                ack = schema.SwitchAckRecord(node=self.node, plan_version=plan.version,
                                             state=state, at=now)
                self.session.put(schema.switch_ack_key(self.job, plan.version, self.node),
                                 schema.encode(ack))
                self.acks.add(plan.version)
            for old in sorted(v for v in self.acks if v < plan.version - ACK_KEEP):
                self.session.delete(schema.switch_ack_key(self.job, old, self.node))
                self.acks.discard(old)
        except CoordinationError as exc:
            self.ack_errors += 1
            logging.getLogger(__name__).warning("%s: ack of v%d: %s", self.node,
                                                plan.version, exc)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop(2.0)
        if self.own_session:
            self.session.stop(revoke=True, timeout=2.0)


def _watch_parent(stop: threading.Event, asked: Optional[threading.Event] = None) -> None:
    """Our parent holds our stdin: when it closes, the parent is gone, and so are we. A line
    ``counters`` sets ``asked``."""
    def run():
        try:
            for line in sys.stdin:
                if line.strip() == "counters" and asked is not None:
                    asked.set()
        finally:
            stop.set()
            time.sleep(2.0)
            os._exit(0)
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def run_agents(args, stop: threading.Event, asked: threading.Event) -> int:
    client = EtcdClient(args.endpoints, timeout=args.etcd_timeout)
    cache, seen, seen_lock = PlanCache(args.job), [], threading.Lock()
    shared = (LeasedSession(client, args.ttl, name=f"agents-{args.first}")
              if args.lease == "process" else None)
    agents = [SimAgent(client, args.job, i, args.ttl, cache, seen, seen_lock, shared)
              for i in range(args.first, args.first + args.count)]
    t0 = time.monotonic()
    workers = None
    if args.workers:  # each agent starts its workers at its first plan
        from _scale_workers import WorkerFleet

        workers = WorkerFleet(args.endpoints, args.job, [a.node for a in agents], args.workers,
                              args.worker_path, args.etcd_timeout)
        for a in agents:
            a.on_head = workers.on_head
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda a: a.start(), agents))
    emit({"ready": len(agents), "pid": os.getpid(), "first": args.first,
          "start_s": round(time.monotonic() - t0, 3)})
    deadline = time.monotonic() + args.max_s
    next_status = 0.0
    while not stop.wait(REPORT_S) and time.monotonic() < deadline:
        with seen_lock:
            batch, seen[:] = list(seen), []
        if batch:
            emit({"seen": batch})
        if workers is not None:
            resolved = workers.tick()
            if resolved:
                emit({"wseen": resolved})
        if asked.is_set():
            asked.clear()
            emit({"counters": dict(workers.counters() if workers else {},
                                   agent_watch=sum(a.watch.event_bytes for a in agents))})
        for a in agents:
            if a.republish.is_set():
                a.republish.clear()
                a.publisher.republish_all()
                a.publish_verdicts()
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + STATUS_S
            sessions = {id(a.session): a.session for a in agents}.values()
            emit({"status": {"losses": sum(x.losses for x in sessions),
                             "ack_errors": sum(a.ack_errors for a in agents),
                             "threads": threading.active_count()}})
    for a in agents:
        a.stop()
    if workers is not None:
        workers.stop()
    if shared is not None:
        shared.stop(revoke=True, timeout=2.0)
    client.close()
    return 0


def _thread_cpu(name: str) -> float:
    for t in threading.enumerate():
        if t.name == name and t.ident is not None:
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:
                return 0.0
    return 0.0


def run_leader(args, stop: threading.Event) -> int:
    from hspmd_elastic.planner import plan_for, preset
    from launcher.leader import Leader, LeaderState

    client = EtcdClient(args.endpoints, timeout=args.etcd_timeout)
    session = LeasedSession(client, args.ttl, name="leader")
    leader = Leader(client, session, args.job, "leader", plan_for, preset(args.model),
                    args.global_batch, debounce_s=args.debounce, min_nodes=args.min_nodes)
    leader.start()
    thread = f"leader-{leader.node}"
    emit({"ready": 1, "pid": os.getpid()})

    def cpu() -> dict:
        return {"thread": round(_thread_cpu(thread), 4), "proc": round(time.process_time(), 4),
                "t": time.time()}

    done, deadline, next_cpu = 0, time.monotonic() + args.max_s, 0.0
    while not stop.wait(0.01) and time.monotonic() < deadline:
        if len(leader.publications) > done:
            settle = time.monotonic() + 10.0  # the journal writes end the replan
            while leader.state is LeaderState.PUBLISHING and time.monotonic() < settle:
                time.sleep(0.005)
            for pub in leader.publications[done:]:
                emit({"published": {"version": pub.version, "reason": pub.reason[:200],
                                    "devices": len(pub.devices), "planner": pub.planner,
                                    "timings": pub.timings, "cpu": cpu()}})
            done = len(leader.publications)
        if time.monotonic() >= next_cpu:
            next_cpu = time.monotonic() + 0.25
            emit({"cpu": cpu()})
    leader.stop(5.0)
    session.stop()
    client.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=("agents", "leader"))
    p.add_argument("--endpoints", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--model", default="llama-32b")
    p.add_argument("--global-batch", type=int, default=8192)
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--debounce", type=float, default=0.25)
    p.add_argument("--lease", choices=("agent", "process"), default="agent",
                   help="one lease per agent (real), or one per process shared by its agents")
    p.add_argument("--nice", type=int, default=0,
                   help="lower this process's CPU priority (simulated agents on a machine "
                        "shared with etcd and the leader)")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    p.add_argument("--max-s", type=float, default=1800.0)
    p.add_argument("--workers", type=int, default=0, help="simulated workers per agent")
    p.add_argument("--worker-path", choices=("stamp", "current"), default="stamp",
                   help="how the simulated workers follow the plans")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")
    if args.nice:
        os.nice(args.nice)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    asked = threading.Event()
    _watch_parent(stop, asked)
    if args.role == "agents":
        return run_agents(args, stop, asked)
    return run_leader(args, stop)


if __name__ == "__main__":
    sys.exit(main())
