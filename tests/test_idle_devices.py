"""A device the plan leaves idle stays in the job, end to end: a real ``hspmd-launch
--hspmd-elastic`` agent of two ``elastic_train.py`` workers on a real etcd, training ``TINY``,
whose per-step fixed costs make the cost model plan one device and leave the other idle
(``Estimate.idle``). Checks:

* the idle slot runs a worker that holds nothing (no rank) and probes its device: its record
  carries ``probe_s`` > 0 and a growing ``probes`` count under the current plan, which is the
  leader's speed sample for an idle device (``launcher.leader.stragglers``);
* ``status --json``'s view names the device as idle, with why;
* the job succeeds, the idle worker leaves by itself when it ends (no failure), and the
  parameters equal the fault-free dense reference (float64).
"""

from __future__ import annotations

import pytest

import _elastic
from _elastic_job import REFERENCE, ElasticLaunchJob
from _wait import wait_for

from hspmd_elastic.coord.plans import read_plan
from launcher.ops.state import read_view

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
NODE = "idle"
# the suite's agents give every worker a role (``PET_HSPMD_ALL_DEVICES=on``); these do not
PLANNER_IDLES = ("--hspmd-all-devices", "off")
USED, IDLE = f"{NODE}:0", f"{NODE}:1"
LONG_STEPS = 1500  # TINY's steps take milliseconds: this outlasts an idle worker's start


def test_an_idle_device_keeps_a_probing_worker_and_the_job_still_equals_the_reference(
        tmp_path, marker, etcd_server):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="idl") as job:
        job.start(NODE, 2, *PLANNER_IDLES, nnodes=1)
        plan = wait_for(lambda: job.check_agents() or read_plan(job.client, job.name)[0], 60,
                        "plan v1")
        assert plan.devices == [USED] and IDLE in plan.inventory, plan  # the cost model's call

        def probing():
            job.check_agents()
            rec = job.workers().get(IDLE)
            return rec if rec is not None and rec.probes >= 3 and rec.probe_s > 0 else None

        idle = wait_for(probing, 60, f"{IDLE}'s worker probing its device")
        assert idle.global_rank == -1 and idle.plan_version == plan.version and idle.busy_s == 0
        later = wait_for(lambda: (r := job.workers().get(IDLE)) is not None
                         and r.probes > idle.probes and r, 30, "more probes")
        assert later.pid == idle.pid  # the same idle worker goes on measuring

        view = read_view(job.client, job.name, timeout=5.0)
        devices = {d.id: d for n in view.nodes for d in n.devices}
        assert devices[IDLE].idle and devices[USED].idle is None, devices[IDLE]

        job.wait_paused([USED])
        job.release.touch()
        job.finish(timeout=90)
        results = job.results()
        assert set(results) == {USED}  # the idle worker held nothing, saved nothing
        job.assert_replicas_match_reference(results)
        assert not [e for e in job.events() if e.type == "failure"]


def test_a_throttled_idle_device_is_measured_by_its_probes_and_named_in_a_speeds_event(
        tmp_path, marker, etcd_server):
    """The idle worker's CPU quota is cut (``launcher.cgroups``, as the straggler tests do):
    its probes make the leader measure the idle device slow, and the decision on that
    (``speeds`` event: no replan, nothing to gain, the plan already leaves it idle) names it
    idle with its measured speed and the step times with and without it; ``status`` shows the
    same reason; the job's parameters equal the dense reference."""
    import uuid

    import _elastic
    from _elastic_job import DATA_SEED, SEED, TINY, job_workers, throttled_job, worker_results

    from hspmd_elastic.contract import schema
    from hspmd_elastic.coord import read_events
    from launcher.cgroups import worker_cgroup

    job, steps, batch = f"ix-{uuid.uuid4().hex[:8]}", 4500, 4  # long enough to measure
    payload = _elastic.reference_payload(TINY, steps=steps, global_batch=batch, seed=SEED,
                                         data_seed=DATA_SEED, adam_eps=1.0)
    # AdamW's eps 1.0, as the straggler tests; a planner that may leave a device idle
    with throttled_job(tmp_path, marker, etcd_server, TINY, job, NODE, batch=batch, steps=steps,
                       adam_eps=1.0, flags=PLANNER_IDLES) as (agent, out, client, quota):
        idle = wait_for(lambda: (r := job_workers(client, job).get(1)) is not None
                        and r.probes >= 1 and r, 60, f"{IDLE}'s worker probing",
                        proc=agent.proc)
        used = job_workers(client, job)[0]
        quota.place(worker_cgroup(NODE, 0), used.pid, 0.8)
        quota.place(worker_cgroup(NODE, 1), idle.pid, 0.05)  # the idle device is slow

        def named():
            for ev in read_events(client, job):
                d = schema.event_detail(ev) if ev.type == "speeds" else None
                if d is not None and IDLE in d.idle and d.measured.get(IDLE, 1.0) < 1.0:
                    return d
            return None

        decision = wait_for(named, 90, f"a speeds event naming {IDLE} idle", proc=agent.proc)
        assert not decision.replan and decision.gain_s == 0, decision  # nothing to gain
        why = decision.idle[IDLE]
        assert why.speed == decision.measured[IDLE] < 1.0  # measured by its probes
        assert why.step_with_s > why.step_without_s > 0  # using it would cost the step
        view = read_view(client, job, timeout=5.0)
        devices = {d.id: d for n in view.nodes for d in n.devices}
        assert devices[IDLE].idle == why.reason
        assert agent.wait(180) == 0, agent.stderr()[-4000:]
        results = worker_results(out)
        assert set(results) == {USED}
        _elastic.assert_recovered_in_memory(results, {USED: used.pid}, payload)


