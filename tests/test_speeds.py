"""Measured speeds and the straggler rule (``launcher.leader.speeds``): pure, property-tested.

The estimator's median ignores outliers and warm-up steps after a switch; the rule replans for a
real slowdown whose predicted gain beats the switch cost, never for noise within one quantum,
never for a gain below the margin, gives a recovered device its work back, and an alternately
throttled device causes at most one speed-driven switch per dwell period.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.leader.speeds import (RELIABLE_SHARE, BusySample, SpeedEstimator, StragglerPolicy,
                                    decide_speeds)

pytestmark = pytest.mark.timeout(300)

POLICY = StragglerPolicy()
GRID = [k * POLICY.quantum for k in range(1, 9)]  # the speeds a plan is made for: 1/8 .. 1


def _toy_step(assumed: dict, true: dict) -> float:
    """A toy cost model: the plan for ``assumed`` gives each device work in proportion to its
    assumed speed; the step is the slowest device's share over its true speed."""
    total = sum(assumed.get(d, 1.0) for d in true)
    return max(assumed.get(d, 1.0) / total / s for d, s in true.items())


def _predict(assumed: dict, measured: dict) -> tuple[float, float]:
    return _toy_step(assumed, measured), _toy_step(measured, measured)


# ---- the estimator -------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.integers(3, 12), st.floats(0.05, 4.0), st.data())
def test_median_ignores_up_to_half_minus_one_outliers(window, value, data):
    est = SpeedEstimator(window=window, skip_after_switch=0, min_samples=3)
    outliers = data.draw(st.lists(st.floats(1e-4, 1e4), max_size=(window - 1) // 2))
    ratios = outliers + [value] * (window - len(outliers))
    ratios = data.draw(st.permutations(ratios))
    for step, r in enumerate(ratios):
        assert est.add(BusySample("n0:0", 1, step, 1.0, r))
    assert est.speeds() == {"n0:0": value}


@settings(max_examples=100, deadline=None)
@given(st.integers(3, 10), st.floats(0.1, 2.0), st.floats(0.0, 0.05), st.data())
def test_median_of_noisy_samples_stays_within_the_noise(window, value, noise, data):
    est = SpeedEstimator(window=window, skip_after_switch=0, min_samples=3)
    bad = data.draw(st.integers(0, (window - 1) // 2))
    for step in range(window):
        r = 1e3 if step < bad else value * (1 + data.draw(st.floats(-noise, noise)))
        est.add(BusySample("d", 1, step, 1.0, r))
    got = est.speeds()["d"]
    assert value * (1 - noise) - 1e-12 <= got <= value * (1 + noise) + 1e-12


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), st.integers(0, 3), st.data())
def test_warm_up_steps_after_a_switch_never_count(lengths, skip, data):
    """Per plan version, ``skip`` warm-up samples (wildly fast) then ordinary ones in [0.5, 1]:
    the speed is never a warm-up value, and it exists exactly when the newest version has
    ``min_samples`` ordinary samples."""
    est = SpeedEstimator(window=8, skip_after_switch=skip, min_samples=3)
    step = 0
    for version, n in enumerate(lengths, start=1):
        for i in range(skip + n):
            warm = i < skip
            r = 1000.0 if warm else data.draw(st.floats(0.5, 1.0))
            counted = est.add(BusySample("d", version, step, 1.0, r))
            assert counted == (not warm)
            step += 1
    speeds = est.speeds()
    newest = [n for n in lengths if skip + n > 0]  # a version with no sample is never seen
    if newest and newest[-1] >= 3:
        assert 0.5 <= speeds["d"] <= 1.0
    else:
        assert speeds == {}


def test_a_new_plan_version_resets_the_window_and_stale_samples_are_ignored():
    est = SpeedEstimator(window=4, skip_after_switch=1, min_samples=2)
    for step in range(6):
        est.add(BusySample("a", 1, step, 1.0, 0.25))
        est.add(BusySample("b", 1, step, 1.0, 1.0))
    assert est.speeds() == {"a": 0.25, "b": 1.0}
    assert est.relative() == {"a": 0.25, "b": 1.0}
    # "a" switches to version 2: warm-up, then two samples; its old window is gone.
    for step in range(6, 9):
        est.add(BusySample("a", 2, step, 2.0, 1.0))
    assert not est.add(BusySample("a", 1, 20, 1.0, 0.25))  # an older version: ignored
    # "b" has not reported in version 2 yet: left out, and relative() over both says nothing.
    assert est.speeds() == {"a": 0.5}
    assert est.relative(["a", "b"]) == {}
    for step in range(6, 9):
        est.add(BusySample("b", 2, step, 1.0, 1.0))
    assert est.relative(["a", "b"]) == {"a": 0.5, "b": 1.0}
    est.forget("a")
    assert est.speeds() == {"b": 1.0}


@pytest.mark.parametrize("busy, predicted", [(math.nan, 1.0), (1.0, math.nan), (0.0, 1.0),
                                             (-1.0, 1.0), (1.0, -2.0), (math.inf, 1.0),
                                             (1.0, math.inf), (1e-320, 1e300), ("x", 1.0)])
def test_malformed_samples_are_ignored(busy, predicted):
    est = SpeedEstimator(window=3, skip_after_switch=0, min_samples=1)
    assert not est.add(BusySample("d", 1, 0, busy, predicted))
    assert est.speeds() == {}
    assert est.add(BusySample("d", 1, 1, 2.0, 1.0))
    assert not est.add(BusySample("d", 1, 1, 2.0, 1.0))  # the same step again
    assert est.speeds() == {"d": 0.5}


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(skip_after_switch=-1),
                                    dict(min_samples=0), dict(window=2, min_samples=3),
                                    dict(window=2.5), dict(window=True)])
