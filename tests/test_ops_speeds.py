"""Per-device busy time and speeds in ``status``, the dashboard and ``/metrics``, on a real etcd.

The records are written as the runtime and the leader write them (``schema.encode``,
``append_event``): workers with their ``busy_s``, a plan with its ``inventory`` and ``speeds``
events. Checks: the terminal's "Speeds" table and ``status --json`` show each device's busy time,
planned and measured speed (the newest ``speeds`` event of the current plan, never an older
plan's); ``/api/state``, the rendered page and ``/metrics`` show the same; a value that is not
a finite number never reaches any of them (``decode`` refuses it, the key is listed as a
problem), nor does a speed <= 0 or a device the view does not know.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hspmd_elastic.coord import EtcdClient, append_event
from hspmd_elastic.coord.client import DEFAULT_TIMEOUT_S
from hspmd_elastic.contract import schema
from hspmd_elastic.plan import simple_plan
from launcher.ops.dashboard import DashboardServer
from launcher.ops.state import JobStateCache

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
JOB = "speedjob"
DEVICES = ["n1:0", "n1:1", "n2:0"]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def client_timeout():
    return DEFAULT_TIMEOUT_S


def ops(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="140")
    return subprocess.run([sys.executable, "-m", "launcher.ops.commands", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
                          env=env, stdin=subprocess.DEVNULL)


def speeds(version: int, measured: dict[str, float], replan: bool = False
           ) -> schema.SpeedsDetail:
    return schema.SpeedsDetail(
        plan_version=version, measured=measured, assumed={d: 1.0 for d in measured},
        step_now_s=0.9, step_new_s=0.6, gain_s=30.0, cost_s=4.0, replan=replan,
        reason="n1:1 measured 0.25")


def plan_record(version: int, inventory: dict[str, float]) -> schema.PlanRecord:
    return schema.PlanRecord(version=version, reason="speeds", devices=DEVICES,
                             strategy=simple_plan(dp=3, num_layers=2, global_batch=3).to_dict(),
                             store_endpoint="h-n1:29500", created_at=time.time(),
                             inventory=inventory)


def seed(client: EtcdClient) -> None:
    """Two nodes, plan v3 over three devices (n2:0 planned at half speed), three workers (n2's
    not measured yet), a ``speeds`` event of plan v2 and two of plan v3 (the newer counts)."""
    now = time.time()
    for node, n in (("n1", 2), ("n2", 1)):
        client.put(schema.node_key(JOB, node), schema.encode(schema.NodeRecord(
            host=f"h-{node}", agent_pid=1, state="running", started_at=now,
            devices=[schema.DeviceInfo(i, "H200", 1 << 30, f"GPU-{node}-{i}")
                     for i in range(n)])))
    for version in (2, 3):
        rec = plan_record(version, {"n1:0": 1.0, "n1:1": 1.0, "n2:0": 0.5})
        client.put(schema.plan_history_key(JOB, version), schema.encode(rec))
    client.put(schema.plan_current_key(JOB), schema.encode(rec))
    for (node, lr), (rank, busy) in {("n1", 0): (0, 0.12), ("n1", 1): (1, 0.48),
                                     ("n2", 0): (2, 0.0)}.items():
        client.put(schema.worker_key(JOB, node, lr), schema.encode(schema.WorkerRecord(
            pid=100 + rank, global_rank=rank, local_rank=lr, plan_version=3, step=40,
            last_progress_at=now, steps_per_s=1.5, busy_s=busy)))
    append_event(client, JOB, "speeds", "n1", speeds(2, {"n1:1": 0.75}))
    append_event(client, JOB, "speeds", "n1", speeds(3, {"n1:0": 1.0, "n1:1": 0.5}))
    append_event(client, JOB, "speeds", "n1", speeds(3, {"n1:0": 1.0, "n1:1": 0.25,
                                                         "n2:0": 0.5}, replan=True))


def strict_json(raw: str) -> dict:
    def refuse(name: str):
        raise AssertionError(f"{name} in a JSON document")
    return json.loads(raw, parse_constant=refuse)


def metrics(raw: bytes) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(raw.decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "job")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def by_device(doc: dict) -> dict[str, dict]:
    return {d["id"]: d for n in doc["nodes"] for d in n["devices"]}


def by_worker(doc: dict) -> dict[str, dict]:
    return {f"{w['node']}:{w['local_rank']}": w for n in doc["nodes"] for w in n["workers"]}


def test_status_shows_busy_time_and_speeds(etcd_server, client):
    seed(client)
    args = ("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str)
    res = ops(*args)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "Speeds" in out, out
    # device, rank, busy/step, planned, measured
    assert re.search(r"n1:0\s.*\b0\s.*0\.1200s\s.*1\.00\s.*1\.00", out), out
    assert re.search(r"n1:1\s.*\b1\s.*0\.4800s\s.*1\.00\s.*0\.25", out), out
    assert re.search(r"n2:0\s.*-\s.*-\s.*0\.50\s.*0\.50", out), out
    # the decision's one-line summary names the slow device and the numbers
    assert "n1:1 0.25 (plan 1.00)" in out and "replan" in out, out
    res = ops(*args, "--json")
    assert res.returncode == 0, res.stderr
    doc = strict_json(res.stdout)
    dev, work = by_device(doc), by_worker(doc)
    assert (dev["n1:1"]["planned_speed"], dev["n1:1"]["measured_speed"]) == (1.0, 0.25)
    assert (dev["n2:0"]["planned_speed"], dev["n2:0"]["measured_speed"]) == (0.5, 0.5)
    assert (work["n1:0"]["busy_s"], work["n1:1"]["busy_s"], work["n2:0"]["busy_s"]) == \
        (0.12, 0.48, 0.0)


def test_a_new_plan_drops_the_old_plans_measured_speeds(etcd_server, client):
    """Measured speeds belong to the plan they were measured under: plan v4 has none yet."""
    seed(client)
    client.put(schema.plan_current_key(JOB), schema.encode(
        plan_record(4, {"n1:0": 1.0, "n1:1": 0.25, "n2:0": 0.5})))
    res = ops("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str, "--json")
    assert res.returncode == 0, res.stderr
    dev = by_device(strict_json(res.stdout))
    assert [(dev[d]["planned_speed"], dev[d]["measured_speed"]) for d in DEVICES] == \
        [(1.0, None), (0.25, None), (0.5, None)]


def chromium_dom(url: str) -> str:
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="ops-chromium-") as profile:
        res = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", url],
            capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return res.stdout.decode()


def test_dashboard_state_page_and_metrics_show_busy_time_and_speeds(client):
    seed(client)
    with JobStateCache(client, JOB) as cache, DashboardServer(cache, port=0) as server:
        state = strict_json(urllib.request.urlopen(server.url + "api/state", timeout=5)
                            .read().decode())
        assert by_device(state)["n1:1"]["measured_speed"] == 0.25
        assert by_worker(state)["n1:1"]["busy_s"] == 0.48
        m = metrics(urllib.request.urlopen(server.url + "metrics", timeout=5).read())
        dom = chromium_dom(server.url + "?stream=0")
    assert m["hspmd_worker_busy_seconds{local_rank=1,node=n1}"] == 0.48
    assert m["hspmd_worker_busy_seconds{local_rank=0,node=n1}"] == 0.12
    assert "hspmd_worker_busy_seconds{local_rank=0,node=n2}" not in m  # not measured yet
    assert m["hspmd_device_speed{device=n1:1,source=measured}"] == 0.25
    assert m["hspmd_device_speed{device=n1:1,source=planned}"] == 1.0
    assert m["hspmd_device_speed{device=n2:0,source=planned}"] == 0.5
    assert re.search(r'<body [^>]*data-source="state"', dom), dom[:2000]
    row = re.search(r'<tr [^>]*data-speed-device="n1:1"[^>]*>', dom)
    assert row and 'data-busy="0.48"' in row.group(0) and 'data-measured="0.25"' in row.group(0)
    assert 'data-planned="1"' in row.group(0), row.group(0)
    gpu = re.search(r'<div [^>]*data-device="n1:1".*?</div></div>', dom, re.S)
    assert gpu and "busy 0.480 s" in gpu.group(0) and "speed 0.25" in gpu.group(0), dom[:3000]


def test_hostile_values_never_reach_the_output(etcd_server, client):
    """NaN/Infinity are refused by ``decode`` (the key is a problem, the worker or event is
    not shown); a speed <= 0 is not known; a device the view does not know gets no sample;
    a device name with control characters is shown escaped."""
    seed(client)
    worker = schema.worker_key(JOB, "n2", 0)
    body = json.loads(client.get(worker).value)
    body["busy_s"] = float("nan")
    client.put(worker, json.dumps(body).encode())  # NaN: not JSON, decode refuses it
    bad = schema.new_event_record(90, "speeds", "n1", speeds(3, {"n1:0": 1.0}), {}, time.time())
    raw = json.loads(schema.encode(bad))
    raw["detail"]["measured"]["n1:0"] = float("inf")
    client.put(schema.event_key(JOB, 90), json.dumps(raw).encode())
    append_event(client, JOB, "speeds", "n1", speeds(3, {"n1:0": -1.0, "n1:1": 0.0,
                                                         "x\x1b[2J": 0.5}))
    res = ops("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str, "--json")
    assert res.returncode == 0, res.stderr
    doc = strict_json(res.stdout)
    problems = {p["key"] for p in doc["problems"]}
    assert {worker, schema.event_key(JOB, 90)} <= problems, doc["problems"]
    dev = by_device(doc)
    assert "n2:0" not in by_worker(doc)
    assert dev["n1:0"]["measured_speed"] is None and dev["n1:1"]["measured_speed"] is None
    assert "x\x1b[2J" not in dev
    res = ops("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str)
    assert res.returncode == 0 and "\x1b" not in res.stdout and "x\\x1b[2J" in res.stdout, \
        res.stdout
    with JobStateCache(client, JOB) as cache, DashboardServer(cache, port=0) as server:
        text = urllib.request.urlopen(server.url + "metrics", timeout=5).read()
    m = metrics(text)
    assert not any(math.isnan(v) or math.isinf(v) for v in m.values())
    assert not any("source=measured" in k for k in m), [k for k in m if "speed" in k]
    assert not any("x\\x1b" in k or "x\x1b" in k for k in m)
    assert "hspmd_worker_busy_seconds{local_rank=0,node=n2}" not in m
