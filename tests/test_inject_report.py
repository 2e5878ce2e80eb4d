"""Detection, recovery, steps and samples lost, and the report: pure functions of what a job
recorded (events, verdicts, progress), checked on hand-made histories."""

from __future__ import annotations

import json

from hspmd_elastic.contract.progress import WorkerProgress, write_progress
from _events import event, make
from launcher.inject.api import (
    NOT_DETECTED,
    NOT_INJECTED,
    NOT_RECOVERED,
    RECOVERED,
    SURVIVED,
    FaultRow,
    ProgressPoint,
    Report,
)
from launcher.inject.detect import (
    Baseline,
    DeviceVerdictSeen,
    Injected,
    expects_reaction,
    lineage_gaps,
    match_detection,
    match_recovery,
    steps_lost,
    switch_started,
)
from launcher.inject.report import all_handled, finalize, render_json, render_table

T0 = 1000.0


def ev(seq, type_, node="node-a", at=None, **detail):
    return event(seq, type_, make(type_, **detail), node, at if at is not None else T0 + seq)


def base(last_seq=2, rnd=0, step=5, at=T0 + 2.5, devices_seen=0):
    return Baseline(at=at, last_seq=last_seq, devices_seen=devices_seen, round=rnd, step=step)


def pts(rnd, steps, t0, rank=0, batch=12):
    return [ProgressPoint(rank, rnd, s, t0 + i * 0.1, batch) for i, s in enumerate(steps)]


def test_worker_fault_matches_the_failure_event_naming_its_pid():
    inj = Injected("kill-worker", {"node": "node-a", "local_rank": 1, "rank": 1}, (4242,))
    events = [ev(1, "failure", exits=[{"pid": 4242}]),  # before the injection
              ev(3, "failure", node="node-b", exits=[{"pid": 77}]),  # a peer's failure
              ev(4, "failure", exits=[{"pid": 4241}, {"pid": 4242}]),
              ev(5, "restart")]
    det = match_detection(inj, base(), events)
    assert (det.seq, det.at, det.by) == (4, T0 + 4, "failure event #4")
    assert match_detection(inj, base(last_seq=4), events) is None
    stall = Injected("hang", {"node": "node-a"}, (9,))
    assert match_detection(stall, base(), [ev(3, "stall", pid=9)]).by == "stall event #3"
    hang = Injected("hang", {"node": "node-a", "local_rank": 1}, (9,))  # the agent's stall event
    assert match_detection(hang, base(), [ev(3, "stall", local_rank=0),
                                          ev(4, "stall", node="node-b", local_rank=1),
                                          ev(5, "stall", local_rank=1)]).seq == 5


def test_agent_fault_leave_or_peer_failure_and_join():
    kill = Injected("kill-agent", {"node": "node-b"}, (555,))
    leave = ev(3, "leave", nodes=["node-b"])
    assert match_detection(kill, base(), [ev(3, "join"), leave]).seq == 3
    assert match_detection(kill, base(), [ev(3, "failure", exits=[{"pid": 1}])]).seq == 3
    assert match_detection(kill, base(), [ev(3, "leave", nodes=["node-c"])]) is None
    join = Injected("join", {"node": "node-c"}, (1,))
    assert match_detection(join, base(), [ev(3, "join", nodes=["node-c"])]).seq == 3
    assert match_detection(join, base(), [ev(3, "leave")]) is None


def test_device_fault_detected_by_verdict_or_event_not_by_the_fault_key():
    inj = Injected("xid", {"node": "node-a", "device": 1}, xid=79)
    old = DeviceVerdictSeen(0, "node-a", 1, "failed", "old", T0)
    other = DeviceVerdictSeen(1, "node-a", 0, "failed", "Xid 79", T0 + 3)
    mine = DeviceVerdictSeen(2, "node-a", 1, "failed", "Xid 79", T0 + 4)
    b = base(devices_seen=1)
    assert match_detection(inj, b, [], [old]) is None
    assert match_detection(inj, b, [], [old, other, mine]).by == \
        "verdict failed at devices/node-a/1"
    assert match_detection(inj, b, [ev(3, "failure", devices=["node-a:1"])]).seq == 3
    assert match_detection(inj, b, [ev(3, "failure", devices=["node-a:0"])]) is None
    assert match_detection(inj, b, [ev(3, "failure", devices=["node-a:0", "node-a:1"])]).seq == 3
    assert match_detection(inj, b, [ev(3, "failure", node="node-b", devices=["node-b:1"])]) \
        is None
    thermal = Injected("thermal", {"node": "node-a", "device": 1})
    degraded = DeviceVerdictSeen(1, "node-a", 1, "degraded", "hot", T0 + 5)
    assert match_detection(thermal, b, [], [mine]) is None
    assert match_detection(thermal, b, [], [degraded]).at == T0 + 5