def test_bad_estimator_settings_are_one_line_errors(kwargs):
    with pytest.raises(ValueError) as err:
        SpeedEstimator(**kwargs)
    assert "\n" not in str(err.value) and "SpeedEstimator" in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(horizon_s=0), dict(margin=-1), dict(dwell_s=math.nan),
                                    dict(quantum=0), dict(floor=math.inf),
                                    dict(min_rel_change="x")])
def test_bad_policy_settings_are_one_line_errors(kwargs):
    with pytest.raises(ValueError) as err:
        StragglerPolicy(**kwargs)
    assert "\n" not in str(err.value)
    assert next(iter(kwargs)) in str(err.value)


# ---- the rule ------------------------------------------------------------------------------

def test_quantise_rounds_to_the_quantum_with_a_floor():
    assert POLICY.quantise(0.49) == 0.5
    assert POLICY.quantise(0.26) == 0.25
    assert POLICY.quantise(0.01) == 0.0625
    assert POLICY.quantise(1.0) == 1.0
    with pytest.raises(ValueError, match="speed=nan"):
        POLICY.quantise(math.nan)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(GRID),
                       min_size=1),
       st.data())
def test_noise_within_one_quantum_never_replans(assumed, data):
    measured = {}
    for dev, speed in assumed.items():
        noise = data.draw(st.floats(-POLICY.quantum, POLICY.quantum))
        measured[dev] = max(1e-3, speed + noise)
    now = data.draw(st.floats(0, 1e6))
    step_now = data.draw(st.floats(1e-3, 1e3))
    step_new = data.draw(st.floats(1e-3, 1e3))
    assert not POLICY.differs(assumed, measured)
    decision = decide_speeds(POLICY, now, -math.inf, assumed, measured, step_now, step_new, 0.0)
    assert not decision.replan
    assert decision.speeds == assumed


def test_a_real_slowdown_with_a_big_gain_replans():
    assumed = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}
    measured = {"a": 1.0, "b": 0.97, "c": 1.0, "d": 0.26}
    now_s, new_s = _predict(assumed, measured)
    decision = decide_speeds(POLICY, 100.0, -math.inf, assumed, measured, now_s, new_s, 2.0)
    assert decision.replan
    assert decision.speeds == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.25}  # b's noise: kept
    assert decision.gain_s == pytest.approx((now_s - new_s) * POLICY.horizon_s / new_s,
                                            rel=1e-12)
    assert decision.gain_s > POLICY.margin * 2.0
    assert decision.cost_s == 2.0
    assert "\n" not in decision.reason
    for text in ("d 1->0.25", "measured 0.26", "replan", f"{decision.gain_s:.3g}"):
        assert text in decision.reason


