"""``hspmd-launch inject`` restarts the job's etcd from the command line: the etcd process that
is proven to serve the job (here the rendezvous store a c10d agent runs), or the user's
``--etcd-restart-cmd``; the report says which way, or the one line why it could not. Real
processes, real signals; nothing but the job's own etcd is ever signalled."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import psutil
import pytest

from _wait import wait_for
from launch_harness import SCRIPTS, Launcher, base_env, run_launch

from hspmd_elastic.contract import schema
from hspmd_elastic.coord import append_event
from hspmd_elastic.coord.client import EtcdClient
from launcher.inject.api import NOT_INJECTED, NOT_RECOVERED, SURVIVED, NotOwnedError
from launcher.inject.command import main as inject_main
from launcher.inject.etcd_restart import find_member
from launcher.standalone import free_ports

pytestmark = pytest.mark.multiproc


def _scenario(tmp_path: Path, *faults: dict, recover_s: float = 30,
              trigger_s: float = 120) -> str:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({
        "schema": 1, "kind": "fault_scenario", "name": "etcd",
        "defaults": {"detect_timeout_s": 5, "recover_timeout_s": recover_s,
                     "trigger_timeout_s": trigger_s},
        "faults": list(faults)}))
    return str(path)


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


def _etcd_pid(port: int) -> int:
    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    assert len(pids) == 1, pids
    return pids.pop()


def test_cli_restarts_the_etcd_its_agent_serves_by_pid(tmp_path, marker):
    """A c10d job whose agent serves the store (an etcd) at the endpoint: the harness proves
    that process is the job's etcd, kills it and starts it again (then stops and resumes it);
    the job rides through both; the relaunched member ends with its agent."""
    job, port = f"cli-{uuid.uuid4().hex[:8]}", free_ports(1)[0]
    progress = tmp_path / "progress"
    progress.mkdir()
    env = base_env(marker)
    agent = Launcher(["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      "--rdzv-id", job, "--nnodes", "1:2", "--nproc-per-node", "1",
                      "--rdzv-conf", "last_call_timeout=0.5", str(SCRIPTS / "inject_ticker.py"),
                      str(progress / "ticks.jsonl"), "0.2", "40"], env, tmp_path, "agent")
    try:
        wait_for(lambda: (progress / "ticks.jsonl").exists(), 120, "the worker's first tick",
                 proc=agent.proc)
        first_pid = _etcd_pid(port)
        report = tmp_path / "report.json"
        code, out, err = run_launch(
            ["inject", "--scenario", _scenario(
                tmp_path, {"at": {"step": 3}, "fault": "etcd-restart", "down_s": 0.5},
                {"at": {"step": 6}, "fault": "etcd-restart", "how": "stop", "down_s": 0.5}),
             "--job", job, "--etcd-endpoints", f"127.0.0.1:{port}", "--progress",
             str(progress), "--report", str(report), "--log-dir", str(tmp_path / "inject")],
            env, tmp_path, 180, name="inject")
        assert code == 0, out + err
        kill, stop = _report(report)["faults"]
        assert kill["outcome"] == SURVIVED and stop["outcome"] == SURVIVED, out
        assert kill["detail"]["by"] == "pid" and kill["detail"]["pid"] == first_pid
        assert "SIGKILL" in kill["note"] and f"etcd pid {first_pid}" in kill["note"], out
        relaunched = _etcd_pid(port)
        assert relaunched != first_pid and stop["detail"]["pid"] == relaunched
        assert "SIGSTOP for 0.5s, then SIGCONT" in stop["note"]
        assert "SIGKILL, down 0.5s" in out  # the table's notes say how it was done
        assert agent.wait(120) == 0, agent.stderr()[-3000:]
        # The keeper ends the relaunched member with its owner (the agent): no orphan etcd.
        wait_for(lambda: not psutil.pid_exists(relaunched)
                 or psutil.Process(relaunched).status() == psutil.STATUS_ZOMBIE, 30,
                 "the relaunched etcd to end with its agent")
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)


def _started(etcd_server, job: str) -> None:
    """The job has a key (a node joined), as one that started has: inject acts on it."""
    with EtcdClient(etcd_server.endpoints, timeout=2.0) as client:
        append_event(client, job, "join", "n1", schema.ChangeDetail(round=0, nodes=["n1"]))


def test_cli_restarts_etcd_through_the_users_command(tmp_path, etcd_server, capsys):
    """``--etcd-restart-cmd`` runs with the target in its environment; the report says so.
    Nobody trains in this job, so the row ends ``not recovered`` (nothing went on), but the
    restart itself happened the user's way."""
    _started(etcd_server, "nobody")
    seen = tmp_path / "seen.txt"
    report = tmp_path / "report.json"
    cmd = f'echo "$HSPMD_ETCD_ENDPOINT $HSPMD_ETCD_HOW $HSPMD_ETCD_DOWN_S $HSPMD_JOB_ID" > {seen}'
    code = inject_main([
        "--scenario", _scenario(tmp_path, {"fault": "etcd-restart", "down_s": 2},
                                recover_s=0.2),
        "--job", "nobody", "--etcd-endpoints", etcd_server.endpoint_str,
        "--etcd-restart-cmd", cmd, "--report", str(report)])
    assert code == 1
    row = _report(report)["faults"][0]
    assert row["outcome"] == NOT_RECOVERED and row["injected_at"] is not None
    assert row["detail"]["by"] == "command" and "--etcd-restart-cmd ran in" in row["note"]
    assert seen.read_text().split() == [etcd_server.endpoints[0], "kill", "2", "nobody"]


