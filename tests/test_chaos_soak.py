"""The chaos soak, short version: one cycle of ``examples/scenarios/chaos-soak-short.json`` (13
fault kinds) against one elastic job on the multi-host topology (three nodes in network
namespaces of their own, a 3-member etcd in namespaces, real agents and workers; see
``tests/_chaos.py``), through the fault-injection harness: a thermal slowdown and its recovery,
a fatal Xid, a suspect GPU drained, a GPU lost (each followed by a ``recover``: a fresh worker
gets its state by BSR), a killed worker, a hung one, a killed agent and a fresh agent joining
in its namespace, a frozen agent and a data-link cut (each node back after the thaw or heal), an
etcd member restarted and every etcd member stalled past the lease TTL. Two faults overlap:
while the job switches into the plan that takes node-c back (the ``join``), the first worker
that plan starts on node-c is killed (timed on the journal and the worker records, see
``_chaos.KillDuringSwitch``). The device faults go through the real detection path: the
injector appends to the node's fault script, the agent's scripted health source
(``--hspmd-health-source scripted:etcd``) makes the verdict, the leader replans on it.

Checked: every fault handled (``recovered``, or ``survived`` for the etcd faults, with no
reaction in the journal); no sample lost; every finished worker ran every step and switched
only by BSR; the parameters equal the fault-free reference (float64, 1e-9); the worker that no
fault touched is the same process; the overlapping kill hit the switch before it ended; the
Xid's verdict is the health source's and the leader's replan names it; no process of the job
is left (``marker``). The report table is printed. ``scripts/soak`` runs the long version (``chaos-soak.json``).
"""

from __future__ import annotations

import time

import pytest

import _chaos
from _chaos import SCENARIOS, ChaosJob, Pace, steps_for

from hspmd_elastic.contract import schema
from launcher.health.rules import classify_xid
from launcher.inject.api import RECOVERED, SURVIVED
from launcher.inject.report import render_table

SCENARIO = SCENARIOS / "chaos-soak-short.json"


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_one_cycle_of_thirteen_fault_kinds_on_three_hosts(netns, marker):
    started = time.monotonic()
    topo = netns(nodes=tuple(_chaos.NODES), etcd_members=3)
    job = ChaosJob(topo, marker, Pace(steps=steps_for(SCENARIO)))
    try:
        pids = job.start()
        scenario = job.scenario(SCENARIO)
        kinds = {f.fault for f in scenario.faults}
        assert len(kinds) >= 12, kinds
        report = job.run(scenario, wait_end_s=180)
        verdict = job.judge(report)
    finally:
        job.close()
    table = render_table(report)
    print(table, f"\n(run took {time.monotonic() - started:.1f}s, max |elastic - reference| = "
                 f"{verdict.max_param_diff})")
    assert not verdict.problems, "\n".join(verdict.problems) + "\n" + table
    rows = {}
    for row in report.rows:
        rows.setdefault(row.fault, []).append(row)
    assert set(rows) == kinds
    for fault in ("etcd-restart", "etcd-stall"):
        assert [r.outcome for r in rows[fault]] == [SURVIVED], table
    for fault, got in rows.items():
        if fault not in ("etcd-restart", "etcd-stall"):
            assert all(r.outcome == RECOVERED and not r.escalated for r in got), table
    assert rows["hang"][0].detected_by.startswith("stall event"), table
    assert rows["suspect"][0].detected_by.split()[:2] in (["verdict", "suspect"],
                                                         ["drain", "event"]), table
    assert rows["partition"][0].detected_by.split()[0] in ("unreachable", "failure"), table
    for fault in ("freeze-agent", "partition"):  # the node came back after the thaw or heal
        assert rows[fault][0].detail["rejoined_at"] >= rows[fault][0].recovered_at, table
    assert report.samples_lost == 0 and report.final_step == job.pace.steps, table
    untouched = "node-a:0"  # slowed down and back, never restarted
    assert verdict.results[untouched]["pid"] == pids[untouched]
    # overlapping faults: a worker killed while the job switched into the join's plan (judge()
    # fails the run when the kill missed the switch)
    assert job.overlap is not None and job.overlap.killed is not None, table
    print(job.overlap.summary(job.events))
    # a device fault through the real detection path: the injector wrote only the node's fault
    # script; the agent's scripted health source turned it into the verdict (its Xid table's
    # text), and that verdict is the change the leader replanned on
    xid = rows["xid"][0]
    assert xid.detail["key"] == schema.fault_script_key(job.name, "node-b"), xid.detail
    assert xid.detail["faults"] == [{"device": 0, "kind": "xid", "xid": 48}], xid.detail
    reason = f"{classify_xid(48).reason()} (scripted)"
    assert any((v.node, v.index, v.state, v.reason) == ("node-b", 0, "failed", reason)
               for v in job.verdicts), job.verdicts
    assert any(c.kind == "failure" and c.devices == ["node-b:0"] and c.reason == reason
               for ev in job.events if ev.type == "replan"
               for c in schema.event_detail(ev).changes), table


