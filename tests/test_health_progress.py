"""HangDetector: the hang rule on a fake clock (no sleeps)."""

from __future__ import annotations

import pytest

from launcher.health.api import HealthConfigError
from launcher.health.progress import HangDetector
from _clock import FakeClock


def detector(clock, **kw):
    kw.setdefault("multiple", 5.0)
    kw.setdefault("min_timeout_s", 10.0)
    kw.setdefault("startup_grace_s", 300.0)
    return HangDetector(clock=clock, **kw)


def run_steps(det, clock, workers, steps, step_s):
    for _ in range(steps):
        clock.t += step_s
        for w in workers:
            step = (det._workers[w].step or 0) + 1 if w in det._workers else 0
            det.heartbeat(w, step)


def test_startup_grace_before_first_step():
    clock = FakeClock()
    det = detector(clock)
    det.heartbeat("r0", 0)
    clock.t = 299
    assert det.hung() == []
    clock.t = 301
    (hang,) = det.hung()
    assert hang.worker == "r0" and hang.starting and hang.limit_s == 300
    assert "before its first step" in hang.reason()


def test_hang_after_multiple_of_recent_step_time():
    clock = FakeClock()
    det = detector(clock)
    run_steps(det, clock, ["r0", "r1"], steps=10, step_s=4.0)
    assert det.step_time() == pytest.approx(4.0)
    assert det.limit(starting=False) == pytest.approx(20.0)
    # r1 keeps going, r0 freezes.
    t_freeze = clock.t
    for _ in range(6):
        clock.t += 4.0
        det.heartbeat("r1", det._workers["r1"].step + 1)
        det.heartbeat("r0", det._workers["r0"].step)  # alive but no progress
    hangs = det.hung()
    assert [h.worker for h in hangs] == ["r0"]
    assert hangs[0].since == t_freeze and hangs[0].stalled_s == pytest.approx(24.0)
    verdict = hangs[0].verdict()
    assert verdict.is_failed and "no progress for 24.0s (limit 20.0s)" in verdict.reason


def test_floor_applies_to_fast_steps():
    clock = FakeClock()
    det = detector(clock)
    run_steps(det, clock, ["r0"], steps=20, step_s=0.1)
    assert det.limit(starting=False) == 10.0
    clock.t += 9.9
    assert det.hung() == []
    clock.t += 0.2
    assert len(det.hung()) == 1


def test_warmup_interval_is_not_part_of_the_estimate():
    clock = FakeClock()
    det = detector(clock)
    det.heartbeat("r0", 0)
    clock.t += 200  # compilation
    det.heartbeat("r0", 1)
    assert det.step_time() is None
    clock.t += 250  # no estimate yet: still the start-up grace
    assert det.hung() == []
    det.heartbeat("r0", 2)
    assert det.step_time() == pytest.approx(250)


def test_estimate_is_a_median_over_a_window():
    clock = FakeClock()
    det = detector(clock, window=5)
    run_steps(det, clock, ["r0"], steps=3, step_s=2.0)
    clock.t += 100  # one stray slow step
    det.heartbeat("r0", det._workers["r0"].step + 1)
    run_steps(det, clock, ["r0"], steps=2, step_s=2.0)
    assert det.step_time() == 2.0
    run_steps(det, clock, ["r0"], steps=5, step_s=3.0)
    assert det.step_time() == 3.0


def test_multi_step_jumps_count_per_step():
    clock = FakeClock()
    det = detector(clock)
    det.heartbeat("r0", 0)
    clock.t += 1
    det.heartbeat("r0", 1)
    clock.t += 10
    det.heartbeat("r0", 6)
    assert det.step_time() == pytest.approx(2.0)


def test_restart_and_reset_give_a_new_grace():
    clock = FakeClock()
    det = detector(clock)
    run_steps(det, clock, ["r0", "r1"], steps=5, step_s=1.0)
    det.heartbeat("r0", 2)  # resumed from an earlier step: a new start
    clock.t += 15
    assert [h.worker for h in det.hung()] == ["r1"]
    det.reset(t=clock.t)  # plan switch: everyone gets the start-up grace
    clock.t += 100
    assert det.hung() == []
    det.forget("r1")
    clock.t += 300
    assert [h.worker for h in det.hung()] == ["r0"]


def test_bad_settings_are_named():
    with pytest.raises(HealthConfigError, match="multiple must be > 0, got 0"):
        HangDetector(multiple=0)
    with pytest.raises(HealthConfigError, match="window must be >= 1"):
        HangDetector(window=0)
