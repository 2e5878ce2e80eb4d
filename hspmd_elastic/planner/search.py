"""The plan search: from the usable devices to the best heterogeneous plan.

``plan_for`` is pure and deterministic. It enumerates layouts, scores them fast, re-solves the
best few exactly and ranks them:

1. Layouts (here). Failed devices are out. For each device type a TP degree (a divisor of the
   model's heads, FFN, hidden and vocabulary sizes, so any mix of degrees shards consistently);
   every node's devices are cut into TP groups of that degree, fastest devices together (the
   remainder into smaller groups). For each pipeline depth the groups are chained into
   pipelines, either in node order (homogeneous pipelines) or dealt so every pipeline gets a
   similar mix of fast and slow groups. Deeper pipelines are tried until they stop helping.
   Subsets of the usable devices are laid out as well (``subsets.subsets``: prefixes by
   speed, dropping the slowest of all, or a type's degraded ones; a family stops once
   dropping more stops helping), so a device that costs more than it adds (the fixed costs
   every device pays per step, at its own speed) is left idle; ``options.use_all_devices``
   lays out all usable devices only.
2. Fast pass (``passes.Solver.fast``): identical pipelines solved once; min-max layer split
   within memory; min-max split of the batch rows. A pipeline that gets no rows is dropped.
   With ``options.redundancy`` above 1, a layout that leaves some layer on fewer nodes is
   dropped here, before it can count as the best of its depth.
3. Exact pass (``passes.Solver.exact``) for the best ``options.refine`` layouts: the layer split
   as a small MILP on the real 1F1B time, a micro-batch size per pipeline, the plan estimated by
   ``cost.estimate_plan``. Candidates close to ``current_plan`` join (``current``).
4. Ranking: plans that break ``options.redundancy`` (a hard constraint, checked per TP shard by
   ``cost.replica_nodes``) are dropped, and when none is left ``RedundancyError`` names the
   shortfall; then the plans that keep the copies ``options.keep_copies`` /
   ``keep_copy_nodes`` ask for (``planner.copies``: a speed-driven replan keeps the current
   plan's redundancy), then those losing the fewest; then optionally plans using every usable
   device first, then (optionally) plans with cross-node replicas, then the score (step time,
   weighted by switch traffic if asked); plans within ``tie_tolerance`` of the best are
   ordered by the bytes a switch from ``current_plan`` would move, then by pipeline depth,
   then by score.
5. Idle devices: for each usable device the chosen plan leaves idle, ``Estimate.idle`` holds
   the best predicted step time of a plan that gives it work (the candidates, and the
   best-ranked draft using it re-solved exactly) against the chosen one (``subsets``).
"""

from __future__ import annotations

import gc
import math
import re
import threading
from contextlib import contextmanager
from itertools import product
from typing import Optional

from hspmd_elastic.plan import Plan, PlanError
from hspmd_elastic.planner import cost, subsets
from hspmd_elastic.planner.api import (Candidate, Device, Inventory, ModelProfile,
                                       PlanInfeasibleError, PlannerError, PlannerOptions,
                                       PlanResult, RedundancyError, fmt_bytes)
from hspmd_elastic.planner.copies import shortfall
from hspmd_elastic.planner.current import candidate, from_current
from hspmd_elastic.planner.passes import Draft, Solver, tp_options

_PP_DEPTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
_MAX_TP_COMBOS = 64
_IDLE_EXACT = 4  # drafts re-solved exactly to say why devices are idle
_PATIENCE = 2
_VARIANT_TP_KEEP = 3


# ---- layout building blocks -------------------------------------------------------------------

class _Group:
    """A TP group: devices (fastest first) on one node, with its cost-model attributes."""

    __slots__ = ("devices", "node", "node_rank", "tp", "flops", "key", "inter", "sid")

    def __init__(self, devices: tuple[Device, ...], node_rank: int, memory_fraction: float,
                 interned: dict, classes: Optional[tuple] = None,
                 known: Optional[dict] = None):
        """``classes``: each device's (spec object, slowdown), all the attributes depend on;
        groups of the same classes share them through ``known``."""
        self.devices = devices
        self.node = devices[0].node
        self.node_rank = node_rank
        self.tp = len(devices)
        attrs = known.get(classes) if known is not None else None
        if attrs is None:
            flops = min(d.flops for d in devices)
            inter = min(d.link_gbps(True) for d in devices)
            shape = cost.group_shape(devices, None, memory_fraction)
            key = (shape.tp, shape.flops, shape.memory, shape.intra_gbps, shape.overhead_s,
                   shape.latency_s, shape.update_s)
            # A small int standing for (key, inter): pipeline signatures are tuples of these.
            attrs = (flops, inter, key, interned.setdefault((key, inter), len(interned)))
            if known is not None:
                known[classes] = attrs
        self.flops, self.inter, self.key, self.sid = attrs


