"""The planner's two small integer problems, solved exactly.

* ``minmax_layers``: layers per stage minimising the slowest stage, every stage at least one
  layer and at most its memory cap. Greedy water-filling (always give the next layer to the stage
  that stays fastest) is exact for a min-max of increasing costs.
* ``pipeline_layers``: the same split minimising the real 1F1B time
  ``sum(t_s) + (m - 1) max(t_s) + max(u_s)`` (``u_s``: a stage's per-step update, linear in its
  layers; none: 0), a small MILP for ``scipy.optimize.milp`` (HiGHS): integer layers per stage,
  one continuous variable for the slowest stage and one for the slowest update.
* ``split_rows``: rows of the global batch per pipeline minimising the slowest pipeline, where a
  pipeline's time is ``fixed + per_row x rows`` (zero when it gets no rows). Identical pipelines
  come as one class with a count; a bisection on the step time finds the least feasible level,
  then surplus rows are taken back from the slowest pipelines. Exact, and linear in the number of
  classes, which keeps a thousand pipelines cheap. With ``least`` (a replica kept on a slow
  device), every pipeline gets that many rows at least when the batch allows it.

All three are deterministic: ties go to the lower index.
"""

from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp


def minmax_layers(fixed: Sequence[float], per_layer: Sequence[float], caps: Sequence[int],
                  total: int) -> Optional[tuple[int, ...]]:
    """Layers per stage, or None when the caps cannot hold ``total`` layers."""
    n = len(fixed)
    if n > total or any(c < 1 for c in caps) or sum(min(c, total) for c in caps) < total:
        return None
    layers = [1] * n
    heap = [(fixed[i] + per_layer[i] * 2, i) for i in range(n) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, i = heapq.heappop(heap)
        layers[i] += 1
        if layers[i] < caps[i]:
            heapq.heappush(heap, (fixed[i] + per_layer[i] * (layers[i] + 1), i))
    return tuple(layers)


def pipeline_layers(fixed: Sequence[float], per_layer: Sequence[float], caps: Sequence[int],
                    total: int, num_microbatches: int,
                    update_fixed: Optional[Sequence[float]] = None,
                    update_per_layer: Optional[Sequence[float]] = None
                    ) -> Optional[tuple[int, ...]]:
    """Layers per stage minimising the 1F1B pipeline time plus the slowest stage's update
    (``update_fixed + update_per_layer x layers`` per stage; None: none); None when
    infeasible."""
    start = minmax_layers(fixed, per_layer, caps, total)
    n = len(fixed)
    ua = np.zeros(n) if update_fixed is None else np.asarray(update_fixed, dtype=float)
    uc = np.zeros(n) if update_per_layer is None else np.asarray(update_per_layer, dtype=float)
    updates = bool(ua.any() or uc.any())
    if start is None or n == 1 or (max(per_layer) == min(per_layer) and not updates):
        return start  # equal per-layer costs: the sum is fixed, so the min-max split is optimal
    scale = 1.0 / max(per_layer)
    a, c = np.asarray(fixed) * scale, np.asarray(per_layer) * scale
    ua, uc = ua * scale, uc * scale
    # variables: l_0..l_{n-1} (integer), z (the slowest stage), w (the slowest update, only
    # when some stage has one)
    k = 2 if updates else 1
    objective = np.concatenate([c, [num_microbatches - 1.0, 1.0][:k]])
    rows = np.zeros((k * n + 1, n + k))
    rows[:n, :n] = np.diag(c)
    rows[:n, n] = -1.0
    if updates:
        rows[n:2 * n, :n] = np.diag(uc)
        rows[n:2 * n, n + 1] = -1.0
    rows[k * n, :n] = 1.0
    lower = np.concatenate([np.full(k * n, -np.inf), [total]])
    upper = np.concatenate([-a, *([-ua] if updates else []), [total]])
    caps_hi = np.array([min(cap, total) for cap in caps], dtype=float)
    bounds = Bounds(np.concatenate([np.ones(n), np.zeros(k)]),
                    np.concatenate([caps_hi, np.full(k, np.inf)]))
    integrality = np.concatenate([np.ones(n), np.zeros(k)])
    # HiGHS stops within a relative gap of 1e-4 by default: a split that much slower than the
    # best would do; ask for the optimum (the problem has a handful of variables)
    res = milp(objective, constraints=LinearConstraint(rows, lower, upper),
               integrality=integrality, bounds=bounds, options={"mip_rel_gap": 1e-12})
    if res.x is None:
        return start
    layers = tuple(int(round(v)) for v in res.x[:n])
    if sum(layers) != total or any(not 1 <= l <= caps_hi[i] for i, l in enumerate(layers)):
        return start
    return layers if _pipe_time(a, c, ua, uc, layers, num_microbatches) <= \
        _pipe_time(a, c, ua, uc, start, num_microbatches) else start


def _pipe_time(a, c, ua, uc, layers, m) -> float:
    times = [a[i] + c[i] * l for i, l in enumerate(layers)]
    return (sum(times) + (m - 1) * max(times)
            + max(ua[i] + uc[i] * l for i, l in enumerate(layers)))


def split_rows(classes: Sequence[tuple[float, float, int]], total: int,
               least: int = 0) -> list[list[int]]:
    """Rows per pipeline, per class of ``(fixed, per_row, count)``; min-max of pipeline times,
    every pipeline at least ``least`` rows (ignored when the batch has too few rows for it)."""
    if least * sum(cnt for _, _, cnt in classes) > total:
        least = 0

    def rows_at(level: float, fixed: float, per_row: float) -> int:
        if level < fixed + per_row:
            return least
        return max(least, int(math.floor((level - fixed) / per_row + 1e-9)))

    def supply(level: float) -> int:
        return sum(cnt * rows_at(level, f, r) for f, r, cnt in classes)

    lo = 0.0
    hi = min(f + r * max(least, math.ceil(total / cnt)) for f, r, cnt in classes)
    for _ in range(200):
        mid = (lo + hi) / 2
        if supply(mid) >= total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    out = [[rows_at(hi, f, r)] * cnt for f, r, cnt in classes]
    surplus = sum(map(sum, out)) - total
    # Take surplus rows back from the pipelines that are slowest with them, last index first.
    order = sorted(((f + r * out[k][j] if out[k][j] else 0.0, k, j)
                    for k, (f, r, _) in enumerate(classes) for j in range(len(out[k]))),
                   key=lambda x: (-x[0], -x[1], -x[2]))
    while surplus > 0:
        taken = 0
        for _, k, j in order:
            if surplus <= 0:
                break
            if out[k][j] > least:
                out[k][j] -= 1
                surplus -= 1
                taken += 1
        if not taken:  # not expected: least x pipelines <= total
            break
    return out
