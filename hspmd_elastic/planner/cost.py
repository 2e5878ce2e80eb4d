"""The cost model: step time and memory per device of a plan, from first principles.

Per stage and micro-batch of ``b`` sequences (``tokens = b x seq_len``):
  * compute: 3 x forward FLOPs (forward + backward) / (TP degree x the slowest member's FLOP/s);
  * TP communication: 4 all-reduces of the hidden activations per layer (2 forward, 2 backward),
    each a start-up latency plus ring cost 2(t-1)/t x bytes over the group's intra-node bandwidth;
  * pipeline hand-off: activations forward and their gradients back to the next stage (latency
    plus bytes), over intra-node bandwidth when both stages share a node, inter-node otherwise;
  * a fixed cost per micro-batch (kernel launches, Python).
Per stage and step, whatever its rows: ``u_s``, each device's local parameter elements (its
layers' share over its TP degree, the embedding on the first stage, the head on the last) x the
slowest member's cost per element (``DeviceSpec.update_s_per_param``: the optimizer update,
gradient copies). A pipeline of stage times ``t_s`` running ``m`` micro-batches with 1F1B takes
``sum(t_s) + (m - 1) max(t_s) + max(u_s)`` (fill and drain are the bubble; the slowest update
delays the next step's fill). Gradients are then all-reduced
across the pipelines (every pipeline holds every layer), ring cost per device over its shard,
inter-node when a layer's holders span nodes; this sync is not overlapped. The step time is the
slowest pipeline plus the slowest sync. Uneven optimizer shards charge ``u_s`` and the optimizer
state at the pipeline's share of the rows (``zero_cost``; the fast pass charges the update so
too, as a cost per row, and the optimizer state's memory whole).

Memory per device: its parameter shard x (weights + gradients + optimizer state) plus activations
of the micro-batches 1F1B keeps in flight on that stage (``min(stages - s, m)``; with TP, 10/34 of
the activation bytes stay whole and 24/34 are split), plus the last stage's logits. A plan that
does not fit raises ``PlanInfeasibleError`` naming the device and the shortfall.

Every function here is pure and cheap; the search calls the per-stage ones directly.
``estimate_plan`` runs them once per distinct stage of a plan (same device classes, layers and
micro-batches), with the results the per-stage computation over every device gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from hspmd_elastic.plan import Plan
from hspmd_elastic.planner import zero_cost
from hspmd_elastic.planner.api import (Device, Estimate, Inventory, ModelProfile,
                                       PlanInfeasibleError, PlannerOptions, fmt_bytes)


@dataclass(frozen=True)
class StageShape:
    """What the cost model needs about a stage's TP group and its link to the next stage."""

    tp: int
    flops: float  # effective FLOP/s of the slowest member
    memory: int  # usable bytes of the smallest member
    intra_gbps: float  # slowest intra-node link of the group
    next_gbps: Optional[float]  # link to the next stage; None on the last stage
    overhead_s: float  # fixed cost per micro-batch (a slow device is slow at this too)
    latency_s: float = 0.0  # start-up cost of one collective or send/receive
    update_s: float = 0.0  # per local parameter element per step (the slowest member's)


def group_shape(devices: Sequence[Device], nxt: Optional[Sequence[Device]],
                memory_fraction: float) -> StageShape:
    """The shape of a TP group ``devices`` followed by the group ``nxt`` (None: last stage)."""
    link = None
    if nxt is not None:
        both = list(devices) + list(nxt)
        one_node = len({d.node for d in both}) == 1
        link = min(d.link_gbps(not one_node) for d in both)
    # One pass over the group (this runs for every stage of every candidate: thousands of
    # times for a plan over thousands of devices); the same minima and maxima as min()/max().
    if not devices:
        raise ValueError("group_shape: a TP group needs at least one device")
    first = devices[0]
    spec = first.spec
    flops, memory, intra = first.flops, spec.memory_bytes, first.link_gbps(False)
    overhead, latency = spec.microbatch_overhead_s * first.slowdown, first.link_latency_s
    update = spec.update_s_per_param * first.slowdown
    for d in devices[1:]:
        spec = d.spec
        if spec is not first.spec or d.slowdown != first.slowdown:
            flops = min(flops, d.flops)
            memory = min(memory, spec.memory_bytes)
            intra = min(intra, d.link_gbps(False))
            overhead = max(overhead, spec.microbatch_overhead_s * d.slowdown)
            latency = max(latency, d.link_latency_s)
            update = max(update, spec.update_s_per_param * d.slowdown)
    return StageShape(tp=len(devices), flops=flops, memory=int(memory * memory_fraction),
                      intra_gbps=intra, next_gbps=link, overhead_s=overhead, latency_s=latency,
                      update_s=update)


