"""The leader: the elected node agent that turns failure, join and slow-down into a new plan.

Every agent runs a ``Leader``; it campaigns through ``coord.Election`` and only the elected one
acts. While leading it watches ``nodes/``, ``devices/``, ``workers/`` and ``plan/current``
(``PrefixWatch``, list-then-watch) and runs a level-triggered loop. Promises:

* the decision is pure: ``build_snapshot`` turns records into a ``ClusterSnapshot`` (usable
  devices per node with type and speed; failed devices and nodes that are leaving are out) and
  ``decide(snapshot, current_plan)`` returns a ``PlanDecision`` exactly when the usable devices,
  their speeds, or the store host differ from what the current plan assumed (its
  ``inventory``), or when no plan exists yet and ``min_nodes`` nodes are up;
* at most ``max_nodes`` nodes are planned over (the maximum of ``--nnodes``; None: all):
  ``select_nodes`` keeps the current plan's nodes, then takes the lowest node ids; the other
  live nodes are hot spares (registered, leased, running no worker, logged once by the
  leader) until a planned node is gone, when the next replan takes one in its place (a join);
* changes are debounced: a replan waits until the decision has been stable for ``debounce_s``
  (at most ``max_debounce_s`` after the first change), on the injected ``clock``; a storm of
  failures yields one publication, or a few;
* each replan re-reads ``plan/current``, decides again from it, plans (``planner_fn``, normally
  ``planner.plan_for``; a DP plan over the usable devices when no planner is given or it fails
  for a reason other than infeasibility) and publishes version+1 with ``coord.publish_plan``
  (one transaction fenced on leadership and on the revision decided from); a conflict re-reads
  and decides again; a rejected fence means leadership is lost: the leader stops and the next
  one re-reads the world and converges; a plan the planner finds infeasible is not retried
  until the cluster changes again (the current plan stays);
* the store of a new plan is the TCPStore a live agent advertises in its node record: the
  leader's own when it has one, else the lowest node id's (deterministic); CPU-only jobs ask the
  planner to give every worker slot a role, and a cluster of two nodes or more asks for every
  parameter slice on two nodes (``default_planner_options``);
* after a publication the journal gets one event per change (``leave``, ``join``, ``failure``,
  ``stall``, ``degrade``, ``recover``; failures and stalls an agent already journaled, marked by
  the verdict reasons ``EXIT_PREFIX``/``STALL_PREFIX``, are not repeated) and one ``replan``
  event with the timings of detection -> publication;
* the leader's lifecycle is the state machine ``LeaderState``/``TRANSITIONS`` with a timestamped
  history; every etcd call has a deadline, every wait a timeout, ``stop`` joins within its own.

Device ids are ``"<node_id>:<index>"``; in a published plan the ints of ``strategy`` index
``PlanRecord.devices`` (the worker's rank in that plan's process group).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import (
    ConflictError,
    CoordinationError,
    EventType,
    FencedWriteRejected,
    WatchEvent,
)
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.election import Election
from hspmd_elastic.coord.journal import append_event
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.plans import publish_plan, read_plan
from hspmd_elastic.coord.watch import PrefixWatch
from hspmd_elastic.plan import Pipeline, Plan, PlanError, Stage
from launcher.health.verdicts import summarize_device_health

log = logging.getLogger(__name__)

EXIT_PREFIX = "worker exit: "  # verdict reason of a slot whose worker died (agent journaled it)
STALL_PREFIX = "stall: "  # verdict reason of a slot whose worker hung (agent journaled it)
GONE_NODE_STATES = ("draining", "leaving", "failed")
DEFAULT_DEBOUNCE_S = 1.0
DEFAULT_MAX_DEBOUNCE_S = 10.0
TICK_S = 0.05  # re-check period while debouncing (real seconds; the debounce clock is injected)
IDLE_RECHECK_S = 1.0  # level-triggered re-check even without watch events
WATCH_START_S = 5.0
STOP_TIMEOUT_S = 5.0

PlannerFn = Callable[..., Any]
Clock = Callable[[], float]


# ----------------------------------------------------------------------------------- errors
class LeaderError(Exception):
    """Root of the leader's errors; ``str(err)`` is one line."""


