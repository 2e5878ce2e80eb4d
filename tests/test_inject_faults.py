"""Each fault lands on real things (a real etcd, real processes, real signals), and the report
says "not detected" when nothing in the job reacts; the command line's errors and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hspmd_elastic.contract import schema
from launcher.health.api import DeviceState
from launcher.health.scripted import ScriptedHealthSource
from launcher.health.verdicts import EtcdFaultFeed, fault_script_key
from launcher.inject.api import NOT_DETECTED, NOT_INJECTED, TargetNotFound
from launcher.inject.detect import FileProgress, JobObserver
from launcher.inject.faults import InjectContext, find_worker, make_fault
from launcher.inject.harness import Harness
from launcher.inject.report import render_table
from launcher.inject.scenario import parse_fault, parse_scenario

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO = SCRIPTS.parent.parent
JOB = "inject-unit"
DEFAULTS = {"detect_timeout_s": 30.0, "recover_timeout_s": 60.0, "trigger_timeout_s": 60.0}


def spec(**entry):
    return parse_fault(entry, 0, DEFAULTS, "<test>")


def scenario(*faults):
    return parse_scenario({"schema": 1, "kind": "fault_scenario", "name": "t",
                           "faults": list(faults)})


@pytest.fixture
def client_timeout():
    return 5.0  # per call of the ``client`` fixture (conftest), instead of 1 s


@pytest.fixture
def ticker(tmp_path, client):
    """A live 'worker' of the job: its pid in workers/node-a/0, in its env the job id, node id
    and local rank, as an agent sets them."""
    progress = tmp_path / "ticker.jsonl"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "inject_ticker.py"), str(progress),
                             "0.05", "40"], env=dict(os.environ, HSPMD_JOB_ID=JOB,
                                                     HSPMD_NODE_ID="node-a", LOCAL_RANK="0"))
    rec = schema.WorkerRecord(pid=proc.pid, global_rank=0, local_rank=0, plan_version=0, step=0,
                              last_progress_at=time.time(), steps_per_s=0.0)
    client.put(schema.worker_key(JOB, "node-a", 0), schema.encode(rec))
    try:
        yield proc, progress
    finally:
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        proc.kill()
        proc.wait(10)


def test_device_faults_land_in_the_key_a_scripted_health_source_reads(client, tmp_path):
    ctx = InjectContext(client, JOB, log_dir=str(tmp_path))
    key = fault_script_key(JOB, "node-a")
    source = ScriptedHealthSource(EtcdFaultFeed(client, key), 3, node="node-a", refresh_s=3600)
    assert all(v.state is DeviceState.HEALTHY for v in source.poll(time.monotonic()).values())
    injected = [make_fault(spec(fault="xid", target={"node": "node-a", "device": 0}, xid=79)),
                make_fault(spec(fault="ecc", target={"node": "node-a", "device": 1}, count=3)),
                make_fault(spec(fault="thermal", target={"node": "node-a", "device": 2},
                                slowdown=0.6))]
    lengths = [f.inject(ctx).detail["script_length"] for f in injected]
    assert lengths == [1, 4, 5]  # appended, never overwritten
    body = json.loads(client.get(key).value)
    assert (body["schema"], body["kind"]) == (2, "fault_script")
    source.refresh()
    verdicts = source.poll(time.monotonic() + 0.01)
    assert verdicts[0].state is DeviceState.FAILED and verdicts[0].xid == 79
    assert verdicts[1].state is DeviceState.FAILED and "ECC" in verdicts[1].reason
    assert verdicts[2].state is DeviceState.DEGRADED and verdicts[2].slowdown == 0.6


def test_a_job_that_does_not_react_is_reported_not_detected(client, tmp_path):
    """Nobody runs a health source for this job: the Xid lands, nothing reacts, and the report
    says so (never a made-up detection); an etcd restart without owned members is refused."""
    sc = scenario({"fault": "xid", "target": {"node": "node-a", "device": 0}, "xid": 48,
                   "detect_timeout_s": 0.5},
                  {"fault": "etcd-restart"})
    observer = JobObserver(client, JOB).start()
    try:
        report = Harness(sc, InjectContext(client, JOB, log_dir=str(tmp_path)), observer).run()
    finally:
        observer.stop()
    xid, etcd = report.rows
    assert xid.outcome == NOT_DETECTED and xid.injected_at is not None
    assert xid.detected_at is None and xid.recovered_at is None
    assert client.get(fault_script_key(JOB, "node-a")) is not None
    assert etcd.outcome == NOT_INJECTED and "etcd members the harness owns" in etcd.note
    assert "not detected" in render_table(report)


def test_sigstop_freezes_the_worker_and_sigcont_resumes_it(client, ticker, tmp_path):
    proc, progress = ticker
    observer = JobObserver(client, JOB, FileProgress(str(progress))).start()
    ctx = InjectContext(client, JOB, log_dir=str(tmp_path))
    sc = scenario({"at": {"step": 3}, "fault": "stop-worker", "target": {"node": "node-a"},
                   "resume_after_s": 1.0, "detect_timeout_s": 1.5, "recover_timeout_s": 5})
    states: list[str] = []
    done = threading.Event()

    def sample() -> None:  # the process's state, seen from outside, during the run
        while not done.wait(0.02):
            states.append(psutil.Process(proc.pid).status())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        report = Harness(sc, ctx, observer).run()
    finally:
        done.set()
        sampler.join(5)
        observer.stop()
    row = report.rows[0]
    assert row.outcome == NOT_DETECTED and row.detail == {"pid": proc.pid, "signal": "SIGSTOP"}
    assert row.detected_at is None and row.recovered_by.startswith("progress to step")
    assert row.note == "the job never noticed; it went on once the fault ended"
    assert psutil.STATUS_STOPPED in states and states[-1] != psutil.STATUS_STOPPED
    times = [json.loads(line)["t"] for line in progress.read_text().splitlines()]
    injected = report.started_at + row.injected_at
    gaps = [b - a for a, b in zip(times, times[1:]) if a >= injected - 0.2]
    assert max(gaps) >= 0.9  # no progress while stopped
    assert times[-1] > injected + 1.0  # advancing again after the SIGCONT


def test_targets_must_be_live_processes_of_the_job(client, tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                env={k: v for k, v in os.environ.items() if k != "HSPMD_JOB_ID"})
    try:
        rec = schema.WorkerRecord(pid=stranger.pid, global_rank=5, local_rank=0, plan_version=0,
                                  step=0, last_progress_at=0.0, steps_per_s=0.0)
        client.put(schema.worker_key(JOB, "node-x", 0), schema.encode(rec))
        ctx = InjectContext(client, JOB, log_dir=str(tmp_path))
        with pytest.raises(TargetNotFound, match=r"no live worker of job inject-unit matches "
                                                 r"target \{'rank': 5\} \(1 matching"):
            find_worker(ctx, {"rank": 5})
        with pytest.raises(TargetNotFound, match="node node-q has no record"):
            make_fault(spec(fault="kill-agent", target={"node": "node-q"})).inject(ctx)
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait(10)


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "launcher.inject.command", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def test_cli_usage_errors_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": 1, "kind": "fault_scenario",
                               "faults": [{"fault": "kill-worker", "target": {"gpu": 1}}]}))
    res = run_cli("--scenario", str(bad), "--job", "j", "--etcd-endpoints", "127.0.0.1:2379")
    assert res.returncode == 2
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "fault 0 (kill-worker): unknown target field(s) for kill-worker gpu" in err[-1]
    assert "Traceback" not in res.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"schema": 1, "kind": "fault_scenario",
                                "faults": [{"fault": "hang"}]}))
    res = run_cli("--scenario", str(good), "--job", "bad/job", "--etcd-endpoints", "h:1")
    assert res.returncode == 2 and "job id 'bad/job' is not valid" in res.stderr
    res = run_cli("--scenario", str(good), "--job", "j", "--etcd-endpoints", "nohost")
    assert res.returncode == 2 and "bad etcd endpoint 'nohost'" in res.stderr


def test_cli_reports_and_exits_1_when_a_fault_is_not_handled(tmp_path, etcd_server, client):
    # the job exists (inject refuses a job id with no keys at once)
    client.put(schema.rdzv_state_key(JOB), schema.encode(schema.RdzvStateRecord(
        round=0, state="joining", restart_count=0, participants=[], reason="start",
        at=time.time())))
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema": 1, "kind": "fault_scenario", "name": "cli",
                                "faults": [{"fault": "thermal", "slowdown": 0.5,
                                            "target": {"node": "node-a", "device": 1},
                                            "detect_timeout_s": 0.3}]}))
    out = tmp_path / "report.json"
    res = run_cli("--scenario", str(path), "--job", JOB, "--etcd-endpoints",
                  etcd_server.endpoint_str, "--report", str(out), "--json")
    assert res.returncode == 1, res.stderr
    printed, written = json.loads(res.stdout), json.loads(out.read_text())
    assert printed == written and written["kind"] == "fault_report"
    assert [f["outcome"] for f in written["faults"]] == [NOT_DETECTED]
    res = run_cli("--scenario", str(path), "--job", JOB, "--etcd-endpoints", "127.0.0.1:1")
    assert res.returncode == 1 and "Error:" in res.stderr and "Traceback" not in res.stderr


def test_faults_after_the_job_ended_are_not_injected(client, tmp_path):
    done = schema.RdzvStateRecord(round=3, state="succeeded", restart_count=1, participants=[],
                                  reason="all nodes done", at=time.time())
    client.put(schema.rdzv_state_key(JOB), schema.encode(done))
    sc = scenario({"at": {"step": 5}, "fault": "kill-worker"},
                  {"at": 0.2, "fault": "kill-agent", "target": {"node": "node-a"}})
    observer = JobObserver(client, JOB).start()
    try:
        report = Harness(sc, InjectContext(client, JOB, log_dir=str(tmp_path)), observer).run()
    finally:
        observer.stop()
    assert [(r.outcome, r.note) for r in report.rows] == [
        (NOT_INJECTED, "job succeeded before the trigger")] * 2
    assert report.samples_lost is None and "unknown (no progress seen)" in render_table(report)
