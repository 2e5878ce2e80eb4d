"""Live elasticity end to end: real etcd, real worker processes over gloo, real SIGKILL.

The test process is the node agent (it hosts the plan's TCPStore) and the leader (it publishes
plans). Every scenario checks the final parameters against the dense reference trained on the
same global batches, within 1e-9 (float64).
"""

from __future__ import annotations

import pytest

from _elastic import JOB, assert_matches_reference, hetero_plan, payload
from _wait import wait_for
from hspmd_elastic.coord import read_events
from hspmd_elastic.elastic.checkpoint import latest_complete
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


@pytest.mark.parametrize("undo", ["device", "off"])
def test_sigkill_survivors_switch_in_process(elastic_job, undo):
    """Every survivor paused at the same step: the switch needs no undo copy, so it works the
    same with ``run(undo="off")``."""
    pl = payload(undo=undo)
    job = elastic_job(pl)
    devices = ["n0:0", "n0:1", "n1:0"]
    procs = {d: job.spawn(d) for d in devices}
    job.publish(hetero_plan(), devices, reason="start")
    job.wait_step(devices, 2)
    job.kill("n0:1")  # half of pipeline 0's TP pair
    survivors = ["n0:0", "n1:0"]
    job.publish(simple_plan(dp=2, num_layers=2, global_batch=4), survivors, reason="failure")
    job.release()
    results = job.join_ok(survivors, timeout=60)
    for d in survivors:
        r = results[d]
        assert r["pid"] == procs[d].pid  # the same process trained through the switch
        assert r["steps_done"] == 5 and r["plan_version"] == 2
        last = r["switches"][-1]
        assert last["source"] == "bsr" and last["to_version"] == 2
    # Device n0:0 lost its TP partner: it received the other half of its shards.
    assert results["n0:0"]["switches"][-1]["bsr_bytes_received"] > 0
    assert_matches_reference(results.values(), pl)


def test_failure_noticed_mid_step_then_plan(elastic_job):
    """The survivors run into the dead peer first; the plan comes after one reported it."""
    pl = payload(global_batch=6)
    job = elastic_job(pl)
    devices = ["n0:0", "n1:0", "n2:0"]
    procs = {d: job.spawn(d) for d in devices}
    job.publish(simple_plan(dp=3, num_layers=2, global_batch=6), devices, reason="start")
    job.wait_step(devices, 2)
    job.kill("n1:0")
    survivors = ["n0:0", "n2:0"]
    job.release()
    wait_for(lambda: any((job.progress(d) or {}).get("state") == "waiting_plan"
                         for d in survivors), 40, "a survivor to notice the dead peer")
    job.publish(simple_plan(dp=2, num_layers=2, global_batch=6), survivors, reason="failure")
    results = job.join_ok(survivors, timeout=60)
    for d in survivors:
        r = results[d]
        assert r["pid"] == procs[d].pid and r["steps_done"] == 5
        assert r["switches"][-1]["source"] == "bsr"
    assert_matches_reference(results.values(), pl)


def test_join_receives_state_through_bsr(elastic_job):
    pl = payload()
    job = elastic_job(pl)
    first = ["n0:0", "n1:0"]
    procs = {d: job.spawn(d) for d in first}
    job.publish(simple_plan(dp=2, num_layers=2, global_batch=4), first, reason="start")
    job.wait_step(first, 2)
    procs["n2:0"] = job.spawn("n2:0")  # a new node's worker: it holds nothing
    devices = first + ["n2:0"]
    job.publish(hetero_plan(), devices, reason="join")
    job.release()
    results = job.join_ok(devices, timeout=60)
    for d in devices:
        r = results[d]
        assert r["steps_done"] == 5 and r["plan_version"] == 2
    joined = results["n2:0"]["switches"]
    assert len(joined) == 1 and joined[0]["source"] == "bsr" and joined[0]["resume_step"] == 2
    assert joined[0]["bsr_bytes_received"] > 0
    assert_matches_reference(results.values(), pl)


def pp2_plan() -> Plan:
    return Plan((Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, 2))), 2, 2),),
                global_batch=4, num_layers=2)


def _lose_a_stage(job):
    devices = ["n0:0", "n1:0"]
    for d in devices:
        job.spawn(d)
    job.publish(pp2_plan(), devices, reason="start")
    job.wait_step(devices, 2)
    return devices


