"""The plan each length bucket runs under inside a step (``planner.bucket_layouts``): pure.

``spread_rows`` keeps every pipeline of the home layout and splits rows by weight; a bucket gets
its own plan only when that plan covers the home plan's devices and its estimate plus the switch
beats the home layout's; otherwise the home layout (no switch). Bad input is one line.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import (Device, Health, Inventory, PlannerError, PlannerOptions,
                                   parse_lengths, plan_for, spec_for_device)
from hspmd_elastic.planner.bucket_layouts import bucket_layouts, spread_rows, switch_seconds
from hspmd_elastic.planner.buckets import bucket_rows
from hspmd_elastic.planner.profiles import profile_from_config

pytestmark = pytest.mark.timeout(120)

TINY = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                   seq_len=8, dtype="float64")
PROFILE = profile_from_config(TINY, "tiny")
OPTIONS = PlannerOptions(use_all_devices=True)


def inventory(n: int, kib: int) -> Inventory:
    spec = spec_for_device("CPU", kib * 1024)
    return Inventory(tuple(Device(i, "n", spec, Health.HEALTHY) for i in range(n)))


def layout(plan: Plan) -> tuple:
    return tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines)


# ---------------------------------------------------------------------------- spread_rows
@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=1,
                        max_size=5),
       rows=st.integers(1, 64))
def test_spread_rows_keeps_every_pipeline_and_splits_by_weight(weights, rows):
    pipes = tuple(Pipeline((Stage((i,), (0, 2)),), m, b) for i, (m, b) in enumerate(weights))
    plan = Plan(pipes, sum(p.rows for p in pipes), 2)
    got = spread_rows(plan, rows)
    if rows < len(pipes):
        assert got is None
        return
    assert layout(got) == layout(plan) and got.global_batch == rows
    total = sum(p.rows for p in pipes)
    for old, new in zip(plan.pipelines, got.pipelines):
        assert new.rows >= 1 and new.microbatch_size <= old.microbatch_size
        # by weight, after the one row each: floor or ceiling of the exact share, plus one
        exact = (rows - len(pipes)) * old.rows / total
        assert math.floor(exact) + 1 <= new.rows <= math.ceil(exact) + 1


# ---------------------------------------------------------------------------- bucket_layouts
def test_a_bucket_whose_rows_do_not_fit_the_home_layout_gets_its_own_plan():
    inv = inventory(4, 340)  # a replica per device; a long row's activations do not fit beside
    home = plan_for(inv, PROFILE, 8, options=OPTIONS).plan
    assert len(home.pipelines) == 4  # DP4
    got = bucket_layouts(inv, PROFILE, home, parse_lengths("3:0.75,8:0.25"), OPTIONS)
    assert [(b.window, b.start, b.plan.global_batch) for b in got] == [(3, 0, 6), (8, 6, 2)]
    short, long_ = got
    assert not short.own and layout(short.plan) == layout(home) and short.switch_s == 0.0
    assert long_.own and layout(long_.plan) != layout(home)
    assert long_.plan.devices == home.devices and math.isinf(long_.home_s)
    assert long_.switch_s == switch_seconds(inv, PROFILE, home) > 0


def test_a_switch_that_costs_more_than_it_saves_is_skipped():
    inv = inventory(3, 260)  # home: TP2+1 pipeline; the short bucket's own plan is DP3
    home = plan_for(inv, PROFILE, 6, options=OPTIONS).plan
    cheap = bucket_layouts(inv, PROFILE, home, parse_lengths("3:0.5,8:0.5"), OPTIONS)
    assert cheap[0].own and cheap[0].step_s + cheap[0].switch_s < cheap[0].home_s
    # the same cluster behind a link a million times slower: the switch no longer pays
    slow = Inventory(tuple(replace(d, spec=replace(d.spec, intra_node_gbps=d.spec.intra_node_gbps
                                                   * 1e-6)) for d in inv.devices))
    skipped = bucket_layouts(slow, PROFILE, home, parse_lengths("3:0.5,8:0.5"), OPTIONS)
    assert not skipped[0].own and layout(skipped[0].plan) == layout(home)


def test_bucket_rows_tile_the_global_batch():
    inv = inventory(2, 4096)
    home = plan_for(inv, PROFILE, 10, options=OPTIONS).plan
    got = bucket_layouts(inv, PROFILE, home, parse_lengths("2:0.3,5:0.3,8:0.4"), OPTIONS)
    assert [b.plan.global_batch for b in got] == list(bucket_rows([0.3, 0.3, 0.4], 10))
    assert [b.start for b in got] == [0, 3, 6]
    assert all(b.plan.devices == home.devices for b in got)


@pytest.mark.parametrize("lengths, named", [
    ("3:0.5,6:0.5", "longest bucket (6 tokens) is not the model's seq_len 8"),
    ("8:0.5,3:0.5", "3"),
])
def test_bad_buckets_are_one_line(lengths, named):
    inv = inventory(2, 4096)
    home = plan_for(inv, PROFILE, 8, options=OPTIONS).plan
    with pytest.raises(PlannerError) as err:
        bucket_layouts(inv, PROFILE, home, parse_lengths(lengths) if lengths[0] != "8"
                       else [parse_lengths("8:1")[0], parse_lengths("3:1")[0]], OPTIONS)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_bucket_plan_may_leave_a_slow_device_idle():
    """Without use_all_devices, the short bucket's own plan may skip a device that would pace
    it; it is still taken (a subset of the home plan's devices), when it pays."""
    spec = spec_for_device("CPU", 4096 * 1024)
    slow = replace(spec, name="CPU")
    inv = Inventory(tuple(Device(i, "n", spec if i < 3 else slow, Health.HEALTHY,
                                 1.0 if i < 3 else 20.0) for i in range(4)))
    opts = PlannerOptions(use_all_devices=False)
    home = Plan(tuple(Pipeline((Stage((i,), (0, 2)),), 1, 2) for i in range(4)), 8, 2)
    got = bucket_layouts(inv, PROFILE, home, parse_lengths("3:0.5,8:0.5"), opts)
    assert all(set(b.plan.devices) <= set(home.devices) for b in got)
    assert any(3 not in b.plan.devices for b in got if b.own), [b.plan for b in got]
