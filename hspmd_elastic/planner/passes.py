"""The search's two scoring passes over candidate layouts (pipelines of TP groups).

``Solver.fast`` scores a layout cheaply: identical pipelines are solved once (a pipeline's
*signature* is what the cost model sees of it), layers per stage by min-max water-filling within
memory, rows per pipeline by ``solve.split_rows``. ``Solver.exact`` turns a scored layout into a
``Plan``: layer splits re-solved for the 1F1B objective (``solve.pipeline_layers``), micro-batch
sizes picked per pipeline. The solver caches by value within one ``plan_for`` call; nothing here
keeps state across calls.

Both passes see each stage's per-step update (``cost.update_coeffs``): the fast pass spreads
it over the estimated micro-batches in its water-filling and adds the slowest stage's to a
pipeline's fixed time (with uneven optimizer shards, ``planner.zero_cost``, a pipeline of ``r``
rows updates ``r / B`` of its parameters: the update is then a cost per row, ``update / B``);
the exact pass solves the layer split with it.

A group is any object with ``devices``, ``node``, ``tp``, ``key`` (its ``StageShape`` fields
without the link: tp, FLOP/s, memory, intra-node GB/s, overhead, latency, update), ``inter`` and
``sid`` (an int interned from ``(key, inter)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter, eq
from typing import Optional, Sequence

from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import ModelProfile, PlannerOptions
from hspmd_elastic.planner.solve import minmax_layers, pipeline_layers, split_rows
from hspmd_elastic.planner.zero_cost import UNEVEN


@dataclass
class PipeModel:
    """A solved pipeline signature: shapes, layer split, micro-batch size, time model."""

    shapes: tuple[cost.StageShape, ...]
    split: tuple[int, ...]
    b: int
    fixed: float  # T(r) = fixed + per_row * r for r >= 1
    per_row: float


def signature(pipe: Sequence) -> tuple:
    """What the cost model sees of a pipeline: its groups' interned attributes, and for each
    hand-off whether it stays inside a node."""
    if len(pipe) == 1:
        return (pipe[0].sid,)
    nodes = tuple(map(_node, pipe))
    return (tuple(map(_sid, pipe)), tuple(map(eq, nodes, nodes[1:])))


_sid, _node = attrgetter("sid"), attrgetter("node")


def shapes_of(signature: tuple, attrs: list) -> tuple[cost.StageShape, ...]:
    """The stage shapes of a signature; ``attrs[sid]`` is a group's (key, inter)."""
    sids, same = (signature, ()) if len(signature) == 1 else signature
    out = []
    for i, sid in enumerate(sids):
        (tp, flops, memory, intra, overhead, latency, update), inter = attrs[sid]
        nxt = None
        if i + 1 < len(sids):
            (_, _, _, intra2, _, _, _), inter2 = attrs[sids[i + 1]]
            nxt = min(intra, intra2) if same[i] else min(inter, inter2)
        out.append(cost.StageShape(tp, flops, memory, intra, nxt, overhead, latency, update))
    return tuple(out)


def tp_options(profile: ModelProfile, options: PlannerOptions, node_size: int) -> list[int]:
    """TP degrees for a device type whose largest node has ``node_size`` of them: the valid ones
    (``ModelProfile.tp_valid``: divisors of every size TP splits, so degrees also mix, that
    divide or are multiples of the key/value heads), within the node; at least TP 1."""
    allowed = options.tp_degrees or tuple(range(1, node_size + 1))
    return sorted(t for t in allowed if profile.tp_valid(t) and t <= node_size) or [1]


