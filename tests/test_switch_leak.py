"""Twenty in-memory switches in the same two worker processes leak nothing.

Every switch leaves the old plan's process groups (destroyed on gloo, aborted on NCCL, through
``GroupReaper``) and forms the new plan's in the same process. A group that is never dropped
keeps its registry entry, its gloo worker threads and its TCP sockets, so after each switch each
worker records ``process_resources()`` (live process groups, threads, open file descriptors;
on CUDA the allocator's bytes too) and the test checks that none of them grows from the first
switches to the last. The plans cycle through DP2, TP2, PP2 and PP2 with the devices swapped,
so the switches move state by BSR, and the run still ends equal to the fault-free reference.
"""

from __future__ import annotations

import pytest

from _elastic import assert_recovered_in_memory, payload, wait_until
from hspmd_elastic.plan import simple_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

SWITCHES = 20
DEVICES = ["n0:0", "n1:0"]


def _plans():
    kw = dict(num_layers=2, global_batch=4)
    pp2 = simple_plan(pp=2, **kw)
    return [simple_plan(dp=2, **kw), simple_plan(tp=2, **kw), pp2, pp2.relabel({0: 1, 1: 0})]


def test_twenty_switches_leak_no_process_group_thread_or_socket(elastic_job):
    pl = payload(steps=SWITCHES + 2, pause_at=None, hold_steps=SWITCHES + 1)
    job = elastic_job(pl)
    procs = {d: job.spawn(d) for d in DEVICES}
    plans = _plans()
    job.publish(plans[0], DEVICES, reason="start")
    for k in range(1, SWITCHES + 2):
        def holding(k=k):
            for d in DEVICES:
                if procs[d].poll() is not None:
                    raise AssertionError(f"{d} exited ({procs[d].returncode}):\n{job.log(d)}")
            return all((job.progress(d) or {}).get("step", -1) >= k
                       and (job.progress(d) or {}).get("plan_version") == k for d in DEVICES)

        wait_until(holding, 60, f"both workers holding after step {k} in plan v{k}")
        if k <= SWITCHES:
            job.publish(plans[k % len(plans)], DEVICES, reason="test", step=k)
        open(f"{job.payload['release']}-{k}", "w").close()
    results = job.join(DEVICES, timeout=60)
    for d, r in results.items():
        assert r["ok"], f"{d}: {r.get('traceback')}\n{job.log(d)}"
    assert_recovered_in_memory(results, {d: p.pid for d, p in procs.items()}, pl)
    moved = 0
    for d, r in results.items():
        switches = [s for s in r["switches"] if s["from_version"] > 0]
        assert len(switches) == SWITCHES, (d, [s["to_version"] for s in r["switches"]])
        moved += sum(s["bsr_bytes_received"] for s in switches)
        res = r["resources"][-SWITCHES:]
        assert len(res) == SWITCHES, (d, r["resources"])
        early, late = res[:3], res[-3:]
        print(f"{d}: after switch 1: {res[0]}; after switch {SWITCHES}: {res[-1]}")
        for key in res[0]:
            assert max(x[key] for x in late) <= max(x[key] for x in early), \
                f"{d}: {key} grew over {SWITCHES} switches: {[x[key] for x in res]}"
        assert res[-1]["process_groups"] >= 1  # the counter reads torch's registry
    assert moved > 0  # the switches moved state between the processes
