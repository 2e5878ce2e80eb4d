"""Elastic mode on the node side: device table, store server, worker exits and hangs as events
and verdicts, workers started for new devices only; and one node driven end to end with its
leader against a real etcd (real worker processes)."""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import pytest

from hspmd_elastic.coord import EtcdClient, LeasedSession, read_events, read_plan
from hspmd_elastic.contract import schema
from _wait import wait_for
from hspmd_elastic.planner import ModelProfile, PlannerOptions, plan_for
from hspmd_elastic.contract.progress import read_progress
from launcher.node.elastic.devices import device_table
from launcher.node.elastic.node import ElasticNode
from launcher.node.elastic.workers import ElasticWorkers, new_local_ranks, plan_rank
from launcher.node.env import elastic_worker_env
from launcher.node.elastic.exits import SlotVerdicts, WorkerExit
from launcher.node.hangs import ProgressMonitor
from launcher.node.store import StoreServer
from launcher.health.api import DeviceInfo, DeviceState, Verdict
from launcher.health.progress import HangDetector
from launcher.leader import Leader
from launcher.logs import WorkerLogPaths
from _clock import FakeClock

JOB = "ajob"
WAIT = 10.0
PROFILE = ModelProfile("tiny", num_layers=2, hidden_size=32, ffn_size=64, num_heads=4,
                       vocab_size=64, seq_len=16)
# Slot 1 fails at once, slot 3 finishes at once; the others wait to be stopped.
WORKER = ("import os, sys, time\n"
          "lr = os.environ['LOCAL_RANK']\n"
          "sys.exit(3) if lr == '1' else sys.exit(0) if lr == '3' else time.sleep(60)\n")


def plan(version: int, devices: list[str]) -> schema.PlanRecord:
    return schema.PlanRecord(version=version, reason="t", devices=devices, strategy={},
                             store_endpoint="", created_at=0.0)


def log_paths(tmp_path):
    def paths(version: int, lr: int) -> WorkerLogPaths:
        d = tmp_path / f"v{version}" / str(lr)
        d.mkdir(parents=True, exist_ok=True)
        return WorkerLogPaths(str(d / "out"), str(d / "err"), str(d / "error.json"), False,
                              False, True)
    return paths


def test_device_table_is_stable_and_names_cpu_slots():
    table = device_table("n1", 3)
    assert [(d.index, d.type, d.uuid) for d in table] == [(0, "CPU", "n1:0"), (1, "CPU", "n1:1"),
                                                          (2, "CPU", "n1:2")]
    assert device_table("n1", 3) == table
    gpus = [DeviceInfo(1, "NVIDIA H200", "GPU-b", 141 << 30, "H200"),
            DeviceInfo(0, "NVIDIA H200", "GPU-a", 141 << 30, "H200")]
    assert [(d.index, d.type, d.uuid) for d in device_table("n1", 8, accelerators=gpus)] == [
        (0, "H200", "GPU-a"), (1, "H200", "GPU-b")]
    with pytest.raises(ValueError, match="at least one worker slot"):
        device_table("n1", 0)


def test_store_server_binds_port_zero_and_serves_a_client():
    from torch.distributed import TCPStore

    server = StoreServer("127.0.0.1").start()
    try:
        host, port = server.endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        client = TCPStore(host, int(port), None, False, timedelta(seconds=5))
        client.set("hspmd/v3/ready", "1")
        assert server.store.get("hspmd/v3/ready") == b"1"
    finally:
        server.close()
    assert server.endpoint == ""


def test_worker_exit_descriptions_and_verdicts():
    code = WorkerExit.from_returncode(2, 4242, 3)
    killed = WorkerExit.from_returncode(0, 4243, -signal.SIGKILL)
    assert (code.exitcode, code.signal, code.ok) == (3, None, False)
    assert (killed.exitcode, killed.signal) == (None, signal.SIGKILL)
    assert code.describe() == "worker pid 4242 exited with code 3"
    assert killed.describe() == "worker pid 4243 killed by SIGKILL"
    v = code.verdict(at=5.0)
    assert v.is_failed and v.reason == code.describe() and v.origin == "exit" and v.at == 5.0
    assert WorkerExit.from_returncode(0, 1, 0).ok