def test_a_gain_below_margin_times_cost_does_not_replan():
    assumed = {"a": 1.0, "b": 1.0}
    measured = {"a": 1.0, "b": 0.5}
    now_s, new_s = _predict(assumed, measured)
    gain = (now_s - new_s) * POLICY.horizon_s / new_s
    cost = gain / POLICY.margin * 1.01  # just too expensive
    decision = decide_speeds(POLICY, 100.0, -math.inf, assumed, measured, now_s, new_s, cost)
    assert not decision.replan and decision.speeds == assumed
    assert decision.gain_s == pytest.approx(gain, rel=1e-12)
    assert "keep the plan" in decision.reason
    cheaper = decide_speeds(POLICY, 100.0, -math.inf, assumed, measured, now_s, new_s,
                            gain / POLICY.margin * 0.99)
    assert cheaper.replan and cheaper.speeds == {"a": 1.0, "b": 0.5}


def test_a_small_relative_change_or_the_dwell_holds_the_plan():
    assumed = {"a": 1.0, "b": 1.0}
    small = {"a": 1.0, "b": 0.85}  # beyond one quantum, but 0.875 is < 20 % off
    decision = decide_speeds(POLICY, 100.0, -math.inf, assumed, small, *_predict(assumed, small),
                             0.0)
    assert not decision.replan
    big = {"a": 1.0, "b": 0.25}
    held = decide_speeds(POLICY, 100.0, 100.0 - POLICY.dwell_s + 1, assumed, big,
                         *_predict(assumed, big), 0.0)
    assert not held.replan and "dwell" in held.reason
    done = decide_speeds(POLICY, 100.0, 100.0 - POLICY.dwell_s, assumed, big,
                         *_predict(assumed, big), 0.0)
    assert done.replan


def test_no_prediction_never_replans():
    assumed, measured = {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 0.25}
    for now_s, new_s in ((math.inf, math.inf), (1.0, math.nan), (1.0, 0.0)):
        decision = decide_speeds(POLICY, 0.0, -math.inf, assumed, measured, now_s, new_s, 1.0)
        assert not decision.replan and "no prediction" in decision.reason
    with pytest.raises(ValueError, match="switch_cost_s=-1"):
        decide_speeds(POLICY, 0.0, -math.inf, assumed, measured, 1.0, 1.0, -1)
    with pytest.raises(ValueError, match="now=nan"):
        decide_speeds(POLICY, math.nan, -math.inf, assumed, measured, 1.0, 1.0, 1)


def test_recovery_gets_the_work_back_by_the_same_rule():
    assumed = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.25}
    measured = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.98}
    now_s, new_s = _predict(assumed, measured)
    decision = decide_speeds(POLICY, 500.0, 0.0, assumed, measured, now_s, new_s, 2.0)
    assert decision.replan and decision.speeds["d"] == 1.0
    assert "d 0.25->1" in decision.reason
    # Within the dwell of the switch that slowed it, the recovery waits.
    assert not decide_speeds(POLICY, 10.0, 0.0, assumed, measured, now_s, new_s, 2.0).replan


# ---- the whole loop: an alternately throttled worker ---------------------------------------

