"""Calibration: the cost model's per-type constants fitted from what the cluster measured. Pure.

The model. Every time the cost model (``cost``) predicts is a sum of known work, each part times
one constant of one device type ``k``, plus a part the constants do not scale::

    t = sum_k ( F_k / R_k + M_k * O_k + C_k * L_k + P_k * U_k ) + K

``R_k``: effective FLOP/s (``peak_tflops x 1e12 x mfu``); ``O_k``: fixed cost per micro-batch
(``microbatch_overhead_s``); ``L_k``: start-up cost of a collective or send/receive
(``link_latency_s``); ``U_k``: cost per local parameter element per step, whatever the rows
(``update_s_per_param``). ``F_k``: FLOPs on devices of type ``k`` (3 x forward, per TP rank);
``M_k``: micro-batches; ``C_k``: collective and send/receive start-ups; ``P_k``: parameter
elements updated (a device's local share; in a step, the slowest update of the pipeline's
stages); ``K``: bytes over bandwidth. A device of declared speed ``s`` (spec ``<type>@<s>``,
``spec_for_device``) and slowdown ``d`` counts ``F d / s``, ``M d / s`` and ``P d / s`` (and on
host-bound links, ``DeviceSpec.host_links``, ``C d / s``, with its bytes over ``s / d`` of the
bandwidth), so one constant serves every declared speed and health of a type. Step times follow
``estimate_plan``: the slowest pipeline (1F1B: every stage once plus the slowest stage ``m - 1``
more times, plus the slowest stage's update) plus the slowest gradient sync, the slowest stage
and members chosen as the constants in use say; given those, ``t`` is linear in ``1/R_k``,
``O_k``, ``L_k`` and ``U_k``. Promises:

* ``predicted_busy_s(plan, profile, inventory, device)``: the cost model's compute time per step
  of ``device``'s share of ``plan`` at nominal speed (its health's slowdown ignored): its
  micro-batches x (3 x forward FLOPs of its layers, and of the head on a last stage, over its
  TP degree at its spec's effective FLOP/s, plus the fixed cost per micro-batch), plus its
  local parameter elements x its cost per element per step; no communication. It is
  ``stage_time_coeffs`` and ``update_time`` of ``cost`` with the links made free, so it is
  the compute part of ``estimate_plan``'s times for a group of alike devices;
* ``busy_measurement`` / ``step_measurement`` turn a measured busy time of one device, or a
  measured step time of a plan, into a ``Measurement`` (its work per type, ``K``, and
  ``predicted_s``: the model's value under the constants in use, ``estimate_plan``'s step time
  for a step);
* ``fit_steps(profile, records)`` fits measured step times of plans, rebuilding their
  measurements under the fitted constants until the critical paths agree with them;
* ``fit(measurements)`` solves for every constant the measurements involve by least squares
  over relative errors (rows weighted by ``1 / seconds``), keeping ``O_k``, ``L_k`` and ``U_k``
  >= 0; a constant no measurement involves is None (``apply`` keeps the spec's), and so is
  every ``U_k`` unless the fit with them is determined, keeps every rate positive and beats
  the fit without them by more than their number is worth (Akaike's criterion: plans whose
  parameters move with their micro-batches cannot tell ``U_k`` from ``O_k``, and times without
  such a cost do not need it); ``predict`` counts a ``U_k`` of None as 0 (the built-in
  value). Bad input (none, a
  time that is not a positive finite number, negative work, ``K`` not below the time, data
  that do not determine the constants) raises a one-line ``ValueError`` naming it;
* ``apply(calibration, spec)``: ``spec`` with its type's fitted constants (scaled by its
  declared speed); a type the calibration does not know is returned unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from hspmd_elastic.plan import Plan
from hspmd_elastic.planner.api import Device, DeviceSpec, Inventory, ModelProfile, PlannerError
from hspmd_elastic.planner.cost import (StageShape, layer_nodes, stage_params, stage_time_coeffs,
                                        update_time)

SpecOf = Callable[[Device], DeviceSpec]
PARAMS = ("rate", "overhead", "latency", "update")  # per type: 1/R (s per FLOP), O, L, U (s)


def type_of(spec: DeviceSpec) -> tuple[str, float]:
    """(type, declared speed): ``"CPU@0.5"`` -> ``("CPU", 0.5)``, ``"H100"`` -> ``("H100", 1.0)``
    (``spec_for_device`` names a declared speed so)."""
    base, at, suffix = spec.name.rpartition("@")
    if at and base:
        try:
            speed = float(suffix)
        except ValueError:
            return spec.name, 1.0
        if speed > 0 and math.isfinite(speed):
            return base, speed
    return spec.name, 1.0


@dataclass(frozen=True)
class Work:
    """Work of one device type in a measured time: FLOPs, micro-batches, start-ups, parameter
    elements updated."""

    flops: float = 0.0
    microbatches: float = 0.0
    collectives: float = 0.0
    params: float = 0.0

    def amounts(self) -> tuple[float, float, float, float]:
        """The amounts in ``PARAMS`` order."""
        return self.flops, self.microbatches, self.collectives, self.params


@dataclass(frozen=True)
class Measurement:
    """A measured time (``seconds``), the work per type it is made of, and ``fixed_s`` (``K``,
    what the constants do not scale). ``predicted_s``: the model's value when the measurement
    was made from a plan (None otherwise)."""

    seconds: float
    work: Mapping[str, Work]
    fixed_s: float = 0.0
    predicted_s: Optional[float] = None


@dataclass(frozen=True)
class TypeFit:
    """One type's fitted constants; None: no measurement involved it."""

    rate_flops: Optional[float]  # effective FLOP/s (peak x mfu)
    overhead_s: Optional[float]  # per micro-batch
    latency_s: Optional[float]  # per collective or send/receive
    update_s: Optional[float] = None  # per parameter element per step


