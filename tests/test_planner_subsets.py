"""Leaving devices out: the search lays out subsets of the usable devices (``planner.subsets``)
and leaves a device idle when its per-step fixed costs outweigh its work, saying why
(``Estimate.idle``); ``use_all_devices`` still forces every device in; the uniform baseline is
the best uniform plan over any prefix of the devices by speed. Pure planner tests: no
processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from click.testing import CliRunner

from hspmd_elastic.planner import (BUILTIN_SPECS, Device, Inventory, ModelProfile, PlannerOptions,
                                   estimate_plan, inventory_from_nodes, plan_for,
                                   spec_for_device, uniform_inventory)
from hspmd_elastic.planner.explain import explain, result_to_dict
from hspmd_elastic.planner.subsets import (MAX_PER_FAMILY, best_uniform, subsets,
                                           uniform_subsets)
from launcher.leader.planning import RedundantPlanner, UniformPlanner
from launcher.plan_cmd import plan_command

pytestmark = pytest.mark.timeout(120)

PROFILE = ModelProfile("small", num_layers=4, hidden_size=64, ffn_size=256, num_heads=4,
                       vocab_size=256, seq_len=32)
BATCH = 32
MIX = (0.5, 0.5, 0.125, 0.125)  # of a core: the measured case of two fast, two slow workers
EVERY = PlannerOptions(use_all_devices=True)


def _inventory(speeds, update: float = 1e-7, host_links: bool = True) -> Inventory:
    """CPU workers at ``speeds`` of a core, one per node; ``update``: seconds per parameter
    element per step at full speed (the optimizer update of the whole replica);
    ``host_links``: collectives on the worker's own CPU share (gloo), else at the link's
    speed whatever the device's (a GPU's NCCL)."""
    cpu = replace(BUILTIN_SPECS["CPU"], update_s_per_param=update, host_links=host_links)
    return Inventory(tuple(
        Device(i, f"n{i}", spec_for_device("CPU", 256 << 20, types={"CPU": cpu}, speed=s))
        for i, s in enumerate(speeds)))


def _rows(plan) -> list[int]:
    return [p.rows for p in plan.pipelines]


def test_slow_devices_whose_update_outweighs_their_rows_are_left_out():
    inv = _inventory(MIX)
    result = plan_for(inv, PROFILE, BATCH)
    every = plan_for(inv, PROFILE, BATCH, options=EVERY)
    assert set(result.plan.devices) == {0, 1}, result.plan
    assert result.estimate.unused_devices == (2, 3)
    assert sum(_rows(result.plan)) == BATCH
    # the cost model agrees: the plan without them is faster than the best plan with them all
    assert result.estimate.step_time_s < every.estimate.step_time_s
    assert math.isfinite(result.estimate.step_time_s)


def test_use_all_devices_still_gives_every_device_a_role():
    inv = _inventory(MIX)
    every = plan_for(inv, PROFILE, BATCH, options=EVERY)
    assert set(every.plan.devices) == {0, 1, 2, 3}, every.plan
    assert every.estimate.unused_devices == () and every.estimate.idle == ()


@pytest.mark.parametrize("update", [0.0, 1e-7])
def test_equal_devices_that_pay_are_all_used(update):
    inv = _inventory((1.0,) * 4, update)
    result = plan_for(inv, PROFILE, BATCH)
    assert set(result.plan.devices) == {0, 1, 2, 3}, result.plan
    assert result.estimate.unused_devices == () and result.estimate.idle == ()
    assert result.plan == plan_for(inv, PROFILE, BATCH, options=EVERY).plan


def test_the_idle_reason_has_consistent_numbers():
    inv = _inventory(MIX)
    result = plan_for(inv, PROFILE, BATCH)
    every = plan_for(inv, PROFILE, BATCH, options=EVERY)
    est = result.estimate
    assert [d.id for d in est.idle] == list(est.unused_devices) == [2, 3]
    for dev in est.idle:
        assert dev.speed == pytest.approx(0.25)  # 0.125 of a core against 0.5
        assert dev.step_time_without_s == est.step_time_s
        # the best plan giving it work is no slower than the best giving every device work
        assert dev.step_time_with_s <= every.estimate.step_time_s * (1 + 1e-12)
        assert dev.step_time_with_s > dev.step_time_without_s
        assert dev.reason == (f"device {dev.id} idle: at 0.25x the fastest device's speed the "
                              f"best plan using it takes {dev.step_time_with_s:.4g} s/step vs "
                              f"{dev.step_time_without_s:.4g} s without")
    text = explain(result)
    for dev in est.idle:
        assert dev.reason in text
    doc = result_to_dict(result)["chosen"]["estimate"]["idle"]
    assert [d["id"] for d in doc] == [2, 3] and doc[0]["reason"] == est.idle[0].reason


def test_uniform_baseline_takes_the_fast_pair_not_every_device_at_the_weakest():
    inv = _inventory(MIX)
    uniform = UniformPlanner(plan_for)(inv, PROFILE, BATCH)
    assert set(uniform.plan.devices) == {0, 1}, uniform.plan
    assert len(set(_rows(uniform.plan))) == 1 and sum(_rows(uniform.plan)) == BATCH
    assert uniform.estimate.unused_devices == (2, 3)
    assert [d.id for d in uniform.estimate.idle] == [2, 3]
    # every device at the weakest speed (the old baseline) predicts a slower step, on the
    # uniform devices and on the devices as they are
    old = plan_for(uniform_inventory(inv), PROFILE, BATCH, options=EVERY)
    assert uniform.estimate.step_time_s < old.estimate.step_time_s
    assert estimate_plan(uniform.plan, inv, PROFILE).step_time_s < \
        estimate_plan(old.plan, inv, PROFILE).step_time_s
    with_all = UniformPlanner(plan_for)(inv, PROFILE, BATCH, options=EVERY)
    assert set(with_all.plan.devices) == {0, 1, 2, 3}


def test_uniform_baseline_over_equal_devices_is_the_plain_uniform_plan():
    inv = _inventory((1.0,) * 4)
    assert len(uniform_subsets(inv)) == 1
    assert UniformPlanner(plan_for)(inv, PROFILE, BATCH).plan == \
        plan_for(uniform_inventory(inv), PROFILE, BATCH).plan


def test_uniform_baseline_resets_a_redundancy_shortfall_once_a_prefix_has_a_plan():
    inv = _inventory(MIX)
    inner = RedundantPlanner(plan_for, 1)
    inner.shortfall = "left over from an earlier search"
    UniformPlanner(inner)(inv, PROFILE, BATCH)
    assert inner.shortfall == ""


def test_the_subsets_are_prefixes_by_speed_and_bounded():
    inv = _inventory(MIX)
    found = subsets(inv.usable)
    assert found[0] == (0, inv.usable)
    kept = [tuple(d.id for d in devs) for _, devs in found]
    assert len(set(kept)) == len(kept)
    assert (0, 1) in kept and (0, 1, 2) in kept and (0,) in kept  # k = 2 (the tier), 1, 3
    big = inventory_from_nodes(",".join(["8xH800"] * 64 + ["8xH20"] * 64)).with_health(
        slowdown={9: 2.0, 700: 1.5})
    many = subsets(big.usable)
    assert len(many) <= 1 + 2 * MAX_PER_FAMILY + 3 * MAX_PER_FAMILY
    for _, devs in many[1:]:
        assert 0 < len(devs) < len(big.usable)
    # dropping all H20s (a tier's edge) is among them; so is dropping only the degraded H800
    sizes = {len(devs) for _, devs in many}
    assert 512 in sizes and 1023 in sizes


def test_best_uniform_raises_the_whole_inventorys_error_when_nothing_fits():
    from hspmd_elastic.planner import PlanInfeasibleError

    tiny = Inventory(tuple(replace(d, spec=replace(d.spec, memory_bytes=1 << 10))
                           for d in _inventory(MIX).devices))
    with pytest.raises(PlanInfeasibleError, match="needs"):
        best_uniform(plan_for, tiny, PROFILE, BATCH)


def _mix_file(tmp_path) -> str:
    path = tmp_path / "mix.json"
    x = {"peak_tflops": 0.005, "memory_gib": 0.25, "intra_node_gbps": 2.0,
         "inter_node_gbps": 0.5, "mfu": 1.0, "microbatch_overhead_s": 0.008,
         "link_latency_s": 0.002, "update_s_per_param": 2e-7}
    devices = [{"id": i, "node": f"n{i}", "type": "X", "slowdown": s}
               for i, s in enumerate((1.0, 1.0, 4.0, 4.0))]
    path.write_text(json.dumps({"types": {"X": x}, "devices": devices}))
    model = tmp_path / "small.json"
    model.write_text(json.dumps({"name": "small", "num_layers": 4, "hidden_size": 64,
                                 "ffn_size": 256, "num_heads": 4, "vocab_size": 256,
                                 "seq_len": 32}))
    return str(path), str(model)


def test_plan_prints_the_idle_devices_and_why(tmp_path):
    devices, model = _mix_file(tmp_path)
    args = ["--devices", devices, "--model", model, "--global-batch", str(BATCH)]
    res = CliRunner().invoke(plan_command, args)
    assert res.exit_code == 0, res.output
    assert "idle usable devices: 2-3" in res.output
    assert "devices 2-3 idle: at 0.25x the fastest device's speed the best plan using it " \
        "takes" in res.output
    doc = json.loads(CliRunner().invoke(plan_command, [*args, "--json"]).output)
    assert [d["id"] for d in doc["chosen"]["estimate"]["idle"]] == [2, 3]
    every = CliRunner().invoke(plan_command, [*args, "--all-devices"])
    assert every.exit_code == 0 and "idle usable devices" not in every.output
    uniform = CliRunner().invoke(plan_command, [*args, "--uniform"])
    assert uniform.exit_code == 0, uniform.output
    assert "idle usable devices: 2-3" in uniform.output
    assert "devices 2-3 idle:" in uniform.output


def test_all_devices_flag_reaches_the_settings_and_forces_every_worker_in(tmp_path):
    from hspmd_elastic.graph.config import ModelConfig
    from launcher.api import ConfigError
    from launcher.cli import build_config, launch_command
    from launcher.leader.planning import AllDevicesPlanner

    model, script = tmp_path / "m.json", tmp_path / "t.py"
    model.write_text(ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2,
                                 ffn_size=32, seq_len=8).to_json())
    script.write_text("")
    base = ["--standalone", "--hspmd-elastic", "--hspmd-model", str(model),
            "--hspmd-global-batch", "8"]

    def settings(*flags):
        ctx = launch_command.make_context("hspmd-launch", [*base, *flags, str(script)])
        return build_config(ctx.params).elastic

    assert settings().all_devices is False
    assert settings("--hspmd-all-devices", "on").all_devices is True
    with pytest.raises(ConfigError) as err:
        settings("--hspmd-all-devices", "maybe")
    assert str(err.value) == "invalid --hspmd-all-devices value 'maybe': use on or off"
    inv = _inventory(MIX)
    forced = AllDevicesPlanner(plan_for)(inv, PROFILE, BATCH, options=PlannerOptions())
    assert set(forced.plan.devices) == {0, 1, 2, 3}
    uniform = AllDevicesPlanner(UniformPlanner(plan_for))(inv, PROFILE, BATCH)
    assert set(uniform.plan.devices) == {0, 1, 2, 3}


def test_the_leader_leaves_a_cpu_worker_idle_and_logs_why(caplog):
    """No role is forced on CPU workers any more: a worker whose fixed costs outweigh its work
    is left out of the published layout, and the leader's log names it with the numbers."""
    import logging

    from launcher.leader import build_snapshot, decide, default_planner_options, make_layout
    from launcher.node.elastic.devices import device_table, node_record

    nodes = {n: node_record(f"h-{n}", device_table(n, 2), "ready", 0.0,
                            store_endpoint="127.0.0.1:1", pid=1) for n in ("a", "b")}
    tiny = ModelProfile("tiny", num_layers=2, hidden_size=16, ffn_size=32, num_heads=2,
                        vocab_size=32, seq_len=8)  # fixed costs dominate its step
    decision = decide(build_snapshot(nodes, {}, "a"), None)
    assert not default_planner_options(decision.devices).use_all_devices
    with caplog.at_level(logging.INFO, logger="launcher.leader.planning"):
        layout = make_layout(decision, None, plan_for, tiny, 4)
    idle = sorted({"a:0", "a:1", "b:0", "b:1"} - set(layout.devices))
    assert idle and layout.planner == "plan_for"
    lines = [r.getMessage() for r in caplog.records if " idle: at " in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"plan v{decision.version}: device"), lines
    assert all(name in lines[0] for name in idle) and "s/step vs" in lines[0], lines


