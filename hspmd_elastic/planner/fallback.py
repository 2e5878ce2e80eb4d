"""The fallback plan: pure data parallelism over the given devices, for when the search fails.

A caller that must publish some plan (the leader, when ``plan_for`` fails for a reason other
than infeasibility) asks for ``fallback_dp_plan``. Promises: pure (no I/O, the same inputs give
the same plan); one single-stage pipeline per device holding every layer, in device-id order;
the global batch split as evenly as possible (the first ``global_batch % n`` pipelines get one
more row); with more devices than rows, only the first ``global_batch`` devices are used; no
device at all raises ``PlanInfeasibleError``. It consults no cost model: memory is not checked.
"""

from __future__ import annotations

from typing import Iterable

from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner.api import PlanInfeasibleError


def fallback_dp_plan(device_ids: Iterable[int], num_layers: int, global_batch: int) -> Plan:
    """A data-parallel ``Plan`` over ``device_ids`` (see the module docstring)."""
    ids = sorted(device_ids)[:global_batch]
    if not ids:
        raise PlanInfeasibleError("fallback DP plan: no usable device")
    base, extra = divmod(global_batch, len(ids))
    pipes = tuple(Pipeline((Stage((d,), (0, num_layers)),), 1, base + (1 if i < extra else 0))
                  for i, d in enumerate(ids))
    return Plan(pipes, global_batch, num_layers)