def test_lost_stage_falls_back_to_checkpoint(elastic_job, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pl = payload(checkpoint_dir=ckpt, checkpoint_every=1)
    job = elastic_job(pl)
    _lose_a_stage(job)
    wait_for(lambda: latest_complete(ckpt) >= 2, 30, "the checkpoint of step 2")
    job.kill("n1:0")  # the only holder of layer 1 and the head
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n0:0"], reason="failure")
    job.release()
    r = job.join_ok(["n0:0"], timeout=60)["n0:0"]
    last = r["switches"][-1]
    assert last["source"] == "checkpoint" and last["resume_step"] == 2
    assert r["steps_done"] == 5
    events = [e for e in read_events(job.client, JOB) if e.type == "fallback"]
    assert events and "no live owner" in events[0].detail["error"]
    assert "layers.1." in events[0].detail["error"]
    assert_matches_reference([r], pl)


def test_drained_stage_sends_its_state_then_leaves(elastic_job):
    """The only holder of layer 1 and the head is drained (a suspect GPU, still working): it
    joins the switch as a BSR source, the survivor receives those layers by network (no
    checkpoint exists), and the drained worker leaves without a place in the new plan."""
    pl = payload()
    job = elastic_job(pl)
    _lose_a_stage(job)
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n0:0"], reason="drain n1:0",
                drain=("n1:0",))
    job.release()
    results = job.join_ok(["n0:0", "n1:0"], timeout=60)
    kept, gone = results["n0:0"], results["n1:0"]
    assert gone["state"] == "excluded" and gone["drained"]["to_version"] == 2
    sent = gone["drained"]["bsr_bytes_sent"]
    assert sent > 0 and gone["drained"]["resume_step"] == 2
    last = kept["switches"][-1]
    assert last["source"] == "bsr" and last["to_version"] == 2 and last["resume_step"] == 2
    assert last["bsr_bytes_received"] == sent  # everything it lacked came from the drained GPU
    drained = [e for e in read_events(job.client, JOB) if e.type == "drained"]
    assert [e.detail["device"] for e in drained] == ["n1:0"]
    assert drained[0].timings["bsr_bytes_sent"] == sent
    assert kept["steps_done"] == 5
    assert_matches_reference([kept], pl)


def test_double_failure_goes_back_to_the_checkpoint_each_rank_reading_its_own_share(
        elastic_job, tmp_path):
    """TP2 pipeline + a one-device replica; the replica and one TP half die: that half's slices
    have no live owner. The whole job goes back to the checkpoint of step 2 (one step redone)
    under another layout (PP2 over the survivor and a joiner); each rank reads about its own
    stage's share of the checkpoint, and the result equals the fault-free run."""
    ckpt = str(tmp_path / "ckpt")
    pl = payload(checkpoint_dir=ckpt, checkpoint_every=2, pause_at=3)
    job = elastic_job(pl)
    devices = ["n0:0", "n0:1", "n1:0"]
    procs = {d: job.spawn(d) for d in devices}
    job.publish(hetero_plan(), devices, reason="start")
    job.wait_step(devices, 3)
    wait_for(lambda: latest_complete(ckpt) >= 2, 30, "the checkpoint of step 2")
    job.kill("n0:1")
    job.kill("n1:0")
    job.spawn("n2:0")
    job.publish(pp2_plan(), ["n0:0", "n2:0"], reason="double failure")
    job.release()
    results = job.join_ok(["n0:0", "n2:0"], timeout=60)
    shares = {}
    for d, r in results.items():
        last = r["switches"][-1]
        assert last["source"] == "checkpoint" and last["resume_step"] == 2, last
        shares[d] = last["checkpoint_bytes_read"]
    assert results["n0:0"]["pid"] == procs["n0:0"].pid
    fallback = [e for e in read_events(job.client, JOB) if e.type == "fallback"]
    assert fallback and fallback[0].detail["checkpoint_step"] == 2
    assert fallback[0].detail["steps_redone"] == 1 and "no live owner" in \
        fallback[0].detail["error"]
    # What each rank holds under PP2, and nothing more, is what it read.
    import math

    import torch

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.state import state_specs

    specs = state_specs(ModelConfig(**pl["config"]), pp2_plan())
    own = {}
    for rank, d in enumerate(["n0:0", "n2:0"]):
        own[d] = 0
        for spec in specs.values():
            ranges = spec.annotation.local_slices(rank, spec.shape)
            if ranges is not None:
                size = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
                own[d] += math.prod(hi - lo for lo, hi in ranges) * size
    assert shares == own, (shares, own)
    assert all(b < sum(own.values()) for b in shares.values())  # never the whole model
    assert_matches_reference(results.values(), pl)


def test_every_holder_lost_and_no_checkpoint_never_restarts_from_the_seed(elastic_job):
    """Both workers die at step 2; a fresh worker alone gets the next plan of a job that had
    trained (the plan says step 2). Nobody holds state and no checkpoint exists: the job fails
    with the root cause instead of silently training again from the initial weights."""
    job = elastic_job(payload())
    _lose_a_stage(job)
    job.kill("n0:0")
    job.kill("n1:0")
    job.spawn("n2:0")
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n2:0"], reason="both lost",
                step=2)
    job.release()
    r = job.join(["n2:0"], timeout=60)["n2:0"]
    assert not r["ok"] and r["error"].startswith("UnrecoverableStateError"), r
    assert "had reached step 2" in r["error"] and "no checkpoint" in r["error"]
    assert [e.type for e in read_events(job.client, JOB)][-1] == "switch-failed"