def _check_tp_degrees(profile: ModelProfile, options: PlannerOptions) -> None:
    if options.tp_degrees is None:
        return
    sizes = profile.tp_sizes()
    if not any(profile.tp_valid(t) for t in options.tp_degrees):
        kv = f" and divides or is a multiple of num_kv_heads={profile.kv_heads}" \
            if profile.num_kv_heads is not None else ""
        raise PlannerError(
            f"tp_degrees={options.tp_degrees}: none divides "
            + ", ".join(f"{k}={v}" for k, v in sizes.items()) + kv + f" of model {profile.name}")


def _node_groups(ordered: tuple, tp: int, allowed: list[int], rank: int,
                 memory_fraction: float, interned: dict, known: dict) -> list[_Group]:
    """Cut one node's devices into groups of ``tp`` (fastest together), remainder smaller.
    ``ordered``: the node's devices fastest first and their classes (``_fastest_first``)."""
    devices, classes = ordered
    groups, i = [], 0
    while i < len(devices):
        left = len(devices) - i
        size = tp if left >= tp else max((t for t in allowed if t <= left), default=1)
        groups.append(_Group(tuple(devices[i:i + size]), rank, memory_fraction, interned,
                             classes[i:i + size], known))
        i += size
    return groups


def _fastest_first(devices: list[Device]) -> tuple:
    """A node's devices, fastest first (then by id), and each one's (spec, slowdown) class."""
    ordered = sorted(devices, key=lambda d: (-d.flops, d.id))
    return ordered, tuple((id(d.spec), d.slowdown) for d in ordered)


def _pipelines(groups: list[_Group], depth: int, mixed: bool) -> tuple[tuple[_Group, ...], ...]:
    if not mixed:
        return tuple(tuple(groups[i:i + depth]) for i in range(0, len(groups), depth))
    count = math.ceil(len(groups) / depth)
    ranked = sorted(groups, key=lambda g: (-g.tp * g.flops, g.node_rank, g.devices[0].id))
    pipes = []
    for j in range(count):
        members = ranked[j::count]
        pipes.append(tuple(sorted(members, key=lambda g: (g.node_rank, g.devices[0].id))))
    return tuple(pipes)


