"""The operations surface on a live job: a real hspmd-launch job on a real etcd.

The launched job writes its nodes, workers, rendezvous and events itself; a worker is killed for
a real failure and restart. What the elastic runtime will write later (a device verdict, plans,
switch events with timings, worker progress) is written here by ``RuntimeStandIn`` with the
production record types and writers (``VerdictPublisher``, ``append_event``).

Checks: the dashboard page (headless Chromium, rendering what ``/api/stream`` pushes) shows the
failed GPU in the cluster map and the failure in the timeline (a screenshot goes to
``artifacts/ops-dashboard.png``); ``/api/stream`` pushes the change as it happens; ``/metrics`` parses and its counters move with the switch; ``status --json``
names the failed GPU and the plan that replaced it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch_harness import (
    REPO,
    SCRIPTS,
    Launcher,
    base_env,
)
from _wait import wait_for

from hspmd_elastic.coord import EtcdClient, append_event
from hspmd_elastic.contract import schema
from hspmd_elastic.plan import simple_plan
from launcher.health.api import Verdict
from launcher.health.verdicts import VerdictPublisher

pytestmark = pytest.mark.multiproc

NODE = "node-a"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "artifacts"


class RuntimeStandIn:
    """Writes what the elastic runtime will write, through the production record types."""

    def __init__(self, client: EtcdClient, job: str):
        self.client, self.job = client, job
        self.verdicts = VerdictPublisher(client, job, NODE)

    def publish_plan(self, version: int, devices: list[str], reason: str) -> None:
        layout = simple_plan(tp=len(devices), num_layers=4, global_batch=2)
        rec = schema.PlanRecord(version=version, reason=reason, devices=devices,
                                strategy=layout.to_dict(), store_endpoint="127.0.0.1:29500",
                                created_at=time.time())
        self.client.put(schema.plan_history_key(self.job, version), schema.encode(rec))
        self.client.put(schema.plan_current_key(self.job), schema.encode(rec))

    def gpu_health(self, verdicts: dict[int, Verdict]) -> None:
        assert self.verdicts.publish(verdicts)

    def switch(self, old: int, new: int, devices: list[str]) -> None:
        """The leader's plan and ``replan`` event, then the switch-done event of the new plan's
        rank 0 (detail and timings shaped as the runtime's ``SwitchTimings.numeric()``)."""
        self.publish_plan(new, devices, f"failure {NODE}:1")
        append_event(self.client, self.job, "replan", NODE, schema.ReplanDetail(
            version=new, previous_version=old, reason=f"failure {NODE}:1",
            device_count=len(devices), planner="dp", store_endpoint="h:1"),
            timings={"plan_s": 0.01, "detect_to_publish_s": 0.12})
        append_event(self.client, self.job, "switch-done", NODE, schema.SwitchDoneDetail(
            plan_version=new, from_version=old, source="bsr", bytes_moved=96 << 20), timings={
            "from_version": float(old), "to_version": float(new), "rank": 0.0,
            "detect_s": 0.02, "stall_s": 0.0, "regroup_s": 0.05, "exchange_s": 0.01,
            "bsr_s": 0.21, "bsr_bytes_total": float(96 << 20), "bsr_bytes_sent": 0.0,
            "bsr_bytes_received": float(96 << 20), "rebuild_s": 0.06, "total_s": 0.35,
            "resume_step": 40.0})

    def progress(self, steps: list[tuple[int, float]]) -> None:
        for step, rate in steps:
            rec = schema.WorkerRecord(pid=os.getpid(), global_rank=0, local_rank=0,
                                      plan_version=2, step=step, last_progress_at=time.time(),
                                      steps_per_s=rate)
            self.client.put(schema.worker_key(self.job, NODE, 0), schema.encode(rec))


def ops_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.ops.commands", *args]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(http_get(url + "metrics").decode()):
        for s in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "job")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def open_stream(url: str) -> http.client.HTTPResponse:
    host, port = re.match(r"http://([^:/]+):(\d+)/", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/api/stream")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    return resp


def next_pushed(resp: http.client.HTTPResponse, predicate, timeout: float) -> dict:
    """Read pushed documents until one satisfies ``predicate`` (AssertionError at the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = resp.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            doc = json.loads(line[6:])
            if predicate(doc):
                return doc
    raise AssertionError("the stream pushed no document with the expected change")


def chromium(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="ops-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
               "--hide-scrollbars", "--virtual-time-budget=5000", *args, url]
        return subprocess.run(cmd, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)


def restarted(doc: dict) -> bool:
    """The agent recorded the failure and restart and registered round 1's two workers (so it
    will not overwrite the progress the stand-in writes next)."""
    workers = [w for n in doc["nodes"] for w in n["workers"]]
    return {"failure", "restart"} <= set(doc["events"]["by_type"]) and len(workers) == 2 \
        and all(w["plan_version"] == 1 for w in workers)


def failed_gpu_shown(doc: dict) -> bool:
    return any(d["id"] == f"{NODE}:1" for d in doc["devices"]["failed"])


def test_live_job_failure_shows_in_dashboard_metrics_and_status(tmp_path, marker, etcd_server):
    job = f"ops-{uuid.uuid4().hex[:8]}"
    ep = etcd_server.endpoint_str
    pids = tmp_path / "pids"
    pids.mkdir()
    env = base_env(marker, PID_DIR=str(pids))
    launch = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                       "--rdzv-endpoint", ep, "--rdzv-id", job, "--hspmd-node-id", NODE,
                       "--max-restarts", "1", "--rdzv-conf", "last_call_timeout=0.1",
                       "--hspmd-lease-ttl", "2", "--shutdown-timeout", "3",
                       str(SCRIPTS / "sleeper.py")], env, tmp_path, "job")
    dash_out = tmp_path / "dashboard.stdout"
    with open(dash_out, "wb") as out:
        dash = subprocess.Popen(ops_cmd("dashboard", "--job", job, "--etcd-endpoints", ep,
                                        "--port", "0"), env=env, cwd=str(REPO), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    runtime = RuntimeStandIn(client, job)
    try:
        url = wait_for(lambda: re.search(rb"(http://127\.0\.0\.1:\d+/)", dash_out.read_bytes()),
                       30, "the dashboard URL", proc=dash).group(1).decode()
        wait_for(lambda: len(list(pids.glob("*.pids"))) == 2, 60, "two workers", proc=launch.proc)
        runtime.publish_plan(1, [f"{NODE}:0", f"{NODE}:1"], "start")
        now = time.monotonic()
        runtime.gpu_health({0: Verdict.healthy(now), 1: Verdict.healthy(now)})
        before = wait_for(lambda: (m := metrics(url))["hspmd_plan_version"] == 1 and m,
                          10, "plan v1 in /metrics")
        assert before["hspmd_switches_total"] == 0 and before["hspmd_switch_seconds_total"] == 0
        stream = open_stream(url)

        # a real failure: rank 1 dies; the agent records it and restarts the workers
        os.kill(int((pids / "1.pids").read_text().split()[0]), signal.SIGKILL)
        runtime.gpu_health({0: Verdict.healthy(now), 1: Verdict.failed(
            "Xid 79: GPU has fallen off the bus", xid=79, at=time.monotonic())})
        pushed = next_pushed(stream, failed_gpu_shown, 20)
        assert pushed["devices"]["failed"][0]["reason"] == "Xid 79: GPU has fallen off the bus"
        stream.close()
        wait_for(lambda: restarted(json.loads(http_get(url + "api/state"))), 30,
                 "the agent's failure and restart events and its restarted workers",
                 proc=launch.proc)
        runtime.switch(1, 2, [f"{NODE}:0"])
        runtime.progress([(10, 2.0), (20, 2.6), (30, 2.4), (40, 2.5)])

        after = wait_for(lambda: (m := metrics(url))["hspmd_switches_total"] == 1
                         and m["hspmd_step"] == 40 and m, 10, "the switch and step 40 in /metrics")
        assert after["hspmd_switch_seconds_total"] == pytest.approx(0.35)
        assert after["hspmd_switch_bytes_moved_total"] == 96 << 20
        assert after["hspmd_devices{health=failed}"] == 1
        assert after["hspmd_devices{health=healthy}"] == 1
        assert after["hspmd_events_total{type=failure}"] >= 1
        assert after["hspmd_plan_version"] == 2 and after["hspmd_steps_per_second"] == 2.5

        # the page, rendered by a real browser from what /api/stream pushes
        dom = chromium(url + "?stream=once", "--dump-dom").stdout.decode()
        assert re.search(r'<body [^>]*data-source="stream"', dom), dom[:2000]
        gpu = re.search(rf'<div [^>]*data-device="{NODE}:1"[^>]*>', dom)
        assert gpu and 'data-health="failed"' in gpu.group(0), dom[:2000]
        assert "Xid 79: GPU has fallen off the bus" in dom
        assert re.search(r'<tr [^>]*data-event-type="failure"', dom)
        assert re.search(r'<circle [^>]*data-event-type="failure"', dom)
        assert re.search(r'data-switch="2"[^>]*>v2 0\.35 s<', dom)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "ops-dashboard.png"
        shot.unlink(missing_ok=True)
        chromium(url + "?stream=0", "--window-size=1280,900", f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000

        # the status document names the failed GPU and the plan that replaced it
        res = subprocess.run(ops_cmd("status", "--json", "--job", job, "--etcd-endpoints", ep),
                             capture_output=True, timeout=30, cwd=str(REPO), env=env)
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        [failed] = doc["devices"]["failed"]
        assert failed["id"] == f"{NODE}:1" and failed["xid"] == 79
        assert failed["replaced_by_plan"] == 2 and not failed["in_plan"]
        assert doc["plan"]["version"] == 2 and doc["plan"]["devices"] == [f"{NODE}:0"]
        assert {"failure", "restart", "replan", "switch-done"} <= set(
            doc["events"]["by_type"])
        assert doc["problems"] == []  # every key of the live job decodes

        # ... and every key it holds has a row in docs/etcd-schema.md's key table
        table = (REPO / "docs" / "etcd-schema.md").read_text()
        documented = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
        held = {schema.match_key(kv.key)[1].pattern
                for kv in client.get_prefix(schema.job_prefix(job))}
        assert held - documented == set() and {"nodes/<node_id>", "workers/<node_id>/<local_rank>",
                                                "events/<seq>", "rdzv/state"} <= held
    finally:
        client.close()
        dash.send_signal(signal.SIGTERM)
        launch.proc.send_signal(signal.SIGTERM)
        assert dash.wait(10) == 0, dash_out.read_text()
        launch.wait(30)
