"""Elastic mode end to end: real etcd, ``hspmd-launch --hspmd-elastic`` agents as separate nodes
on this host (``--hspmd-node-id``), two workers each running ``hspmd_elastic.runtime`` over
gloo, real SIGKILLs. The worker-kill scenario is the suite's one shared worker-kill run
(``_elastic_job.worker_kill_run``: 3 + 2 workers, read here for recovery, by
tests/test_security_tls.py for TLS and auth, by tests/test_elastic_hspmd.py for resharding).

Scenarios: a worker SIGKILLed, an agent SIGKILLed (node loss by lease expiry), an agent
SIGTERMed (it leaves), a node joining mid-run, a hot spare (beyond the maximum of ``--nnodes``)
taking a lost node's place. Each checks that the job finishes all steps
without restarting a survivor (same pids before and after, read from the worker records) and
without reading a checkpoint, and that the final parameters equal the dense reference trained on
the same global batches (float64, 1e-9). The worker-kill scenario also logs, per completed step,
the global sample ids each pipeline trained, and checks that the committed trajectory (per step,
the last plan version that completed it) consumed every sample exactly once, and that both
agents acked the first plan and the recovery plan ``done`` in ``switch/<version>/<node_id>``. A lost shard with
no checkpoint ends the job: exit 1 on every node, torchrun's failure summary, the root cause in
one line. Workers pause at step ``PAUSE`` until the test creates the release file, so every
fault hits a known state. The agent's pure decision (``judge``) and the elastic flags are checked
at the end. The job harness (agents, waits, reference checks) is ``tests/_elastic_job.py``.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from _elastic_job import (BATCH, KILL_NODES, KILL_VICTIM, STEPS, TINY, ElasticLaunchJob,
                          JobFacts, shared_worker_kill_run, write_tiny)
from _wait import wait_for
from launch_harness import SCRIPTS

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.plans import read_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]


@pytest.fixture
def job(etcd_server, tmp_path, marker):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="el") as j:
        yield j


def check_recovered(job: JobFacts, survivors: dict[str, int]) -> dict[str, dict]:
    """Survivors finished every step in the same processes, without a checkpoint."""
    results = job.assert_recovered(survivors)
    for dev in survivors:
        assert results[dev]["plan_version"] >= 2 and len(results[dev]["switches"]) >= 2
    types = [e.type for e in job.events()]
    assert "fallback" not in types and "restart" not in types and "switch-failed" not in types
    return results


def committed_samples(rows: list[dict]) -> dict[int, list[int]]:
    """Per step, the sample ids the final trajectory trained: the step under the last plan version
    that completed it (a step redone after a rollback counts once, as its committed run), one
    entry per pipeline of that plan (all ranks of a pipeline must report the same rows)."""
    out = {}
    for step in range(STEPS):
        runs = [r for r in rows if r["step"] == step]
        assert runs, f"step {step}: no rank logged it"
        version = max(r["plan_version"] for r in runs)
        by_pipeline: dict[int, list[int]] = {}
        for r in runs:
            if r["plan_version"] == version:
                assert r["state_step"] == step + 1, r
                got = by_pipeline.setdefault(r["pipeline"], r["samples"])
                assert got == r["samples"], (step, version, r["pipeline"], got, r["samples"])
        pipelines = {r["pipelines"] for r in runs if r["plan_version"] == version}
        assert len(pipelines) == 1 and set(by_pipeline) == set(range(pipelines.pop())), (
            step, version, sorted(by_pipeline))
        out[step] = [i for p in sorted(by_pipeline) for i in by_pipeline[p]]
    return out


def check_samples_once(job: JobFacts) -> dict[int, list[int]]:
    """Every sample id 0..STEPS*BATCH-1 consumed exactly once by the committed trajectory, each in
    its own step's global batch ``[s*B, (s+1)*B)``."""
    final = committed_samples(job.sample_log())
    counts = Counter(i for ids in final.values() for i in ids)
    twice = sorted(i for i, n in counts.items() if n > 1)
    skipped = sorted(set(range(STEPS * BATCH)) - set(counts))
    assert not twice and not skipped and set(counts) == set(range(STEPS * BATCH)), (
        f"consumed twice: {twice}, skipped: {skipped}, unknown: "
        f"{sorted(set(counts) - set(range(STEPS * BATCH)))}")
    for step, ids in final.items():
        assert sorted(ids) == list(range(step * BATCH, (step + 1) * BATCH)), (step, ids)
    return final


