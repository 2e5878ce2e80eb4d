"""Where the network faults act: a topology file that names, per node and per etcd member, its
network namespace and its link devices (read by ``hspmd-launch inject --topology FILE``).

A topology file::

    {"schema": 1, "kind": "netns_topology",
     "nodes": {"node-a": {"netns": "hsn0-1a2b3c", "control": "ctl", "data": "dat"}},
     "etcd":  {"m0": {"netns": "hse0-1a2b3c", "control": "ctl"}}}

``control`` is the link to the etcd members, ``data`` the link to the peers (a node whose
control and data traffic share one link names the same device twice). A ``partition`` brings
those links down with ``ip -n NETNS link set DEV down`` and up again after its ``duration_s``:
the packets are dropped, as a failed switch port would, so both sides see a silent peer.
``tests/_netns.py`` writes this file for the multi-host tests; on real hosts, a site that can cut
links some other way has no file and gets ``not injected`` with the reason.

Promises: a bad file is one ``TopologyError`` line naming the file, the entry and what is wrong;
a link that cannot be set (no such namespace or device, no privilege) is one ``InjectError``
line with ``ip``'s own message; every ``ip`` call is bounded.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Optional

from launcher.inject.api import InjectError

TOPOLOGY_KIND = "netns_topology"
LINK_CHOICES = ("all", "control", "data")
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
