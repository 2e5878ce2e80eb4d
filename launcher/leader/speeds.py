"""Measured device speeds and the straggler rule. Pure: no I/O, no clock (time is an argument).

A device's *speed* is the cost model's predicted compute time for its share of the current plan
at nominal speed (``planner.calibrate.predicted_busy_s``) over the busy time its worker measured
for one step (its own forward and backward, waits on peers left out): 1.0 is what the cost
model expects, 0.25 a device four times slower. Promises:

* ``SpeedEstimator`` keeps per device the last ``window`` usable samples of the device's newest
  plan version: a sample of a newer version resets the device's window, one of an older version
  is ignored, and the first ``skip_after_switch`` samples (distinct steps) of each version are
  skipped (warm-up after a switch). A sample whose busy or predicted time is not a positive
  finite number is ignored, as is a repeated or earlier step of the same version.
  ``speeds()`` is each device's lower median ratio, for the devices with ``min_samples``
  usable samples of the newest plan version any sample named (the others left the plan or have
  not reported since the switch). The lower median is a sample, never the mean of two: a window
  that straddles a change of speed gives the old speed or the new one, not one in between that
  the device never ran at. It ignores up to ``(w - 1) // 2`` outliers of ``w`` samples;
* ``relative(devices)`` divides those speeds by the reference's, the fastest device whose
  share of the step's work (its newest sample's ``share``: the predicted compute without the
  costs per step and per micro-batch, else its prediction) is at least ``RELIABLE_SHARE`` of
  the largest; a device faster than the reference is 1.0, so every speed is in (0, 1]: the
  planner's inventory takes a device's speed as a slowdown ``1 / speed >= 1``, and only
  relative speeds matter while the cost model's absolute scale is uncalibrated (the
  calibration corrects the scale, ``planner.calibrate``). The fastest device rather than the
  median is the reference because a slowdown below 1 does not exist; a device with a small
  share is none, because its busy time is mostly the cost per step, where a calibration error
  weighs most (which is why the share leaves those costs out): a device that recovers while
  it holds a few rows must not make the others look slow (it gets its work back, as an
  equal). Given ``devices``, the answer is empty unless every one of them has a speed, so a
  partial view (right after a switch) never rescales the others. ``others`` are devices the
  plan leaves idle, whose samples come from their probes (``elastic.busy.probe``): they are
  scaled by the same reference and never are it;
* ``StragglerPolicy.quantise`` rounds a speed to a multiple of ``quantum`` (at least ``floor``);
  ``StragglerPolicy.changed(assumed, measured)`` names the devices whose measured speed moved
  from the one the plan assumed (1.0 when it says nothing) by more than one quantum and whose
  quantised speed differs from the assumed one by at least ``min_rel_change`` of it, with their
  quantised speeds. Noise within one quantum of the assumed speed is never a change;
* ``decide_speeds`` replans only when some device changed (above), the dwell since the last
  speed-driven switch is over (``now - last_speed_switch_at >= dwell_s``), and the predicted
  gain over the horizon beats the switch's predicted cost by the margin:
  ``(step_now_s - step_new_s) * horizon_s / step_new_s > margin * switch_cost_s``. The caller
  passes ``step_now_s``, the cost model's step time of the current plan with the devices at
  their measured speeds, and ``step_new_s``, the best plan's step time for those speeds (the
  leader: ``estimate_plan`` of the current plan and ``plan_for``, over the inventory at the
  measured speeds; ``launcher.leader.stragglers``). A device that recovers gets its work back
  by the same rule. The decision's ``speeds`` are what the next plan is for: the quantised
  speed of every changed device, the assumed one of the others; its ``reason`` is one line with
  the numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Optional


@dataclass(frozen=True)
class BusySample:
    """One step of one device: its measured busy time and the cost model's prediction for its
    share of plan ``plan_version`` at nominal speed."""

    device: Hashable
    plan_version: int
    step: int
    busy_s: float
    predicted_s: float
    # the device's share of the step's work: its predicted compute without the costs per step
    # and per micro-batch (None: ``predicted_s``); only picks the reference (``relative``)
    share: Optional[float] = None

    @property
    def ratio(self) -> Optional[float]:
        """``predicted_s / busy_s``, or None when either is not a positive finite number."""
        try:
            busy, predicted = float(self.busy_s), float(self.predicted_s)
        except (TypeError, ValueError):
            return None
        if not (busy > 0 and predicted > 0 and math.isfinite(busy) and math.isfinite(predicted)):
            return None
        ratio = predicted / busy
        return ratio if ratio > 0 and math.isfinite(ratio) else None


@dataclass
class _Track:
    """One device's samples of its newest plan version."""

    version: int
    seen: int = 0  # distinct steps of this version seen, warm-up included
    last_step: Optional[int] = None
    window: deque = field(default_factory=deque)
    predicted_s: float = 0.0  # the newest usable sample's share of the work (``BusySample``)


