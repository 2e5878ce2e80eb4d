"""The planner adapter: a ``PlanDecision`` in, the plan to publish out. Pure given the planner.

The seam to the data plane's planner is typed: ``PlannerFn`` is the signature of
``hspmd_elastic.planner.plan_for`` (an ``Inventory``, a ``ModelProfile``, the global batch, the
current ``Plan`` and ``PlannerOptions`` in; a ``PlanResult`` out). Promises:

* ``make_layout`` hands the planner an inventory of the usable devices plus the current plan's
  lost ones (as failed), with ints in device-id order, degraded devices as slowdowns, each
  device's spec from its type with the memory and speed its node declared
  (``planner.spec_for_device``), and the current plan relabelled to those ints
  (``coord.contract.plan_of`` then ``Plan.relabel``; None when the record holds no plan the
  planner reads), so the planner can prefer a cheap switch;
* the published layout uses compact ids: ``PlannedLayout.devices[i]`` is the device of int
  ``i`` in ``plan``, which is the worker's rank in that plan's process group;
* a plan the planner finds infeasible raises ``PlanningFailed`` (the caller keeps the current
  plan); any other planner failure, or no planner, gives ``fallback_dp_plan`` (from the
  planner's API) over the usable devices, and the layout says so (``planner``);
* the planner's options come from ``default_planner_options`` unless the caller gives some: a
  cluster of two nodes or more prefers every parameter slice on two nodes; no job is asked to
  give every device a role (CPU jobs included): the planner leaves a device idle when it costs
  more than it adds, and the result's ``Estimate.idle`` says why; ``RedundantPlanner`` wraps a
  planner so every plan keeps every slice on ``--hspmd-redundancy`` nodes (a hard constraint,
  whatever the options), and remembers why the last search found none (``shortfall``) so the
  agent can end the job;
  ``UniformPlanner`` wraps a planner so every plan is uniform SPMD (``--hspmd-planner uniform``),
  the best one over any prefix of the devices by speed (``planner.subsets.best_uniform``);
  ``AllDevicesPlanner`` so every usable device gets a role (``--hspmd-all-devices on``); the
  devices a plan leaves idle are logged with why;
* a decision that answers speeds alone (``speed_only``: degrade and recover changes, no device
  came or went) plans under ``keep_copies``: the plans keeping the copies the current plan owes of
  every parameter slice (``planner.copies``) rank first, a trade is logged as a warning;
* this module imports the planner package (numpy, scipy) when it is imported: only an elastic
  agent imports the leader, never the CLI's start-up (``hspmd-launch --help`` stays fast).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import device_sort_key, node_of
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.plan import Plan, PlanError
from hspmd_elastic.planner import (Device, Health, Inventory, LengthBucket, PlanInfeasibleError,
                                   PlannerError, PlannerOptions, RedundancyError,
                                   fallback_dp_plan, spec_for_device)
from hspmd_elastic.planner.bucket_layouts import bucket_layouts
from hspmd_elastic.planner.copies import KEPT, Copies, copies_of, keep, weigh
from hspmd_elastic.planner.explain import idle_lines
from hspmd_elastic.planner.search import paused_gc
from hspmd_elastic.planner.subsets import best_uniform
from launcher.leader.decide import PlanDecision, assumed_inventory
from launcher.leader.snapshot import DeviceView

if TYPE_CHECKING:
    from hspmd_elastic.planner import ModelProfile, PlanResult

log = logging.getLogger(__name__)

PLANNER_SEARCH = "plan_for"  # PlannedLayout.planner: the planner's search made the plan
PLANNER_FALLBACK = "fallback-dp"  # PlannedLayout.planner: the fallback DP plan


class LeaderError(Exception):
    """Root of the leader's errors; ``str(err)`` is one line."""


class PlanningFailed(LeaderError):
    """No plan could be made for a decision (the planner found it infeasible)."""


class PlannerFn(Protocol):
    """The planner the leader calls: ``hspmd_elastic.planner.plan_for`` or a stand-in."""

    def __call__(self, inventory: Inventory, profile: ModelProfile, global_batch: int,
                 current_plan: Optional[Plan] = None,
                 options: PlannerOptions = ...) -> PlanResult: ...


@dataclass(frozen=True)
class PlannedLayout:
    """A plan over compact ids (``devices[i]`` is device ``i``) and who made it."""

    plan: Plan
    devices: tuple[str, ...]
    planner: str  # PLANNER_SEARCH or PLANNER_FALLBACK
    # length buckets (``--hspmd-lengths``): PlanRecord.buckets, over the same compact ids
    buckets: tuple[dict, ...] = ()