def _group_sets(devices: tuple[Device, ...], profile: ModelProfile,
                options: PlannerOptions, interned: dict, keep=None):
    """Yield (TP degree per type, TP groups) for each TP degree of each device type
    (only the degree maps in ``keep`` when given)."""
    by_node: dict[str, list[Device]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    node_order = _node_order(by_node)
    types = sorted({d.spec.name for d in devices})
    per_type = {t: tp_options(profile, options, max(
        sum(1 for d in devs if d.spec.name == t) for devs in by_node.values()))
        for t in types}
    combos = list(product(*(per_type[t] for t in types)))
    if len(combos) > _MAX_TP_COMBOS:  # many device types: one degree for all
        common = sorted(set.intersection(*(set(v) for v in per_type.values())) or {1})
        combos = [tuple(t for _ in types) for t in common]
    if keep is not None:  # the kept maps, on the types this subset still has
        keep = {tuple(kv for kv in k if kv[0] in per_type) for k in keep}
    cache: dict[tuple, list[_Group]] = {}
    ordered: dict[str, tuple] = {}  # node -> _fastest_first
    known: dict[tuple, tuple] = {}  # device classes -> a group's attributes
    for combo in combos:
        tp_of = dict(zip(types, combo))
        if keep is not None and tuple(sorted(tp_of.items())) not in keep:
            continue
        groups = []
        for rank, node in enumerate(node_order):
            devs = by_node[node]
            kind = devs[0].spec.name
            if (node, tp_of[kind]) not in cache:
                if node not in ordered:
                    ordered[node] = _fastest_first(devs)
                cache[node, tp_of[kind]] = _node_groups(
                    ordered[node], tp_of[kind], per_type[kind], rank, options.memory_fraction,
                    interned, known)
            groups += cache[node, tp_of[kind]]
        yield tuple(sorted(tp_of.items())), groups


def _node_order(by_node: dict[str, list[Device]]) -> list[str]:
    """Whole, uniform nodes first (natural name order), then nodes with failed or degraded
    devices: pipelines chained over the groups then line up with node boundaries, and the
    irregular groups gather in the last pipelines."""
    full = {}
    for devs in by_node.values():
        kind = devs[0].spec.name
        full[kind] = max(full.get(kind, 0), len(devs))

    def irregular(node: str) -> bool:
        devs = by_node[node]
        return len(devs) < full[devs[0].spec.name] or any(d.slowdown > 1 for d in devs)

    return sorted(by_node, key=lambda n: (irregular(n), _natural(n)))


def _depth_layouts(groups: list[_Group], profile: ModelProfile, options: PlannerOptions):
    """Yield (depth, layouts of that depth) in increasing depth; a layout is a pair: a tuple of
    pipelines, each a tuple of TP groups in stage order, and their signatures (or None)."""
    depths = options.pp_degrees or _PP_DEPTHS
    hetero = len({g.key for g in groups}) > 1
    sids = [g.sid for g in groups]
    same = [a.node == b.node for a, b in zip(groups, groups[1:])]
    for depth in sorted(depths):
        if depth > min(len(groups), profile.num_layers):
            break
        yield depth, [(_pipelines(groups, depth, mixed),
                       None if mixed else _chunk_signatures(sids, same, depth))
                      for mixed in ((False, True) if hetero and depth > 1 else (False,))]


def _chunk_signatures(sids: list[int], same: list[bool], depth: int) -> list[tuple]:
    """``passes.signature`` of each pipeline of ``_pipelines(groups, depth, False)``, from the
    groups' sids and whether each group shares its successor's node."""
    if depth == 1:
        return [(sid,) for sid in sids]
    out = []
    for i in range(0, len(sids), depth):
        if i + 1 == len(sids):
            out.append((sids[i],))
        else:
            out.append((tuple(sids[i:i + depth]), tuple(same[i:i + depth - 1])))
    return out


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


# ---- the entry point --------------------------------------------------------------------------

def plan_for(inventory: Inventory, profile: ModelProfile, global_batch: int,
             current_plan: Optional[Plan] = None,
             options: PlannerOptions = PlannerOptions()) -> PlanResult:
    """The best plan for ``profile`` on the usable devices of ``inventory``, with alternatives.

    Raises ``PlanInfeasibleError`` (naming the shortfall) when nothing fits, and
    ``PlannerError`` for bad inputs. Python's cyclic garbage collector is paused meanwhile
    (``paused_gc``).
    """
    with paused_gc():
        return _plan_for(inventory, profile, global_batch, current_plan, options)


_gc_lock = threading.Lock()
_gc_pauses = 0  # calls inside paused_gc, all threads together
_gc_paused_it = False  # whether the first of them turned the collector off


@contextmanager
def paused_gc():
    """No cyclic garbage collection inside (nested and concurrent uses are fine; the collector
    is left as it was found once the last one ends). A search over thousands of devices
    allocates a few hundred thousand short-lived objects and no cycles: reference counting
    frees them, and the collections they would trigger, each a walk over every object of the
    process, cost a third of the search's time or more in a process holding many records."""
    global _gc_pauses, _gc_paused_it
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_paused_it = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_paused_it:
                gc.enable()


def _plan_for(inventory: Inventory, profile: ModelProfile, global_batch: int,
              current_plan: Optional[Plan], options: PlannerOptions) -> PlanResult:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"global_batch={global_batch!r} must be a positive integer")
    _check_tp_degrees(profile, options)
    usable = inventory.usable
    if not usable:
        raise PlanInfeasibleError(f"no usable device: all {len(inventory.devices)} devices of "
                                  "the inventory have failed")
    solver = Solver(profile, global_batch, options)
    drafts, rejected = _scan_subsets(solver, usable, profile, options)
    if not drafts:
        raise (_short_of_redundancy(usable, profile, options) if rejected
               else _infeasible(usable, profile, options))
    drafts.sort(key=lambda d: (_preference(d, len(usable), profile.num_layers, options),
                               d.score))  # stable: layouts come in a fixed order
    candidates = _refine(drafts, solver, inventory, profile, options, current_plan)
    if options.redundancy > 1:
        kept = [c for c in candidates if c.estimate.replica_nodes >= options.redundancy]
        if candidates and not kept:
            raise _short_of_redundancy(usable, profile, options)
        candidates = kept
    if not candidates:
        raise _infeasible(usable, profile, options)
    ranked = _rank(candidates, options)
    chosen = ranked[0]
    if chosen.estimate.unused_devices:
        steps = _with_steps(chosen, candidates, drafts, solver, inventory, profile, options)
        chosen = subsets.with_idle(chosen, subsets.idle_devices(chosen, inventory, steps))
    return PlanResult(chosen, tuple(ranked[1:1 + options.alternatives]), profile, inventory)


