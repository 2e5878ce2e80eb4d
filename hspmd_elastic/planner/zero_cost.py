"""What uneven optimizer shards (``Plan.optimizer_shards == "uneven"``) change in the cost model.

Under ``graph.zero``'s rule each split parameter is cut among the pipelines holding it by their
rows per step, so a pipeline of ``r`` of the global batch's ``B`` rows owns, and updates, about
``r / B`` of every parameter it holds: its devices keep the AdamW moments of that share only
and run the optimizer update on that share only. The cost model charges exactly that: each
device's update time (``DeviceSpec.update_s_per_param`` x slowdown x its parameters) and the
optimizer-state part of its memory (``ModelProfile.optimizer_bytes`` per parameter) scaled by
its pipeline's ``share``; weights and gradients stay whole.

This is the rows approximation everywhere (the planner holds a ``ModelProfile``, not the
``ModelConfig`` that ``graph.zero.update_fraction`` needs): it leaves out that inside a TP
group the first ranks own more than the last (``graph.zero``'s docstring), and that
parameters without a split dimension (norm scales) stay replicated, a few rows per layer.
Replicated mode is share 1.0. Pure arithmetic.
"""

from __future__ import annotations

from typing import Optional

from hspmd_elastic.plan import OPTIMIZER_SHARDS, Plan
from hspmd_elastic.planner.api import ModelProfile, PlannerOptions

UNEVEN = OPTIMIZER_SHARDS[1]


def uneven(options: PlannerOptions, plan: Optional[Plan] = None) -> bool:
    """True when the options (or the plan itself) say the moments are sharded unevenly."""
    return options.optimizer_shards == UNEVEN or \
        (plan is not None and plan.optimizer_shards == UNEVEN)


def pipeline_share(plan: Plan, pipeline: int, options: PlannerOptions) -> float:
    """The share of its parameters each device of ``plan``'s pipeline ``pipeline`` updates and
    keeps moments for: its rows over the global batch when uneven, else 1.0."""
    if not uneven(options, plan):
        return 1.0
    return plan.pipelines[pipeline].rows / plan.global_batch


def state_bytes(profile: ModelProfile, share: float = 1.0) -> float:
    """Bytes per parameter a holder keeps: weights and gradients, plus ``share`` of the
    optimizer state (``ModelProfile.state_bytes_per_param`` at share 1.0)."""
    if share == 1.0:
        return profile.state_bytes_per_param
    return profile.param_bytes + profile.grad_bytes + profile.optimizer_bytes * share