class IllegalLeaderTransition(LeaderError):
    """A state change the ``TRANSITIONS`` table does not allow (a bug)."""


class PlanningFailed(LeaderError):
    """No plan could be made for a decision (the planner found it infeasible)."""


# ----------------------------------------------------------------------------------- ids
def device_id(node: str, index: int) -> str:
    return f"{node}:{index}"


def parse_device_id(dev: str) -> tuple[str, int]:
    node, sep, index = dev.rpartition(":")
    if not sep or not node or not index.isdigit():
        raise ValueError(f"device id {dev!r} is not <node_id>:<index>")
    return node, int(index)


def device_sort_key(dev: str) -> tuple[str, int]:
    return parse_device_id(dev)


# ----------------------------------------------------------------------------------- snapshot
@dataclass(frozen=True)
class DeviceView:
    """One device slot as the leader sees it. ``speed``: relative to nominal (1.0 nominal)."""

    id: str
    node: str
    index: int
    type: str
    memory_bytes: int
    state: str = "healthy"  # healthy | degraded | failed
    speed: float = 1.0
    reason: str = ""


@dataclass(frozen=True)
class NodeView:
    node: str
    host: str
    state: str
    store_endpoint: str
    devices: tuple[DeviceView, ...]

    @property
    def alive(self) -> bool:
        return self.state not in GONE_NODE_STATES


@dataclass(frozen=True)
class ClusterSnapshot:
    """The cluster at one moment, as records said it. ``self_node``: the leader's node."""

    nodes: Mapping[str, NodeView]
    self_node: str = ""
    step: Optional[int] = None  # the furthest step any worker reported

    def usable(self) -> dict[str, DeviceView]:
        return {d.id: d for n in self.nodes.values() if n.alive for d in n.devices
                if d.state != "failed"}

    def device(self, dev: str) -> Optional[DeviceView]:
        node, _ = parse_device_id(dev)
        view = self.nodes.get(node)
        return next((d for d in view.devices if d.id == dev), None) if view else None

    def alive_nodes(self) -> list[str]:
        return sorted(n for n, v in self.nodes.items() if v.alive)

    def store_for(self, prefer: str) -> tuple[str, str]:
        """(node, endpoint) of a store hosted by a live agent: ``prefer``'s, else the lowest
        node id's; ("", "") when no live agent advertises one."""
        live = {n: v.store_endpoint for n, v in self.nodes.items() if v.alive and v.store_endpoint}
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
                   default_slowdown: float = 0.5) -> ClusterSnapshot:
    """Pure: node records + health verdicts (+ worker progress) -> ``ClusterSnapshot``."""
    health = summarize_device_health(verdicts, default_slowdown=default_slowdown)
    views = {}
    for name, rec in nodes.items():
        devs = []
        for info in sorted(rec.devices, key=lambda d: d.index):
            where = (name, info.index)
            if where in health.failed:
                state, speed, reason = "failed", 0.0, health.failed[where]
            elif where in health.slowdown:
                state, speed = "degraded", float(health.slowdown[where])
                reason = verdicts[where].reason
            else:
                state, speed, reason = "healthy", 1.0, ""
            devs.append(DeviceView(device_id(name, info.index), name, info.index, info.type,
                                   info.memory_bytes, state, speed, reason))
        views[name] = NodeView(name, rec.host, rec.state, rec.store_endpoint, tuple(devs))
    steps = [w.step for w in (workers or {}).values()]
    return ClusterSnapshot(views, self_node, max(steps) if steps else None)


# ----------------------------------------------------------------------------------- decision
class ChangeKind(str, enum.Enum):
    JOIN = "join"
    LEAVE = "leave"
    FAILURE = "failure"
    STALL = "stall"
    DEGRADE = "degrade"
    RECOVER = "recover"


@dataclass(frozen=True)
class Change:
    """What changed since the current plan, for one node (``devices``: the ids concerned)."""

    kind: ChangeKind
    node: str
    devices: tuple[str, ...]
    detail: str = ""
    journaled: bool = False  # already in the journal (an agent reported it)

    def describe(self) -> str:
        if self.kind in (ChangeKind.JOIN, ChangeKind.LEAVE):
            return f"{self.kind.value} {self.node}"
        what = f"{self.kind.value} {','.join(self.devices)}"
        return f"{what}: {self.detail}" if self.detail else what


