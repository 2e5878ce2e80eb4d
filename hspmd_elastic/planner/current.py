"""Candidates derived from the current plan, so a switch can move little or nothing.

* the current plan itself, when it still runs (same batch, live devices, fits);
* its intact pipelines with the global batch re-split over them by speed (no weight moves;
  each keeps a row at least when the search keeps copies, ``Solver.least_rows``: a slow
  device's replica stays, with little work);
* the same plus each broken pipeline rebuilt from its survivors: every stage keeps the largest
  allowed TP group of its surviving devices, empty stages go, the layers are re-split. Only the
  rebuilt pipelines move weights.
"""

from __future__ import annotations

import math
from typing import Optional

from hspmd_elastic.plan import Pipeline, Plan, PlanError, Stage
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import (Candidate, Inventory, ModelProfile, PlanInfeasibleError,
                                       PlannerOptions)
from hspmd_elastic.planner.explain import describe
from hspmd_elastic.planner.passes import Solver, tp_options
from hspmd_elastic.planner.solve import minmax_layers, split_rows


def from_current(plan: Plan, solver: Solver, inventory: Inventory, profile: ModelProfile,
                 options: PlannerOptions) -> list[Candidate]:
    """Candidates close to ``plan``: the plan itself if it still runs; its intact pipelines with
    the batch re-split over them by speed (no weights move); and the same plus each broken
    pipeline rebuilt from its surviving devices (only those pipelines move weights)."""
    out = []
    if plan.global_batch == solver.batch:
        out.append(candidate(plan, "current plan", inventory, profile, options, plan))
    if plan.num_layers == profile.num_layers:
        for rebuild, label in ((False, "current plan, intact pipelines only"),
                               (True, "current plan, broken pipelines rebuilt")):
            repaired = _repair(plan, solver, inventory, rebuild)
            if repaired is not None:
                out.append(candidate(repaired, label, inventory, profile, options, plan))
    return [c for c in out if c is not None]


def _repair(plan: Plan, solver: Solver, inventory: Inventory, rebuild: bool) -> Optional[Plan]:
    devs = inventory.by_id()
    alive = [[[d for d in s.devices if d in devs and devs[d].usable] for s in p.stages]
             for p in plan.pipelines]
    rows_est = max(1, math.ceil(solver.batch / len(plan.pipelines)))
    kept = []  # (stages, shapes, split)
    for p, groups in zip(plan.pipelines, alive):
        if all(len(g) == s.tp for g, s in zip(groups, p.stages)):
            split = tuple(s.layers[1] - s.layers[0] for s in p.stages)
            kept.append((p.stages, _stage_shapes(groups, devs, solver), split))
        elif rebuild:
            rebuilt = _rebuild(groups, devs, solver, rows_est)
            if rebuilt is not None:
                kept.append(rebuilt)
    if not kept:
        return None
    classes = []
    for _, shapes, split in kept:
        times = solver.times(shapes, split, 1)
        classes.append((sum(times) - max(times), max(times), 1))
    pipes = []
    for (stages, shapes, split), (r,) in zip(kept, split_rows(classes, solver.batch,
                                                              solver.least_rows)):
        if r:
            b = solver.pick_batch(shapes, split, r)
            pipes.append(Pipeline(stages, r // b, b))
    return Plan(tuple(pipes), solver.batch, plan.num_layers)


def _stage_shapes(groups: list[list[int]], devs: dict, solver: Solver) -> tuple:
    members = [[devs[d] for d in g] for g in groups]
    return tuple(cost.group_shape(g, members[i + 1] if i + 1 < len(members) else None,
                                  solver.options.memory_fraction)
                 for i, g in enumerate(members))


def _rebuild(groups: list[list[int]], devs: dict, solver: Solver, rows_est: int):
    """A broken pipeline from its survivors: each stage keeps the largest allowed TP group of its
    surviving devices (in their old order), empty stages go, layers are re-split."""
    new_groups = []
    for g in groups:
        if g:
            allowed = tp_options(solver.profile, solver.options, len(g))
            new_groups.append(g[:max(allowed)])
    if not new_groups:
        return None
    shapes = _stage_shapes(new_groups, devs, solver)
    n = len(shapes)
    coeffs = [cost.stage_time_coeffs(solver.profile, sh, i == n - 1, 1)
              for i, sh in enumerate(shapes)]
    split = minmax_layers([c[0] for c in coeffs], [c[1] for c in coeffs],
                          solver.caps(shapes, 1, rows_est), solver.profile.num_layers)
    if split is None:
        return None
    stages, start = [], 0
    for g, layers in zip(new_groups, split):
        stages.append(Stage(tuple(g), (start, start + layers)))
        start += layers
    return tuple(stages), shapes, split


def candidate(plan: Plan, label: str, inventory: Inventory, profile: ModelProfile,
               options: PlannerOptions, current: Optional[Plan]) -> Optional[Candidate]:
    """``plan`` checked against the model and estimated; None if it cannot run."""
    try:
        if profile.config is not None:
            plan.check_model(profile.config)
        est = cost.estimate_plan(plan, inventory, profile, options, current)
    except (PlanError, PlanInfeasibleError):
        return None
    text = describe(plan, inventory)
    return Candidate(plan, est, f"{label}: {text}" if label else text,
                     score(est, profile, options))


def score(est, profile: ModelProfile, options: PlannerOptions) -> float:
    moved = est.switch_bytes or 0
    replica = profile.total_params * (profile.param_bytes + profile.optimizer_bytes)
    return est.step_time_s * (1.0 + options.switch_weight * moved / replica)
