"""ScriptedHealthSource: the fault-script format, the replay rules, file and etcd feeds."""

from __future__ import annotations

import json

import pytest

from hspmd_elastic.coord.client import EtcdClient
from launcher.health.api import DeviceState, FaultScriptError
from launcher.health.scripted import (
    Fault,
    FileFaultFeed,
    ScriptedHealthSource,
    StaticFaultFeed,
    encode_fault_script,
    parse_faults,
    replay,
)
from launcher.health.verdicts import EtcdFaultFeed, fault_script_key
from _clock import FakeClock


# ----------------------------------------------------------------------------- format
def test_parse_list_lines_and_object_forms_agree():
    faults = [{"at": 1, "device": 0, "kind": "xid", "xid": 79},
              {"at": 2.5, "device": 1, "kind": "thermal", "slowdown": 0.6}]
    as_list = parse_faults(json.dumps(faults))
    as_lines = parse_faults("# drill\n" + "\n".join(json.dumps(f) for f in faults) + "\n\n")
    as_object = parse_faults(encode_fault_script(as_list).decode())
    assert as_list == as_lines == as_object
    assert as_list[0] == Fault(device=0, kind="xid", at=1.0, xid=79)


@pytest.mark.parametrize("entry,problem", [
    ({"device": 0, "kind": "boom"}, "kind 'boom' is not one of xid, ecc, lost, thermal, suspect, recover"),
    ({"kind": "lost"}, "missing field device"),
    ({"device": 0, "kind": "xid"}, "kind xid needs an xid number"),
    ({"device": 0, "kind": "thermal", "slowdown": 1.5}, "slowdown must be in (0, 1]"),
    ({"device": 0, "kind": "thermal"}, "kind thermal needs a slowdown"),
    ({"device": -1, "kind": "lost"}, "device must be a non-negative integer"),
    ({"device": 0, "kind": "lost", "when": 3}, "unknown field(s) when"),
    ({"device": 0, "kind": "lost", "at": "soon"}, "at must be a number >= 0.0"),
])
def test_bad_faults_are_named(entry, problem):
    with pytest.raises(FaultScriptError) as err:
        parse_faults(json.dumps([{"device": 0, "kind": "ecc"}, entry]), "drill.json")
    assert "drill.json entry 1" in str(err.value) and problem in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_json_line_is_named():
    with pytest.raises(FaultScriptError, match="drill.jsonl line 2: not JSON"):
        parse_faults('{"device": 0, "kind": "ecc"}\n{oops\n', "drill.jsonl")


# ----------------------------------------------------------------------------- replay rules
def test_replay_rules():
    timed = [
        (5.0, Fault(0, "thermal", slowdown=0.6)),
        (6.0, Fault(0, "xid", xid=13)),            # informational: no change
        (7.0, Fault(1, "xid", xid=79)),
        (8.0, Fault(1, "ecc")),                    # already failed: first reason stays
        (9.0, Fault(0, "lost")),
        (10.0, Fault(2, "ecc", reason="custom")),
        (11.0, Fault(2, "recover")),
    ]
    at_6 = replay(timed, [0, 1, 2], now=6.0)
    assert at_6[0].state is DeviceState.DEGRADED and at_6[0].slowdown == 0.6 and at_6[0].at == 5.0
    at_10 = replay(timed, [0, 1, 2], now=10.0)
    assert at_10[1].xid == 79 and "Xid 79" in at_10[1].reason
    assert at_10[0].is_failed and "lost" in at_10[0].reason
    assert at_10[2].reason == "custom"
    assert replay(timed, [0, 1, 2], now=11.0)[2].state is DeviceState.HEALTHY


def test_a_scripted_drain_xid_makes_the_device_suspect_as_the_drivers_does():
    timed = [(1.0, Fault(0, "xid", xid=63)), (2.0, Fault(1, "xid", xid=92)),
             (3.0, Fault(0, "xid", xid=92)),   # already suspect: the first reason stays
             (4.0, Fault(1, "xid", xid=79))]   # a fatal one replaces suspect
    at_3 = replay(timed, [0, 1], now=3.0)
    assert at_3[0].state is DeviceState.SUSPECT and at_3[0].xid == 63, at_3[0]
    assert "row remap pending" in at_3[0].reason and at_3[0].at == 1.0
    assert at_3[1].state is DeviceState.SUSPECT and at_3[1].xid == 92
    assert replay(timed, [0, 1], now=4.0)[1].is_failed


def test_source_replays_relative_to_start():
    clock = FakeClock(1000.0)
    feed = StaticFaultFeed([Fault(1, "xid", at=10, xid=48),
                            Fault(0, "thermal", at=5, slowdown=0.5)])
    source = ScriptedHealthSource(feed, 2, clock, node="n1", refresh_s=3600)
    source.start()
    try:
        assert [d.uuid for d in source.devices()] == ["SCRIPTED-n1-0", "SCRIPTED-n1-1"]
        assert all(v.state is DeviceState.HEALTHY for v in source.poll(clock.t + 4).values())
        v = source.poll(clock.t + 10)
        assert v[0].slowdown == 0.5 and v[1].xid == 48 and v[1].at == clock.t + 10
    finally:
        source.stop(timeout=5)


def test_fault_for_unknown_device_is_refused():
    with pytest.raises(FaultScriptError, match=r"device 3 does not exist \(devices: \[0, 1\]\)"):
        ScriptedHealthSource(StaticFaultFeed([Fault(3, "lost")]), 2, FakeClock(1000.0))


# ----------------------------------------------------------------------------- file feed
def test_file_feed_refresh_picks_up_new_faults_and_ignores_bad_edits(tmp_path):
    path = tmp_path / "faults.jsonl"
    path.write_text('{"at": 1, "device": 0, "kind": "ecc"}\n')
    clock = FakeClock(1000.0)
    source = ScriptedHealthSource(FileFaultFeed(str(path)), 2, clock)
    assert source.poll(clock.t + 2)[0].is_failed
    path.write_text('{"at": 1, "device": 0, "kind": "ecc"}\n{"device": 1, "kind": "lost"}\n')
    clock.t += 50
    source.refresh()  # the unscheduled fault applies from the moment it is seen
    assert not source.poll(clock.t - 1)[1].is_failed
    assert source.poll(clock.t)[1].is_failed
    path.write_text("{broken")
    source.refresh()  # logged, previous script kept
    assert source.poll(clock.t)[1].is_failed
    path.unlink()
    source.refresh()  # no script: no faults
    assert not source.poll(clock.t)[1].is_failed


# ----------------------------------------------------------------------------- etcd feed
def test_etcd_feed_per_node(etcd_server):
    client = EtcdClient(etcd_server.endpoints, timeout=5)
    try:
        key = fault_script_key("job1", "node-a")
        assert key == "/hspmd/v1/jobs/job1/faults/node-a"
        clock = FakeClock(1000.0)
        source = ScriptedHealthSource(EtcdFaultFeed(client, key), 2, clock, refresh_s=3600)
        assert source.faults == []
        client.put(key, encode_fault_script([Fault(1, "xid", xid=79)]))
        clock.t += 3
        source.refresh()
        v = source.poll(clock.t)
        assert v[1].xid == 79 and v[0].state is DeviceState.HEALTHY
        client.put(key, b"[not json")
        source.refresh()
        assert source.poll(clock.t)[1].is_failed  # bad value ignored, previous script kept
        client.delete(key)
        source.refresh()
        assert not source.poll(clock.t)[1].is_failed
    finally:
        client.close()
