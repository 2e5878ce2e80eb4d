"""Straggler replans: from the workers' measured busy time to the speeds the next plan is for.

In synchronous training every rank's step takes the slowest rank's time, so neither the step
rate nor the hang rule says *which* device is slow. Each worker measures its own compute per
step (``busy_s`` of ``workers/<node>/<local_rank>``, ``hspmd_elastic.elastic.busy``); this
module turns those into device speeds and decides, with the cost model, whether a plan for the
measured speeds pays for its switch. Promises:

* ``StragglerWatch.observe(workers, current, usable)`` takes the worker records of the
  current plan (``workers()``, read at most every ``SAMPLE_S``) (a record of another plan version, or ``busy_s`` 0, is no sample); a device's
  sample is the cost model's predicted compute for its share of the current plan at nominal
  health (``planner.calibrate.predicted_busy_s``; with length buckets, the sum over the
  buckets' plans at their lengths) over its measured busy time; the estimator
  (``speeds.SpeedEstimator``: a median over a window, the steps right after a switch skipped)
  gives each device's speed, relative to the fastest device (1.0);
* ``observe`` returns, as a value, the speeds the leader plans for (device -> speed below 1;
  absent: full speed); the leader passes it into its snapshot (``build_snapshot(...,
  measured=...)``, folded by ``snapshot.with_measured``, the fold these predictions use too),
  and nothing reads it back from here. It changes only when ``speeds.decide_speeds`` says
  so: a quantised measured speed differs from what the plan assumed by at least the policy's
  minimum change, the dwell since the last speed-driven switch is over, and the predicted gain
  over the horizon (the current plan at the measured speeds against the best plan for them,
  both by the cost model) beats the switch's predicted cost by the margin (the last switch's
  measured ``total_s``, at least ``MIN_SWITCH_COST_S``; ``DEFAULT_SWITCH_COST_S`` before one
  was measured). A device that recovers gets its work back by the same rule;
* a usable device the current plan was made over but leaves idle (``idle_devices``: the
  planner found it costs more than it adds) is measured by its worker's probes while it waits
  for a plan that uses it (``WorkerRecord.probe_s`` and ``probes``, ``elastic.busy.probe``):
  a probe's sample is the cost model's time of the probe's workload (``probe_predicted_s``)
  over its measured time, scaled by the plan devices' reference (``SpeedEstimator.relative``'s
  ``others``). The predictions weigh the current plan's devices and its idle ones, so an idle
  device that got faster comes back by the same rule, cost-benefit and dwell included; the
  decision names the devices its plan leaves idle with their speed and the step time with and
  without each (``SpeedsDetail.idle``, ``idle_reasons``);
* the best plan for the measured speeds is the best that keeps the copies the current plan owes
  (``Copies.owed``: its own, up to two or ``--hspmd-redundancy``) of every parameter slice (``planner.copies``: devices and nodes), unless none does; the same
  rule plans the switch (``planning.speed_only``). A faster plan that would lose copies is
  named, not taken; when keeping them leaves the current plan the best, the gain is 0 and the
  decision says so; a trade (no plan keeps them) is journaled as such;
* each decision on a candidate change (replan or not) is journaled once as a ``speeds`` event
  with its numbers and the copies before and after (``contract.events.SpeedsDetail``), a
  decision not to replan at most once per plan version and measured speeds;
* the cost model is calibrated from the same measurements: the busy time of every device
  measured at full speed (relative speed >= ``NOMINAL``) under each plan is a
  ``calibrate.busy_measurement``; when a new plan version comes and the measurements of the
  last ``CALIBRATION_KEEP`` (plan, device) pairs determine the CPU's (or a type's) compute rate
  and fixed cost per micro-batch, and where they tell it apart its cost per parameter element
  per step (``calibrate.fit``; a plan with length buckets mixes plans in a step and adds no
  measurement), the predictions of that plan and every
  later comparison use the fitted constants (``calibration``); measurements that do not
  determine them leave the last calibration (or none) in place;
* nothing here blocks: the planner runs only when measured speeds differ from the assumed ones
  by the minimum change, at most once per ``RECHECK_S``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.events import IdleDevice
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.elastic.busy import PROBE_LAYERS, probe_rows
from hspmd_elastic.plan import Plan, PlanError
from hspmd_elastic.planner import Inventory, PlannerError, estimate_plan
from hspmd_elastic.planner.buckets import profile_at
from hspmd_elastic.planner.calibrate import apply, busy_measurement, fit, predicted_busy_s
from hspmd_elastic.planner.copies import Copies, copies_of, keep, weigh
from hspmd_elastic.planner.cost import StageShape, stage_time_coeffs
from launcher.leader.decide import assumed_inventory
from launcher.leader.planning import device_inventory
from launcher.leader.snapshot import DeviceView, nominal, with_measured
from launcher.leader.speeds import (BusySample, SpeedEstimator, StragglerPolicy,
                                    decide_speeds)

log = logging.getLogger(__name__)

SAMPLE_S = 0.5  # at most one read of the workers' records per this long
RECHECK_S = 2.0  # at most one cost-model comparison per this long
DEFAULT_SWITCH_COST_S = 2.0  # a switch's predicted cost before one was measured
MIN_SWITCH_COST_S = 0.5  # a measured switch never counts as cheaper (plan, debounce, warm-up)
NOMINAL = 0.9  # a device this fast (relative) counts as nominal for the calibration
CALIBRATION_KEEP = 32  # (plan, device) busy measurements the fit uses, newest


@dataclass(frozen=True)
class Prediction:
    """The cost model's view of a speed change: the step time of the current plan and of the
    best plan for the measured speeds, and the copies of the parameters each keeps
    (``planner.copies``; None: not predicted)."""

    step_now_s: float
    step_new_s: float
    before: Optional[object] = None  # planner.copies.Copies of the current plan
    after: Optional[object] = None  # ... of the best plan for the measured speeds
    verdict: Optional[object] = None  # planner.copies.Verdict
    idle_now: Mapping[str, IdleDevice] = field(default_factory=dict)  # the current plan's
    idle_new: Mapping[str, IdleDevice] = field(default_factory=dict)  # the best plan's

    def note(self) -> str:
        """The redundancy part of the decision's line ("" when not predicted)."""
        if self.verdict is None:
            return ""
        return f"; redundancy {self.verdict.outcome}: {self.verdict.why}"

    def copies_fields(self) -> dict:
        """``SpeedsDetail``'s redundancy fields."""
        if self.verdict is None:
            return {}
        return {"copies_before": self.before.devices, "copies_after": self.after.devices,
                "copy_nodes_before": self.before.nodes, "copy_nodes_after": self.after.nodes,
                "redundancy": self.verdict.outcome, "redundancy_reason": self.verdict.why}


