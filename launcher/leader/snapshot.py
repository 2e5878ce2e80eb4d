"""The cluster as the leader sees it: records in, a ``ClusterSnapshot`` out. Pure, no I/O.

Promises:

* ``build_snapshot`` turns node records, device-health verdicts and worker progress into a
  ``ClusterSnapshot``: per node its devices (ids ``"<node_id>:<index>"``, made by
  ``contract.ids.device_id``) with type, memory, state and speed relative to nominal (the
  health verdict's), and the speed the node declared for it (``--hspmd-device-speed``);
  failed devices have speed 0 and are not ``usable``; suspect devices (warning signs before a
  fatal fault) are not ``usable`` either, but they still work: ``decide`` drains the ones that
  hold state; nodes in ``GONE_NODE_STATES``
  (leaving, failed) are not ``alive`` and none of their devices is usable;
* a verdict whose ``origin`` is ``exit`` or ``stall`` (``contract.records.VerdictOrigin``) was
  written by a node agent that saw its worker die or hang and journaled it already; ``decide``
  marks the change ``journaled`` so the leader does not journal it twice;
* a node is *cut off* (``NodeView.cut_off``: the reason) when a strict majority of the other
  nodes of the current plan report it unreachable over the data network (``reach/<node>``,
  ``launcher.node.elastic.reach``); its devices are not usable, and it hosts no store. When that rule
  would cut half of the planned nodes or more, nobody is cut (two nodes that lose each other
  cannot tell which one is cut off);
* ``ClusterSnapshot.retry`` holds, per live node, the plan version its workers wait after
  (``retry/<node>``: their switch into it failed and nothing else explains it);
* ``ClusterSnapshot.store_for`` is deterministic: the preferred node's advertised store when it
  has one, else the lowest live node id's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import device_id, node_of
from launcher.health.verdicts import summarize_device_health

GONE_NODE_STATES = schema.GONE_NODE_STATES
MEASURED = "measured"  # DeviceView.origin of a speed the leader measured (not a health verdict)


@dataclass(frozen=True)
class DeviceView:
    """One device slot as the leader sees it. ``speed``: relative to nominal (1.0 nominal),
    from health verdicts; ``declared_speed``: what the node declared its device to be, relative
    to its type's nominal (a capacity, not a health state); ``memory_bytes`` 0: not known."""

    id: str
    node: str
    index: int
    type: str
    memory_bytes: int
    state: str = "healthy"  # healthy | degraded | suspect | failed
    speed: float = 1.0
    reason: str = ""
    declared_speed: float = 1.0
    origin: str = "health"  # who made its verdict (``contract.records.VerdictOrigin``)


@dataclass(frozen=True)
class NodeView:
    """One node's record and its devices; ``alive`` unless its state is a gone one."""

    node: str
    host: str
    state: str
    store_endpoint: str
    devices: tuple[DeviceView, ...]
    cut_off: str = ""  # why the node counts as cut off from the data network ("" when not)

    @property
    def alive(self) -> bool:
        return self.state not in GONE_NODE_STATES


@dataclass(frozen=True)
class ClusterSnapshot:
    """The cluster at one moment, as records said it. ``self_node``: the leader's node."""

    nodes: Mapping[str, NodeView]
    self_node: str = ""
    step: Optional[int] = None  # the furthest step any worker reported
    running: frozenset = frozenset()  # devices whose worker's record is in etcd (it runs)
    retry: Mapping[str, int] = field(default_factory=dict)  # node -> plan version to retry

    def usable(self) -> dict[str, DeviceView]:
        return {d.id: d for n in self.nodes.values() if n.alive and not n.cut_off
                for d in n.devices if d.state not in ("failed", "suspect")}

    def device(self, dev: str) -> Optional[DeviceView]:
        view = self.nodes.get(node_of(dev))
        return next((d for d in view.devices if d.id == dev), None) if view else None

    def alive_nodes(self) -> list[str]:
        return sorted(n for n, v in self.nodes.items() if v.alive)

    def store_for(self, prefer: str) -> tuple[str, str]:
        """(node, endpoint) of a store hosted by a live agent: ``prefer``'s, else the lowest
        node id's; ("", "") when no live agent advertises one."""
        live = {n: v.store_endpoint for n, v in self.nodes.items()
                if v.alive and v.store_endpoint and not v.cut_off}
        if prefer in live:
            return prefer, live[prefer]
        if live:
            node = min(live)
            return node, live[node]
        return "", ""


