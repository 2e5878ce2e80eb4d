"""A speed-driven replan keeps the job's redundancy, so the next kill is survived in memory.

Two CPU workers of one ``hspmd-launch --hspmd-elastic`` job train data-parallel (a full replica
on each). One worker's CPU cgroup quota is cut to a fiftieth of a core (``launcher.cgroups``, the
``throttle`` fault's mechanism): the leader measures it and replans for its speed. The fastest
plan using both workers is a pipeline (one copy of every parameter slice), and it is what the
leader used to publish: killing the other worker then ended the job with "no live owner". Under
the redundancy rule (``hspmd_elastic.planner.copies``) the speed plan keeps both replicas, the
slow worker with fewer rows, and the ``speeds`` event says the copies were kept. Then the fast
worker is SIGKILLed: the switch is from the survivor's memory, and the final parameters equal
the fault-free run (float64, 1e-9).
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

import _elastic
from _elastic_job import DATA_SEED, SEED, measuring_pids, throttled_job, worker_results
from _wait import wait_for

from hspmd_elastic.contract import schema
from hspmd_elastic.coord import read_events
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.coord.plans import read_plan
from hspmd_elastic.graph.config import ModelConfig
from launcher.cgroups import available, worker_cgroup

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

# Four layers: the fastest two-worker plan for a worker at a tenth of the other's speed is the
# pipeline [0 L0-3 > 1 L3-4] (``test_redundancy_rule.py`` checks it on the model of the report)
MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, ffn_size=128,
                    seq_len=32, dtype="float64")
STEPS, BATCH = 120, 8
NODE = "rn"
# of a core: the straggler well below an eighth of the other's speed even when the machine is
# busy and the fast worker gets less than its quota (the regime where the pipeline looks fastest)
FAST, SLOW = 0.8, 0.02
SLOW_PLANNED = 0.125  # at this speed or below the search ranks the pipeline first
ADAM_EPS = 1.0


def _events(client, job: str, type_: str) -> list:
    return [(ev, schema.event_detail(ev)) for ev in read_events(client, job) if ev.type == type_]


def _degrade_replans(client, job: str, device: str) -> list:
    return [d for _, d in _events(client, job, "replan")
            if any(c.kind == "degrade" and device in c.devices for c in d.changes)]


def _plan_record(client, job: str, version: int):
    return next((r for kv in client.get_prefix(schema.plan_history_prefix(job))
                 for r in [schema.decode(kv.key, kv.value)] if r.version == version), None)


def _fastest_copies(measured: dict, devices) -> int:
    """Copies of the plan the search ranks first at ``measured`` speeds (device -> speed)
    without the rule."""
    from hspmd_elastic.planner import (Device, Inventory, PlannerOptions, plan_for,
                                       profile_from_config, spec_for_device)

    cpu = spec_for_device("CPU", None)
    inventory = Inventory(tuple(Device(i, NODE, cpu, slowdown=1 / measured[d])
                                for i, d in enumerate(devices)))
    result = plan_for(inventory, profile_from_config(MODEL), BATCH,
                      options=PlannerOptions(use_all_devices=True))
    return len(result.plan.pipelines)  # each pipeline holds every slice once


def test_a_speed_replan_keeps_both_replicas_and_the_job_survives_the_next_kill(
        tmp_path, marker, etcd_server):
    found, why = available()
    if found is None:
        pytest.skip(f"no CPU cgroups to throttle a worker with: {why}")
    job = f"rr-{uuid.uuid4().hex[:8]}"
    payload = _elastic.reference_payload(MODEL, steps=STEPS, global_batch=BATCH, seed=SEED,
                                         data_seed=DATA_SEED, adam_eps=ADAM_EPS)
    fast_dev, slow_dev = f"{NODE}:0", f"{NODE}:1"
    with throttled_job(tmp_path, marker, etcd_server, MODEL, job, NODE, batch=BATCH, steps=STEPS,
                       adam_eps=ADAM_EPS) as (agent, out, client, quota):
        pids = measuring_pids(client, job, agent, 120)
        first = plan_of(read_plan(client, job)[0])
        assert len(first.pipelines) == 2  # DP2: a full replica on each worker
        quota.place(worker_cgroup(NODE, 0), pids[0], FAST)
        quota.place(worker_cgroup(NODE, 1), pids[1], SLOW)  # the straggler appears

        def slow_plan():  # a degrade plan made for the straggler's real speed
            for down in _degrade_replans(client, job, slow_dev):
                rec = _plan_record(client, job, down.version)
                if rec is not None and rec.inventory.get(slow_dev, 1.0) <= SLOW_PLANNED:
                    return down, rec
            return None

        down, rec = wait_for(slow_plan, 90, f"a replan for {slow_dev} at <= {SLOW_PLANNED}",
                             proc=agent.proc)
        speed_plan = plan_of(rec)
        rows = {rec.devices[p.stages[0].devices[0]]: p.rows for p in speed_plan.pipelines}
        # the hazard is real at the speeds the plan was made for: without the rule, the plan
        # the search ranks first (what the leader published) holds one copy
        assert _fastest_copies(rec.inventory, rec.devices) == 1, rec.inventory
        assert len(speed_plan.pipelines) == 2, (rec.inventory, speed_plan)  # replicas kept
        assert rows[slow_dev] < rows[fast_dev], rows  # the slow worker has less work
        decided = [d for _, d in _events(client, job, "speeds")
                   if d.replan and d.plan_version == down.version - 1]
        assert decided, _events(client, job, "speeds")
        speeds = decided[-1]  # the decision the plan answers
        assert (speeds.copies_before, speeds.copies_after) == (2, 2), speeds
        assert speeds.redundancy == "kept" and "redundancy kept" in speeds.reason, speeds

        # once the workers run the speed plan, the fast worker dies
        wait_for(lambda: any(d.plan_version == down.version
                             for _, d in _events(client, job, "switch-done")), 60,
                 f"the switch into plan v{down.version}", proc=agent.proc)
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: any(d.plan_version > down.version and d.source == "bsr"
                             for _, d in _events(client, job, "switch-done")), 60,
                 "an in-memory switch after the kill", proc=agent.proc)
        quota.set(worker_cgroup(NODE, 1), None)  # lifted: the rest of the run goes fast

        assert agent.wait(120) == 0, agent.stderr()[-4000:]
        failed = [d for _, d in _events(client, job, "switch-failed")]
        assert not failed, failed
        _elastic.assert_recovered_in_memory(worker_results(out), {slow_dev: pids[1]}, payload)
