"""Declared device capacity and the redundancy guarantee, from the flags to the planner.

Pure parts only (no etcd, no process): ``--hspmd-device-memory`` / ``--hspmd-device-speed`` /
``--hspmd-redundancy`` parsing and their one-line errors; the agent's device table and the
leader's inventory built from declared capacity (a model that does not fit the declared memory
is sharded); ``PlannerOptions.redundancy`` as a hard constraint (no plan breaking it, a
``RedundancyError`` naming the shortfall) checked per TP shard; ``RedundantPlanner`` and the
agent's judge ending the job on a shortfall; a ``ModelConfig`` JSON recognised by its keys.
The end-to-end path (real agents, etcd and workers) is ``tests/test_elastic_hspmd.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from _elastic_job import TINY

from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import (BUILTIN_SPECS, Device, Inventory, PlannerError,
                                   PlannerOptions, RedundancyError, estimate_plan, fmt_bytes,
                                   layout_line, parse_bytes, plan_for, profile_from_config,
                                   profile_from_dict, spec_for_device)
from launcher.leader import PlanningFailed, RedundantPlanner, build_snapshot, decide, make_layout
from launcher.node.elastic.devices import device_table
from launcher.node.elastic.judge import JobView, judge
from hspmd_elastic.contract import schema

pytestmark = pytest.mark.timeout(60)

SCRIPT = str(Path(__file__).parent / "scripts" / "sleeper.py")

CONFIG = TINY
PROFILE = profile_from_config(CONFIG)
KiB = 1 << 10


def inventory(nodes: int, per_node: int, memory: int, failed=()) -> Inventory:
    spec = replace(BUILTIN_SPECS["CPU"], memory_bytes=memory)
    inv = Inventory(tuple(Device(i, f"node{i // per_node}", spec)
                          for i in range(nodes * per_node)))
    return inv.with_health(failed=tuple(failed))


def specialization(plan: Plan) -> list:
    """Per pipeline, per stage: (TP degree, layer range); what a switch must reshard."""
    return sorted(tuple((s.tp, s.layers) for s in p.stages) for p in plan.pipelines)


# ---- flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, size", [("24MiB", 24 << 20), ("1.5 GiB", 3 << 29),
                                        ("512kib", 512 << 10), (".5MiB", 512 << 10)])
def test_sizes_take_kib_mib_gib(text, size):
    assert parse_bytes(text) == size
    assert fmt_bytes(size) in ("24.0 MiB", "1.5 GiB", "512.0 KiB")


@pytest.mark.parametrize("text", ["24MB", "24", "x", "-3MiB", "0KiB", "1e3MiB", ""])
def test_bad_sizes_name_the_value(text):
    with pytest.raises(PlannerError, match=repr(text)):
        parse_bytes(text)


def _build(args, tmp_path):
    from launcher.cli import build_config, launch_command

    model = tmp_path / "m.json"
    model.write_text(CONFIG.to_json())
    ctx = launch_command.make_context("hspmd-launch", [
        "--hspmd-elastic", "--hspmd-model", str(model), "--hspmd-global-batch", "4", *args,
        SCRIPT])
    return build_config(ctx.params)


def test_capacity_flags_reach_the_elastic_settings(tmp_path):
    elastic = _build(["--nnodes", "2", "--hspmd-device-memory", "150KiB",
                      "--hspmd-device-speed", "0.5", "--hspmd-redundancy", "2"], tmp_path).elastic
    assert (elastic.device_memory_bytes, elastic.device_speed, elastic.redundancy) == \
        (150 * KiB, 0.5, 2)
    plain = _build([], tmp_path).elastic
    assert (plain.device_memory_bytes, plain.device_speed, plain.redundancy) == (0, 1.0, 0)
    buckets = _build(["--hspmd-lengths", f"4:0.75,{CONFIG.seq_len}:0.25"], tmp_path).elastic
    assert buckets.lengths == ((4, 0.75), (CONFIG.seq_len, 0.25)) and plain.lengths == ()
    types = tmp_path / "types.json"
    types.write_text('{"CPU": {"peak_tflops": 0.075, "microbatch_overhead_s": 0.08}}')
    measured = _build(["--hspmd-device-types", str(types)], tmp_path).elastic
    (cpu,) = measured.device_types
    builtin = BUILTIN_SPECS["CPU"]
    assert (cpu.name, cpu.peak_tflops, cpu.microbatch_overhead_s) == ("CPU", 0.075, 0.08)
    # a known type keeps the fields the file does not give, host-bound links included
    assert replace(cpu, peak_tflops=builtin.peak_tflops,
                   microbatch_overhead_s=builtin.microbatch_overhead_s) == builtin
    assert plain.device_types == ()


def test_measured_device_types_change_what_the_leader_plans(tmp_path):
    """The constants a job measured (``--hspmd-device-types``) are the ones its planner uses:
    with this machine's fixed cost per step at 80 ms a core, two workers at 0.125 of a core
    cost the step more than their rows return and are left idle; with the built-in 4 ms they
    get rows."""
    from hspmd_elastic.planner import device_types_from_dict

    from hspmd_elastic.graph.config import ModelConfig

    profile = profile_from_config(ModelConfig(vocab_size=64, hidden_size=256, num_heads=4,
                                              num_layers=2, ffn_size=1024, seq_len=32))

    def plan(types):
        inv = Inventory(tuple(Device(i, "n", spec_for_device("CPU", None, types=types, speed=s))
                              for i, s in enumerate((0.5, 0.5, 0.125, 0.125))))
        return plan_for(inv, profile, 64).plan

    measured = device_types_from_dict({"CPU": {"peak_tflops": 0.075,
                                               "microbatch_overhead_s": 0.08}})
    assert set(plan(measured).devices) == {0, 1}
    assert set(plan(None).devices) == {0, 1, 2, 3}


@pytest.mark.parametrize("args, message", [
    (["--hspmd-device-memory", "24MB"],
     "invalid --hspmd-device-memory value '24MB': use a size with a unit, KiB, MiB or GiB"),
    (["--hspmd-device-speed", "fast"], "invalid --hspmd-device-speed value 'fast'"),
    (["--hspmd-device-speed", "-1"], "invalid --hspmd-device-speed value '-1'"),
    (["--hspmd-redundancy", "0"], "invalid --hspmd-redundancy value '0': must be an integer"),
    (["--nnodes", "1:2", "--hspmd-redundancy", "3"],
     "invalid --hspmd-redundancy value '3': the job has at most 2 nodes"),
    (["--hspmd-lengths", "64:0.9,16:0.1"], "invalid --hspmd-lengths value '64:0.9,16:0.1'"),
    (["--hspmd-lengths", "8:0.5,16:0.4"], "invalid --hspmd-lengths value '8:0.5,16:0.4': "
                                          "the shares sum to 0.9, not 1"),
    (["--hspmd-device-types", "/nonexistent/types.json"],
     "invalid --hspmd-device-types value '/nonexistent/types.json': No such file or directory"),
    (["--hspmd-lengths", f"4:0.5,{CONFIG.seq_len * 2}:0.5"],
     f"the longest bucket ({CONFIG.seq_len * 2} tokens) must be the model's sequence length "
     f"{CONFIG.seq_len}"),
])
def test_bad_capacity_flags_get_one_line(args, message, tmp_path, capsys):
    from launcher.cli import main

    model = tmp_path / "m.json"
    model.write_text(CONFIG.to_json())
    code = main(["--hspmd-elastic", "--hspmd-model", str(model), "--hspmd-global-batch", "4",
                 *args, SCRIPT])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("hspmd-launch: error: ") and message in err[0], err


def test_capacity_flags_need_elastic_mode(capsys):
    from launcher.cli import main

    assert main(["--hspmd-device-memory", "24MiB", SCRIPT]) == 2
    assert "--hspmd-device-memory 24MiB is only used with --hspmd-elastic" in \
        capsys.readouterr().err


# ---- from the node's record to the planner's inventory ------------------------------------

def test_declared_memory_and_speed_reach_the_inventory_and_force_sharding():
    devices = device_table("a", 3, memory_bytes=150 * KiB, speed=0.5)
    assert {(d.memory_bytes, d.speed) for d in devices} == {(150 * KiB, 0.5)}
    rec = schema.NodeRecord(host="h", agent_pid=1, devices=devices, state="ready",
                            started_at=0.0, store_endpoint="h:1")
    assert schema.decode(schema.node_key("j", "a"), schema.encode(rec)).devices == devices
    seen = []

    def planner(inventory, profile, global_batch, current_plan=None, options=None):
        seen.append(inventory)
        return plan_for(inventory, profile, global_batch, current_plan, options)

    d = decide(build_snapshot({"a": rec}, {}, "a"), None)
    layout = make_layout(d, None, planner, PROFILE, 4)
    spec = seen[0].devices[0].spec
    assert spec.memory_bytes == 150 * KiB and spec.name == "CPU@0.5"
    assert spec.peak_tflops == BUILTIN_SPECS["CPU"].peak_tflops * 0.5
    assert all(dev.health.value == "healthy" for dev in seen[0].devices)  # a capacity, not health
    # 150 KiB cannot hold a replica (about 235 KiB): the plan shards it with TP and/or PP.
    assert any(s.tp > 1 for p in layout.plan.pipelines for s in p.stages) or \
        any(len(p.stages) > 1 for p in layout.plan.pipelines)
    unbounded = make_layout(decide(build_snapshot(
        {"a": replace(rec, devices=device_table("a", 3))}, {}, "a"), None), None, plan_for,
        PROFILE, 4)
    assert all(len(p.stages) == 1 and p.stages[0].tp == 1 for p in unbounded.plan.pipelines)


def test_speed_scales_flops_and_fixed_costs():
    spec = spec_for_device("CPU", 1 << 20, speed=2.0)
    base = BUILTIN_SPECS["CPU"]
    assert spec.memory_bytes == 1 << 20 and spec.peak_tflops == 2 * base.peak_tflops
    assert spec.microbatch_overhead_s == base.microbatch_overhead_s / 2
    assert spec_for_device("CPU") == base
    with pytest.raises(PlannerError, match="speed=0"):
        spec_for_device("CPU", speed=0)


def test_a_worker_kill_forces_a_differently_specialized_plan():
    """2 nodes x 3 devices of 150 KiB: one sharded replica per node; a lost device forces
    another TP degree and layer split on its node, and both nodes keep a replica."""
    inv = inventory(2, 3, 150 * KiB)
    options = PlannerOptions(use_all_devices=True, cross_node_replicas=True)
    before = plan_for(inv, PROFILE, 4, options=options)
    after = plan_for(inv.with_health(failed=(5,)), PROFILE, 4, current_plan=before.plan,
                     options=options)
    assert specialization(before.plan) != specialization(after.plan)
    assert after.estimate.switch_bytes > 0 and after.estimate.replica_nodes == 2
    names = [f"node{i // 3}:{i % 3}" for i in range(6)]
    assert layout_line(before.plan, names).startswith("DP2: node0:0-1 tp2 L0 > node0:2 L1")


# ---- redundancy as a hard constraint ------------------------------------------------------

@pytest.mark.parametrize("nodes, per_node, memory, failed", [
    (2, 2, 200 * KiB, ()), (2, 3, 150 * KiB, (5,)), (3, 1, 1 << 20, (0,)), (2, 2, 1 << 20, (3,))])
def test_every_plan_keeps_every_slice_on_the_redundant_nodes(nodes, per_node, memory, failed):
    inv = inventory(nodes, per_node, memory, failed)
    result = plan_for(inv, PROFILE, 4, options=PlannerOptions(redundancy=2, alternatives=5))
    for cand in (result.chosen, *result.alternatives):
        assert cand.estimate.replica_nodes >= 2, cand.label
        layer_nodes = [{inv.by_id()[d].node for p in cand.plan.pipelines for s in p.stages
                        if s.layers[0] <= layer < s.layers[1] for d in s.devices}
                       for layer in range(PROFILE.num_layers)]
        assert all(len(n) >= 2 for n in layer_nodes), cand.label


@pytest.mark.parametrize("nodes, per_node, memory, failed, redundancy, message", [
    (1, 4, 200 * KiB, (), 2, r"redundancy 2 .*only 1 node \(node0\) has usable devices: "
                             r"short by 1 node$"),
    (2, 2, 200 * KiB, (), 3, r"only 2 nodes \(node0, node1\) have usable devices: short by 1"),
    (2, 2, 200 * KiB, (0,), 2, r"2 replicas of model config need 469\.0 KiB; the 3 usable "
                               r"devices on 2 nodes offer 414\.5 KiB, counting at most one "
                               r"replica per node: short by 54\.5 KiB"),
])
def test_no_plan_meets_the_redundancy_the_error_names_the_shortfall(
        nodes, per_node, memory, failed, redundancy, message):
    inv = inventory(nodes, per_node, memory, failed)
    assert plan_for(inv, PROFILE, 4).plan  # a plan exists without the guarantee
    with pytest.raises(RedundancyError, match=message) as info:
        plan_for(inv, PROFILE, 4, options=PlannerOptions(redundancy=redundancy))
    assert "\n" not in str(info.value)


def test_redundancy_is_counted_per_tp_shard():
    """A TP group split over two nodes holds each of its shards on one node only: two such
    groups cover a layer on both nodes, yet each shard may sit on one node alone."""
    inv = inventory(2, 2, 1 << 30)  # devices 0, 1 on node0; 2, 3 on node1
    split = Plan((Pipeline((Stage((0, 2), (0, 2)),), 1, 2),
                  Pipeline((Stage((1, 3), (0, 2)),), 1, 2)), 4, 2)
    assert estimate_plan(split, inv, PROFILE).replica_nodes == 1  # shard 0: devices 0, 1 (node0)
    skewed = Plan((Pipeline((Stage((0, 2), (0, 2)),), 1, 2),
                   Pipeline((Stage((3, 1), (0, 2)),), 1, 2)), 4, 2)
    assert estimate_plan(skewed, inv, PROFILE).replica_nodes == 2  # shard 0: devices 0 and 3
    alone = Plan((Pipeline((Stage((0, 2), (0, 2)),), 1, 4),), 4, 2)
    assert estimate_plan(alone, inv, PROFILE).replica_nodes == 1
    both = Plan((Pipeline((Stage((0,), (0, 2)),), 1, 2), Pipeline((Stage((2,), (0, 2)),), 1, 2)),
                4, 2)
    assert estimate_plan(both, inv, PROFILE).replica_nodes == 2
    with pytest.raises(PlannerError, match="redundancy=0"):
        PlannerOptions(redundancy=0)


def test_the_redundant_planner_keeps_the_guarantee_and_the_agent_fails_the_job():
    planner = RedundantPlanner(plan_for, 2)
    ok = planner(inventory(2, 2, 200 * KiB), PROFILE, 4,
                 options=PlannerOptions(use_all_devices=True))
    assert ok.estimate.replica_nodes >= 2 and planner.shortfall == ""
    with pytest.raises(RedundancyError):
        planner(inventory(2, 2, 200 * KiB, failed=(0,)), PROFILE, 4)
    assert planner.shortfall.startswith("redundancy 2 (every parameter slice on 2 nodes)")
    state, reason = judge(JobView(nodes=2, usable_devices=3, plan_shortfall=planner.shortfall))
    assert state == "failed" and reason.startswith("no plan keeps the redundancy guarantee: "
                                                   "redundancy 2") and "short by" in reason
    assert judge(JobView(nodes=2, usable_devices=3))[0] == "running"

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    rec = schema.NodeRecord(host="h", agent_pid=1, devices=device_table("a", 2), state="ready",
                            started_at=0.0, store_endpoint="h:1")
    d = decide(build_snapshot({"a": rec, "b": replace(rec)}, {}, "a"), None)
    assert make_layout(d, None, broken, PROFILE, 4).planner == "fallback-dp"
    with pytest.raises(PlanningFailed, match="no fallback plan under --hspmd-redundancy"):
        make_layout(d, None, RedundantPlanner(broken, 2), PROFILE, 4)


# ---- model JSON ----------------------------------------------------------------------------

def test_a_model_config_without_schema_is_recognised_by_its_keys():
    data = json.loads(CONFIG.to_json())
    data.pop("schema")
    profile = profile_from_dict(data)
    assert profile.config == CONFIG and profile.param_bytes == 8
    with pytest.raises(PlannerError, match=r"a ModelConfig, by its keys \['dtype', .*unknown "
                                           r"keys \['param_bytes'\]"):
        profile_from_dict(dict(data, param_bytes=2))
    with pytest.raises(PlannerError, match=r'unknown keys \[\'foo\'\].*"schema": 1'):
        profile_from_dict({"num_layers": 2, "foo": 1})


def test_the_plan_command_rehearses_declared_memory_and_redundancy(tmp_path):
    from click.testing import CliRunner

    from launcher.plan_cmd import plan_command

    model = tmp_path / "m.json"
    model.write_text(CONFIG.to_json())
    base = ["--model", str(model), "--devices", "3xCPU,3xCPU", "--global-batch", "4",
            "--device-memory", "150KiB", "--all-devices", "--redundancy", "2"]
    ok = CliRunner().invoke(plan_command, [*base, "--json"])
    assert ok.exit_code == 0, ok.output
    chosen = json.loads(ok.output)["chosen"]
    assert chosen["estimate"]["replica_nodes"] == 2
    assert max(chosen["estimate"]["memory_limit_bytes"].values()) == int(150 * KiB * 0.9)
    short = CliRunner().invoke(plan_command, [*base, "--fail", "node1:0,node1:1,node1:2"])
    assert short.exit_code == 1 and "only 1 node (node0) has usable devices" in short.output
    bad = CliRunner().invoke(plan_command, [*base, "--device-memory", "150KB"])
    assert bad.exit_code == 2 and "size '150KB'" in bad.output