def test_a_device_a_slowdown_leaves_idle_hands_its_optimizer_shard_over_then_probes(
        tmp_path, marker, etcd_server):
    """Uneven optimizer shards (each row's AdamW moments on one holder) over three workers, the
    planner's CPU compute slowed so that the first plan uses all three (``--hspmd-device-types``);
    then device 2 runs at an eighth of its speed (a scripted ``thermal`` verdict) and the next
    plan leaves it idle. It owns moments nobody else has, so that plan drains it: its state
    leaves by BSR before its worker leaves (no checkpoint exists), and its slot then gets an idle
    worker that probes it. No failure; the parameters equal the fault-free dense reference."""
    from launcher.health.scripted import Fault, encode_fault_script

    from hspmd_elastic.contract import schema

    types = tmp_path / "types.json"
    types.write_text('{"CPU": {"peak_tflops": 1e-05}}')
    slow = f"{NODE}:2"
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="idr") as job:
        # long enough after the switch for the idle worker to start and probe
        job.start(NODE, 3, *PLANNER_IDLES, "--hspmd-optimizer-shards", "uneven",
                  "--hspmd-device-types", str(types), "--hspmd-health-source", "scripted:etcd",
                  nnodes=1, train=("--steps", str(LONG_STEPS), "--adam-eps", "1.0"))
        devices = [f"{NODE}:{i}" for i in range(3)]
        pids = job.wait_paused(devices)
        assert sorted(job.plans()[1][1]) == devices
        job.client.put(schema.fault_script_key(job.name, NODE), encode_fault_script(
            [Fault(2, "thermal", slowdown=0.125, reason="thermal slowdown to 1/8")]))

        def idling_plan():
            later = [(v, names) for v, (_p, names) in job.plans().items() if v > 1]
            return later[-1] if later and slow not in later[-1][1] else None

        version, names = wait_for(lambda: job.check_agents() or idling_plan(), 60,
                                  f"a plan that leaves {slow} idle")
        rec = read_plan(job.client, job.name)[0]
        assert rec.version == version and rec.drain == [slow] and slow in rec.inventory, rec
        job.release.touch()

        def probing():
            job.check_agents()
            w = job.workers().get(slow)
            return w if w is not None and w.pid != pids[slow] and w.probes >= 1 else None

        idle = wait_for(probing, 60, f"an idle worker probing {slow}")
        assert idle.global_rank == -1 and idle.busy_s == 0
        job.finish(timeout=90)
        events = job.events()
        drained = [e for e in events if e.type == "drained"]
        assert [schema.event_detail(e).device for e in drained] == [slow], [
            (e.type, e.detail) for e in events]
        assert drained[0].timings["bsr_bytes_sent"] > 0  # the moments only it held
        assert not {"failure", "fallback", "switch-failed"} & {e.type for e in events}
        results = job.results()
        assert set(results) == set(devices) - {slow}  # the idle worker saved nothing
        for dev, res in results.items():
            assert res["pid"] == pids[dev] and res["state"] == "done", (dev, res["state"])
            assert res["steps_done"] == LONG_STEPS
        # every element held (a moment nobody sent would leave NaN) and equal to the reference
        # (AdamW's eps 1.0, as the straggler tests: over many steps the plans' other orders of
        # adding rows must not let last-bit differences grow)
        _elastic.assert_matches_reference(results.values(),
                                          dict(REFERENCE, steps=LONG_STEPS, adam_eps=1.0),
                                          tol=1e-9)
