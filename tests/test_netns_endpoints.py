"""How nodes name etcd and themselves, in network namespaces the tests make.

IPv6: an etcd endpoint is ``[::1]:2379`` (``http(s)://`` too) wherever one is taken; a bare
``::1:2379`` is ambiguous and one line. In a private namespace, an etcd process listens on
``[::1]:2379`` only, and a restart-mode job runs on it while ``status``, ``inject`` (a worker
killed, then the job's etcd restarted by pid) and the dashboard's ``/metrics`` reach it there; a
c10d agent serves its own etcd at ``[::1]`` (the embedded etcd's URLs) and its worker gets the
bracketed endpoint.

The advertised address: a node of a job that may span hosts, without ``--local-addr``, on a host
whose name resolves to loopback (``/etc/hosts`` says so), advertises the address of the
interface that reaches etcd, not ``localhost``, and says so in one line.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from pathlib import Path

import pytest

from _netns import NsProcess, Topology
from _wait import wait_for
from launch_harness import SCRIPTS, base_env, read_json_files

from hspmd_elastic.coord.client import EtcdClient, parse_endpoints
from launcher.inject.api import RECOVERED, SURVIVED
from launcher.standalone import EtcdMember

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

V6_PORT, V6_PEER, C10D_PORT = 2379, 2380, 29400  # a fresh namespace: every port is free


# ------------------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("spec, parsed, formatted", [
    ("[::1]:2379", [("::1", 2379)], ["[::1]:2379"]),
    ("http://[::1]:2379", [("::1", 2379)], ["[::1]:2379"]),
    ("https://[fd00::7]:2379,h:1", [("fd00::7", 2379), ("h", 1)], ["[fd00::7]:2379", "h:1"]),
    ("127.0.0.1:2379", [("127.0.0.1", 2379)], ["127.0.0.1:2379"]),
])
def test_bracketed_ipv6_endpoints_are_parsed_and_kept_bracketed(spec, parsed, formatted):
    from hspmd_elastic.coord.client import format_endpoint
    from launcher.cli import _endpoints

    assert parse_endpoints(spec) == parsed
    assert [format_endpoint(h, p) for h, p in parsed] == formatted
    assert list(_endpoints(spec, "--rdzv-endpoint")) == formatted
    with EtcdClient(spec) as client:  # nothing is sent: only the channels' targets are made
        assert client.endpoints == formatted
        assert client.current_endpoint in formatted


@pytest.mark.parametrize("spec, why", [
    ("::1:2379", "an IPv6 address needs brackets"),
    ("[::1]", "expected host:port"),
    ("[::1:2379", "expected [ipv6-address]:port"),
])
def test_an_unbracketed_or_broken_ipv6_endpoint_is_one_line(spec, why):
    from launcher.api import ConfigError
    from launcher.cli import _endpoints

    with pytest.raises(ValueError, match=re.escape(why)) as err:
        parse_endpoints(spec)
    assert repr(spec) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(f"--rdzv-endpoint value {spec!r}")):
        _endpoints(spec, "--rdzv-endpoint")


def test_the_advertised_address_is_picked_only_where_the_host_name_is_loopback(caplog):
    from launcher.node.addresses import advertised_address

    toward = {("10.0.0.1", 2379): "10.0.0.5", ("127.0.0.1", 2379): "127.0.0.1"}.get

    def pick(local, etcd=("10.0.0.1", 2379), nodes=2, standalone=False, loop=True):
        return advertised_address(local, "box", nodes, standalone, etcd,
                                  toward=lambda h, p: toward((h, p)), loopback=lambda _: loop)

    with caplog.at_level(logging.INFO, logger="launcher.node.addresses"):
        assert pick(None) == "10.0.0.5"
        assert "host name box resolves to loopback: advertising 10.0.0.5" in caplog.text
        caplog.clear()
        assert pick("10.9.9.9") == "10.9.9.9"  # --local-addr wins
        assert pick(None, nodes=1) is None and pick(None, standalone=True) is None
        assert pick(None, loop=False) is None  # the name reaches others: kept
        assert pick(None, etcd=("127.0.0.1", 2379)) is None  # etcd on loopback: one host
        assert not caplog.records
        assert pick(None, etcd=("192.0.2.1", 2379)) is None  # no route: one warning
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "give --local-addr" in warned[0].getMessage()


# ------------------------------------------------------------------------- in namespaces
def _start(topo: Topology, node: str, argv: list[str], env: dict, name: str) -> NsProcess:
    return topo.spawn(node, argv, env, name)


def _finish(proc: NsProcess, timeout: float) -> str:
    code = proc.wait(timeout)
    assert code == 0, f"{proc.name} exited {code}:\n{proc.stderr()[-4000:]}"
    return proc.stdout()


def _python(code: str) -> list[str]:
    import sys

    return [sys.executable, "-c", code]


def test_ipv6_loopback_etcd_serves_a_job_status_inject_and_the_dashboard(marker, netns,
                                                                         tmp_path):
    topo = netns(nodes=("v6",), etcd_members=0)  # torn down (etcd killed) before marker's check
    ep, c10d = f"[::1]:{V6_PORT}", f"[::1]:{C10D_PORT}"
    env = base_env(marker)
    member = EtcdMember("v6", V6_PORT, V6_PEER, str(tmp_path / "etcd" / "v6.etcd"), host="::1")
    (tmp_path / "etcd").mkdir()
    _start(topo, "v6", member.command(), env, "etcd")
    assert f"http://{ep}" in member.command()  # listens (and advertises) on [::1] only
    # one call of the client, retried within its deadline until etcd answers at [::1]
    _finish(_start(topo, "v6", _python(
        f"from hspmd_elastic.coord.client import EtcdClient\n"
        f"EtcdClient({ep!r}, timeout=20).revision()"), env, "probe"), 40)

    job, progress, dump = f"v6-{uuid.uuid4().hex[:6]}", tmp_path / "progress", tmp_path / "dump"
    dump.mkdir()
    train = [str(SCRIPTS / "inject_train.py"), "--steps", "16", "--batch", "4", "--snapshot",
             str(tmp_path / "snap.pt"), "--progress-dir", str(progress), "--step-sleep", "0.25"]
    agent = topo.launch("v6", ["--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--rdzv-id", job,
                               "--hspmd-node-id", "v6", "--nnodes", "1", "--max-restarts", "2",
                               "--shutdown-timeout", "5", *train], env, "agent")
    served = topo.launch("v6", ["--rdzv-backend", "c10d", "--rdzv-endpoint", c10d, "--rdzv-id",
                                f"c-{job}", "--nnodes", "1:2", "--rdzv-conf",
                                "last_call_timeout=0.2", str(SCRIPTS / "env_dump.py")],
                         dict(env, DUMP_DIR=str(dump)), "c10d")
    wait_for(lambda: list(progress.glob("rank0.jsonl")), 60, "the job's first step",
             proc=agent.proc)
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({
        "schema": 1, "kind": "fault_scenario", "name": "v6",
        "defaults": {"detect_timeout_s": 20, "recover_timeout_s": 40, "trigger_timeout_s": 40},
        "faults": [{"at": {"step": 2}, "fault": "kill-worker",
                    "target": {"node": "v6", "local_rank": 0}},
                   {"at": {"step": 6}, "fault": "etcd-restart", "how": "stop",
                    "down_s": 0.3}]}))
    report = tmp_path / "report.json"
    inject = topo.launch("v6", ["inject", "--scenario", str(scenario), "--job", job,
                                "--etcd-endpoints", ep, "--progress", str(progress),
                                "--report", str(report)], env, "inject")
    doc = json.loads(_finish(topo.launch("v6", ["status", "--job", job, "--etcd-endpoints", ep,
                                                "--json"], env, "status"), 60))
    assert [n["id"] for n in doc["nodes"]] == ["v6"], doc
    dashboard = topo.launch("v6", ["dashboard", "--job", job, "--etcd-endpoints", ep,
                                   "--port", "0"], env, "dashboard")
    url = wait_for(lambda: re.search(r"at (http://\S+/) ", dashboard.stdout()), 60,
                   "the dashboard's URL", proc=dashboard.proc).group(1)
    metrics = _finish(_start(topo, "v6", _python(
        f"import urllib.request\nprint(urllib.request.urlopen({url + 'metrics'!r}, "
        f"timeout=10).read().decode())"), env, "metrics"), 30)
    assert f'job="{job}"' in metrics and "hspmd_devices" in metrics, metrics[:2000]
    dashboard.proc.send_signal(2)
    assert dashboard.wait(20) == 0, dashboard.stderr()
    _finish(inject, 120)
    _finish(agent, 60)
    rows = {r["fault"]: r for r in json.loads(report.read_text())["faults"]}
    assert rows["kill-worker"]["outcome"] == RECOVERED, rows
    assert rows["etcd-restart"]["outcome"] == SURVIVED, rows
    assert rows["etcd-restart"]["detail"]["by"] == "pid", rows  # found on [::1] by its port
    _finish(served, 60)
    dumped = read_json_files(dump, "round0_rank*.json")
    assert [d["env"]["HSPMD_ETCD_ENDPOINTS"] for d in dumped.values()] == [c10d], dumped
    assert f"serving the rendezvous store (etcd) at {c10d}" in served.stderr()


def test_a_multi_node_job_without_local_addr_advertises_the_address_that_reaches_etcd(
        marker, netns, tmp_path):
    """The host name resolves to loopback in the node's namespace (its ``/etc/hosts``, as a
    stock one does); the job may span hosts (``--nnodes 1:2``) and no ``--local-addr`` is
    given: ``MASTER_ADDR`` and the node's record name the node's control address (the one
    that reaches etcd), never ``localhost``."""
    topo = netns(nodes=("node-a",), etcd_members=1)
    node = topo.nodes["node-a"]
    hosts = Path("/etc/netns") / node.netns / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")  # the trap, for sure
    dump = tmp_path / "dump"
    dump.mkdir()
    job = f"adv-{uuid.uuid4().hex[:6]}"
    agent = topo.launch("node-a", ["--rdzv-backend", "etcd", "--rdzv-endpoint",
                                   topo.endpoint_str, "--rdzv-id", job, "--hspmd-node-id",
                                   "node-a", "--nnodes", "1:2", "--rdzv-conf",
                                   "last_call_timeout=0.2", str(SCRIPTS / "env_dump.py")],
                        base_env(marker, DUMP_DIR=str(dump)), "agent")
    _finish(agent, 90)
    (dumped,) = read_json_files(dump, "round0_rank*.json").values()
    assert dumped["env"]["MASTER_ADDR"] == node.control_addr, dumped["env"]
    assert dumped["pg_world"] == 1 and dumped["all_reduce"] == 0.0  # gloo up on that address
    line = [ln for ln in agent.stderr().splitlines() if "resolves to loopback" in ln]
    assert len(line) == 1 and f"advertising {node.control_addr}" in line[0], agent.stderr()