def _scan_subsets(solver: Solver, usable: tuple[Device, ...], profile: ModelProfile,
                  options: PlannerOptions) -> tuple[list[Draft], int]:
    """Fast-score the layouts of every subset of ``subsets.subsets`` (only all usable devices
    with ``options.use_all_devices``): (drafts, layouts dropped for ``options.redundancy``).
    Past the first subset only the TP degree maps that did best on it are retried, and a
    family of subsets stops once dropping more stops helping (``subsets.Patience``)."""
    drafts: list[Draft] = []
    keep = None
    rejected = 0
    patience = subsets.Patience(len(usable))
    tried = [(0, usable)] if options.use_all_devices else subsets.subsets(usable)
    for index, (family, devices) in enumerate(tried):
        if not patience.wants(family):
            continue
        best: dict[tuple, float] = {}
        for tp_of, groups in _group_sets(devices, profile, options, solver.interned, keep):
            found, dropped = _scan_depths(solver, groups)
            drafts += found
            rejected += dropped
            best[tp_of] = min((d.score for d in found), default=math.inf)
        patience.scored(family, min(best.values(), default=math.inf))
        if index == 0:
            # On the subsets, only the TP degrees that did best on all devices are retried.
            keep = set(sorted(best, key=lambda k: (best[k], k))[:_VARIANT_TP_KEEP])
    return drafts, rejected


def _with_steps(chosen: Candidate, candidates: list[Candidate], drafts: list[Draft],
                solver: Solver, inventory: Inventory, profile: ModelProfile,
                options: PlannerOptions) -> dict[int, float]:
    """Per device ``chosen`` leaves idle, the least predicted step time of a plan that gives it
    work: the exact candidates, and the best-ranked draft using it re-solved exactly (at most
    ``_IDLE_EXACT`` drafts)."""
    idle = set(chosen.estimate.unused_devices)
    out: dict[int, float] = {}

    def seen(devices, step: float) -> None:
        for d in idle.intersection(devices):
            if d not in out or step < out[d]:
                out[d] = step

    for c in candidates:
        seen(c.plan.devices, c.estimate.step_time_s)
    left, solved = set(idle), 0
    for draft in drafts:
        if not left or solved >= _IDLE_EXACT:
            break
        if left.isdisjoint(d.id for _, pipe, _ in draft.assigned for g in pipe
                           for d in g.devices):
            continue
        solved += 1
        try:
            plan = solver.exact(draft)
            est = cost.estimate_plan(plan, inventory, profile, options)
        except (PlanError, PlanInfeasibleError):
            continue
        seen(plan.devices, est.step_time_s)
        left -= set(plan.devices)
    return out


def _scan_depths(solver: Solver, groups: list[_Group]) -> tuple[list[Draft], int]:
    """Fast-score layouts of increasing pipeline depth. Deeper pipelines trade data parallelism
    for bubble; once ``_PATIENCE`` depths in a row fail to beat the best, deeper ones stop.
    Layouts that break ``options.redundancy`` are dropped and counted: (drafts, dropped)."""
    out, best, worse, dropped = [], math.inf, 0, 0
    want, layers = solver.options.redundancy, solver.profile.num_layers
    for _, layouts in _depth_layouts(groups, solver.profile, solver.options):
        scores = []
        for layout, signatures in layouts:
            draft = solver.fast(layout, signatures)
            if draft is not None and want > 1 and not _draft_replicated(draft, layers, want):
                dropped += 1
                continue
            if draft is not None:
                out.append(draft)
                scores.append(draft.score)
        if scores and min(scores) < best:
            best, worse = min(scores), 0
        elif best < math.inf:
            worse += 1
            if worse >= _PATIENCE:
                break
    return out, dropped


