"""``--hspmd-planner uniform`` and ``hspmd-launch plan --uniform``: the best uniform SPMD plan
(one TP/PP everywhere, even layers and rows), the baseline heterogeneous plans are measured
against."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _elastic_job import TINY
from hspmd_elastic.planner import (Health, Inventory, PlannerOptions, estimate_plan, plan_for,
                                   profile_from_config, spec_for_device, uniform_inventory)
from hspmd_elastic.planner.api import Device
from launcher.leader.planning import UniformPlanner

pytestmark = pytest.mark.timeout(120)
BATCH = 16


def _inventory(speeds, failed=()) -> Inventory:
    return Inventory(tuple(
        Device(i, f"n{i}", spec_for_device("CPU", 64 << 20, speed=s),
               Health.FAILED if i in failed else Health.HEALTHY)
        for i, s in enumerate(speeds)))


def _rows(plan) -> list[int]:
    return [p.rows for p in plan.pipelines]


def test_uniform_inventory_makes_every_live_device_the_weakest():
    inv = _inventory([1.0, 1.0, 0.25, 0.25], failed=(1,))
    uni = uniform_inventory(inv)
    live = [d for d in uni.devices if d.health is not Health.FAILED]
    assert [d.id for d in live] == [0, 2, 3] and uni.devices[1] == inv.devices[1]
    assert len({d.spec for d in live}) == 1 and all(d.slowdown == 1.0 for d in live)
    assert live[0].spec.peak_tflops == pytest.approx(inv.devices[2].spec.peak_tflops)


def test_the_uniform_plan_splits_evenly_where_the_hetero_plan_follows_speed():
    profile = profile_from_config(TINY)
    inv = _inventory([1.0, 1.0, 0.25, 0.25])
    # every device, data parallel only (``--hspmd-all-devices on``): the rows are what differs
    every = PlannerOptions(use_all_devices=True, tp_degrees=(1,), pp_degrees=(1,))
    hetero = plan_for(inv, profile, BATCH, options=every).plan
    uniform = UniformPlanner(plan_for)(inv, profile, BATCH, options=every).plan
    assert len(set(_rows(uniform))) == 1 and sum(_rows(uniform)) == BATCH, _rows(uniform)
    assert len(set(_rows(hetero))) > 1, _rows(hetero)  # the fast devices get more rows
    # on these devices the cost model prefers the plan that follows their speeds
    assert estimate_plan(hetero, inv, profile).step_time_s < \
        estimate_plan(uniform, inv, profile).step_time_s


def test_plan_uniform_shows_its_step_time_on_the_real_devices():
    args = [sys.executable, "-m", "launcher.plan_cmd", "--devices", "2xH800,2xH20",
            "--model", "llama-7b", "--uniform"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "uniform plan on these devices: step" in out.stdout
    doc = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True,
                                    timeout=120).stdout)
    assert doc["uniform"]["step_time_s"] > 0


@pytest.mark.parametrize("flag, value, message", [
    ("--hspmd-planner", "spmd", "invalid --hspmd-planner value 'spmd': use hetero or uniform"),
    ("--hspmd-straggler-replans", "maybe",
     "invalid --hspmd-straggler-replans value 'maybe': use on or off"),
])
def test_bad_planner_flags_are_one_line(flag, value, message, tmp_path):
    from launcher.api import ConfigError
    from launcher.cli import build_config, launch_command

    model, script = tmp_path / "m.json", tmp_path / "train.py"
    model.write_text(TINY.to_json())
    script.write_text("")
    ctx = launch_command.make_context("hspmd-launch", [
        "--standalone", "--hspmd-elastic", "--hspmd-model", str(model),
        "--hspmd-global-batch", "8", flag, value, str(script)])
    with pytest.raises(ConfigError) as err:
        build_config(ctx.params)
    assert str(err.value) == message


def test_planner_flags_reach_the_settings(tmp_path):
    from launcher.cli import build_config, launch_command

    model, script = tmp_path / "m.json", tmp_path / "t.py"
    model.write_text(TINY.to_json())
    script.write_text("")
    base = ["--standalone", "--hspmd-elastic", "--hspmd-model", str(model),
            "--hspmd-global-batch", "8"]
    cfg = build_config(launch_command.make_context("hspmd-launch", [*base, str(script)]).params)
    assert (cfg.elastic.planner, cfg.elastic.straggler_replans) == ("hetero", True)
    cfg = build_config(launch_command.make_context("hspmd-launch", [
        *base, "--hspmd-planner", "uniform", "--hspmd-straggler-replans", "off",
        str(script)]).params)
    assert (cfg.elastic.planner, cfg.elastic.straggler_replans) == ("uniform", False)


def test_the_uniform_plan_keeps_one_tp_and_pp_degree_where_the_search_would_mix_them():
    """Three equal devices: the search over them may lay out TP 2 beside TP 1 (what it did
    for the bench's model), which uniform SPMD cannot run; the uniform planner plans each
    degree pair alone and keeps one (``subsets.degrees``)."""
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner.subsets import degrees

    profile = profile_from_config(ModelConfig(vocab_size=64, hidden_size=256, num_heads=4,
                                              num_layers=2, ffn_size=1024, seq_len=32))
    inv = Inventory(tuple(Device(i, "n", spec_for_device("CPU", None)) for i in range(3)))
    every = PlannerOptions(use_all_devices=True, optimizer_shards="uneven")
    mixed = plan_for(inv, profile, 64, options=every).plan
    assert len(degrees(mixed)) > 1, mixed  # the search alone mixes them here
    uniform = UniformPlanner(plan_for)(inv, profile, 64, options=every).plan
    assert degrees(uniform) == {(1, 1)} and sorted(_rows(uniform)) == [21, 21, 22], uniform