# ---- time ----------------------------------------------------------------------------------

def stage_time_coeffs(profile: ModelProfile, shape: StageShape, last: bool,
                      b: int) -> tuple[float, float]:
    """(fixed, per layer) seconds of one micro-batch of ``b`` sequences on this stage."""
    tokens = b * profile.seq_len
    rate = shape.tp * shape.flops
    per_layer = 3.0 * tokens * profile.layer_flops_per_token / rate
    act = tokens * profile.hidden_size * profile.activation_bytes
    if shape.tp > 1:
        per_layer += 4 * (shape.latency_s
                          + 2.0 * (shape.tp - 1) / shape.tp * act / (shape.intra_gbps * 1e9))
    fixed = shape.overhead_s
    if last:
        fixed += 3.0 * tokens * profile.head_flops_per_token / rate
    if shape.next_gbps is not None:
        fixed += 2.0 * (shape.latency_s + act / (shape.next_gbps * 1e9))
    return fixed, per_layer


def stage_time(profile: ModelProfile, shape: StageShape, layers: int, last: bool, b: int) -> float:
    fixed, per_layer = stage_time_coeffs(profile, shape, last, b)
    return fixed + per_layer * layers


def update_coeffs(profile: ModelProfile, shape: StageShape, first: bool,
                  last: bool, share: float = 1.0) -> tuple[float, float]:
    """(fixed, per layer) seconds per step of the stage's work that does not depend on its
    rows: each device's local parameter elements x ``shape.update_s`` x ``share``, the part it
    updates (``zero_cost.pipeline_share``: 1.0 unless the optimizer shards are uneven)."""
    if not shape.update_s:
        return 0.0, 0.0
    per = shape.update_s * share / shape.tp
    return per * stage_params(profile, 0, first, last), per * profile.layer_params


def update_time(profile: ModelProfile, shape: StageShape, layers: int, first: bool,
                last: bool, share: float = 1.0) -> float:
    fixed, per_layer = update_coeffs(profile, shape, first, last, share)
    return fixed + per_layer * layers


def pipeline_time(stage_times: Sequence[float], num_microbatches: int,
                  updates: Sequence[float] = ()) -> float:
    """1F1B: fill and drain once, then the slowest stage paces every other micro-batch; then
    the slowest stage's per-step update (``updates``, per stage; none: 0)."""
    return (sum(stage_times) + (num_microbatches - 1) * max(stage_times)
            + max(updates, default=0.0))


def grad_sync_time(profile: ModelProfile, params_per_device: float, replicas: int,
                   gbps: float, latency_s: float = 0.0) -> float:
    """A ring all-reduce of one device's gradient shard over ``replicas`` holders, as one
    bucket: 2(R-1) steps of latency plus 2(R-1)/R x bytes."""
    if replicas <= 1:
        return 0.0
    shard = params_per_device * profile.grad_bytes
    return 2.0 * (replicas - 1) * (latency_s + shard / replicas / (gbps * 1e9))


# ---- memory --------------------------------------------------------------------------------

def stage_params(profile: ModelProfile, layers: int, first: bool, last: bool) -> int:
    """Parameters of a stage; a tied embedding is on both ends, once on a stage that is both."""
    once = profile.tie_embeddings and first and last
    return (layers * profile.layer_params + (profile.embed_params if first and not once else 0)
            + (profile.head_params if last else 0))