class StragglerWatch:
    """The leader's measured speeds (see the module docstring)."""

    def __init__(self, profile, global_batch: int, planner_fn, options_fn: Callable,
                 policy: Optional[StragglerPolicy] = None,
                 clock: Callable[[], float] = time.monotonic,
                 journal: Optional[Callable[[schema.SpeedsDetail], None]] = None):
        self.profile, self.global_batch = profile, global_batch
        self.planner_fn, self.options_fn = planner_fn, options_fn
        self.policy = policy or StragglerPolicy()
        self.clock, self.journal = clock, journal
        self.estimator = SpeedEstimator()
        self._planned: dict[str, float] = {}  # what ``observe`` returns (see its docstring)
        self.switch_cost_s = DEFAULT_SWITCH_COST_S
        self.last: Optional[schema.SpeedsDetail] = None  # the newest decision (for status)
        self._last_switch_at = -math.inf
        self._predicted: tuple[int, dict[str, float]] = (-1, {})
        self._shares: dict[str, float] = {}  # device -> its work share of the plan (speeds)
        self._seen: dict[str, tuple[int, int]] = {}  # device -> (plan version, step) sampled
        self._probed: dict[str, tuple[int, int]] = {}  # idle device -> (version, probes) sampled
        self._probe_cache: tuple[tuple, dict[str, float]] = ((), {})  # _probe_predictions
        self._checked_at = self._sampled_at = -math.inf
        self._journaled: set[tuple] = set()
        self.calibration = None  # planner.calibrate.Calibration, once measurements allow
        self._busy: dict[tuple[int, str], float] = {}  # (plan version, device) -> busy_s
        self._measurements: dict[tuple[int, str], object] = {}  # for the fit, newest last

    def _spec_of(self):
        """The spec of a device under the calibration (None: the built-in constants)."""
        if self.calibration is None:
            return None

        return lambda d, c=self.calibration: apply(c, d.spec)

    def _calibrate(self) -> None:
        """Fit the constants from the busy measurements so far (a new plan's predictions use
        them); measurements that do not determine them keep the last fit."""
        if len({v for v, _d in self._measurements}) < 2:
            return  # one plan's devices share one work mix: rate and fixed cost stay unknown

        try:
            self.calibration = fit(list(self._measurements.values())[-CALIBRATION_KEEP:])
        except ValueError as exc:
            log.debug("calibration: %s", exc)
            return
        log.info("cost model calibrated from %d busy measurement(s): %s (rms error %.1f%%)",
                 self.calibration.samples, self.calibration.types,
                 100 * self.calibration.rms_rel_error)

    def _note_nominal(self, current: schema.PlanRecord, usable: Mapping[str, DeviceView],
                      measured: Mapping[str, float]) -> None:
        """Keep the busy times of the devices measured at full speed under ``current``."""
        fresh = [(d, self._busy[(current.version, d)]) for d, sp in measured.items()
                 if sp >= NOMINAL and (current.version, d) in self._busy
                 and (current.version, d) not in self._measurements]
        if not fresh or current.buckets:  # a bucketed step mixes plans: predictions only
            return
        try:
            plan, inventory = plan_of(current), self._inventory(current, usable, {})
            ranks = {d: i for i, d in enumerate(current.devices)}
            for dev, busy in fresh:
                self._measurements[(current.version, dev)] = busy_measurement(
                    plan, self.profile, inventory, ranks[dev], busy)
        except (PlanError, KeyError, ValueError) as exc:
            log.debug("calibration: no measurement of plan v%d (%s)", current.version, exc)
        while len(self._measurements) > CALIBRATION_KEEP:
            self._measurements.pop(next(iter(self._measurements)))

    # ------------------------------------------------------------------ samples
    def _predictions(self, current: schema.PlanRecord,
                     usable: Mapping[str, DeviceView]) -> dict[str, float]:
        """Predicted compute per step of each device's share of ``current`` (nominal health),
        computed once per plan version."""
        if self._predicted[0] == current.version:
            return self._predicted[1]

        self._calibrate()
        spec_of = self._spec_of()

        out: dict[str, float] = {}
        self._shares = {}

        def work_only(d):  # the compute of the device's rows, no cost per step or micro-batch
            spec = spec_of(d) if spec_of is not None else d.spec
            return replace(spec, microbatch_overhead_s=0.0, update_s_per_param=0.0)

        try:
            parts = self._parts(current)
            inventory = self._inventory(current, usable, {})
        except (PlanError, KeyError, ValueError, TypeError) as exc:
            log.debug("plan v%d: no predictions (%s)", current.version, exc)
            inventory = None
        if inventory is not None:
            for rank, dev in enumerate(current.devices):
                try:
                    mine = [(plan, profile) for plan, profile in parts
                            if rank in plan.devices]  # a bucket's plan may leave it idle
                    out[dev] = sum(predicted_busy_s(plan, profile, inventory, rank, spec_of)
                                   for plan, profile in mine)
                    self._shares[dev] = sum(predicted_busy_s(plan, profile, inventory, rank,
                                                             work_only)
                                            for plan, profile in mine)
                except Exception as exc:  # noqa: BLE001 - a device without a prediction
                    log.debug("plan v%d: no prediction for %s (%s)", current.version, dev, exc)
        self._predicted = (current.version, out)
        return out

    def _parts(self, current: schema.PlanRecord) -> list:
        """What a step of ``current`` runs: its plan at the model's length, or with length
        buckets each bucket's plan at the bucket's length (``PlanRecord.buckets``)."""
        if not current.buckets:
            return [(plan_of(current), self.profile)]

        return [(Plan.from_dict(b["strategy"]), profile_at(self.profile, int(b["window"])))
                for b in current.buckets]

    def _inventory(self, current: schema.PlanRecord, usable: Mapping[str, DeviceView],
                   speeds: Mapping[str, float]):
        """The planner's inventory (``planning.device_inventory``) of ``current``'s devices
        (ids: their ranks), then the usable devices it leaves idle (``idle_devices``), at
        ``speeds`` (absent: full speed; folded by ``snapshot.with_measured``), each device's
        spec from its type and declared capacity."""
        universe = [*current.devices, *idle_devices(current, usable)]
        views = {d: with_measured(nominal(usable[d]), speeds.get(d, 1.0))
                 for d in universe if d in usable}
        ids = {d: i for i, d in enumerate(universe)}
        lost = next(iter(usable.values())).type if usable else "CPU"
        return device_inventory(universe, views, ids, lost)

    def _probe_predictions(self, current: schema.PlanRecord, idle: list[str],
                           usable: Mapping[str, DeviceView]) -> dict[str, float]:
        """The cost model's time of an idle device's probe under ``current`` (nominal health;
        ``probe_predicted_s``), computed once per plan version and idle set."""
        key = (current.version, tuple(idle), self.calibration)
        if not idle or self._probe_cache[0] == key:
            return self._probe_cache[1] if idle else {}
        spec_of = self._spec_of()
        try:
            rows = probe_rows(plan_of(current))
            inventory = self._inventory(current, usable, {})
        except (PlanError, KeyError, ValueError, TypeError) as exc:
            log.debug("plan v%d: no probe predictions (%s)", current.version, exc)
            return {}
        out = {}
        for i, dev in enumerate(current.devices + idle):
            if dev in idle:
                d = inventory.devices[i]
                out[dev] = probe_predicted_s(self.profile,
                                             spec_of(d) if spec_of is not None else d.spec, rows)
        self._probe_cache = (key, out)
        return out

    def _sample(self, workers: Mapping[tuple[str, int], schema.WorkerRecord],
                current: schema.PlanRecord, usable: Mapping[str, DeviceView]) -> None:
        predicted = self._predictions(current, usable)
        shares = self._shares
        idle = idle_devices(current, usable)
        probes = self._probe_predictions(current, idle, usable)
        for (node, lr), rec in workers.items():
            dev = device_id(node, lr)
            if dev in probes:
                self._sample_probe(dev, rec, current.version, probes[dev])
                continue
            if rec.plan_version != current.version or rec.busy_s <= 0 or dev not in predicted:
                continue
            if self._seen.get(dev) == (rec.plan_version, rec.step):
                continue
            self._seen[dev] = (rec.plan_version, rec.step)
            self._busy[(rec.plan_version, dev)] = rec.busy_s
            self.estimator.add(BusySample(dev, rec.plan_version, rec.step, rec.busy_s,
                                          predicted[dev], shares.get(dev)))

    def _sample_probe(self, dev: str, rec: schema.WorkerRecord, version: int,
                      predicted_s: float) -> None:
        """An idle device's probe (``WorkerRecord.probes``: its count under the plan) as a
        sample: the probe's predicted time over its measured one."""
        if rec.plan_version != version or rec.probes <= 0 or rec.probe_s <= 0:
            return
        if self._probed.get(dev) == (version, rec.probes):
            return
        self._probed[dev] = (version, rec.probes)
        self.estimator.add(BusySample(dev, version, rec.probes, rec.probe_s, predicted_s))

    # ------------------------------------------------------------------ decisions
    def observe(self, workers: Callable[[], Mapping[tuple[str, int], schema.WorkerRecord]],
                current: Optional[schema.PlanRecord], usable: Mapping[str, DeviceView]
                ) -> dict[str, float]:
        """Take the newest worker records (``workers()``, read at most once per
        ``SAMPLE_S``: the agents relay them about once a second); returns the measured speeds
        the leader plans for (device -> speed below 1; absent: full speed), a new dict that
        changes only when the straggler rule replans (see the module docstring). The leader
        passes it into its snapshot (``build_snapshot(..., measured=...)``)."""
        if current is None or not current.strategy:
            return dict(self._planned)
        now = self.clock()
        if now - self._sampled_at < SAMPLE_S:
            return dict(self._planned)
        self._sampled_at = now
        self._sample(workers(), current, usable)
        self._decide(now, current, usable)
        return dict(self._planned)

    def _decide(self, now: float, current: schema.PlanRecord,
                usable: Mapping[str, DeviceView]) -> None:
        """Weigh the measured speeds (at most every ``RECHECK_S``); journal the decision, and
        on a replan move ``_planned`` to its speeds."""
        idle = idle_devices(current, usable)
        measured = self.estimator.relative(current.devices, others=idle)
        if not measured:
            return
        self._note_nominal(current, usable, measured)
        whole = assumed_inventory(current)
        assumed = {d: s for d, s in whole.items() if d in measured}
        if now - self._checked_at < RECHECK_S or not self.policy.differs(assumed, measured):
            return
        self._checked_at = now
        predicted = self._predict(current, usable, {**whole, **measured})
        step_now, step_new = predicted.step_now_s, predicted.step_new_s
        decision = decide_speeds(self.policy, now, self._last_switch_at, assumed, measured,
                                 step_now, step_new, self.switch_cost_s)
        detail = schema.SpeedsDetail(
            plan_version=current.version, measured=dict(sorted(measured.items())),
            assumed=dict(sorted(assumed.items())), step_now_s=step_now, step_new_s=step_new,
            gain_s=decision.gain_s, cost_s=decision.cost_s, replan=decision.replan,
            reason=decision.reason + predicted.note(), **predicted.copies_fields(),
            idle=dict(predicted.idle_new if decision.replan else predicted.idle_now))
        self.last = detail
        key = (current.version, decision.replan, tuple(sorted(decision.speeds.items())))
        if self.journal is not None and key not in self._journaled:
            self._journaled.add(key)
            self.journal(detail)
        planned = {d: s for d, s in decision.speeds.items() if s < 1.0}
        if not decision.replan or planned == self._planned:
            return  # nothing to do, or the plan for these speeds is on its way
        log.info("measured speeds: %s", decision.reason)
        self._planned = planned
        self._last_switch_at = now

    def _predict(self, current: schema.PlanRecord, usable: Mapping[str, DeviceView],
                 measured: Mapping[str, float]) -> Prediction:
        """Predicted step times at ``measured``: the current plan's, and the best plan's that
        keeps the copies the current plan owes (``Copies.owed``) unless none does
        (``planner.copies``; the same rule ``planning.make_layout`` plans the switch by), with
        what the best plan does to those copies."""
        try:
            inventory = self._inventory(current, usable, measured)
            spec_of = self._spec_of()
            if spec_of is not None:  # the constants this cluster measured
                inventory = Inventory(tuple(replace(d, spec=spec_of(d))
                                            for d in inventory.devices))
            now_plan = plan_of(current)
            before = copies_of(now_plan, inventory)
            universe = [*current.devices, *idle_devices(current, usable)]
            options = keep(self.options_fn([usable[d] for d in universe if d in usable]),
                           before)
            now_s = estimate_plan(now_plan, inventory, self.profile, options).step_time_s
            result = self.planner_fn(inventory, self.profile, self.global_batch,
                                     current_plan=now_plan, options=options)
        except (PlannerError, PlanError, KeyError, ValueError) as exc:
            log.info("measured speeds: no prediction (%s)", exc)
            return Prediction(math.inf, math.inf)
        new_s, after = result.estimate.step_time_s, Copies.of(result.estimate)
        if new_s >= now_s:  # the current plan is the best that keeps the copies
            new_s, after = now_s, before
        candidates = (result.chosen, *result.alternatives)
        fastest = min(candidates, key=lambda c: c.estimate.step_time_s)
        other = None if fastest is result.chosen else \
            (Copies.of(fastest.estimate), fastest.estimate.step_time_s, new_s)
        unused_now = [universe[i] for i in range(len(universe)) if i not in now_plan.devices]
        if after is before:
            unused_new, known = unused_now, {}
        else:  # the planner's own reasons (``Estimate.idle``) where it gives them
            unused_new = [universe[i] for i in result.estimate.unused_devices]
            known = {universe[i.id]: (i.step_time_with_s, i.step_time_without_s)
                     for i in getattr(result.estimate, "idle", ())}
        return Prediction(now_s, new_s, before, after,
                          weigh(before, after, other, options.redundancy),
                          idle_reasons(unused_now, universe, candidates, measured, now_s),
                          idle_reasons(unused_new, universe, candidates, measured, new_s,
                                       known))

    def switched(self, seconds: float) -> None:
        """A switch took ``seconds`` (its ``switch-done`` event's ``total_s``): the next
        switch's predicted cost, at least ``MIN_SWITCH_COST_S``."""
        if seconds > 0 and math.isfinite(seconds):
            self.switch_cost_s = max(seconds, MIN_SWITCH_COST_S)


