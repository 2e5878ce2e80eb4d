"""The cost model's per-step cost per parameter element (``DeviceSpec.update_s_per_param``):
every built-in type has none, so every earlier prediction stands; with it, a pipeline's time
gains its slowest stage's update, the exact layer split minimises it (against brute force),
and the plan search gives a slow device fewer rows, the plan it picks then being faster under
that model than the one picked without it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from hspmd_elastic.planner import (BUILTIN_SPECS, Device, Inventory, ModelProfile, PlannerError,
                                   PlannerOptions, estimate_plan, inventory_from_dict, plan_for,
                                   spec_for_device, uniform_inventory)
from hspmd_elastic.planner.cost import stage_params
from hspmd_elastic.planner.solve import pipeline_layers

pytestmark = pytest.mark.timeout(120)

PROFILE = ModelProfile("small", num_layers=8, hidden_size=256, ffn_size=1024, num_heads=8,
                       vocab_size=1024, seq_len=128)
CPU = replace(BUILTIN_SPECS["CPU"], update_s_per_param=2e-7)


def test_no_built_in_type_has_one_and_the_declared_speed_scales_it():
    assert all(s.update_s_per_param == 0.0 for s in BUILTIN_SPECS.values())
    half = spec_for_device("CPU", types={"CPU": CPU}, speed=0.5)
    assert half.update_s_per_param == pytest.approx(4e-7)
    inv = inventory_from_dict({"types": {"X": {"peak_tflops": 1, "memory_gib": 8,
                                               "intra_node_gbps": 1, "inter_node_gbps": 1,
                                               "update_s_per_param": 3e-9}}, "nodes": "2xX"})
    assert inv.devices[0].spec.update_s_per_param == 3e-9
    with pytest.raises(PlannerError, match="update_s_per_param=-1"):
        replace(CPU, update_s_per_param=-1.0)
    mixed = Inventory((Device(0, "n", CPU), Device(1, "n", CPU, slowdown=4.0)))
    assert uniform_inventory(mixed).devices[0].spec.update_s_per_param == pytest.approx(8e-7)


@pytest.mark.parametrize("plan", [
    simple_plan(dp=2, num_layers=8, global_batch=8, num_microbatches=2),
    simple_plan(pp=2, num_layers=8, global_batch=8, num_microbatches=4),
    simple_plan(tp=2, dp=2, num_layers=8, global_batch=8, num_microbatches=1),
    Plan((Pipeline((Stage((0,), (0, 6)), Stage((1, 2), (6, 8))), 4, 1),
          Pipeline((Stage((3,), (0, 8)),), 1, 2)), 6, 8)])
def test_a_pipeline_gains_its_slowest_stages_update(plan):
    slow = {1: 2.0}
    base = Inventory(tuple(Device(i, "n", BUILTIN_SPECS["CPU"], slowdown=slow.get(i, 1.0))
                           for i in range(4)))
    with_it = Inventory(tuple(replace(d, spec=CPU) for d in base.devices))
    old, new = estimate_plan(plan, base, PROFILE), estimate_plan(plan, with_it, PROFILE)
    assert new.stage_times_s == old.stage_times_s
    assert new.bubble_fraction == pytest.approx(old.bubble_fraction)
    for pi, pipe in enumerate(plan.pipelines):
        n = len(pipe.stages)
        update = max(CPU.update_s_per_param * max(slow.get(d, 1.0) for d in s.devices)
                     * stage_params(PROFILE, s.layers[1] - s.layers[0], si == 0, si == n - 1)
                     / s.tp for si, s in enumerate(pipe.stages))
        assert new.pipeline_times_s[pi] == pytest.approx(old.pipeline_times_s[pi] + update,
                                                         rel=1e-12)
    assert new.step_time_s == pytest.approx(max(new.pipeline_times_s) + new.grad_sync_s)


def _rows(plan: Plan) -> dict[int, int]:
    return {p.stages[0].devices[0]: p.num_microbatches * p.microbatch_size
            for p in plan.pipelines}


def test_the_search_gives_a_slow_device_fewer_rows_with_it():
    """Three workers at half a core, one at an eighth: a per-step update that does not shrink
    with the rows costs the slow one four times as much, so it gets fewer rows."""
    def inventory(spec):
        return Inventory(tuple(Device(i, "n", spec_for_device("CPU", types={"CPU": spec},
                                                              speed=s))
                               for i, s in enumerate((0.5, 0.5, 0.5, 0.125))))

    options = PlannerOptions(tp_degrees=(1,), pp_degrees=(1,))
    old = plan_for(inventory(BUILTIN_SPECS["CPU"]), PROFILE, 64, options=options).plan
    new = plan_for(inventory(CPU), PROFILE, 64, options=options).plan
    assert _rows(new).get(3, 0) < _rows(old)[3]
    truth = inventory(CPU)
    assert estimate_plan(new, truth, PROFILE).step_time_s < \
        estimate_plan(old, truth, PROFILE).step_time_s


_coef = st.floats(min_value=0.1, max_value=10.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pipeline_layers_with_updates_is_optimal(data):
    n = data.draw(st.integers(2, 4))
    total = data.draw(st.integers(n, 9))
    fixed, per, ufixed, uper = ([data.draw(_coef) for _ in range(n)] for _ in range(4))
    caps = [data.draw(st.integers(1, total)) for _ in range(n)]
    m = data.draw(st.integers(1, 8))

    def time(layers):
        times = [f + c * l for f, c, l in zip(fixed, per, layers)]
        return sum(times) + (m - 1) * max(times) + max(
            f + c * l for f, c, l in zip(ufixed, uper, layers))

    options = [c for c in itertools.product(*(range(1, c + 1) for c in caps))
               if sum(c) == total]
    got = pipeline_layers(fixed, per, caps, total, m, ufixed, uper)
    if not options:
        assert got is None
        return
    assert sum(got) == total and all(1 <= l <= c for l, c in zip(got, caps))
    assert time(got) <= min(map(time, options)) * (1 + 1e-6)