def test_slot_verdicts_are_sticky_and_the_worst_wins():
    slots = SlotVerdicts()
    hot = Verdict.degraded("hot", 0.5)
    assert slots.merged({1: hot}, [0, 1]) == {0: Verdict.healthy(), 1: hot}
    slots.fail(1, Verdict.failed("worker exit: x"))
    slots.fail(1, Verdict.failed("later"))  # the first cause stays
    merged = slots.merged({1: hot, 2: Verdict.failed("ecc")}, [0, 1])
    assert merged[1].reason == "worker exit: x" and merged[2].reason == "ecc"
    assert merged[0].state is DeviceState.HEALTHY
    slots.clear(1)
    assert slots.merged({}, [1])[1].state is DeviceState.HEALTHY


def test_progress_monitor_reports_each_hang_once_and_a_new_worker_starts_afresh():
    mono, wall = FakeClock(100.0), FakeClock(5000.0)
    monitor = ProgressMonitor(HangDetector(multiple=3, min_timeout_s=1.0, startup_grace_s=4.0,
                                           clock=mono), mono, wall)

    def rec(pid, step, at):
        return schema.WorkerRecord(pid=pid, global_rank=0, local_rank=0, plan_version=1,
                                   step=step, last_progress_at=at, steps_per_s=0.0)

    monitor.observe({0: rec(10, 0, 5000.0), 1: rec(11, 0, 5000.0)})
    for step in range(1, 5):  # slot 1 steps every 0.5 s; slot 0 never does
        mono.now += 0.5
        wall.now += 0.5
        monitor.observe({0: rec(10, 0, 5000.0), 1: rec(11, step, wall.now)})
    assert monitor.new_hangs() == []
    mono.now += 2.5
    wall.now += 2.5
    hangs = monitor.new_hangs()
    assert [(h.worker, h.starting) for h in hangs] == [(0, True), (1, False)]
    assert monitor.new_hangs() == []
    monitor.observe({0: rec(12, 0, wall.now)})  # slot 0 restarted, slot 1 gone
    assert monitor.new_hangs() == []
    mono.now += 4.5
    wall.now += 4.5
    assert [h.worker for h in monitor.new_hangs()] == [0]


def test_only_new_slots_get_workers():
    p = plan(3, ["m:0", "n:2", "n:0", "n:10"])
    assert new_local_ranks(p, "n", []) == [0, 2, 10]
    assert new_local_ranks(p, "n", [0, 2]) == [10]
    assert new_local_ranks(p, "x", []) == []
    assert plan_rank(p, "n", 2) == 1 and plan_rank(p, "n", 5) is None
    env = elastic_worker_env({"PATH": "/bin"}, ["h:1", "h:2"], JOB, "n", 2, 3, "/tmp/p2.json")
    assert env == {"PATH": "/bin", "HSPMD_ETCD_ENDPOINTS": "h:1,h:2", "HSPMD_JOB_ID": JOB,
                   "HSPMD_NODE_ID": "n", "LOCAL_RANK": "2", "HSPMD_PLAN_VERSION": "3",
                   "HSPMD_PROGRESS_FILE": "/tmp/p2.json"}


def test_progress_reports_become_worker_records(tmp_path):
    path = tmp_path / "progress_1.json"
    assert read_progress(str(path), 1) is None
    path.write_text("{not json")
    assert read_progress(str(path), 1) is None
    report = {"pid": 7, "global_rank": 4, "local_rank": 1, "plan_version": 2, "step": 12,
              "last_progress_at": 1.5e9, "steps_per_s": 3.0, "state": "training"}
    path.write_text(json.dumps(report))
    rec = read_progress(str(path), 1)
    assert (rec.pid, rec.global_rank, rec.local_rank, rec.step) == (7, 4, 1, 12)
    path.write_text(json.dumps({**report, "step": "twelve"}))
    assert read_progress(str(path), 1) is None


