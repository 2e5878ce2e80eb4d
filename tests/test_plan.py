"""Plans: validation with one-line errors, JSON round trip, layouts and derived annotations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hspmd_elastic.annotations import TensorAnnotation
from hspmd_elastic.graph.config import ModelConfig, ModelConfigError, param_specs
from hspmd_elastic.plan import Pipeline, Plan, PlanError, Stage, simple_plan

CONFIG = ModelConfig()


def plan_of(pipelines, global_batch=8, num_layers=4) -> Plan:
    return Plan(tuple(Pipeline(tuple(Stage(tuple(d), l) for d, l in stages), n, s)
                      for n, s, stages in pipelines), global_batch, num_layers)


HETERO = [(3, 2, [((0, 1), (0, 3)), ((2, 3), (3, 4))]), (1, 2, [((4,), (0, 4))])]


def test_heterogeneous_plan_queries():
    plan = plan_of(HETERO)
    assert plan.devices == (0, 1, 2, 3, 4)
    assert plan.locate(3).pipeline == 0 and plan.locate(3).stage == 1 and plan.locate(3).tp_rank == 1
    assert plan.batch_rows(0) == (0, 6) and plan.batch_rows(1) == (6, 8)
    assert plan.microbatch_rows(0, 2) == (4, 6) and plan.microbatch_rows(1, 0) == (6, 8)
    assert plan.pipelines[0].stage_of_layer(3).devices == (2, 3)


@pytest.mark.parametrize("pipelines, global_batch, fragment", [
    ([(4, 2, [((0,), (0, 2)), ((1,), (3, 4))])], 8, "leave a gap: layers [2, 3)"),
    ([(4, 2, [((0,), (0, 3)), ((1,), (2, 4))])], 8, "overlap the previous stage, which ends at 3"),
    ([(4, 2, [((0,), (0, 3))])], 8, "layers [3, 4) are uncovered"),
    ([(4, 2, [((0,), (1, 4))])], 8, "layers [0, 1) are held by no stage"),
    ([(4, 2, [((0,), (0, 5))])], 8, "beyond num_layers=4"),
    ([(4, 2, [((0,), (2, 2)), ((1,), (2, 4))])], 8, "is empty"),
    ([(2, 2, [((0, 1), (0, 4))]), (2, 2, [((1,), (0, 4))])], 8,
     "device 1 is in two stages: pipeline 0 stage 0 and pipeline 1 stage 0"),
    ([(2, 2, [((0, 0), (0, 4))])], 4, "pipeline 0 stage 0 lists device(s) [0] more than once"),
    ([(3, 2, [((0,), (0, 4))]), (2, 2, [((1,), (0, 4))])], 8,
     "micro-batches sum to 10 rows (pipeline 0: 3x2, pipeline 1: 2x2), global_batch=8"),
    ([(0, 2, [((0,), (0, 4))])], 8, "pipeline 0 num_microbatches=0 must be a positive integer"),
    ([(4, 2, [((), (0, 4))])], 8, "has no devices"),
    ([(8, 1, [((-1,), (0, 4))])], 8, "device -1 must be >= 0"),
    ([(8, 1, [])], 8, "pipeline 0 has no stages"),
    ([], 8, "plan has no pipelines"),
])
def test_bad_plans_are_rejected_with_one_line_errors(pipelines, global_batch, fragment):
    with pytest.raises(PlanError) as info:
        plan_of(pipelines, global_batch)
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_plans_are_checked_without_torch():
    """Validation is pure: it runs (and rejects) before anything could create a process group."""
    code = ("import sys\n"
            "from hspmd_elastic.plan import Plan, PlanError\n"
            "try:\n"
            "    Plan.from_json(sys.argv[1])\n"
            "except PlanError as exc:\n"
            "    print(exc)\n"
            "assert 'torch' not in sys.modules\n")
    bad = json.loads(plan_of(HETERO).to_json())
    bad["global_batch"] = 9
    out = subprocess.run([sys.executable, "-c", code, json.dumps(bad)], capture_output=True,
                         text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("micro-batches sum to 8 rows (pipeline 0: 3x2, pipeline 1: 1x2), "
                          "global_batch=9\n")


def test_model_dependent_checks():
    plan_of(HETERO).check_model(CONFIG)
    with pytest.raises(PlanError, match="TP degree 3 does not divide num_heads=2"):
        plan_of([(4, 2, [((0, 1, 2), (0, 4))])]).check_model(CONFIG)
    with pytest.raises(PlanError, match="plan has num_layers=2, model has 4"):
        plan_of([(4, 2, [((0,), (0, 2))])], num_layers=2).check_model(CONFIG)
    wide = ModelConfig(num_heads=4, hidden_size=16, ffn_size=32, vocab_size=32)
    # TP 4 against TP 2: lcm 4 divides every split dimension.
    plan_of([(2, 2, [((0, 1, 2, 3), (0, 4))]), (2, 2, [((4, 5), (0, 4))])]).check_model(wide)


def test_model_config_errors_name_the_value():
    with pytest.raises(ModelConfigError, match="hidden_size=10 is not divisible by num_heads=3"):
        ModelConfig(hidden_size=10, num_heads=3)
    with pytest.raises(ModelConfigError, match="dtype='float16'"):
        ModelConfig(dtype="float16")
    assert ModelConfig.from_json(CONFIG.to_json()) == CONFIG


def test_json_round_trip_is_versioned():
    plan = plan_of(HETERO)
    data = json.loads(plan.to_json())
    assert data["schema"] == 1
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="schema=2"):
        Plan.from_dict(dict(data, schema=2))
    with pytest.raises(PlanError, match=r"unknown keys \['extra'\]"):
        Plan.from_dict(dict(data, extra=1))
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    bad = json.loads(plan.to_json())
    bad["pipelines"][0]["stages"][1]["layers"] = [4, 4]
    with pytest.raises(PlanError, match="is empty"):
        Plan.from_dict(bad)


def test_simple_plan_shapes():
    plan = simple_plan(dp=2, tp=2, pp=2, num_layers=4, global_batch=8, num_microbatches=2)
    assert [[s.devices for s in p.stages] for p in plan.pipelines] == [
        [(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert all(p.microbatch_size == 2 for p in plan.pipelines)
    with pytest.raises(PlanError, match="pp=3 does not divide num_layers=4"):
        simple_plan(pp=3, num_layers=4, global_batch=8)


def test_param_annotations_of_heterogeneous_plan():
    plan = plan_of(HETERO)
    anns = plan.param_annotations(CONFIG)
    assert set(anns) == set(param_specs(CONFIG))
    wq = anns["layers.3.attn.wq.weight"]
    assert [g.devices for g in wq.groups.groups] == [(2, 3), (4,)]
    assert wq.states.hdim == -1
    assert wq.local_slices(3, (16, 16)) == ((8, 16), (0, 16))
    assert wq.local_slices(4, (16, 16)) == ((0, 16), (0, 16))
    wo = anns["layers.0.attn.wo.weight"]
    assert wo.local_slices(1, (16, 16)) == ((0, 16), (8, 16))
    embed, head = anns["embed.weight"], anns["lm_head.weight"]
    assert [g.devices for g in embed.groups.groups] == [(0, 1), (4,)]
    assert [g.devices for g in head.groups.groups] == [(2, 3), (4,)]
    assert embed.local_slices(1, (32, 16)) == ((16, 32), (0, 16))
    norm = anns["layers.1.attn_norm.weight"]
    assert norm.local_slices(0, (16,)) == norm.local_slices(1, (16,)) == ((0, 16),)
    for ann in anns.values():
        assert TensorAnnotation.from_json(ann.to_json()) == ann
    step = plan.replicated_annotation()
    assert step.devices() == (0, 1, 2, 3, 4) and step.local_slices(2, ()) == ()