class RedundantPlanner:
    """A ``PlannerFn`` that calls ``planner_fn`` with ``redundancy`` set on whatever options it
    is given: every plan keeps every parameter slice on ``redundancy`` nodes, or the search
    raises ``planner.RedundancyError``. ``shortfall`` is that error's line from the last call
    ("" after a plan was found): no plan can keep the guarantee for this cluster. Any other
    failure of the planner is raised as ``PlanInfeasibleError``, so ``make_layout`` keeps the
    current plan instead of publishing the fallback DP plan, which ignores the guarantee."""

    def __init__(self, planner_fn: PlannerFn, redundancy: int):
        if redundancy < 1:
            raise ValueError(f"redundancy={redundancy} must be >= 1")
        self.planner_fn, self.redundancy = planner_fn, redundancy
        self.shortfall = ""

    def __call__(self, inventory: Inventory, profile: ModelProfile, global_batch: int,
                 current_plan: Optional[Plan] = None,
                 options: Optional[PlannerOptions] = None) -> PlanResult:
        opts = replace(options or PlannerOptions(), redundancy=self.redundancy)
        try:
            result = self.planner_fn(inventory, profile, global_batch,
                                     current_plan=current_plan, options=opts)
        except RedundancyError as exc:
            self.shortfall = str(exc)
            raise
        except PlanInfeasibleError:
            raise
        except Exception as exc:  # noqa: BLE001 - no fallback plan: it ignores the guarantee
            raise PlanInfeasibleError(f"the planner failed ({type(exc).__name__}: {exc}); no "
                                      "fallback plan under --hspmd-redundancy") from exc
        self.shortfall = ""
        return result


class _Wrapper:
    """A ``PlannerFn`` around ``planner_fn``, whose ``shortfall`` it passes on (none: "")."""

    def __init__(self, planner_fn: PlannerFn):
        self.planner_fn = planner_fn

    @property
    def shortfall(self) -> str:
        return getattr(self.planner_fn, "shortfall", "")


class AllDevicesPlanner(_Wrapper):
    """A ``PlannerFn`` that calls ``planner_fn`` with ``use_all_devices`` set on whatever options
    it is given (``--hspmd-all-devices on``): every usable device gets a role, even one the
    planner would leave idle. ``shortfall`` is ``planner_fn``'s (none: "")."""

    def __call__(self, inventory: Inventory, profile: ModelProfile, global_batch: int,
                 current_plan: Optional[Plan] = None,
                 options: Optional[PlannerOptions] = None) -> PlanResult:
        opts = replace(options or PlannerOptions(), use_all_devices=True)
        return self.planner_fn(inventory, profile, global_batch, current_plan=current_plan,
                               options=opts)


def _all_devices(planner_fn: Optional[PlannerFn]) -> bool:
    """Whether ``planner_fn`` is, or wraps (``.planner_fn``), an ``AllDevicesPlanner``."""
    while planner_fn is not None:
        if isinstance(planner_fn, AllDevicesPlanner):
            return True
        planner_fn = getattr(planner_fn, "planner_fn", None)
    return False


class UniformPlanner(_Wrapper):
    """A ``PlannerFn`` that plans uniform SPMD (``--hspmd-planner uniform``): the best of
    ``planner_fn`` over ``planner.uniform_inventory`` of each prefix of the devices by speed
    (fastest first, every device of it taken for its weakest, the others idle:
    ``planner.subsets.best_uniform``), so the plan has one TP and PP degree everywhere, even
    layers and even rows, whatever the devices' speeds, and leaves out slow devices that would
    pace it. The conservative mode, and the baseline heterogeneous plans are measured against.
    A ``planner_fn`` with a ``shortfall`` (``RedundantPlanner``) keeps the whole inventory's
    after a failure, and "" once some prefix has a plan."""

    def __call__(self, inventory: Inventory, profile: ModelProfile, global_batch: int,
                 current_plan: Optional[Plan] = None,
                 options: Optional[PlannerOptions] = None) -> PlanResult:
        try:
            result = best_uniform(self.planner_fn, inventory, profile, global_batch,
                                  current_plan, options or PlannerOptions())
        except RedundancyError as exc:
            self._set_shortfall(str(exc))
            raise
        self._set_shortfall("")
        return result

    def _set_shortfall(self, text: str) -> None:
        if hasattr(self.planner_fn, "shortfall"):
            self.planner_fn.shortfall = text


def default_planner_options(devices: Sequence[DeviceView],
                            optimizer_shards: str = "replicated") -> PlannerOptions:
    """The planner's options for this cluster.

    When the devices span two nodes or more, rank plans that keep every parameter slice on two
    nodes first, so that losing one node is a reshard from the survivors, not a checkpoint
    reload (a preference: a cluster where no such plan fits still gets the fastest plan).
    ``use_all_devices`` stays off for every job, CPU workers included: a device that costs the
    step more than it adds (a slow worker's per-step fixed costs) is left idle, and the plan's
    ``Estimate.idle`` says why; a caller that needs every worker busy passes options with
    ``use_all_devices=True``. ``optimizer_shards``: the job's ``--hspmd-optimizer-shards``,
    which the cost model charges the update and optimizer memory by."""
    return PlannerOptions(cross_node_replicas=len({d.node for d in devices}) >= 2,
                          optimizer_shards=optimizer_shards)


