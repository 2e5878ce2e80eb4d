"""launcher.ops pure parts: the job view, the status document, metrics and the terminal render.

No etcd here: records are built with the production record types and fed to ``JobView.build``.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from hspmd_elastic.contract import schema
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from launcher.ops.api import STATUS_FORMAT, STATUS_VERSION
from launcher.ops.metrics import exposition, make_registry
from launcher.ops.status import render
from launcher.ops.events import event_summary
from launcher.ops.view import JobView, decode_pairs
from _events import change, done, failed, replan
from _events import event as typed_event

JOB = "viewjob"
NOW = 1_800_000_000.0
DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def node(name: str, n_dev: int, state: str = "running") -> tuple[str, schema.Record]:
    devs = [schema.DeviceInfo(i, "H200", 141 << 30, f"GPU-{name}-{i}") for i in range(n_dev)]
    return schema.node_key(JOB, name), schema.NodeRecord(host=f"h-{name}", agent_pid=10,
                                                         devices=devs, state=state,
                                                         started_at=NOW - 100)


def health(name: str, index: int, state: str, reason: str = "", xid=None):
    return schema.device_key(JOB, name, index), schema.DeviceHealthRecord(
        state=state, reason=reason, xid=xid, slowdown=None, at=NOW - 20)


def worker(name: str, lr: int, rank: int, step: int, rate: float):
    return schema.worker_key(JOB, name, lr), schema.WorkerRecord(
        pid=100 + rank, global_rank=rank, local_rank=lr, plan_version=2, step=step,
        last_progress_at=NOW - 1, steps_per_s=rate)


def plan(version: int, devices: list[str], layout: Plan, reason: str):
    rec = schema.PlanRecord(version=version, reason=reason, devices=devices,
                            strategy=layout.to_dict(), store_endpoint="h-a:29500",
                            created_at=NOW - 50 + version)
    return [(schema.plan_history_key(JOB, version), rec)], rec


def event(seq: int, type_: str, node_id=None, detail=None, timings=None, at=0.0):
    return schema.event_key(JOB, seq), typed_event(seq, type_, detail, node_id,
                                                   at or NOW - 40 + seq, timings)


def failed_gpu_job() -> list[tuple[str, schema.Record]]:
    """Two nodes of 2 GPUs; b:1 failed; plan v1 (2 pipelines) replaced by v2 without b:1."""
    v1_devs = ["a:0", "a:1", "b:0", "b:1"]
    v2_devs = ["a:0", "a:1", "b:0"]
    h1, _ = plan(1, v1_devs, simple_plan(dp=2, tp=2, num_layers=8, global_batch=8), "start")
    v2 = Plan((Pipeline((Stage((0, 1), (0, 8)),), 1, 4), Pipeline((Stage((2,), (0, 8)),), 1, 4)),
              8, 8)
    h2, current = plan(2, v2_devs, v2, "failure b:1")
    return [
        node("a", 2), node("b", 2),
        health("a", 0, "healthy"), health("a", 1, "healthy"), health("b", 0, "degraded", "slow"),
        health("b", 1, "failed", "Xid 79: fell off the bus", 79),
        worker("a", 0, 0, 11, 2.0), worker("b", 0, 2, 9, 0.0), worker("a", 1, 1, 11, 4.0),
        *h1, *h2, (schema.plan_current_key(JOB), current),
        event(1, "failure", "b", change("failure", ["b:1"], "Xid 79", 2)),
        event(2, "replan", "a", replan(2, 1, "failure b:1: Xid 79")),
        event(3, "switch-done", "a", done(2, 1, bytes_moved=1 << 30),
              {"reshard_s": 0.5, "total_s": 1.25}),
        (schema.leader_key(JOB), schema.LeaderRecord(node="a", since=NOW - 60,
                                                     candidate_key="k", term=7)),
    ]


def test_view_names_failed_gpu_and_the_plan_that_replaced_it():
    view = JobView.build(JOB, failed_gpu_job(), now=NOW, revision=42)
    doc = view.document()
    assert doc["format"] == STATUS_FORMAT and doc["version"] == STATUS_VERSION
    [failed] = doc["devices"]["failed"]
    assert failed["id"] == "b:1" and failed["reason"] == "Xid 79: fell off the bus"
    assert failed["xid"] == 79 and failed["replaced_by_plan"] == 2 and not failed["in_plan"]
    assert doc["devices"]["counts"] == {"healthy": 2, "degraded": 1, "suspect": 0, "failed": 1,
                                        "unknown": 0, "lost": 0}
    assert doc["plan"]["version"] == 2 and "b:1" not in doc["plan"]["devices"]
    stages = [[s["devices"] for s in p["stages"]] for p in doc["plan"]["pipelines"]]
    assert stages == [[["a:0", "a:1"]], [["b:0"]]]
    a1 = next(d for n in doc["nodes"] for d in n["devices"] if d["id"] == "a:1")
    assert a1["placement"] == {"pipeline": 0, "stage": 0, "tp_rank": 1}
    assert [p["version"] for p in doc["plan_history"]] == [1, 2]
    assert doc["leader"]["node"] == "a" and doc["leader"]["term"] == 7
    assert doc["throughput"]["step"] == 11 and doc["throughput"]["steps_per_s"] == 3.0
    json.dumps(doc)  # plain JSON all the way down


def test_switches_pair_by_version_and_feed_the_counters():
    view = JobView.build(JOB, failed_gpu_job(), now=NOW)
    [sw] = view.switches
    assert (sw.from_version, sw.to_version, sw.state) == (1, 2, "done")
    assert sw.duration_s == 1.25 and sw.bytes_moved == 1 << 30
    c = view.document()["switches"]
    assert (c["total"], c["failed"], c["seconds_total"], c["bytes_moved_total"]) == \
        (1, 0, 1.25, 1 << 30)
    # no total_s: the timings add up; no timings: done.at - start.at
    records = [event(1, "replan", detail=replan(3), at=NOW - 10),
               event(2, "switch-done", detail=done(3), at=NOW - 7),
               event(3, "replan", detail=replan(4), at=NOW - 5),
               event(4, "switch-failed", detail=failed(4, "slice w3 lost", 3), at=NOW - 4),
               event(5, "replan", detail=replan(5), at=NOW - 2)]
    view = JobView.build(JOB, records, now=NOW)
    assert [(s.to_version, s.state, s.duration_s) for s in view.switches] == \
        [(3, "done", 3.0), (4, "failed", 1.0), (5, "running", None)]
    assert view.switches[1].reason == "slice w3 lost"
    assert view.counters["total"] == 1 and view.counters["failed"] == 1
    [wait] = view.waits
    assert wait.kind == "switch" and wait.done == 0 and wait.elapsed_s == 2.0


def test_absent_pieces_are_none_and_lost_nodes_come_from_the_plan():
    h, cur = plan(1, ["a:0", "c:0"], simple_plan(dp=2, num_layers=2, global_batch=2), "start")
    view = JobView.build(JOB, [node("a", 1), *h, (schema.plan_current_key(JOB), cur)], now=NOW)
    doc = view.document()
    assert doc["leader"] is None and doc["events"]["recent"] == [] and doc["waits"] == []
    c = next(n for n in doc["nodes"] if n["id"] == "c")
    assert not c["present"] and c["state"] == "lost"
    assert [d["health"] for d in c["devices"]] == ["lost"]
    a0 = next(n for n in doc["nodes"] if n["id"] == "a")["devices"][0]
    assert a0["health"] == "unknown" and a0["in_plan"]
    empty = JobView.build(JOB, [], now=NOW).document()
    assert empty["plan"] is None and empty["nodes"] == [] and empty["throughput"]["step"] is None


def test_strategy_without_a_layout_is_shown_raw():
    rec = schema.PlanRecord(version=1, reason="start", devices=["a:0"], strategy={"dp": 1},
                            store_endpoint="x:1", created_at=NOW)
    view = JobView.build(JOB, [(schema.plan_current_key(JOB), rec)], now=NOW)
    assert view.plan.pipelines == [] and "no pipelines" in view.plan.layout_error
    text = _render_text(view)
    assert "no pipelines" in text and '"dp": 1' in text


def test_bad_records_are_reported_not_raised():
    good, bad = decode_pairs([(schema.node_key(JOB, "a"), b"{not json"),
                              (schema.event_seq_key(JOB), b'{"schema":2,"kind":"counter",'
                                                          b'"value":3}')])
    assert len(good) == 1 and bad[0][0] == schema.node_key(JOB, "a")
    view = JobView.build(JOB, good, now=NOW, bad=bad)
    assert view.document()["problems"][0]["problem"].startswith("malformed JSON")


def test_rendezvous_wait_counts_joined_nodes():
    st = schema.RdzvStateRecord(round=3, state="joining", restart_count=1, participants=[],
                                reason="node b left", at=NOW - 4)
    joined = schema.RdzvJoinRecord(node="a", host="h", local_world_size=2, node_rank=None,
                                   at=NOW - 3)
    view = JobView.build(JOB, [(schema.rdzv_state_key(JOB), st),
                               (schema.rdzv_join_key(JOB, 3, "a"), joined)], now=NOW)
    [wait] = view.waits
    assert (wait.kind, wait.done, wait.total, wait.elapsed_s) == ("rendezvous", 1, None, 4.0)
    assert view.rendezvous["joined"] == ["a"]


def test_event_summaries_are_one_line():
    _, ev = event(1, "failure", "a", schema.FailureDetail(
        devices=["a:1"], reason="worker failure", round=0,
        exits=[schema.ExitInfo(local_rank=1, pid=7, exitcode=None, signal=9, global_rank=1)]))
    assert event_summary(ev) == "worker failure: rank 1 exitcode -9"
    _, ev = event(2, "switch-done", None, done(2, 1, bytes_moved=3 << 20), {"total_s": 0.5})
    assert event_summary(ev) == "plan v1 -> v2 in 0.50s, 3.0 MiB moved"
    _, ev = event(3, "stall", "a", schema.StallDetail(
        devices=["a:0"], reason="hang", local_rank=0, pid=8, step=4, stalled_s=2.5))
    assert event_summary(ev) == "device a:0 stalled at step 4 for 2.5s"
    _, ev = event(4, "replan", "a", replan(3, 2, "failure a:1: worker failure", devices=3))
    assert event_summary(ev) == "plan v3 over 3 devices: failure a:1: worker failure"


def _metrics(view: JobView) -> dict[str, float]:
    text = exposition(make_registry(lambda: view)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "job")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_parse_and_follow_the_view():
    m = _metrics(JobView.build(JOB, failed_gpu_job(), now=NOW, leader_changes=2))
    assert m["hspmd_switches_total"] == 1 and m["hspmd_switch_seconds_total"] == 1.25
    assert m["hspmd_switch_bytes_moved_total"] == 1 << 30
    assert m["hspmd_leader_changes_total"] == 2
    assert m["hspmd_devices{health=failed}"] == 1 and m["hspmd_devices{health=healthy}"] == 2
    assert m["hspmd_events_total{type=failure}"] == 1
    assert m["hspmd_steps_per_second"] == 3.0 and m["hspmd_plan_version"] == 2


def _render_text(view: JobView) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(render(view, "127.0.0.1:2379"))
    return console.file.getvalue()


def test_terminal_render_shows_plan_failed_gpu_and_events():
    text = _render_text(JobView.build(JOB, failed_gpu_job(), now=NOW))
    assert "Plan v2 (failure b:1)" in text and "layers 0-7" in text
    assert re.search(r"b:1\s+.*failed\s+.*Xid 79: fell off the bus.*plan v2", text)
    assert "switch-done" in text and "1.25s" in text and "a (term 7" in text
    empty = _render_text(JobView.build(JOB, [], now=NOW))
    for words in ("no plan published", "no leader elected", "no nodes registered",
                  "Events: none recorded"):
        assert words in empty


def test_operations_doc_lists_every_metric_and_document_field():
    doc = DOC.read_text()
    view = JobView.build(JOB, failed_gpu_job(), now=NOW)
    text = exposition(make_registry(lambda: view)).decode()
    names = {fam.name for fam in text_string_to_metric_families(text)}
    for name in names:
        exposed = name + "_total" if f"# TYPE {name}_total counter" in text or \
            f"# TYPE {name} counter" in text else name
        assert f"`{exposed}`" in doc, f"{exposed} is not documented in {DOC.name}"
    for field in view.document():
        assert f"`{field}`" in doc, f"status document field {field!r} not in {DOC.name}"


def test_progress_bars_follow_the_waits():
    from launcher.ops.progress import WaitProgress

    records = [event(1, "replan", detail=replan(2, 1)), *failed_gpu_job()[:2]]
    h, cur = plan(2, ["a:0", "b:0"], simple_plan(dp=2, num_layers=2, global_batch=2), "x")
    records += [(schema.plan_current_key(JOB), cur),
                (schema.switch_ack_key(JOB, 2, "a"), schema.SwitchAckRecord(
                    node="a", plan_version=2, state="done", at=NOW))]
    console = Console(file=io.StringIO(), width=120, force_terminal=True, color_system=None)
    with WaitProgress(console) as bars:
        assert not bars.sync(JobView.build(JOB, records, now=NOW))
        assert bars.labels == ["switch"]
        assert "switch to plan v2: nodes done" in console.file.getvalue()
        assert "1/2" in console.file.getvalue()
        ended = event(2, "switch-done", detail=done(2, 1))
        assert bars.sync(JobView.build(JOB, records + [ended], now=NOW))
        assert bars.labels == []


def test_switches_as_the_leader_and_the_runtime_journal_them():
    """A leader's ``replan`` starts a switch (not the first plan); the runtime's
    ``switch-done`` carries the versions and bytes in its detail, its phases in its timings
    (SwitchTimings.numeric())."""
    timings = {"from_version": 1.0, "to_version": 2.0, "rank": 0.0, "detect_s": 0.01,
               "regroup_s": 0.02, "bsr_s": 0.2, "bsr_bytes_total": 4096.0, "total_s": 0.3,
               "resume_step": 7.0}
    records = [
        event(1, "replan", "a", replan(1, 0, "start", devices=2),
              {"plan_s": 0.1, "detect_to_publish_s": 0.2}),
        event(2, "leave", "b", change("leave", ["b:0"], "node b left", 2)),
        event(3, "replan", "a", replan(2, 1, "leave b", devices=1)),
        event(4, "switch-done", "a", done(2, 1, bytes_moved=4096), timings),
        event(5, "replan", "a", replan(3, 2, "join b")),
        event(6, "replan", "a", replan(4, 3, "join c")),
    ]
    view = JobView.build(JOB, records, now=NOW)
    assert [(s.from_version, s.to_version, s.state) for s in view.switches] == \
        [(1, 2, "done"), (2, 3, "superseded"), (3, 4, "running")]
    first = view.switches[0]
    assert first.duration_s == 0.3 and first.bytes_moved == 4096
    assert view.counters["total"] == 1 and view.counters["bytes_moved_total"] == 4096
    recent = {e["seq"]: e for e in view.document()["events"]["recent"]}
    assert recent[1]["summary"] == "plan v1 over 2 devices: start"
    assert recent[1]["duration_s"] == 0.2
    assert recent[2]["summary"] == "node b left (device b:0)"
    assert recent[4]["summary"] == "plan v1 -> v2 in 0.30s, 4.0 KiB moved"


def test_a_suspect_gpu_is_counted_listed_rendered_and_exported():
    records = [r for r in failed_gpu_job() if r[0] != schema.device_key(JOB, "a", 1)]
    records.append(health("a", 1, "suspect", "row remapping pending"))
    view = JobView.build(JOB, records, now=NOW, revision=42)
    doc = view.document()
    assert doc["devices"]["counts"]["suspect"] == 1
    assert [d["id"] for d in doc["devices"]["suspect"]] == ["a:1"]
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(view, "127.0.0.1:2379"))
    assert "1 suspect" in out.getvalue()
    families = {f.name: f for f in text_string_to_metric_families(
        exposition(make_registry(lambda: view)).decode())}
    assert any(s.labels["health"] == "suspect" and s.value == 1
               for s in families["hspmd_devices"].samples)


def test_length_buckets_are_listed_rendered_and_a_bad_one_is_named():
    home = simple_plan(dp=2, num_layers=2, global_batch=8)
    own = simple_plan(pp=2, num_layers=2, global_batch=2, num_microbatches=2)
    rec = schema.PlanRecord(version=3, reason="start", devices=["a:0", "a:1"],
                            strategy=home.to_dict(), store_endpoint="x:1", created_at=NOW,
                            buckets=[{"window": 4, "start": 0, "strategy": simple_plan(
                                dp=2, num_layers=2, global_batch=6).to_dict()},
                                {"window": 16, "start": 6, "strategy": own.to_dict()},
                                {"window": 32, "start": 8, "strategy": {"dp": 1}}])
    view = JobView.build(JOB, [(schema.plan_current_key(JOB), rec)], now=NOW)
    short, long_, bad = view.plan.buckets
    assert (short["window"], short["rows"], short["switches"]) == (4, 6, False)
    assert (long_["window"], long_["start"], long_["switches"]) == (16, 6, True)
    assert long_["layout"] == "tp1:L0-0+tp1:L1-1 x2"
    assert bad["error"].startswith("not a valid bucket")
    assert json.loads(json.dumps(view.document()))["plan"]["buckets"][1]["window"] == 16
    text = _render_text(view)
    assert "16 tokens, rows 6+2: tp1:L0-0+tp1:L1-1 x2 (own plan, switched in the step)" in text
    assert "4 tokens, rows 0+6" in text and "(home layout)" in text and "bucket 2: not a" in text
