"""A multi-host topology on Linux network namespaces, for the tests that need real network links.

Each node is a network namespace with two links: ``ctl`` on a "control" bridge (10.77.N.0/24,
where the etcd members are) and ``dat`` on a "data" bridge (10.78.N.0/24, where the peers are),
so a test cuts either link alone (``Topology.cut(node, "control")``: ``ip -n NS link set ctl
down``) or both, in either of the ``partition`` fault's modes (``mode="down"``: the link goes
down; ``mode="drop"``: it stays up and an nftables table in the namespace drops every packet,
``launcher.inject.topology``). etcd runs as members in namespaces of their own on the control bridge
(``launcher.standalone.EtcdCluster`` with the members' addresses and ``ip netns exec``). The
bridges live in a namespace of their own; this process reaches the control bridge through one
veth (10.77.N.254) to read etcd, and never the data bridge.

Promises:

* only addresses on this topology's bridges (and loopback) are ever contacted; ``N`` is drawn at
  random among the third octets no interface of this host uses and no other test process holds
  (a claim file under ``/tmp/hspmd-netns-octets``), and every namespace and the one
  veth in this host's namespace carry a random suffix, so topologies of concurrent tests never
  meet;
* ``spawn`` starts a process in a node's namespace as an ordinary child (``ip netns exec`` execs
  the command: the child's pid is the process's) and tracks it;
* ``close`` (the fixture's finalizer, run even when the test fails) kills every tracked process
  by pid, stops the etcd members, deletes every namespace (which removes their veths) and the
  host's veth; every loop is bounded in count and time;
* when the kernel refuses a namespace (no privilege, no netns support) the test fails with one
  line carrying the kernel's own message wherever namespaces are expected to work: on Linux as
  root, and wherever ``HSPMD_REQUIRE_NETNS=1`` (``.ci/run`` sets it), since a skipped partition
  or chaos test there is a missing test. It is skipped, with that message, only elsewhere (not
  root, not Linux) or where ``HSPMD_REQUIRE_NETNS=0`` says so explicitly.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import psutil
import pytest

from launch_harness import LAUNCH, REPO, assert_agents_running

from launcher.inject.topology import PARTITION_MODES, cut_link
from launcher.standalone import EtcdCluster

CONTROL_DEV, DATA_DEV = "ctl", "dat"
LINKS = {"control": (CONTROL_DEV,), "data": (DATA_DEV,), "all": (CONTROL_DEV, DATA_DEV)}
IP_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0


# 1: a refused namespace fails the test; 0: it skips it; unset: it fails on Linux as root
REQUIRE_ENV = "HSPMD_REQUIRE_NETNS"


def netns_required() -> bool:
    """Whether a refused namespace fails the test (else it is skipped)."""
    wanted = os.environ.get(REQUIRE_ENV, "")
    if wanted in ("0", "1"):
        return wanted == "1"
    return sys.platform.startswith("linux") and os.geteuid() == 0


def refused(exc: Exception) -> None:
    """Fail (where namespaces are expected to work) or skip the test, in one line."""
    reason = " ".join(str(exc).split())
    if netns_required():
        why = (f"{REQUIRE_ENV}=1" if os.environ.get(REQUIRE_ENV) == "1"
               else f"Linux as root; {REQUIRE_ENV}=0 skips instead")
        pytest.fail(f"network namespaces refused by the kernel where they are required ({why})"
                    f": {reason}", pytrace=False)
    pytest.skip(f"network namespaces refused by the kernel: {reason}")


class NetnsRefused(RuntimeError):
    """The kernel (or our privileges) refused to make a network namespace."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (bounded); a failure raises RuntimeError with ip's own message."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


_RESERVED = Path("/tmp/hspmd-netns-octets")  # octet -> a file naming the pid that holds it


def _reserve_octet() -> int:
    """A third octet no interface of this host uses and no live test process holds: claimed
    by creating ``_RESERVED/<octet>`` exclusively (tests run in parallel processes); a claim
    whose process is gone is taken over. Released by ``Topology.close``."""
    _RESERVED.mkdir(exist_ok=True)
    free = sorted(set(range(1, 250)) - _used_octets())
    random.shuffle(free)
    for octet in free:
        path = _RESERVED / str(octet)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = int(path.read_text() or "0")
            except (OSError, ValueError):
                continue
            if holder and psutil.pid_exists(holder):
                continue
            path.write_text(str(os.getpid()))  # a dead holder's claim
            return octet
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return octet
    raise NetnsRefused("no free third octet for a test topology")