@dataclass(frozen=True)
class Calibration:
    """Fitted constants per device type (``type_of``'s name), and how well they fit."""

    types: Mapping[str, TypeFit]
    samples: int = 0
    rms_rel_error: float = 0.0  # over the measurements fitted
    max_rel_error: float = 0.0

    def predict(self, m: Measurement) -> float:
        """The calibrated model's time for ``m``'s work; ``ValueError`` when it needs a constant
        the calibration lacks."""
        total = m.fixed_s
        for name, work in m.work.items():
            fit = self.types.get(name)
            for param, amount in zip(PARAMS, work.amounts()):
                if amount == 0:
                    continue
                value = None if fit is None else getattr(fit, _FIELD[param])
                if value is None and param == "update":
                    continue  # not determined: the built-in 0
                if value is None:
                    raise ValueError(f"calibration has no {_FIELD[param]} for type {name!r}")
                total += amount / value if param == "rate" else amount * value
        return total


_FIELD = {"rate": "rate_flops", "overhead": "overhead_s", "latency": "latency_s",
          "update": "update_s"}


# ---- the work of a plan --------------------------------------------------------------------

def _spec(dev: Device, spec_of: Optional[SpecOf]) -> DeviceSpec:
    return dev.spec if spec_of is None else spec_of(dev)


def _device(inventory: Inventory, device: int) -> Device:
    dev = inventory.devices_by_id.get(device)
    if dev is None:
        raise PlannerError(f"device {device} is not in the inventory")
    return dev


def _share(plan: Plan, profile: ModelProfile, device: int):
    """(pipeline, stage, layers, last) of ``device`` in ``plan``."""
    if plan.num_layers != profile.num_layers:
        raise PlannerError(f"plan has num_layers={plan.num_layers}, model {profile.name} has "
                           f"{profile.num_layers}")
    where = plan.locate(device)
    pipe = plan.pipelines[where.pipeline]
    stage = pipe.stages[where.stage]
    return pipe, stage, stage.layers[1] - stage.layers[0], where.stage == len(pipe.stages) - 1


