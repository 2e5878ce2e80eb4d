"""Agent faults land on a real hspmd-launch agent: a freeze longer than the lease TTL makes
the node's record expire (and the thawed agent writes it again), a SIGKILL takes the agent and
its worker down; a job of one node has nobody to notice, and the report says so."""

from __future__ import annotations

import threading
import uuid

import psutil
import pytest

from launch_harness import (
    SCRIPTS,
    Launcher,
    base_env,
    pid_alive,
)

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import EventType
from hspmd_elastic.coord.client import EtcdClient
from _wait import Recorder, wait_for
from hspmd_elastic.coord.watch import PrefixWatch
from launcher.inject.api import NOT_DETECTED
from launcher.inject.detect import JobObserver
from launcher.inject.faults import InjectContext
from launcher.inject.harness import Harness
from launcher.inject.scenario import parse_scenario

pytestmark = pytest.mark.multiproc


def test_freeze_past_the_lease_then_kill_the_agent(tmp_path, marker, etcd_server):
    job = f"inject-{uuid.uuid4().hex[:8]}"
    pids = tmp_path / "pids"
    pids.mkdir()
    env = base_env(marker, PID_DIR=str(pids), PET_LOG_DIR=str(tmp_path / "logs"))
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", "node-k", "--hspmd-lease-ttl", "2",
                      "--shutdown-timeout", "3", str(SCRIPTS / "sleeper.py")], env, tmp_path,
                     "node-k")
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    node_key = schema.node_key(job, "node-k")
    changes, states, done = Recorder(), [], threading.Event()

    def sample() -> None:  # the agent's state, seen from outside
        while not done.wait(0.02):
            try:
                states.append(psutil.Process(agent.proc.pid).status())
            except psutil.NoSuchProcess:
                return

    watch = observer = None
    try:
        worker_pid = int(wait_for(lambda: (pids / "0.pids").exists()
                                  and (pids / "0.pids").read_text().split()[0], 60,
                                  "the worker's pid", proc=agent.proc))
        wait_for(lambda: (kv := client.get(node_key)) and
                 schema.decode(node_key, kv.value).state == "running", 20, "node running")
        watch = PrefixWatch(client, node_key, lambda ev: changes(ev.type)).start()
        observer = JobObserver(client, job).start()
        scenario = parse_scenario({
            "schema": 1, "kind": "fault_scenario", "name": "agent-faults",
            "defaults": {"detect_timeout_s": 3, "recover_timeout_s": 5},
            "faults": [{"fault": "freeze-agent", "target": {"node": "node-k"}, "duration_s": 4},
                       {"fault": "kill-agent", "target": {"node": "node-k"}}]})
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = Harness(scenario, InjectContext(client, job, log_dir=str(tmp_path)),
                         observer).run()
        done.set()
        sampler.join(5)
        assert agent.wait(20) == -9
        wait_for(lambda: not pid_alive(worker_pid), 10, "the worker to die with its agent")
    finally:
        done.set()
        for w in (watch, observer):
            if w is not None:
                w.stop()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.wait(10)
        client.close()
    freeze, kill = report.rows
    assert freeze.detail["signal"] == "SIGSTOP" and kill.detail["signal"] == "SIGKILL"
    assert freeze.detail["pid"] == kill.detail["pid"] == agent.proc.pid
    assert psutil.STATUS_STOPPED in states
    # frozen past its TTL: the lease expired (record gone), the thawed agent wrote it again;
    # killed: the record expired for good
    def collapsed(items):  # consecutive repeats (the agent rewrites its record) as one
        return [t for i, t in enumerate(items) if i == 0 or items[i - 1] != t]

    assert changes.wait_for(lambda items: collapsed(items) == [
        EventType.DELETE, EventType.PUT, EventType.DELETE], 10), changes.items
    # one node: nobody to notice, and the report says so
    assert [r.outcome for r in report.rows] == [NOT_DETECTED, NOT_DETECTED]
    assert freeze.detected_at is None and kill.detected_at is None