def switch_seconds(job: JobFacts, since: float) -> float:
    """From ``since`` (the kill, wall clock) to the first switch-done event after it."""
    done = [e for e in job.events() if e.type == "switch-done" and e.at > since]
    assert done, [e.type for e in job.events()]
    return done[0].at - since


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The suite's one worker-kill run (``tests/_elastic_job.py``), read here for recovery."""
    return shared_worker_kill_run(tmp_path_factory)


@pytest.mark.timeout(180)  # it may start the shared run (30-60 s on two busy cores)
def test_worker_sigkill_survivors_switch_in_memory(killed):
    """The shared run: two nodes (3 + 2 workers), node-b:1 SIGKILLed at step PAUSE once both
    nodes acked plan v1 done. Besides the recovery checks, the sample-id log shows the committed
    trajectory consumed each training sample exactly once, and the agents' switch acks show both
    nodes done with the first plan and with the recovery plan."""
    run = killed.checked()
    nodes, pids = tuple(KILL_NODES), run.pids
    first = [e for e in run.events() if e.type == "replan"][0]
    assert schema.event_detail(first).device_count == len(pids), first.detail
    survivors = run.survivors()
    results = check_recovered(run, survivors)
    assert KILL_VICTIM not in results
    failure = schema.event_detail(next(e for e in run.events() if e.type == "failure"))
    assert failure.devices == [KILL_VICTIM] and [x.signal for x in failure.exits] == [9]
    print(f"worker SIGKILL -> switch-done {switch_seconds(run, run.killed_at):.3f}s")
    assert "job recovered from 1 worker failure" in run.stderr["node-b"]
    assert all(run.stderr[n].count("started pid") == 1 for n in nodes)
    final = check_samples_once(run)
    rows = run.sample_log()
    last = results["node-a:0"]["plan_version"]
    assert last >= 2
    for node in nodes:  # each state once and in order; the recovery plan's ack reads done
        for version in (1, last):
            states = run.ack_states(version, node)
            order = ["joined", "ready", "done"]
            assert states and states[-1] == "done", (version, node, states)
            assert states == sorted(set(states), key=order.index), (version, node, states)
    assert {r["plan_version"] for r in rows if r["step"] == STEPS - 1} == {last}
    versions = {s: sorted({r["plan_version"] for r in rows if r["step"] == s}) for s in final}
    print(f"sample ids: {sum(map(len, final.values()))} over {len(final)} steps, each once; "
          f"plan versions per step: {versions}")


def test_a_switch_that_fails_on_every_rank_is_published_again(job):
    """node-a:1 gives up the last wait of step 2 (an injected timeout, as on a busy host); its
    peer then times out in step 3 (3 s). Both wait for a plan, and no failure, leave or
    unreachable peer explains it: the agent asks for a retry once they waited two lease TTLs,
    the leader publishes the same devices again, and both switch into it in the same processes
    (the rank a step ahead rolls back) and finish equal to the reference."""
    job.release.touch()  # no pause: the fault is the injected one
    a = job.start("node-a", nnodes="1", nproc=2,
                  train=("--abandon", "node-a:1:2", "--comm-timeout", "3"))
    devices = ["node-a:0", "node-a:1"]
    pids = wait_for(lambda: (lambda r: {d: r[d].pid for d in devices}
                             if set(devices) <= set(r) else None)(job.workers()),
                    60, "both workers' records")
    job.finish(timeout=80)
    results = check_recovered(job, pids)
    events = job.events()
    retry = [e for e in events if e.type == "retry"]
    assert len(retry) == 1 and retry[0].node == "node-a", [e.type for e in events]
    asked = schema.event_detail(retry[0])
    assert asked.devices == devices and asked.plan_version == 2
    replans = [schema.event_detail(e) for e in events if e.type == "replan"]
    assert [r.version for r in replans] == [1, 2], replans
    [again] = replans[1].changes
    assert (again.kind, again.node, again.devices) == ("retry", "node-a", devices)
    assert again.reason.startswith("the switch into v1")
    assert not any(e.type in ("failure", "leave", "unreachable", "stall") for e in events)
    assert results["node-a:0"]["switches"][-1]["resume_step"] == 2
    assert "asking the leader to publish it again" in a.stderr()
    assert a.stderr().count("started pid") == 1  # the workers, started once


