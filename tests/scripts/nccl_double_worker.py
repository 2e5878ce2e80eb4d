"""A worker of tests/test_nccl_semantics.py: rank ``0`` (the survivor) or ``1`` (the victim) of a
plan whose group is formed on the NCCL double (``tests/_nccl_double.py``) by the production
``GroupFormer``; the survivor then waits through the production ``Watchdog``, ``AbortMonitor``,
``Comm`` and BSR. A ``joiner`` is a process that joins the survivor's next plan.

    nccl_double_worker.py ROLE SCENARIO STORE_ENDPOINT ETCD_ENDPOINT JOB LIMIT_S

Lines on stdout: ``FORMING`` before the plan's group is formed, ``FORMED`` once it exists (the
test then SIGKILLs the victim and answers ``GO`` on the survivor's stdin), ``SYNC`` before a
host sync, ``POSTED`` once the double has the BSR's receive enqueued, and the survivor's (and a
joiner's) last line ``RESULT {json}``. The survivor's next plan is a world of two with
the joiner, whose all-reduce sums rank + 3 (``NEXT_PLAN``: 7 on every element): a group that
did not work would leave a rank's own value.

Scenarios: ``collective`` (the step's all_reduce, then its host sync, with a dead peer),
``hostsync`` (a host sync blocked behind a collective whose wait said done at enqueue), ``aborted``
(the armed monitor aborts while the watchdog still waits: the collective completes as NCCL's
aborted works do), ``bsr`` (the same for a fused BSR's receive from the dead victim: the test
publishes a newer plan once it is ``POSTED``, on which the monitor aborts), ``hung2`` (two groups
hung on the dead peer when the plan is abandoned), ``dump`` (a host sync behind a dead peer, then
the next plan formed with a ``joiner``), ``create`` (the victim dies between the plan's barrier and
its communicator), ``creating`` (the same, and a newer plan is published meanwhile), ``split`` (the
victim dies between the groups' barrier and their first operation).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the double

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _nccl_double as double  # noqa: E402
from hspmd_elastic.coord import EtcdClient  # noqa: E402
from hspmd_elastic.elastic.group import GroupFormer, parse_endpoint, version_prefix  # noqa: E402
from hspmd_elastic.elastic.watchdog import PlanWatcher, Watchdog  # noqa: E402
from hspmd_elastic.graph.comm import Comm, CommTimeoutError, store_barrier  # noqa: E402

ELASTIC_ERRORS = (CommTimeoutError, RuntimeError)
NEXT_PLAN = [7.0, 7.0]  # rank 0's 3 + rank 1's 4: the next plan's all-reduce, computed
WATCHDOG_S = 60.0  # "aborted", "bsr": the watchdog's own deadline, far beyond the armed limit


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    role, scenario, endpoint, etcd, job, limit = sys.argv[1:7]
    limit_s = float(limit)
    double.register()
    if role == "joiner":
        return joiner(endpoint, limit_s)
    rank = 0 if role == "survivor" else 1
    # "hung2": an abort bound the two aborts can meet only if they run at once
    former = GroupFormer(limit_s, connect_timeout_s=limit_s, backend=double.NAME,
                         **({"abort_timeout_s": limit_s} if scenario == "hung2" else {}))
    client = EtcdClient([etcd], timeout=5.0)
    plans = PlanWatcher(client, job).start(10.0)
    newer = lambda: plans.newer_than(1) is not None  # noqa: E731
    if scenario in ("create", "creating") and rank == 1:  # arrives at the barrier, then dies
        host, port = parse_endpoint(endpoint)
        store = dist.PrefixStore(version_prefix(1), dist.TCPStore(host, port, None, False))
        store.set("arrive/1", double.NAME)
        os.kill(os.getpid(), signal.SIGKILL)
    result: dict = {"main": threading.current_thread().name}
    say("FORMING")
    start = time.monotonic()
    try:
        former.form(1, endpoint, rank, 2, aborted=newer, deadline=time.monotonic() + limit_s)
    except Exception as exc:  # noqa: BLE001 - reported
        result.update(error=type(exc).__name__, message=str(exc),
                      elapsed=time.monotonic() - start, initialized=dist.is_initialized())
        return finish(former, endpoint, result, plans, client)
    from hspmd_elastic.plan import simple_plan
    from hspmd_elastic.graph.config import ModelConfig

    plan = simple_plan(dp=2, num_layers=2, global_batch=2)
    config = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=2, ffn_size=16,
                         seq_len=4, dtype="float64")
    if scenario == "split" and rank == 1:  # meets the groups' barrier, then dies
        store_barrier(former.store, "comm-create", 1, 2, time.monotonic() + limit_s,
                      lambda: False)
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "split":
        start = time.monotonic()
        try:  # as GraphSwitch._create_comms: the groups, then their first operation
            comm = Comm.create(plan, config, 0, timeout_s=limit_s, store=former.store,
                               group_timeout_s=former.group_timeout_s)
            former.ready(list(comm.groups.values()), "plan v1's groups", newer,
                         time.monotonic() + limit_s)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            result.update(error=type(exc).__name__, message=str(exc))
        result["elapsed"] = time.monotonic() - start
        return finish(former, endpoint, result, plans, client)
    second = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=former.group_timeout_s)) \
        if scenario == "hung2" else None
    if second is not None:
        former.ready([second], "the second group", newer, time.monotonic() + limit_s)
    say("FORMED")
    if sys.stdin.readline().strip() != "GO":  # the victim is SIGKILLed meanwhile
        return 3
    watchdog_s = WATCHDOG_S if scenario in ("aborted", "bsr") else limit_s
    watchdog = Watchdog(plans, lambda: 1, watchdog_s, on_abandon=former.abandoned,
                        monitor=former.monitor)
    start = time.monotonic()
    try:
        with former.armed("step 0", limit_s, watchdog.superseded):  # as the runtime arms a step
            if scenario == "bsr":
                result["received"] = bsr(former)
            elif scenario in ("collective", "aborted"):  # the step: through the watchdog ...
                loss = Comm({(0, 1): dist.group.WORLD}, 0, watchdog).all_reduce(
                    torch.ones(3, dtype=torch.float64), [0, 1])
                result["loss"] = loss.tolist()
            elif scenario == "hung2":  # two groups hung on the dead peer, then abandoned
                for group in (dist.group.WORLD, second):
                    dist.all_reduce(torch.ones(1), group=group, async_op=True)
                former.abandoned(threading.Event())
            else:  # ... or one whose wait returned at enqueue
                dist.all_reduce(torch.ones(3, dtype=torch.float64), async_op=True)
            if scenario in ("collective", "hostsync", "dump"):
                say("SYNC")
                double.synchronize()  # ... then its host sync (reading the loss)
                watchdog.check("after the host sync")
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        result.update(error=type(exc).__name__, message=str(exc))
    result["elapsed"] = time.monotonic() - start
    result["fired"] = former.monitor.broken  # the reason, once the abort has begun
    second = None
    return finish(former, endpoint, result, plans, client)


def bsr(former: GroupFormer) -> list:
    """A fused BSR in which the dead victim sends this rank a tensor: ``POSTED`` once the
    receive is enqueued, then (the test publishes a newer plan) the armed monitor aborts the
    communicators, the receive completes, and the executor must not return it. No
    ``should_abort``: with it the executor could see the newer plan first and abandon the
    exchange (``ReshardAborted``, right too, but not the case held here)."""
    from hspmd_elastic.annotations import TensorAnnotation as T
    from hspmd_elastic.reshard import TensorSpec, fused_bsr_schedule
    from hspmd_elastic.reshard.executor import execute_fused

    spec = TensorSpec("w", (2, 3), "float64", T.single_group([1], {}), T.single_group([0], {}))
    schedule = fused_bsr_schedule([spec], {1}, {})
    double.enqueue_hooks.append(lambda kind: kind == "recv" and say("POSTED"))
    out, _stats = execute_fused(schedule, 0, {}, "cpu", timeout_s=WATCHDOG_S,
                                comms_aborted=former.comms_aborted)
    return out["w"].tolist()


def finish(former: GroupFormer, endpoint: str, result: dict, plans, client) -> int:
    """The same process forms the next plan's group with the joiner and computes."""
    plans.stop()
    client.close()
    result["abort_threads"] = list(double.abort_threads)
    try:
        former.form(2, endpoint, 0, 2, aborted=lambda: False, deadline=time.monotonic() + 120)
        result["next_plan"] = compute(0)
    except Exception as exc:  # noqa: BLE001 - reported
        result["next_plan"] = f"{type(exc).__name__}: {exc}"
    # an earlier communicator still waiting for readiness: the next plan did not wait for it
    result["creations_waiting"] = double.creations_waiting()
    former.leave()
    result["destructor_waits"] = list(double.destructor_waits)
    result["watchdog_fired"] = list(double.watchdog_fired)
    former.close()
    say("RESULT " + json.dumps(result))
    return 0


def compute(rank: int) -> list:
    t = torch.full((2,), 3.0 + rank)
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    return t.tolist()


def joiner(endpoint: str, limit_s: float) -> int:
    """Rank 1 of the survivor's next plan: a process whose first group is made after the
    failure. It computes once; where ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` is set, it then stays
    for the heartbeat window torch's monitor would end it in (that timeout plus its polls)."""
    former = GroupFormer(limit_s, connect_timeout_s=limit_s, backend=double.NAME)
    result: dict = {}
    try:
        former.form(2, endpoint, 1, 2, aborted=lambda: False, deadline=time.monotonic() + 240)
        result["next_plan"] = compute(1)
    except Exception as exc:  # noqa: BLE001 - reported
        result["next_plan"] = f"{type(exc).__name__}: {exc}"
    say("JOINED")
    heartbeat = os.environ.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    window = float(heartbeat) + 2.0 if heartbeat is not None else 0.0
    time.sleep(window)  # the observation window: torch's monitor would act within it
    result["survived_s"] = window
    say("RESULT " + json.dumps(result))
    os._exit(0)  # the group stays: its destructor is not what is observed here


if __name__ == "__main__":
    sys.exit(main())