def test_with_uneven_optimizer_shards_the_slow_devices_pay_for_their_rows_and_stay():
    """The same mix, collectives at the link's speed: a slow device left out for its
    whole-replica update is worth its rows once it updates only its rows' share
    (``--hspmd-optimizer-shards uneven``, ``zero_cost``)."""
    inv = _inventory(MIX, host_links=False)
    replicated = plan_for(inv, PROFILE, BATCH)
    uneven = plan_for(inv, PROFILE, BATCH,
                      options=PlannerOptions(optimizer_shards="uneven"))
    assert set(replicated.plan.devices) == {0, 1}
    assert set(uneven.plan.devices) == {0, 1, 2, 3}, uneven.plan
    rows = {p.stages[0].devices[0]: p.rows for p in uneven.plan.pipelines}
    assert min(rows[0], rows[1]) > max(rows[2], rows[3]) >= 1
    assert uneven.estimate.step_time_s < replicated.estimate.step_time_s


def test_on_host_bound_links_the_slow_devices_stay_idle_even_with_uneven_shards():
    """The same mix on CPU workers (``DeviceSpec.host_links``): their gradient collectives run
    on their own CPU share, so a worker at 0.125 of a core slows every all-reduce it joins by
    its speed, whatever its rows; the uneven shards do not pay for that, and the plan keeps
    the two fast workers (what ``scripts/bench_hetero`` (d) measured)."""
    inv = _inventory(MIX)
    uneven = plan_for(inv, PROFILE, BATCH, options=PlannerOptions(optimizer_shards="uneven"))
    assert set(uneven.plan.devices) == {0, 1}, uneven.plan
    off_host = plan_for(_inventory(MIX, host_links=False), PROFILE, BATCH,
                        options=PlannerOptions(optimizer_shards="uneven"))
    assert set(off_host.plan.devices) == {0, 1, 2, 3}, off_host.plan
    every = plan_for(inv, PROFILE, BATCH,
                     options=PlannerOptions(optimizer_shards="uneven", use_all_devices=True))
    assert uneven.estimate.step_time_s < every.estimate.step_time_s