@dataclass(frozen=True)
class PlanDecision:
    """A new plan is needed: over ``devices`` (usable, in id order), for these reasons."""

    version: int
    reason: str
    changes: tuple[Change, ...]
    devices: tuple[DeviceView, ...]
    store_node: str
    store_endpoint: str

    @property
    def inventory(self) -> dict[str, float]:
        return {d.id: d.speed for d in self.devices}

    def fingerprint(self) -> tuple:
        """Equal for decisions that would give the same plan (the debounce compares these)."""
        return (self.version, tuple(sorted(self.inventory.items())), self.store_endpoint)


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
    kept = {parse_device_id(d)[0] for d in assumed_inventory(current)} if current else set()
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
    planned, spares = select_nodes(snapshot, current, max_nodes)
    if spares:
        usable = {k: d for k, d in usable.items() if d.node in planned}
    store_node, store = snapshot.store_for(snapshot.self_node)
    ordered = tuple(usable[d] for d in sorted(usable, key=device_sort_key))
    if current is None:
        if len(snapshot.alive_nodes()) < min_nodes:
            return None
        changes = tuple(Change(ChangeKind.JOIN, n, tuple(d.id for d in ordered if d.node == n))
                        for n in snapshot.alive_nodes() if n not in spares)
        return PlanDecision(1, "start", changes, ordered, store_node, store)
    changes = _changes(snapshot, assumed_inventory(current), usable, spares)
    store_lost = current.store_endpoint not in {
        v.store_endpoint for v in snapshot.nodes.values() if v.alive and v.store_endpoint}
    if not changes and not (store_lost and store):
        return None
    reasons = [c.describe() for c in changes]
    if store_lost and store:
        reasons.append(f"store {current.store_endpoint or '(none)'} -> {store}")
    return PlanDecision(current.version + 1, "; ".join(reasons), changes, ordered, store_node,
                        store)


def _changes(snapshot: ClusterSnapshot, assumed: Mapping[str, float],
             usable: Mapping[str, DeviceView], spares: Sequence[str] = ()
             ) -> tuple[Change, ...]:
    """The differences between ``assumed`` (device -> speed) and ``usable``, grouped by node and
    kind, in a deterministic order. A planned node that is now a spare (only when the plan
    holds more nodes than the maximum, e.g. made by a leader given a larger one) leaves."""
    groups: dict[tuple[ChangeKind, str, str, bool], list[str]] = {}
    assumed_nodes = {parse_device_id(d)[0] for d in assumed}

    def add(kind: ChangeKind, dev: str, detail: str = "", journaled: bool = False) -> None:
        groups.setdefault((kind, parse_device_id(dev)[0], detail, journaled), []).append(dev)

    for dev in sorted(set(assumed) - set(usable), key=device_sort_key):
        node, _ = parse_device_id(dev)
        view, seen = snapshot.nodes.get(node), snapshot.device(dev)
        if view is None or not view.alive:
            add(ChangeKind.LEAVE, dev, "" if view is None else f"node {view.state}")
        elif node in spares:
            add(ChangeKind.LEAVE, dev, "node spare: --nnodes max reached")
        elif seen is None:
            add(ChangeKind.FAILURE, dev, "device no longer reported")
        elif seen.reason.startswith(STALL_PREFIX):
            add(ChangeKind.STALL, dev, seen.reason[len(STALL_PREFIX):], journaled=True)
        elif seen.reason.startswith(EXIT_PREFIX):
            add(ChangeKind.FAILURE, dev, seen.reason[len(EXIT_PREFIX):], journaled=True)
        else:
            add(ChangeKind.FAILURE, dev, seen.reason)
    for dev in sorted(set(usable) - set(assumed), key=device_sort_key):
        node = usable[dev].node
        add(ChangeKind.RECOVER if node in assumed_nodes else ChangeKind.JOIN, dev)
    for dev in sorted(set(usable) & set(assumed), key=device_sort_key):
        old, new = assumed[dev], usable[dev].speed
        if abs(old - new) > 1e-9:
            kind = ChangeKind.DEGRADE if new < old else ChangeKind.RECOVER
            add(kind, dev, f"speed {old:.0%} -> {new:.0%}")
    order = {k: i for i, k in enumerate(ChangeKind)}
    keys = sorted(groups, key=lambda k: (order[k[0]], k[1], k[2]))
    return tuple(Change(k[0], k[1], tuple(groups[k]), k[2], k[3]) for k in keys)


