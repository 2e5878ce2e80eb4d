"""Where the network faults act: a topology file that names, per node and per etcd member, its
network namespace and its link devices (read by ``hspmd-launch inject --topology FILE``).

A topology file::

    {"schema": 1, "kind": "netns_topology",
     "nodes": {"node-a": {"netns": "hsn0-1a2b3c", "control": "ctl", "data": "dat"}},
     "etcd":  {"m0": {"netns": "hse0-1a2b3c", "control": "ctl"}}}

``control`` is the link to the etcd members, ``data`` the link to the peers (a node whose
control and data traffic share one link names the same device twice). A ``partition`` cuts
those links for its ``duration_s`` in one of two modes:

* ``down`` (the default): ``ip -n NETNS link set DEV down``, then ``up``. The cut side's own
  connections fail at once ("Network is unreachable"), as on a host whose port went dark; the
  other side sees a silent peer;
* ``drop``: an nftables table in the namespace (``inet hspmd_drop_<DEV>``, hooks input, output
  and forward at priority -300) drops every IP packet in and out of the device, then the table is
  deleted. The link stays up and neither side is told anything: a connection attempt (from
  either side) hangs until its own timeout, and an open connection goes silent, as behind a
  failed switch or a firewall that drops. ARP is still answered.

``tests/_netns.py`` writes this file for the multi-host tests; on real hosts, a site that can cut
links some other way has no file and gets ``not injected`` with the reason.

Promises: a bad file is one ``TopologyError`` line naming the file, the entry and what is wrong;
a link that cannot be cut or healed (no such namespace or device, no privilege, no ``nft`` for
``drop``) is one ``InjectError`` line with the tool's own message; every ``ip`` and ``nft`` call
is bounded; cutting or healing twice in the same mode is the same as once.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Optional

from launcher.inject.api import InjectError

TOPOLOGY_KIND = "netns_topology"
LINK_CHOICES = ("all", "control", "data")
PARTITION_MODES = ("down", "drop")  # link down; every packet dropped (link up)
IP_TIMEOUT_S = 10.0


class TopologyError(InjectError, ValueError):
    """A topology file is malformed (the CLI exits 2 on it)."""


@dataclass(frozen=True)
class HostLinks:
    """One host's namespace and link devices (``data`` is None for an etcd member)."""

    netns: str
    control: str
    data: Optional[str] = None

    def devices(self, links: str) -> list[str]:
        """The devices a partition of ``links`` (all, control, data) brings down, in order."""
        if links == "control":
            return [self.control]
        if links == "data":
            if self.data is None:
                raise InjectError(f"namespace {self.netns} has no data link to cut")
            return [self.data]
        return list(dict.fromkeys(d for d in (self.control, self.data) if d))


@dataclass(frozen=True)
class NetTopology:
    nodes: dict[str, HostLinks]
    etcd: dict[str, HostLinks]

    def host(self, node: Optional[str] = None, member: Optional[str] = None) -> HostLinks:
        """The links of ``node`` (or of etcd ``member``); InjectError names what exists."""
        table, name, what = ((self.nodes, node, "node") if node is not None
                             else (self.etcd, member, "etcd member"))
        if name not in table:
            raise InjectError(f"{what} {name!r} is not in the topology file (it names "
                              f"{', '.join(sorted(table)) or 'none'})")
        return table[name]


def _host(body: Any, where: str, with_data: bool) -> HostLinks:
    if not isinstance(body, dict):
        raise TopologyError(f"bad topology {where}: expected an object with netns and control")
    allowed = {"netns", "control", "data"} if with_data else {"netns", "control"}
    extra = sorted(set(body) - allowed)
    if extra:
        raise TopologyError(f"bad topology {where}: unknown field(s) {', '.join(extra)}; "
                            f"valid: {', '.join(sorted(allowed))}")
    for name in ("netns", "control") + (("data",) if with_data else ()):
        value = body.get(name)
        if not isinstance(value, str) or not value or "/" in value or " " in value:
            raise TopologyError(f"bad topology {where}: {name} must be a namespace or device "
                                f"name, got {value!r}")
    return HostLinks(body["netns"], body["control"], body.get("data"))


