"""The two ways ``etcd-restart`` reaches an etcd the harness did not start itself.

* **a user command** (``hspmd-launch inject --etcd-restart-cmd CMD``): ``/bin/sh -c CMD`` in its
  own session, with ``HSPMD_ETCD_ENDPOINT`` (the target member), ``HSPMD_ETCD_ENDPOINTS``,
  ``HSPMD_ETCD_MEMBER``, ``HSPMD_ETCD_HOW``, ``HSPMD_ETCD_DOWN_S`` and ``HSPMD_JOB_ID`` in its
  environment; killed (its whole process group) past ``timeout_s``; a non-zero exit is a failed
  injection naming the code and the command's last output line;
* **a member found by pid** (``find_member``): a process is signalled only once it is *proven*
  to be the job's etcd: the endpoint's host is this machine, exactly one process listens on
  the endpoint's port (on the endpoint's address or a wildcard one), that process is an
  ``etcd`` binary, and a client connected to that one endpoint (with the ``HSPMD_ETCD_*`` TLS
  and auth settings) reads the job's keys. ``how: stop`` is SIGSTOP for ``down_s`` then SIGCONT (the
  process keeps its parent); ``how: kill`` is SIGKILL, then the same command line (same data
  directory, working directory and environment) started again under a small keeper that stops
  it when the original parent exits, so the relaunched member ends with its owner (an agent's
  embedded etcd ends with the agent) and no orphan is left.

Every wait is bounded; every refusal is an ``InjectError`` whose message is the one line the
report shows.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

import psutil

from hspmd_elastic.coord.api import CoordinationError, EtcdAuthError
from hspmd_elastic.coord.client import EtcdClient, parse_endpoints
from hspmd_elastic.contract.schema import job_prefix
from hspmd_elastic.coord.security import EtcdSecurity, EtcdSecurityError
from launcher.inject.api import InjectError, NotOwnedError, TargetNotFound
from launcher.node.addresses import is_local_address

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0
PROBE_TIMEOUT_S = 5.0
KILL_WAIT_S = 5.0
DEFAULT_COMMAND_TIMEOUT_S = 60.0
_WILDCARD = ("0.0.0.0", "::", "")

# Runs the relaunched member and stops it (TERM, then KILL) once the original owner is gone,
# once the keeper itself is told to stop, or never returns while both live.
_KEEPER = r'''
import json, os, signal, subprocess, sys, time
import psutil
spec = json.loads(sys.argv[1])
log = open(spec["log"], "ab")
child = subprocess.Popen(spec["argv"], cwd=spec["cwd"], env=spec["env"], stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
def owner_alive():
    try:
        p = psutil.Process(spec["owner"])
        return abs(p.create_time() - spec["owner_created"]) < 0.5 and \
            p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
while child.poll() is None and not stop and owner_alive():
    time.sleep(0.2)
if child.poll() is None:
    child.terminate()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=5)
'''


@dataclass(frozen=True)
class FoundMember:
    """An etcd process proven to serve the job at ``endpoint`` (see the module docstring)."""

    endpoint: str
    pid: int
    created: float
    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    owner: int
    owner_created: float

    def describe(self) -> str:
        return f"etcd pid {self.pid} listening on {self.endpoint}"


def target_endpoint(endpoints: list[str], member: Any) -> str:
    """The endpoint a scenario's ``member`` (index, or ``host:port``) names; the first one by
    default."""
    if member is None:
        return endpoints[0]
    if isinstance(member, int) and not isinstance(member, bool):
        if 0 <= member < len(endpoints):
            return endpoints[member]
    elif str(member) in endpoints:
        return str(member)
    raise TargetNotFound(f"etcd member {member!r} is not one of the job's endpoints "
                         f"({', '.join(endpoints)}; use an index or host:port)")


def _local_ips(host: str) -> Optional[set[str]]:
    if not is_local_address(host):
        return None

    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None


def _listeners(port: int, ips: set[str]) -> set[Optional[int]]:
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError) as exc:
        raise NotOwnedError(f"cannot list listening sockets on this host ({exc})") from exc
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr
            and c.laddr.port == port and (c.laddr.ip in ips or c.laddr.ip in _WILDCARD)}


def _serves_job(endpoint: str, job: str, security: Optional[EtcdSecurity]) -> bool:
    try:
        security = EtcdSecurity.from_env().checked() if security is None else security
        with EtcdClient(parse_endpoints(endpoint), timeout=PROBE_TIMEOUT_S,
                        security=security) as client:
            return bool(client.get_prefix(job_prefix(job)))
    except (CoordinationError, EtcdSecurityError):
        return False


def find_member(endpoint: str, job: str,
                security: Optional[EtcdSecurity] = None) -> FoundMember:
    """The etcd process that serves ``job`` at ``endpoint``, or ``NotOwnedError`` naming which
    proof failed (nothing is signalled here). ``security``: how to reach it (default: from
    ``HSPMD_ETCD_*``)."""
    host, port = parse_endpoints(endpoint)[0]  # [::1]:2379 -> ("::1", 2379)
    ips = _local_ips(host)
    if ips is None:
        raise NotOwnedError(f"etcd at {endpoint} is not on this host: give "
                            "--etcd-restart-cmd to restart it")
    pids = _listeners(port, ips)
    if len(pids) != 1 or None in pids:
        what = "no process" if not pids else (
            "a process this user cannot see" if None in pids else f"{len(pids)} processes")
        raise NotOwnedError(f"{what} listening on {endpoint}: not provably the job's etcd")
    pid = pids.pop()
    try:
        proc = psutil.Process(pid)
        argv, name = tuple(proc.cmdline()), proc.name()
        created, cwd, env = proc.create_time(), proc.cwd(), proc.environ()
        owner = proc.ppid()
        owner_created = psutil.Process(owner).create_time()
    except psutil.Error as exc:
        raise NotOwnedError(f"pid {pid} listening on {endpoint} cannot be inspected "
                            f"({type(exc).__name__})") from exc
    binary = os.path.basename(argv[0]) if argv else name
    if binary != "etcd" and name != "etcd":
        raise NotOwnedError(f"pid {pid} listening on {endpoint} is {binary!r}, not etcd")
    if not _serves_job(endpoint, job, security):
        raise NotOwnedError(f"etcd pid {pid} at {endpoint} holds no key of job {job}")
    return FoundMember(endpoint, pid, created, argv, cwd, dict(env), owner, owner_created)


def _same_process(found: FoundMember) -> bool:
    try:
        proc = psutil.Process(found.pid)
        return abs(proc.create_time() - found.created) < 0.5 and \
            proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _health_url(found: FoundMember) -> str:
    """Where the relaunched member answers ``/health`` in plain HTTP: its metrics listener when
    it has one (a member serving TLS), else its client endpoint."""
    argv = list(found.argv)
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--listen-metrics-urls" and i + 1 < len(argv) else (
            arg.partition("=")[2] if arg.startswith("--listen-metrics-urls=") else "")
        if value.startswith("http://"):
            return value.split(",")[0].rstrip("/") + "/health"
    return f"http://{found.endpoint}/health"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return b'"health":"true"' in resp.read().replace(b" ", b"")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def restart_found(found: FoundMember, how: str, down_s: float, log_dir: str,
                  stopped: set[int]) -> dict[str, Any]:
    """Stop or kill ``found`` for ``down_s`` and bring it back (see the module docstring).
    ``stopped`` records a SIGSTOPped pid until it is resumed (``InjectContext.close``)."""
    if not _same_process(found):
        raise TargetNotFound(f"{found.describe()} exited before the injection")
    if how == "stop":
        os.kill(found.pid, signal.SIGSTOP)
        stopped.add(found.pid)
        threading.Event().wait(down_s)
        os.kill(found.pid, signal.SIGCONT)
        stopped.discard(found.pid)
        return {"by": "pid", "pid": found.pid, "endpoint": found.endpoint, "how": how,
                "down_s": down_s,
                "done_by": f"{found.describe()}: SIGSTOP for {down_s:g}s, then SIGCONT"}
    os.kill(found.pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while _same_process(found):  # gone, or a zombie its parent has not reaped yet
        if time.monotonic() >= deadline:
            raise InjectError(f"{found.describe()} survived SIGKILL for {KILL_WAIT_S:.0f}s")
        time.sleep(0.02)
    threading.Event().wait(down_s)
    os.makedirs(log_dir, exist_ok=True)
    spec = {"argv": list(found.argv), "cwd": found.cwd, "env": found.env,
            "owner": found.owner, "owner_created": found.owner_created,
            "log": os.path.join(log_dir, f"etcd-{found.endpoint.replace(':', '-')}.log")}
    keeper = subprocess.Popen([sys.executable, "-c", _KEEPER, json.dumps(spec)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(_health_url(found)):
        if keeper.poll() is not None or time.monotonic() >= deadline:
            raise InjectError(f"etcd at {found.endpoint} did not come back within "
                              f"{START_TIMEOUT_S:.0f}s after SIGKILL (log: {spec['log']})")
        time.sleep(0.05)
    return {"by": "pid", "pid": found.pid, "endpoint": found.endpoint, "how": how,
            "down_s": down_s, "keeper_pid": keeper.pid,
            "done_by": f"{found.describe()}: SIGKILL, down {down_s:g}s, started again with "
                       f"its own command line (keeper pid {keeper.pid}, ends with owner pid "
                       f"{found.owner})"}


def run_restart_command(command: str, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run the user's ``--etcd-restart-cmd`` (bounded); ``InjectError`` when it fails."""
    proc = subprocess.Popen(["/bin/sh", "-c", command], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate(timeout=KILL_WAIT_S)
        raise InjectError(f"--etcd-restart-cmd did not finish within {timeout_s:g}s "
                          f"(killed): {command}") from None
    took = time.monotonic() - started
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0:
        last = lines[-1] if lines else "no output"
        raise InjectError(f"--etcd-restart-cmd exited with code {proc.returncode} ({last}): "
                          f"{command}")
    return {"by": "command", "command": command, "took_s": round(took, 3),
            "done_by": f"--etcd-restart-cmd ran in {took:.1f}s: {command}"}


def wait_answering(client: EtcdClient, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the job's etcd answers again (bounded); ``InjectError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.revision()
            return
        except EtcdAuthError:
            return  # a refusal is an answer (with auth on, this user may not read key "\0")
        except CoordinationError as exc:
            if time.monotonic() >= deadline:
                raise InjectError(f"the job's etcd did not answer within {timeout_s:g}s after "
                                  f"the restart: {exc}") from exc
        time.sleep(0.1)
