"""The plan each length bucket runs under inside a step, given the step's home plan.

The home plan holds the parameters and the optimizer state and is what the leader publishes;
``graph.bucketed`` runs each bucket's rows under the bucket's plan and moves the parameters out
and the gradients back by fused BSR. Promises (pure, torch-free):

* ``bucket_layouts(inventory, profile, home, buckets, options)``: one ``BucketLayout`` per
  bucket, shortest first, tiling ``home``'s global batch with ``bucket_rows`` of the buckets'
  shares; the last bucket's length must be the profile's ``seq_len`` (every sequence fits some
  bucket), else ``PlannerError``.
* A bucket runs under its own plan (``plan_for`` at the bucket's length and rows) only when that
  plan uses the home plan's devices or some of them (a device the bucket's plan leaves idle
  sends its parameters and gets its gradients back), differs from the home layout, and its
  estimated step time plus the estimated switch (``switch_s``: the parameters out and the
  gradients back,
  ``2 x total_params x param_bytes`` over the slowest link of the devices, intra-node on one
  node, inter-node across several) is below the home layout's estimate on the bucket. Otherwise
  the bucket runs under the home layout (``spread_rows``): no switch, since the cost model says
  the transfer would cost more than it saves.
* ``spread_rows(plan, rows)``: ``plan``'s layout with ``rows`` split over all its pipelines in
  proportion to their rows (largest remainders, every pipeline at least one row), each with the
  largest micro-batch size up to its own that divides its rows; None when ``rows`` is below the
  number of pipelines.
* A bucket neither plan fits raises ``PlanInfeasibleError`` naming the bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from hspmd_elastic.plan import Pipeline, Plan
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import (Inventory, ModelProfile, PlanInfeasibleError,
                                       PlannerError, PlannerOptions)
from hspmd_elastic.planner.buckets import (LengthBucket, _layout_key, bucket_rows, check_buckets,
                                           profile_at)
from hspmd_elastic.planner.search import plan_for

GB = 1e9


@dataclass(frozen=True)
class BucketLayout:
    """Bucket rows ``[start, start + plan.global_batch)`` at ``window`` tokens under ``plan``
    (``own``: the bucket's own plan, a switch; else the home layout)."""

    window: int
    start: int
    plan: Plan
    own: bool
    step_s: float  # the estimate of ``plan`` on the bucket
    home_s: float  # the home layout's estimate on the bucket (inf: it does not fit)
    switch_s: float  # the estimated switch out and back (0.0 under the home layout)

    def to_dict(self) -> dict:
        return {"window": self.window, "start": self.start, "strategy": self.plan.to_dict()}


def spread_rows(plan: Plan, rows: int) -> Optional[Plan]:
    """``plan``'s layout with ``rows`` rows over all its pipelines (module promises)."""
    n = len(plan.pipelines)
    if rows < n:
        return None
    weights = [p.rows for p in plan.pipelines]
    total = sum(weights)
    extra = rows - n  # every pipeline gets one; the rest by weight, largest remainders
    exact = [extra * w / total for w in weights]
    got = [1 + math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[:rows - sum(got)]:
        got[i] += 1
    pipes = []
    for pipe, r in zip(plan.pipelines, got):
        b = max(d for d in range(1, min(pipe.microbatch_size, r) + 1) if r % d == 0)
        pipes.append(Pipeline(pipe.stages, r // b, b))
    return Plan(tuple(pipes), rows, plan.num_layers)


def switch_seconds(inventory: Inventory, profile: ModelProfile, plan: Plan) -> float:
    """Parameters out and gradients back over the slowest link of ``plan``'s devices."""
    devs = [inventory.devices_by_id[d] for d in plan.devices]
    nodes = {d.node for d in devs}
    gbps = min(d.link_gbps(len(nodes) > 1) for d in devs)
    return 2.0 * profile.total_params * profile.param_bytes / (gbps * GB)


def _estimate(plan: Optional[Plan], inventory: Inventory, profile: ModelProfile,
              options: PlannerOptions) -> float:
    if plan is None:
        return math.inf
    try:
        return cost.estimate_plan(plan, inventory, profile, options).step_time_s
    except PlanInfeasibleError:
        return math.inf


def bucket_layouts(inventory: Inventory, profile: ModelProfile, home: Plan,
                   buckets: Sequence[LengthBucket],
                   options: PlannerOptions = PlannerOptions()) -> tuple[BucketLayout, ...]:
    """The plan of every bucket inside a step under ``home`` (module promises)."""
    buckets = check_buckets(buckets)
    if buckets[-1].max_len != profile.seq_len:
        raise PlannerError(f"the longest bucket ({buckets[-1].max_len} tokens) is not the "
                           f"model's seq_len {profile.seq_len}: every sequence needs a bucket")
    rows = bucket_rows([b.share for b in buckets], home.global_batch)
    out, start = [], 0
    for k, (bucket, n) in enumerate(zip(buckets, rows)):
        prof = profile_at(profile, bucket.max_len)
        at_home = spread_rows(home, n)
        home_s = _estimate(at_home, inventory, prof, options)
        own: Optional[Plan] = None
        try:
            own = plan_for(inventory, prof, n, options=options).plan
        except PlannerError:
            own = None
        if own is not None and (not set(own.devices) <= set(home.devices)
                                or _layout_key(own) == _layout_key(home)):
            own = None
        own_s = _estimate(own, inventory, prof, options)
        switch_s = switch_seconds(inventory, profile, home) if own is not None else math.inf
        if own is not None and own_s + switch_s < home_s:
            out.append(BucketLayout(bucket.max_len, start, own, True, own_s, home_s, switch_s))
        elif at_home is not None and math.isfinite(home_s):
            out.append(BucketLayout(bucket.max_len, start, at_home, False, home_s, home_s, 0.0))
        else:
            raise PlanInfeasibleError(f"length bucket {k} ({bucket.max_len} tokens, {n} rows): "
                                      "neither its own plan nor the home plan's layout fits it")
        start += n
    return tuple(out)