def _stage_flops(profile: ModelProfile, b: int, tp: int, layers: int, last: bool) -> float:
    """FLOPs of one micro-batch of ``b`` sequences on each device of a TP group of ``tp``."""
    tokens = b * profile.seq_len
    return 3.0 * tokens * (layers * profile.layer_flops_per_token
                           + (profile.head_flops_per_token if last else 0.0)) / tp


def predicted_busy_s(plan: Plan, profile: ModelProfile, inventory: Inventory, device: int,
                     spec_of: Optional[SpecOf] = None) -> float:
    """The cost model's compute time per step of ``device``'s share of ``plan`` at nominal
    speed (see the module docstring); ``spec_of``: the spec to use per device (default its
    own; e.g. ``lambda d: apply(calibration, d.spec)``)."""
    pipe, stage, layers, last = _share(plan, profile, device)
    spec = _spec(_device(inventory, device), spec_of)
    shape = StageShape(tp=stage.tp, flops=spec.peak_tflops * 1e12 * spec.mfu, memory=0,
                       intra_gbps=math.inf, next_gbps=None,
                       overhead_s=spec.microbatch_overhead_s, latency_s=0.0,
                       update_s=spec.update_s_per_param)
    fixed, per_layer = stage_time_coeffs(profile, shape, last, pipe.microbatch_size)
    first = stage is pipe.stages[0]
    return (pipe.num_microbatches * (fixed + per_layer * layers)
            + update_time(profile, shape, layers, first, last))


def busy_measurement(plan: Plan, profile: ModelProfile, inventory: Inventory, device: int,
                     busy_s: float, speed: float = 1.0,
                     spec_of: Optional[SpecOf] = None) -> Measurement:
    """A measured busy time of ``device`` in ``plan`` as a ``Measurement`` (no communication).
    ``speed``: the device's speed relative to nominal while measured (its work counts
    ``1 / speed`` times); ``predicted_s`` is ``predicted_busy_s / speed``."""
    if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed={speed!r} must be a finite number > 0")
    pipe, stage, layers, last = _share(plan, profile, device)
    spec = _spec(_device(inventory, device), spec_of)
    name, declared = type_of(spec)
    scale = pipe.num_microbatches / (declared * speed)
    params = stage_params(profile, layers, stage is pipe.stages[0], last) / stage.tp
    work = Work(flops=_stage_flops(profile, pipe.microbatch_size, stage.tp, layers, last) * scale,
                microbatches=scale, params=params / (declared * speed))
    predicted = predicted_busy_s(plan, profile, inventory, device, spec_of) / speed
    return Measurement(float(busy_s), {name: work}, 0.0, predicted)


class _Lin:
    """A linear form: coefficients on (param, type) plus a constant, and its value under the
    constants in use."""

    def __init__(self) -> None:
        self.coef: dict[tuple[str, str], float] = {}
        self.fixed = 0.0
        self.value = 0.0

    def add(self, param: str, spec: DeviceSpec, amount: float, constant: float) -> None:
        """``amount`` of ``param`` on ``spec``'s type; ``constant``: ``spec``'s own value of it
        (for ``rate``: its FLOP/s, divided by; else multiplied by)."""
        name, declared = type_of(spec)
        per_speed = param in ("rate", "overhead", "update") or (param == "latency"
                                                                  and spec.host_links)
        scaled = amount / declared if per_speed else amount
        key = (param, name)
        self.coef[key] = self.coef.get(key, 0.0) + scaled
        self.value += amount / constant if param == "rate" else amount * constant

    def add_fixed(self, seconds: float) -> None:
        self.fixed += seconds
        self.value += seconds

    def plus(self, other: "_Lin", times: float = 1.0) -> None:
        for key, c in other.coef.items():
            self.coef[key] = self.coef.get(key, 0.0) + c * times
        self.fixed += other.fixed * times
        self.value += other.value * times

    def measurement(self, seconds: float) -> Measurement:
        work: dict[str, dict[str, float]] = {}
        for (param, name), c in self.coef.items():
            work.setdefault(name, {})[param] = c
        return Measurement(float(seconds), {
            n: Work(*(w.get(p, 0.0) for p in PARAMS)) for n, w in sorted(work.items())},
            self.fixed, self.value)


