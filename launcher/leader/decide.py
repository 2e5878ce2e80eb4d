"""The leader's decision: does the cluster still match the current plan? Pure, no I/O.

Promises:

* ``decide(snapshot, current_plan)`` returns a ``PlanDecision`` exactly when the usable devices,
  their speeds, or the store host differ from what the current plan assumed (its
  ``inventory``; ``assumed_inventory``), or when no plan exists yet and ``min_nodes`` nodes are
  up; otherwise None. The decision names every change (``ChangeKind``: leave, join, failure,
  stall, drain, unreachable, degrade, recover), grouped by node and kind in a deterministic
  order; a node a majority of the plan cannot reach over the data network (``snapshot``'s
  ``cut_off``) is ``unreachable``: its devices leave the plan while the cut lasts;
* a suspect device (warning signs before a fatal fault) is not usable: it leaves the plan, and
  when it computes in the current plan, is alive and its worker runs, it is *drained*
  (``PlanDecision.drain``): it joins the switch's group as a BSR source, so its state leaves by
  network, then its worker leaves. A drain is never carried into a later plan: if another
  change interrupts it, the device's state is taken as lost (replicas or a checkpoint);
* a usable device of the current plan whose worker runs is *retiring* when the next plan
  leaves it out (``PlanDecision.retiring``; the planner found it costs more than it adds, or a
  speed replan idles it): the plan drains it like a suspect device (``plan_record``), so state
  only it holds (an uneven optimizer shard, a slice without a replica) leaves by network
  before its worker leaves; the agent then runs an idle worker on the slot;
* at most ``max_nodes`` nodes are planned over (the maximum of ``--nnodes``; None: all):
  ``select_nodes`` keeps the current plan's nodes, then takes the lowest node ids; the other
  live nodes are hot spares (registered, leased, running no worker) until a planned node is
  gone, when the next decision takes one in its place (a join);
* when nothing else changed but a node of the current plan asks for a retry (its workers wait
  after their switch into that very plan failed: ``ClusterSnapshot.retry``), the decision is
  the same plan again, one ``retry`` change per asking node (the leader bounds how often);
* failures and stalls an agent already journaled (verdicts of origin ``exit`` / ``stall``)
  are marked ``journaled``;
* ``PlanDecision.fingerprint`` is equal for decisions that would give the same plan (the
  leader's debounce compares these);
* ``largest_cluster`` says when the usable devices are the most the job can ever have (the
  maximum of ``--nnodes`` planned, every device of them usable; for a one-node job: its complete
  node): a plan infeasible there is infeasible for good, and the job ends instead of waiting
  for a change that cannot come.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import device_sort_key, node_of
from launcher.leader.snapshot import ClusterSnapshot, DeviceView


# The kind of one change, also the type of its journal event (``contract.events.CHANGE_TYPES``,
# in the order a decision lists them): JOIN, LEAVE, FAILURE, STALL, DRAIN, UNREACHABLE, DEGRADE,
# RECOVER and RETRY (nothing changed, but the switch into the current plan failed: again).
ChangeKind = enum.Enum("ChangeKind", [(t.upper(), t) for t in schema.CHANGE_TYPES], type=str)


@dataclass(frozen=True)
class Change:
    """What changed since the current plan, for one node (``devices``: the ids concerned)."""

    kind: ChangeKind
    node: str
    devices: tuple[str, ...]
    detail: str = ""
    journaled: bool = False  # already in the journal (an agent reported it)

    def record(self) -> schema.PlanChange:
        """The change as a ``replan`` event lists it (``contract.events.PlanChange``)."""
        return schema.PlanChange(self.kind.value, self.node, list(self.devices), self.detail)

    def describe(self) -> str:
        return self.record().describe()


@dataclass(frozen=True)
class PlanDecision:
    """A new plan is needed: over ``devices`` (usable, in id order), for these reasons."""

    version: int
    reason: str
    changes: tuple[Change, ...]
    devices: tuple[DeviceView, ...]
    store_node: str
    store_endpoint: str
    drain: tuple[str, ...] = ()  # devices of the current plan that serve the switch, then leave
    # usable devices of the current plan whose worker runs: drained too if the plan leaves them
    retiring: tuple[str, ...] = ()

    @property
    def inventory(self) -> dict[str, float]:
        return {d.id: d.speed for d in self.devices}

    def fingerprint(self) -> tuple:
        """Equal for decisions that would give the same plan (the debounce compares these)."""
        return (self.version, tuple(sorted(self.inventory.items())), self.store_endpoint,
                self.drain)


def assumed_inventory(plan: schema.PlanRecord) -> dict[str, float]:
    """What ``plan`` was made over (device -> speed); its devices at speed 1 for plans that do
    not say."""
    return dict(plan.inventory) if plan.inventory else {d: 1.0 for d in plan.devices}


def select_nodes(snapshot: ClusterSnapshot, current: Optional[schema.PlanRecord],
                 max_nodes: Optional[int] = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Pure: ``(planned, spares)``, the live nodes with a usable device split at ``max_nodes``
    (the maximum of ``--nnodes``; None: no maximum, no spares), both in node id order.

    The nodes ``current`` was made over come first, so a node joining a full plan waits as a
    spare instead of displacing a planned node (a switch for nothing); the rest by node id,
    which makes the choice deterministic: the same world always gives the same spares, so
    decisions do not flip-flop between them. A planned node that is gone (left, lease
    expired, every device failed) is no candidate, so the lowest spare takes its place."""
    candidates = sorted({d.node for d in snapshot.usable().values()})
    if max_nodes is None or len(candidates) <= max_nodes:
        return tuple(candidates), ()
    kept = {node_of(d) for d in assumed_inventory(current)} if current else set()
    ranked = sorted(candidates, key=lambda n: (n not in kept, n))
    return tuple(sorted(ranked[:max_nodes])), tuple(sorted(ranked[max_nodes:]))


