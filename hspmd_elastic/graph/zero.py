"""Uneven optimizer shards (ZeRO-1 style): which holder updates which rows. Pure, no torch.

With ``Plan.optimizer_shards == "uneven"`` every row of a split parameter has exactly one
*owner* among the devices that hold it: only the owner keeps that row's AdamW moments and
computes its update; the others receive the updated row. The rule, the same on every rank
from the plan alone:

* the parameter's groups (``ParamLayout.groups``: one TP group per pipeline, two for a tied
  embedding in a pipeline of several stages) get weights, each its pipeline's rows per step
  (``Pipeline.rows``, which the planner sets by measured speed);
* the split dimension ``[0, N)`` is cut at whole rows by those weights
  (``annotations.split_bounds``): group ``g`` owns ``[B_g, B_{g+1})``;
* inside group ``g`` each TP rank owns the part of that range its shard holds, and the TP ranks
  sharing a part (replicated key/value heads) cut it evenly among themselves.

So each device owns one contiguous box (possibly empty) of each split parameter, and each
pipeline updates about its share of the rows, ``r / B`` of every split parameter for ``r`` of
the global batch's ``B`` rows: a slow device, given few rows, also gets a small update. The cut
is per parameter, not per gradient-synchronisation group, so a shard that spans several groups
(a TP degree lower than another pipeline's) still owns one box, which BSR moves like any slice.

The price of one box per device: inside a TP group the share is not even. The group's range
``[B_g, B_{g+1})`` starts at its first part, so its first TP ranks own all their rows and the
last ones fewer (TP2 with 3/4 of the rows: rank 0 updates all of its shard, rank 1 half).
Even shares are not always possible with contiguous boxes (a TP1 pipeline with 1/4 of the rows
against a TP4 one would need one row of each quarter), so the rule stays this simple one and
``update_fraction`` reports each device's exact share (what the cost model should charge).

Parameters duplicated inside a TP group (norm scales: no split dim) keep replicated moments and
are updated by every holder, as in ``"replicated"`` mode; they are a few rows per layer.

One copy: each owned row's moments exist on its owner only, so losing the owner loses them and a
switch then needs a checkpoint (``ReshardError``), whatever copies of the parameter survive.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Optional

from hspmd_elastic.annotations import Annotation, BoxAnnotation, Ranges, split_bounds
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.plan import OPTIMIZER_SHARDS, ParamLayout, Plan

REPLICATED, UNEVEN = OPTIMIZER_SHARDS


def is_uneven(plan: Plan) -> bool:
    return plan.optimizer_shards == UNEVEN


def group_weights(plan: Plan, layout: ParamLayout) -> tuple[int, ...]:
    """Per group of ``layout``, the rows per step of the pipeline that group belongs to."""
    return tuple(plan.pipelines[plan.locate(g[0]).pipeline].rows for g in layout.groups)


@functools.lru_cache(maxsize=1024)
def owner_cuts(layout: ParamLayout, weights: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``(device, lo, hi)``: the rows ``[lo, hi)`` of the split dim that ``device`` owns, for
    every device owning at least one row, ascending by ``lo``; together they cover ``[0, N)``
    once. ``weights``: one per group (``group_weights``)."""
    dim = layout.split_dim
    if dim is None:
        raise ValueError("a parameter without a split dim has no owner cut")
    n = layout.shape[dim]
    bounds = split_bounds(n, weights)
    out = []
    for g, group in enumerate(layout.groups):
        parts, reps = layout.parts(g), layout.replicas(g)
        for part in range(parts):
            lo = max(bounds[g], n * part // parts)
            hi = min(bounds[g + 1], n * (part + 1) // parts)
            if lo >= hi:
                continue
            holders = group[part * reps:(part + 1) * reps]
            sub = split_bounds(hi - lo, (1,) * reps)
            out.extend((d, lo + a, lo + b) for d, a, b in zip(holders, sub, sub[1:]) if a < b)
    return tuple(sorted(out, key=lambda c: c[1]))


def plan_cuts(plan: Plan, config: ModelConfig) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """``owner_cuts`` of every split parameter under ``plan`` (empty in replicated mode)."""
    if not is_uneven(plan):
        return {}
    return {name: owner_cuts(layout, group_weights(plan, layout))
            for name, layout in plan.param_layouts(config).items()
            if layout.split_dim is not None}


def _owned_box(param_box: Ranges, dim: int, cut, device: int) -> Ranges:
    mine = [(lo, hi) for d, lo, hi in cut if d == device]
    lo, hi = mine[0] if mine else (param_box[dim][0],) * 2
    return param_box[:dim] + ((lo, hi),) + param_box[dim + 1:]


def moment_annotations(plan: Plan, config: ModelConfig,
                       params: Optional[Mapping[str, Annotation]] = None
                       ) -> dict[str, Annotation]:
    """The annotation of each parameter's AdamW moments under ``plan``: the parameter's own in
    replicated mode and for parameters without a split dim, else a ``BoxAnnotation`` giving
    every holder its owned box (empty for a holder that owns no row). ``params``: the plan's
    ``param_annotations``, when the caller has them."""
    params = plan.param_annotations(config) if params is None else params
    if not is_uneven(plan):
        return dict(params)
    cuts = plan_cuts(plan, config)
    layouts = plan.param_layouts(config)
    out: dict[str, Annotation] = {}
    for name, ann in params.items():
        if name not in cuts:
            out[name] = ann
            continue
        shape, dim = layouts[name].shape, layouts[name].split_dim
        out[name] = BoxAnnotation(shape, tuple(
            (d, _owned_box(box, dim, cuts[name], d)) for d, box in ann.shards(shape).items()))
    return out


def owned_ranges(plan: Plan, config: ModelConfig, rank: int) -> dict[str, Ranges]:
    """Per parameter ``rank`` holds, the global index ranges of the rows whose optimizer state
    and update are its own: its whole shard in replicated mode and for parameters without a
    split dim; else its box of the uneven cut (a zero-length range along the split dim when it
    owns no row)."""
    out = {}
    layouts = plan.param_layouts(config)
    for name, ann in moment_annotations(plan, config).items():
        box = ann.local_slices(rank, layouts[name].shape)
        if box is not None:
            out[name] = box
    return out


def update_fraction(plan: Plan, config: ModelConfig, device: int) -> float:
    """The share of its parameter elements whose optimizer update ``device`` runs under
    ``plan``: 1.0 in replicated mode; in uneven mode its owned elements over its held elements,
    unsplit parameters counted whole (0.0 for a device that holds nothing)."""
    if not is_uneven(plan):
        return 1.0
    params, specs = plan.param_annotations(config), param_specs(config)
    held = owned = 0
    for name, box in owned_ranges(plan, config, device).items():
        shape = specs[name].shape
        held += math.prod(hi - lo for lo, hi in params[name].local_slices(device, shape))
        owned += math.prod(hi - lo for lo, hi in box)
    return owned / held if held else 0.0


def local_owned_rows(plan: Plan, config: ModelConfig, rank: int) -> dict[str, tuple[int, int, int]]:
    """``owned_ranges`` of the split parameters, in ``rank``'s local coordinates:
    ``(dim, lo, hi)`` of its shard (empty in replicated mode: every row is its own)."""
    if not is_uneven(plan):
        return {}
    params = plan.param_annotations(config)
    owned = owned_ranges(plan, config, rank)
    out = {}
    for name, layout in plan.param_layouts(config).items():
        if layout.split_dim is None or name not in owned:
            continue
        dim = layout.split_dim
        start = params[name].local_slices(rank, layout.shape)[dim][0]
        lo, hi = owned[name][dim]
        out[name] = (dim, lo - start, hi - start)
    return out
