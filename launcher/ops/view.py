"""``JobView``: what an operator sees of a job, as a pure function of the job's etcd records.

Promises:

* ``JobView.build(job, records, now=...)`` takes (key, decoded record) pairs of one job (as
  ``decode_pairs`` makes from a prefix read or a watch cache) and does no I/O: the same records
  and ``now`` give the same view;
* keys that do not decode are kept as ``bad_records`` (key, problem), never raised;
* things a job has not written yet (no plan, no leader, no verdicts) are ``None``/empty, not
  errors: a node's devices come from its node record, its health verdicts and the current plan;
  a device without a verdict is ``unknown``; a node named by the plan or the rendezvous but
  without a node record is ``lost`` (its agent's lease ended);
* switches and counters come from the whole event journal (``events.py`` says how events pair
  into switches);
* a usable device the current plan was made over (its ``inventory``) but gives no role is
  ``idle``, with why (``idle_reason``: the newest ``speeds`` decision's numbers for it);
* a device's ``planned_speed`` is the current plan's ``inventory`` entry for it, its
  ``measured_speed`` the newest ``speeds`` event of the current plan (``measured``; 1.0: the
  fastest device); a worker's ``busy_s`` is its record's (0: not measured yet). A speed that is
  not a positive finite number, or a busy time that is not a finite one >= 0, is shown as not
  known (``None`` / 0), never passed on;
* ``document()`` is the stable JSON document of ``status --json`` and ``/api/state``
  (``format``/``version`` from ``api.py``; fields in docs/operations.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import RecordError
from hspmd_elastic.contract.ids import parse_device_id
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.plan import Plan, PlanError

from launcher.ops.api import HEALTH_STATES, RECENT_EVENTS, STATUS_FORMAT, STATUS_VERSION
from launcher.ops.events import SwitchView, counters_of, event_dict, switches_of


# ------------------------------------------------------------------------------ view values
@dataclass
class DeviceView:
    node: str
    index: int
    type: str = ""
    memory_bytes: int = 0
    uuid: str = ""
    health: str = "unknown"  # healthy | degraded | suspect | failed | unknown | lost
    reason: str = ""
    xid: Optional[int] = None
    slowdown: Optional[float] = None
    health_at: Optional[float] = None
    plan_rank: Optional[int] = None  # position in the current plan's device list
    placement: Optional[dict[str, int]] = None  # pipeline, stage, tp_rank
    replaced_by_plan: Optional[int] = None  # first plan version that dropped this device
    planned_speed: Optional[float] = None  # the current plan's inventory (1.0: nominal)
    measured_speed: Optional[float] = None  # newest ``speeds`` event of the plan (1.0: fastest)
    idle: Optional[str] = None  # why the current plan leaves this usable device idle

    @property
    def id(self) -> str:
        return f"{self.node}:{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "node": self.node, "index": self.index, "type": self.type,
                "memory_bytes": self.memory_bytes, "uuid": self.uuid, "health": self.health,
                "reason": self.reason, "xid": self.xid, "slowdown": self.slowdown,
                "health_at": self.health_at, "in_plan": self.plan_rank is not None,
                "plan_rank": self.plan_rank, "placement": self.placement,
                "replaced_by_plan": self.replaced_by_plan, "planned_speed": self.planned_speed,
                "measured_speed": self.measured_speed, "idle": self.idle}


@dataclass
class WorkerView:
    node: str
    local_rank: int
    global_rank: int
    pid: int
    plan_version: int
    step: int
    steps_per_s: float
    last_progress_at: float
    idle_s: float
    busy_s: float = 0.0  # the rank's own compute per step (0: not measured yet)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class NodeView:
    id: str
    present: bool  # the node record exists (the agent's lease is alive)
    state: str  # a NodeRecord state, or "lost"
    host: str = ""
    agent_pid: Optional[int] = None
    started_at: Optional[float] = None
    devices: list[DeviceView] = field(default_factory=list)
    workers: list[WorkerView] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "present": self.present, "state": self.state, "host": self.host,
                "agent_pid": self.agent_pid, "started_at": self.started_at,
                "devices": [d.to_dict() for d in self.devices],
                "workers": [w.to_dict() for w in self.workers]}


@dataclass
class PlanView:
    version: int
    reason: str
    created_at: float
    store_endpoint: str
    devices: list[str]
    strategy: dict[str, Any]
    pipelines: list[dict[str, Any]]  # [{index, num_microbatches, microbatch_size, stages: [...]}]
    num_layers: Optional[int] = None
    global_batch: Optional[int] = None
    layout_error: Optional[str] = None  # the strategy is not a Plan layout (shown raw)
    inventory: dict[str, float] = field(default_factory=dict)  # device -> relative speed
    # length buckets: [{window, start, rows, layout, switches}] (PlanRecord.buckets)
    buckets: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class WaitView:
    """A long wait in progress: ``done`` of ``total`` (None when the total is not known)."""

    kind: str  # rendezvous | switch (status --wait adds start: the job has no key yet)
    label: str
    done: int
    total: Optional[int]
    since: Optional[float]
    elapsed_s: Optional[float]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ---------------------------------------------------------------------------------- decoding
def decode_pairs(kvs: Iterable[tuple[str, bytes]]) -> tuple[list[tuple[str, schema.Record]],
                                                           list[tuple[str, str]]]:
    """Decode raw (key, value) pairs: (good (key, record) pairs, bad (key, problem) pairs)."""
    good, bad = [], []
    for key, raw in kvs:
        try:
            good.append((key, schema.decode(key, raw)))
        except RecordError as exc:
            bad.append((key, exc.problem))
    return good, bad


def _match(key: str) -> tuple[str, dict[str, str]]:
    _, spec, params = schema.match_key(key)
    return spec.pattern, params


# ------------------------------------------------------------------------------ the view
@dataclass
class JobView:
    job: str
    generated_at: float
    revision: int
    nodes: list[NodeView]
    leader: Optional[dict[str, Any]]
    plan: Optional[PlanView]
    plan_history: list[dict[str, Any]]
    events: list[schema.EventRecord]
    switches: list[SwitchView]
    counters: dict[str, Any]
    rendezvous: Optional[dict[str, Any]]
    waits: list[WaitView]
    throughput: dict[str, Any]
    bad_records: list[tuple[str, str]]

    @classmethod
    def build(cls, job: str, records: Iterable[tuple[str, schema.Record]], *, now: float,
              revision: int = 0, bad: Sequence[tuple[str, str]] = (),
              samples: Sequence[Sequence[float]] = (),
              leader_changes: Optional[int] = None) -> "JobView":
        return _build(job, list(records), now, revision, list(bad), list(samples),
                      leader_changes)

    @property
    def devices(self) -> list[DeviceView]:
        return [d for n in self.nodes for d in n.devices]

    def device_counts(self) -> dict[str, int]:
        counts = {s: 0 for s in HEALTH_STATES}
        for d in self.devices:
            counts[d.health if d.health in counts else "unknown"] += 1
        return counts

    def document(self) -> dict[str, Any]:
        """The stable JSON document (docs/operations.md, "The status document")."""
        devices = self.devices
        return {
            "format": STATUS_FORMAT,
            "version": STATUS_VERSION,
            "job": self.job,
            "generated_at": self.generated_at,
            "revision": self.revision,
            "leader": self.leader,
            "nodes": [n.to_dict() for n in self.nodes],
            "devices": {
                "counts": self.device_counts(),
                "failed": [d.to_dict() for d in devices if d.health == "failed"],
                "degraded": [d.to_dict() for d in devices if d.health == "degraded"],
                "suspect": [d.to_dict() for d in devices if d.health == "suspect"],
                "lost": [d.to_dict() for d in devices if d.health == "lost"],
            },
            "plan": self.plan.to_dict() if self.plan else None,
            "plan_history": self.plan_history,
            "throughput": self.throughput,
            "switches": {"recent": [s.to_dict() for s in self.switches[-RECENT_EVENTS:]],
                         **{k: self.counters[k] for k in ("total", "failed", "seconds_total",
                                                          "bytes_moved_total", "last_seconds")}},
            "events": {"total": len(self.events), "by_type": self.counters["events_by_type"],
                       "recent": [event_dict(e) for e in self.events[-RECENT_EVENTS:]]},
            "leader_changes": self.counters["leader_changes"],
            "rendezvous": self.rendezvous,
            "waits": [w.to_dict() for w in self.waits],
            "problems": [{"key": k, "problem": p} for k, p in self.bad_records],
        }


def _build(job: str, records: list[tuple[str, schema.Record]], now: float, revision: int,
           bad: list[tuple[str, str]], samples: list, leader_changes: Optional[int]) -> JobView:
    by_pattern: dict[str, list[tuple[dict[str, str], schema.Record]]] = {}
    for key, record in records:
        try:
            pattern, params = _match(key)
        except RecordError as exc:
            bad.append((key, exc.problem))
            continue
        by_pattern.setdefault(pattern, []).append((params, record))

    def one(pattern: str):
        rows = by_pattern.get(pattern, [])
        return rows[0][1] if rows else None

    history = sorted((r for _, r in by_pattern.get("plan/history/<version>", [])),
                     key=lambda p: p.version)
    current = one("plan/current")
    plan = _plan_view(current) if current is not None else None
    events = sorted((r for _, r in by_pattern.get("events/<seq>", [])), key=lambda e: e.seq)
    switches = switches_of(events)
    rdzv = _rendezvous(one("rdzv/state"), by_pattern)
    nodes = _nodes(by_pattern, plan, rdzv, history, now)
    _speeds(nodes, plan, events)
    leader = one("leader")
    leader_doc = None if leader is None else {
        "node": leader.node, "since": leader.since, "term": leader.term,
        "candidate_key": leader.candidate_key}
    if leader_changes is None:
        leader_changes = 0 if leader is None else 1
    counters = counters_of(events, switches, leader_changes)
    workers = [w for n in nodes for w in n.workers]
    return JobView(
        job=job, generated_at=now, revision=revision, nodes=nodes, leader=leader_doc, plan=plan,
        plan_history=[_history_row(p) for p in history], events=events, switches=switches,
        counters=counters, rendezvous=rdzv,
        waits=_waits(rdzv, plan, switches, by_pattern, now),
        throughput=_throughput(workers, samples), bad_records=bad,
    )


# ------------------------------------------------------------------------------------ plan
def _history_row(p: schema.PlanRecord) -> dict[str, Any]:
    return {"version": p.version, "reason": p.reason, "created_at": p.created_at,
            "devices": list(p.devices)}


def _plan_view(p: schema.PlanRecord) -> PlanView:
    view = PlanView(version=p.version, reason=p.reason, created_at=p.created_at,
                    store_endpoint=p.store_endpoint, devices=list(p.devices),
                    strategy=dict(p.strategy), pipelines=[],
                    inventory=dict(getattr(p, "inventory", None) or {}))
    if not isinstance(p.strategy, dict) or "pipelines" not in p.strategy:
        view.layout_error = "the strategy has no pipelines (shown as given)"
        return view
    try:
        layout = plan_of(p)
    except (PlanError, TypeError, KeyError, ValueError) as exc:
        view.layout_error = f"the strategy is not a valid plan layout: {exc}"
        return view
    view.num_layers, view.global_batch = layout.num_layers, layout.global_batch
    for pi, pipe in enumerate(layout.pipelines):
        stages = [{"index": si, "layers": list(st.layers), "tp": st.tp,
                   "devices": [p.devices[d] for d in st.devices]}
                  for si, st in enumerate(pipe.stages)]
        view.pipelines.append({"index": pi, "num_microbatches": pipe.num_microbatches,
                               "microbatch_size": pipe.microbatch_size, "stages": stages})
    view.buckets = [_bucket_row(i, b, layout) for i, b in enumerate(p.buckets or [])]
    return view


def _shape(plan: Plan) -> list:
    return [[(s.devices, s.layers) for s in pipe.stages] for pipe in plan.pipelines]


def _bucket_row(index: int, bucket: Any, home: Plan) -> dict[str, Any]:
    """One length bucket for display: its window, rows and layout (pipelines as
    ``tpT:Lfirst-last`` stages), and whether the step switches out of the home layout for it."""
    try:
        plan = Plan.from_dict(bucket["strategy"])
        layout = " | ".join("+".join(f"tp{s.tp}:L{s.layers[0]}-{s.layers[1] - 1}"
                                     for s in pipe.stages) + f" x{pipe.rows}"
                            for pipe in plan.pipelines)
        return {"index": index, "window": int(bucket["window"]), "start": int(bucket["start"]),
                "rows": plan.global_batch, "layout": layout,
                "switches": _shape(plan) != _shape(home)}
    except (PlanError, TypeError, KeyError, ValueError) as exc:
        return {"index": index, "error": f"not a valid bucket: {exc}"}


def _split_device(device_id: str) -> Optional[tuple[str, int]]:
    """``(node, index)`` of a plan's device id; None for one that is not ``<node>:<index>``."""
    try:
        return parse_device_id(device_id)
    except ValueError:
        return None