def _simulate(flip_s: float, duration_s: float, seed: int, cost_s: float = 2.0,
              jitter: float = 0.03) -> list[float]:
    """The leader's loop, once a second: each of 4 workers (half a core each; ``d`` flips
    between half and an eighth of a core every ``flip_s`` seconds) reports one step's busy
    time; the estimator's relative speeds go through ``decide_speeds``; a replan makes a new
    plan version for the decision's speeds. Returns the times of the switches."""
    rng = random.Random(seed)
    est = SpeedEstimator()
    assumed = {d: 1.0 for d in "abcd"}
    version, last, switches = 1, -math.inf, []
    for t in range(int(duration_s)):
        true = {"a": 0.5, "b": 0.5, "c": 0.5,
                "d": 0.5 if int(t // flip_s) % 2 == 0 else 0.125}
        total = sum(assumed.values())
        for dev, speed in true.items():
            predicted = assumed[dev] / total  # its share at nominal speed (1.0)
            busy = predicted / speed * (1 + rng.uniform(-jitter, jitter))
            est.add(BusySample(dev, version, t, busy, predicted))
        measured = est.relative("abcd")
        if not measured or not POLICY.differs(assumed, measured):
            continue
        decision = decide_speeds(POLICY, float(t), last, assumed, measured,
                                 *_predict(assumed, measured), cost_s)
        if decision.replan:
            assumed, last, version = dict(decision.speeds), float(t), version + 1
            switches.append(float(t))
    return switches


@settings(max_examples=25, deadline=None)
@given(st.floats(1.0, 45.0), st.integers(0, 2 ** 16))
def test_an_alternately_throttled_worker_switches_at_most_once_per_dwell(flip_s, seed):
    switches = _simulate(flip_s, 1200.0, seed)
    for before, after in zip(switches, switches[1:]):
        assert after - before >= POLICY.dwell_s
    assert len(switches) <= 1200.0 / POLICY.dwell_s + 1


def test_a_slow_flip_is_followed_and_a_fast_one_is_damped():
    slow = _simulate(120.0, 1200.0, seed=1)
    # every throttle and every recovery is followed, once each
    assert 8 <= len(slow) <= 10
    fast = _simulate(3.0, 1200.0, seed=2)
    for before, after in zip(fast, fast[1:]):
        assert after - before >= POLICY.dwell_s


def _fed(samples: dict) -> SpeedEstimator:
    """device -> (predicted_s, ratio) for three usable steps of plan 1."""
    est = SpeedEstimator(window=4, skip_after_switch=0, min_samples=3)
    for step in range(3):
        for dev, (predicted, ratio) in samples.items():
            est.add(BusySample(dev, 1, step, predicted / ratio, predicted))
    return est


def test_a_device_with_a_small_share_is_no_reference_for_the_others():
    """A worker back at full speed while it holds 2 rows of 64 reads fast (its busy time is
    mostly the cost per step, which the calibration got wrong): the others stay at 1.0 and it
    is an equal, not the reference that makes them look twice as slow."""
    est = _fed({"a": (0.2, 0.5), "b": (0.2, 0.52), "c": (0.19, 0.5), "d": (0.02, 1.0)})
    rel = est.relative()
    assert rel["d"] == 1.0 and rel["b"] == 1.0
    assert rel["a"] == pytest.approx(0.5 / 0.52, rel=1e-12)
    assert rel["c"] == pytest.approx(0.5 / 0.52, rel=1e-12)
    # a slow device with an equal share is still slow, and a slow small one stays slow
    assert _fed({"a": (0.2, 1.0), "b": (0.2, 0.25)}).relative()["b"] == 0.25
    assert _fed({"a": (0.2, 1.0), "d": (0.02, 0.25)}).relative()["d"] == 0.25


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"),
                       st.tuples(st.floats(1e-3, 1.0), st.floats(0.05, 4.0)), min_size=1))
def test_relative_speeds_are_in_0_1_and_the_reference_is_1(samples):
    rel = _fed(samples).relative()
    assert set(rel) == set(samples) and all(0 < v <= 1.0 for v in rel.values())
    largest = max(p for p, _r in samples.values())
    reliable = [d for d, (p, _r) in samples.items() if p >= RELIABLE_SHARE * largest]
    assert any(rel[d] == 1.0 for d in reliable)


def test_the_share_picks_the_reference_not_the_prediction_with_its_costs_per_step():
    """A recovered worker with 2 rows of 64 whose prediction is mostly an overestimated cost
    per step (0.18 of the others' 0.2) reads three times as fast as the others; its share of
    the work (without that cost) is small, so it is no reference."""
    est = SpeedEstimator(window=4, skip_after_switch=0, min_samples=3)
    for step in range(3):
        for dev, predicted, share, ratio in (("a", 0.2, 0.15, 0.33), ("b", 0.2, 0.15, 0.31),
                                             ("d", 0.18, 0.015, 1.0)):
            est.add(BusySample(dev, 1, step, predicted / ratio, predicted, share))
    rel = est.relative()
    assert rel == {"a": 1.0, "b": pytest.approx(0.31 / 0.33, rel=1e-12), "d": 1.0}
    without = SpeedEstimator(window=4, skip_after_switch=0, min_samples=3)
    for step in range(3):
        for dev, predicted, ratio in (("a", 0.2, 0.33), ("d", 0.18, 1.0)):
            without.add(BusySample(dev, 1, step, predicted / ratio, predicted))
    # the prediction alone: d leads
    assert without.relative()["a"] == pytest.approx(0.33, rel=1e-12)
