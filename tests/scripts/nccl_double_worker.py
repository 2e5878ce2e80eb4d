"""A worker of tests/test_nccl_semantics.py: rank ``0`` (the survivor) or ``1`` (the victim) of a
plan whose group is formed on the NCCL double (``tests/_nccl_double.py``) by the production
``GroupFormer``; the survivor then waits through the production ``Watchdog``, ``AbortMonitor``
and ``Comm``.

    nccl_double_worker.py ROLE SCENARIO STORE_ENDPOINT ETCD_ENDPOINT JOB LIMIT_S

Lines on stdout: ``FORMED`` once the plan's group exists (the test then SIGKILLs the victim and
answers ``GO`` on the survivor's stdin), and the survivor's last line ``RESULT {json}``.

Scenarios: ``collective`` (the step's all_reduce, then its host sync, with a dead peer),
``hostsync`` (a host sync blocked behind a collective whose wait said done at enqueue),
``create`` (the victim dies between the plan's barrier and its communicator), ``split`` (the
victim dies between the groups' barrier and its split).
"""

from __future__ import annotations

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


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    role, scenario, endpoint, etcd, job, limit = sys.argv[1:7]
    limit_s = float(limit)
    rank = 0 if role == "survivor" else 1
    double.register()
    former = GroupFormer(limit_s, connect_timeout_s=limit_s, backend=double.NAME)
    if scenario == "create" and rank == 1:  # arrives at the plan's barrier, then dies
        host, port = parse_endpoint(endpoint)
        store = dist.PrefixStore(version_prefix(1), dist.TCPStore(host, port, None, False))
        store.set("arrive/1", double.NAME)
        os.kill(os.getpid(), signal.SIGKILL)
    result: dict = {"main": threading.current_thread().name}
    start = time.monotonic()
    try:
        former.form(1, endpoint, rank, 2, aborted=lambda: False,
                    deadline=time.monotonic() + limit_s)
    except Exception as exc:  # noqa: BLE001 - reported
        result.update(error=type(exc).__name__, message=str(exc),
                      elapsed=time.monotonic() - start, initialized=dist.is_initialized())
        return finish(former, endpoint, result)
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
        try:
            Comm.create(plan, config, 0, timeout_s=limit_s, store=former.store)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            result.update(error=type(exc).__name__, message=str(exc))
        result["elapsed"] = time.monotonic() - start
        return finish(former, endpoint, result)
    say("FORMED")
    if sys.stdin.readline().strip() != "GO":  # the victim is SIGKILLed meanwhile
        return 3
    client = EtcdClient([etcd], timeout=5.0)
    plans = PlanWatcher(client, job).start(10.0)
    watchdog = Watchdog(plans, lambda: 1, limit_s, on_abandon=former.abandoned,
                        monitor=former.monitor)
    start = time.monotonic()
    try:
        with former.armed("step 0", limit_s, watchdog.superseded):  # as the runtime arms a step
            if scenario == "collective":  # the step: a collective through the watchdog ...
                loss = Comm({(0, 1): dist.group.WORLD}, 0, watchdog).all_reduce(
                    torch.ones(3, dtype=torch.float64), [0, 1])
            else:  # ... or one whose wait returned at enqueue
                loss = torch.ones(3, dtype=torch.float64)
                dist.all_reduce(loss, async_op=True)
            say("SYNC")
            double.synchronize()  # ... then its host sync (reading the loss)
            watchdog.check("after the host sync")
        result["error"] = None
        result["loss"] = loss.tolist()
    except CommTimeoutError as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    result["elapsed"] = time.monotonic() - start
    result["fired"] = former.monitor.fired
    plans.stop()
    client.close()
    return finish(former, endpoint, result)


def finish(former: GroupFormer, endpoint: str, result: dict) -> int:
    """The same process forms the next plan's group, alone, and computes on it."""
    result["abort_threads"] = list(double.abort_threads)
    try:
        former.form(2, endpoint, 0, 1, aborted=lambda: False, deadline=time.monotonic() + 30)
        t = torch.full((2,), 3.0)
        work = dist.all_reduce(t, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        result["next_plan"] = t.tolist()
    except Exception as exc:  # noqa: BLE001 - reported
        result["next_plan"] = f"{type(exc).__name__}: {exc}"
    former.leave()
    former.close()
    say("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
