"""One live agent per node id, one mode per job (``launcher.node.claim``): a misconfigured
newcomer is refused in one line, and the job that runs never loses.

Real etcd, real ``hspmd-launch`` agents and workers, real signals.
"""

from __future__ import annotations

import re
import signal
import uuid

import pytest

from launch_harness import SCRIPTS, Launcher, base_env, pid_alive
from _elastic_job import ElasticLaunchJob
from _wait import wait_for

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient

pytestmark = pytest.mark.multiproc


def restart_args(etcd, job: str, node: str, nnodes: str, *extra: str, ttl: str = "2"
                 ) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
            "--rdzv-conf", "last_call_timeout=0.5,join_timeout=300", "--hspmd-lease-ttl", ttl,
            "--shutdown-timeout", "5", *extra, str(SCRIPTS / "sleeper.py")]


def _sleeping(tmp_path, marker, etcd, job: str, node: str, nnodes: str, name: str,
              ttl: str = "2"):
    """A restart-mode agent whose one worker sleeps; (launcher, worker pid)."""
    pids = tmp_path / f"pids-{name}"
    pids.mkdir()
    agent = Launcher(restart_args(etcd, job, node, nnodes, ttl=ttl),
                     base_env(marker, PID_DIR=str(pids)), tmp_path, name)
    pid = int(wait_for(lambda: (pids / "0.pids").exists() and (pids / "0.pids").read_text(),
                       60, f"{name}'s worker", proc=agent.proc))
    return agent, pid


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("hspmd-launch: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("nnodes", ["1:2", "2"])
def test_a_second_agent_with_a_held_node_id_fails_in_one_line(tmp_path, marker, etcd_server,
                                                              nnodes):
    job = f"dup-{uuid.uuid4().hex[:8]}"
    if nnodes == "1:2":
        first, worker = _sleeping(tmp_path, marker, etcd_server, job, "node-a", nnodes, "a")
    else:  # the first waits for a second node that never comes under another id
        first = Launcher(restart_args(etcd_server, job, "node-a", nnodes),
                         base_env(marker, PID_DIR=str(tmp_path)), tmp_path, "a")
        with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
            wait_for(lambda: client.get(schema.claim_key(job, "node-a")), 60,
                     "node-a's claim", proc=first.proc)
        worker = None
    second = Launcher(restart_args(etcd_server, job, "node-a", nnodes),
                      base_env(marker, PID_DIR=str(tmp_path)), tmp_path, "b")
    assert second.wait(60) == 1, second.stderr()
    line = _one_error_line(second.stderr())
    assert re.search(rf"node id 'node-a' of job '{job}' is held by a live agent "
                     rf"\(host \S+, pid {first.proc.pid}\)", line), line
    assert first.proc.poll() is None  # the running agent is untouched
    if worker is not None:
        assert pid_alive(worker)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(30) == 1


def test_a_sigkilled_agents_claim_on_this_host_is_taken_over_at_once(tmp_path, marker,
                                                                     etcd_server, client):
    """The dead agent's claim is under a lease that outlives the test (an hour): only a
    takeover (the newcomer revoking that lease) can give the node id to the newcomer."""
    job = f"dup-{uuid.uuid4().hex[:8]}"
    key = schema.claim_key(job, "node-a")
    first, worker = _sleeping(tmp_path, marker, etcd_server, job, "node-a", "1", "a",
                              ttl="3600")
    held = client.get(key)
    assert schema.decode(key, held.value).pid == first.proc.pid and held.lease
    first.proc.send_signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(worker), 20, "the killed agent's worker to die")
    assert client.lease_ttl(held.lease) > 0  # the dead agent's claim still stands
    again, again_worker = _sleeping(tmp_path, marker, etcd_server, job, "node-a", "1", "again")
    taken = client.get(key)
    claim = schema.decode(key, taken.value)
    assert (claim.pid, claim.host, claim.mode) == (again.proc.pid, schema.decode(
        key, held.value).host, "restart"), claim
    assert taken.create_revision > held.mod_revision and taken.lease not in (0, held.lease)
    assert client.lease_ttl(held.lease) == -1  # revoked by the newcomer, not expired
    assert "left from a dead agent; taking it over" in again.stderr()
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(30) == 1, again.stderr()
    assert not pid_alive(again_worker)


def test_a_restart_mode_agent_cannot_take_down_a_running_elastic_job(tmp_path, marker,
                                                                     etcd_server):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="mixed") as job:
        job.start("na", 2, nnodes="1:2")
        pids = job.wait_paused(["na:0", "na:1"])
        newcomer = Launcher(restart_args(etcd_server, job.name, "nb", "1:2"),
                            base_env(marker, PID_DIR=str(tmp_path), EXIT_NOW="1"), tmp_path,
                            "nb")
        assert newcomer.wait(60) == 1, newcomer.stderr()
        line = _one_error_line(newcomer.stderr())
        assert f"job '{job.name}' runs in elastic mode (node na on host " in line, line
        assert "this agent runs in restart mode" in line and "--hspmd-elastic" in line, line
        assert not list(tmp_path.glob("*.pids"))  # its script never ran
        job.release.touch()
        job.finish(60)
        results = job.results()
        assert {d: r["pid"] for d, r in results.items()} == pids
        job.assert_replicas_match_reference(results)


def test_an_elastic_agent_cannot_take_down_a_running_restart_mode_job(tmp_path, marker,
                                                                       etcd_server):
    job = f"mixed-{uuid.uuid4().hex[:8]}"
    first, worker = _sleeping(tmp_path, marker, etcd_server, job, "na", "1:2", "a")
    (tmp_path / "el").mkdir()
    with ElasticLaunchJob(etcd_server, tmp_path / "el", marker, name=job) as el:
        newcomer = el.start("nb", 1, nnodes="1:2")
        assert newcomer.wait(60) == 1, newcomer.stderr()
        line = _one_error_line(newcomer.stderr())
        assert f"job '{job}' runs in restart mode (node na on host " in line, line
        assert "this agent runs in elastic mode" in line, line
    assert first.proc.poll() is None and pid_alive(worker)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(30) == 1
