"""The HSPMD path end to end: real etcd, ``hspmd-launch --hspmd-elastic`` agents as nodes of this
host, real gloo workers, real SIGKILLs.

The agents declare their devices small (``--hspmd-device-memory``), so the leader's planner
shards the model (TP and/or PP) as it would on GPUs that cannot hold a replica. A worker
SIGKILLed mid-run (the suite's shared worker-kill run, ``_elastic_job.worker_kill_run``, read
here for resharding) forces a differently specialized plan: the survivors reshard weights and
AdamW state by fused BSR into it (bytes moved, read from the journal's ``switch-done`` timings),
every DP replica ends equal, and the parameters equal the fault-free dense reference (float64; a
slice nobody holds stays NaN and fails the check).
A GPU that shows warning signs (a scripted ``suspect`` verdict) is drained: the next plan leaves
it out while it still works, it serves as a BSR source in that switch (the bytes its state sent
are in its ``drained`` event), then its worker leaves and the device stays out. With
``--hspmd-redundancy 2`` ("every parameter slice on both nodes", a hard constraint) and no plan
that can keep it, nothing is published and the job fails on every agent with one line naming
the shortfall (the same judge ends a job whose fault leaves no such plan, and the planner never
returns a plan that breaks it: ``tests/test_planner_capacity.py``). The job harness is
``tests/_elastic_job.py`` (its agents pass ``--hspmd-redundancy 2`` unless a test says otherwise).
"""

from __future__ import annotations

import pytest

from _elastic_job import KILL_VICTIM, STEPS, ElasticLaunchJob, shared_worker_kill_run
from _wait import wait_for

from hspmd_elastic.contract import schema

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]

MEMORY = "150KiB"  # one replica needs about 235 KiB (weights, gradients, AdamW, activations)
NODES = ("node-a", "node-b")


@pytest.fixture
def job(etcd_server, tmp_path, marker):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="hs", redundancy=2) as j:
        yield j


def specialization(plan) -> list:
    """Per pipeline, per stage: (TP degree, layer range)."""
    return sorted(tuple((s.tp, s.layers) for s in p.stages) for p in plan.pipelines)


