"""Health in restart mode: real agents and real worker processes on CPUs, the scripted health
source as the GPUs. A fatal verdict makes the job restart without that slot (fewer workers,
``CUDA_VISIBLE_DEVICES`` and ``WORLD_SIZE`` follow) or fail with the verdict as root cause; a
worker that opted into heartbeats (``hspmd_elastic.heartbeat``) and stops stepping is killed
and restarted, counted; without heartbeats there is no hang rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from _wait import wait_for
from launch_harness import Launcher, base_env, read_json_files

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.env import PROGRESS_FILE_ENV
from hspmd_elastic.contract.progress import read_progress
from hspmd_elastic.coord.journal import read_events
from hspmd_elastic.heartbeats import Heartbeat
from launcher.health.api import DeviceInfo
from launcher.health.nvml import probe_nvml
from launcher.node.restart.health import (
    FAIL,
    LEAVE,
    RESTART,
    after_device_loss,
    node_slots,
)

pytestmark = pytest.mark.multiproc

WORKER = r'''
import json, os, sys, time

out, mode = os.environ["OUT_DIR"], os.environ["MODE"]
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
lr = int(os.environ["LOCAL_RANK"])
keys = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK",
        "HSPMD_PROGRESS_FILE", "HSPMD_ROUND")
dump = {k: os.environ.get(k) for k in keys}
dump["pid"] = os.getpid()
name = os.path.join(out, f"restart{restart}_local{lr}.json")
with open(name + ".tmp", "w") as f:
    json.dump(dump, f)
os.replace(name + ".tmp", name)
if mode == "devices":
    if restart == 0:
        time.sleep(120)  # runs until the agent stops it
elif mode == "hang":
    import hspmd_elastic
    for step in range(1, 31):
        if restart == 0 and lr == 1 and step == 5:
            time.sleep(120)  # alive, no progress: a hang
        hspmd_elastic.heartbeat(step)
        time.sleep(0.12)  # past the heartbeat's 0.1 s write interval: every step is written
elif mode == "silent":
    if lr == 1:
        time.sleep(3)  # longer than every hang limit, but no heartbeat: no hang rule
'''

# Short limits, yet long enough that a loaded test machine never starves a live worker past them.
HANG_ENV = {"HSPMD_HANG_TIMEOUT_S": "5", "HSPMD_HANG_MULTIPLE": "2",
            "HSPMD_HANG_STARTUP_S": "20"}
# The silent worker waits past these; it would be declared hung if it had opted in.
SILENT_ENV = {"HSPMD_HANG_TIMEOUT_S": "1", "HSPMD_HANG_MULTIPLE": "2",
              "HSPMD_HANG_STARTUP_S": "1"}


class Job:
    def __init__(self, tmp_path: Path, marker: str, etcd, mode: str, nproc: int,
                 max_restarts: int, extra_env: dict | None = None, scripted: bool = True):
        self.id = f"health-{uuid.uuid4().hex[:8]}"
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.faults = tmp_path / "faults.jsonl"
        self.faults.write_text("")
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        env = base_env(marker, OUT_DIR=str(self.out), MODE=mode, **(extra_env or {}))
        self.etcd = etcd
        self.agent = Launcher([
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_str,
            "--rdzv-id", self.id, "--hspmd-node-id", "node-a", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.05",
            "--shutdown-timeout", "2",
            *(["--hspmd-health-source", f"scripted:{self.faults}"] if scripted else []),
            str(script)], env, tmp_path, "node-a")

    def dumps(self, restart: int) -> dict[int, dict]:
        files = read_json_files(self.out, f"restart{restart}_local*.json")
        return {int(d["LOCAL_RANK"]): d for d in files.values()}

    def fail_device(self, index: int, xid: int = 79) -> None:
        with open(self.faults, "a") as f:
            f.write(json.dumps({"device": index, "kind": "xid", "xid": xid}) + "\n")

    def etcd_view(self):
        with EtcdClient(self.etcd.endpoints, timeout=5.0) as client:
            events = read_events(client, self.id)
            kv = client.get(schema.rdzv_state_key(self.id))
            state = schema.decode(kv.key, kv.value)
        return events, state


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hspmd-launch: error:")]
    assert lines, stderr[-3000:]
    return lines[-1]


# ------------------------------------------------------------------------------------- pure
def test_slots_follow_cuda_visible_devices_and_the_sources_indices():
    devices = [DeviceInfo(i, f"GPU {i}", f"GPU-{i}", 0, "H100") for i in range(4)]
    assert [(s.token, s.index) for s in node_slots(2, None, devices)] == [("0", 0), ("1", 1)]
    assert [(s.token, s.index) for s in node_slots(2, "3,1", devices)] == [("3", 3), ("1", 1)]
    assert [(s.token, s.index) for s in node_slots(2, "GPU-2,GPU-0", devices)] == \
        [("GPU-2", 2), ("GPU-0", 0)]
    # no such device at the source (CPU slots, a scripted source): the slot's position
    assert [(s.token, s.index) for s in node_slots(3, "7", [])] == \
        [("7", 0), ("1", 1), ("2", 2)]


def test_a_lost_device_restarts_while_one_is_usable_else_leaves_or_fails():
    assert after_device_loss(1, participants=1, min_nodes=1) == RESTART
    assert after_device_loss(0, participants=3, min_nodes=2) == LEAVE
    assert after_device_loss(0, participants=2, min_nodes=2) == FAIL
    assert after_device_loss(0, participants=1, min_nodes=1) == FAIL


def test_heartbeat_writes_the_progress_file_when_the_step_moves(tmp_path):
    path = str(tmp_path / "progress.json")
    beat = Heartbeat(env={PROGRESS_FILE_ENV: path, "RANK": "3", "LOCAL_RANK": "1",
                          "HSPMD_ROUND": "2"}, min_interval_s=0.0)
    assert beat.beat(1)
    report = read_progress(path, 1)
    assert (report.step, report.pid, report.global_rank, report.plan_version) == \
        (1, os.getpid(), 3, 2)
    assert not beat.beat(1)  # the same step again is no progress: nothing written
    assert beat.beat() and read_progress(path, 1).step == 2  # None counts on
    slow = Heartbeat(path=path, env={}, min_interval_s=3600.0)
    assert slow.beat(7) and not slow.beat(8)  # at most one write per interval
    assert read_progress(path, 1).step == 7


def test_heartbeat_outside_an_agent_does_nothing(tmp_path):
    assert not Heartbeat(env={}).beat(1)
    assert list(tmp_path.iterdir()) == []


def test_the_heartbeat_line_is_torch_free_and_writes_where_the_agent_says(tmp_path):
    path = tmp_path / "p.json"
    code = ("import sys, hspmd_elastic; assert hspmd_elastic.heartbeat(5); "
            "bad = [m for m in ('torch', 'launcher') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env=dict(os.environ, HSPMD_PROGRESS_FILE=str(path)))
    assert read_progress(str(path), 0).step == 5


def test_cli_health_source_defaults_to_auto_and_refuses_bad_values(tmp_path, capsys):
    from launcher.cli import launch_command, main

    option = next(p for p in launch_command.params if p.name == "hspmd_health_source")
    assert option.default == "auto"
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["--hspmd-health-source", "gpu", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gpu'" in err[0] and "auto, nvml, none" in err[0], err
    assert main(["--hspmd-health-source", f"scripted:{tmp_path}/none.jsonl", str(script)]) == 2
    assert "is not a readable file" in capsys.readouterr().err


# --------------------------------------------------------------------------- real processes
def test_a_fatal_verdict_restarts_the_job_without_that_device(tmp_path, marker, etcd_server):
    job = Job(tmp_path, marker, etcd_server, "devices", nproc=3, max_restarts=1)
    first = wait_for(lambda: len(job.dumps(0)) == 3 and job.dumps(0), 120, "3 workers",
                     proc=job.agent.proc)
    assert {d["CUDA_VISIBLE_DEVICES"] for d in first.values()} == {None}
    assert {d["WORLD_SIZE"] for d in first.values()} == {"3"}
    job.fail_device(1)
    code = job.agent.wait(120)
    assert code == 0, job.agent.stderr()[-3000:]

    second = job.dumps(1)
    assert sorted(second) == [0, 1], second
    for lr, dump in second.items():
        assert dump["CUDA_VISIBLE_DEVICES"] == "0,2"
        assert dump["WORLD_SIZE"] == "2" and dump["LOCAL_WORLD_SIZE"] == "2"
        assert dump["RANK"] == str(lr)
    events, state = job.etcd_view()
    assert state.state == "succeeded" and state.restart_count == 1
    failures = [schema.event_detail(e) for e in events if e.type == "failure"]
    device_failures = [d for d in failures if not d.exits]  # not a worker's exit
    assert [d.devices for d in device_failures] == [["node-a:1"]]
    assert "GPU 1 failed" in device_failures[0].reason
    assert "Xid 79" in device_failures[0].reason or "79" in device_failures[0].reason
    assert "restarting without GPU 1: 2 worker(s) here" in job.agent.stderr()


def test_no_usable_device_left_fails_the_job_with_the_verdict(tmp_path, marker, etcd_server):
    job = Job(tmp_path, marker, etcd_server, "devices", nproc=1, max_restarts=3)
    wait_for(lambda: len(job.dumps(0)) == 1, 120, "the worker", proc=job.agent.proc)
    job.fail_device(0)
    code = job.agent.wait(120)
    assert code == 1
    line = _error_line(job.agent.stderr())
    assert "GPU 0 failed" in line and "no usable device left" in line, line
    _, state = job.etcd_view()
    assert state.state == "failed" and "GPU 0 failed" in state.reason


def test_restarts_used_up_fail_the_job_with_the_verdict(tmp_path, marker, etcd_server):
    job = Job(tmp_path, marker, etcd_server, "devices", nproc=2, max_restarts=0)
    wait_for(lambda: len(job.dumps(0)) == 2, 120, "2 workers", proc=job.agent.proc)
    job.fail_device(0, xid=48)
    code = job.agent.wait(120)
    assert code == 1
    line = _error_line(job.agent.stderr())
    assert "GPU 0 failed" in line and "restarts used up" in line, line
    assert not job.dumps(1)  # never restarted


def test_a_worker_that_stops_heartbeating_is_killed_and_restarted(tmp_path, marker,
                                                                   etcd_server):
    job = Job(tmp_path, marker, etcd_server, "hang", nproc=2, max_restarts=1,
              extra_env=HANG_ENV)
    code = job.agent.wait(120)
    assert code == 0, job.agent.stderr()[-3000:]
    hung = job.dumps(0)[1]
    assert hung["HSPMD_PROGRESS_FILE"].endswith("round0_local1.json")
    events, state = job.etcd_view()
    assert state.state == "succeeded" and state.restart_count == 1
    stalls = [e for e in events if e.type == "stall"]
    stall = schema.event_detail(stalls[0])
    assert len(stalls) == 1 and stall.pid == hung["pid"], stalls
    assert stall.step == 4 and stall.local_rank == 1 and stall.devices == ["node-a:1"]
    assert "made no progress" in stalls[0].detail["reason"]
    assert sorted(job.dumps(1)) == [0, 1]  # every worker restarted


def test_without_heartbeats_restart_mode_has_no_hang_rule(tmp_path, marker, etcd_server):
    job = Job(tmp_path, marker, etcd_server, "silent", nproc=2, max_restarts=1,
              extra_env=SILENT_ENV, scripted=False)  # the default source: auto
    code = job.agent.wait(120)
    assert code == 0, job.agent.stderr()[-3000:]
    said = [ln for ln in job.agent.stderr().splitlines() if "GPU health:" in ln]
    if probe_nvml() is None:
        assert not said  # a driver: NVML watches the GPUs
    else:
        assert len(said) == 1 and "monitoring worker processes only" in said[0], said
    events, state = job.etcd_view()
    assert state.state == "succeeded" and state.restart_count == 0
    assert not [e for e in events if e.type in ("stall", "failure")]
    assert not job.dumps(1)