class Solver:
    """Per-call caches and the pieces of the fast and exact passes."""

    def __init__(self, profile: ModelProfile, global_batch: int, options: PlannerOptions):
        self.profile, self.batch, self.options = profile, global_batch, options
        self.models: dict = {}
        self.splits: dict = {}
        self.batches: dict = {}
        self.interned: dict = {}  # (group key, inter-node gbps) -> sid
        self.attrs: list = []  # sid -> (group key, inter-node gbps)

    @property
    def least_rows(self) -> int:
        """Rows every pipeline gets at least: 1 when the search keeps replicas
        (``PlannerOptions.keep_copies`` above 1: a slow device keeps its copy with a row of
        work rather than leaving the plan), else 0 (a pipeline worth no row is dropped)."""
        return 1 if self.options.keep_copies > 1 else 0

    def _batch_sizes(self, rows: int) -> list[int]:
        cap = min(rows, self.options.max_microbatch_size or rows)
        sizes = {1 << k for k in range(cap.bit_length()) if (1 << k) <= cap} | {cap}
        return sorted(sizes)

    def fits(self, shapes, split, b: int, m: int) -> bool:
        n = len(shapes)
        return all(cost.stage_memory(self.profile, sh.tp, split[s], s == 0, s == n - 1, b,
                                     cost.inflight(n, s, m)) <= sh.memory
                   for s, sh in enumerate(shapes))

    def times(self, shapes, split, b: int) -> list[float]:
        n = len(shapes)
        return [cost.stage_time(self.profile, sh, split[s], s == n - 1, b)
                for s, sh in enumerate(shapes)]

    def updates(self, shapes) -> list[tuple[float, float]]:
        """Per stage, ``cost.update_coeffs``: (fixed, per layer) seconds per step."""
        n = len(shapes)
        return [cost.update_coeffs(self.profile, sh, s == 0, s == n - 1)
                for s, sh in enumerate(shapes)]

    def update_time(self, shapes, split) -> float:
        """The slowest stage's per-step update with ``split`` layers per stage."""
        return max(f + c * layers for (f, c), layers in zip(self.updates(shapes), split))

    def caps(self, shapes, b: int, m: int) -> list[int]:
        n = len(shapes)
        return [cost.layer_cap(self.profile, sh, s == 0, s == n - 1, b, cost.inflight(n, s, m))
                for s, sh in enumerate(shapes)]

    def model(self, signature: tuple, rows_est: int) -> Optional[PipeModel]:
        key = (signature, rows_est)
        if key not in self.models:
            if len(self.attrs) < len(self.interned):
                self.attrs = [k for k, _ in sorted(self.interned.items(), key=lambda kv: kv[1])]
            self.models[key] = self._model(shapes_of(signature, self.attrs), rows_est)
        return self.models[key]

    def _model(self, shapes: tuple, rows_est: int) -> Optional[PipeModel]:
        n = len(shapes)
        coeffs = [cost.stage_time_coeffs(self.profile, sh, s == n - 1, 1)
                  for s, sh in enumerate(shapes)]
        # the per-step update, spread over the rows_est micro-batches of one row
        ups = self.updates(shapes)
        split = minmax_layers([c[0] + u[0] / rows_est for c, u in zip(coeffs, ups)],
                              [c[1] + u[1] / rows_est for c, u in zip(coeffs, ups)],
                              self.caps(shapes, 1, rows_est), self.profile.num_layers)
        if split is None:
            return None
        update = self.update_time(shapes, split)
        best = None
        for b in self._batch_sizes(rows_est):
            m = math.ceil(rows_est / b)
            if not self.fits(shapes, split, b, m):
                break  # activations only grow with the micro-batch size
            times = self.times(shapes, split, b)
            total = sum(times) + (rows_est / b - 1) * max(times)
            if best is None or total <= best[0]:
                best = (total, b, times)
        if best is None:  # not expected: the caps above were taken at b = 1
            return None
        _, b, times = best
        slowest = max(times)
        if self.options.optimizer_shards == UNEVEN:  # the update of r rows' share: r / B of it
            return PipeModel(shapes, split, b, sum(times) - slowest,
                             slowest / b + update / self.batch)
        return PipeModel(shapes, split, b, sum(times) - slowest + update, slowest / b)

    def fast(self, pipelines: Sequence[tuple],
             signatures: Optional[Sequence[tuple]] = None) -> Optional["Draft"]:
        """Score a layout (pipelines of groups) with the water-filling splits; None if no
        pipeline fits. ``signatures``: each pipeline's ``signature``, when the caller has
        them."""
        rows_est = max(1, math.ceil(self.batch / len(pipelines)))
        classes: dict[tuple, list] = {}
        if signatures is None:
            signatures = [signature(pipe) for pipe in pipelines]
        for pipe, sig in zip(pipelines, signatures):
            if sig in classes:
                classes[sig].append(pipe)
            else:
                classes[sig] = [pipe]
        members, params = [], []
        for sig, pipes in classes.items():
            model = self.model(sig, rows_est)
            if model is not None:
                members.append((model, pipes))
                params.append((model.fixed, model.per_row, len(pipes)))
        if not members:
            return None
        rows = split_rows(params, self.batch, self.least_rows)
        assigned = [(model, pipe, r) for (model, pipes), rs in zip(members, rows)
                    for pipe, r in zip(pipes, rs) if r > 0]
        compute = max(model.fixed + model.per_row * r for model, _, r in assigned)
        score = compute + self._sync_estimate(assigned)
        return Draft(score, tuple(assigned))

    def _sync_estimate(self, assigned) -> float:
        replicas = len(assigned)
        if replicas <= 1:
            return 0.0
        first = assigned[0][1][0].node
        spans = any(g.node != first for _, pipe, _ in assigned for g in pipe)
        worst, seen = 0.0, set()
        for model, pipe, _ in assigned:
            if id(model) in seen:
                continue
            seen.add(id(model))
            n = len(pipe)
            for s, g in enumerate(pipe):
                gbps = min(d.link_gbps(spans) for d in g.devices)
                params = cost.stage_params(self.profile, model.split[s], s == 0, s == n - 1) / g.tp
                worst = max(worst, cost.grad_sync_time(self.profile, params, replicas, gbps,
                                                       g.key[5]))
        return worst

    # ---- exact pass ---------------------------------------------------------------------------
    def exact(self, draft: "Draft", resolve: bool = True) -> Plan:
        """Build a draft's plan: with ``resolve``, layer splits re-solved for the 1F1B objective;
        micro-batch sizes picked per pipeline."""
        splits: dict[int, tuple[int, ...]] = {}
        pipes = []
        for model, pipe, rows in draft.assigned:
            if id(model) not in splits:
                splits[id(model)] = self._exact_split(model, rows) if resolve else model.split
            split = splits[id(model)]
            b = self.pick_batch(model.shapes, split, rows)
            pipes.append(build_pipeline(pipe, split, rows // b, b))
        return Plan(tuple(pipes), self.batch, self.profile.num_layers)

    def _exact_split(self, model: PipeModel, rows: int) -> tuple[int, ...]:
        n, b = len(model.shapes), model.b
        m = max(1, math.ceil(rows / b))
        coeffs = [cost.stage_time_coeffs(self.profile, sh, s == n - 1, b)
                  for s, sh in enumerate(model.shapes)]
        ups = tuple(self.updates(model.shapes))
        key = (tuple(coeffs), tuple(self.caps(model.shapes, b, m)), m, ups)
        if key not in self.splits:
            self.splits[key] = pipeline_layers([c[0] for c in coeffs], [c[1] for c in coeffs],
                                               list(key[1]), self.profile.num_layers, m,
                                               [u[0] for u in ups], [u[1] for u in ups])
        return self.splits[key] or model.split

    def pick_batch(self, shapes, split, rows: int) -> int:
        key = (shapes, split, rows)
        if key not in self.batches:
            self.batches[key] = self._best_batch(shapes, split, rows)
        return self.batches[key]

    def _best_batch(self, shapes, split, rows: int) -> int:
        """The micro-batch size (a divisor of ``rows``) with the lowest 1F1B time that fits;
        ties go to the larger size (fewer micro-batches)."""
        best = None
        for b in range(1, min(rows, self.options.max_microbatch_size or rows) + 1):
            if rows % b or not self.fits(shapes, split, b, rows // b):
                continue
            total = cost.pipeline_time(self.times(shapes, split, b), rows // b)
            if best is None or total <= best[0]:
                best = (total, b)
        return best[1] if best else 1


@dataclass(frozen=True)
class Draft:
    """A layout scored by the fast pass."""

    score: float
    assigned: tuple  # (model, pipeline groups, rows) per pipeline with rows > 0


def build_pipeline(groups: Sequence, split: Sequence[int], m: int, b: int) -> Pipeline:
    """A ``Pipeline`` of TP groups with ``split`` layers per stage, ``m`` x ``b`` rows."""
    stages, start = [], 0
    for g, layers in zip(groups, split):
        stages.append(Stage(tuple(sorted(d.id for d in g.devices)), (start, start + layers)))
        start += layers
    return Pipeline(tuple(stages), m, b)