def test_node_loss_of_the_leader_job_continues_on_the_other_node(job):
    """The leader's agent (it also hosts the plan's store) dies with its workers: the other node
    is elected once the lease expires, plans on its own store, and its workers switch."""
    job.start("node-a")
    job.start("node-b")
    devices = ["node-a:0", "node-a:1", "node-b:0", "node-b:1"]
    pids = job.wait_paused(devices)
    lost = job.leader()
    plan = next(e for e in job.events() if e.type == "replan")
    assert schema.event_detail(plan).store_endpoint and plan.node == lost
    other = "node-b" if lost == "node-a" else "node-a"
    victim = job.agents.pop(lost)
    killed_at = time.time()
    victim.proc.send_signal(signal.SIGKILL)  # the agent and, with it, its workers
    assert victim.wait(10) == -signal.SIGKILL
    job.release.touch()
    job.finish()
    check_recovered(job, {d: p for d, p in pids.items() if d.startswith(other)})
    events = job.events()
    assert any(e.type == "leave" and e.node == lost for e in events)
    last = [e for e in events if e.type == "replan"][-1]
    assert last.node == other and (schema.event_detail(last).store_endpoint
                                   != schema.event_detail(plan).store_endpoint)
    print(f"leader SIGKILL (lease TTL 2s) -> switch-done {switch_seconds(job, killed_at):.3f}s")


def test_agent_sigterm_leaves_and_the_job_continues(job):
    job.start("node-a")
    b = job.start("node-b")
    pids = job.wait_paused(["node-a:0", "node-a:1", "node-b:0", "node-b:1"])
    b.proc.send_signal(signal.SIGTERM)  # forwarded to its workers; the node leaves the job
    del job.agents["node-b"]
    assert b.wait(30) == 1
    assert "hspmd-launch: error: process" in b.stderr() and "(SIGTERM)" in b.stderr()
    job.release.touch()
    job.finish()
    check_recovered(job, {d: p for d, p in pids.items() if d.startswith("node-a")})
    assert any(e.type == "leave" and e.node == "node-b" for e in job.events())


def test_an_etcd_stall_of_three_lease_ttls_switches_nothing(job):
    """etcd frozen (SIGSTOP) for three lease TTLs while the workers wait at a step: every
    lease expires and every agent re-creates its records under a new lease; the leader holds
    its replan while the cluster reconciles, so no plan is published, nobody switches or
    restarts, and the parameters equal the fault-free run."""
    job.start("node-a")
    job.start("node-b")
    pids = job.wait_paused(["node-a:0", "node-a:1", "node-b:0", "node-b:1"])
    prefix = schema.nodes_prefix(job.name)
    leases = {kv.key[len(prefix):]: kv.lease for kv in job.client.get_prefix(prefix)}
    assert sorted(leases) == ["node-a", "node-b"]
    etcd = job.etcd.members[0].proc
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        time.sleep(3 * 2.0)  # the fault's length (3 x --hspmd-lease-ttl), not a synchronisation
    finally:
        os.kill(etcd.pid, signal.SIGCONT)

    def re_registered():
        now = {kv.key[len(prefix):]: kv.lease for kv in job.client.get_prefix(prefix)}
        return sorted(now) == sorted(leases) and all(now[n] not in (0, leases[n]) for n in now)

    wait_for(re_registered, 30, "both nodes re-registered under new leases")
    job.release.touch()
    job.finish()
    results = job.assert_recovered(pids)
    assert all(r["plan_version"] == 1 and len(r["switches"]) == 1 for r in results.values()), \
        {d: (r["plan_version"], len(r["switches"])) for d, r in results.items()}
    types = [e.type for e in job.events()]
    assert "replan" in types and types.count("replan") == 1, types  # only the first plan
    assert not {"leave", "failure", "restart", "switch-failed"} & set(types), types
    for node, agent in job.agents.items():
        assert "etcd unreachable, workers keep running" in agent.stderr(), node


