"""The fault-injection harness against a real elastic job: real etcd, real
``hspmd-launch --hspmd-elastic`` agents as nodes on this host, two workers each over gloo, real
signals, device faults through ``--hspmd-health-source scripted:etcd``.

The scenario is ``examples/scenarios/elastic-five-faults.json`` (its join entry gets this test's
flags), seven different faults: a killed worker, a frozen worker (SIGSTOP; its agent's hang
detector declares it hung and kills it), a node joining (its workers get their state through
BSR), a fatal Xid on the new node, that node's agent killed (lease expiry), a thermal slowdown,
and last an etcd restart the job rides through (reported ``survived``: nothing to detect). The
first six are handled by the job itself, never by a restart: the detection is the job's own
record (a ``failure``/``stall``/``leave``/``join`` event, a failed or degraded verdict), the
recovery the ``switch-done`` event of the plan that handled it. The job ends with the parameters
of a fault-free run (float64, 1e-9), the workers that were never hit keep their pids, no switch
reads a checkpoint, the frozen worker is killed by its agent, and no sample is lost.

Samples lost: the final trajectory is, per plan version (``round``), the steps its ranks
completed (the progress log); a plan that resumes past the last step its predecessor completed
skipped those steps' global batches, and ``samples lost`` = skipped steps x global batch. A step
trained twice (a rank one step ahead rolls back from its undo copy) is not in the final
trajectory twice; that every global sample of steps ``[0, STEPS)`` went into the final
parameters exactly once is what the equality with the dense reference shows.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

import _elastic
from _inject import injecting

from launch_harness import SCRIPTS, Launcher, base_env, pid_alive, wait_for  # noqa: E402

from hspmd_elastic.coord import read_events, schema  # noqa: E402
from hspmd_elastic.coord.client import EtcdClient  # noqa: E402
from hspmd_elastic.graph.config import ModelConfig  # noqa: E402
from launcher.inject.api import RECOVERED, SURVIVED  # noqa: E402
from launcher.inject.harness import Harness  # noqa: E402
from launcher.inject.report import all_handled, render_table  # noqa: E402
from launcher.inject.scenario import parse_scenario  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

SCENARIO = Path(__file__).resolve().parent.parent / "examples" / "scenarios" / \
    "elastic-five-faults.json"
CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=8, dtype="float64")
STEPS, BATCH, SEED, DATA_SEED, STEP_TIME = 60, 4, 3, 7, 0.5
# The collectives give up after COMM_S (the peers of a frozen worker then report that they wait
# for a plan); a worker whose step does not advance for HANG_S is hung.
COMM_S, HANG_S = 5.0, 10.0


REFERENCE = _elastic.reference_payload(CONFIG, steps=STEPS, global_batch=BATCH, seed=SEED,
                                       data_seed=DATA_SEED)


def load_results(out: Path) -> dict[str, dict]:
    import torch

    return {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
            for p in sorted(out.glob("*.pt"))}


def worker_pids(client: EtcdClient, job: str) -> dict[str, int]:
    prefix = schema.workers_prefix(job)
    out = {}
    for kv in client.get_prefix(prefix):
        node, lr = kv.key[len(prefix):].split("/")
        out[f"{node}:{lr}"] = schema.decode(kv.key, kv.value).pid
    return out


def test_elastic_job_survives_seven_different_faults_in_memory(tmp_path, marker, etcd_server):
    job = f"inject-el-{uuid.uuid4().hex[:8]}"
    model, out, progress = tmp_path / "model.json", tmp_path / "out", tmp_path / "progress"
    model.write_text(CONFIG.to_json())
    flags = ["--nnodes", "2:3", "--nproc-per-node", "2", "--hspmd-lease-ttl", "2",
             "--shutdown-timeout", "5", "--rdzv-conf", "join_timeout=60",
             "--hspmd-health-source", "scripted:etcd", "--hspmd-elastic",
             "--hspmd-model", str(model), "--hspmd-global-batch", str(BATCH)]
    script = [str(SCRIPTS / "elastic_train.py"), "--config", str(model),
              "--steps", str(STEPS), "--global-batch", str(BATCH), "--seed", str(SEED),
              "--data-seed", str(DATA_SEED), "--out", str(out), "--progress-dir", str(progress),
              "--step-time", str(STEP_TIME), "--timeout", "30", "--comm-timeout", str(COMM_S)]
    env = base_env(marker, HSPMD_HANG_TIMEOUT_S=str(HANG_S), HSPMD_HANG_STARTUP_S="60")
    agents = {node: Launcher(["--rdzv-backend", "etcd", "--rdzv-endpoint",
                              etcd_server.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
                              *flags, *script], env, tmp_path, node)
              for node in ("node-a", "node-b")}
    body = json.loads(SCENARIO.read_text())
    for entry in body["faults"]:
        if entry["fault"] == "join":
            entry["args"] = [*flags, *script]
    scenario = parse_scenario(body, str(SCENARIO))
    assert len({f.fault for f in scenario.faults}) >= 5

    with injecting(etcd_server, job, progress, tmp_path / "inject", env,
                   agents.values()) as (client, observer, ctx):
        started = time.monotonic()
        first = ["node-a:0", "node-a:1", "node-b:0", "node-b:1"]
        pids = wait_for(lambda: (lambda w: w if set(first) <= set(w) else None)(
            worker_pids(client, job)), 60, "the first plan's workers")
        report = Harness(scenario, ctx, observer, wait_end_s=60).run()
        codes = {node: a.wait(60) for node, a in agents.items()}
        events = read_events(client, job)
    table = render_table(report)
    print(table, f"\n(run took {time.monotonic() - started:.1f}s)")
    assert codes == {"node-a": 0, "node-b": 0}, \
        {n: a.stderr()[-3000:] for n, a in agents.items()}

    rows = {r.fault: r for r in report.rows}
    assert len(rows) == len(scenario.faults) == 7 and all_handled(report), table
    for prev, row in zip(report.rows, report.rows[1:]):
        assert row.injected_at >= prev.recovered_at, table  # one at a time, after recovery
    etcd = rows.pop("etcd-restart")  # nothing to detect: training goes on
    assert etcd.outcome == SURVIVED and etcd.detected_at is None and etcd.steps_lost == 0, table
    for row in rows.values():
        assert row.outcome == RECOVERED and not row.escalated, table
        assert row.injected_at <= row.detected_at + 0.05 <= row.recovered_at + 0.05, table
        assert row.recovered_by.startswith("switch-done event"), table
        assert row.steps_lost is not None and 0 <= row.steps_lost <= 1, table
    assert rows["kill-worker"].detected_by.startswith("failure event")
    assert rows["xid"].detected_by.startswith("verdict failed")
    assert rows["thermal"].detected_by.startswith("verdict degraded")
    assert rows["join"].detected_by.startswith("join event")
    assert rows["hang"].detected_by.startswith("stall event")
    assert rows["kill-agent"].detected_by.split()[0] in ("leave", "failure")
    assert report.samples_lost == 0 and report.steps_skipped == 0, table
    assert report.final_step == STEPS, table

    hung = rows["hang"].detail["pid"]  # killed by its agent, not left stopped
    stall = next(e for e in events if e.type == "stall")
    assert stall.detail["pid"] == hung and stall.detail["device"] == "node-a:1"
    assert f"killed hung worker pid {hung} (slot 1)" in agents["node-a"].stderr()
    assert not pid_alive(hung)

    types = [e.type for e in events]
    assert not {"fallback", "restart", "switch-failed"} & set(types), types
    results = load_results(out)
    survivors = {d: pids[d] for d in ("node-a:0", "node-b:0")}
    diff = _elastic.assert_recovered_in_memory(results, survivors, REFERENCE)
    print(f"max |elastic - reference| = {diff:g}")


# ------------------------------------------------------------------- pure pieces it relies on
def test_replan_reasons_name_the_fault_they_handle():
    from launcher.inject.detect import Injected, handling_plan, replan_changes

    assert replan_changes("failure node-a:1,node-a:2: Xid 79: gone; join node-c; "
                          "store x:1 -> y:2") == [("failure", ("node-a:1", "node-a:2")),
                                                  ("join", ("node-c",)),
                                                  ("store", ("x:1 -> y:2",))]
    assert replan_changes("degrade node-a:0: speed 100% -> 50%") == [("degrade", ("node-a:0",))]

    def replan(seq, version, reason):
        return schema.EventRecord(seq=seq, type="replan", node="node-b",
                                  detail={"version": version, "reason": reason}, timings={},
                                  at=float(seq))

    events = [replan(3, 2, "failure node-b:1: worker exit: killed"),
              replan(6, 3, "stall node-a:1: worker 1 hung at step 6"),
              replan(9, 4, "join node-c"), replan(12, 5, "leave node-c"),
              replan(14, 6, "degrade node-a:0: speed 100% -> 50%")]
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
    events = [schema.EventRecord(seq=3, type="failure", node="node-b", detail={"pid": 42},
                                 timings={}, at=3),
              schema.EventRecord(seq=4, type="switch-done", node="node-a",
                                 detail={"plan_version": 1}, timings={"to_version": 1.0}, at=4),
              schema.EventRecord(seq=5, type="replan", node="node-a",
                                 detail={"version": 2, "reason": "failure node-b:1: x"},
                                 timings={}, at=5),
              schema.EventRecord(seq=6, type="switch-done", node="node-a",
                                 detail={"plan_version": 2}, timings={"to_version": 2.0}, at=6)]
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