# ------------------------------------------------------------------- pure pieces it relies on
def _ev(seq, type_, node="node-a", **detail):
    from _events import event, make

    if type_ == "replan":
        detail.setdefault("previous_version", detail["version"] - 1)
    return event(seq, type_, make(type_, **detail), node, float(seq))


def test_new_kinds_are_detected_and_recovered_from_the_jobs_own_records():
    from launcher.inject.detect import (
        Baseline,
        DeviceVerdictSeen,
        Injected,
        handling_plan,
        match_detection,
        match_recovery,
    )

    base = Baseline(at=0.0, last_seq=2, devices_seen=1, round=3, step=10)
    verdicts = [DeviceVerdictSeen(0, "node-b", 0, "failed", "old", 0.5),
                DeviceVerdictSeen(1, "node-b", 0, "suspect", "ECC counts", 3.0),
                DeviceVerdictSeen(2, "node-a", 0, "healthy", "reset", 3.5)]
    suspect = Injected("suspect", {"node": "node-b", "device": 0})
    assert match_detection(suspect, base, [], verdicts).by == "verdict suspect at devices/node-b/0"
    drain = [_ev(3, "drain", "node-b", devices=["node-b:0"], plan_version=4),
             _ev(4, "replan", version=4, changes=[{"kind": "drain", "node": "node-b", "devices": ["node-b:0"], "reason": "ECC counts"}]),
             _ev(5, "switch-done", plan_version=4)]
    assert match_detection(suspect, base, drain).by == "drain event #3"
    assert handling_plan(suspect, drain, 2) == 4
    det = match_detection(suspect, base, drain)
    assert match_recovery(suspect, base, det, drain, []).by == "switch-done event #5"
    recover = Injected("recover", {"node": "node-a", "device": 0})
    assert match_detection(recover, base, [], verdicts).by == "verdict healthy at devices/node-a/0"
    for change in ({"kind": "recover", "node": "node-a", "devices": ["node-a:0"]},
                   {"kind": "join", "node": "node-a"}):
        assert handling_plan(recover, [_ev(7, "replan", version=6, changes=[change])], 2) == 6
    lost = Injected("lost", {"node": "node-b", "device": 0})
    assert match_detection(lost, base, [], verdicts) is None  # its failed verdict is older
    killed = Injected("kill-agent", {"node": "node-c"})
    gone = [_ev(3, "unreachable", "node-c", devices=["node-c:0"], plan_version=5)]
    # its peers' probes can report the dead node before its lease expires: that replan takes
    # it out of the plan, and its expiring lease then journals no leave
    assert match_detection(killed, base, gone).by == "unreachable event #3"
    assert match_detection(killed, base, [_ev(3, "unreachable", "node-b")]) is None
    cut = Injected("partition", {"node": "node-c"})
    away = [_ev(3, "unreachable", "node-c", devices=["node-c:0"], plan_version=5),
            _ev(4, "replan", version=5, changes=[{"kind": "unreachable", "node": "node-c", "devices": ["node-c:0"], "reason": "unreachable over the data network from node-a, node-b"}])]
    assert match_detection(cut, base, away).by == "unreachable event #3"
    assert handling_plan(cut, away, 2) == 5


