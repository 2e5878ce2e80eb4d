"""The fault-injection harness's pure pieces for elastic jobs: how a replan's reason names the
fault it handles, which switch-done is the recovery, and why a state change without a step is no
hang. The harness against a real elastic job, with every fault kind of
``examples/scenarios/elastic-five-faults.json`` and more, is the chaos soak
(``tests/test_chaos_soak.py``: three hosts in network namespaces, a 3-member etcd).
"""

from __future__ import annotations

import pytest

from hspmd_elastic.contract import schema


# ------------------------------------------------------------------- pure pieces it relies on
def test_replan_reasons_name_the_fault_they_handle():
    from launcher.inject.detect import Injected, handling_plan, replan_changes

    from _events import event, make

    def replan(seq, version, *changes):
        return event(seq, "replan", make("replan", version=version, previous_version=version - 1,
                                          changes=list(changes)), "node-b", float(seq))

    three = replan(1, 2, {"kind": "failure", "node": "node-a",
                          "devices": ["node-a:1", "node-a:2"], "reason": "Xid 79: gone"},
                   {"kind": "join", "node": "node-c"})
    assert replan_changes(three) == [("failure", ("node-a:1", "node-a:2")),
                                     ("join", ("node-c",))]
    assert replan_changes(event(2, "switch-done", make("switch-done", plan_version=2))) == []

    events = [replan(3, 2, {"kind": "failure", "node": "node-b", "devices": ["node-b:1"],
                            "reason": "worker pid 7 killed by SIGKILL"}),
              replan(6, 3, {"kind": "stall", "node": "node-a", "devices": ["node-a:1"],
                            "reason": "worker 1 hung at step 6"}),
              replan(9, 4, {"kind": "join", "node": "node-c"}),
              replan(12, 5, {"kind": "leave", "node": "node-c"}),
              replan(14, 6, {"kind": "degrade", "node": "node-a", "devices": ["node-a:0"],
                             "reason": "speed 100% -> 50%"})]
    cases = [(Injected("kill-worker", {"node": "node-b", "local_rank": 1}), 2),
             (Injected("hang", {"node": "node-a", "local_rank": 1}), 3),
             (Injected("join", {"node": "node-c"}), 4),
             (Injected("kill-agent", {"node": "node-c"}), 5),
             (Injected("thermal", {"node": "node-a", "device": 0}), 6),
             (Injected("xid", {"node": "node-a", "device": 0}, xid=79), None)]
    for inj, version in cases:
        assert handling_plan(inj, events, 0) == version, inj.fault
    assert handling_plan(cases[0][0], events, 3) is None  # only replans after the injection


def test_switch_done_of_the_handling_plan_is_the_recovery():
    from launcher.inject.detect import Baseline, Detection, Injected, match_recovery

    inj = Injected("kill-worker", {"node": "node-b", "local_rank": 1}, (42,))
    base = Baseline(at=0.0, last_seq=2, devices_seen=0, round=1, step=3)
    from _events import event, make

    events = [event(3, "failure", make("failure", exits=[{"pid": 42}]), "node-b", 3),
              event(4, "switch-done", make("switch-done", plan_version=1), "node-a", 4),
              event(5, "replan", make("replan", version=2, previous_version=1, changes=[
                  {"kind": "failure", "node": "node-b", "devices": ["node-b:1"]}]), "node-a", 5),
              event(6, "switch-done", make("switch-done", plan_version=2, from_version=1),
                    "node-a", 6)]
    rec = match_recovery(inj, base, Detection(3.0, "failure event #3", 3), events, [])
    assert (rec.at, rec.by, rec.round) == (6, "switch-done event #6", 2)


def test_a_state_change_without_a_step_is_not_a_hang(monkeypatch):
    """The peers of a frozen worker stop stepping too, but report that they wait for a plan."""
    from launcher.node.hangs import ProgressMonitor
    from launcher.health.api import HealthConfigError
    from launcher.health.progress import hang_detector_from_env

    now = [100.0]
    detector = hang_detector_from_env({"HSPMD_HANG_TIMEOUT_S": "2", "HSPMD_HANG_STARTUP_S": "9"},
                                      clock=lambda: now[0])
    assert (detector.min_timeout_s, detector.startup_grace_s, detector.multiple) == (2, 9, 10)
    monitor = ProgressMonitor(detector, clock=lambda: now[0], wall_clock=lambda: now[0])

    def rec(pid, step, at):
        return schema.WorkerRecord(pid=pid, global_rank=0, local_rank=0, plan_version=1,
                                   step=step, last_progress_at=at, steps_per_s=0.0)

    for step in range(1, 4):  # both step every 0.1 s
        monitor.observe({0: rec(10, step, now[0]), 1: rec(11, step, now[0])})
        now[0] += 0.1
    last = now[0] - 0.1
    now[0] += 1.5
    # slot 0 is frozen; slot 1's collective timed out: a new report, the same step
    monitor.observe({0: rec(10, 3, last), 1: rec(11, 3, now[0])})
    now[0] += 1.0
    assert [h.worker for h in monitor.new_hangs()] == [0]
    with pytest.raises(HealthConfigError, match="HSPMD_HANG_TIMEOUT_S='soon'"):
        hang_detector_from_env({"HSPMD_HANG_TIMEOUT_S": "soon"})
    with pytest.raises(HealthConfigError, match="min_timeout_s must be > 0"):
        hang_detector_from_env({"HSPMD_HANG_TIMEOUT_S": "0"})
