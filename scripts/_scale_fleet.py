"""The parent side of the scale runs: one etcd, one leader process, agent processes, and what
they report. Used by ``scripts/bench_scale`` and ``tests/test_scale_small.py``.

``Fleet(groups=[...])`` starts a real single-member etcd on loopback (``EtcdCluster``), the
leader process and one agents process per group (``scripts/_scale_agents.py``; group ``g``
holds ``groups[g]`` agents; ``env``: extra environment for them; ``workers``: simulated workers per
agent, following the plans as ``worker_path`` says, ``scripts/_scale_workers.py``), each wrapped
so it dies with this process (``die_with_parent``), and watches ``nodes/`` and ``plan/current``
itself: it records when each node record vanished, when each plan version appeared and when
each simulated worker resolved it. ``counters()`` asks every agents process what etcd sent its
agents and workers so far (bytes, per process). Every wait has a
deadline (``wait_for``); ``close()`` SIGKILLs and reaps every process it started, then stops
etcd, also after a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402

from hspmd_elastic.contract import schema  # noqa: E402
from hspmd_elastic.coord.api import EventType, WatchEvent  # noqa: E402
from hspmd_elastic.coord.client import EtcdClient  # noqa: E402
from hspmd_elastic.coord.watch import PrefixWatch  # noqa: E402
from launcher.node.workers import die_with_parent  # noqa: E402
from launcher.standalone import EtcdCluster  # noqa: E402

AGENTS = os.path.join(ROOT, "scripts", "_scale_agents.py")
JOB = "scale"
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


@dataclass
class Child:
    """One child process and what it last said."""

    name: str
    popen: subprocess.Popen
    first: int = 0
    count: int = 0
    ready: bool = False
    status: dict = field(default_factory=dict)
    killed_at: Optional[float] = None
    counters: dict = field(default_factory=dict)
    counters_seq: int = 0

    @property
    def nodes(self) -> list[str]:
        return [f"agent-{i:05d}" for i in range(self.first, self.first + self.count)]


@dataclass
class PlanSeen:
    """A plan version as the fleet's own watch saw it."""

    version: int
    created_at: float
    seen_at: float
    nodes: frozenset
    devices: int