def test_no_reaction_expected_from_an_etcd_restart_or_an_informational_xid():
    assert not expects_reaction("etcd-restart")
    assert not expects_reaction("xid", 13) and expects_reaction("xid", 79)
    inj = Injected("etcd-restart", {"member": "m0"}, ended_at=T0 + 4)
    assert match_detection(inj, base(), [ev(3, "failure")]) is None
    points = pts(0, [5, 6, 7], T0 + 3.85)  # step 6 before etcd came back, step 7 after
    rec = match_recovery(inj, base(), None, [], points)
    assert rec.by == "progress to step 7" and rec.at > T0 + 4


def test_recovery_is_progress_in_a_newer_round_or_a_switch_done():
    inj = Injected("kill-worker", {"node": "node-a"}, (1,))
    det = match_detection(inj, base(), [ev(3, "failure", exits=[{"pid": 1}])])
    old_round_late = pts(0, [6], T0 + 3.2)  # a survivor's step after detection: not recovery
    assert match_recovery(inj, base(), det, [], old_round_late) is None
    new_round = pts(1, [5, 6], T0 + 9)
    rec = match_recovery(inj, base(), det, [], old_round_late + new_round)
    assert (rec.round, rec.at, rec.by) == (1, T0 + 9, "progress in round 1 (step 5)")
    elastic = [ev(4, "replan", previous_version=1, version=2),
               ev(5, "switch-done", plan_version=2, from_version=1)]
    switched = match_recovery(inj, base(), det, elastic, [])
    assert (switched.by, switched.round) == ("switch-done event #5", 2)
    assert switch_started(elastic, det.seq) == T0 + 4
    assert switch_started([ev(4, "replan", previous_version=0)], det.seq) is None
    assert match_recovery(inj, base(), None, [], new_round) is None  # never detected


def test_steps_lost_and_lineage():
    points = pts(0, [1, 2, 3, 4, 5, 6], T0) + pts(1, [5, 6, 7, 8], T0 + 10)
    assert steps_lost(points, 1, base(rnd=0)) == 2  # steps 5 and 6 trained twice
    assert steps_lost(points, 0, base(rnd=0)) == 0
    assert steps_lost(points, None, base()) is None
    ok = lineage_gaps(points)
    assert (ok.steps_skipped, ok.samples_lost, ok.final_step) == (0, 0, 8)
    gap = lineage_gaps(pts(0, [1, 2, 3], T0) + pts(1, [6, 7], T0 + 10))  # resumed at 5, had 3
    assert (gap.steps_skipped, gap.samples_lost) == (2, 24)
    unknown = lineage_gaps([ProgressPoint(0, 0, 1, T0), ProgressPoint(0, 1, 4, T0 + 1)])
    assert unknown.steps_skipped == 2 and unknown.samples_lost is None