# ----------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class PlannedLayout:
    """A plan over compact ids (``devices[i]`` is device ``i``) and who made it."""

    plan: Plan
    devices: tuple[str, ...]
    planner: str  # "plan_for" or "fallback-dp"


def fallback_dp_plan(device_ids: Sequence[int], num_layers: int, global_batch: int) -> Plan:
    """The fallback: pure data parallelism, one single-stage pipeline per device, the global
    batch split as evenly as possible (the first ``global_batch % n`` pipelines get one more
    row); with more devices than rows, the first ``global_batch`` devices are used."""
    ids = sorted(device_ids)[:global_batch]
    if not ids:
        raise PlanningFailed("fallback DP plan: no usable device")
    base, extra = divmod(global_batch, len(ids))
    pipes = tuple(Pipeline((Stage((d,), (0, num_layers)),), 1, base + (1 if i < extra else 0))
                  for i, d in enumerate(ids))
    return Plan(pipes, global_batch, num_layers)


def remap_plan(plan: Plan, mapping: Mapping[int, int]) -> Plan:
    """``plan`` with every device id ``d`` replaced by ``mapping[d]``."""
    data = plan.to_dict()
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["devices"] = [mapping[d] for d in stage["devices"]]
    return Plan.from_dict(data)


def default_planner_options(devices: Sequence[DeviceView]):
    """The planner's options for this cluster.

    CPU jobs expect a role for every worker slot: ask the planner to use every device. When the
    devices span two nodes or more, rank plans that keep every parameter slice on two nodes
    first, so that losing one node is a reshard from the survivors, not a checkpoint reload
    (a preference: a cluster where no such plan fits still gets the fastest plan)."""
    from hspmd_elastic.planner import PlannerOptions

    return PlannerOptions(use_all_devices=all(d.type.upper() == "CPU" for d in devices),
                          cross_node_replicas=len({d.node for d in devices}) >= 2)