def test_a_node_taken_away_is_back_once_a_plan_takes_it_back():
    from launcher.inject.detect import Injected, expects_rejoin, match_rejoin

    events = [_ev(3, "leave", "node-b", devices=["node-b:0"], plan_version=5),
              _ev(4, "replan", version=5, changes=[{"kind": "leave", "node": "node-b"}]),
              _ev(5, "switch-done", plan_version=5),
              _ev(6, "replan", version=6, changes=[{"kind": "join", "node": "node-c"}]),
              _ev(7, "switch-done", plan_version=6)]
    frozen = Injected("freeze-agent", {"node": "node-b"})
    assert expects_rejoin(frozen, events, 2) is None  # not thawed yet
    frozen.ended_at = 4.5
    assert expects_rejoin(frozen, events, 2) == 5
    assert match_rejoin(frozen, events, 5) is None  # a join of another node
    events += [_ev(8, "replan", version=7, changes=[{"kind": "join", "node": "node-b"}]),
               _ev(9, "switch-done", plan_version=7)]
    back = match_rejoin(frozen, events, 5)
    assert (back.by, back.round) == ("switch-done event #9", 7)
    killed = Injected("kill-agent", {"node": "node-b"})
    assert expects_rejoin(killed, events, 2) is None  # nothing is to come back


def test_a_fault_to_ride_through_must_leave_no_reaction_in_the_journal():
    from launcher.inject.detect import expects_reaction, reactions

    assert not expects_reaction("etcd-stall") and not expects_reaction("etcd-restart")
    events = [_ev(3, "switch-done", plan_version=2), _ev(4, "replan", version=3, changes=[]),
              _ev(5, "leave", "node-b"), _ev(6, "failure", "node-c")]
    assert [e.seq for e in reactions(events, 2, 5)] == [4, 5]
    assert reactions(events, 6) == [] and [e.seq for e in reactions(events, 5)] == [6]


def test_etcd_stall_needs_the_jobs_etcd_members(tmp_path):
    from launcher.inject.api import NotOwnedError
    from launcher.inject.faults import InjectContext, make_fault
    from launcher.inject.scenario import parse_fault

    spec = parse_fault({"fault": "etcd-stall", "duration_s": 1}, 0,
                       {"detect_timeout_s": 5.0, "recover_timeout_s": 5.0}, "t")
    with pytest.raises(NotOwnedError, match="etcd-stall needs the job's etcd members"):
        make_fault(spec).inject(InjectContext(None, "j"))


def test_a_killed_agents_late_leave_is_no_reaction_to_a_later_fault():
    from launcher.inject.harness import _about

    gone = {"node-c"}
    assert _about(_ev(5, "leave", "node-c"), gone)
    assert _about(_ev(6, "replan", version=7, changes=[{"kind": "leave", "node": "node-c"}]), gone)
    assert _about(_ev(6, "replan", version=7, changes=[{"kind": "unreachable", "node": "node-c", "devices": ["node-c:0", "node-c:1"], "reason": "x"}]), gone)
    assert not _about(_ev(6, "replan", version=7, changes=[{"kind": "leave", "node": "node-c"}, {"kind": "leave", "node": "node-b"}]), gone)
    assert not _about(_ev(7, "leave", "node-b"), gone)
    assert not _about(_ev(8, "replan", version=8, changes=[{"kind": "store", "node": "a", "devices": ["a:1 -> b:2"]}]), gone)