def test_join_mid_run_receives_state(job):
    job.start("node-a", nnodes="2:3")  # room for a third node: it joins, it is no spare
    job.start("node-b", nnodes="2:3")
    first = ["node-a:0", "node-a:1", "node-b:0", "node-b:1"]
    pids = job.wait_paused(first)
    job.start("node-c", nnodes="2:3")
    wait_for(lambda: job.check_agents() or all(d in job.workers()
                                               for d in ("node-c:0", "node-c:1")),
             60, "node-c's workers to start")
    job.release.touch()
    job.finish()
    results = check_recovered(job, pids)
    assert {"node-c:0", "node-c:1"} <= set(results)
    joined = results["node-c:0"]["switches"]
    assert len(joined) == 1 and joined[0]["source"] == "bsr"
    assert any(e.type == "join" and e.node == "node-c" for e in job.events())


def test_a_spare_beyond_nnodes_max_replaces_a_lost_node(job):
    """``--nnodes 2:2``, three agents of one worker each: node-c is a hot spare (registered, no
    worker) while the plan is full; SIGKILLing a planned agent (node loss by lease expiry) makes
    the leader take the spare in, whose worker gets the state through BSR. Every agent left,
    the spare included, exits 0 and the result equals the fault-free reference. (Which spare is
    taken among several is in tests/test_leader_decide.py.)"""
    job.start("node-a", nnodes="2:2", nproc=1)
    job.start("node-b", nnodes="2:2", nproc=1)
    pids = job.wait_paused(["node-a:0", "node-b:0"])
    job.start("node-c", nnodes="2:2", nproc=1)
    spare = job.agents["node-c"]
    wait_for(lambda: job.check_agents() or "gives this node no device" in spare.stderr(), 60,
             "node-c to follow a plan without it")
    wait_for(lambda: any("node node-c is a spare: --nnodes max 2 reached" in
                         job.agents[p].stderr() for p in ("node-a", "node-b")), 30,
             "the leader to name the spare")
    plan, _ = read_plan(job.client, job.name)
    assert plan.version == 1 and sorted(plan.devices) == ["node-a:0", "node-b:0"]
    assert "node-c:0" not in job.workers() and "started pid" not in spare.stderr()
    leader = job.leader()
    lost = "node-b" if leader == "node-a" else "node-a"
    victim = job.agents.pop(lost)
    victim.proc.send_signal(signal.SIGKILL)  # the agent and, with it, its worker
    assert victim.wait(10) == -signal.SIGKILL
    wait_for(lambda: job.check_agents() or "node-c:0" in job.workers(), 60,
             "the spare's worker to start")
    job.release.touch()
    job.finish()
    results = check_recovered(job, {f"{leader}:0": pids[f"{leader}:0"]})
    assert set(results) == {f"{leader}:0", "node-c:0"}
    joined = results["node-c:0"]["switches"]
    assert len(joined) == 1 and joined[0]["source"] == "bsr"
    events = job.events()
    assert any(e.type == "leave" and e.node == lost for e in events)
    assert [e.node for e in events
            if e.type == "join" and schema.event_detail(e).plan_version > 1] == ["node-c"]
    assert spare.stderr().count("started pid") == 1