def test_lost_stage_without_checkpoint_fails_with_root_cause(elastic_job):
    job = elastic_job(payload())
    _lose_a_stage(job)
    job.kill("n1:0")
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n0:0"], reason="failure")
    job.release()
    r = job.join(["n0:0"], timeout=60)["n0:0"]  # exits, does not hang
    assert not r["ok"] and r["returncode"] == 1
    assert r["error"].startswith("UnrecoverableStateError")
    assert "no live owner" in r["error"] and "lm_head.weight" in r["error"]
    assert "no checkpoint directory is configured" in r["error"]
    assert [e.type for e in read_events(job.client, JOB)][-1] == "switch-failed"


def _one_step_ahead(elastic_job, undo: str):
    """n0:1 fails the last wait of step 3 (an injected fault) while the others complete that
    step; n1:0 is then killed and the survivors switch to DP2: their results by device."""
    pl = payload(pause_at=None, global_batch=6, undo=undo)
    job = elastic_job(pl)
    devices = ["n0:0", "n0:1", "n1:0"]
    for d in devices:
        job.spawn(d, fail_last_wait_of_step=3 if d == "n0:1" else None)
    job.publish(simple_plan(dp=3, num_layers=2, global_batch=6), devices, reason="start")
    wait_for(lambda: (job.progress("n0:1") or {}).get("state") == "waiting_plan", 60,
             "n0:1 to abandon step 3")
    job.wait_step(["n0:0"], 4)  # n0:0 committed step 3 before the failure: it is one step ahead
    job.kill("n1:0")
    survivors = ["n0:0", "n0:1"]
    job.publish(simple_plan(dp=2, num_layers=2, global_batch=6), survivors, reason="failure")
    results = job.join_ok(survivors, timeout=60)
    for d in survivors:
        assert results[d]["switches"][-1]["resume_step"] == 3
    assert_matches_reference(results.values(), pl)
    return {d: results[d]["switches"][-1] for d in survivors}


def test_rank_one_step_ahead_rolls_back(elastic_job):
    """The survivors hold different steps, the switch resumes at step 3 and n0:0 rolls back."""
    last = _one_step_ahead(elastic_job, undo="device")
    assert last["n0:0"]["rolled_back"]
    assert not last["n0:1"]["rolled_back"]


def test_plan_with_a_dead_device_is_superseded_during_regroup(elastic_job):
    """v2 still lists a dead device (a stale view): the survivors wait for it at the store
    barrier and move on to v3 as soon as it is published. A device left out of the newest plan
    while alive leaves cleanly."""
    pl = payload(global_batch=6)
    job = elastic_job(pl)
    devices = ["n0:0", "n1:0", "n2:0"]
    for d in devices:
        job.spawn(d)
    job.publish(simple_plan(dp=3, num_layers=2, global_batch=6), devices, reason="start")
    job.wait_step(devices, 2)
    job.kill("n2:0")
    job.publish(simple_plan(dp=3, num_layers=2, global_batch=6), devices, reason="stale")
    job.release()
    wait_for(lambda: all((job.progress(d) or {}).get("state") == "regrouping"
                         and job.progress(d)["plan_version"] == 2 for d in devices[:2]),
             40, "the survivors to wait for the dead device at the v2 barrier")
    job.publish(simple_plan(dp=1, num_layers=2, global_batch=6), ["n0:0"], reason="failure")
    results = job.join(devices[:2], timeout=60)
    r = results["n0:0"]
    assert r["ok"], f"{r.get('traceback')}\n{job.log('n0:0')}"
    assert (r["plan_version"], r["steps_done"]) == (3, 5)
    assert [s["to_version"] for s in r["switches"]] == [1, 3]
    left = results["n1:0"]
    assert left["ok"] and left["state"] == "excluded", job.log("n1:0")
    assert_matches_reference([r], pl)
    done = [e for e in read_events(job.client, JOB) if e.type == "switch-done"]
    assert done[-1].detail["plan_version"] == 3
    want = {"detect_s", "regroup_s", "bsr_s", "rebuild_s", "bsr_bytes_total"}
    assert want <= set(done[-1].timings)


def test_without_undo_copies_the_rank_one_step_ahead_is_refilled_from_its_peer(elastic_job):
    """As above with ``run(undo="off")``: n0:0 cannot roll back, so it is not an owner of step 3;
    its DP peer n0:1 (at step 3) is, and n0:0 receives the whole state from it by BSR."""
    last = _one_step_ahead(elastic_job, undo="off")
    assert not last["n0:0"]["rolled_back"] and not last["n0:1"]["rolled_back"]
    assert last["n0:0"]["bsr_bytes_received"] > 0
    assert last["n0:1"]["bsr_bytes_received"] == 0
