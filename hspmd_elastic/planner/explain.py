"""Human- and machine-readable accounts of a planner result.

``explain(result)`` is the text ``hspmd-launch plan`` prints: the chosen layout (pipelines,
stages, layer ranges, TP groups with their node and device type, micro-batches), the estimated
step time and throughput, memory per device against its usable limit, idle devices, switch
traffic, and the next-best alternatives with their gap to the chosen plan. Idle devices come
with why (``Estimate.idle``, ``idle_lines``): the best plan using them against the chosen one.
Pipelines identical in shape to an earlier one are listed once with their devices.
``result_to_dict`` is the same content as a JSON-ready dict (``"schema": 1``).
``layout_line(plan, devices)`` is a plan's specialization on one line: every pipeline's stages
with their devices, TP degree and layers.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from hspmd_elastic.planner.api import Candidate, IdleDevice, Inventory, PlanResult, fmt_bytes
from hspmd_elastic.planner.subsets import idle_reason


def compact_ids(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ids = sorted(ids)
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def describe(plan, inventory: Inventory, limit: int = 3) -> str:
    """A one-line layout: ``"2 x [H800 tp2 > H20 tp8] + 1 x [H20 tp4]"`` (pipelines by shape)."""
    type_of = _type_names(inventory)
    shapes: dict[str, int] = {}
    texts: dict[tuple, str] = {}  # a stage's type names and TP degree -> its text
    for pipe in plan.pipelines:
        parts = []
        for s in pipe.stages:
            key = (frozenset(map(type_of.__getitem__, s.devices)), s.tp)
            if key not in texts:
                texts[key] = f"{'/'.join(sorted(key[0]))} tp{s.tp}"
            parts.append(texts[key])
        stages = " > ".join(parts)
        shapes[stages] = shapes.get(stages, 0) + 1
    parts = [f"{n} x [{shape}]" for shape, n in list(shapes.items())[:limit]]
    if len(shapes) > limit:
        parts.append(f"{len(shapes) - limit} more shapes")
    return " + ".join(parts)


_last_types: tuple = (None, {})  # (inventory, device id -> type name): one tuple, swapped whole


def _type_names(inventory: Inventory) -> dict:
    """Device id -> its type's name, built once for the inventory last asked about."""
    global _last_types
    cached, names = _last_types
    if cached is not inventory:
        names = {d.id: d.spec.name for d in inventory.devices}
        _last_types = (inventory, names)
    return names


def layout_line(plan, devices: Optional[Sequence[str]] = None) -> str:
    """One line: ``"DP2: n0:0-1 tp2 L0-2 > n0:2 L3 (4 rows) | n1:0 L0-3 (4 rows)"``.

    Pipelines are separated by ``|``, stages by ``>``; a stage shows its devices (``devices[i]``
    names int ``i``; ``"<node>:<index>"`` names on one node are compressed), its TP degree when
    above 1 and its decoder layers; each pipeline its rows of the global batch."""
    def names(ids) -> str:
        if devices is None:
            return compact_ids(ids)
        by_node: dict[str, list] = {}
        for i in ids:
            node, sep, index = str(devices[i]).rpartition(":")
            if not sep or not index.isdigit():
                by_node.setdefault(str(devices[i]), [])
            else:
                by_node.setdefault(node, []).append(int(index))
        return ",".join(f"{n}:{compact_ids(ix)}" if ix else n for n, ix in by_node.items())

    pipes = []
    for pipe in plan.pipelines:
        stages = []
        for stage in pipe.stages:
            a, b = stage.layers
            layers = f"L{a}" if b - a == 1 else f"L{a}-{b - 1}"
            tp = f" tp{stage.tp}" if stage.tp > 1 else ""
            stages.append(f"{names(stage.devices)}{tp} {layers}")
        rows = pipe.num_microbatches * pipe.microbatch_size
        pipes.append(f"{' > '.join(stages)} ({rows} row{'s' if rows != 1 else ''})")
    return f"DP{len(pipes)}: " + " | ".join(pipes)


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _bytes(n: float) -> str:
    return fmt_bytes(n)


def _summary(c: Candidate) -> str:
    e = c.estimate
    text = (f"step {e.step_time_s:.4g} s, {e.samples_per_s:.4g} samples/s, "
            f"{e.tokens_per_s:,.0f} tokens/s, grad sync {e.grad_sync_s:.3g} s, "
            f"bubble {e.bubble_fraction:.0%}")
    if e.switch_bytes is not None:
        text += f", switch moves {_bytes(e.switch_bytes)}"
    return text


def _stage_lines(c: Candidate, pi: int, inventory: Inventory) -> list[str]:
    devs = inventory.by_id()
    pipe, est = c.plan.pipelines[pi], c.estimate
    lines = []
    for si, stage in enumerate(pipe.stages):
        group = [devs[d] for d in stage.devices]
        nodes = sorted({d.node for d in group})
        types = sorted({d.spec.name for d in group})
        slow = max(d.slowdown for d in group)
        mem = max(est.memory_bytes[d] for d in stage.devices)
        limit = min(est.memory_limit_bytes[d] for d in stage.devices)
        where = f"{'/'.join(nodes)}, {'/'.join(types)}, tp {stage.tp}"
        if slow > 1:
            where += f", slowdown {slow:g}"
        noun = "device" if stage.tp == 1 else "devices"
        lines.append(
            f"    stage {si}: layers [{stage.layers[0]}, {stage.layers[1]}) on {noun} "
            f"{compact_ids(stage.devices)} ({where}); {est.stage_times_s[pi][si] * 1e3:.4g} "
            f"ms per micro-batch; memory {_bytes(mem)} of {_bytes(limit)} per device")
    return lines