# A device whose predicted share of the step is below this fraction of the largest share is no
# reference for the others: its busy time is mostly the cost per step (the optimizer update of
# its replica), where an error of the calibration weighs most.
RELIABLE_SHARE = 0.25


class SpeedEstimator:
    """Per device, the median of its recent speed samples (see the module docstring)."""

    def __init__(self, window: int = 8, skip_after_switch: int = 2, min_samples: int = 3):
        for name, value, least in (("window", window, 1), ("skip_after_switch",
                                                           skip_after_switch, 0),
                                   ("min_samples", min_samples, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SpeedEstimator: {name}={value!r} must be an integer >= "
                                 f"{least}")
        if min_samples > window:
            raise ValueError(f"SpeedEstimator: min_samples={min_samples} must be <= "
                             f"window={window}")
        self.window, self.skip_after_switch = window, skip_after_switch
        self.min_samples = min_samples
        self._tracks: dict[Hashable, _Track] = {}
        self._newest: Optional[int] = None  # the newest plan version any sample named

    def add(self, sample: BusySample) -> bool:
        """Take one sample; True when it counts (not warm-up, not stale, not malformed)."""
        ratio = sample.ratio
        if ratio is None:
            return False
        track = self._tracks.get(sample.device)
        if track is None or sample.plan_version > track.version:
            track = self._tracks[sample.device] = _Track(sample.plan_version,
                                                         window=deque(maxlen=self.window))
        elif sample.plan_version < track.version:
            return False
        if self._newest is None or sample.plan_version > self._newest:
            self._newest = sample.plan_version
        if track.last_step is not None and sample.step <= track.last_step:
            return False
        track.last_step = sample.step
        track.seen += 1
        if track.seen <= self.skip_after_switch:
            return False
        track.window.append(ratio)
        share = sample.predicted_s if sample.share is None else sample.share
        track.predicted_s = float(share) if math.isfinite(float(share)) else 0.0
        return True

    def add_all(self, samples: Iterable[BusySample]) -> int:
        """``add`` each sample; the number that counted."""
        return sum(self.add(s) for s in samples)

    def forget(self, device: Hashable) -> None:
        """Drop a device's samples (it left the job)."""
        self._tracks.pop(device, None)

    def speeds(self) -> dict[Hashable, float]:
        """device -> lower median of its window, for devices with ``min_samples`` usable
        samples of the newest plan version."""
        return {dev: statistics.median_low(t.window) for dev, t in self._tracks.items()
                if t.version == self._newest and len(t.window) >= self.min_samples}

    def relative(self, devices: Optional[Iterable[Hashable]] = None,
                 others: Iterable[Hashable] = ()) -> dict[Hashable, float]:
        """``speeds()`` over the fastest of them (1.0); with ``devices``, only those, and
        nothing unless every one of them has a speed; ``others`` (idle devices, measured by
        their probes) are scaled by the same reference and never are it."""
        speeds = self.speeds()
        extra = {d: speeds[d] for d in others if d in speeds}
        if devices is not None:
            wanted = list(dict.fromkeys(devices))
            if not wanted or any(d not in speeds for d in wanted):
                return {}
            speeds = {d: speeds[d] for d in wanted}
        if not speeds:
            return {}
        shares = {d: self._tracks[d].predicted_s for d in speeds}
        largest = max(shares.values())
        reference = max(s for d, s in speeds.items() if shares[d] >= RELIABLE_SHARE * largest)
        return {d: (1.0 if s >= reference else s / reference)
                for d, s in {**speeds, **extra}.items()}


@dataclass(frozen=True)
class StragglerPolicy:
    """The straggler rule's knobs: the gain is counted over ``horizon_s`` and must beat the
    switch cost by ``margin``; speed-driven switches are ``dwell_s`` apart at least; a speed
    changes by ``min_rel_change`` (relative) and more than one ``quantum`` to count, and is
    planned for rounded to a multiple of ``quantum``, at least ``floor``."""

    horizon_s: float = 60.0
    margin: float = 1.5
    dwell_s: float = 30.0
    min_rel_change: float = 0.2
    quantum: float = 0.125
    floor: float = 0.0625

    def __post_init__(self) -> None:
        for name in ("horizon_s", "margin", "dwell_s", "min_rel_change", "quantum", "floor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"StragglerPolicy: {name}={value!r} must be a finite number "
                                 ">= 0")
        for name in ("horizon_s", "quantum", "floor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StragglerPolicy: {name}={getattr(self, name)!r} must be > 0")

    def quantise(self, speed: float) -> float:
        """``speed`` rounded to the nearest multiple of ``quantum``, at least ``floor``."""
        if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed={speed!r} must be a finite number > 0")
        return max(self.floor, round(speed / self.quantum) * self.quantum)

    def changed(self, assumed: Mapping[Hashable, float],
                measured: Mapping[Hashable, float]) -> dict[Hashable, float]:
        """device -> quantised measured speed, for the measured devices whose speed changed
        from the assumed one (1.0 where ``assumed`` says nothing); see the module docstring.
        A measured speed that is not a positive finite number is no measurement."""
        out = {}
        for dev, speed in measured.items():
            if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
                continue
            was = assumed.get(dev, 1.0)
            q = self.quantise(speed)
            if abs(speed - was) <= self.quantum or q == was:
                continue
            if abs(q - was) >= self.min_rel_change * was:
                out[dev] = q
        return out

    def differs(self, assumed: Mapping[Hashable, float],
                measured: Mapping[Hashable, float]) -> bool:
        """Whether some device's measured speed changed (``changed``); cheap, no cost model."""
        return bool(self.changed(assumed, measured))


@dataclass(frozen=True)
class SpeedDecision:
    """The straggler rule's verdict: replan for ``speeds`` or not, with its numbers."""

    replan: bool
    speeds: dict  # device -> speed the next plan is for (the assumed ones when not replanning)
    gain_s: float  # predicted time saved over the horizon (0 when not computed)
    cost_s: float  # predicted cost of the switch
    reason: str


def _fmt_speeds(assumed: Mapping, measured: Mapping, changed: Mapping) -> str:
    parts = []
    for dev in sorted(changed, key=str):
        parts.append(f"{dev} {assumed.get(dev, 1.0):.3g}->{changed[dev]:.3g} "
                     f"(measured {measured[dev]:.3g})")
    return ", ".join(parts)


def decide_speeds(policy: StragglerPolicy, now: float, last_speed_switch_at: float,
                  assumed: Mapping[Hashable, float], measured: Mapping[Hashable, float],
                  step_now_s: float, step_new_s: float, switch_cost_s: float) -> SpeedDecision:
    """The straggler rule (see the module docstring). ``now`` and ``last_speed_switch_at`` are
    seconds on one clock (``-inf``: never switched); ``step_now_s`` / ``step_new_s``: the
    predicted step times of the current and of the best plan at the measured speeds;
    ``switch_cost_s``: the predicted cost of the switch."""
    for name, value in (("now", now), ("switch_cost_s", switch_cost_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"decide_speeds: {name}={value!r} must be a finite number")
    if switch_cost_s < 0:
        raise ValueError(f"decide_speeds: switch_cost_s={switch_cost_s!r} must be >= 0")
    if not isinstance(last_speed_switch_at, (int, float)) or math.isnan(last_speed_switch_at):
        raise ValueError(f"decide_speeds: last_speed_switch_at={last_speed_switch_at!r} must "
                         "be a number (-inf: never)")
    keep = dict(assumed)
    cost = float(switch_cost_s)
    changed = policy.changed(assumed, measured)
    if not changed:
        return SpeedDecision(False, keep, 0.0, cost,
                             f"no device's measured speed differs from the plan's by more "
                             f"than {policy.quantum:g} and {policy.min_rel_change:.0%}")
    what = _fmt_speeds(assumed, measured, changed)
    since = now - last_speed_switch_at
    if since < policy.dwell_s:
        return SpeedDecision(False, keep, 0.0, cost,
                             f"speeds {what}; wait: {since:.1f} s since the last speed-driven "
                             f"switch < dwell {policy.dwell_s:g} s")
    if not (isinstance(step_now_s, (int, float)) and isinstance(step_new_s, (int, float))
            and math.isfinite(step_now_s) and math.isfinite(step_new_s) and step_new_s > 0):
        return SpeedDecision(False, keep, 0.0, cost,
                             f"speeds {what}; no prediction (step {step_now_s!r} s now, "
                             f"{step_new_s!r} s new)")
    gain = max(0.0, step_now_s - step_new_s) * policy.horizon_s / step_new_s
    need = policy.margin * cost
    numbers = (f"predicted step {step_now_s:.4g} s -> {step_new_s:.4g} s, gain {gain:.3g} s "
               f"over {policy.horizon_s:g} s vs switch cost {cost:.3g} s x {policy.margin:g}")
    if not gain > need:
        return SpeedDecision(False, keep, gain, cost, f"speeds {what}; {numbers}: keep the plan")
    new = dict(assumed)
    new.update(changed)
    return SpeedDecision(True, new, gain, cost, f"speeds {what}; {numbers}: replan")