def _as(d: Device, spec: DeviceSpec) -> Device:
    """``d`` with ``spec`` (its links, ``Device.link_gbps``, under the constants in use)."""
    return d if d.spec is spec else replace(d, spec=spec)


def _latency_times(d: Device, spec: DeviceSpec) -> float:
    """How many of its type's latencies one start-up costs ``d`` (host-bound links: its
    slowdown)."""
    return d.slowdown if spec.host_links else 1.0


def _stage_lin(profile: ModelProfile, group: Sequence[Device], nxt: Optional[Sequence[Device]],
               layers: int, last: bool, b: int, spec_of: Optional[SpecOf]) -> _Lin:
    """One micro-batch on one stage, as ``cost.stage_time`` computes it (``group_shape``)."""
    specs = [_spec(d, spec_of) for d in group]
    tp = len(group)
    lin = _Lin()
    rates = [s.peak_tflops * 1e12 * s.mfu / d.slowdown for d, s in zip(group, specs)]
    slow = min(range(tp), key=rates.__getitem__)
    flops = _stage_flops(profile, b, tp, layers, last)
    lin.add("rate", specs[slow], flops * group[slow].slowdown, rates[slow] * group[slow].slowdown)
    costs = [s.microbatch_overhead_s * d.slowdown for d, s in zip(group, specs)]
    worst = max(range(tp), key=costs.__getitem__)
    lin.add("overhead", specs[worst], group[worst].slowdown, specs[worst].microbatch_overhead_s)
    devs = [_as(d, s) for d, s in zip(group, specs)]
    lat = max(range(tp), key=lambda i: devs[i].link_latency_s)
    times = _latency_times(group[lat], specs[lat])
    act = b * profile.seq_len * profile.hidden_size * profile.activation_bytes
    if tp > 1:
        intra = min(d.link_gbps(False) for d in devs)
        lin.add("latency", specs[lat], 4.0 * layers * times, specs[lat].link_latency_s)
        lin.add_fixed(4.0 * layers * 2.0 * (tp - 1) / tp * act / (intra * 1e9))
    if nxt is not None:
        both = list(group) + list(nxt)
        one_node = len({d.node for d in both}) == 1
        link = min(_as(d, _spec(d, spec_of)).link_gbps(not one_node) for d in both)
        lin.add("latency", specs[lat], 2.0 * times, specs[lat].link_latency_s)
        lin.add_fixed(2.0 * act / (link * 1e9))
    return lin


def _update_lin(profile: ModelProfile, group: Sequence[Device], layers: int, first: bool,
                last: bool, spec_of: Optional[SpecOf]) -> _Lin:
    """One step's update on one stage, as ``cost.update_time`` computes it: the member with
    the largest cost per parameter element."""
    specs = [_spec(d, spec_of) for d in group]
    costs = [s.update_s_per_param * d.slowdown for d, s in zip(group, specs)]
    worst = max(range(len(group)), key=costs.__getitem__)
    lin = _Lin()
    params = stage_params(profile, layers, first, last) / len(group)
    lin.add("update", specs[worst], params * group[worst].slowdown,
            specs[worst].update_s_per_param)
    return lin


def _sync_lin(plan: Plan, profile: ModelProfile, devs: Mapping[int, Device],
              spec_of: Optional[SpecOf]) -> _Lin:
    """The slowest gradient all-reduce, as ``cost._grad_sync`` finds it."""
    replicas = len(plan.pipelines)
    best = _Lin()
    if replicas <= 1:
        return best
    nodes = layer_nodes(plan, devs)
    for pipe in plan.pipelines:
        n = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            group = [devs[d] for d in stage.devices]
            specs = [_spec(d, spec_of) for d in group]
            spans = any(len(nodes[layer]) > 1 for layer in range(*stage.layers))
            links = [_as(d, s) for d, s in zip(group, specs)]
            gbps = min(d.link_gbps(spans) for d in links)
            params = stage_params(profile, stage.layers[1] - stage.layers[0], si == 0,
                                  si == n - 1) / len(group)
            lat = max(range(len(group)), key=lambda i: links[i].link_latency_s)
            lin = _Lin()
            steps = 2.0 * (replicas - 1)
            lin.add("latency", specs[lat], steps * _latency_times(group[lat], specs[lat]),
                    specs[lat].link_latency_s)
            lin.add_fixed(steps * params * profile.grad_bytes / replicas / (gbps * 1e9))
            if lin.value > best.value:
                best = lin
    return best