def _shape_key(c: Candidate, pi: int, inventory: Inventory) -> tuple:
    devs = inventory.by_id()
    pipe = c.plan.pipelines[pi]
    return (pipe.num_microbatches, pipe.microbatch_size,
            tuple((s.layers, tuple(devs[d].spec.name for d in s.devices),
                   tuple(devs[d].slowdown for d in s.devices)) for s in pipe.stages))


def explain(result: PlanResult) -> str:
    inv, chosen = result.inventory, result.chosen
    plan, est = chosen.plan, chosen.estimate
    failed = [d.id for d in inv.devices if not d.usable]
    lines = [
        f"Plan for {result.profile.name} ({_params(result.profile.total_params)} parameters, "
        f"{plan.num_layers} layers), global batch {plan.global_batch}, on "
        f"{_count(len(inv.devices), 'device')} ({len(failed)} failed"
        f"{': ' + compact_ids(failed) if failed else ''})",
        f"Chosen: {_count(len(plan.pipelines), 'pipeline')} over "
        f"{_count(len(plan.devices), 'device')}: "
        f"{chosen.label}",
        f"  estimate: {_summary(chosen)}",
    ]
    seen: dict[tuple, int] = {}
    for pi, pipe in enumerate(plan.pipelines):
        key = _shape_key(chosen, pi, inv)
        head = (f"  pipeline {pi}: {pipe.num_microbatches} micro-batches x {pipe.microbatch_size}"
                f" rows, {est.pipeline_times_s[pi] * 1e3:.4g} ms")
        if key in seen:
            devices = [d for s in pipe.stages for d in s.devices]
            lines.append(f"{head}; same shape as pipeline {seen[key]}, devices "
                         f"{compact_ids(devices)}")
            continue
        seen[key] = pi
        lines.append(head)
        lines += _stage_lines(chosen, pi, inv)
    if est.unused_devices:
        lines.append(f"  idle usable devices: {compact_ids(est.unused_devices)} "
                     "(they would not speed up the step)")
        lines += [f"    {line}" for line in idle_lines(est.idle)]
    lines.append(f"  every parameter slice lives on {est.replica_nodes} nodes or more"
                 if est.cross_node_replicas
                 else "  some parameter slices live on one node only: losing it needs a "
                 "checkpoint")
    if result.alternatives:
        lines.append("Next-best alternatives:")
    for i, alt in enumerate(result.alternatives, 1):
        gap = alt.estimate.step_time_s / est.step_time_s - 1.0
        lines.append(f"  {i}. {_count(len(alt.plan.pipelines), 'pipeline')} over "
                     f"{_count(len(alt.plan.devices), 'device')}: {alt.label}")
        lines.append(f"     {_summary(alt)} ({gap:+.1%} step time)")
    return "\n".join(lines)


def idle_lines(idle: Sequence[IdleDevice], limit: int = 8,
               names: Optional[Sequence[str]] = None) -> list[str]:
    """Why devices are idle, one line per distinct set of numbers (``subsets.idle_reason``):
    ``"devices 2-3 idle: at 0.25x the fastest device's speed the best plan using it takes
    0.1861 s/step vs 0.08336 s without"``; past ``limit`` lines, one more line counts the rest.
    ``names[i]`` names device ``i`` (``"node-b:1"``) when given."""
    groups: dict[tuple, list[int]] = {}
    for dev in idle:
        groups.setdefault((round(dev.speed, 3), dev.step_time_with_s, dev.step_time_without_s),
                          []).append(dev.id)
    lines = []
    for (speed, with_s, without_s), ids in groups.items():
        if names is None:
            listed = compact_ids(ids)
        else:
            listed = ",".join(names[i] for i in ids[:limit])
            listed += f" and {len(ids) - limit} more" if len(ids) > limit else ""
        who = f"device{'s' if len(ids) > 1 else ''} {listed}"
        lines.append(idle_reason(who, speed, with_s, without_s))
    if len(lines) > limit:
        rest = sum(len(ids) for ids in list(groups.values())[limit:])
        lines = lines[:limit] + [f"... and {rest} more idle devices"]
    return lines


def idle_to_dict(dev: IdleDevice) -> dict:
    return {"id": dev.id, "speed": dev.speed, "reason": dev.reason,
            "step_time_with_s": dev.step_time_with_s,
            "step_time_without_s": dev.step_time_without_s}


def candidate_to_dict(c: Candidate) -> dict:
    e = c.estimate
    return {
        "label": c.label,
        "score": c.score,
        "plan": c.plan.to_dict(),
        "estimate": {
            "step_time_s": e.step_time_s, "samples_per_s": e.samples_per_s,
            "tokens_per_s": e.tokens_per_s, "grad_sync_s": e.grad_sync_s,
            "bubble_fraction": e.bubble_fraction,
            "pipeline_times_s": list(e.pipeline_times_s),
            "memory_bytes": {str(k): v for k, v in sorted(e.memory_bytes.items())},
            "memory_limit_bytes": {str(k): v for k, v in sorted(e.memory_limit_bytes.items())},
            "unused_devices": list(e.unused_devices),
            "idle": [idle_to_dict(d) for d in e.idle],
            "cross_node_replicas": e.cross_node_replicas,
            "replica_nodes": e.replica_nodes,
            "switch_bytes": e.switch_bytes,
        },
    }


def result_to_dict(result: PlanResult) -> dict:
    return {
        "schema": 1,
        "model": result.profile.name,
        "chosen": candidate_to_dict(result.chosen),
        "alternatives": [candidate_to_dict(c) for c in result.alternatives],
    }
