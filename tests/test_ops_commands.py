"""``status`` and ``dashboard`` as commands against a real etcd: bad input, errors, --watch,
and a dashboard that only reads (the etcd revision does not move while it serves)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _wait import wait_for

from hspmd_elastic.coord import EtcdClient, append_event
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import DEFAULT_TIMEOUT_S
from launcher.ops.dashboard import DashboardServer
from launcher.ops.state import JobStateCache
from launcher.standalone import free_ports

REPO = Path(__file__).resolve().parents[1]
JOB = "cmdjob"


def ops(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.ops.commands", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
                          env=env, stdin=subprocess.DEVNULL)


@pytest.fixture
def client_timeout():
    return DEFAULT_TIMEOUT_S  # per call of the ``client`` fixture (conftest): the client's default


def seed(client: EtcdClient) -> None:
    client.put(schema.node_key(JOB, "n1"), schema.encode(schema.NodeRecord(
        host="h1", agent_pid=1, devices=[schema.DeviceInfo(0, "H200", 1 << 30, "GPU-0")],
        state="running", started_at=time.time())))
    append_event(client, JOB, "join", "n1", schema.ChangeDetail(round=0, nodes=["n1"]))


@pytest.mark.parametrize("args, bad", [
    (["status", "--job", JOB, "--etcd-endpoints", "localhost:99999"], "localhost:99999"),
    (["status", "--job", "bad/job", "--etcd-endpoints", "127.0.0.1:2379"], "bad/job"),
    (["status", "--job", JOB], "--etcd-endpoints"),
    (["dashboard", "--job", JOB, "--etcd-endpoints", "127.0.0.1:2379", "--port", "70000"],
     "70000"),
    (["status", "--job", JOB, "--etcd-endpoints", "127.0.0.1:2379", "--for", "2"], "--watch"),
    # an IPv6 address without brackets: is 2379 its last group or the port?
    (["status", "--job", JOB, "--etcd-endpoints", "::1:2379"], "'::1:2379'"),
])
def test_bad_input_is_one_line_and_exit_2(args, bad):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSPMD_")}
    res = ops(*args, env=env)
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and bad in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_unreachable_etcd_and_unknown_job_exit_1(etcd_server):
    port = free_ports(1)[0]
    start = time.monotonic()
    res = ops("status", "--job", JOB, "--etcd-endpoints", f"127.0.0.1:{port}", "--timeout", "1")
    assert res.returncode == 1 and time.monotonic() - start < 20
    assert len(res.stderr.strip().splitlines()) == 1 and "etcd" in res.stderr
    res = ops("status", "--job", "nosuchjob", "--etcd-endpoints", etcd_server.endpoint_str)
    assert res.returncode == 1 and "'nosuchjob' has no keys" in res.stderr, res.stderr


def test_status_text_and_watch_json_follow_changes(etcd_server, client):
    seed(client)
    env = dict(os.environ, HSPMD_ETCD_ENDPOINTS=etcd_server.endpoint_str,
               COLUMNS="120")
    res = ops("status", "--job", JOB, env=env)
    assert res.returncode == 0, res.stderr
    for words in ("job cmdjob", "no plan published", "no leader elected", "n1", "join"):
        assert words in res.stdout
    watch = subprocess.Popen(
        [sys.executable, "-m", "launcher.ops.commands", "status", "--job", JOB, "--watch",
         "--json", "--for", "30"], stdout=subprocess.PIPE, text=True, cwd=str(REPO),
        env=env, stdin=subprocess.DEVNULL)
    try:
        first = json.loads(watch.stdout.readline())
        assert first["devices"]["counts"]["failed"] == 0
        client.put(schema.device_key(JOB, "n1", 0), schema.encode(schema.DeviceHealthRecord(
            state="failed", reason="Xid 48: double bit ECC", xid=48, slowdown=None,
            at=time.time())))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            doc = json.loads(watch.stdout.readline())
            if doc["devices"]["failed"]:
                break
        assert doc["devices"]["failed"][0]["reason"] == "Xid 48: double bit ECC"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(10) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)


def test_dashboard_only_reads_and_serves_its_routes(client):
    seed(client)
    revision = client.revision()
    with JobStateCache(client, JOB) as cache, DashboardServer(cache, port=0) as server:
        assert server.address[0] == "127.0.0.1"
        url = server.url
        page = urllib.request.urlopen(url, timeout=5).read().decode()
        # self-contained: no URL but the SVG namespace
        assert set(re.findall(r"https?://[^\"' ]+", page)) <= {"http://www.w3.org/2000/svg"}
        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=5).read())
        assert state["job"] == JOB and state["nodes"][0]["id"] == "n1"
        assert b"hspmd_devices" in urllib.request.urlopen(url + "metrics", timeout=5).read()
        for path, code in (("nope", 404),):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url + path, timeout=5)
            assert err.value.code == code
        post = urllib.request.Request(url + "api/state", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(post, timeout=5)
        assert err.value.code == 405
    assert client.revision() == revision  # nothing was written


def test_cache_follows_puts_and_deletes(client):
    seed(client)
    with JobStateCache(client, JOB) as cache:
        assert [n.id for n in cache.view().nodes] == ["n1"]
        version = cache.version
        client.delete(schema.node_key(JOB, "n1"))
        deadline = time.monotonic() + 10
        while cache.view().nodes and time.monotonic() < deadline:
            version = cache.wait_changed(version, 1.0)
        assert cache.view().nodes == []
        assert cache.view().revision == client.revision()


def test_status_wait_shows_a_switch_until_it_is_done(etcd_server, client):
    seed(client)
    plan = schema.PlanRecord(version=2, reason="failure n1:1", devices=["n1:0"], strategy={},
                             store_endpoint="h1:1", created_at=time.time())
    client.put(schema.plan_current_key(JOB), schema.encode(plan))
    append_event(client, JOB, "replan", "n1", schema.ReplanDetail(
        version=2, previous_version=1, reason="failure n1:1", device_count=1, planner="dp",
        store_endpoint="h1:1"))
    args = ("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str, "--wait")
    res = ops(*args, "--for", "1")
    assert res.returncode == 1, res
    assert "not settled: switch to plan v2: nodes done" in res.stderr.strip().splitlines()[-1]
    client.put(schema.switch_ack_key(JOB, 2, "n1"), schema.encode(schema.SwitchAckRecord(
        node="n1", plan_version=2, state="done", at=time.time())))
    append_event(client, JOB, "switch-done", "n1", schema.SwitchDoneDetail(
        plan_version=2, from_version=1, source="bsr"), timings={"total_s": 0.5})
    res = ops(*args, "--json", "--for", "20")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["switches"]["total"] == 1


def test_mounted_under_hspmd_launch():
    """The launcher's subcommand table pointed at these commands (the mount it needs)."""
    code = ("import sys; from launcher import cli; "
            "cli.SUBCOMMANDS.update(status='launcher.ops.commands:status', "
            "dashboard='launcher.ops.commands:dashboard'); "
            "sys.exit(cli.main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "status", "--job", "x/y",
                          "--etcd-endpoints", "127.0.0.1:2379"], capture_output=True, text=True,
                         timeout=30, cwd=str(REPO))
    assert res.returncode == 2 and res.stderr.startswith("hspmd-launch: error: ")
    assert "'x/y'" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_status_wait_waits_for_a_job_that_has_not_started(etcd_server, client, tmp_path):
    """``--wait`` on a job with no key yet says so in one line and waits (bounded by --for)
    for its first key instead of exiting at once; ``--for`` running out names the start."""
    args = ("status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str, "--wait")
    start = time.monotonic()
    res = ops(*args, "--for", "1.5")
    assert res.returncode == 1 and time.monotonic() - start >= 1.5, res
    assert res.stderr.strip().splitlines()[-1].endswith(
        f"job {JOB} not settled: job start: no keys under {schema.job_prefix(JOB)} yet"), \
        res.stderr
    err = tmp_path / "wait.stderr"
    with open(err, "w") as err_file:
        waiting = subprocess.Popen([sys.executable, "-m", "launcher.ops.commands", *args,
                                    "--json", "--for", "60"], stdout=subprocess.PIPE,
                                   stderr=err_file, text=True, cwd=str(REPO),
                                   stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "waiting for it to start" in err.read_text(), 30,
                 lambda: f"status --wait to say it waits; stderr: {err.read_text()}",
                 proc=waiting)
        seed(client)  # the job starts: a node joins
        out, _ = waiting.communicate(timeout=30)
        assert waiting.returncode == 0, err.read_text()
        assert [n["id"] for n in json.loads(out)["nodes"]] == ["n1"]
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait(10)
