"""``throttle`` / ``unthrottle``: the scenario format (good and bad entries, one line each), how
the harness decides detection and recovery from recorded journal events, and the faults acting
on a real worker of a real job (hspmd-launch, real etcd): capped in a real CPU cgroup, the cap
lifted, and every cgroup gone after ``InjectContext.close``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from _events import done, event, replan
from _wait import wait_for
from launch_harness import SCRIPTS, Launcher, base_env

from hspmd_elastic.contract import schema
from launcher.cgroups import available, cgroup_of
from launcher.inject.api import NOT_DETECTED, InjectError, ScenarioError, TargetNotFound
from launcher.inject.detect import Baseline, Injected, JobObserver, match_detection, \
    match_recovery
from launcher.inject.faults import InjectContext, make_fault
from launcher.inject.harness import Harness
from launcher.inject.scenario import SPEED_FAULTS, parse_fault, parse_scenario

pytestmark = pytest.mark.timeout(180)

DEFAULTS = {"detect_timeout_s": 30.0, "recover_timeout_s": 60.0, "trigger_timeout_s": 60.0}
CORES = os.cpu_count() or 1


def spec(**entry):
    return parse_fault(entry, 0, DEFAULTS, "<test>")


# ------------------------------------------------------------------------------ scenario format
def test_throttle_and_unthrottle_parse():
    sc = parse_scenario({"schema": 1, "kind": "fault_scenario", "name": "t", "faults": [
        {"at": {"step": 3}, "fault": "throttle", "target": {"node": "node-a", "local_rank": 1},
         "cpus": 0.125},
        {"fault": "throttle", "target": {"node": "node-b", "local_rank": 0}, "cpus": 1,
         "duration_s": 5},
        {"at": 20.0, "fault": "unthrottle", "target": {"node": "node-a", "local_rank": 1}},
    ]})
    throttle, timed, unthrottle = sc.faults
    assert (throttle.fault, throttle.target, throttle.params, throttle.at_step) == \
        ("throttle", {"node": "node-a", "local_rank": 1}, {"cpus": 0.125}, 3)
    assert timed.params == {"cpus": 1.0, "duration_s": 5.0}
    assert (unthrottle.target, unthrottle.params, unthrottle.at_s) == \
        ({"node": "node-a", "local_rank": 1}, {}, 20.0)
    assert SPEED_FAULTS == ("throttle", "unthrottle")


WORKER = {"node": "node-a", "local_rank": 0}


@pytest.mark.parametrize("entry, problem", [
    ({"fault": "throttle", "target": WORKER},
     "throttle needs cpus: the share of one core the worker keeps (e.g. 0.125)"),
    ({"fault": "throttle", "target": WORKER, "cpus": 0}, "cpus must be a number > 0.0"),
    ({"fault": "throttle", "target": WORKER, "cpus": -1}, "got -1"),
    ({"fault": "throttle", "target": WORKER, "cpus": float("nan")}, "got nan"),
    ({"fault": "throttle", "target": WORKER, "cpus": float("inf")}, "got inf"),
    ({"fault": "throttle", "target": WORKER, "cpus": CORES + 1},
     f"cpus must be a number > 0.0 and <= {float(CORES)}, got {CORES + 1}"),
    ({"fault": "throttle", "target": WORKER, "cpus": "0.5"}, "got '0.5'"),
    ({"fault": "throttle", "target": WORKER, "cpus": True}, "got True"),
    ({"fault": "throttle", "target": WORKER, "cpus": 0.001},
     "cpus must be >= 0.01 (the kernel's smallest CFS quota), got 0.001"),
    ({"fault": "throttle", "target": WORKER, "cpus": 0.5, "duration_s": 0},
     "duration_s must be a number > 0"),
    ({"fault": "throttle", "target": {"node": "node-a"}, "cpus": 0.5},
     "throttle needs target.local_rank"),
    ({"fault": "unthrottle", "target": {"local_rank": 0}}, "unthrottle needs target.node"),
    ({"fault": "throttle", "target": {**WORKER, "rank": 2}, "cpus": 0.5},
     "unknown target field(s) for throttle rank; valid: local_rank, node"),
    ({"fault": "throttle", "target": {"node": "a/b", "local_rank": 0}, "cpus": 0.5},
     "target.node must be an id"),
    ({"fault": "throttle", "target": {"node": "a", "local_rank": -1}, "cpus": 0.5},
     "target.local_rank must be an integer >= 0, got -1"),
    ({"fault": "unthrottle", "target": WORKER, "cpus": 0.5},
     "unknown field(s) for unthrottle cpus"),
    ({"fault": "throttle", "target": WORKER, "cpus": 0.5, "slowdown": 0.5},
     "unknown field(s) for throttle slowdown"),
])
def test_bad_entries_are_one_line_errors(entry, problem):
    with pytest.raises(ScenarioError) as err:
        spec(**entry)
    message = str(err.value)
    assert problem in message and "\n" not in message
    assert message.startswith(f"bad scenario <test> fault 0 ({entry['fault']}): ")


# ------------------------------------------------------------------------- detection, recovery
T0 = 1000.0
DEV = "node-a:1"


def base() -> Baseline:
    return Baseline(at=T0, last_seq=3, devices_seen=0, round=1, step=10)


def ev(seq: int, type_: str, detail: schema.Detail) -> schema.EventRecord:
    return event(seq, type_, detail, node="node-a", at=T0 + seq)


def change(kind: str, devices: list[str]) -> schema.PlanChange:
    return schema.PlanChange(kind=kind, node=devices[0].split(":")[0], devices=devices,
                             reason="measured speed")


def test_a_throttle_is_detected_by_a_degrade_replan_naming_its_device():
    inj = Injected("throttle", {"node": "node-a", "local_rank": 1, "rank": 3}, (42,))
    events = [
        ev(2, "replan", replan(1, changes=(change("degrade", [DEV]),))),  # before: not it
        ev(4, "replan", replan(2, changes=(change("degrade", ["node-a:0"]),))),  # other device
        ev(5, "switch-done", done(2)),
        ev(6, "replan", replan(3, changes=(change("recover", [DEV]),))),  # the wrong kind
        ev(7, "switch-done", done(3)),
    ]
    assert match_detection(inj, base(), events) is None  # never a made-up detection
    assert match_recovery(inj, base(), None, events, []) is None
    events += [ev(8, "replan", replan(4, changes=(change("degrade", ["node-b:0", DEV]),))),
               ev(9, "switch-failed", schema.SwitchFailedDetail(plan_version=4, error="x",
                                                                from_version=3)),
               ev(10, "switch-done", done(4))]
    det = match_detection(inj, base(), events)
    assert (det.at, det.by, det.seq) == (T0 + 8, "replan event #8", 8)
    rec = match_recovery(inj, base(), det, events, [])
    assert (rec.at, rec.by, rec.round) == (T0 + 10, "switch-done event #10", 4)


def test_an_unthrottle_is_detected_by_a_recover_replan():
    inj = Injected("unthrottle", {"node": "node-a", "local_rank": 1, "rank": 3}, (42,))
    events = [ev(4, "replan", replan(2, changes=(change("degrade", [DEV]),))),
              ev(5, "switch-done", done(2))]
    assert match_detection(inj, base(), events) is None
    events += [ev(6, "replan", replan(3, changes=(change("recover", [DEV]),))),
               ev(7, "switch-done", done(3))]
    det = match_detection(inj, base(), events)
    assert det.by == "replan event #6"
    assert match_recovery(inj, base(), det, events, []).by == "switch-done event #7"


# ---------------------------------------------------------------------------- a real job's worker
def _home(pid: int, version: int) -> str:
    return cgroup_of(Path(f"/proc/{pid}/cgroup").read_text(), version)


def _workers(client, job: str, count: int):
    recs = {rec.local_rank: rec.pid for _, rec in schema.decode_valid(
        client.get_prefix(schema.workers_prefix(job)), logging.getLogger(__name__), "test")}
    return recs if len(recs) == count and all(p > 1 for p in recs.values()) else None


def test_a_real_worker_is_throttled_then_unthrottled_and_close_cleans_up(
        tmp_path, marker, etcd_server, client):
    hierarchy, line = available()
    if hierarchy is None:
        pytest.fail(line)
    job = f"throttle-{uuid.uuid4().hex[:8]}"
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    agent = Launcher(["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint_str,
                      "--rdzv-id", job, "--hspmd-node-id", "node-a", "--nproc-per-node", "2",
                      "--shutdown-timeout", "5", str(SCRIPTS / "sleeper.py")],
                     base_env(marker, PID_DIR=str(pids_dir)), tmp_path, "node-a")
    ctx = InjectContext(client, job, log_dir=str(tmp_path / "inject"))
    parent = os.path.join(hierarchy.root, f"hspmd-{job}")
    try:
        pids = wait_for(lambda: _workers(client, job, 2), 60, "both workers' records",
                        proc=agent.proc)
        homes = {r: _home(p, hierarchy.version) for r, p in pids.items()}
        inj = make_fault(spec(fault="throttle", target={"node": "node-a", "local_rank": 1},
                              cpus=0.125)).inject(ctx)
        child = os.path.join(parent, "node-a-1")
        assert inj.injected.target == {"node": "node-a", "local_rank": 1, "rank": 1}
        assert inj.injected.pids == (pids[1],) and inj.detail["cgroup"] == child
        assert inj.detail["cpus"] == 0.125 and "capped at 0.125 of a core" in \
            inj.detail["done_by"] and inj.timers == []
        assert Path(child, "cgroup.procs").read_text().split() == [str(pids[1])]
        assert _home(pids[0], hierarchy.version) == homes[0]  # the other worker untouched
        if hierarchy.version == 1:
            assert Path(child, "cpu.cfs_quota_us").read_text().strip() == "12500"
            assert Path(child, "cpu.cfs_period_us").read_text().strip() == "100000"
        else:
            assert Path(child, "cpu.max").read_text().strip() == "12500 100000"

        lifted = make_fault(spec(fault="unthrottle", target={"node": "node-a",
                                                             "local_rank": 1})).inject(ctx)
        assert lifted.injected.pids == (pids[1],) and lifted.detail["cgroup"] == child
        assert ctx.cpu_quota.get().quota("node-a-1") is None
        with pytest.raises(InjectError, match=r"unthrottle: worker node-a/0 of job .* was not "
                                              r"throttled by this harness"):
            make_fault(spec(fault="unthrottle", target={"node": "node-a", "local_rank": 0})
                       ).inject(ctx)

        # with duration_s, a follow-up lifts the cap by itself (and ends the fault)
        timed = make_fault(spec(fault="throttle", target={"node": "node-a", "local_rank": 0},
                                cpus=0.5, duration_s=3)).inject(ctx)
        quota = ctx.cpu_quota.get()
        assert quota.quota("node-a-0") == pytest.approx(0.5)
        (timer,) = timed.timers
        assert (timer.after_s, timer.ends_fault, timer.label) == (3.0, True, "cap lifted")
        timer.action()
        assert quota.quota("node-a-0") is None
        assert sorted(quota.placed()) == ["node-a-0", "node-a-1"]

        ctx.close()
        assert not os.path.exists(parent)
        assert {r: _home(p, hierarchy.version) for r, p in pids.items()} == homes
        assert agent.proc.poll() is None  # the job went on
        ctx.close()  # idempotent

        # through the harness: injected, the cap lifted after duration_s; a restart-mode job
        # does not replan on speed, so it is "not detected" (never a made-up detection); the
        # run's end removes the cgroups
        observer = JobObserver(client, job).start()
        try:
            report = Harness(parse_scenario({"schema": 1, "kind": "fault_scenario", "faults": [
                {"fault": "throttle", "target": {"node": "node-a", "local_rank": 1},
                 "cpus": 0.25, "duration_s": 0.3, "detect_timeout_s": 0.2,
                 "recover_timeout_s": 0.2}]}), InjectContext(client, job), observer).run()
        finally:
            observer.stop()
        (row,) = report.rows
        assert row.outcome == NOT_DETECTED and row.injected_at is not None, row
        assert row.detail["cpus"] == 0.25 and row.note.startswith(f"pid {pids[1]} capped at "
                                                                  "0.25 of a core")
        assert not os.path.exists(parent)
    finally:
        ctx.close()
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
        agent.wait(60)
    assert not os.path.exists(parent)


def test_only_the_jobs_proven_workers_are_throttled(client, tmp_path):
    """A record naming a process that is not the job's worker: refused, never put in a
    cgroup (no cgroup is even made)."""
    job = f"throttle-{uuid.uuid4().hex[:8]}"
    stranger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE,
                                env={k: v for k, v in os.environ.items() if k != "HSPMD_JOB_ID"})
    try:
        rec = schema.WorkerRecord(pid=stranger.pid, global_rank=0, local_rank=0, plan_version=0,
                                  step=0, last_progress_at=time.time(), steps_per_s=0.0)
        client.put(schema.worker_key(job, "node-a", 0), schema.encode(rec))
        ctx = InjectContext(client, job, log_dir=str(tmp_path))
        with pytest.raises(TargetNotFound, match=r"does not carry job .* not signalled"):
            make_fault(spec(fault="throttle", target=WORKER, cpus=0.5)).inject(ctx)
        assert ctx.cpu_quota is None
        hierarchy, _ = available()
        if hierarchy is not None:
            assert not os.path.exists(os.path.join(hierarchy.root, f"hspmd-{job}"))
        ctx.close()
    finally:
        stranger.stdin.close()
        stranger.wait(10)