def _preference(draft: Draft, usable: int, num_layers: int, options: PlannerOptions) -> tuple:
    """The ranking's preference classes for a draft (0 is preferred), as in ``_rank``."""
    short = (int(options.keep_copy_nodes > 1
                 and not _draft_replicated(draft, num_layers, options.keep_copy_nodes)),
             max(0, options.keep_copies - len(draft.assigned)))
    idle = 0
    if options.use_all_devices:
        idle = int(sum(g.tp for _, pipe, _ in draft.assigned for g in pipe) < usable)
    redundant = 0
    if options.cross_node_replicas:
        redundant = int(not _draft_replicated(draft, num_layers, 2))
    return (short, idle, redundant)


def _draft_replicated(draft: Draft, num_layers: int, want: int) -> bool:
    """Whether every layer of a draft lives on ``want`` nodes or more (a TP group sits in one
    node, so each node holding a layer holds every slice of it)."""
    nodes: list[set] = [set() for _ in range(num_layers)]
    left = num_layers
    for model, pipe, _ in draft.assigned:
        start = 0
        for g, layers in zip(pipe, model.split):
            for layer in range(start, start + layers):
                held = nodes[layer]
                if len(held) < want and g.node not in held:
                    held.add(g.node)
                    if len(held) == want:
                        left -= 1
            start += layers
        if not left:
            return True
    return False


def _refine(drafts, solver: Solver, inventory: Inventory, profile: ModelProfile,
            options: PlannerOptions, current_plan: Optional[Plan]) -> list[Candidate]:
    """Exact plans for the best drafts (the first ``options.refine`` with re-solved layer
    splits), distinct, plus the candidates derived from ``current_plan``. A re-solved split that
    moves a layer off the nodes ``options.redundancy`` needs falls back to the draft's split."""
    out, seen = [], []
    wanted = options.refine + options.alternatives
    for draft in drafts:
        if len(out) >= wanted:
            break
        resolve = len(out) < options.refine
        try:
            plan = solver.exact(draft, resolve=resolve)
            cand = candidate(plan, "", inventory, profile, options, current_plan)
            if resolve and cand is not None and \
                    cand.estimate.replica_nodes < options.redundancy:
                plan = solver.exact(draft, resolve=False)
                cand = candidate(plan, "", inventory, profile, options, current_plan)
        except PlanError:
            continue
        # Distinct plans: dataclass equality is the plans' JSON equality (every field is an
        # int); comparing stops at the first difference, encoding would not.
        if cand is not None and not any(plan == p for p in seen):
            seen.append(plan)
            out.append(cand)
    if current_plan is not None:
        for cand in from_current(current_plan, solver, inventory, profile, options):
            if not any(cand.plan == p for p in seen):
                seen.append(cand.plan)
                out.append(cand)
    return out


def _rank(candidates: list[Candidate], options: PlannerOptions) -> list[Candidate]:
    """Best first: preference classes, then score; near-equal plans by switch traffic. The
    last tie-break is the plan's JSON text, encoded only for plans tied on everything before
    it (plans over thousands of devices take milliseconds each to encode)."""
    def head_key(c: Candidate):
        redundant = options.cross_node_replicas and not c.estimate.cross_node_replicas
        idle = options.use_all_devices and bool(c.estimate.unused_devices)
        return ((shortfall(c.estimate, options), int(idle), int(redundant)), c.score)

    def near_key(c: Candidate):
        return (c.estimate.switch_bytes or 0, max(len(p.stages) for p in c.plan.pipelines),
                c.score)

    ranked = _sorted_by(candidates, head_key)
    head = head_key(ranked[0])
    near = [c for c in ranked
            if head_key(c)[0] == head[0] and c.score <= head[1] * (1.0 + options.tie_tolerance)]
    # Near-equal plans: least switch traffic first, then the shallowest pipelines (fewer
    # hand-offs, simpler switches), then the score.
    near = _sorted_by(near, near_key)
    taken = {id(c) for c in near}  # candidates are distinct plans: identity is equality
    return near + [c for c in ranked if id(c) not in taken]