def step_measurement(plan: Plan, profile: ModelProfile, inventory: Inventory, seconds: float,
                     spec_of: Optional[SpecOf] = None) -> Measurement:
    """A measured step time of ``plan`` as a ``Measurement`` (see the module docstring); its
    ``predicted_s`` is ``estimate_plan``'s step time under the same specs."""
    if plan.num_layers != profile.num_layers:
        raise PlannerError(f"plan has num_layers={plan.num_layers}, model {profile.name} has "
                           f"{profile.num_layers}")
    devs = {d: _device(inventory, d) for d in plan.devices}
    slowest: Optional[_Lin] = None
    for pipe in plan.pipelines:
        groups = [[devs[d] for d in s.devices] for s in pipe.stages]
        n = len(groups)
        stages = [_stage_lin(profile, groups[si], groups[si + 1] if si + 1 < n else None,
                             s.layers[1] - s.layers[0], si == n - 1, pipe.microbatch_size,
                             spec_of) for si, s in enumerate(pipe.stages)]
        times = [s.value for s in stages]
        lin = _Lin()
        for s in stages:
            lin.plus(s)
        lin.plus(stages[max(range(n), key=times.__getitem__)], pipe.num_microbatches - 1)
        updates = [_update_lin(profile, groups[si], s.layers[1] - s.layers[0], si == 0,
                               si == n - 1, spec_of) for si, s in enumerate(pipe.stages)]
        lin.plus(max(updates, key=lambda u: u.value))
        if slowest is None or lin.value > slowest.value:
            slowest = lin
    if slowest is None:
        raise PlannerError("plan has no pipeline")
    slowest.plus(_sync_lin(plan, profile, devs, spec_of))
    return slowest.measurement(seconds)


# ---- the fit -------------------------------------------------------------------------------

def _check(i: int, m: Measurement) -> None:
    s = m.seconds
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"measurement #{i}: seconds={s!r} must be a finite number > 0")
    if not (isinstance(m.fixed_s, (int, float)) and math.isfinite(m.fixed_s)
            and 0 <= m.fixed_s < s):
        raise ValueError(f"measurement #{i}: fixed_s={m.fixed_s!r} must be >= 0 and below "
                         f"seconds={s!r}")
    for name, work in m.work.items():
        for what in ("flops", "microbatches", "collectives", "params"):
            v = getattr(work, what)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"measurement #{i}: type {name!r} {what}={v!r} must be a "
                                 "finite number >= 0")


class _Undetermined(ValueError):
    """The measurements do not tell the constants apart."""


class _Contradicted(ValueError):
    """The best fit needs a non-positive compute rate."""


def _solve(a: np.ndarray, y: np.ndarray, keys: list[tuple[str, str]]) -> np.ndarray:
    """Least squares with columns scaled to unit norm; ``ValueError`` when the columns are
    (nearly) dependent: the data do not tell the constants apart."""
    norms = np.linalg.norm(a, axis=0)
    scaled = a / norms
    sv = np.linalg.svd(scaled, compute_uv=False)
    if len(sv) < a.shape[1] or sv[-1] < 1e-9 * sv[0]:
        names = ", ".join(f"{_FIELD[p]}[{t}]" for p, t in keys)
        raise _Undetermined(f"the measurements do not determine {names} ({a.shape[0]} "
                         "measurement(s)): vary the layers, micro-batches or plans")
    x, *_ = np.linalg.lstsq(scaled, y, rcond=None)
    return x / norms