def make_layout(decision: PlanDecision, current: Optional[schema.PlanRecord],
                planner_fn: Optional[PlannerFn], profile: Any, global_batch: int,
                options: Any = None) -> PlannedLayout:
    """Pure (given a pure ``planner_fn``): the plan for ``decision``.

    The planner's inventory holds the usable devices plus the current plan's lost ones (as
    failed), ids in device-id order, so the current plan can be handed over for its
    switch-cost preference. Raises ``PlanningFailed`` when the planner finds no plan."""
    from hspmd_elastic.planner import (Device, Health, Inventory, PlanInfeasibleError,
                                       spec_for_device)

    usable = {d.id: d for d in decision.devices}
    old = list(current.devices) if current else []
    universe = sorted(set(usable) | set(old), key=device_sort_key)
    ids = {dev: i for i, dev in enumerate(universe)}
    planner = "plan_for"
    plan: Optional[Plan] = None
    if planner_fn is not None:
        try:
            fallback_type = decision.devices[0].type
            devs = []
            for dev in universe:
                v = usable.get(dev)
                if v is None:
                    spec = spec_for_device(fallback_type)
                    devs.append(Device(ids[dev], parse_device_id(dev)[0], spec, Health.FAILED))
                    continue
                spec = spec_for_device(v.type, v.memory_bytes or None)
                health = Health.DEGRADED if v.state == "degraded" else Health.HEALTHY
                devs.append(Device(ids[dev], v.node, spec, health, 1.0 / max(v.speed, 1e-6)))
            opts = options if options is not None else default_planner_options(decision.devices)
            result = planner_fn(Inventory(tuple(devs)), profile, global_batch,
                                current_plan=_current_in(current, ids), options=opts)
            plan = getattr(result, "plan", result)
        except PlanInfeasibleError as exc:
            raise PlanningFailed(f"plan v{decision.version}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the planner is optional: fall back, say why
            log.warning("plan v%d: planner failed (%s: %s); using the fallback DP plan",
                        decision.version, type(exc).__name__, exc)
            plan = None
    if plan is None:
        planner = "fallback-dp"
        plan = fallback_dp_plan([ids[d] for d in usable], profile.num_layers, global_batch)
    used = sorted(plan.devices)
    compact = {u: k for k, u in enumerate(used)}
    return PlannedLayout(remap_plan(plan, compact), tuple(universe[u] for u in used), planner)


def _current_in(current: Optional[schema.PlanRecord], ids: Mapping[str, int]) -> Optional[Plan]:
    """The current plan with its device ints moved to the inventory's ids (None if unreadable)."""
    if current is None or not current.strategy:
        return None
    try:
        plan = Plan.from_dict(current.strategy)
        return remap_plan(plan, {i: ids[dev] for i, dev in enumerate(current.devices)})
    except (PlanError, KeyError, IndexError, TypeError) as exc:
        log.info("current plan v%d is not a plan the planner reads (%s)", current.version, exc)
        return None


def plan_record(decision: PlanDecision, layout: PlannedLayout, created_at: float
                ) -> schema.PlanRecord:
    return schema.PlanRecord(version=decision.version, reason=decision.reason,
                             devices=list(layout.devices), strategy=layout.plan.to_dict(),
                             store_endpoint=decision.store_endpoint, created_at=created_at,
                             inventory=decision.inventory)



# ----------------------------------------------------------------------------------- state machine
class LeaderState(str, enum.Enum):
    FOLLOWER = "follower"  # not elected (or not yet watching)
    WATCHING = "watching"  # leading; the cluster matches the current plan
    DEBOUNCING = "debouncing"  # a change was seen; waiting for the cluster to settle
    PLANNING = "planning"  # re-reading the plan and asking the planner
    PUBLISHING = "publishing"  # the fenced write of plan/current
    STOPPED = "stopped"


_S = LeaderState
# Bounds per state: DEBOUNCING ends within max_debounce_s of the first change; PLANNING is one
# pure planner call; PUBLISHING and every etcd read have the client's deadline.
TRANSITIONS: dict[LeaderState, frozenset] = {
    _S.FOLLOWER: frozenset({_S.WATCHING, _S.STOPPED}),
    _S.WATCHING: frozenset({_S.DEBOUNCING, _S.FOLLOWER, _S.STOPPED}),
    _S.DEBOUNCING: frozenset({_S.PLANNING, _S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.PLANNING: frozenset({_S.PUBLISHING, _S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.PUBLISHING: frozenset({_S.WATCHING, _S.FOLLOWER, _S.STOPPED}),
    _S.STOPPED: frozenset(),
}


class Outcome(str, enum.Enum):
    """How one replan attempt ended."""

    PUBLISHED = "published"
    NO_CHANGE = "no-change"  # a fresh read showed nothing to do (someone published already)
    CONFLICT = "conflict"  # plan/current changed under us: re-read and decide again
    DEPOSED = "deposed"  # the fenced write was rejected: we no longer lead
    INFEASIBLE = "infeasible"  # the planner found no plan for these devices
    ETCD_ERROR = "etcd-error"  # etcd did not answer in time: the next tick re-reads


@dataclass(frozen=True)
class Publication:
    version: int
    reason: str
    devices: tuple[str, ...]
    planner: str
    timings: dict[str, float] = field(default_factory=dict)


class _World:
    """What the watches delivered, keyed like the records; one lock, no I/O."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nodes: dict[str, schema.NodeRecord] = {}
        self.verdicts: dict[tuple[str, int], schema.DeviceHealthRecord] = {}
        self.workers: dict[tuple[str, int], schema.WorkerRecord] = {}
        self.plan: Optional[schema.PlanRecord] = None
        self.plan_rev = 0

    def apply(self, ev: WatchEvent) -> None:
        try:
            _, spec, params = schema.match_key(ev.key)
        except CoordinationError:
            return
        put = ev.type is EventType.PUT
        with self.lock:
            if spec.record is schema.PlanRecord:
                if spec.pattern == "plan/current" and put:
                    self.set_plan_locked(ev.record, ev.revision)
                return
            if spec.record is schema.NodeRecord:
                table, key = self.nodes, params["node_id"]
            elif spec.record is schema.DeviceHealthRecord:
                table, key = self.verdicts, (params["node_id"], int(params["index"]))
            elif spec.record is schema.WorkerRecord:
                table, key = self.workers, (params["node_id"], int(params["local_rank"]))
            else:
                return
            if put:
                table[key] = ev.record
            else:
                table.pop(key, None)

    def set_plan_locked(self, plan: Optional[schema.PlanRecord], revision: int) -> None:
        if plan is not None and revision >= self.plan_rev:
            self.plan, self.plan_rev = plan, revision

    def snapshot(self, self_node: str) -> tuple[ClusterSnapshot, Optional[schema.PlanRecord]]:
        with self.lock:
            snap = build_snapshot(dict(self.nodes), dict(self.verdicts), self_node,
                                  dict(self.workers))
            return snap, self.plan


# ----------------------------------------------------------------------------------- the leader
class Leader:
    """The leader side of one node agent (see the module docstring). ``start`` / ``stop``."""

    def __init__(self, client: EtcdClient, session: LeasedSession, job: str, node: str,
                 planner_fn: Optional[PlannerFn], model_profile: Any, global_batch: int,
                 debounce_s: float = DEFAULT_DEBOUNCE_S, clock: Clock = time.monotonic, *,
                 max_debounce_s: float = DEFAULT_MAX_DEBOUNCE_S, min_nodes: int = 1,
                 max_nodes: Optional[int] = None, planner_options: Any = None,
                 wall_clock: Clock = time.time, election_recheck_s: float = 1.0):
        if debounce_s < 0 or max_debounce_s < debounce_s:
            raise ValueError(f"need 0 <= debounce_s ({debounce_s}) <= max_debounce_s "
                             f"({max_debounce_s})")
        if min_nodes < 1:
            raise ValueError(f"min_nodes={min_nodes} must be >= 1")
        if max_nodes is not None and max_nodes < min_nodes:
            raise ValueError(f"need min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        self.client, self.job, self.node = client, job, node
        self.planner_fn, self.profile, self.global_batch = planner_fn, model_profile, global_batch
        self.planner_options = planner_options
        self.debounce_s, self.max_debounce_s, self.min_nodes = debounce_s, max_debounce_s, min_nodes
        self.max_nodes = max_nodes
        self._clock, self._wall = clock, wall_clock
        self.election = Election(client, session, job, node, on_change=self._on_leadership,
                                 recheck_s=election_recheck_s, wall_clock=wall_clock)
        self._lock = threading.Lock()
        self._state = LeaderState.FOLLOWER
        self._history: list[tuple[LeaderState, float, float, str]] = [
            (LeaderState.FOLLOWER, clock(), wall_clock(), "created")]
        self.publications: list[Publication] = []
        self.outcomes: list[Outcome] = []
        self.pending: Optional[PlanDecision] = None  # the decision being debounced
        self._first_at = self._last_at = 0.0
        self._fingerprint: Optional[tuple] = None
        self._infeasible: Optional[tuple] = None
        self._no_devices = False
        self._spares: set[str] = set()  # nodes said to be spares (logged once each)
        self._world: Optional[_World] = None
        self._watches: list[PrefixWatch] = []
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> LeaderState:
        with self._lock:
            return self._state

    def history(self) -> list[tuple[LeaderState, float, float, str]]:
        with self._lock:
            return list(self._history)

    def start(self) -> "Leader":
        """Join the election and start the loop. Raises CoordinationError if etcd is away."""
        self.election.campaign(0.0)
        self._thread = threading.Thread(target=self._run, name=f"leader-{self.node}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the loop and the watches and leave the election, within about ``timeout``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("[%s] leader %s: loop did not stop within %.1fs", self.job,
                            self.node, timeout)
        self._stop_watches(timeout)
        self.election.resign(timeout)
        if self.state is not LeaderState.STOPPED:
            self._transition(LeaderState.STOPPED, "stopped")

    def poke(self) -> None:
        """Re-check now (e.g. after a test advanced the injected clock)."""
        self._wake.set()

    def _transition(self, new: LeaderState, reason: str) -> None:
        with self._lock:
            old = self._state
            if new is old:
                return
            if new not in TRANSITIONS[old]:
                raise IllegalLeaderTransition(f"leader state {old.value} -> {new.value}")
            self._state = new
            self._history.append((new, self._clock(), self._wall(), reason))
            del self._history[:-256]
        log.info("[%s] leader %s: %s -> %s (%s)", self.job, self.node, old.value, new.value,
                 reason)

    def _on_leadership(self, leading: bool) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                delay = self._tick()
            except CoordinationError as exc:
                log.info("[%s] leader %s: %s; retrying", self.job, self.node, exc)
                delay = 4 * TICK_S
            except Exception:  # noqa: BLE001 - the loop must survive a bug in one tick
                log.exception("[%s] leader %s: unexpected error", self.job, self.node)
                delay = IDLE_RECHECK_S
            self._wake.wait(delay)

    def _tick(self) -> float:
        """One level-triggered step; returns how long to wait (real seconds) at most."""
        if not self.election.is_leader:
            if self.state is not LeaderState.FOLLOWER:
                self._step_down("leadership lost")
            return IDLE_RECHECK_S
        if self.state is LeaderState.FOLLOWER:
            self._take_office()
        snap, current = self._world.snapshot(self.node)
        self._note_spares(snap, current)
        decision = decide(snap, current, self.min_nodes, self.max_nodes)
        fp = decision.fingerprint() if decision else None
        if decision is None or fp == self._infeasible:
            self._note_no_devices(snap, current)
            self.pending = None
            if self.state is LeaderState.DEBOUNCING:
                self._transition(LeaderState.WATCHING, "change gone")
            return IDLE_RECHECK_S
        now = self._clock()
        if self.state is LeaderState.WATCHING:
            self._first_at = self._last_at = now
            self._transition(LeaderState.DEBOUNCING, decision.reason)
        elif fp != self._fingerprint:
            self._last_at = now
        self._fingerprint, self.pending = fp, decision
        due = min(self._last_at + self.debounce_s, self._first_at + self.max_debounce_s)
        if now < due:
            return TICK_S
        self._replan(self._first_at)
        return TICK_S

    def _note_no_devices(self, snap: ClusterSnapshot, current: Optional[schema.PlanRecord]
                         ) -> None:
        """Say once (per outage) that nothing is left to plan on; the plan stays as it is."""
        empty = current is not None and not snap.usable()
        if empty and not self._no_devices:
            log.error("[%s] leader %s: no usable device left; keeping plan v%d until one "
                      "returns", self.job, self.node, current.version)
        self._no_devices = empty

    def _note_spares(self, snap: ClusterSnapshot, current: Optional[schema.PlanRecord]
                     ) -> None:
        """Say once per node (again only after it was planned in meanwhile) that it is a spare,
        so an operator who started more nodes than ``--nnodes`` allows sees why one idles."""
        if self.max_nodes is None:
            return
        _, spares = select_nodes(snap, current, self.max_nodes)
        for node in spares:
            if node not in self._spares:
                log.info("[%s] leader %s: node %s is a spare: --nnodes max %d reached", self.job,
                         self.node, node, self.max_nodes)
        self._spares = set(spares)

    def _take_office(self) -> None:
        world = _World()
        prefixes = [schema.nodes_prefix(self.job), schema.devices_prefix(self.job),
                    schema.workers_prefix(self.job), schema.plan_current_key(self.job)]
        watches = []
        try:
            for prefix in prefixes:
                watch = PrefixWatch(self.client, prefix, lambda ev, w=world: self._on_event(w, ev),
                                    decode=True, initial=True,
                                    name=f"leader {self.node} {prefix.rstrip('/').split('/')[-1]}")
                watches.append(watch.start(WATCH_START_S))
        except BaseException:
            for watch in watches:
                watch.stop(STOP_TIMEOUT_S)
            raise
        self._world, self._watches = world, watches
        self._infeasible = None
        self._transition(LeaderState.WATCHING, f"elected (term {self.election.term})")

    def _on_event(self, world: _World, ev: WatchEvent) -> None:
        world.apply(ev)
        self._wake.set()

    def _step_down(self, reason: str) -> None:
        self._stop_watches(STOP_TIMEOUT_S)
        self.pending = None
        self._transition(LeaderState.FOLLOWER, reason)

    def _stop_watches(self, timeout: float) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.stop(timeout)

    # ------------------------------------------------------------------ replan
    def _replan(self, first_at: float) -> Outcome:
        """Re-read, decide, plan, publish (fenced), journal; the outcome is in ``outcomes``
        before the state leaves PUBLISHING. Never raises CoordinationError."""
        self._transition(LeaderState.PLANNING, "debounce over")
        t0 = self._clock()
        try:
            current, rev = read_plan(self.client, self.job)
        except CoordinationError as exc:
            return self._back(Outcome.ETCD_ERROR, f"reading the plan: {exc}")
        with self._world.lock:
            self._world.set_plan_locked(current, rev)
        snap, _ = self._world.snapshot(self.node)
        decision = decide(snap, current, self.min_nodes, self.max_nodes)
        if decision is None:
            return self._back(Outcome.NO_CHANGE, "nothing to do after a fresh read")
        try:
            layout = make_layout(decision, current, self.planner_fn, self.profile,
                                 self.global_batch, self.planner_options)
        except PlanningFailed as exc:
            log.error("[%s] leader %s: %s; waiting for the cluster to change", self.job,
                      self.node, exc)
            self._infeasible = decision.fingerprint()
            return self._back(Outcome.INFEASIBLE, str(exc))
        t1 = self._clock()
        record = plan_record(decision, layout, self._wall())
        self._transition(LeaderState.PUBLISHING, f"v{decision.version}: {decision.reason}")
        try:
            revision = publish_plan(self.election, record, rev, current.version if current else 0)
        except FencedWriteRejected as exc:
            log.warning("[%s] leader %s: plan v%d rejected, no longer leader: %s", self.job,
                        self.node, decision.version, exc)
            self.outcomes.append(Outcome.DEPOSED)
            self._step_down("publish rejected: deposed")
            return Outcome.DEPOSED
        except ConflictError as exc:
            return self._back(Outcome.CONFLICT, str(exc))
        except CoordinationError as exc:
            return self._back(Outcome.ETCD_ERROR, f"publishing v{decision.version}: {exc}")
        t2 = self._clock()
        with self._world.lock:
            self._world.set_plan_locked(record, revision)
        timings = {"debounce_s": t0 - first_at, "plan_s": t1 - t0, "publish_s": t2 - t1,
                   "detect_to_publish_s": t2 - first_at}
        log.info("[%s] leader %s: published plan v%d over %d device(s) (%s, store %s, step %s) "
                 "in %.3fs: %s", self.job, self.node, decision.version, len(layout.devices),
                 layout.planner, decision.store_endpoint or "none", snap.step,
                 timings["detect_to_publish_s"], decision.reason)
        self.publications.append(Publication(decision.version, decision.reason, layout.devices,
                                             layout.planner, timings))
        self.outcomes.append(Outcome.PUBLISHED)
        self._journal(decision, layout, current, snap, timings)
        self.pending = None
        self._transition(LeaderState.WATCHING, f"published v{decision.version}")
        return Outcome.PUBLISHED

    def _back(self, outcome: Outcome, why: str) -> Outcome:
        log.info("[%s] leader %s: replan %s: %s", self.job, self.node, outcome.value, why)
        self.outcomes.append(outcome)
        self._transition(LeaderState.WATCHING, outcome.value)
        return outcome

    def _journal(self, decision: PlanDecision, layout: PlannedLayout,
                 current: Optional[schema.PlanRecord], snap: ClusterSnapshot,
                 timings: dict[str, float]) -> None:
        """The change events and the replan event (the plan is out already: failures here are
        logged, not retried)."""
        try:
            for change in decision.changes:
                if change.journaled:
                    continue
                append_event(self.client, self.job, change.kind.value, node=change.node,
                             detail={"devices": list(change.devices), "detail": change.detail,
                                     "plan_version": decision.version}, wall_clock=self._wall)
            append_event(self.client, self.job, "replan", node=self.node, detail={
                "version": decision.version, "previous_version": current.version if current else 0,
                "reason": decision.reason, "devices": len(layout.devices),
                "planner": layout.planner, "store_endpoint": decision.store_endpoint,
                "step": snap.step, "changes": [c.describe() for c in decision.changes],
            }, timings=timings, wall_clock=self._wall)
        except CoordinationError as exc:
            log.warning("[%s] leader %s: plan v%d published but not journaled: %s", self.job,
                        self.node, decision.version, exc)
