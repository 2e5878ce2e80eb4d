"""Twenty in-memory switches in the same two worker processes leak nothing.

Every switch leaves the old plan's process groups (destroyed on gloo, aborted on NCCL, through
``GroupReaper``) and forms the new plan's in the same process. A group that is never dropped
keeps its registry entry, its gloo worker threads and its TCP sockets, so after each switch each
worker records ``process_resources()`` (live process groups, threads, open file descriptors;
on CUDA the allocator's bytes too) and the test checks that none of them grows from the first
switches to the last. The plans cycle through DP2, TP2, PP2 and PP2 with the devices swapped,
so the switches move state by BSR, and the run still ends equal to the fault-free reference.

When a rank starts a step's collective before it sees the newer plan, the switch leaves that
collective in flight and the reaper's "retired ..." thread holds the old groups (a thread; their
sockets, pipe and epoll: four files) until it has ended, then half a second more; the switch
returns before that. A count read at once then shows a set about to be dropped (M16 item 8: 4 to 5
threads, 20 to 24 files, on a loaded machine). So the workers (``tests/scripts/leak_worker.py``)
read twice: ``raw`` at once, ``settled`` after ``GroupReaper.wait_idle``, the holder threads' own
end (bounded well below the groups' gloo timeout). The settled counts are compared, and every
switch's reaper must have gone idle; a failure names the threads and open files that differ.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from _elastic import HERE, assert_recovered_in_memory, payload
from _wait import wait_for
from hspmd_elastic.plan import simple_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

SWITCHES = 20
DEVICES = ["n0:0", "n1:0"]
WORKER = os.path.join(HERE, "scripts", "leak_worker.py")


def _plans():
    kw = dict(num_layers=2, global_batch=4)
    pp2 = simple_plan(pp=2, **kw)
    return [simple_plan(dp=2, **kw), simple_plan(tp=2, **kw), pp2, pp2.relabel({0: 1, 1: 0})]


def _what_differs(base: dict, look: dict) -> str:
    """What holds the extra count: the thread names of ``look`` that ``base`` lacks (and the
    reverse), the open files by kind (socket, pipe, anon_inode:[eventpoll], a path) likewise, and
    ``look``'s open files (fd and link target)."""
    def kind(target):
        return re.sub(r":\[\d+\]$", "", target.split(" ", 1)[1])

    def diff(a, b):
        more, less = Counter(b) - Counter(a), Counter(a) - Counter(b)
        return f"+{dict(more)} -{dict(less)}"

    return (f"threads {diff(base['threads'], look['threads'])}; open files by kind "
            f"{diff(map(kind, base['files']), map(kind, look['files']))}; reaper holding "
            f"{look['holding']} set(s); open files: {look['files']}")


def _summary(d: str, readings: list[dict]) -> str:
    """One line per worker: settled counts of the first and last three switches, and every
    switch whose raw reading caught the reaper holding a set."""
    def counts(x):
        c = x["settled"]["counts"]
        return f"{c['process_groups']}/{c['threads']}/{c['fds']}"

    held = [f"#{i + 1}: {x['raw']['counts']['threads']}/{x['raw']['counts']['fds']} held "
            f"{x['raw']['holding']} -> {x['settled']['counts']['threads']}/"
            f"{x['settled']['counts']['fds']} after {x['waited_s']:.2f}s"
            for i, x in enumerate(readings) if x["raw"]["holding"]]
    return (f"{d} (groups/threads/fds): switches 1-3 {[counts(x) for x in readings[:3]]}, "
            f"{SWITCHES - 2}-{SWITCHES} {[counts(x) for x in readings[-3:]]}; "
            f"raw readings with the reaper holding (threads/fds): {held or 'none'}")


def test_twenty_switches_leak_no_process_group_thread_or_socket(elastic_job):
    pl = payload(steps=SWITCHES + 2, pause_at=None, hold_steps=SWITCHES + 1)
    job = elastic_job(pl)
    procs = {d: job.spawn(d, script=[WORKER, job._path(d, "payload.json")]) for d in DEVICES}
    plans = _plans()
    job.publish(plans[0], DEVICES, reason="start")
    for k in range(1, SWITCHES + 2):
        def holding(k=k):
            for d in DEVICES:
                if procs[d].poll() is not None:
                    raise AssertionError(f"{d} exited ({procs[d].returncode}):\n{job.log(d)}")
            return all((job.progress(d) or {}).get("step", -1) >= k
                       and (job.progress(d) or {}).get("plan_version") == k for d in DEVICES)

        wait_for(holding, 60, f"both workers holding after step {k} in plan v{k}")
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
        readings = r["resources"][-SWITCHES:]
        assert len(readings) == SWITCHES, (d, r["resources"])
        print(_summary(d, readings))
        assert readings[0]["reapers"] == 1, f"{d}: found {readings[0]['reapers']} GroupReaper(s)"
        stuck = [x for x in r["resources"] if not x["idle"]]  # the first switch (v0->v1) too
        if stuck:
            pytest.fail(f"{d}: the reaper still held retired groups {stuck[0]['waited_s']:.1f}s "
                        f"after a switch: {stuck[0]['settled']['threads']}, "
                        f"{_what_differs(readings[0]['settled'], stuck[0]['settled'])}")
        res = [x["settled"]["counts"] for x in readings]
        early, late = range(3), range(SWITCHES - 3, SWITCHES)
        for key in res[0]:
            top = max(early, key=lambda i: res[i][key])
            worst = max(late, key=lambda i: res[i][key])
            assert res[worst][key] <= res[top][key], (
                f"{d}: {key} grew over {SWITCHES} switches: {[x[key] for x in res]}; after "
                f"switch {worst + 1} against switch {top + 1}: "
                f"{_what_differs(readings[top]['settled'], readings[worst]['settled'])}")
        assert res[-1]["process_groups"] >= 1  # the counter reads torch's registry
    assert moved > 0  # the switches moved state between the processes
