"""Leaving devices out: the subsets of the usable devices the search tries, why a device is left
idle, and the best uniform plan over any subset.

A device that costs more than it adds is better idle: every device pays fixed costs per step
whatever its rows (the optimizer update of its whole shard at its own speed, a cost per
micro-batch, a start-up latency per collective, a share of the gradient all-reduce), so a
device at a quarter of the others' speed can slow the step down even with few rows. Promises:

* ``subsets(usable)``: the device sets the search lays out, all usable devices first, each a
  *prefix by speed* (fastest first; ties: more memory first, then lower id): families of
  subsets, each by an increasing number ``k`` of devices dropped from the slow end:

  - the whole inventory: the ``k`` slowest of all, ``k`` at every speed tier's edge (a tier
    is the devices of one effective speed and memory), so a slow device type can go whole;
  - the whole inventory again, the other ``k``: all of them up to ``SMALL`` devices, else 1, 2,
    4, ... (a slow node goes whole, equal devices fewer when fixed costs dominate);
  - per device type with degraded members (``slowdown`` above 1): its slowest tiers, the
    others kept, so a straggler goes without its whole type;
  - the degraded devices of every type together, slowest tier first.

  Each family holds at most ``MAX_PER_FAMILY`` subsets (for more, the ``k`` values are thinned
  geometrically, the tier edges first); a subset already listed is not repeated. The search
  stops a family once ``PATIENCE`` subsets in a row fail to beat the best score so far (one,
  off the tiers' edges of more than ``SMALL`` devices; ``Patience``): dropping more stops
  helping.
* ``idle_devices``: for each usable device a chosen plan leaves idle, an ``IdleDevice``: its
  speed relative to the fastest usable device, the predicted step time of the best plan the
  search found that gives it work (``None``: none it scored does) against the chosen plan's,
  and a one-line reason with those numbers.
* ``best_uniform``: the best uniform plan over any subset: for each prefix by speed ending at
  a tier's edge (``uniform_subsets``), every device of it taken for its weakest
  (``devices.uniform_inventory``), the others out, the plan held to one TP and one PP degree
  (``degrees``: the search over equal devices may still mix them; each pair it used is then
  planned alone); the least predicted step wins, the larger
  subset on a tie within ``options.tie_tolerance``. With ``options.use_all_devices`` only the
  whole inventory is planned. The chosen estimate lists the devices left out as unused, with
  their ``IdleDevice`` (step times: the uniform predictions; "with" is the least step of a
  prefix's uniform plan using the device, or of the best plan using it that a prefix's search
  found).
* Pure and deterministic, like the rest of the planner.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence

from hspmd_elastic.planner.api import (Candidate, Device, Health, IdleDevice, Inventory,
                                       ModelProfile, PlanInfeasibleError, PlannerOptions,
                                       PlanResult)
from hspmd_elastic.planner.devices import uniform_inventory

MAX_PER_FAMILY = 10  # subsets of one family the search lays out at most
PATIENCE = 2  # subsets in a row that fail to beat the best before a family stops
MAX_UNIFORM = 12  # prefixes the uniform baseline plans at most
SMALL = 8  # up to this many devices, every drop count is tried (else 1, 2, 4, ...)


def speed_key(d: Device) -> tuple:
    """Fastest first; ties: more memory first, then the lower id."""
    return (-d.flops, -d.spec.memory_bytes, d.id)


def _tier(d: Device) -> tuple:
    return (d.flops, d.spec.memory_bytes)


def _edges(ordered: Sequence[Device]) -> list[int]:
    """Drop counts at the tiers' edges: the devices after each tier, slowest tier first."""
    n = len(ordered)
    return [n - i for i in range(n - 1, 0, -1) if _tier(ordered[i]) != _tier(ordered[i - 1])]


def _drop_counts(ordered: Sequence[Device]) -> tuple[list[int], list[int]]:
    """Increasing drop counts in 1..n-1: (the tiers' edges, the others: every count for up to
    ``SMALL`` devices, else 1, 2, 4, ...), each at most ``MAX_PER_FAMILY`` (thinned evenly)."""
    n = len(ordered)
    edges = _thin(_edges(ordered), MAX_PER_FAMILY)
    counts = range(1, n) if n <= SMALL else [1 << i for i in range(n.bit_length())
                                             if 0 < (1 << i) < n]
    return edges, _thin([k for k in counts if k not in edges], MAX_PER_FAMILY)


def _thin(values: list[int], most: int) -> list[int]:
    if len(values) <= most:
        return values
    if most <= 0:
        return []
    step = (len(values) - 1) / max(1, most - 1)
    return sorted({values[round(i * step)] for i in range(most)})