def _used_octets() -> set[int]:
    """Third octets of 10.77.x / 10.78.x addresses this host's namespace already uses."""
    used = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                addr = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            parts = str(addr).split(".")
            if len(parts) == 4 and parts[0] == "10" and parts[1] in ("77", "78"):
                used.add(int(parts[2]))
    return used


@dataclass
class NetNode:
    """One simulated host: its namespace, its addresses on both bridges, its link names."""

    name: str
    netns: str
    control_addr: str
    data_addr: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def as_topology(self) -> dict:
        return {"netns": self.netns, "control": CONTROL_DEV, "data": DATA_DEV}


class NsProcess:
    """A process started in a namespace, its output in files (like ``launch_harness.Launcher``)."""

    def __init__(self, node: NetNode, argv: Sequence[str], env: dict[str, str], out_dir: Path,
                 name: str):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.stdout_path = out_dir / f"{name}.stdout"
        self.stderr_path = out_dir / f"{name}.stderr"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([*node.prefix, *argv], env=env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, cwd=str(REPO),
                                         start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout}s; stderr:\n"
                                 + self.stderr()[-6000:]) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")


def name_service(netns: str, hosts_lines: Sequence[str] = ()) -> None:
    """``ip netns exec`` mounts ``/etc/netns/NS/*`` over ``/etc``: in the namespace, names
    resolve from this host's ``/etc/hosts`` (the hostname's loopback entry included: the trap a
    multi-host deployment must not fall into) plus ``hosts_lines``, and the only nameserver is
    the namespace's own loopback (and ``nsswitch.conf`` asks none), so no lookup leaves the
    namespaces, and none waits for an unreachable server. Removed by ``ip netns del``'s caller
    (``shutil.rmtree(/etc/netns/NS)``)."""
    etc = Path("/etc/netns") / netns
    etc.mkdir(parents=True, exist_ok=True)
    try:
        hosts = Path("/etc/hosts").read_text()
    except OSError:
        hosts = "127.0.0.1 localhost\n"
    (etc / "hosts").write_text(hosts.rstrip("\n") + "\n" + "\n".join(hosts_lines) + "\n")
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    if Path("/etc/nsswitch.conf").exists():  # files only: a miss is answered at once
        base = Path("/etc/nsswitch.conf").read_text().splitlines()
        (etc / "nsswitch.conf").write_text("\n".join(
            "hosts: files" if ln.startswith("hosts:") else ln for ln in base) + "\n")


