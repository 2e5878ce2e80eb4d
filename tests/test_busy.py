"""A rank's busy time per step (``hspmd_elastic.elastic.busy``), and that a real elastic worker
reports it to its agent's record (``workers/<node>/<local_rank>.busy_s``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.elastic.busy import BusyMeter

pytestmark = pytest.mark.timeout(120)


def test_busy_is_the_step_minus_its_waits_median_of_the_plans_recent_steps():
    meter = BusyMeter(window=4, skip=2, min_steps=2)
    meter.add(1, 9.0, 0.0)  # warm-up steps after the switch into v1: left out
    meter.add(1, 9.0, 0.0)
    meter.add(1, 1.0, 0.25)
    assert meter.busy_s == 0.0 and meter.steps == 1  # not measured yet
    meter.add(1, 1.5, 0.5)
    assert meter.busy_s == pytest.approx(0.875)
    for wall in (5.0, 1.0, 1.0):  # one step slowed by a one-off does not move the median
        meter.add(1, wall, 0.0)
    assert meter.busy_s == pytest.approx(1.0)
    meter.add(2, 0.1, 0.0)  # a new plan: a new window, its warm-up left out
    assert meter.busy_s == 0.0 and meter.steps == 0


def test_bad_times_are_ignored_and_bad_settings_are_one_line():
    meter = BusyMeter(window=3, skip=0, min_steps=1)
    for wall, waited in ((math.nan, 0.0), (1.0, math.inf), (-1.0, 0.0), (1.0, -0.1)):
        meter.add(1, wall, waited)
    assert meter.steps == 0
    meter.add(1, 0.5, 0.9)  # waited longer than the wall clock says: no negative busy time
    assert meter.busy_s == 0.0 and meter.steps == 1
    with pytest.raises(ValueError, match=r"BusyMeter\(window=0"):
        BusyMeter(window=0)


def test_a_busy_time_measured_elsewhere_goes_through_the_same_window():
    """``add_busy`` (the CUDA timer's figures) skips, windows and ignores as ``add`` does."""
    meter = BusyMeter(window=3, skip=1, min_steps=1)
    meter.add_busy(1, 9.0)  # warm-up
    for busy in (math.nan, -1.0, math.inf):
        meter.add_busy(1, busy)
    assert meter.steps == 0
    meter.add_busy(1, 0.5)
    meter.add(1, 2.0, 0.5)
    assert meter.busy_s == pytest.approx(1.0) and meter.steps == 2
    meter.add_busy(2, 0.1)
    assert meter.steps == 0


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(st.lists(st.floats(0.0, 10.0), min_size=3, max_size=30), st.integers(0, 4))
def test_the_median_ignores_a_minority_of_outliers(busy, outliers):
    window = len(busy)
    meter = BusyMeter(window=window + outliers, skip=0, min_steps=1)
    for b in busy:
        meter.add(7, b, 0.0)
    outliers = min(outliers, (window - 1) // 2)
    for _ in range(outliers):
        meter.add(7, 1e6, 0.0)
    assert min(busy) <= meter.busy_s <= max(busy)
