"""``hspmd-launch plan``: what-if questions about a cluster, and usage errors for bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

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