def memory_coeffs(profile: ModelProfile, tp: int, first: bool, last: bool, b: int,
                  inflight: int, share: float = 1.0) -> tuple[float, float]:
    """(fixed, per layer) bytes per device of a stage; ``share``: the part of its parameters
    whose optimizer state it keeps (``zero_cost``)."""
    state = zero_cost.state_bytes(profile, share) / tp
    act_share = (10.0 + 24.0 / tp) / 34.0
    per_layer = (profile.layer_params * state
                 + profile.kv_replica_params(tp) * zero_cost.state_bytes(profile, share)
                 + inflight * b * profile.seq_len * profile.activation_bytes_per_token_layer
                 * act_share)
    fixed = stage_params(profile, 0, first, last) * state
    if last:
        fixed += b * profile.seq_len * profile.vocab_size * max(4, profile.activation_bytes) / tp
    return fixed, per_layer


def stage_memory(profile: ModelProfile, tp: int, layers: int, first: bool, last: bool, b: int,
                 inflight: int, share: float = 1.0) -> int:
    fixed, per_layer = memory_coeffs(profile, tp, first, last, b, inflight, share)
    return int(math.ceil(fixed + per_layer * layers))


def layer_cap(profile: ModelProfile, shape: StageShape, first: bool, last: bool, b: int,
              inflight: int) -> int:
    """The most layers this stage can hold within its memory (may be < 1: it cannot hold one)."""
    fixed, per_layer = memory_coeffs(profile, shape.tp, first, last, b, inflight)
    return int(math.floor((shape.memory - fixed) / per_layer))