def _placements(plan: Optional[PlanView]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for pipe in plan.pipelines if plan else []:
        for stage in pipe["stages"]:
            for tp_rank, dev in enumerate(stage["devices"]):
                out[dev] = {"pipeline": pipe["index"], "stage": stage["index"],
                            "tp_rank": tp_rank}
    return out


def _replaced_by(device_id: str, history: list[schema.PlanRecord]) -> Optional[int]:
    """The latest plan version that dropped ``device_id`` (its predecessor used it)."""
    found = None
    for prev, nxt in zip(history, history[1:]):
        if device_id in prev.devices and device_id not in nxt.devices:
            found = nxt.version
    return found


# ----------------------------------------------------------------------------------- nodes
def _nodes(by_pattern, plan: Optional[PlanView], rdzv: Optional[dict], history, now: float
           ) -> list[NodeView]:
    nodes: dict[str, NodeView] = {}
    for params, rec in by_pattern.get("nodes/<node_id>", []):
        node = NodeView(id=params["node_id"], present=True, state=rec.state, host=rec.host,
                        agent_pid=rec.agent_pid, started_at=rec.started_at)
        node.devices = [DeviceView(node.id, d.index, d.type, d.memory_bytes, d.uuid)
                        for d in rec.devices]
        nodes[node.id] = node

    def node_of(node_id: str) -> NodeView:
        if node_id not in nodes:
            nodes[node_id] = NodeView(id=node_id, present=False, state="lost")
        return nodes[node_id]

    def device_of(node_id: str, index: int) -> DeviceView:
        node = node_of(node_id)
        for d in node.devices:
            if d.index == index:
                return d
        dev = DeviceView(node_id, index)
        node.devices.append(dev)
        return dev

    for params, rec in by_pattern.get("devices/<node_id>/<index>", []):
        dev = device_of(params["node_id"], int(params["index"]))
        dev.health, dev.reason, dev.xid = rec.state, rec.reason, rec.xid
        dev.slowdown, dev.health_at = rec.slowdown, rec.at
    placements = _placements(plan)
    for rank, dev_id in enumerate(plan.devices if plan else []):
        split = _split_device(dev_id)
        if split is not None:
            dev = device_of(*split)
            dev.plan_rank, dev.placement = rank, placements.get(dev_id)
    for p in (rdzv or {}).get("participants", []):
        node_of(p["node"])
    for params, rec in by_pattern.get("workers/<node_id>/<local_rank>", []):
        node_of(params["node_id"]).workers.append(WorkerView(
            node=params["node_id"], local_rank=rec.local_rank, global_rank=rec.global_rank,
            pid=rec.pid, plan_version=rec.plan_version, step=rec.step,
            steps_per_s=rec.steps_per_s, last_progress_at=rec.last_progress_at,
            idle_s=round(max(0.0, now - rec.last_progress_at), 3), busy_s=_busy(rec.busy_s)))
    for node in nodes.values():
        node.devices.sort(key=lambda d: d.index)
        node.workers.sort(key=lambda w: w.local_rank)
        for dev in node.devices:
            if not node.present and dev.health != "failed":
                dev.health = "lost"
            if dev.health in ("failed", "lost"):
                dev.replaced_by_plan = _replaced_by(dev.id, history)
    return sorted(nodes.values(), key=lambda n: n.id)


# ---------------------------------------------------------------------------------- speeds
def _busy(value: Any) -> float:
    """A worker's busy time as shown: a finite number >= 0, else 0 (not measured)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value >= 0
    return round(float(value), 6) if ok else 0.0


def speed_value(value: Any) -> Optional[float]:
    """A device speed as shown: a positive finite number, else None (not known)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0
    return round(float(value), 6) if ok else None


def newest_speeds(events: Sequence[schema.EventRecord], plan_version: Optional[int] = None
                  ) -> Optional[schema.SpeedsDetail]:
    """The newest ``speeds`` event's detail (journaled for ``plan_version`` when given; None
    when none; an event whose detail does not read is skipped)."""
    for ev in reversed(events):
        if ev.type != "speeds":
            continue
        try:
            detail = schema.event_detail(ev)
        except RecordError:
            continue
        if isinstance(detail, schema.SpeedsDetail) and \
                plan_version in (None, detail.plan_version):
            return detail
    return None


def measured_speeds(events: Sequence[schema.EventRecord], plan_version: int
                    ) -> dict[str, float]:
    """``measured`` of the newest ``speeds`` event journaled for ``plan_version`` ({} when
    none; an event whose detail does not read is skipped)."""
    detail = newest_speeds(events, plan_version)
    return {} if detail is None else dict(detail.measured)


def _speeds(nodes: list[NodeView], plan: Optional[PlanView],
            events: Sequence[schema.EventRecord]) -> None:
    """Set each device's planned and measured speed (the current plan's; None without one)."""
    if plan is None:
        return
    measured = measured_speeds(events, plan.version)
    for node in nodes:
        for dev in node.devices:
            dev.planned_speed = speed_value(plan.inventory.get(dev.id))
            dev.measured_speed = speed_value(measured.get(dev.id))
            if dev.id in plan.inventory and dev.plan_rank is None \
                    and dev.health not in ("failed", "suspect", "lost"):
                dev.idle = idle_reason(events, plan.version, dev.id)


def idle_reason(events: Sequence[schema.EventRecord], plan_version: int, device: str) -> str:
    """Why plan ``plan_version`` leaves ``device`` idle: the reason of the newest ``speeds``
    event that led to it (a replan decided under an earlier plan) or was weighed under it and
    names the device (``SpeedsDetail.idle``: speed, step time with and without it), else the
    plain fact."""
    for ev in reversed(events):
        if ev.type != "speeds":
            continue
        try:
            d = schema.event_detail(ev)
        except RecordError:
            continue
        fits = d.plan_version == plan_version and not d.replan or \
            d.plan_version < plan_version and d.replan
        if fits and device in getattr(d, "idle", {}):
            return d.idle[device].reason
    return f"plan v{plan_version} leaves it idle"


# ----------------------------------------------------------------------------- rendezvous
def _rendezvous(st: Optional[schema.RdzvStateRecord], by_pattern) -> Optional[dict[str, Any]]:
    if st is None:
        return None
    round_key = f"{st.round:0{schema.PAD}d}"
    joined = sorted(
        rec.node for params, rec in by_pattern.get("rdzv/rounds/<round>/joined/<node_id>", [])
        if params["round"] == round_key)
    master = next((rec for params, rec in by_pattern.get("rdzv/rounds/<round>/master", [])
                   if params["round"] == round_key), None)
    return {"round": st.round, "state": st.state, "restart_count": st.restart_count,
            "reason": st.reason, "at": st.at, "joined": joined,
            "participants": [{"node": p.node, "host": p.host,
                              "local_world_size": p.local_world_size} for p in st.participants],
            "master": None if master is None else f"{master.addr}:{master.port}"}


# ----------------------------------------------------------------------------------- waits
def _waits(rdzv: Optional[dict], plan: Optional[PlanView], switches: list[SwitchView],
           by_pattern, now: float) -> list[WaitView]:
    waits = []
    if rdzv is not None and rdzv["state"] == "joining":
        waits.append(WaitView("rendezvous", f"rendezvous round {rdzv['round']}: nodes joining",
                              len(rdzv["joined"]), None, rdzv["at"],
                              round(max(0.0, now - rdzv["at"]), 3)))
    running = [s for s in switches if s.state == "running"]
    if running:
        sw = running[-1]
        version_key = None if sw.to_version is None else f"{sw.to_version:0{schema.PAD}d}"
        acks = [rec for params, rec in by_pattern.get("switch/<version>/<node_id>", [])
                if params["version"] == version_key]
        expected = None
        if plan is not None and plan.version == sw.to_version:
            expected = len({split[0] for split in map(_split_device, plan.devices)
                            if split is not None}) or None
        done = sum(1 for a in acks if a.state == "done")
        waits.append(WaitView("switch", f"switch to plan v{sw.to_version}: nodes done", done,
                              expected, sw.started_at,
                              None if sw.started_at is None
                              else round(max(0.0, now - sw.started_at), 3)))
    return waits


# ------------------------------------------------------------------------------ throughput
def job_rate(progress: Sequence[tuple[int, float]]) -> Optional[float]:
    """The job's steps/s from the workers' (step, steps_per_s): the mean over the workers at
    the highest step, so workers behind (restarting, just started) do not drag it down."""
    if not progress:
        return None
    top = max(step for step, _ in progress)
    rates = [r for step, r in progress if step == top and math.isfinite(r)]
    return round(sum(rates) / len(rates), 6) if rates else None


def _throughput(workers: list[WorkerView], samples: list) -> dict[str, Any]:
    return {
        "workers": len(workers),
        "step": max((w.step for w in workers), default=None),
        "steps_per_s": job_rate([(w.step, w.steps_per_s) for w in workers]),
        "samples": [list(s) for s in samples],
    }