def subsets(usable: Sequence[Device]) -> list[tuple[int, tuple[Device, ...]]]:
    """``(family, devices)`` for every subset the search lays out (see the module's promises);
    the first is ``(0, usable)``. Within a family, subsets come in increasing drop count."""
    usable = tuple(usable)
    out: list[tuple[int, tuple[Device, ...]]] = [(0, usable)]
    seen = {frozenset(d.id for d in usable)}

    def add(family: int, kept: Iterable[Device]) -> None:
        kept = tuple(sorted(kept, key=lambda d: d.id))
        ids = frozenset(d.id for d in kept)
        if kept and ids not in seen:
            seen.add(ids)
            out.append((family, kept))

    ordered = sorted(usable, key=speed_key)
    edges, counts = _drop_counts(ordered)
    for family, ks in ((1, edges), (2, counts)):
        for k in ks:
            add(family, ordered[:len(ordered) - k])
    family = 3
    for kind in sorted({d.spec.name for d in usable}):
        of_type = sorted((d for d in usable if d.spec.name == kind), key=speed_key)
        if all(d.slowdown == 1.0 for d in of_type):
            continue
        others = [d for d in usable if d.spec.name != kind]
        for k in _drop_counts(of_type)[0]:
            add(family, others + of_type[:len(of_type) - k])
        family += 1
    factors = sorted({d.slowdown for d in usable})
    for limit in reversed(factors[:-1][-MAX_PER_FAMILY:]):
        add(family, (d for d in usable if d.slowdown <= limit))
    return out


class Patience:
    """Whether to go on with a family of subsets: ``PATIENCE`` subsets in a row of one family
    that fail to beat the best score so far (any family's) stop that family; one, for the
    counts off the tiers' edges (family 2) of more than ``SMALL`` devices."""

    def __init__(self, devices: int) -> None:
        self.best = math.inf
        self.misses: dict[int, int] = {}
        self.devices = devices

    def wants(self, family: int) -> bool:
        most = 1 if family == 2 and self.devices > SMALL else PATIENCE
        return self.misses.get(family, 0) < most

    def scored(self, family: int, score: float) -> None:
        if score < self.best:
            self.best = score
            self.misses[family] = 0
        else:
            self.misses[family] = self.misses.get(family, 0) + 1


# ---- why a device is idle ---------------------------------------------------------------------

def relative_speeds(inventory: Inventory) -> dict[int, float]:
    """Each usable device's effective FLOP/s over the fastest usable device's."""
    usable = inventory.usable
    top = max((d.flops for d in usable), default=0.0)
    return {d.id: (d.flops / top if top else 0.0) for d in usable}


def idle_devices(chosen: Candidate, inventory: Inventory,
                 with_steps: dict[int, Optional[float]]) -> tuple[IdleDevice, ...]:
    """An ``IdleDevice`` per device ``chosen`` leaves idle; ``with_steps``: per device, the
    predicted step time of the best plan found that gives it work (missing or None: none)."""
    speeds = relative_speeds(inventory)
    without = chosen.estimate.step_time_s
    out = []
    for d in chosen.estimate.unused_devices:
        with_s = with_steps.get(d)
        speed = speeds.get(d, 0.0)
        out.append(IdleDevice(d, speed, idle_reason(f"device {d}", speed, with_s, without),
                              with_s, without))
    return tuple(out)


def idle_reason(who: str, speed: float, with_s: Optional[float], without_s: float) -> str:
    """``"device 3 idle: at 0.25x the fastest device's speed the best plan using it takes
    0.41 s/step vs 0.22 s without"`` (``who``: ``"device 3"``, or ``"devices 2-3"`` for
    several with the same numbers)."""
    head = f"{who} idle: at {speed:.3g}x the fastest device's speed"
    if with_s is None:
        return f"{head} no plan the search scored gives it work ({without_s:.4g} s/step without)"
    if with_s < without_s:  # a near-equal plan: the ranking preferred the chosen one
        return (f"{head} the best plan using it takes {with_s:.4g} s/step, {without_s:.4g} s "
                "without; the chosen plan ranks first (less to move, or a preference)")
    return (f"{head} the best plan using it takes {with_s:.4g} s/step vs {without_s:.4g} s "
            "without")


def with_idle(chosen: Candidate, idle: tuple[IdleDevice, ...],
              unused: Optional[tuple[int, ...]] = None) -> Candidate:
    """``chosen`` with ``idle`` (and ``unused``, when given) in its estimate."""
    est = replace(chosen.estimate, idle=idle,
                  **({} if unused is None else {"unused_devices": unused}))
    return replace(chosen, estimate=est)