def inflight(num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return min(num_stages - stage, num_microbatches)


# ---- whole plans ---------------------------------------------------------------------------

def estimate_plan(plan: Plan, inventory: Inventory, profile: ModelProfile,
                  options: PlannerOptions = PlannerOptions(),
                  current_plan: Optional[Plan] = None) -> Estimate:
    """Estimate ``plan``; raise ``PlanInfeasibleError`` if it uses an unusable device or a device
    runs out of memory.

    The search scores a handful of plans over thousands of devices, most stages alike: each
    stage is reduced to the classes (spec, slowdown) of its devices and of the next stage's, and
    the cost model runs once per distinct stage (``_Index``, ``_StageCosts``); the results are
    those of the per-stage formulas, evaluated on the same values."""
    if plan.num_layers != profile.num_layers:
        raise PlanInfeasibleError(f"plan has num_layers={plan.num_layers}, model "
                                  f"{profile.name} has {profile.num_layers}")
    index = _index_of(inventory)
    stages = [[tuple(s.devices) for s in pipe.stages] for pipe in plan.pipelines]
    used = {d for pipe in stages for devices in pipe for d in devices}
    bad = used - index.usable_ids
    if bad:
        d = min(bad)
        if d not in index.devs:
            raise PlanInfeasibleError(f"plan uses device {d}, which is not in the inventory")
        raise PlanInfeasibleError(f"plan uses device {d}, which has failed")
    costs = _StageCosts(index, profile, options)
    memory, limits, stage_times, pipe_times, pipe_updates = {}, {}, [], [], []
    facts = []  # per stage: (layers, classes, nodes)
    for pi, pipe in enumerate(plan.pipelines):
        updates: list[float] = []
        times = costs.pipeline(plan, pi, stages[pi], memory, limits, facts, updates)
        stage_times.append(tuple(times))
        pipe_times.append(pipeline_time(times, pipe.num_microbatches, updates))
        pipe_updates.append(max(updates))
    layers = _LayerNodes(plan.num_layers, facts)
    sync = costs.grad_sync(len(plan.pipelines), facts, layers)
    slowest = max(range(len(pipe_times)), key=lambda i: pipe_times[i])
    busy = plan.pipelines[slowest].num_microbatches * max(stage_times[slowest])
    step = max(pipe_times) + sync
    replicas = layers.replica_nodes()
    return Estimate(
        step_time_s=step,
        samples_per_s=plan.global_batch / step,
        tokens_per_s=plan.global_batch * profile.seq_len / step,
        pipeline_times_s=tuple(pipe_times),
        stage_times_s=tuple(stage_times),
        grad_sync_s=sync,
        bubble_fraction=max(0.0, 1.0 - busy / (pipe_times[slowest] - pipe_updates[slowest])),
        memory_bytes=memory,
        memory_limit_bytes=limits,
        unused_devices=tuple(d for d in index.usable_order if d not in used),
        cross_node_replicas=replicas >= 2,
        switch_bytes=None if current_plan is None else switch_bytes(current_plan, plan, profile),
        replica_nodes=replicas,
        # each pipeline holds every slice once (its stages tile the layers, a TP group splits
        # its stage's slices over its devices): the fewest devices holding one is the count
        replica_devices=len(plan.pipelines),
    )


class _Index:
    """Per device of one inventory: its node and its class, an int standing for its
    (spec object, slowdown): two devices of one class look the same to the cost model."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self.devs = inventory.devices_by_id
        self.usable_order = tuple(d.id for d in inventory.usable)
        self.usable_ids = frozenset(self.usable_order)
        self.node = {d.id: d.node for d in inventory.devices}
        interned: dict[tuple, int] = {}
        self.cls = {d.id: interned.setdefault((id(d.spec), d.slowdown), len(interned))
                    for d in inventory.devices}
        self.one_of: dict[int, int] = {}  # class -> its first device
        for d, c in self.cls.items():
            self.one_of.setdefault(c, d)
        self.limits: dict[float, dict[int, int]] = {}  # memory fraction -> class -> limit

    def limit_of(self, memory_fraction: float) -> dict[int, int]:
        if memory_fraction not in self.limits:
            out: dict[int, int] = {}
            for d in self.inventory.devices:
                out.setdefault(self.cls[d.id], int(d.spec.memory_bytes * memory_fraction))
            self.limits[memory_fraction] = out
        return self.limits[memory_fraction]


class _LastOf:
    """``fn(x)``, remembered for the last ``x`` asked, by identity (inventories and plans are
    immutable; a search asks about the same one again and again). The pair is one tuple,
    swapped whole, so concurrent callers never mix two arguments' values."""

    def __init__(self, fn):
        self.fn, self._last = fn, (None, None)

    def __call__(self, x):
        cached, value = self._last
        if cached is not x:
            value = self.fn(x)
            self._last = (x, value)
        return value


_index_of = _LastOf(_Index)  # the current inventory's index


class _StageCosts:
    """The per-stage cost model of one ``estimate_plan`` call, once per distinct stage."""

    def __init__(self, index: _Index, profile: ModelProfile, options: PlannerOptions):
        self.index, self.profile, self.options = index, profile, options
        self.limit = index.limit_of(options.memory_fraction)
        self.shapes: dict[tuple, StageShape] = {}
        self.stages: dict[tuple, tuple] = {}

    def pipeline(self, plan: Plan, pi: int, groups: list[tuple], memory: dict, limits: dict,
                 facts: list, updates: list) -> list[float]:
        """Stage times of pipeline ``pi``; fills ``memory`` and ``limits`` per device,
        ``facts`` and ``updates`` (``update_time``) per stage; raises as
        ``_pipeline_stage_times`` does when memory is short."""
        index, profile = self.index, self.profile
        pipe = plan.pipelines[pi]
        n, m, b = len(pipe.stages), pipe.num_microbatches, pipe.microbatch_size
        classes = [tuple(map(index.cls.__getitem__, g)) for g in groups]
        nodes = [tuple(map(index.node.__getitem__, g)) for g in groups]
        times, share = [], zero_cost.pipeline_share(plan, pi, self.options)
        for si, stage in enumerate(pipe.stages):
            last = si == n - 1
            if last:
                shape_key = (classes[si], None, False)
            else:
                one_node = len(set(nodes[si] + nodes[si + 1])) == 1
                shape_key = (classes[si], classes[si + 1], one_node)
            shape = self.shapes.get(shape_key)
            if shape is None:
                devs = index.devs
                shape = self.shapes[shape_key] = group_shape(
                    [devs[d] for d in groups[si]],
                    None if last else [devs[d] for d in groups[si + 1]],
                    self.options.memory_fraction)
            layers = stage.layers[1] - stage.layers[0]
            key = (shape_key, layers, si == 0, last, b, inflight(n, si, m), share)
            found = self.stages.get(key)
            if found is None:
                need = stage_memory(profile, shape.tp, layers, si == 0, last, b, key[5], share)
                lims = tuple(self.limit[c] for c in dict.fromkeys(classes[si]))
                found = self.stages[key] = (need, lims, min(lims),
                                            stage_time(profile, shape, layers, last, b),
                                            update_time(profile, shape, layers, si == 0, last,
                                                        share))
            need, lims, lowest, elapsed, update = found
            if need > lowest:  # the reference names the device that is short
                _pipeline_stage_times(plan, pi, index.devs, profile, self.options, {}, {})
                raise AssertionError("unreachable: the reference raises for this stage")
            memory.update(dict.fromkeys(groups[si], need))
            if len(lims) == 1:
                limits.update(dict.fromkeys(groups[si], lims[0]))
            else:
                limits.update(zip(groups[si], map(self.limit.__getitem__, classes[si])))
            times.append(elapsed)
            updates.append(update)
            facts.append((stage.layers, si == 0, last, classes[si], nodes[si]))
        return times

    def grad_sync(self, replicas: int, facts: list, layers: "_LayerNodes") -> float:
        """``_grad_sync``: the slowest gradient all-reduce over the pipelines."""
        if replicas <= 1:
            return 0.0
        devs, profile = self.index.devs, self.profile
        worst = 0.0
        seen: set = set()
        for span, first, last, classes, nodes in facts:
            spans = layers.spans(span)
            key = (span[1] - span[0], first, last, classes, spans)
            if key in seen:
                continue
            seen.add(key)
            group = [devs[self.index.one_of[c]] for c in classes]  # the same specs
            gbps = min(d.link_gbps(spans) for d in group)
            params = stage_params(profile, span[1] - span[0], first, last) / len(group)
            latency = max(d.link_latency_s for d in group)
            worst = max(worst, grad_sync_time(profile, params, replicas, gbps, latency))
        return worst


class _LayerNodes:
    """Per decoder layer, which nodes hold it, from the stages' (layers, nodes) facts: what
    ``layer_nodes`` and ``replica_nodes`` compute per stage and layer, here once per distinct
    layer range."""

    def __init__(self, num_layers: int, facts: list):
        self.num_layers = num_layers
        whole: dict[tuple, set] = {}  # layer range -> nodes of the stages inside one node
        split: dict[tuple, list] = {}  # layer range -> node tuples of stages over several
        for span, _, _, _, nodes in facts:
            first = nodes[0]
            if nodes.count(first) == len(nodes):
                whole.setdefault(span, set()).add(first)
            else:
                split.setdefault(span, []).append(nodes)
                whole.setdefault(span, set())
        self.whole, self.split = whole, split
        self.covering: list[tuple] = [
            tuple(r for r in whole if r[0] <= layer < r[1]) for layer in range(num_layers)]
        self._spans: dict[tuple, bool] = {}

    def _holders(self, ranges: tuple) -> set:
        out: set = set()
        for r in ranges:
            out |= self.whole[r]
            for nodes in self.split.get(r, ()):
                out.update(nodes)
        return out

    def spans(self, span: tuple) -> bool:
        """Whether some layer of ``span`` is held on more than one node."""
        if span not in self._spans:
            multi: dict[tuple, bool] = {}
            out = False
            for layer in range(*span):
                ranges = self.covering[layer]
                if ranges not in multi:
                    multi[ranges] = len(self._holders(ranges)) > 1
                if multi[ranges]:
                    out = True
                    break
            self._spans[span] = out
        return self._spans[span]

    def replica_nodes(self) -> int:
        """``replica_nodes``: the fewest nodes any parameter slice lives on."""
        counts: dict[tuple, int] = {}
        fewest = None
        for layer in range(self.num_layers):
            ranges = self.covering[layer]
            if ranges not in counts:
                whole: set = set()
                split: list = []
                for r in ranges:
                    whole |= self.whole[r]
                    split += self.split.get(r, [])
                if not split:
                    counts[ranges] = len(whole)
                else:
                    cells = math.lcm(*(len(nodes) for nodes in split))
                    counts[ranges] = min(len(whole | {nodes[c * len(nodes) // cells]
                                                      for nodes in split})
                                         for c in range(cells))
            count = counts[ranges]
            fewest = count if fewest is None else min(fewest, count)
        return fewest or 0


def _pipeline_stage_times(plan: Plan, pi: int, devs: dict, profile: ModelProfile,
                          options: PlannerOptions, memory: dict, limits: dict) -> list[float]:
    pipe = plan.pipelines[pi]
    n, m, b = len(pipe.stages), pipe.num_microbatches, pipe.microbatch_size
    times = []
    groups = [[devs[d] for d in stage.devices] for stage in pipe.stages]
    for si, stage in enumerate(pipe.stages):
        group = groups[si]
        nxt = groups[si + 1] if si + 1 < n else None
        shape = group_shape(group, nxt, options.memory_fraction)
        layers = stage.layers[1] - stage.layers[0]
        first, last = si == 0, si == n - 1
        need = stage_memory(profile, shape.tp, layers, first, last, b, inflight(n, si, m),
                            zero_cost.pipeline_share(plan, pi, options))
        for dev in group:
            limit = int(dev.spec.memory_bytes * options.memory_fraction)
            if need > limit:
                raise PlanInfeasibleError(
                    f"device {dev.id} ({dev.spec.name}, pipeline {pi} stage {si}, layers "
                    f"{list(stage.layers)}, TP {shape.tp}, micro-batch {b}) needs "
                    f"{fmt_bytes(need)}, has {fmt_bytes(limit)} usable: short by "
                    f"{fmt_bytes(need - limit)}", needed_bytes=need, available_bytes=limit)
            memory[dev.id], limits[dev.id] = need, limit
        times.append(stage_time(profile, shape, layers, last, b))
    return times


def layer_nodes(plan: Plan, devs: dict) -> list[set]:
    """Per decoder layer, the nodes holding a replica of it."""
    nodes: list[set] = [set() for _ in range(plan.num_layers)]
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            stage_nodes = {devs[d].node for d in stage.devices}
            for layer in range(*stage.layers):
                nodes[layer] |= stage_nodes
    return nodes


def cross_node_replicas(plan: Plan, devs: dict) -> bool:
    """Whether every parameter slice lives on two nodes or more."""
    return replica_nodes(plan, devs) >= 2


def replica_nodes(plan: Plan, devs: dict) -> int:
    """The fewest nodes any parameter slice lives on. A stage holds its layers' TP shard
    ``[r/tp, (r+1)/tp)`` on its ``r``-th device; a stage inside one node holds every slice of
    its layers there. The embedding and the head are split like the first and last layers and
    live with them."""
    whole: list[set] = [set() for _ in range(plan.num_layers)]
    split: list[list[tuple]] = [[] for _ in range(plan.num_layers)]
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            nodes = tuple(devs[d].node for d in stage.devices)
            one = len(set(nodes)) == 1
            for layer in range(*stage.layers):
                if one:
                    whole[layer].add(nodes[0])
                else:
                    split[layer].append(nodes)
    fewest = None
    for layer in range(plan.num_layers):
        if not split[layer]:
            count = len(whole[layer])
        else:
            cells = math.lcm(*(len(nodes) for nodes in split[layer]))
            count = min(len(whole[layer] | {nodes[c * len(nodes) // cells]
                                            for nodes in split[layer]})
                        for c in range(cells))
        fewest = count if fewest is None else min(fewest, count)
    return fewest or 0


def _grad_sync(plan: Plan, devs: dict, profile: ModelProfile) -> float:
    """The slowest gradient all-reduce, stage by stage (``_StageCosts.grad_sync`` gives the
    same once per distinct stage)."""
    replicas = len(plan.pipelines)
    if replicas <= 1:
        return 0.0
    nodes = layer_nodes(plan, devs)
    worst = 0.0
    for pipe in plan.pipelines:
        n = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            group = [devs[d] for d in stage.devices]
            spans = any(len(nodes[layer]) > 1 for layer in range(*stage.layers))
            gbps = min(d.link_gbps(spans) for d in group)
            params = stage_params(profile, stage.layers[1] - stage.layers[0], si == 0,
                                  si == n - 1) / len(group)
            latency = max(d.link_latency_s for d in group)
            worst = max(worst, grad_sync_time(profile, params, replicas, gbps, latency))
    return worst


# ---- switching -----------------------------------------------------------------------------

def _holdings(plan: Plan) -> dict[int, tuple[int, int, int, int, bool, bool]]:
    """device -> (layer start, layer stop, tp, tp rank, holds embedding, holds head)."""
    out = {}
    for pipe in plan.pipelines:
        n = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            for rank, d in enumerate(stage.devices):
                out[d] = (stage.layers[0], stage.layers[1], stage.tp, rank, si == 0, si == n - 1)
    return out


# The current plan is compared with every candidate of a search: its holdings, remembered.
_holdings_of = _LastOf(_holdings)


def _shard_overlap(tp_a: int, rank_a: int, tp_b: int, rank_b: int) -> float:
    lo = max(rank_a / tp_a, rank_b / tp_b)
    hi = min((rank_a + 1) / tp_a, (rank_b + 1) / tp_b)
    return max(0.0, hi - lo)


def switch_bytes(old: Plan, new: Plan, profile: ModelProfile) -> int:
    """Bytes of weights and optimizer state that devices of ``new`` must receive: every slice a
    device holds in ``new`` and did not hold in ``old``."""
    per_param = profile.param_bytes + profile.optimizer_bytes
    before = _holdings_of(old) if old.num_layers == new.num_layers else {}
    total = 0.0
    # One value per (holding in new, holding in old): devices of one stage moved alike cost
    # the same; summed per device in the plan's order, as the plain loop would.
    moved: dict[tuple, float] = {}
    for pipe in new.pipelines:
        n = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            tp = stage.tp
            shape = (stage.layers[0], stage.layers[1], tp, si == 0, si == n - 1)
            for rank, d in enumerate(stage.devices):
                was = before.get(d)
                key = (shape, rank, was)
                value = moved.get(key)
                if value is None:
                    value = moved[key] = _moved(profile, shape, rank, was)
                total += value
    return int(round(total * per_param))


def _moved(profile: ModelProfile, shape: tuple, rank: int, was: Optional[tuple]) -> float:
    """Parameters one device must receive: its shard of ``shape`` (layer start, stop, tp, holds
    the embedding, holds the head) at TP rank ``rank``, less what it held before (``was``, a
    ``_holdings`` value, or None)."""
    a, b, tp, emb, head = shape
    params = stage_params(profile, b - a, emb, head) / tp
    kept = 0.0
    if was is not None:
        c, e, tp0, rank0, emb0, head0 = was
        frac = _shard_overlap(tp, rank, tp0, rank0)
        layers = max(0, min(b, e) - max(a, c))
        kept = frac * (layers * profile.layer_params + (profile.embed_params if emb and emb0
                                                        else 0)
                       + (profile.head_params if head and head0 else 0))
    return max(0.0, params - kept)