def fit(measurements: Sequence[Measurement]) -> Calibration:
    """The constants that best explain ``measurements`` (see the module docstring)."""
    ms = list(measurements)
    if not ms:
        raise ValueError("fit: no measurements")
    for i, m in enumerate(ms):
        if not isinstance(m, Measurement):
            raise ValueError(f"measurement #{i}: {m!r} is not a Measurement")
        _check(i, m)
    keys = sorted({(p, name) for m in ms for name, w in m.work.items()
                   for p, v in zip(PARAMS, w.amounts()) if v > 0},
                  key=lambda k: (k[1], PARAMS.index(k[0])))
    if not keys:
        raise ValueError("fit: the measurements hold no work (every flops, microbatches, "
                         "collectives and params is 0)")
    seconds = np.array([m.seconds for m in ms])
    weights = 1.0 / seconds
    y = (seconds - np.array([m.fixed_s for m in ms])) * weights
    base = [k for k in keys if k[0] != "update"]
    if len(base) == len(keys) or not base:
        values, _ = _fit_values(ms, keys, y, weights)
    else:
        keys, values = _with_or_without_update(ms, keys, base, y, weights)
    fits: dict[str, dict[str, Optional[float]]] = {}
    for j, (p, t) in enumerate(keys):
        v = float(values[j])
        fits.setdefault(t, dict.fromkeys(PARAMS))[p] = 1.0 / v if p == "rate" else v
    cal = Calibration({t: TypeFit(f["rate"], f["overhead"], f["latency"], f["update"])
                       for t, f in sorted(fits.items())}, len(ms))
    errors = [abs(cal.predict(m) - m.seconds) / m.seconds for m in ms]
    return replace(cal, rms_rel_error=float(math.sqrt(sum(e * e for e in errors) / len(ms))),
                   max_rel_error=float(max(errors)))


def _fit_values(ms: list[Measurement], keys: list[tuple[str, str]], y: np.ndarray,
                weights: np.ndarray) -> tuple[dict[int, float], float]:
    """(key index -> fitted value, weighted residual sum of squares); a negative overhead,
    latency or update is pinned to 0 (an active set)."""
    a = np.array([[getattr(m.work.get(t, Work()), _WORK[p]) for p, t in keys] for m in ms],
                 dtype=float) * weights[:, None]
    active = list(range(len(keys)))
    while True:
        if not active:
            raise ValueError("fit: every constant comes out negative: the measurements "
                             "contradict the model")
        x = _solve(a[:, active], y, [keys[j] for j in active])
        negative = [(x[i], j) for i, j in enumerate(active)
                    if keys[j][0] != "rate" and x[i] < 0]
        if not negative:
            break
        active.remove(min(negative)[1])
    values = dict.fromkeys(range(len(keys)), 0.0)
    values.update(zip(active, x))
    for j, (p, t) in enumerate(keys):
        if p == "rate" and not values[j] > 0:
            raise _Contradicted(f"fit: type {t!r} gets a non-positive compute time per FLOP "
                                f"({values[j]:.3g}): the measurements contradict the model")
    residual = a @ np.array([values[j] for j in range(len(keys))]) - y
    return values, float(residual @ residual)


def _with_or_without_update(ms: list[Measurement], keys: list, base: list, y: np.ndarray,
                            weights: np.ndarray) -> tuple[list, dict[int, float]]:
    """(keys, values) of the fit with the per-parameter costs or of the one without them
    (``base``): with them only when they are determined, keep every compute rate positive and
    explain the measurements better than their extra constants are worth (Akaike: the
    residual sum of squares falls below ``exp(-2 extra / measurements)`` of the other's)."""
    try:
        full, full_rss = _fit_values(ms, keys, y, weights)
    except (_Undetermined, _Contradicted):
        return base, _fit_values(ms, base, y, weights)[0]
    try:
        values, rss = _fit_values(ms, base, y, weights)
    except _Contradicted:
        return keys, full
    if full_rss < rss * math.exp(-2.0 * (len(keys) - len(base)) / len(ms)):
        return keys, full
    return base, values