def _sorted_by(candidates: list[Candidate], key) -> list[Candidate]:
    """``sorted(candidates, key=lambda c: key(c) + (c.plan.to_json(),))``, encoding only the
    plans whose ``key`` ties with another's (for the others the text is never compared)."""
    keys = [key(c) for c in candidates]
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    full = [k + ((c.plan.to_json(),) if counts[k] > 1 else ("",))
            for k, c in zip(keys, candidates)]
    order = sorted(range(len(candidates)), key=full.__getitem__)
    return [candidates[i] for i in order]


def _infeasible(usable: tuple[Device, ...], profile: ModelProfile,
                options: PlannerOptions) -> PlanInfeasibleError:
    """Why nothing fits: total memory short of one replica, else no stage holds a layer."""
    need = _replica_bytes(profile)
    have = int(sum(d.spec.memory_bytes for d in usable) * options.memory_fraction)
    if need > have:
        return PlanInfeasibleError(
            f"model {profile.name} needs {fmt_bytes(need)} for one replica (weights, gradients, "
            f"optimizer state, one micro-batch of activations); the {len(usable)} usable devices "
            f"offer {fmt_bytes(have)}: short by {fmt_bytes(need - have)}",
            needed_bytes=need, available_bytes=have)
    biggest = max(usable, key=lambda d: (d.spec.memory_bytes, -d.id))
    return PlanInfeasibleError(
        f"model {profile.name} fits the {len(usable)} usable devices in total "
        f"({fmt_bytes(have)} for {fmt_bytes(need)}) but no layout does: a stage cannot hold "
        f"even one layer within {fmt_bytes(biggest.spec.memory_bytes * options.memory_fraction)}"
        " per device with the allowed TP degrees", needed_bytes=need, available_bytes=have)


def _replica_bytes(profile: ModelProfile) -> int:
    """One replica: weights, gradients, optimizer state, one micro-batch of activations."""
    state = profile.total_params * profile.state_bytes_per_param
    act = profile.num_layers * profile.seq_len * profile.activation_bytes_per_token_layer
    return int(state + act)


def _short_of_redundancy(usable: tuple[Device, ...], profile: ModelProfile,
                         options: PlannerOptions) -> RedundancyError:
    """Why no plan keeps every slice on ``options.redundancy`` nodes: too few nodes, else memory
    counted at most one replica per node, else no layout within memory."""
    want = options.redundancy
    by_node: dict[str, list[Device]] = {}
    for d in usable:
        by_node.setdefault(d.node, []).append(d)
    head = f"redundancy {want} (every parameter slice on {want} nodes)"
    if len(by_node) < want:
        names = ", ".join(sorted(by_node, key=_natural))
        return RedundancyError(
            f"{head}: only {len(by_node)} node{'s' if len(by_node) != 1 else ''} "
            f"({names}) {'have' if len(by_node) != 1 else 'has'} usable devices: short by "
            f"{want - len(by_node)} node{'s' if want - len(by_node) != 1 else ''}")
    need = _replica_bytes(profile)
    have = sum(min(need, int(sum(d.spec.memory_bytes for d in devs) * options.memory_fraction))
               for devs in by_node.values())
    if have < want * need:
        return RedundancyError(
            f"{head}: {want} replicas of model {profile.name} need {fmt_bytes(want * need)}; the "
            f"{len(usable)} usable devices on {len(by_node)} nodes offer {fmt_bytes(have)}, "
            f"counting at most one replica per node: short by {fmt_bytes(want * need - have)}",
            needed_bytes=want * need, available_bytes=have)
    smallest = min(d.spec.memory_bytes for d in usable) * options.memory_fraction
    return RedundancyError(
        f"{head}: no layout of the {len(usable)} usable devices on {len(by_node)} nodes holds "
        f"it within memory ({fmt_bytes(smallest)} usable on the smallest device; one replica "
        f"needs {fmt_bytes(need)})", needed_bytes=want * need, available_bytes=have)