def build_snapshot(nodes: Mapping[str, schema.NodeRecord],
                   verdicts: Mapping[tuple[str, int], schema.DeviceHealthRecord],
                   self_node: str = "",
                   workers: Optional[Mapping[tuple[str, int], schema.WorkerRecord]] = None,
                   default_slowdown: float = 0.5,
                   reach: Optional[Mapping[str, schema.ReachRecord]] = None,
                   planned: frozenset = frozenset(),
                   retry: Optional[Mapping[str, schema.RetryRecord]] = None,
                   measured: Optional[Mapping[str, float]] = None) -> ClusterSnapshot:
    """Pure: node records + health verdicts (+ worker progress, + reachability reports and
    the nodes of the current plan, + retry requests, + the speeds the leader measured and
    decided to plan for, ``launcher.leader.stragglers``) -> ``ClusterSnapshot``. A measured
    speed below 1 makes a healthy device ``degraded`` (origin ``measured``); a device slowed by
    its health verdict too gets the lower of the two (``with_measured``: the only place a
    measured speed becomes part of the devices the leader plans over)."""
    health = summarize_device_health(verdicts, default_slowdown=default_slowdown)
    alive = {n for n, rec in nodes.items() if rec.state not in GONE_NODE_STATES}
    cut = cut_off_nodes(reach or {}, planned & alive, alive)
    views = {}
    for name, rec in nodes.items():
        devs = []
        for info in sorted(rec.devices, key=lambda d: d.index):
            where = (name, info.index)
            if where in health.failed:
                state, speed, reason = "failed", 0.0, health.failed[where]
            elif where in health.suspect:
                state, speed, reason = "suspect", 0.0, health.suspect[where]
            elif where in health.slowdown:
                state, speed = "degraded", float(health.slowdown[where])
                reason = verdicts[where].reason
            else:
                state, speed, reason = "healthy", 1.0, ""
            origin = verdicts[where].origin if where in verdicts else "health"
            dev = device_id(name, info.index)
            devs.append(with_measured(DeviceView(dev, name, info.index, info.type,
                                                 info.memory_bytes, state, speed, reason,
                                                 info.speed, origin),
                                      (measured or {}).get(dev, 1.0)))
        views[name] = NodeView(name, rec.host, rec.state, rec.store_endpoint, tuple(devs),
                               cut.get(name, ""))
    steps = [w.step for w in (workers or {}).values()]
    running = frozenset(device_id(n, lr) for n, lr in (workers or {}))
    retries = {n: r.plan_version for n, r in (retry or {}).items() if n in alive}
    return ClusterSnapshot(views, self_node, max(steps) if steps else None, running, retries)


def with_measured(view: DeviceView, speed: float) -> DeviceView:
    """The one fold of a measured speed into a device's view: a healthy or degraded device
    measured slower than its view says becomes ``degraded`` at the measured speed (origin
    ``MEASURED``); any other view is itself. ``build_snapshot`` folds the leader's measured
    speeds with it, and the straggler rule's predictions (``stragglers``) fold the speeds they
    weigh with it, over ``nominal(view)``."""
    if view.state not in ("healthy", "degraded") or not speed < view.speed:
        return view
    return replace(view, state="degraded", speed=speed, origin=MEASURED,
                   reason=f"measured speed {speed:.0%} of the fastest device")


def nominal(view: DeviceView) -> DeviceView:
    """``view`` at full health: healthy, speed 1.0 (what a measured speed is relative to)."""
    return replace(view, state="healthy", speed=1.0, reason="", origin="health")


def cut_off_nodes(reach: Mapping[str, schema.ReachRecord], voters: frozenset,
                  alive: set) -> dict[str, str]:
    """Pure: node -> why it is cut off from the data network (see the module docstring).
    ``voters``: the live nodes of the current plan, whose reports count; ``alive``: the
    candidates (a node the current plan left out stays cut while the plan's nodes report it)."""
    out = {}
    for node in sorted(alive):
        others = voters - {node}
        by = sorted(r for r in others if r in reach and node in reach[r].unreachable)
        if others and 2 * len(by) > len(others):
            out[node] = f"unreachable over the data network from {', '.join(by)}"
    if voters and 2 * len(set(out) & voters) >= len(voters):
        return {}
    return out
