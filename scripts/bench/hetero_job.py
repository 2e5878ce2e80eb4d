"""One job of ``scripts/bench_hetero``: an ``hspmd-launch --hspmd-elastic`` agent (one node,
``nproc`` workers, default ``NPROC``, training ``scripts/bench/elastic_train.py`` with a per-step
timeline) against the bench's etcd, its workers in CPU cgroups (``launcher.cgroups.CpuQuota``),
and what the bench reads back: worker records, the journal, plan records, step completions.

Promises:

* every wait has the job's deadline (``Settings.phase_timeout_s`` from the start) and fails at
  once, with the agent's log tail, when the agent exits;
* only the job's own workers go into its cgroups: the pids its worker records name, checked to
  be children of its agent running the bench's training script;
* ``close`` (idempotent; also run by a finalizer) stops the agent (SIGTERM to its process group,
  SIGKILL after ``STOP_S``), kills any worker of the job still alive, moves every process out of
  the job's cgroups and removes them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable, Mapping, Optional, Sequence

from bench import timeline
from bench.common import ROOT, SCRIPTS
from bench.hetero_pure import DATA_SEED, MODEL, NODE, NPROC, SEED, Settings, StepEnd, \
    step_ends, window

TRAIN = os.path.join(SCRIPTS, "bench", "elastic_train.py")
STEPS = 1_000_000  # the job runs until the bench stops it
STOP_S = 15.0
POLL_S = 0.2  # the bench's own polls compete with the workers for the 2 cores


class BenchError(RuntimeError):
    pass


def device(local_rank: int) -> str:
    return f"{NODE}:{local_rank}"


class HeteroJob:
    def __init__(self, etcd, tmp: str, name: str, settings: Settings, flags: Sequence[str],
                 nproc: int = NPROC):
        from hspmd_elastic.coord import EtcdClient
        from hspmd_elastic.files import atomic_write
        from hspmd_elastic.graph.config import ModelConfig
        from launcher.cgroups import CpuQuota

        self.etcd, self.tmp, self.name, self.settings = etcd, tmp, name, settings
        self.flags, self.nproc = list(flags), nproc
        self.config = os.path.join(tmp, "model.json")
        atomic_write(self.config, ModelConfig(**MODEL).to_json())
        self.tl_dir = os.path.join(tmp, "timeline")
        os.makedirs(self.tl_dir)
        self.log_path = os.path.join(tmp, "agent.log")
        self.client = EtcdClient(etcd.endpoint_str, timeout=5.0)
        self.quota = CpuQuota(name, period_us=settings.period_ms * 1000)
        self.fractions: dict[str, float] = {}  # device -> its cgroup's share of a core now
        self.agent: Optional[subprocess.Popen] = None
        self._tl_pos = [0] * nproc  # bytes of each worker's timeline read so far
        self._tl_recs: list[list[dict]] = [[] for _ in range(nproc)]
        self.deadline = time.monotonic() + settings.phase_timeout_s
        self._placed: dict[int, int] = {}  # local rank -> the pid in its cgroup
        self._closed = threading.Event()
        self._follower: Optional[threading.Thread] = None
        self._finalizer = weakref.finalize(self, _stop, [None], self.tl_dir, self.quota, nproc)

    # ------------------------------------------------------------------ processes
    def start(self) -> None:
        s = self.settings
        argv = ["--nnodes", "1", "--nproc-per-node", str(self.nproc), "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.etcd.endpoint_str, "--rdzv-id", self.name,
                "--hspmd-node-id", NODE, "--shutdown-timeout", "5",
                "--hspmd-elastic", "--hspmd-model", self.config,
                "--hspmd-global-batch", str(s.global_batch), *self.flags, TRAIN,
                "--config", self.config, "--steps", str(STEPS),
                "--global-batch", str(s.global_batch), "--seed", str(SEED),
                "--data-seed", str(DATA_SEED), "--timeline", self.tl_dir, "--timeout", "60"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.agent = subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], cwd=ROOT,
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, [self.agent], self.tl_dir, self.quota,
                                          self.nproc)

    def close(self) -> None:
        self._closed.set()
        if self._follower is not None:
            self._follower.join(10)
        self._finalizer()
        self.client.close()

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "(no log)"

    def wait_for(self, pred: Callable, what: str):
        while True:
            value = pred()
            if value:
                return value
            if self.agent is not None and self.agent.poll() is not None:
                raise BenchError(f"{self.name}: the agent exited with {self.agent.returncode} "
                                 f"while waiting for {what}\n{self.log_tail()}")
            if time.monotonic() > self.deadline:
                raise BenchError(f"{self.name}: timed out after "
                                 f"{self.settings.phase_timeout_s:g} s waiting for {what}")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ workers and quotas
    def workers(self) -> dict[int, object]:
        from hspmd_elastic.contract import schema

        kvs = self.client.get_prefix(schema.workers_prefix(self.name))
        return {rec.local_rank: rec for kv in kvs for rec in [schema.decode(kv.key, kv.value)]}

    def _job_pid(self, pid: int) -> bool:
        """The pid is a live child of this job's agent running the bench's training script."""
        import psutil

        try:
            p = psutil.Process(pid)
            return (self.agent is not None and self.agent.pid in {a.pid for a in p.parents()}
                    and any(self.tl_dir in part for part in p.cmdline()))
        except psutil.Error:
            return False

    def place(self, fractions: Sequence[float]) -> float:
        """Every worker, once it has completed a step, into its cgroup at ``fractions[lr]`` of a
        core; returns when (wall clock) the last one was placed."""
        from launcher.cgroups import worker_cgroup

        ws = self.wait_for(lambda: (lambda w: w if len(w) == self.nproc and all(
            r.step >= 1 and self._job_pid(r.pid) for r in w.values()) else None)(self.workers()),
            f"{self.nproc} workers past their first step")
        for lr, fraction in enumerate(fractions):
            self.quota.place(worker_cgroup(NODE, lr), ws[lr].pid, fraction)
            self.fractions[device(lr)] = fraction
            self._placed[lr] = ws[lr].pid
        if self._follower is None:
            self._follower = threading.Thread(target=self._follow, name="quota follower",
                                              daemon=True)
            self._follower.start()
        return time.time()

    def _follow(self) -> None:
        """The quota stays with the slot, not the process: a worker that replaces another on a
        slot (an idle worker after a drain, a joiner) goes into the slot's cgroup as soon as its
        record appears, so a slow device stays slow (every ``POLL_S``, until ``close``)."""
        from hspmd_elastic.coord import EtcdClient
        from hspmd_elastic.contract import schema
        from launcher.cgroups import CgroupError, worker_cgroup

        client = EtcdClient(self.etcd.endpoint_str, timeout=5.0)
        try:
            while not self._closed.wait(POLL_S):
                try:
                    kvs = client.get_prefix(schema.workers_prefix(self.name))
                except Exception:  # noqa: BLE001 - etcd busy: try again next time
                    continue
                for kv in kvs:
                    rec = schema.decode_or_none(kv)
                    if rec is None or self._placed.get(rec.local_rank, rec.pid) == rec.pid:
                        continue
                    fraction = self.fractions.get(device(rec.local_rank))
                    if fraction is None or not self._job_pid(rec.pid):
                        continue
                    try:
                        self.quota.place(worker_cgroup(NODE, rec.local_rank), rec.pid, fraction)
                        self._placed[rec.local_rank] = rec.pid
                    except CgroupError:
                        pass  # it exited already
        finally:
            client.close()

    def set(self, local_rank: int, fraction: float) -> float:
        from launcher.cgroups import worker_cgroup

        self.quota.set(worker_cgroup(NODE, local_rank), fraction)
        self.fractions[device(local_rank)] = fraction
        return time.time()

    def pids(self) -> dict[int, int]:
        return {lr: rec.pid for lr, rec in self.workers().items()}

    # ------------------------------------------------------------------ steps
    def ends(self) -> list[StepEnd]:
        """Step completions so far; each timeline is read from where the last call stopped."""
        for lr in range(self.nproc):
            path = os.path.join(self.tl_dir, f"{NODE}_{lr}.jsonl")
            try:
                with open(path, "rb") as f:
                    f.seek(self._tl_pos[lr])
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue  # no complete line yet
            for line in data[:end].splitlines():
                try:
                    self._tl_recs[lr].append(json.loads(line))
                except ValueError:
                    pass
            self._tl_pos[lr] += end + 1
        return step_ends({device(lr): recs for lr, recs in enumerate(self._tl_recs)})

    def steps_after(self, after: float, count: int, skip: Optional[int] = None) -> list[StepEnd]:
        """Wait for ``count`` step completions after ``after`` (``skip`` left out first)."""
        skip = self.settings.skip if skip is None else skip
        return self.wait_for(lambda: (lambda w: w if len(w) == count else None)(
            window(self.ends(), after, skip, count)), f"{count} steps after {skip} more")

    def steps_done(self) -> int:
        ends = self.ends()
        return ends[-1].step + 1 if ends else 0

    # ------------------------------------------------------------------ the journal and plans
    def events(self) -> list:
        from hspmd_elastic.coord import read_events

        return read_events(self.client, self.name)

    def speed_switches(self, after: float = 0.0) -> list[tuple[object, object]]:
        """(replan event, its detail) of every plan driven by measured speeds (a ``degrade`` or
        ``recover`` change) journaled after ``after``."""
        from hspmd_elastic.contract import schema

        out = []
        for ev in self.events():
            if ev.type == "replan" and ev.at > after:
                d = schema.event_detail(ev)
                if any(c.kind in ("degrade", "recover") for c in d.changes):
                    out.append((ev, d))
        return out

    def wait_speed_switch(self, after: float, within_s: float) -> Optional[dict]:
        """The first speed-driven switch (a ``degrade`` or ``recover`` replan of any device)
        journaled after ``after``, once its ``switch-done`` is: its version and times; None when
        the leader published none within ``within_s`` (the plan it started with stands)."""
        from hspmd_elastic.contract import schema

        limit = time.monotonic() + within_s

        def found():
            switches = self.speed_switches(after)
            if switches:
                ev, detail = switches[0]
                done = next((e for e in self.events() if e.type == "switch-done"
                             and schema.event_detail(e).plan_version == detail.version), None)
                if done is not None:
                    return {"version": detail.version, "replan_at": ev.at, "done_at": done.at}
            elif time.monotonic() > limit:
                return {"version": None}
            return None

        got = self.wait_for(found, "a speed-driven switch")
        return None if got["version"] is None else got

    def wait_switch(self, kind: str, dev: str, after: float) -> dict:
        """The first ``kind`` (degrade | recover) replan of ``dev`` after ``after``, the speeds
        decision before it and its ``switch-done``: their times (s after ``after``) and the
        plan version."""
        from hspmd_elastic.contract import schema

        def found():
            evs = self.events()
            replan = next((e for e in evs if e.type == "replan" and e.at > after and any(
                c.kind == kind and dev in c.devices for c in schema.event_detail(e).changes)),
                None)
            if replan is None:
                return None
            version = schema.event_detail(replan).version
            done = next((e for e in evs if e.type == "switch-done"
                         and schema.event_detail(e).plan_version == version), None)
            if done is None:
                return None
            speeds = [e for e in evs if e.type == "speeds" and after < e.at <= replan.at
                      and schema.event_detail(e).replan]
            return {"version": version, "replan_at": replan.at, "done_at": done.at,
                    "speeds_at": speeds[-1].at if speeds else None,
                    "speeds": schema.event_detail(speeds[-1]).to_dict() if speeds else None}

        return self.wait_for(found, f"a {kind} replan of {dev} and its switch-done")

    def plan_record(self, version: int):
        from hspmd_elastic.contract import schema

        kv = self.client.get(schema.plan_history_key(self.name, version))
        if kv is None:
            raise BenchError(f"{self.name}: no plan record v{version}")
        return schema.decode(kv.key, kv.value)

    def layout(self, version: int) -> str:
        from hspmd_elastic.coord.contract import plan_of
        from hspmd_elastic.planner import layout_line

        rec = self.plan_record(version)
        return layout_line(plan_of(rec), rec.devices)

    def plan_at_true_speeds(self, version: int, fractions: Mapping[str, float]):
        """(plan, inventory): plan ``version`` over its devices declared at their cgroups'
        shares of a core (``spec_for_device("CPU", speed=share)``), all healthy."""
        from hspmd_elastic.contract.ids import node_of
        from hspmd_elastic.coord.contract import plan_of
        from hspmd_elastic.planner import Device, Health, Inventory, spec_for_device

        rec = self.plan_record(version)
        inv = Inventory(tuple(Device(i, node_of(d), spec_for_device("CPU", None,
                                                                    speed=fractions[d]),
                                     Health.HEALTHY, 1.0) for i, d in enumerate(rec.devices)))
        return plan_of(rec), inv


def _stop(agent_box: list, tl_dir: str, quota, nproc: int = NPROC) -> None:
    """Stop the agent's process group, kill the job's workers left, remove its cgroups."""
    import psutil

    agent = agent_box[0]
    if agent is not None and agent.poll() is None:
        for sig, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(agent.pid, sig)
            except ProcessLookupError:
                break
            try:
                agent.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    for lr in range(nproc):
        recs = timeline.read(os.path.join(tl_dir, f"{NODE}_{lr}.jsonl"))
        for pid in {r["pid"] for r in recs}:
            try:
                p = psutil.Process(pid)
                if any(tl_dir in part for part in p.cmdline()):
                    p.kill()
                    p.wait(timeout=5)
            except (psutil.Error, OSError):
                pass
    quota.close()