def test_elastic_workers_start_new_slots_only_and_report_each_exit_once(tmp_path):
    workers = ElasticWorkers(JOB, "n", [sys.executable, "-c", WORKER], ["127.0.0.1:1"],
                             log_paths(tmp_path), base_env=dict(os.environ))
    try:
        started = workers.apply_plan(plan(1, ["n:0", "n:1", "n:3"]))
        assert [w.local_rank for w in started] == [0, 1, 3]
        assert started[1].env["LOCAL_RANK"] == "1" and started[1].global_rank == 1
        assert started[1].env["HSPMD_PROGRESS_FILE"] == workers.progress_file(1)
        exits = []
        wait_for(lambda: exits.extend(workers.poll()) or len(exits) == 2, WAIT,
                 "two workers' exits")
        assert sorted((e.local_rank, e.exitcode) for e in exits) == [(1, 3), (3, 0)]
        assert workers.poll() == []
        survivor = workers.running()[0]
        added = workers.apply_plan(plan(2, ["n:0", "n:1", "n:2", "n:3"]))  # 1 and 3 ended
        assert [w.local_rank for w in added] == [2] and added[0].global_rank == 2
        assert workers.running() == {0: survivor, 2: added[0].pid}
        assert workers.apply_plan(plan(3, ["n:0", "n:2"])) == []
    finally:
        workers.stop(grace_s=2.0)
    assert workers.running() == {}


# Reports that the newest plan excludes it, then dies by SIGABRT (as a crash in the
# interpreter's teardown after leaving would).
EXCLUDED_WORKER = (
    "import os, signal, time\n"
    "from hspmd_elastic.contract.progress import WorkerProgress, write_progress\n"
    "write_progress(os.environ['HSPMD_PROGRESS_FILE'], WorkerProgress(\n"
    "    pid=os.getpid(), global_rank=0, local_rank=int(os.environ['LOCAL_RANK']),\n"
    "    plan_version=int(os.environ['HSPMD_PLAN_VERSION']), step=2,\n"
    "    last_progress_at=time.time(), steps_per_s=0.0, state='excluded'))\n"
    "os.kill(os.getpid(), signal.SIGABRT)\n")


def test_a_worker_that_left_an_excluding_plan_is_no_failure_and_its_slot_comes_back(
        etcd_server, tmp_path):
    client = EtcdClient(etcd_server.endpoints, timeout=1.0)
    session = LeasedSession(client, ttl=2, name="agent n")
    workers = ElasticWorkers(JOB, "n", [sys.executable, "-c", EXCLUDED_WORKER],
                             etcd_server.endpoints, log_paths(tmp_path))
    node = ElasticNode(client, session, JOB, "n", "127.0.0.1", device_table("n", 1), workers)
    try:
        node.start()
        client.put(schema.plan_current_key(JOB), plan(1, ["n:0"]).to_json())
        wait_for(lambda: node.tick() or (node.plan_version == 1 and workers.exits), WAIT,
                 "plan v1 applied and its worker's exit", interval=0.05)
        ex, _, final = workers.exits[0]
        assert (ex.signal, final) == (signal.SIGABRT, "excluded")
        node.tick()
        assert node.slots.failed() == {} and node.succeeded == set()
        assert [e.type for e in read_events(client, JOB)] == []  # no failure journaled
        verdict = client.get(schema.device_key(JOB, "n", 0))
        assert verdict is None or schema.decode(verdict.key, verdict.value).state == "healthy"
        # A later plan that uses the device again (a healed partition) starts a new worker.
        client.put(schema.plan_current_key(JOB), plan(2, ["n:0"]).to_json())
        wait_for(lambda: node.tick() or len(workers.exits) == 2, WAIT, "the second worker's exit",
                 interval=0.05)
        assert workers.exits[1][0].pid != ex.pid
    finally:
        node.stop(grace_s=2.0, timeout=3.0)
        session.stop(timeout=3.0)
        client.close()