def test_lost_shard_without_checkpoint_fails_the_job_with_summary(job):
    """Global batch 1 leaves one pipeline (TP2 x PP2 on four devices): a dead TP rank's shard
    has no other owner, the switch fails on every rank and the job ends with exit 1."""
    a, b = job.start("node-a", batch=1), job.start("node-b", batch=1)
    devices = ["node-a:0", "node-a:1", "node-b:0", "node-b:1"]
    pids = job.wait_paused(devices)
    plan = [e for e in job.events() if e.type == "replan"][0]
    assert schema.event_detail(plan).device_count == 4
    os.kill(pids["node-b:1"], signal.SIGKILL)
    job.release.touch()
    job.finish(code=1)
    err_b = b.stderr()
    assert "elastic_train.py FAILED" in err_b and "Root Cause (first observed failure):" in err_b
    root = err_b.split("Root Cause (first observed failure):", 1)[1]
    assert f"(pid: {pids['node-b:1']})" in root and "SIGKILL" in root
    for err in (a.stderr(), err_b):
        line = [ln for ln in err.splitlines() if ln.startswith("hspmd-launch: error:")]
        assert line and "job failed: switch failed" in line[-1] and "no live owner" in line[-1]
    assert "switch-failed" in [e.type for e in job.events()]
    assert not list(job.out.glob("*.pt"))


# ------------------------------------------------------------------------- pure decisions, CLI
def test_judge_a_recorded_end_wins_then_success_then_failure():
    from launcher.node.elastic.judge import JobView, judge
    from launcher.node.restart.rendezvous import RoundState

    ended = RoundState(round=3, state="failed", restart_count=0, reason="switch failed: x")
    assert judge(JobView(ended=ended, finished_worker="n:0 done")) == ("failed", "switch failed: x")
    assert judge(JobView(finished_worker="n:0 done", switch_failed="boom"))[0] == "succeeded"
    assert judge(JobView(nodes_done=True, nodes=2, usable_devices=0))[0] == "succeeded"
    assert judge(JobView(switch_failed="plan v2: no live owner\nmore"))[1] == (
        "switch failed: plan v2: no live owner")
    assert judge(JobView(nodes=2, usable_devices=0)) == ("failed",
                                                         "no usable device left in the job")
    assert judge(JobView(nodes=0, usable_devices=0))[0] == "running"  # nobody registered yet
    assert judge(JobView(nodes=2, usable_devices=3))[0] == "running"


@pytest.mark.parametrize("args, message", [
    (["--hspmd-elastic"], "--hspmd-elastic needs --hspmd-model and --hspmd-global-batch"),
    (["--hspmd-elastic", "--hspmd-model", "llama-7b"], "needs --hspmd-global-batch"),
    (["--hspmd-elastic", "--hspmd-model", "llama-8b", "--hspmd-global-batch", "4"],
     "invalid --hspmd-model value 'llama-8b': no such file; use a JSON file, an inline JSON "
     "object or a preset (llama-7b, llama-13b, llama-32b)"),
    (["--hspmd-elastic", "--hspmd-model", '{"schema": 1, "num_layers": 0}',
      "--hspmd-global-batch", "4"], "num_layers=0 must be >= 1"),
    (["--hspmd-elastic", "--hspmd-model", "{oops", "--hspmd-global-batch", "4"],
     "not readable JSON"),
    (["--hspmd-elastic", "--hspmd-model", "llama-7b", "--hspmd-global-batch", "0"],
     "invalid --hspmd-global-batch value 0: must be >= 1"),
    (["--hspmd-global-batch", "8"], "--hspmd-global-batch 8 is only used with --hspmd-elastic"),
])
def test_elastic_flags_bad_values_get_one_line(args, message, capsys):
    from launcher.cli import main

    assert main([*args, str(SCRIPTS / "sleeper.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hspmd-launch: error: ") and message in err[0]


def test_elastic_flags_build_the_planner_input(tmp_path, monkeypatch):
    from launcher.cli import build_config, launch_command

    model = write_tiny(tmp_path / "m.json")
    monkeypatch.setenv("PET_HSPMD_ELASTIC", "1")
    ctx = launch_command.make_context("hspmd-launch", [
        "--hspmd-model", str(model), "--hspmd-global-batch", "4", str(SCRIPTS / "sleeper.py")])
    elastic = build_config(ctx.params).elastic
    assert elastic.global_batch == 4 and elastic.model_profile.config == TINY
    assert elastic.model_profile.num_layers == TINY.num_layers