# ---- the uniform baseline over any subset -----------------------------------------------------

def uniform_subsets(inventory: Inventory,
                    use_all: bool = False) -> list[tuple[tuple[int, ...], Inventory]]:
    """``(kept ids, inventory)`` for every prefix by speed ending at a tier's edge, the whole
    inventory first: the prefix's devices as ``uniform_inventory`` makes them, the other usable
    devices marked failed (at most ``MAX_UNIFORM`` prefixes; ``use_all``: the whole one)."""
    ordered = sorted(inventory.usable, key=speed_key)
    counts = [0] + ([] if use_all else _thin(_edges(ordered), MAX_UNIFORM - 1))
    out = []
    for k in counts:
        kept = {d.id for d in ordered[:len(ordered) - k]}
        inv = Inventory(tuple(d if d.id in kept or not d.usable
                              else Device(d.id, d.node, d.spec, Health.FAILED, d.slowdown)
                              for d in inventory.devices))
        out.append((tuple(sorted(kept)), uniform_inventory(inv)))
    return out


PlanFn = Callable[..., PlanResult]


def degrees(plan) -> set[tuple[int, int]]:
    """The (PP, TP) degrees of ``plan``'s stages: one pair when it is uniform SPMD."""
    return {(len(p.stages), len(s.devices)) for p in plan.pipelines for s in p.stages}


def _one_degree(plan_fn: PlanFn, inv: Inventory, profile: ModelProfile, global_batch: int,
                current_plan, options: PlannerOptions) -> PlanResult:
    """``plan_fn`` over ``inv`` (equal devices), held to one TP and one PP degree: equal
    devices still let the search give pipelines different degrees (TP 2 beside TP 1 over
    three devices), which uniform SPMD cannot run; then each degree pair it used is planned
    alone, and the fastest plan wins."""
    result = plan_fn(inv, profile, global_batch, current_plan=current_plan, options=options)
    pairs = degrees(result.plan)
    if len(pairs) == 1:
        return result
    best: Optional[PlanResult] = None
    for pp, tp in sorted(pairs):
        held = replace(options, tp_degrees=(tp,), pp_degrees=(pp,))
        try:
            got = plan_fn(inv, profile, global_batch, current_plan=current_plan, options=held)
        except PlanInfeasibleError:
            continue
        if len(degrees(got.plan)) == 1 and (
                best is None or got.estimate.step_time_s < best.estimate.step_time_s):
            best = got
    if best is None:
        raise PlanInfeasibleError(f"no plan of one TP and PP degree over {len(inv.usable)} "
                                  f"device(s) (the search's mixes {sorted(pairs)})")
    return best


def best_uniform(plan_fn: PlanFn, inventory: Inventory, profile: ModelProfile,
                 global_batch: int, current_plan=None,
                 options: PlannerOptions = PlannerOptions()) -> PlanResult:
    """The best uniform plan over any prefix by speed (see the module's promises). ``plan_fn``:
    ``plan_for`` or a wrapper of it. Raises the whole inventory's ``PlanInfeasibleError`` when
    no prefix has a plan."""
    tried: list[tuple[tuple[int, ...], PlanResult]] = []
    first_error: Optional[PlanInfeasibleError] = None
    for kept, inv in uniform_subsets(inventory, options.use_all_devices):
        try:
            tried.append((kept, _one_degree(plan_fn, inv, profile, global_batch, current_plan,
                                            options)))
        except PlanInfeasibleError as exc:
            first_error = first_error or exc
    if not tried:
        assert first_error is not None
        raise first_error
    fastest = min(r.estimate.step_time_s for _, r in tried)
    kept, result = next((k, r) for k, r in tried
                        if r.estimate.step_time_s <= fastest * (1.0 + options.tie_tolerance))
    used = set(result.plan.devices)
    unused = tuple(d.id for d in inventory.usable if d.id not in used)
    with_steps: dict[int, Optional[float]] = {}
    for _, r in tried:  # a plan using the device, or its search's best plan that would
        steps = {i.id: i.step_time_with_s for i in r.estimate.idle}
        steps.update(dict.fromkeys(r.plan.devices, r.estimate.step_time_s))
        for d in unused:
            step = steps.get(d)
            if step is not None and (with_steps.get(d) is None or step < with_steps[d]):
                with_steps[d] = step
    chosen = with_idle(result.chosen, (), unused)
    chosen = with_idle(chosen, idle_devices(chosen, inventory, with_steps))
    return PlanResult(chosen, result.alternatives, result.profile, result.inventory)