class Topology:
    """Nodes and etcd members in namespaces of their own (see the module docstring)."""

    def __init__(self, tmp: Path, nodes: Sequence[str] = ("node-a", "node-b"),
                 etcd_members: int = 3):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.suffix = uuid.uuid4().hex[:6]
        self.octet = _reserve_octet()
        self.bridge_ns = f"hsb-{self.suffix}"
        self.host_dev = f"hso{self.suffix}"
        self.namespaces: list[str] = []
        self.nodes = {n: NetNode(n, f"hsn{i}-{self.suffix}", self.control(11 + i),
                                 self.data(11 + i)) for i, n in enumerate(nodes)}
        self.members = [NetNode(f"m{i}", f"hse{i}-{self.suffix}", self.control(1 + i), "")
                        for i in range(etcd_members)]
        self.etcd: Optional[EtcdCluster] = None
        self.procs: list[NsProcess] = []
        self.cuts: dict[tuple[str, str], str] = {}  # (netns, device) -> the mode it is cut in
        self._port = 0

    def control(self, host: int) -> str:
        return f"10.77.{self.octet}.{host}"

    def data(self, host: int) -> str:
        return f"10.78.{self.octet}.{host}"

    # ------------------------------------------------------------------------------ build
    def _netns(self, name: str) -> None:
        res = ip("netns", "add", name, check=False)
        if res.returncode != 0:
            raise NetnsRefused(res.stderr.strip() or f"ip netns add exited {res.returncode}")
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        self._name_service(name)

    def _name_service(self, name: str) -> None:
        lines = [f"{n.data_addr} {n.name}" for n in self.nodes.values()]
        lines += [f"{m.control_addr} etcd-{m.name}" for m in self.members]
        name_service(name, lines)

    def _attach(self, ns: str, dev: str, bridge: str, addr: str) -> None:
        """A veth ``dev`` in ``ns`` holding ``addr``/24, its peer a port of ``bridge``."""
        port = f"p{self._port}"
        self._port += 1
        ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns",
           self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "set", port, "master", bridge)
        ip("-n", self.bridge_ns, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")

    def start(self) -> "Topology":
        self._netns(self.bridge_ns)
        for br in ("bctl", "bdat"):
            ip("-n", self.bridge_ns, "link", "add", br, "type", "bridge")
            ip("-n", self.bridge_ns, "link", "set", br, "up")
        # This process reads etcd through one veth on the control bridge.
        ip("link", "add", self.host_dev, "type", "veth", "peer", "name", "obs", "netns",
           self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "set", "obs", "master", "bctl")
        ip("-n", self.bridge_ns, "link", "set", "obs", "up")
        ip("addr", "add", f"{self.control(254)}/24", "dev", self.host_dev)
        ip("link", "set", self.host_dev, "up")
        for node in self.nodes.values():
            self._netns(node.netns)
            self._attach(node.netns, CONTROL_DEV, "bctl", node.control_addr)
            self._attach(node.netns, DATA_DEV, "bdat", node.data_addr)
        for m in self.members:
            self._netns(m.netns)
            self._attach(m.netns, CONTROL_DEV, "bctl", m.control_addr)
        if self.members:
            self.etcd = EtcdCluster(len(self.members), base_dir=str(self.tmp / "etcd"),
                                    hosts=[m.control_addr for m in self.members],
                                    command_prefixes=[m.prefix for m in self.members]).start()
        return self

    # ------------------------------------------------------------------------------ use
    @property
    def endpoint_str(self) -> str:
        """The etcd members' control addresses, as ``--rdzv-endpoint`` takes them."""
        return self.etcd.endpoint_str if self.etcd else ""

    def spawn(self, node: str, argv: Sequence[str], env: dict[str, str],
              name: Optional[str] = None) -> NsProcess:
        proc = NsProcess(self.nodes[node], argv, env, self.tmp, name or node)
        self.procs.append(proc)
        return proc

    def launch(self, node: str, args: Sequence[str], env: dict[str, str],
               name: Optional[str] = None) -> NsProcess:
        """``hspmd-launch ARGS`` in ``node``'s namespace (logs under the test's directory)."""
        name = name or node
        env = dict(env, PET_LOG_DIR=str(self.tmp / f"{name}-logs"))
        return self.spawn(node, [LAUNCH, *args], env, name)

    def netns_of(self, target: str) -> NetNode:
        if target in self.nodes:
            return self.nodes[target]
        for m in self.members:
            if m.name == target:
                return m
        raise KeyError(target)

    def set_links(self, target: str, links: str, up: bool, mode: str = "down") -> None:
        """Cut (``up`` False) or heal ``target``'s (a node or an etcd member) ``links``
        (control, data, all) in ``mode``: ``down`` (the link goes down: the cut side's own
        connections fail at once) or ``drop`` (the link stays up and drops every packet: a
        connection from either side hangs until its own timeout). A heal undoes the mode each
        link was cut in."""
        if mode not in PARTITION_MODES:
            raise ValueError(f"mode must be one of {', '.join(PARTITION_MODES)}, got {mode!r}")
        node = self.netns_of(target)
        for dev in LINKS[links]:
            if dev == DATA_DEV and not node.data_addr:
                continue
            if up:
                cut_link(node.netns, dev, self.cuts.pop((node.netns, dev), mode), cut=False)
            else:
                cut_link(node.netns, dev, mode, cut=True)
                self.cuts[(node.netns, dev)] = mode

    def cut(self, target: str, links: str = "all", mode: str = "down") -> None:
        self.set_links(target, links, up=False, mode=mode)

    def heal(self, target: str, links: str = "all") -> None:
        self.set_links(target, links, up=True)

    def connect(self, node: str, addr: str, port: int = 9, timeout: float = 1.0) -> str:
        """From ``node``'s namespace, one TCP connect to ``addr:port`` (nothing listens on port
        9, the discard port, on this topology): ``refused`` (the peer answered), ``timeout``
        (nothing answered within ``timeout``), or the error's own words (``Network is
        unreachable``: the link is down)."""
        code = ("import socket, sys\n"
                "try:\n"
                f"    socket.create_connection(({addr!r}, {port}), timeout={timeout})\n"
                "    print('connected')\n"
                "except socket.timeout:\n    print('timeout')\n"
                "except ConnectionRefusedError:\n    print('refused')\n"
                "except OSError as exc:\n    print(exc.strerror or exc)\n")
        res = subprocess.run([*self.nodes[node].prefix, sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=timeout + IP_TIMEOUT_S)
        return res.stdout.strip() or res.stderr.strip()

    def etcd_connections(self, node: str, pid: int) -> set[str]:
        """The etcd members (``host:port``) process ``pid`` in ``node``'s namespace holds an
        established TCP connection to, as the kernel sees them (``ss``): a client talks to a
        member over such a connection (it keeps one it moved away from open)."""
        res = subprocess.run([*self.nodes[node].prefix, "ss", "-Htnp", "state", "established"],
                             capture_output=True, text=True, timeout=IP_TIMEOUT_S)
        members = set(self.endpoint_str.split(","))
        out = set()
        for line in res.stdout.splitlines():
            cols = line.split()  # recv-q, send-q, local, peer, users:(("name",pid=N,fd=M))
            if len(cols) < 5 or f"pid={pid}," not in cols[4]:
                continue
            peer = cols[3].replace("[::ffff:", "").replace("]", "")  # IPv4 on a dual socket
            if peer in members:
                out.add(peer)
        return out

    def topology_file(self) -> Path:
        """The file ``hspmd-launch inject --topology`` reads to act on these links."""
        path = self.tmp / "topology.json"
        path.write_text(json.dumps({
            "schema": 1, "kind": "netns_topology",
            "nodes": {n.name: n.as_topology() for n in self.nodes.values()},
            "etcd": {m.name: {"netns": m.netns, "control": CONTROL_DEV} for m in self.members},
        }, indent=1))
        return path

    # ------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        for p in self.procs:
            p.kill()
        if self.etcd is not None:
            self.etcd.stop()
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        ip("link", "del", self.host_dev, check=False)
        self.namespaces.clear()
        with contextlib.suppress(OSError):
            (_RESERVED / str(self.octet)).unlink()


@contextlib.contextmanager
def topologies(tmp: Path) -> Iterator:
    """``make(nodes=..., etcd_members=3)`` -> a started ``Topology``; all closed at the end.
    A kernel that refuses namespaces fails or skips the test with its own message
    (``refused``)."""
    made: list[Topology] = []

    def make(nodes: Sequence[str] = ("node-a", "node-b"), etcd_members: int = 3) -> Topology:
        topo = Topology(tmp / f"net{len(made)}", nodes, etcd_members)
        made.append(topo)
        try:
            return topo.start()
        except NetnsRefused as exc:
            refused(exc)

    try:
        yield make
    finally:
        for topo in made:
            topo.close()


# ------------------------------------------------------------------------ jobs on the topology
class NetnsJob:
    """One ``hspmd-launch`` job whose agents run one per node of ``topo``, each advertising its
    data address (``--local-addr``) and reaching etcd at the members' control addresses; an
    etcd client of this process (through the control bridge) watches it."""

    def __init__(self, topo: Topology, env: dict[str, str], ttl: float = 2.0):
        from hspmd_elastic.coord.client import EtcdClient

        self.topo, self.env, self.ttl = topo, env, ttl
        self.name = f"nj-{uuid.uuid4().hex[:8]}"
        self.agents: dict[str, NsProcess] = {}
        self.client = EtcdClient(topo.etcd.endpoints, timeout=2.0)

    def args(self, node: str, nnodes: str, nproc: int, *extra: str) -> list[str]:
        return ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.topo.endpoint_str, "--rdzv-id", self.name,
                "--hspmd-node-id", node, "--local-addr", self.topo.nodes[node].data_addr,
                "--hspmd-lease-ttl", f"{self.ttl:g}", "--shutdown-timeout", "5",
                "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60", *extra]

    def start(self, node: str, args: Sequence[str], name: Optional[str] = None) -> NsProcess:
        self.agents[node] = self.topo.launch(node, list(args), self.env, name)
        return self.agents[node]

    def check_agents(self) -> None:
        """AssertionError, with its stderr, if an agent has exited."""
        assert_agents_running(self.agents)

    def workers(self) -> dict:
        from hspmd_elastic.contract import schema
        from hspmd_elastic.coord.api import CoordinationError

        prefix = schema.workers_prefix(self.name)
        out = {}
        try:
            for kv in self.client.get_prefix(prefix):
                node, lr = kv.key[len(prefix):].split("/")
                out[f"{node}:{lr}"] = schema.decode(kv.key, kv.value)
        except CoordinationError:
            return {}
        return out

    def events(self) -> list:
        from hspmd_elastic.coord import read_events

        return read_events(self.client, self.name)

    def finish(self, timeout: float = 90.0) -> None:
        for node, agent in self.agents.items():
            code = agent.wait(timeout)
            assert code == 0, f"{node} exited {code}:\n{agent.stderr()[-6000:]}"

    def close(self) -> None:
        for agent in self.agents.values():
            agent.kill()
        self.client.close()
