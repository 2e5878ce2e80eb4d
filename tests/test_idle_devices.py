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

from _elastic_job import ElasticLaunchJob
from _wait import wait_for

from hspmd_elastic.coord.plans import read_plan
from launcher.ops.state import read_view

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
NODE = "idle"
# the suite's agents give every worker a role (``PET_HSPMD_ALL_DEVICES=on``); these do not
PLANNER_IDLES = ("--hspmd-all-devices", "off")
USED, IDLE = f"{NODE}:0", f"{NODE}:1"


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
    from _elastic_job import DATA_SEED, SEED, TINY, job_workers

    from hspmd_elastic.contract import schema
    from hspmd_elastic.coord import read_events
    from launcher.cgroups import CpuQuota, worker_cgroup

    job, steps, batch = f"ix-{uuid.uuid4().hex[:8]}", 3000, 4  # long enough to measure
    payload = _elastic.reference_payload(TINY, steps=steps, global_batch=batch, seed=SEED,
                                         data_seed=DATA_SEED, adam_eps=1.0)
    agent, out = idle_agent(tmp_path, marker, etcd_server, job, batch=batch, steps=steps)
    client = job_client(etcd_server)
    quota = CpuQuota(job)
    try:
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
        import torch

        results = {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
                   for p in sorted(out.glob("*.pt"))}
        assert set(results) == {USED}
        _elastic.assert_recovered_in_memory(results, {USED: used.pid}, payload)
    finally:
        quota.close()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        client.close()


def job_client(etcd_server):
    from hspmd_elastic.coord.client import EtcdClient

    return EtcdClient(etcd_server.endpoints, timeout=5.0)


def idle_agent(tmp_path, marker, etcd_server, job: str, *, batch: int, steps: int):
    """``_elastic_job.straggler_agent`` on ``TINY`` (AdamW eps 1.0), with a planner that may
    leave a device idle; the agent and its workers' results folder."""
    from _elastic_job import TINY, elastic_argv
    from launch_harness import Launcher, base_env

    model, out = tmp_path / "model.json", tmp_path / "out"
    model.write_text(TINY.to_json())
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", NODE, "--shutdown-timeout", "5",
                      *elastic_argv(model, batch, "--hspmd-straggler-dwell", "1", *PLANNER_IDLES,
                                    steps=steps, out=out,
                                    train=("--timeout", "60", "--adam-eps", "1"))],
                     base_env(marker), tmp_path, NODE)
    return agent, out