def decide(snapshot: ClusterSnapshot, current: Optional[schema.PlanRecord],
           min_nodes: int = 1, max_nodes: Optional[int] = None) -> Optional[PlanDecision]:
    """Pure: a ``PlanDecision`` when the cluster differs from what ``current`` assumed.

    With ``max_nodes``, only the nodes ``select_nodes`` plans over count: spares are neither
    in ``devices`` nor named as joins until a planned node is gone and one of them is needed
    (then it is a ``join``)."""
    if max_nodes is not None and max_nodes < min_nodes:
        raise ValueError(f"need min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
    usable = snapshot.usable()
    if not usable:
        return None
    # Without a maximum every candidate is planned: no spares, no need to rank nodes.
    planned, spares = select_nodes(snapshot, current, max_nodes) if max_nodes is not None \
        else ((), ())
    if spares:
        usable = {k: d for k, d in usable.items() if d.node in planned}
    store_node, store = snapshot.store_for(snapshot.self_node)
    if current is None:
        alive = snapshot.alive_nodes()
        if len(alive) < min_nodes:
            return None
        ordered = _ordered(usable)
        by_node: dict[str, list[str]] = {}
        for d in ordered:
            by_node.setdefault(d.node, []).append(d.id)
        changes = tuple(Change(ChangeKind.JOIN, n, tuple(by_node.get(n, ())))
                        for n in alive if n not in spares)
        return PlanDecision(1, "start", changes, ordered, store_node, store)
    changes = _changes(snapshot, assumed_inventory(current), usable, spares) \
        or _retries(snapshot, current)
    store_lost = current.store_endpoint not in {
        v.store_endpoint for v in snapshot.nodes.values()
        if v.alive and v.store_endpoint and not v.cut_off}
    if not changes and not (store_lost and store):
        return None
    ordered = _ordered(usable)
    reasons = [c.describe() for c in changes]
    if store_lost and store:
        reasons.append(f"store {current.store_endpoint or '(none)'} -> {store}")
    retiring = tuple(d for d in current.devices if d in usable and d in snapshot.running)
    return PlanDecision(current.version + 1, "; ".join(reasons), changes, ordered, store_node,
                        store, drain_of(snapshot, current, usable), retiring)


def largest_cluster(snapshot: ClusterSnapshot, max_nodes: Optional[int]) -> str:
    """Pure: "" unless the usable devices are the largest cluster the job can ever have: the
    maximum of ``--nnodes`` (``max_nodes``; None: no maximum, more may come) of live nodes, none
    cut off, every device of them usable (a failed or suspect one may come back). Else one
    phrase for people: ``"2 node(s) of --nnodes max 2, 4 device(s)"``."""
    if max_nodes is None:
        return ""
    planned, _spares = select_nodes(snapshot, None, max_nodes)
    views = [snapshot.nodes[n] for n in planned]
    if len(views) < max_nodes or any(v.cut_off or not v.alive for v in views):
        return ""
    devices = [d for v in views for d in v.devices]
    if not devices or any(d.state in ("failed", "suspect") for d in devices):
        return ""
    return f"{len(views)} node(s) of --nnodes max {max_nodes}, {len(devices)} device(s)"


def drain_of(snapshot: ClusterSnapshot, current: schema.PlanRecord,
             usable: Mapping[str, DeviceView]) -> tuple[str, ...]:
    """Pure: the devices the next plan drains: computing in ``current``, not ``usable`` but
    suspect (still working), on a live node, with a running worker (one that holds state)."""
    out = []
    for dev in current.devices:
        if dev in usable:  # most devices: the lookups below scan a node's devices
            continue
        view = snapshot.device(dev)
        node = snapshot.nodes.get(node_of(dev))
        if (view is not None and view.state == "suspect"
                and node is not None and node.alive and dev in snapshot.running):
            out.append(dev)
    return tuple(sorted(out, key=device_sort_key))


def _retries(snapshot: ClusterSnapshot, current: schema.PlanRecord) -> tuple[Change, ...]:
    """Pure: one ``retry`` change per node of ``current`` whose workers wait after their
    switch into it failed (``ClusterSnapshot.retry``); used only when nothing else changed,
    since any other change publishes a new plan anyway."""
    planned: dict[str, list[str]] = {}
    for dev in current.devices:
        planned.setdefault(node_of(dev), []).append(dev)
    return tuple(Change(ChangeKind.RETRY, n, tuple(planned[n]),
                        f"the switch into v{current.version} failed with no change to explain it")
                 for n in sorted(snapshot.retry)
                 if snapshot.retry[n] == current.version and n in planned)


def _ordered(usable: Mapping[str, DeviceView]) -> tuple[DeviceView, ...]:
    return tuple(usable[d] for d in sorted(usable, key=device_sort_key))


def _changes(snapshot: ClusterSnapshot, assumed: Mapping[str, float],
             usable: Mapping[str, DeviceView], spares: Sequence[str] = ()
             ) -> tuple[Change, ...]:
    """The differences between ``assumed`` (device -> speed) and ``usable``, grouped by node and
    kind, in a deterministic order. A planned node that is now a spare (only when the plan
    holds more nodes than the maximum, e.g. made by a leader given a larger one) leaves."""
    groups: dict[tuple[ChangeKind, str, str, bool], list[str]] = {}
    assumed_nodes = {node_of(d) for d in assumed}

    def add(kind: ChangeKind, dev: str, detail: str = "", journaled: bool = False) -> None:
        groups.setdefault((kind, node_of(dev), detail, journaled), []).append(dev)

    for dev in sorted(set(assumed) - set(usable), key=device_sort_key):
        node = node_of(dev)
        view, seen = snapshot.nodes.get(node), snapshot.device(dev)
        if view is None or not view.alive:
            add(ChangeKind.LEAVE, dev, "" if view is None else f"node {view.state}")
        elif view.cut_off:
            add(ChangeKind.UNREACHABLE, dev, view.cut_off)
        elif node in spares:
            add(ChangeKind.LEAVE, dev, "node spare: --nnodes max reached")
        elif seen is None:
            add(ChangeKind.FAILURE, dev, "device no longer reported")
        elif seen.origin == schema.VerdictOrigin.STALL.value:
            add(ChangeKind.STALL, dev, seen.reason, journaled=True)
        elif seen.origin == schema.VerdictOrigin.EXIT.value:
            add(ChangeKind.FAILURE, dev, seen.reason, journaled=True)
        elif seen.state == "suspect":
            add(ChangeKind.DRAIN, dev, seen.reason)
        else:
            add(ChangeKind.FAILURE, dev, seen.reason)
    for dev in sorted(set(usable) - set(assumed), key=device_sort_key):
        node = usable[dev].node
        add(ChangeKind.RECOVER if node in assumed_nodes else ChangeKind.JOIN, dev)
    # Only the devices whose speed changed are sorted (all of them are compared).
    moved = [dev for dev in usable.keys() & assumed.keys()
             if abs(assumed[dev] - usable[dev].speed) > 1e-9]
    for dev in sorted(moved, key=device_sort_key):
        old, new = assumed[dev], usable[dev].speed
        kind = ChangeKind.DEGRADE if new < old else ChangeKind.RECOVER
        add(kind, dev, f"speed {old:.0%} -> {new:.0%}")
    order = {k: i for i, k in enumerate(ChangeKind)}
    keys = sorted(groups, key=lambda k: (order[k[0]], k[1], k[2]))
    return tuple(Change(k[0], k[1], tuple(groups[k]), k[2], k[3]) for k in keys)