def test_report_rows_table_and_json():
    rows = [FaultRow(0, "kill-worker", {"node": "node-a", "local_rank": 1}, RECOVERED, 1.0, 1.2,
                     "failure event #3", 6.0, "progress in round 1 (step 5)"),
            FaultRow(1, "etcd-restart", {"member": "m0"}, SURVIVED, 8.0, None,
                     "n/a (no reaction expected)", 9.5, "progress to step 9"),
            FaultRow(2, "hang", {"rank": 0}, NOT_DETECTED, 12.0, note="nobody noticed")]
    report = Report("demo", "job1", rows, T0)
    bases = {0: (base(rnd=0), 1), 1: (base(rnd=1, step=8), 1)}
    points = pts(0, [1, 2, 3, 4, 5, 6], T0) + pts(1, [5, 6, 7, 8, 9], T0 + 10)
    finalize(report, points, bases)
    assert [r.steps_lost for r in rows] == [2, 0, None]
    assert report.samples_lost == 0 and report.final_step == 9
    assert not all_handled(report)
    text = render_table(report)
    lines = text.splitlines()
    assert lines[0] == "fault report: scenario demo, job job1"
    assert lines[1].split()[:3] == ["#", "fault", "target"]
    assert "failure event #3" in lines[2] and "+6.00s" in lines[2] and "recovered" in lines[2]
    assert "n/a (no reaction expected)" in lines[3] and "survived" in lines[3]
    assert lines[4].split()[-2:] == ["not", "detected"]
    assert "#2 hang: nobody noticed" in text
    assert lines[-1] == "samples lost: 0; steps skipped: 0; last step seen: 9"
    body = json.loads(render_json(report))
    assert body["kind"] == "fault_report" and body["samples_lost"] == 0
    assert [f["outcome"] for f in body["faults"]] == [RECOVERED, SURVIVED, NOT_DETECTED]
    rows.pop()
    assert all_handled(report)


def test_a_job_that_failed_after_its_last_fault_is_no_recovery():
    """The report carries the job's end; a failed end makes the last fault injected before it
    not recovered (the earlier ones keep their outcome) and the run not handled."""
    from launcher.inject.api import JobEnd
    from launcher.inject.harness import _blame_failed_end

    def rows():
        return [FaultRow(0, "kill-worker", {"node": "node-a"}, RECOVERED, 1.0, 1.2, "f #3", 2.0),
                FaultRow(1, "kill-worker", {"node": "node-a"}, RECOVERED, 5.0, 5.1, "f #7", 5.5,
                         note="job failed"),
                FaultRow(2, "kill-worker", {"node": "node-a"}, note="job failed before the "
                         "trigger")]
    report = Report("demo", "job1", rows(), T0, job_end=JobEnd("failed", "no device left", 9.0))
    _blame_failed_end(report)
    assert [r.outcome for r in report.rows] == [RECOVERED, NOT_RECOVERED, NOT_INJECTED]
    assert report.rows[1].note == "job failed at +9.00s: no device left"
    assert not all_handled(report)
    assert "job: failed at +9.00s: no device left" in render_table(report)
    assert json.loads(render_json(report))["job_end"] == {"state": "failed", "at": 9.0,
                                                          "reason": "no device left"}
    for end in (JobEnd("succeeded", "all done", 9.0), JobEnd("running"), None):
        report = Report("demo", "job1", rows()[:2], T0, job_end=end)
        _blame_failed_end(report)
        assert all_handled(report) and [r.outcome for r in report.rows] == [RECOVERED] * 2


def test_file_progress_reads_appended_lines_and_rewritten_objects(tmp_path):
    from launcher.inject.detect import FileProgress, default_progress

    lines = tmp_path / "rank0.jsonl"
    lines.write_text('{"rank": 0, "round": 1, "step": 1, "t": 5.0, "batch": 12}\n'
                     'not json\n{"rank": 0, "round": 1, "step": 0, "t": 5.5}\n'
                     '{"rank": 0, "round": 1, "st')
    source = FileProgress(str(tmp_path / "*.jsonl"))
    assert source.poll() == [ProgressPoint(0, 1, 1, 5.0, 12)]
    with open(lines, "a") as fh:  # the line being written is completed
        fh.write('ep": 2, "t": 6.0}\n')
    assert [p.step for p in source.poll()] == [1, 2]
    latest = tmp_path / "latest.json"  # HSPMD_PROGRESS_FILE: one report, replaced by rename
    runtime = FileProgress(str(latest))
    for step in (3, 4):
        write_progress(str(latest), WorkerProgress(pid=9, global_rank=1, local_rank=0,
                                                   plan_version=2, step=step,
                                                   last_progress_at=step + 0.5, steps_per_s=1.0))
        runtime.poll()
    assert runtime.poll() == [ProgressPoint(1, 2, 3, 3.5), ProgressPoint(1, 2, 4, 4.5)]
    assert default_progress(None) is None
    assert default_progress(str(tmp_path)).pattern == str(tmp_path / "*")
