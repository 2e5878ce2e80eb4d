"""etcd over TLS with client-certificate auth and RBAC (docs/security.md), end to end.

A real etcd serves TLS only and asks every client for a certificate signed by the test CA
(``--client-cert-auth``); authentication is on, with a job user (readwrite on the job's
prefix) and a read-only viewer (tests/_security.py). Checked here:

* a two-agent elastic job whose worker is SIGKILLed recovers in memory and ends with the
  reference's parameters, every agent and worker reaching etcd over TLS as the job user, the
  password never on a command line (the suite's shared worker-kill run,
  ``_elastic_job.worker_kill_run``, runs over TLS for this);
* every tool (the launcher, status, dashboard, inject) refuses to run without a client
  certificate, with a certificate etcd does not trust, or with a wrong password: one line,
  non-zero exit, no traceback; a bad flag value is a usage error naming the flag;
* the viewer runs status and the dashboard, and a write or an agent under it is denied;
* the client fetches a new token after an etcd restart (calls, a watch and a lease go on);
* the etcd an agent runs itself listens on loopback (or the address it was given), never on
  a wildcard address, and can serve TLS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import psutil
import pytest

from _elastic_job import KILL_VICTIM, shared_worker_kill_run
from _security import PASSWORDS, Pki, SecureEtcd, clean_env
from _wait import wait_for
from launch_harness import LAUNCH, REPO

from hspmd_elastic.coord import LeasedSession, PrefixWatch, append_event
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import EtcdAuthError
from hspmd_elastic.coord.client import EtcdClient
from launcher.cli import main as cli_main
from launcher.standalone import AgentEtcd, EtcdStartError, bind_addresses, free_ports

pytestmark = [pytest.mark.timeout(120)]

JOB = "sec-job"
SCENARIO = str(REPO / "examples" / "scenarios" / "node-loss.json")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure(tmp_path, pki):
    etcd = SecureEtcd(tmp_path, pki, JOB)
    yield etcd
    etcd.stop()


def _one_line_failure(code: int, err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _run_tool(capfd, monkeypatch, env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    """``hspmd-launch <argv>`` in this process, with exactly ``env``'s HSPMD_ETCD_* settings."""
    for name in [k for k in os.environ if k.startswith("HSPMD_ETCD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capfd.readouterr()
    code = cli_main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def _launcher(tmp: Path, name: str, env: dict[str, str], endpoint: str) -> subprocess.Popen:
    """A restart-mode agent of JOB (its script: ``true``) on ``endpoint``, output in files."""
    args = [LAUNCH, "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", JOB, "--no-python", "true"]
    return subprocess.Popen(args, env=clean_env(OMP_NUM_THREADS="1", **env),
                            stdout=open(tmp / f"{name}.out", "wb"),
                            stderr=open(tmp / f"{name}.err", "wb"), stdin=subprocess.DEVNULL,
                            cwd=str(REPO), start_new_session=True)


def _finished(proc: subprocess.Popen, tmp: Path, name: str, timeout: float = 60.0):
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    return code, (tmp / f"{name}.err").read_text(errors="replace")


# ------------------------------------------------------------------------------ the job
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The suite's one worker-kill run (``tests/_elastic_job.py``): its etcd serves TLS only,
    with client certificates and RBAC; read here for what the job's processes used."""
    return shared_worker_kill_run(tmp_path_factory)


@pytest.mark.multiproc
@pytest.mark.timeout(180)  # it may start the shared run (30-60 s on two busy cores)
def test_elastic_job_with_a_worker_kill_over_tls_and_auth(killed):
    """The shared run: 2 agents (3 + 2 workers) as the job user (TLS, client certificate,
    password from a file, RBAC on the job's prefix only); node-b:1 SIGKILLed at the pause
    step; the survivors switch in memory and match the reference."""
    run = killed.checked()
    assert run.cmdlines, "no process of the job seen at the pause"
    for cmdline in run.cmdlines:  # the password is on no command line
        assert not any(PASSWORDS["job"] in arg for arg in cmdline), cmdline
    assert run.worker_etcd_env["HSPMD_ETCD_USER"] == "job"
    assert run.worker_etcd_env["HSPMD_ETCD_PASSWORD_FILE"] == run.password_file
    results = run.assert_recovered(run.survivors())
    assert results["node-a:0"]["plan_version"] >= 2, results["node-a:0"]["switches"]
    failure = next(e for e in run.events() if e.type == "failure")
    assert schema.event_detail(failure).devices == [KILL_VICTIM]


# ------------------------------------------------------------------------------ refusals
def test_every_tool_refuses_a_missing_or_untrusted_certificate_and_a_wrong_password(
        secure, tmp_path, capfd, monkeypatch):
    with EtcdClient(secure.endpoint, security=secure.pki.security("job")) as client:
        append_event(client, JOB, "join", "n0", schema.ChangeDetail())  # a job for status
    cases = {
        "no-cert": (secure.env("job", cert=None), "TLS handshake", "none was given"),
        "rogue-cert": (secure.env("job", cert="rogue"), "TLS handshake",
                       "refused the client certificate"),
        "wrong-password": (secure.env("job", password="not-it"), "wrong user name or password",
                           "'job'"),
    }
    agents = {name: _launcher(tmp_path, name, env, secure.endpoint)
              for name, (env, _, _) in cases.items()}
    ep = ["--etcd-endpoints", secure.endpoint]
    tools = {
        "status": ["status", "--job", JOB, *ep, "--json"],
        "dashboard": ["dashboard", "--job", JOB, *ep, "--port", "0"],
        "inject": ["inject", "--job", JOB, *ep, "--scenario", SCENARIO],
    }
    for name, (env, needle, detail) in cases.items():
        for tool, argv in tools.items():
            code, _, err = _run_tool(capfd, monkeypatch, env, *argv)
            line = _one_line_failure(code, err, "hspmd-launch", needle, detail)
            assert code == 1, (tool, name, line)
    for name, (_, needle, detail) in cases.items():
        code, err = _finished(agents[name], tmp_path, name)
        line = _one_line_failure(code, err, "hspmd-launch: error:", needle, detail)
        assert code == 1, line
    # a plain client (no CA): the hint says why etcd hangs up
    code, _, err = _run_tool(capfd, monkeypatch, {}, "status", "--job", JOB, *ep,
                             "--timeout", "0.5")
    _one_line_failure(code, err, "https://")


def test_bad_security_flags_are_usage_errors_naming_the_flag(tmp_path, capfd, monkeypatch):
    script = str(tmp_path / "train.py")
    Path(script).write_text("")
    missing = str(tmp_path / "missing.pem")
    not_pem = str(tmp_path / "not.pem")
    Path(not_pem).write_text("hello\n")
    checks = [
        (["status", "--job", "j", "--etcd-endpoints", "127.0.0.1:1", "--etcd-cacert", missing],
         f"--etcd-cacert {missing!r}: No such file"),
        (["inject", "--job", "j", "--etcd-endpoints", "127.0.0.1:1", "--scenario", SCENARIO,
          "--etcd-cert", not_pem, "--etcd-key", not_pem], f"--etcd-key {not_pem!r}: not a PEM"),
        (["dashboard", "--job", "j", "--etcd-endpoints", "127.0.0.1:1", "--etcd-user", "u"],
         "--etcd-user 'u' needs a password: set HSPMD_ETCD_PASSWORD or give "
         "--etcd-password-file"),
        (["--hspmd-etcd-cacert", missing, script], f"--hspmd-etcd-cacert {missing!r}"),
        (["--hspmd-etcd-cert", not_pem, script], "--hspmd-etcd-cert"),
        (["--hspmd-etcd-user", "u", "--hspmd-etcd-password-file", missing, script],
         f"--hspmd-etcd-password-file {missing!r}: No such file"),
        (["--hspmd-etcd-server-cert", not_pem, "--hspmd-etcd-server-key", not_pem, "--nnodes",
          "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1", script],
         "only used when the agent runs etcd itself"),
    ]
    for argv, needle in checks:
        code, _, err = _run_tool(capfd, monkeypatch, {}, *argv)
        _one_line_failure(code, err, needle)
        assert code == 2, err


# ------------------------------------------------------------------------------ read-only
def test_the_read_only_role_runs_status_and_the_dashboard_but_cannot_write(
        secure, tmp_path, capfd, monkeypatch):
    with EtcdClient(secure.endpoint, security=secure.pki.security("job")) as client:
        append_event(client, JOB, "join", "n0", schema.ChangeDetail())
    viewer = secure.env("viewer")
    agent = _launcher(tmp_path, "viewer-agent", viewer, secure.endpoint)
    dash = subprocess.Popen(
        [sys.executable, "-m", "launcher.ops.commands", "dashboard", "--job", JOB,
         "--etcd-endpoints", secure.endpoint, "--port", "0"], env=clean_env(**viewer),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        line = _readline(dash, timeout=60.0)
        assert "serving job sec-job at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url + "api/state", timeout=10) as resp:
            state = json.loads(resp.read())
        assert state["job"] == JOB and state["events"]["total"] == 1, state
    finally:
        dash.send_signal(signal.SIGTERM)
        dash.communicate(timeout=30)
    code, out, err = _run_tool(capfd, monkeypatch, viewer, "status", "--job", JOB,
                               "--etcd-endpoints", secure.endpoint, "--json")
    assert code == 0, err
    assert json.loads(out)["job"] == JOB
    with EtcdClient(secure.endpoint, security=secure.pki.security("viewer")) as client:
        assert client.get_prefix(schema.job_prefix(JOB))
        with pytest.raises(EtcdAuthError, match="'viewer' has no permission"):
            client.put(schema.event_seq_key(JOB), "1")
    code, err = _finished(agent, tmp_path, "viewer-agent")
    _one_line_failure(code, err, "hspmd-launch: error:", "'viewer' has no permission")


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        proc.kill()
        raise AssertionError(f"no line within {timeout}s; stderr: {proc.communicate()[1]}")
    return got[0]


# ------------------------------------------------------------------------------ tokens
def test_calls_watches_and_leases_go_on_with_a_new_token_after_an_etcd_restart(secure, pki):
    client = EtcdClient(secure.endpoint, timeout=10.0, security=pki.security("job"))
    seen: list[str] = []
    prefix = schema.job_prefix(JOB)
    watch = PrefixWatch(client, prefix, lambda ev: seen.append(ev.key), progress_s=0.5).start()
    session = LeasedSession(client, ttl=5)
    try:
        session.put(prefix + "nodes/n0", "{}")
        client.put(prefix + "before", "1")
        stale = client._auth.current
        secure.member.stop()
        secure.member.launch()
        secure.member.wait_healthy()
        client.put(prefix + "after", "1")  # the old token is unknown now: a new one is fetched
        assert client._auth.current not in (None, stale)
        wait_for(lambda: prefix + "after" in seen, 20, "the watch to see the write after")
        assert client.get(prefix + "nodes/n0") is not None  # the session's lease lived on
        with pytest.raises(EtcdAuthError, match="no permission"):
            client.get(schema.job_prefix("another-job") + "x")
    finally:
        session.stop(revoke=True, timeout=5)
        watch.stop()
        client.close()


# ------------------------------------------------------------------------------ exposure
def _listening(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_an_agents_own_etcd_listens_on_loopback_or_the_given_address_never_a_wildcard(pki):
    embedded = AgentEtcd()  # --standalone
    try:
        assert embedded.start()
        assert _listening(embedded.member.proc.pid) == {"127.0.0.1"}
        assert "0.0.0.0" not in " ".join(embedded.member.command())
    finally:
        embedded.stop()
    # the c10d/static store at a fixed port: the addresses its host names only, here over TLS
    port = free_ports(1)[0]
    store = AgentEtcd("localhost", port, tls=pki.server_tls())
    try:
        assert store.start()
        assert "127.0.0.1" in _listening(store.member.proc.pid) <= {"127.0.0.1", "::1"}
        assert store.member.client_url.startswith("https://")
        with EtcdClient(f"127.0.0.1:{port}", security=pki.security()) as client:
            assert client.revision(prefix=schema.job_prefix(JOB)) >= 1
        with EtcdClient(f"127.0.0.1:{port}", security=pki.security(cert=None)) as client:
            with pytest.raises(EtcdAuthError, match="client certificate"):
                client.revision()
    finally:
        store.stop()
    with pytest.raises(EtcdStartError, match="not an address of this node"):
        bind_addresses("192.0.2.1")
    assert bind_addresses("127.0.0.1") == ("127.0.0.1",)


def test_standalone_serves_its_embedded_etcd_over_tls_with_client_certificates(pki, tmp_path):
    """``--standalone`` with a server certificate: the agent reaches its own etcd over TLS with
    its client certificate, and the job runs."""
    env = clean_env(OMP_NUM_THREADS="1", HSPMD_ETCD_SERVER_CERT=pki.path("server.crt"),
                    HSPMD_ETCD_SERVER_KEY=pki.path("server.key"))
    args = ["--standalone", "--hspmd-etcd-cacert", pki.path("ca.crt"), "--hspmd-etcd-cert",
            pki.path("client.crt"), "--hspmd-etcd-key", pki.path("client.key"),
            "--no-python", "true"]
    done = subprocess.run([LAUNCH, *args], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    assert "serving etcd at 127.0.0.1:" in done.stderr and "(https on 127.0.0.1)" in done.stderr