def test_a_node_runs_its_plan_and_reports_an_exit_and_a_hang(etcd_server, tmp_path):
    client = EtcdClient(etcd_server.endpoints, timeout=1.0)
    session = LeasedSession(client, ttl=2, name="agent n")
    mono, wall = FakeClock(100.0), FakeClock(1.7e9)
    # every worker busy (the tiny model's fixed costs would leave some idle): the test follows
    # each worker's exit and hang
    leader = Leader(client, session, JOB, "n", plan_for, PROFILE, 8, debounce_s=0.05,
                    election_recheck_s=0.3,
                    planner_options=PlannerOptions(use_all_devices=True))
    workers = ElasticWorkers(JOB, "n", [sys.executable, "-c", WORKER], etcd_server.endpoints,
                             log_paths(tmp_path))
    monitor = ProgressMonitor(HangDetector(min_timeout_s=1.0, startup_grace_s=5.0, clock=mono),
                              mono, wall)
    node = ElasticNode(client, session, JOB, "n", "127.0.0.1", device_table("n", 3), workers,
                       leader=leader, monitor=monitor, clock=mono, wall_clock=wall)

    def ticked_until(predicate, what: str) -> None:
        wait_for(lambda: node.tick() or predicate(), WAIT, what, interval=0.05)

    try:
        node.start()
        rec = schema.decode(schema.node_key(JOB, "n"), client.get(schema.node_key(JOB, "n")).value)
        assert rec.store_endpoint == node.store.endpoint != "" and len(rec.devices) == 3
        ticked_until(lambda: node.plan_version == 1, "plan v1 applied")
        rec = schema.decode(schema.node_key(JOB, "n"), client.get(schema.node_key(JOB, "n")).value)
        assert rec.state == "running"
        wait_for(lambda: node.tick() or 1 not in workers.running(), WAIT, "worker 1's exit",
                 interval=0.05)
        pids = workers.running()
        assert sorted(pids) == [0, 2]

        ticked_until(lambda: (read_plan(client, JOB)[0] or plan(0, [])).version == 2,
                     "plan v2 published")
        v2 = read_plan(client, JOB)[0]
        assert v2.devices == ["n:0", "n:2"] and v2.store_endpoint == node.store.endpoint
        assert v2.reason.startswith("failure n:1: worker pid ") and "code 3" in v2.reason
        ticked_until(lambda: node.plan_version == 2, "plan v2 applied")
        assert workers.running() == pids  # survivors were not restarted
        assert client.get(schema.worker_key(JOB, "n", 1)) is None

        mono.now += 6.0  # slot 0 never reports a step; slot 2 does (as the runtime would)
        wall.now += 6.0
        report = {"pid": pids[2], "global_rank": 1, "local_rank": 2, "plan_version": 2,
                  "step": 1, "last_progress_at": wall.now, "steps_per_s": 1.0, "state": "training"}
        with open(workers.progress_file(2), "w") as f:
            json.dump(report, f)
        ticked_until(lambda: read_plan(client, JOB)[0].version == 3, "plan v3 published")
        v3 = read_plan(client, JOB)[0]
        relayed = schema.decode(schema.worker_key(JOB, "n", 2),
                                client.get(schema.worker_key(JOB, "n", 2)).value)
        assert (relayed.pid, relayed.step, relayed.plan_version) == (pids[2], 1, 2)
        assert v3.devices == ["n:2"] and v3.reason.startswith("stall n:0: worker 0 hung")
        verdict = schema.decode(schema.device_key(JOB, "n", 0),
                                client.get(schema.device_key(JOB, "n", 0)).value)
        assert verdict.state == "failed" and verdict.origin == "stall"
        wait_for(lambda: [e.type for e in read_events(client, JOB)] == [
            "join", "replan", "failure", "replan", "stall", "replan"], WAIT, "the six events")
        failure = read_events(client, JOB)[2]
        detail = schema.event_detail(failure)
        assert detail.devices == ["n:1"] and detail.plan_version == 1
        [exit_] = detail.exits
        assert exit_.exitcode == 3 and exit_.signal is None and exit_.local_rank == 1
    finally:
        node.stop(grace_s=2.0, timeout=3.0)
        session.stop(timeout=3.0)
        client.close()


def test_the_hang_rule_watches_training_workers_only():
    from types import SimpleNamespace

    from launcher.node.hangs import watched_slots

    rec = {lr: schema.WorkerRecord(pid=10 + lr, global_rank=lr, local_rank=lr, plan_version=2,
                                   step=5, last_progress_at=0.0, steps_per_s=1.0)
           for lr in range(5)}
    reports = {0: SimpleNamespace(state="training"), 1: SimpleNamespace(state="regrouping"),
               2: SimpleNamespace(state="waiting_plan"), 3: SimpleNamespace(state="finishing")}
    # slot 4 has not reported yet: its start-up grace applies
    assert sorted(watched_slots(rec, reports)) == [0, 4]
    mono, wall = FakeClock(100.0), FakeClock(0.0)
    monitor = ProgressMonitor(HangDetector(min_timeout_s=1.0, startup_grace_s=1.0, clock=mono),
                              mono, wall)
    for _ in range(3):  # nobody's step advances for a long time
        monitor.observe(watched_slots(rec, reports))
        mono.now += 50.0
        wall.now += 50.0
    assert sorted(h.worker for h in monitor.new_hangs()) == [0, 4]