def make_layout(decision: PlanDecision, current: Optional[schema.PlanRecord],
                planner_fn: Optional[PlannerFn], profile: ModelProfile, global_batch: int,
                options: Optional[PlannerOptions] = None,
                lengths: Sequence[tuple[int, float]] = (), *,
                optimizer_shards: str = "replicated") -> PlannedLayout:
    """Pure (given a pure ``planner_fn``): the plan for ``decision`` (see the module docstring).
    Raises ``PlanningFailed`` when the planner finds no plan. The cyclic garbage collector is
    paused meanwhile (``planner.search.paused_gc``: the objects made here have no cycles).
    ``optimizer_shards``: the job's mode, set on the planner's options (given or default) so
    the cost model charges every plan, the current one included, alike; the caller stamps it
    on the published plan."""
    if options is not None and options.optimizer_shards != optimizer_shards:
        options = replace(options, optimizer_shards=optimizer_shards)
    with paused_gc():
        return _make_layout(decision, current, planner_fn, profile, global_batch, options,
                            lengths, optimizer_shards)


def _make_layout(decision: PlanDecision, current: Optional[schema.PlanRecord],
                 planner_fn: Optional[PlannerFn], profile: ModelProfile, global_batch: int,
                 options: Optional[PlannerOptions],
                 lengths: Sequence[tuple[int, float]] = (),
                 optimizer_shards: str = "replicated") -> PlannedLayout:
    usable = {d.id: d for d in decision.devices}
    old = list(current.devices) if current else []
    universe = sorted(set(usable) | set(old), key=device_sort_key)
    ids = {dev: i for i, dev in enumerate(universe)}
    planner = PLANNER_SEARCH
    plan: Optional[Plan] = None
    inventory, opts = None, None
    if planner_fn is not None:
        try:
            inventory = device_inventory(universe, usable, ids, decision.devices[0].type)
            opts = options if options is not None else \
                default_planner_options(decision.devices, optimizer_shards)
            now = _current_in(current, ids)
            before, home = None, opts  # the bucket plans hold no parameters: no copies kept
            if now is not None and speed_only(decision, current):
                before, home = keep_copies(opts, now, inventory)
            result = planner_fn(inventory, profile, global_batch, current_plan=now,
                                options=home)
            plan = result.plan
            _log_idle(decision.version, result, universe)
            if before is not None:
                _log_copies(decision.version, before, result, home.redundancy)
        except PlanInfeasibleError as exc:
            raise PlanningFailed(f"plan v{decision.version}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the planner is optional: fall back, say why
            log.warning("plan v%d: planner failed (%s: %s); using the fallback DP plan",
                        decision.version, type(exc).__name__, exc)
            plan = None
    if plan is None:
        planner = PLANNER_FALLBACK
        try:
            plan = fallback_dp_plan([ids[d] for d in usable], profile.num_layers, global_batch)
        except PlanInfeasibleError as exc:
            raise PlanningFailed(str(exc)) from exc
    used = sorted(plan.devices)
    compact = {u: k for k, u in enumerate(used)}
    buckets: tuple[dict, ...] = ()
    if lengths and inventory is not None and planner == PLANNER_SEARCH:
        if _all_devices(planner_fn):  # the buckets' plans too give every device a role
            opts = replace(opts, use_all_devices=True)
        buckets = _buckets(decision.version, inventory, profile, plan, lengths, opts, compact)
    return PlannedLayout(_relabel(plan, compact), tuple(universe[u] for u in used), planner,
                         buckets)


SPEED_KINDS = frozenset({"degrade", "recover"})


def speed_only(decision: PlanDecision, current: Optional[schema.PlanRecord]) -> bool:
    """Whether ``decision`` answers speeds alone: every change a ``degrade`` or ``recover``
    and the same devices as ``current`` assumed (none came, none went)."""
    if current is None or not decision.changes:
        return False

    return (all(c.kind.value in SPEED_KINDS for c in decision.changes)
            and {d.id for d in decision.devices} == set(assumed_inventory(current)))


def keep_copies(options: PlannerOptions, current: Plan, inventory: Inventory):
    """``(copies, options)``: the copies ``current`` keeps over ``inventory``
    (``planner.copies``) and ``options`` that rank the plans keeping them first."""
    copies = copies_of(current, inventory)
    return copies, keep(options, copies)


def _log_idle(version: int, result: PlanResult, universe: Sequence[str]) -> None:
    """Say which usable devices the plan leaves idle and why (``Estimate.idle``; ``universe[i]``
    names the planner's device ``i``)."""
    for line in idle_lines(result.estimate.idle, names=universe):
        log.info("plan v%d: %s", version, line)


def _log_copies(version: int, before, result: PlanResult, redundancy: int = 1) -> None:
    """Say what a speed-driven plan did to the job's redundancy (a trade is a warning)."""
    verdict = weigh(before, Copies.of(result.estimate), redundancy=redundancy)
    (log.info if verdict.outcome == KEPT else log.warning)(
        "plan v%d (speeds only): redundancy %s: %s", version, verdict.outcome, verdict.why)


def _buckets(version: int, inventory: Inventory, profile: ModelProfile, plan: Plan,
             lengths: Sequence[tuple[int, float]], options: PlannerOptions,
             compact: Mapping[int, int]) -> tuple[dict, ...]:
    """``planner.bucket_layouts`` for ``plan``, relabelled to the published ids; none (every row
    under the plan: the same result, without the bucket plans' speed) when no set fits."""
    try:
        layouts = bucket_layouts(inventory, profile, plan,
                                 [LengthBucket(n, s) for n, s in lengths], options)
    except PlannerError as exc:
        log.warning("plan v%d: no length buckets (%s); every row runs under the plan",
                    version, exc)
        return ()
    out = []
    for b in layouts:
        out.append({"window": b.window, "start": b.start,
                    "strategy": _relabel(b.plan, compact).to_dict()})
        home = ("the home layout cannot run it" if not math.isfinite(b.home_s)
                else f"home layout {b.home_s:.3g}s")
        log.info("plan v%d: length bucket %d tokens, rows %d+%d, %s (estimated %.3gs; %s, "
                 "switch %.3gs)", version, b.window, b.start, b.plan.global_batch,
                 "its own plan" if b.own else "the home layout", b.step_s, home, b.switch_s)
    return tuple(out)


def _relabel(plan: Plan, mapping: Mapping[int, int]) -> Plan:
    """``plan.relabel(mapping)``; the plan itself when ``mapping`` moves no id (plans are
    immutable, and building one over thousands of devices is not free)."""
    if all(k == v for k, v in mapping.items()) and mapping.keys() >= set(plan.devices):
        return plan
    return plan.relabel(mapping)


def device_inventory(universe: Sequence[str], usable: Mapping[str, DeviceView],
                     ids: Mapping[str, int], lost_type: str) -> Inventory:
    """The planner's inventory (``make_layout``'s, and the straggler rule's predictions'): every
    device of ``universe`` under its int id; those not
    ``usable`` (lost since the current plan) as failed devices of type ``lost_type``."""
    devs = []
    specs: dict[tuple, object] = {}  # one spec per (type, memory, speed): devices share it

    def spec_of(type_name: str, memory: Optional[int], speed: float = 1.0):
        if (type_name, memory, speed) not in specs:
            specs[type_name, memory, speed] = spec_for_device(type_name, memory, speed=speed)
        return specs[type_name, memory, speed]

    for dev in universe:
        view = usable.get(dev)
        if view is None:
            devs.append(Device(ids[dev], node_of(dev), spec_of(lost_type, None), Health.FAILED))
            continue
        spec = spec_of(view.type, view.memory_bytes or None, view.declared_speed)
        health = Health.DEGRADED if view.state == "degraded" else Health.HEALTHY
        devs.append(Device(ids[dev], view.node, spec, health, 1.0 / max(view.speed, 1e-6)))
    return Inventory(tuple(devs))


def _current_in(current: Optional[schema.PlanRecord], ids: Mapping[str, int]) -> Optional[Plan]:
    """The current plan with its device ints moved to the inventory's ids (None if unreadable)."""
    if current is None or not current.strategy:
        return None
    try:
        return _relabel(plan_of(current), {i: ids[dev] for i, dev in enumerate(current.devices)})
    except (PlanError, KeyError, IndexError, TypeError) as exc:
        log.info("current plan v%d is not a plan the planner reads (%s)", current.version, exc)
        return None


def plan_record(decision: PlanDecision, layout: PlannedLayout, created_at: float,
                step: int = 0) -> schema.PlanRecord:
    """The ``PlanRecord`` that publishes ``layout`` for ``decision``; ``step``: the furthest
    step any worker reported (the snapshot's)."""
    return schema.PlanRecord(version=decision.version, reason=decision.reason,
                             devices=list(layout.devices), strategy=layout.plan.to_dict(),
                             store_endpoint=decision.store_endpoint, created_at=created_at,
                             inventory=decision.inventory,
                             drain=[d for d in (*decision.drain, *decision.retiring)
                                    if d not in layout.devices],
                             step=step, buckets=[dict(b) for b in layout.buckets])