def idle_devices(current: schema.PlanRecord, usable: Mapping[str, DeviceView]) -> list[str]:
    """The usable devices ``current`` was made over (its ``inventory``) and leaves idle, in
    the inventory's order."""
    return [d for d in assumed_inventory(current) if d in usable and d not in current.devices]


def probe_predicted_s(profile, spec, rows: int) -> float:
    """The cost model's time of an idle device's probe (``elastic.busy.probe``: forward and
    backward of ``rows`` rows through ``PROBE_LAYERS`` layers, embedding and head) on a
    device of ``spec`` at nominal speed: one micro-batch of a one-stage pipeline without TP."""
    shape = StageShape(tp=1, flops=spec.peak_tflops * 1e12 * spec.mfu, memory=0,
                       intra_gbps=math.inf, next_gbps=None,
                       overhead_s=spec.microbatch_overhead_s, latency_s=0.0, update_s=0.0)
    fixed, per_layer = stage_time_coeffs(profile, shape, True, rows)
    return fixed + per_layer * min(PROBE_LAYERS, profile.num_layers)


def idle_reasons(unused: list[str], universe: list[str], candidates, speeds: Mapping[str, float],
                 without_s: float, known: Optional[Mapping[str, tuple]] = None
                 ) -> dict[str, IdleDevice]:
    """Why a plan leaves each of ``unused`` idle: its speed (measured, else assumed), and the
    step time of the best plan that uses it against ``without_s``, the plan's without it.
    ``known``: device -> (with, without) from the planner's own reasons (``Estimate.idle``;
    with None: no plan found); the others from the best of ``candidates`` (the planner's
    chosen plan and alternatives, ids over ``universe``) that uses the device."""
    out = {}
    for dev in unused:
        if known and dev in known:
            with_s, without = known[dev]
        else:
            rank = universe.index(dev)
            using = [c.estimate.step_time_s for c in candidates
                     if rank in c.plan.devices and math.isfinite(c.estimate.step_time_s)]
            with_s, without = (min(using) if using else None), without_s
        without = float(without) if math.isfinite(without) else 0.0
        speed = float(speeds.get(dev, 1.0))
        shown = f"{with_s:.3g} s" if with_s is not None else "no plan found"
        out[dev] = IdleDevice(speed, float(with_s or 0.0), without,
                              f"speed {speed:.3g}: step {shown} with it, {without:.3g} s "
                              "without")
    return out
