"""The fault-injection harness against a real restart-mode job: real etcd, real hspmd-launch
agents, real workers over gloo, real signals. Five different faults; the job ends with the
parameters of a fault-free run and the report shows every fault injected, detected (or, for
the etcd restart, ridden through) and recovered, with no sample lost."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from _inject import injecting
from inject_train import reference_params
from launch_harness import SCRIPTS, Launcher, base_env

from launcher.inject.api import RECOVERED, SURVIVED
from launcher.inject.harness import Harness
from launcher.inject.report import all_handled, render_table
from launcher.inject.scenario import parse_scenario

pytestmark = pytest.mark.multiproc

# Enough steps that the last fault still lands mid-training: while a joining agent starts (it
# imports torch), the running round trains on, and faults are triggered one after the other.
STEPS, BATCH = 48, 12


def test_restart_mode_job_survives_five_faults(tmp_path, marker, etcd_server):
    job = f"inject-{uuid.uuid4().hex[:8]}"
    progress, snapshot = tmp_path / "progress", tmp_path / "snapshot.pt"
    script = [str(SCRIPTS / "inject_train.py"), "--steps", str(STEPS), "--batch", str(BATCH),
              "--snapshot", str(snapshot), "--progress-dir", str(progress),
              "--step-sleep", "0.25"]
    flags = ["--nnodes", "1:2", "--max-restarts", "5", "--shutdown-timeout", "5",
             "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60", "--hspmd-lease-ttl", "2"]
    env = base_env(marker, PET_LOG_DIR=str(tmp_path / "logs"))
    agent = Launcher(["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint_str,
                      "--rdzv-id", job, "--hspmd-node-id", "node-a", "--nproc-per-node", "2",
                      *flags, *script], env, tmp_path, "node-a")
    scenario = parse_scenario({
        "schema": 1, "kind": "fault_scenario", "name": "five-faults",
        "defaults": {"detect_timeout_s": 20, "recover_timeout_s": 40, "trigger_timeout_s": 60},
        "faults": [
            {"at": {"step": 3}, "fault": "kill-worker",
             "target": {"node": "node-a", "local_rank": 1}},
            {"at": {"step": 6}, "fault": "join", "target": {"node": "node-b"},
             "args": [*flags, "--nproc-per-node", "1", *script]},
            {"at": {"step": 9}, "fault": "etcd-restart", "down_s": 0.5},
            {"at": {"step": 12}, "fault": "kill-agent", "target": {"node": "node-b"}},
            {"at": {"step": 15}, "fault": "stop-worker",
             "target": {"node": "node-a", "local_rank": 0}, "escalate_after_s": 2},
        ]}, "five-faults")
    with injecting(etcd_server, job, progress, tmp_path / "inject", env,
                   [agent]) as (_client, observer, ctx):
        started = time.monotonic()
        report = Harness(scenario, ctx, observer, wait_end_s=60).run()
        code = agent.wait(60)
    table = render_table(report)
    print(table, f"\n(run took {time.monotonic() - started:.1f}s)")
    assert code == 0, agent.stderr()[-3000:]

    rows = {r.fault: r for r in report.rows}
    assert len(rows) == 5 and all_handled(report), table
    for fault in ("kill-worker", "join", "kill-agent", "stop-worker"):
        row = rows[fault]
        assert row.outcome == RECOVERED, table
        assert row.injected_at <= row.detected_at + 0.05 <= row.recovered_at + 0.05, table
        assert row.steps_lost is not None and 0 <= row.steps_lost <= 2, table
    assert rows["kill-worker"].detected_by.startswith("failure event")
    assert rows["join"].detected_by.startswith("join event")
    assert rows["kill-agent"].detected_by.split()[0] in ("leave", "failure")
    # restart mode has no hang detection: the job only noticed the SIGKILL of the escalation
    assert rows["stop-worker"].escalated and "after the escalation" in \
        rows["stop-worker"].detected_by
    etcd = rows["etcd-restart"]
    assert etcd.outcome == SURVIVED and etcd.detected_at is None and etcd.steps_lost == 0
    assert report.samples_lost == 0 and report.final_step == STEPS

    final = torch.load(snapshot, map_location="cpu")
    assert final["step"] == STEPS
    reference = reference_params(STEPS, BATCH)
    for name, value in reference.items():
        torch.testing.assert_close(final["model"][name], value, rtol=1e-9, atol=1e-12)
