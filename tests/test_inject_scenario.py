"""Scenario files of the fault-injection harness: the format, and one-line errors naming the
bad entry; the shipped examples are valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.inject.api import FAULT_NAMES, ScenarioError
from launcher.inject.scenario import (
    DEFAULT_FREEZE_S,
    load_scenario,
    parse_scenario,
    parse_scenario_text,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def scenario(*faults, **top):
    return {"schema": 1, "kind": "fault_scenario", "name": "t", "faults": list(faults), **top}


ONE_OF_EACH = [
    {"at": {"step": 3}, "fault": "kill-worker", "target": {"node": "a", "local_rank": 1}},
    {"at": 1.5, "fault": "stop-worker", "target": {"rank": 2}, "resume_after_s": 2},
    {"fault": "hang", "escalate_after_s": 5},
    {"fault": "kill-agent", "target": {"node": "b"}},
    {"fault": "freeze-agent", "target": {"node": "b"}},
    {"fault": "xid", "target": {"node": "a", "device": 0}, "xid": 79},
    {"fault": "ecc", "target": {"node": "a", "device": 1}, "count": 4},
    {"fault": "thermal", "target": {"node": "a", "device": 1}, "slowdown": 0.5},
    {"fault": "lost", "target": {"node": "a", "device": 0}},
    {"fault": "suspect", "target": {"node": "b", "device": 1}},
    {"fault": "recover", "target": {"node": "a", "device": 0}},
    {"fault": "etcd-restart", "target": {"member": "m0"}, "down_s": 1, "how": "stop"},
    {"fault": "etcd-stall", "duration_s": 4},
    {"fault": "join", "target": {"node": "c"}, "args": ["--nproc-per-node", "1", "t.py"],
     "env": {"X": "1"}, "detect_timeout_s": 5, "comment": "a third node"},
    {"fault": "partition", "target": {"node": "b"}, "links": "data", "duration_s": 3},
    {"fault": "throttle", "target": {"node": "a", "local_rank": 1}, "cpus": 0.25,
     "duration_s": 6},
    {"fault": "unthrottle", "target": {"node": "a", "local_rank": 1}},
]


def test_every_fault_kind_parses():
    sc = parse_scenario(scenario(*ONE_OF_EACH, defaults={"recover_timeout_s": 7}))
    assert [f.fault for f in sc.faults] == list(FAULT_NAMES)
    kill, stop, hang, _, freeze, xid, ecc, thermal, lost, suspect, recover, etcd, stall, join, \
        cut, throttle, unthrottle = sc.faults
    assert throttle.params == {"cpus": 0.25, "duration_s": 6.0} and unthrottle.params == {}
    assert throttle.target == unthrottle.target == {"node": "a", "local_rank": 1}
    assert lost.params == suspect.params == recover.params == {}
    assert suspect.target == {"node": "b", "device": 1}
    assert stall.target == {} and stall.params == {"duration_s": 4.0}
    assert cut.params == {"links": "data", "mode": "down", "duration_s": 3.0}
    assert cut.target == {"node": "b"}
    assert (kill.at_step, kill.at_s, kill.target) == (3, None, {"node": "a", "local_rank": 1})
    assert (stop.at_s, stop.params) == (1.5, {"resume_after_s": 2.0})
    assert hang.target == {} and hang.params == {"escalate_after_s": 5.0}
    assert freeze.params == {"duration_s": DEFAULT_FREEZE_S}
    assert xid.params == {"xid": 79} and ecc.params == {"count": 4}
    assert thermal.params == {"slowdown": 0.5}
    assert etcd.params == {"down_s": 1.0, "how": "stop"} and etcd.target == {"member": "m0"}
    assert join.params == {"args": ["--nproc-per-node", "1", "t.py"], "env": {"X": "1"}}
    assert join.detect_timeout_s == 5 and join.recover_timeout_s == 7
    assert join.comment == "a third node"
    assert kill.describe() == "#0 kill-worker[local_rank=1,node=a]"


@pytest.mark.parametrize("entry, problem", [
    ({"fault": "explode"}, "fault 0: fault 'explode' is not one of kill-worker"),
    ({"fault": "kill-worker", "target": {"pod": "x"}},
     "fault 0 (kill-worker): unknown target field(s) for kill-worker pod; valid: local_rank, "
     "node, rank"),
    ({"fault": "kill-worker", "target": {"local_rank": -1}},
     "target.local_rank must be an integer >= 0, got -1"),
    ({"fault": "kill-agent"}, "fault 0 (kill-agent): kill-agent needs target.node"),
    ({"fault": "kill-agent", "target": {"node": "a/b"}}, "target.node must be an id"),
    ({"fault": "xid", "target": {"node": "a", "device": 0}}, "xid needs an xid number"),
    ({"fault": "thermal", "target": {"node": "a", "device": 0}, "slowdown": 1.5},
     "slowdown must be a number > 0.0 and <= 1.0, got 1.5"),
    ({"fault": "ecc", "target": {"node": "a", "device": 0}, "count": 0},
     "count must be an integer >= 1, got 0"),
    ({"fault": "stop-worker", "resume_after_s": 1, "escalate_after_s": 2},
     "give resume_after_s or escalate_after_s, not both"),
    ({"fault": "kill-worker", "xid": 3}, "unknown field(s) for kill-worker xid"),
    ({"fault": "kill-worker", "at": -2}, "at (seconds after the start) must be a number >= 0"),
    ({"fault": "kill-worker", "at": {"epoch": 2}}, "unknown field(s) in at epoch"),
    ({"fault": "kill-worker", "at": {"step": "3"}}, "at.step must be an integer >= 0"),
    ({"fault": "etcd-restart", "how": "reboot"}, "how must be kill or stop, got 'reboot'"),
    ({"fault": "etcd-stall", "target": {"member": "m0"}},
     "unknown target field(s) for etcd-stall member; valid: none"),
    ({"fault": "suspect", "target": {"node": "a"}}, "suspect needs target.device"),
    ({"fault": "join", "target": {"node": "c"}}, "join needs args"),
    ({"fault": "join", "target": {"node": "c"}, "args": ["x"], "env": {"A": 1}},
     "env must map names to strings"),
    ({"fault": "hang", "detect_timeout_s": 0}, "detect_timeout_s must be a number > 0"),
    ("kill-worker", "fault 0: expected a JSON object, got str"),
])
def test_bad_entries_name_the_entry_and_the_value(entry, problem):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(scenario({"fault": "kill-worker"}, entry), "s.json")
    text = str(err.value)
    assert "\n" not in text and text.startswith("bad scenario s.json fault 1")
    assert problem.replace("fault 0", "fault 1") in text


@pytest.mark.parametrize("body, problem", [
    ([], "expected a JSON object with schema, kind and faults, got list"),
    ({"kind": "fault_scenario", "faults": [{"fault": "hang"}]}, "schema must be 1, got None"),
    ({"schema": 1, "kind": "fault_script", "faults": []}, "kind must be 'fault_scenario'"),
    ({"schema": 1, "kind": "fault_scenario", "faults": []}, "faults must be a non-empty list"),
    ({"schema": 1, "kind": "fault_scenario", "faults": [{"fault": "hang"}], "extra": 1},
     "unknown top-level field(s) extra"),
    ({"schema": 1, "kind": "fault_scenario", "faults": [{"fault": "hang"}],
      "defaults": {"detect_s": 1}}, "unknown field(s) in defaults detect_s"),
])
def test_bad_top_level(body, problem):
    with pytest.raises(ScenarioError, match="bad scenario s.json: ") as err:
        parse_scenario(body, "s.json")
    assert problem in str(err.value)


def test_files_not_json_or_missing(tmp_path):
    with pytest.raises(ScenarioError, match=r"bad scenario <scenario>: not JSON"):
        parse_scenario_text("{nope")
    with pytest.raises(ScenarioError, match=r"missing.json: cannot read it"):
        load_scenario(str(tmp_path / "missing.json"))
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(scenario({"fault": "hang"})))
    assert load_scenario(str(path)).faults[0].fault == "hang"


def test_shipped_examples_are_valid():
    paths = sorted(EXAMPLES.glob("*.json"))
    assert paths, "examples/scenarios/ has no scenario"
    kinds = {p.name: {f.fault for f in load_scenario(str(p)).faults} for p in paths}
    assert len(kinds["five-faults.json"]) >= 5
    assert set().union(*kinds.values()) == set(FAULT_NAMES)  # every fault has an example