def parse_topology(body: Any, where: str = "<topology>") -> NetTopology:
    if not isinstance(body, dict) or body.get("kind") != TOPOLOGY_KIND \
            or body.get("schema") != 1:
        raise TopologyError(f"bad topology {where}: expected {{\"schema\": 1, \"kind\": "
                            f"\"{TOPOLOGY_KIND}\", \"nodes\": {{...}}}}")
    nodes, etcd = body.get("nodes", {}), body.get("etcd", {})
    if not isinstance(nodes, dict) or not isinstance(etcd, dict):
        raise TopologyError(f"bad topology {where}: nodes and etcd must be objects")
    return NetTopology(
        {n: _host(h, f"{where} node {n}", True) for n, h in nodes.items()},
        {m: _host(h, f"{where} etcd member {m}", False) for m, h in etcd.items()})


def load_topology(path: str) -> NetTopology:
    try:
        with open(path, encoding="utf-8") as fh:
            body = json.load(fh)
    except OSError as exc:
        raise TopologyError(f"bad topology {path}: cannot read it "
                            f"({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise TopologyError(f"bad topology {path}: not JSON ({exc})") from exc
    return parse_topology(body, path)


Runner = Callable[..., subprocess.CompletedProcess]


def set_link(netns: str, device: str, up: bool, run: Runner = subprocess.run) -> None:
    """``ip -n NETNS link set DEVICE up|down``; InjectError with ip's message on failure."""
    argv = ["ip", "-n", netns, "link", "set", device, "up" if up else "down"]
    try:
        res = run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InjectError(f"cannot run {' '.join(argv)}: {exc}") from exc
    if res.returncode != 0:
        raise InjectError(f"{' '.join(argv)} failed: "
                          f"{(res.stderr or '').strip() or f'exit {res.returncode}'}")


def drop_table(device: str) -> str:
    """The nftables table (family ``inet``) that drops ``device``'s packets."""
    return "hspmd_drop_" + re.sub(r"[^A-Za-z0-9_]", "_", device)


def drop_script(device: str, drop: bool) -> str:
    """An ``nft -f`` script that adds (``drop``) or deletes the table dropping every IP packet in
    and out of ``device``; both are idempotent (``add table`` of an existing table is no error)."""
    table = f"inet {drop_table(device)}"
    lines = [f"add table {table}", f"delete table {table}"]
    if drop:
        dev = json.dumps(device)
        lines += [f"add table {table}"] + [
            f"add chain {table} {hook} {{ type filter hook {hook} priority -300; "
            f"policy accept; }}" for hook in ("input", "output", "forward")] + [
            f"add rule {table} input iifname {dev} drop",
            f"add rule {table} output oifname {dev} drop",
            f"add rule {table} forward iifname {dev} drop",
            f"add rule {table} forward oifname {dev} drop"]
    return "\n".join(lines) + "\n"


def set_drop(netns: str, device: str, drop: bool, run: Runner = subprocess.run) -> None:
    """Drop every IP packet of ``device`` in ``netns`` (or stop dropping): one nftables
    transaction through ``ip netns exec NETNS nft -f -``; InjectError with nft's message."""
    if shutil.which("nft") is None:
        raise InjectError("partition mode drop needs nft (nftables) on this host; install it "
                          "or use mode down")
    argv = ["ip", "netns", "exec", netns, "nft", "-f", "-"]
    what = f"{' '.join(argv)} ({'drop' if drop else 'stop dropping'} on {device})"
    try:
        res = run(argv, input=drop_script(device, drop), capture_output=True, text=True,
                  timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InjectError(f"cannot run {what}: {exc}") from exc
    if res.returncode != 0:
        err = " ".join((res.stderr or "").split()) or f"exit {res.returncode}"
        raise InjectError(f"{what} failed: {err}")


def cut_link(netns: str, device: str, mode: str, cut: bool, run: Runner = subprocess.run
             ) -> None:
    """Cut (``cut``) or heal ``device`` in ``netns`` the way ``mode`` (down, drop) says."""
    if mode == "drop":
        set_drop(netns, device, cut, run)
    else:
        set_link(netns, device, up=not cut, run=run)