class Fleet:
    """See the module docstring. ``groups``: agents per process, in order."""

    def __init__(self, groups: list[int], ttl: float = 10.0, model: str = "llama-32b",
                 global_batch: int = 8192, debounce: float = 0.25,
                 base_dir: Optional[str] = None, max_s: float = 1800.0,
                 lease: str = "agent", nice: int = 0, env: Optional[dict] = None,
                 etcd_dir: Optional[str] = None, workers: int = 0, worker_path: str = "stamp",
                 etcd_timeout: float = 5.0):
        self.groups, self.ttl, self.model, self.lease = groups, ttl, model, lease
        self.etcd_timeout = etcd_timeout
        self.workers, self.worker_path = workers, worker_path
        self.wseen: dict[int, dict[tuple, float]] = {}  # version -> (node, slot) -> wall time
        self.wversion: dict[tuple, int] = {}  # (node, slot) -> newest version resolved
        self.nice, self.env = nice, dict(env or {})
        # etcd's data under ``etcd_dir`` (e.g. a tmpfs) instead of beside the logs
        self._etcd_dir = tempfile.mkdtemp(prefix="hspmd-scale-etcd-", dir=etcd_dir) \
            if etcd_dir else None
        self.global_batch, self.debounce, self.max_s = global_batch, debounce, max_s
        self.n = sum(groups)
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="hspmd-scale-")
        self.cond = threading.Condition()
        self.children: list[Child] = []
        self.leader: Optional[Child] = None
        self.seen: dict[int, dict[str, float]] = {}  # version -> node -> wall time seen
        self.publications: list[dict] = []
        self.cpu: list[dict] = []  # the leader's CPU samples
        self.deleted: dict[str, float] = {}  # node -> wall time its record vanished
        self.plans: dict[int, PlanSeen] = {}
        self.etcd: Optional[EtcdCluster] = None
        self.client: Optional[EtcdClient] = None
        self._watches: list[PrefixWatch] = []
        self._readers: list[threading.Thread] = []

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 120.0) -> "Fleet":
        try:
            self.etcd = EtcdCluster(1, base_dir=self._etcd_dir or
                                    os.path.join(self.base_dir, "etcd")).start()
            self.client = EtcdClient(self.etcd.endpoints, timeout=5.0)
            self._watch()
            common = ["--endpoints", self.etcd.endpoint_str, "--job", JOB, "--ttl",
                      str(self.ttl), "--max-s", str(self.max_s), "--etcd-timeout",
                      str(self.etcd_timeout)]
            self.leader = self._spawn("leader", ["leader", *common, "--model", self.model,
                                                 "--global-batch", str(self.global_batch),
                                                 "--min-nodes", str(self.n),
                                                 "--debounce", str(self.debounce)])
            more = ["--workers", str(self.workers), "--worker-path", self.worker_path] \
                if self.workers else []
            # One process at a time: a thousand agents registering at once is a start-up storm
            # that says nothing about the steady state or a failure.
            first, deadline = 0, time.monotonic() + timeout
            for g, count in enumerate(self.groups):
                child = self._spawn(f"agents{g}", ["agents", *common, "--first", str(first),
                                                   "--count", str(count), "--lease", self.lease,
                                                   "--nice", str(self.nice), *more])
                child.first, child.count = first, count
                first += count
                self.wait_for(lambda: all(c.ready for c in self.children),
                              max(deadline - time.monotonic(), 0.0), f"{child.name} ready")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> Child:
        err = open(os.path.join(self.base_dir, f"{name}.log"), "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **self.env)
        popen = subprocess.Popen(die_with_parent((sys.executable, AGENTS, *args)),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                 env=env, text=True, bufsize=1)
        err.close()
        child = Child(name, popen)
        with self.cond:
            self.children.append(child)
        reader = threading.Thread(target=self._read, args=(child,), name=f"read-{name}",
                                  daemon=True)
        reader.start()
        self._readers.append(reader)
        return child

    def close(self) -> None:
        for child in list(self.children):
            self.kill(child)
        for w in self._watches:
            w.stop(2.0)
        if self.client is not None:
            self.client.close()
        if self.etcd is not None:
            self.etcd.stop()
        for r in self._readers:
            r.join(2.0)
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        if self._etcd_dir:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def kill(self, child: Child) -> float:
        """SIGKILL ``child`` and reap it; returns when it was killed (wall time)."""
        if child.popen.poll() is None:
            child.killed_at = time.time()
            child.popen.send_signal(signal.SIGKILL)
        try:
            child.popen.wait(10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            pass
        for stream in (child.popen.stdin, child.popen.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return child.killed_at or time.time()

    # ------------------------------------------------------------------ what we learn
    def _read(self, child: Child) -> None:
        for line in child.popen.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self._apply(child, msg)
                self.cond.notify_all()

    def _apply(self, child: Child, msg: dict) -> None:
        if "ready" in msg:
            child.ready = True
        elif "seen" in msg:
            for node, version, at in msg["seen"]:
                self.seen.setdefault(version, {})[node] = at
        elif "status" in msg:
            child.status = msg["status"]
        elif "wseen" in msg:
            for node, slot, version, at in msg["wseen"]:
                self.wseen.setdefault(version, {})[(node, slot)] = at
                self.wversion[(node, slot)] = max(version, self.wversion.get((node, slot), 0))
        elif "counters" in msg:
            child.counters, child.counters_seq = msg["counters"], child.counters_seq + 1
        elif "published" in msg:
            self.publications.append(msg["published"])
        elif "cpu" in msg:
            self.cpu.append(msg["cpu"])
            del self.cpu[:-2000]

    def _watch(self) -> None:
        def on_node(ev: WatchEvent) -> None:
            if ev.type is EventType.DELETE:
                with self.cond:
                    self.deleted[ev.key.rsplit("/", 1)[1]] = time.time()
                    self.cond.notify_all()

        def on_plan(ev: WatchEvent) -> None:
            if ev.type is EventType.PUT and ev.record is not None:
                now, plan = time.time(), ev.record
                nodes = frozenset(d.rpartition(":")[0] for d in plan.inventory or plan.devices)
                with self.cond:
                    self.plans[plan.version] = PlanSeen(plan.version, plan.created_at, now,
                                                        nodes, len(plan.devices))
                    self.cond.notify_all()

        for prefix, fn, decode in ((schema.nodes_prefix(JOB), on_node, False),
                                   (schema.plan_current_key(JOB), on_plan, True)):
            self._watches.append(PrefixWatch(self.client, prefix, fn, decode=decode,
                                             name=f"fleet {prefix}").start(10.0))

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``pred()`` (under the lock) or fail with ``TimeoutError`` naming ``what``
        and any child that died."""
        with self.cond:
            if self.cond.wait_for(pred, timeout):
                return
            dead = [f"{c.name} (exit {c.popen.returncode})" for c in self.children
                    if c.popen.poll() is not None and c.killed_at is None]
        raise TimeoutError(f"{what}: not within {timeout:g}s" +
                           (f"; died: {', '.join(dead)}" if dead else ""))

    def live_nodes(self) -> list[str]:
        return [n for c in self.children if c.name != "leader" and c.killed_at is None
                for n in c.nodes]

    def latest_plan(self) -> Optional[PlanSeen]:
        with self.cond:
            return self.plans[max(self.plans)] if self.plans else None

    def all_seen(self, version: int, nodes: list[str]) -> bool:
        got = self.seen.get(version, {})
        return all(n in got for n in nodes)

    def all_resolved(self, version: int, nodes: list[str]) -> bool:
        """Every simulated worker of ``nodes`` resolved ``version`` or a newer plan."""
        return all(self.wversion.get((n, slot), 0) >= version for n in nodes
                   for slot in range(self.workers))

    def counters(self, timeout: float = 60.0) -> dict[str, dict]:
        """What etcd sent each live agents process's agents and workers so far (by process
        name; each answers a ``counters`` line on its stdin)."""
        children = [c for c in self.agent_children() if c.killed_at is None]
        with self.cond:
            asked = {c.name: c.counters_seq for c in children}
        for c in children:
            c.popen.stdin.write("counters\n")
            c.popen.stdin.flush()
        self.wait_for(lambda: all(c.counters_seq > asked[c.name] for c in children), timeout,
                      "every agents process's counters")
        with self.cond:
            return {c.name: dict(c.counters) for c in children}

    def losses(self) -> int:
        with self.cond:
            return sum(c.status.get("losses", 0) for c in self.children)

    def agent_children(self) -> list[Child]:
        return [c for c in self.children if c.name != "leader"]

    # ------------------------------------------------------------------ etcd's view
    def metrics(self) -> dict[str, float]:
        """etcd's Prometheus counters, summed per metric name (``name`` or
        ``name{grpc_method=...}`` for the gRPC ones)."""
        url = self.etcd.members[0].client_url + "/metrics"
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = _METRIC.match(line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            out[name] = out.get(name, 0.0) + value
            method = re.search(r'grpc_method="([^"]+)"', labels)
            if method:
                key = f"{name}{{{method.group(1)}}}"
                out[key] = out.get(key, 0.0) + value
        return out

    def revision(self) -> int:
        return self.client.revision()

    def etcd_rss(self) -> int:
        return psutil.Process(self.etcd.members[0].proc.pid).memory_info().rss
