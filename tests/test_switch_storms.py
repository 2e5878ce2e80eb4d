#!/usr/bin/env python3
"""Failure storms during live elasticity: real etcd, real worker processes over gloo, real
SIGKILL; this test process hosts the plans' TCPStore and publishes the plans as the leader.

(a) two workers of four die a moment apart: the test publishes v2 after the first death and v3
after the second, possibly while the survivors are still switching to v2;
(b) a worker dies in the middle of the switch to v2 (it kills itself with SIGKILL when it enters
the "building" phase, after its part of the BSR, while the others wait to create v2's groups);
v3 without it must free the others (their communication timeouts are longer than the test);
(c) a worker hangs in the middle of the switch to v2 (SIGSTOP as it enters the BSR, before its
sends: its connections stay open): one peer waits for its data, the others to create v2's
groups; v3 without it must free both at once.

Both end with the survivors' parameters equal to the dense reference within 1e-9 (float64).
The workers kill or stop themselves through ``_elastic``'s ``die_in``: a signal to their own
process as they enter a given state of a given plan version.
"""

from __future__ import annotations

import signal

import pytest

from _elastic import (
    TIMEOUTS,
    ElasticJob,
    assert_matches_reference,
    hetero_plan,
    payload,
)
from _wait import wait_for
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]

# Communication timeouts far beyond the test's own deadline: a survivor that waits for one instead
# of leaving on the newer plan (or any gloo group whose destructor waits for its abandoned
# collective to time out) makes the survivors' join fail, with no wall-clock comparison.
BEYOND_DEADLINE = dict(TIMEOUTS, comm_s=600.0, regroup_s=600.0)
DEVICES = ["n0:0", "n0:1", "n1:0", "n1:1"]


def dp_plan(rows: list[int]) -> Plan:
    return Plan(tuple(Pipeline((Stage((d,), (0, 2)),), 1, r) for d, r in enumerate(rows)),
                global_batch=sum(rows), num_layers=2)


def tp2_dp2() -> Plan:
    return simple_plan(tp=2, dp=2, num_layers=2, global_batch=4)


def state_of(job: ElasticJob, device: str) -> tuple[int, str]:
    p = job.progress(device) or {}
    return p.get("plan_version", 0), p.get("state", "")


def check_survivors(job, results, procs, pl, version):
    for d, r in results.items():
        assert r["ok"], f"{d}: {r.get('traceback')}\n{job.log(d)}"
        assert r["pid"] == procs[d].pid  # the same process trained through every switch
        assert (r["steps_done"], r["plan_version"]) == (pl["steps"], version), job.log(d)
        assert r["switches"][-1]["source"] == "bsr"
    assert_matches_reference(results.values(), pl)


def test_two_failures_in_quick_succession(elastic_job):
    pl = payload()
    j = elastic_job(pl)
    procs = {d: j.spawn(d) for d in DEVICES}
    j.publish(tp2_dp2(), DEVICES, reason="start")
    j.wait_step(DEVICES, 2)
    j.kill("n1:1")
    j.publish(hetero_plan(), DEVICES[:3], reason="failure of n1:1")
    j.release()
    # The second failure: as soon as n1:0 has started switching to v2.
    wait_for(lambda: state_of(j, "n1:0")[0] == 2, 30, "n1:0 to start switching to v2")
    j.kill("n1:0")
    survivors = DEVICES[:2]
    j.publish(simple_plan(dp=2, num_layers=2, global_batch=4), survivors,
              reason="failure of n1:0")
    results = j.join(survivors, timeout=50)
    check_survivors(j, results, procs, pl, 3)


def test_failure_during_a_switch(elastic_job):
    pl = payload(timeouts=BEYOND_DEADLINE)
    j = elastic_job(pl)
    procs = {d: j.spawn(d, die_in={"version": 2, "state": "building"} if d == "n1:0" else None)
             for d in DEVICES}
    j.publish(tp2_dp2(), DEVICES, reason="start")
    j.wait_step(DEVICES, 2)
    j.kill("n1:1")
    j.publish(hetero_plan(), DEVICES[:3], reason="failure of n1:1")
    j.release()
    # n1:0 receives its missing TP half through v2's BSR, then dies as it starts building; the
    # others have no data to move and wait for it to create v2's groups.
    procs["n1:0"].wait(timeout=30)
    assert procs["n1:0"].returncode == -signal.SIGKILL, j.log("n1:0")
    assert state_of(j, "n1:0") == (2, "building")
    survivors = DEVICES[:2]
    wait_for(lambda: all(state_of(j, d) == (2, "building") for d in survivors), 30,
             "the survivors to wait for n1:0 in v2's building phase")
    j.publish(simple_plan(dp=2, num_layers=2, global_batch=4), survivors,
              reason="failure of n1:0")
    results = j.join(survivors, timeout=50)  # far below the 600 s communication timeouts
    check_survivors(j, results, procs, pl, 3)
    for d in survivors:
        assert [s["to_version"] for s in results[d]["switches"]] == [1, 3]


def test_hung_peer_during_the_bsr(elastic_job):
    pl = payload(timeouts=BEYOND_DEADLINE)
    j = elastic_job(pl)
    hang = {"version": 2, "state": "resharding", "signal": "SIGSTOP"}
    procs = {d: j.spawn(d, die_in=hang if d == "n0:1" else None) for d in DEVICES}
    j.publish(tp2_dp2(), DEVICES, reason="start")
    j.wait_step(DEVICES, 2)
    # v2 (DP4, e.g. after a slow-down verdict): n0:0 needs n0:1's TP half, n1:* swap theirs.
    j.publish(dp_plan([1, 1, 1, 1]), DEVICES, reason="replan")
    j.release()
    want = {"n0:1": (2, "resharding"), "n0:0": (2, "resharding"), "n1:0": (2, "building"),
            "n1:1": (2, "building")}
    wait_for(lambda: all(state_of(j, d) == s for d, s in want.items()), 30,
             f"the v2 switch to stall on the stopped n0:1 as {want}")
    survivors = ["n0:0", "n1:0", "n1:1"]
    j.publish(dp_plan([2, 1, 1]), survivors, reason="n0:1 hangs")
    results = j.join(survivors, timeout=50)  # far below the 600 s communication timeouts
    assert procs["n0:1"].poll() is None  # still stopped: nobody saw its connections close
    j.kill("n0:1")
    check_survivors(j, results, procs, pl, 3)
    for d in survivors:
        assert [s["to_version"] for s in results[d]["switches"]] == [1, 3]