@pytest.mark.parametrize("cmd, timeout, why", [
    ("echo broken >&2; exit 3", "10", "exited with code 3 (broken)"),
    ("sleep 30", "0.5", "did not finish within 0.5s (killed)"),
])
def test_a_failing_restart_command_is_one_line_in_the_report(tmp_path, etcd_server, cmd,
                                                              timeout, why):
    report = tmp_path / "report.json"
    _started(etcd_server, "nobody")
    code = inject_main([
        "--scenario", _scenario(tmp_path, {"fault": "etcd-restart"}), "--job", "nobody",
        "--etcd-endpoints", etcd_server.endpoint_str, "--etcd-restart-cmd", cmd,
        "--etcd-restart-timeout", timeout, "--report", str(report)])
    assert code == 1
    row = _report(report)["faults"][0]
    assert row["outcome"] == NOT_INJECTED and why in row["note"], row["note"]
    assert "\n" not in row["note"]


def test_an_unknown_job_is_refused_at_once_and_its_etcd_never_signalled(tmp_path, etcd_server,
                                                                         capfd):
    """``--job`` with no key in etcd (a typo): one line at once, as ``status`` says it, before
    any fault waits for its trigger; and an etcd that holds no key of the job is not provably
    the job's etcd, so the restart fault would leave it alone, saying why."""
    _started(etcd_server, "myjob")
    pid = etcd_server.members[0].proc.pid
    report = tmp_path / "report.json"
    start = time.monotonic()
    code = inject_main([
        "--scenario", _scenario(tmp_path, {"at": {"step": 3}, "fault": "etcd-restart"},
                                {"at": {"step": 5}, "fault": "kill-worker",
                                 "target": {"node": "n1", "local_rank": 0}}, trigger_s=10),
        "--job", "myjbo", "--etcd-endpoints", etcd_server.endpoint_str,
        "--report", str(report)])
    took = time.monotonic() - start
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert code == 1 and took < 15, (code, took, err)
    assert len(err) == 1 and "job 'myjbo' has no keys under" in err[0], err
    assert not report.exists()
    with pytest.raises(NotOwnedError, match="holds no key of job myjbo"):
        find_member(etcd_server.endpoints[0], "myjbo")
    assert etcd_server.members[0].proc.pid == pid and etcd_server.members[0].running
    with EtcdClient(etcd_server.endpoints, timeout=2.0) as client:
        client.revision()


def test_a_listener_that_is_not_etcd_is_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(NotOwnedError, match="not etcd"):
            find_member(f"127.0.0.1:{port}", "any-job")
    with pytest.raises(NotOwnedError, match="no process listening"):
        find_member(f"127.0.0.1:{port}", "any-job")
    with pytest.raises(NotOwnedError, match="not on this host"):
        find_member("192.0.2.1:2379", "any-job")


def test_the_inject_cli_help_names_the_restart_command(tmp_path):
    code, out, _ = run_launch(["inject", "--help"], base_env("help"), tmp_path, 60,
                              name="inject-help")
    assert code == 0 and "--etcd-restart-cmd" in out and "--etcd-restart-timeout" in out
