"""A plan's strategy with its pipelines as runs: the compact form ``plan/layout`` carries.

A strategy (``hspmd_elastic.plan.Plan.to_dict``) lists every stage of every pipeline with every
device id: 88 KB of JSON at 8,000 devices, though a planner's pipelines mostly repeat one shape
on consecutive devices. ``compact_strategy`` writes consecutive pipelines of one shape once:

    {"schema": 1, "global_batch": B, "num_layers": L,
     "pipeline_runs": [[count, offset, stride, num_microbatches, microbatch_size, stages], ...]}

Copy ``i`` (``0 <= i < count``) of a run is the pipeline whose stages are ``stages`` with every
device id shifted by ``offset + i * stride``. A stage is ``[first, tp, start, stop]`` (devices
``first .. first + tp - 1``, layers ``[start, stop)``) or ``[[d0, d1, ...], start, stop]`` (device
ids that are not consecutive). Promises (pure, no I/O):

* ``expand_strategy(compact_strategy(s)) == s`` for every ``s``: the encoder checks it, and a
  strategy that is not a plan's (other keys, non-integer device ids) or that would not come
  back the same is kept verbatim (a dict without ``pipeline_runs``, which ``expand_strategy``
  returns as it is);
* ``expand_strategy`` of a malformed compact form raises ``ValueError`` naming the bad run.
"""

from __future__ import annotations

from typing import Any

RUNS = "pipeline_runs"
_PLAN_KEYS = {"schema", "global_batch", "num_layers", "pipelines"}
_PIPE_KEYS = {"num_microbatches", "microbatch_size", "stages"}
_STAGE_KEYS = {"devices", "layers"}
_MAX_EXPANDED = 1 << 22  # stages one compact form may expand to (a bound on a forged value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_plan_dict(strategy: Any) -> bool:
    if not isinstance(strategy, dict) or set(strategy) != _PLAN_KEYS:
        return False
    pipes = strategy["pipelines"]
    if not isinstance(pipes, list):
        return False
    for p in pipes:
        if not isinstance(p, dict) or set(p) != _PIPE_KEYS or not isinstance(p["stages"], list):
            return False
        for s in p["stages"]:
            if (not isinstance(s, dict) or set(s) != _STAGE_KEYS
                    or not isinstance(s["devices"], list) or not isinstance(s["layers"], list)
                    or len(s["layers"]) != 2
                    or not all(_int(x) for x in (*s["devices"], *s["layers"]))):
                return False
    return True


def _shape(pipe: dict) -> tuple[int, tuple]:
    """(offset, shape): the pipeline's first device id and its stages relative to it."""
    stages = pipe["stages"]
    offset = next((s["devices"][0] for s in stages if s["devices"]), 0)
    out = []
    for s in stages:
        rel = [d - offset for d in s["devices"]]
        lo, hi = s["layers"]
        if rel and rel == list(range(rel[0], rel[0] + len(rel))):
            out.append((rel[0], len(rel), lo, hi))
        else:
            out.append((tuple(rel), lo, hi))
    return offset, (pipe["num_microbatches"], pipe["microbatch_size"], tuple(out))


def compact_strategy(strategy: dict[str, Any]) -> dict[str, Any]:
    """``strategy`` with its pipelines as runs (or verbatim: see the module docstring)."""
    if not _is_plan_dict(strategy):
        return dict(strategy)
    runs: list[list] = []  # [count, offset, stride, shape]
    for pipe in strategy["pipelines"]:
        offset, shape = _shape(pipe)
        last = runs[-1] if runs else None
        if last is not None and last[3] == shape:
            if last[0] == 1:
                last[0], last[2] = 2, offset - last[1]
                continue
            if offset == last[1] + last[0] * last[2]:
                last[0] += 1
                continue
        runs.append([1, offset, 0, shape])
    out = {k: v for k, v in strategy.items() if k != "pipelines"}
    out[RUNS] = [[count, offset, stride, shape[0], shape[1],
                  [[list(s[0]), s[1], s[2]] if isinstance(s[0], tuple) else list(s)
                   for s in shape[2]]]
                 for count, offset, stride, shape in runs]
    return out if expand_strategy(out) == strategy else dict(strategy)


def _stage(entry: Any, base: int, where: str) -> dict:
    if isinstance(entry, list) and len(entry) == 4 and all(_int(x) for x in entry):
        first, tp, lo, hi = entry
        if tp < 1:
            raise ValueError(f"{where}: a stage of {tp} devices")
        return {"devices": list(range(base + first, base + first + tp)), "layers": [lo, hi]}
    if (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
            and all(_int(x) for x in (*entry[0], entry[1], entry[2]))):
        return {"devices": [base + d for d in entry[0]], "layers": [entry[1], entry[2]]}
    raise ValueError(f"{where}: stage {str(entry)[:80]} is not [first, tp, start, stop] nor "
                     "[[devices...], start, stop]")


def expand_strategy(compact: dict[str, Any]) -> dict[str, Any]:
    """The strategy ``compact_strategy`` was given (a dict without runs: itself)."""
    if RUNS not in compact:
        return dict(compact)
    runs = compact[RUNS]
    if not isinstance(runs, list):
        raise ValueError(f"{RUNS} must be a list")
    pipes, total = [], 0
    for i, run in enumerate(runs):
        where = f"pipeline run {i}"
        if (not isinstance(run, list) or len(run) != 6 or not all(_int(x) for x in run[:5])
                or not isinstance(run[5], list) or run[0] < 1):
            raise ValueError(f"{where}: {str(run)[:80]} is not [count, offset, stride, "
                             "num_microbatches, microbatch_size, stages]")
        count, offset, stride, nmb, size, stages = run
        total += count * max(1, len(stages))
        if total > _MAX_EXPANDED:
            raise ValueError(f"{where}: expands to more than {_MAX_EXPANDED} stages")
        for c in range(count):
            base = offset + c * stride
            pipes.append({"num_microbatches": nmb, "microbatch_size": size,
                          "stages": [_stage(s, base, where) for s in stages]})
    out = {k: v for k, v in compact.items() if k != RUNS}
    out["pipelines"] = pipes
    return out