def roles(plan, devices: list[str]) -> dict[str, tuple]:
    """device -> (TP degree, TP rank, layer range) in ``plan``."""
    return {devices[d]: (s.tp, r, s.layers) for p in plan.pipelines for s in p.stages
            for r, d in enumerate(s.devices)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The suite's one worker-kill run (``tests/_elastic_job.py``), read here for resharding."""
    return shared_worker_kill_run(tmp_path_factory)


@pytest.mark.timeout(180)  # it may start the shared run (30-60 s on two busy cores)
def test_a_worker_kill_reshards_into_a_differently_specialized_plan(killed):
    """The shared run: 5 workers on two nodes declared at 200 KiB (one replica needs about
    235 KiB): plan v1 shards the model (TP and/or PP); SIGKILLing node-b:1 forces a plan with
    another TP degree, layer split or pipeline count; the survivors move real bytes by BSR,
    every DP replica ends equal, and the result equals the fault-free reference."""
    run = killed.checked()
    pids, victim = run.pids, KILL_VICTIM
    devices = list(pids)
    v1, names1 = run.plans()[1]
    assert sorted(names1) == sorted(devices), names1
    assert any(s.tp > 1 for p in v1.pipelines for s in p.stages) or \
        any(len(p.stages) > 1 for p in v1.pipelines), v1
    plans = run.plans()
    last = max(plans)
    v2, names2 = plans[last]
    assert last >= 2 and victim not in names2
    assert specialization(v2) != specialization(v1), (v1, v2)
    before, after = roles(v1, names1), roles(v2, names2)
    assert any(before[d] != after[d] for d in after), (before, after)
    events = run.events()
    done = [schema.event_detail(e) for e in events if e.type == "switch-done"
            and schema.event_detail(e).plan_version == last]
    assert done and done[0].bytes_moved > 0, [(e.type, e.detail) for e in events]
    assert not {"fallback", "switch-failed", "restart"} & {e.type for e in events}
    results = run.results()
    assert set(results) == set(devices) - {victim}
    for dev, res in results.items():
        assert res["state"] == "done" and res["steps_done"] == STEPS, (dev, res["state"])
        assert res["pid"] == pids[dev], f"{dev} was restarted"
        assert all(s["source"] in ("init", "bsr") for s in res["switches"]), res["switches"]
    assert len(v2.pipelines) >= 2, v2  # replicas to compare
    diff = run.assert_replicas_match_reference(results)
    print(f"v1 {specialization(v1)} -> v{last} {specialization(v2)}: "
          f"{done[0].bytes_moved} B moved, max diff {diff:.1e}")


def test_no_plan_keeps_the_redundancy_the_job_fails_naming_the_shortfall(job):
    """One worker per node declared at 200 KiB: a pipeline over both nodes fits, two replicas
    do not, so no plan keeps every slice on both nodes. Nothing is published, no worker starts,
    and both agents exit 1 with one line naming the shortfall."""
    for node in NODES:
        job.start(node, 1, "--hspmd-device-memory", "200KiB")
    job.finish(code=1)
    for node, agent in job.agents.items():
        lines = [ln for ln in agent.stderr().splitlines()
                 if ln.startswith("hspmd-launch: error:")]
        assert lines, agent.stderr()[-3000:]
        assert "no plan keeps the redundancy guarantee: redundancy 2" in lines[-1] and \
            "counting at most one replica per node: short by 109.0 KiB" in lines[-1], lines[-1]
        assert "started pid" not in agent.stderr()
    assert job.plans() == {}  # no plan breaking the guarantee was published


def test_a_suspect_gpu_is_drained_its_state_leaves_by_network_then_it_is_released(job):
    """One node, 3 workers declared at 150 KiB (no device holds a replica, so each holds a
    shard nobody else has); node-a:2 turns suspect mid-run: plan v2 shards over the other two
    and drains it; its shard reaches them by fused BSR (no checkpoint exists), then its worker
    leaves, no failure is counted, and the result equals the fault-free reference."""
    from launcher.health.scripted import Fault, encode_fault_script

    job.start("node-a", 3, "--hspmd-device-memory", MEMORY, "--hspmd-health-source",
              "scripted:etcd", nnodes=1, redundancy=1)
    devices = [f"node-a:{i}" for i in range(3)]
    pids = job.wait_paused(devices)
    assert sorted(job.plans()[1][1]) == devices
    suspect = "node-a:2"
    job.client.put(schema.fault_script_key(job.name, "node-a"), encode_fault_script(
        [Fault(2, "suspect", reason="240 new correctable ECC error(s)")]))

    def drain_plan():
        for version, (_plan, names) in job.plans().items():
            if version > 1:
                return version, names
        return None

    version, names = wait_for(drain_plan, 30, "the plan that drains node-a:2")
    rec = schema.decode(schema.plan_history_key(job.name, version), job.client.get(
        schema.plan_history_key(job.name, version)).value)
    assert suspect not in names and rec.drain == [suspect], rec
    job.release.touch()
    job.finish()
    events = job.events()
    drained = [e for e in events if e.type == "drained"]
    assert [schema.event_detail(e).device for e in drained] == [suspect], [
        (e.type, e.detail) for e in events]
    sent = drained[0].timings["bsr_bytes_sent"]
    assert sent > 0 and schema.event_detail(drained[0]).plan_version == version
    changes = [(e.type, schema.event_detail(e).devices) for e in events if e.type == "drain"]
    assert changes == [("drain", [suspect])], changes
    assert not {"failure", "fallback", "switch-failed"} & {e.type for e in events}
    assert all(suspect not in names for v, (_p, names) in job.plans().items() if v >= version)
    results = job.results()
    assert set(results) == set(devices) - {suspect}  # the drained worker left, holding nothing
    for dev, res in results.items():
        assert res["pid"] == pids[dev] and res["state"] == "done", (dev, res["state"])
        assert res["switches"][-1]["source"] == "bsr"
    received = sum(r["switches"][-1]["bsr_bytes_received"] for r in results.values())
    assert received >= sent
    diff = job.assert_replicas_match_reference(results)
    print(f"drained {suspect}: sent {int(sent)} B by BSR; max diff {diff:.1e}")