_WORK = {"rate": "flops", "overhead": "microbatches", "latency": "collectives",
         "update": "params"}


def fit_steps(profile: ModelProfile, records: Sequence[tuple[Plan, Inventory, float]],
              rounds: int = 8) -> Calibration:
    """``fit`` over measured step times ``(plan, inventory, seconds)``, made self-consistent:
    the critical path of a step (its slowest pipeline, stage and members) depends on the
    constants, so each round rebuilds the measurements under the previous round's calibrated
    specs (``step_measurement`` with ``apply``) and fits again, until the work no longer
    changes (at most ``rounds``; then the round that fits best). Rounds start from the specs
    as given and from ``_fixed_cost_start``; the fit with the least rms error wins (several
    self-consistent fits can exist, one per set of critical paths)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"fit_steps: rounds={rounds!r} must be an integer >= 1")
    records = list(records)
    best: Optional[Calibration] = None
    error: Optional[ValueError] = None
    for start in (None, _fixed_cost_start(records)):
        try:
            cal = _rounds(profile, records, rounds, start)
        except ValueError as exc:  # this start's critical paths do not determine the fit
            error = error or exc
            continue
        if best is None or cal.rms_rel_error < best.rms_rel_error - 1e-12:
            best = cal
    if best is None:
        raise error
    return best


def _fixed_cost_start(records: Sequence[tuple[Plan, Inventory, float]]) -> SpecOf:
    """A second starting point of ``fit_steps``: every device's spec with a cost per
    micro-batch of half the shortest measured step (scaled by its declared speed), so that
    the first critical paths are the pipelines whose devices have the least speed for their
    micro-batches, not the ones with the most rows. A step with a large cost per step (the
    optimizer update of a whole replica, the all-reduce's CPU time) on a slow device with few
    rows is only explained from there; the fit that explains the steps better wins."""
    shortest = min(seconds for _plan, _inv, seconds in records) if records else 0.0

    def spec_of(dev: Device) -> DeviceSpec:
        _name, declared = type_of(dev.spec)
        return replace(dev.spec, microbatch_overhead_s=0.5 * shortest / declared)

    return spec_of


def _rounds(profile: ModelProfile, records: Sequence[tuple[Plan, Inventory, float]],
            rounds: int, start: Optional[SpecOf]) -> Calibration:
    """``fit_steps`` from one starting point: rounds until the work no longer changes."""
    cal: Optional[Calibration] = None
    best: Optional[Calibration] = None
    seen = None
    for _ in range(rounds):
        spec_of = start if cal is None else (lambda d, c=cal: apply(c, d.spec))
        ms = [step_measurement(plan, profile, inv, seconds, spec_of)
              for plan, inv, seconds in records]
        work = [(m.work, m.fixed_s) for m in ms]
        if work == seen:
            return cal
        seen = work
        cal = fit(ms)
        if best is None or cal.rms_rel_error < best.rms_rel_error:
            best = cal
    return best


def apply(calibration: Calibration, spec: DeviceSpec) -> DeviceSpec:
    """``spec`` with its type's fitted constants (see the module docstring). The fitted rate
    sets ``mfu`` (``peak_tflops`` rises only when the rate is above the peak)."""
    name, declared = type_of(spec)
    fit_ = calibration.types.get(name)
    if fit_ is None:
        return spec
    changes: dict = {}
    if fit_.rate_flops is not None:
        rate = fit_.rate_flops * declared / 1e12  # TFLOP/s of this declared speed
        if rate <= spec.peak_tflops:
            changes["mfu"] = rate / spec.peak_tflops
        else:
            changes.update(peak_tflops=rate, mfu=1.0)
    if fit_.overhead_s is not None:
        changes["microbatch_overhead_s"] = fit_.overhead_s / declared
    if fit_.latency_s is not None:
        changes["link_latency_s"] = fit_.latency_s / (declared if spec.host_links else 1.0)
    if fit_.update_s is not None:
        changes["update_s_per_param"] = fit_.update_s / declared
    return replace(spec, **changes)
