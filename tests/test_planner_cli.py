"""``hspmd-launch plan``: what-if questions about a cluster, and usage errors for bad input."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from hspmd_elastic.plan import Plan
from launcher.plan_cmd import plan_command

PAPER = "8xH800,8xH800,8xH20,8xH20,8xH20,8xH20"


def _run(*args: str):
    return CliRunner().invoke(plan_command, list(args))


def test_prints_the_plan_for_a_hypothetical_cluster():
    res = _run("--devices", PAPER, "--model", "llama-13b", "--fail", "node0:1,9")
    assert res.exit_code == 0, res.output
    assert "Chosen:" in res.output and "Next-best alternatives:" in res.output
    assert "2 failed: 1,9" in res.output


def test_json_output_is_a_valid_plan_without_the_failed_devices():
    res = _run("--devices", PAPER, "--fail", "3", "--degrade", "node2:0=2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["schema"] == 1
    used = {d for p in data["chosen"]["plan"]["pipelines"] for s in p["stages"]
            for d in s["devices"]}
    assert 3 not in used


def test_inventory_and_model_from_json_files(tmp_path):
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps({"types": {"X1": {"peak_tflops": 100, "memory_gib": 64,
                                                "intra_node_gbps": 100, "inter_node_gbps": 10}},
                               "nodes": "4xX1,4xX1"}))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"preset": "llama-7b", "seq_len": 2048}))
    res = _run("--devices", str(inv), "--model", str(model), "--global-batch", "7")
    assert res.exit_code == 0, res.output
    assert "global batch 7" in res.output


def test_current_plan_reports_switch_traffic(tmp_path):
    first = json.loads(_run("--devices", "8xH800,8xH800", "--json").output)
    current = tmp_path / "plan.json"
    current.write_text(json.dumps(first["chosen"]["plan"]))
    res = _run("--devices", "8xH800,8xH800", "--fail", "0", "--current", str(current), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["chosen"]["estimate"]["switch_bytes"] > 0


@pytest.mark.parametrize("args,needle", [
    (("--devices", "8xH900"), "'H900'"),
    (("--devices", "8xH800", "--fail", "node7:0"), "'node7'"),
    (("--devices", "8xH800", "--fail", "node0:8"), "index '8'"),
    (("--devices", "8xH800", "--fail", "node0:x"), "'node0:x'"),
    (("--devices", "8xH800", "--fail", "99"), "device 99"),
    (("--devices", "8xH800", "--degrade", "1=0.5"), "'1=0.5'"),
    (("--devices", "8xH800", "--model", "llama-70b"), "'llama-70b'"),
    (("--devices", "8xH800", "--tp", "two"), "'two'"),
    (("--devices", "8xH800", "--global-batch", "0"), "--global-batch"),
])
def test_bad_input_is_a_one_line_usage_error(args, needle):
    res = _run(*args)
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in res.output


def test_infeasible_model_exits_1_naming_the_shortfall():
    res = _run("--devices", "2xL40S", "--model", "llama-32b")
    assert res.exit_code == 1
    assert "short by" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("inventory,needle", [
    ({"devices": [{"id": 0, "node": "a", "type": "CPU", "slowdown": "fast"}]}, "slowdown='fast'"),
    ({"devices": [{"id": 0, "node": "a"}]}, "needs id, node and type"),
    ({"types": {"X": "big"}, "nodes": "2xX"}, "device type 'X'"),
    ({"types": {"X": {"peak_tflops": 1}}, "nodes": "2xX"}, "missing key 'memory_gib'"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_inventory_files_are_usage_errors(tmp_path, inventory, needle):
    path = tmp_path / "inv.json"
    path.write_text(json.dumps(inventory))
    res = _run("--devices", str(path))
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


# ------------------------------------------------------------------- M28: the CLI's rough edges
LENGTHS = ("--devices", "4xH800,4xH800", "--model", "llama-7b", "--global-batch", "16",
           "--lengths", "512:0.95,8192:0.05")


def test_lengths_say_why_the_home_layout_cannot_run_a_bucket():
    """The 8192-token bucket gets 1 row of 16, under a home plan of two pipelines: the text
    says the home layout cannot run it (no step time), as the JSON does (``home_s`` null)."""
    res = _run(*LENGTHS)
    assert res.exit_code == 0, res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("  <= 8192 tokens")]
    assert len(line) == 1 and "its own plan, switched in the step" in line[0], res.output
    assert "the home layout cannot run it (only 1 row for its 2 pipelines)" in line[0]
    data = json.loads(_run(*LENGTHS, "--json").output)
    last = data["in_step"]["buckets"][-1]
    assert last["home_s"] is None and last["home_why"] == "only 1 row for its 2 pipelines"
    assert data["in_step"]["buckets"][0]["home_why"] == ""


def test_plan_takes_dash_h_as_every_subcommand_does(capsys):
    from launcher import cli

    for name in ("plan", "status", "dashboard", "inject"):
        assert cli.main([name, "-h"]) == 0, name
        out = capsys.readouterr()
        assert f"Usage: hspmd-launch {name}" in out.out and not out.err, (name, out.err)


def test_uniform_tells_its_plan_on_the_devices_as_they_are():
    """One step time per plan, and the devices named by their type: the plan searched over
    the weakest-device copy, estimated on the real mix (what the cost model says of it)."""
    from launcher.plan_cmd import load_inventory, load_profile
    from hspmd_elastic.planner import estimate_plan

    res = _run("--devices", "2xH800,2xH20", "--uniform")
    assert res.exit_code == 0, res.output
    assert "uniform tp" not in res.output and "H800 tp" in res.output, res.output
    chosen = res.output.split("Next-best alternatives:")[0]
    assert len(re.findall(r"step [0-9.]+ s", chosen)) == 1, chosen
    data = json.loads(_run("--devices", "2xH800,2xH20", "--uniform", "--json").output)
    plan = Plan.from_dict(data["chosen"]["plan"])
    real = estimate_plan(plan, load_inventory("2xH800,2xH20"), load_profile("llama-7b"))
    assert data["chosen"]["estimate"]["step_time_s"] == pytest.approx(real.step_time_s)
    assert data["uniform"]["step_time_s"] == data["chosen"]["estimate"]["step_time_s"]
    assert f"step {real.step_time_s:.4g} s" in chosen


def test_lengths_with_uniform_show_what_the_uniform_leader_publishes():
    """The agent takes --hspmd-planner uniform with --hspmd-lengths (a uniform home plan, each
    bucket's plan from bucket_layouts over the real devices); plan --lengths --uniform shows
    the same home plan as the leader's ``UniformPlanner``."""
    from hspmd_elastic.planner import plan_for
    from hspmd_elastic.planner.buckets import profile_at
    from hspmd_elastic.planner.explain import layout_line
    from launcher.leader.planning import UniformPlanner
    from launcher.plan_cmd import load_inventory, load_profile

    args = ("--devices", "4xH800,4xH20", "--model", "llama-7b", "--global-batch", "16",
            "--lengths", "512:0.95,8192:0.05", "--uniform")
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert "In an elastic job with --hspmd-planner uniform --hspmd-lengths" in res.output
    data = json.loads(_run(*args, "--json").output)
    home = UniformPlanner(plan_for)(load_inventory("4xH800,4xH20"),
                                    profile_at(load_profile("llama-7b"), 8192), 16).plan
    assert data["planner"] == "uniform" and data["in_step"]["home"] == layout_line(home)
    assert [b["rows"] for b in data["in_step"]["buckets"]] == [15, 1]


def test_a_bad_share_sum_names_the_spec_once():
    res = _run("--devices", "8xH800", "--lengths", "512:0.5,8192:0.4")
    assert res.exit_code == 2
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and errors[0].count("512:0.5,8192:0.4") == 1, errors
    assert errors[0].lower().count("lengths") == 1, errors  # not "--lengths: lengths '...'"
    assert "the shares sum to 0.9, not 1" in errors[0]
