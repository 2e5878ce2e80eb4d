"""A dead peer never hangs a survivor on a backend with NCCL's semantics.

gloo fails a collective whose peer died within the group's timeout; NCCL does not: a ``Work``'s
future is done at enqueue, ``wait()`` only orders streams, the kernel spins on the dead peer, and
a host sync behind it blocks until the communicators are aborted. These tests run real worker
processes whose plan group is formed, by the production ``GroupFormer``, on a double with those
semantics (``tests/_nccl_double.py``, a c10d backend registered through torch's own interface),
a real etcd for the plan watch, and a real SIGKILL for the peer. The survivor must be out within
the limit, through an abort issued from the monitor's thread, and then form the next plan's
group in the same process. A survivor that hangs fails the test at its bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "nccl_double_worker.py")
LIMIT_S = 3.0
SLACK_S = 6.0  # the abort, the poll intervals, a loaded 2-core machine
BOUND_S = 120.0  # a survivor still running then is hung (start-up included)
START_S = 120.0  # importing torch on a loaded 2-core machine


class Worker:
    def __init__(self, role: str, scenario: str, store: str, etcd: str, job: str,
                 limit_s: float = LIMIT_S):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for name in ("TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_NONBLOCKING_TIMEOUT",
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
            env.pop(name, None)  # what the worker sets, not the test's environment
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, role, scenario, store, etcd, job, str(limit_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self.lines.append("<EOF>")
            self._seen.notify_all()

    def expect(self, prefix: str, timeout: float) -> str:
        """The first output line starting with ``prefix`` (an event: the reader thread's)."""
        def found():
            return next((ln for ln in self.lines if ln.startswith(prefix) or ln == "<EOF>"),
                        None)
        with self._seen:
            line = self._seen.wait_for(found, timeout)
        if line is None or line == "<EOF>":
            raise AssertionError(f"no {prefix!r} line within {timeout:g}s (hung or died); "
                                 "output:\n" + "\n".join(self.lines[-40:]))
        return line

    def result(self, timeout: float = BOUND_S) -> dict:
        return json.loads(self.expect("RESULT ", timeout)[len("RESULT "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def world(etcd_server):
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    started: list[Worker] = []

    def start(role, scenario, job, limit_s=LIMIT_S):
        w = Worker(role, scenario, f"127.0.0.1:{server.port}", etcd_server.endpoints[0], job,
                   limit_s)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def _left_by_abort(res: dict) -> None:
    assert res["abort_threads"], "nothing aborted the communicators"
    assert res["abort_threads"][0] != res["main"], \
        f"the abort ran on the thread that was stuck: {res['abort_threads']}"
    assert res["abort_threads"][0] == "comm-abort-monitor", res["abort_threads"]
    assert res["next_plan"] == [3.0, 3.0], f"no next plan in the same process: {res}"


def _kill_victim_then_go(survivor: Worker, victim: Worker) -> None:
    survivor.expect("FORMED", START_S)
    victim.expect("FORMED", START_S)
    victim.kill()  # a real SIGKILL, while the survivor holds the plan's group
    survivor.proc.stdin.write("GO\n")
    survivor.proc.stdin.flush()


def test_a_dead_peer_makes_the_survivor_leave_its_collective_through_an_abort(world):
    survivor, victim = world("survivor", "collective", "ncclsem-a"), \
        world("victim", "collective", "ncclsem-a")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res  # not a host sync that never returns
    assert res["elapsed"] <= LIMIT_S + SLACK_S, res
    _left_by_abort(res)


def test_a_host_sync_behind_a_dead_peer_is_released_by_the_monitor_thread(world):
    survivor, victim = world("survivor", "hostsync", "ncclsem-b"), \
        world("victim", "hostsync", "ncclsem-b")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res
    assert res["fired"] and "no communication completed" in res["fired"], res
    assert res["elapsed"] <= LIMIT_S + 2.0 + SLACK_S, res  # + the monitor's grace
    _left_by_abort(res)


def test_a_newer_plan_releases_a_blocked_host_sync_before_the_limit(world, etcd_server):
    from hspmd_elastic.coord import EtcdClient
    from hspmd_elastic.coord.plans import plan_puts
    from hspmd_elastic.contract import schema
    from hspmd_elastic.plan import simple_plan

    job = "ncclsem-c"
    survivor, victim = world("survivor", "hostsync", job, 60.0), \
        world("victim", "hostsync", job, 60.0)
    _kill_victim_then_go(survivor, victim)
    survivor.expect("SYNC", START_S)  # about to block in the host sync
    record = schema.PlanRecord(version=2, reason="test", devices=["n0:0"],
                               strategy=simple_plan(dp=1, num_layers=2, global_batch=2).to_dict(),
                               store_endpoint="127.0.0.1:1", created_at=time.time())
    with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
        client.txn([], plan_puts(job, record))  # as a leader publishes: the stamp announces it
    res = survivor.result()
    assert res["error"] == "SwitchRequested", res
    assert "newer plan" in res["fired"], res
    assert res["elapsed"] < 30.0, res  # far inside the 60 s limit
    _left_by_abort(res)


@pytest.mark.parametrize("scenario,error", [("create", "RegroupTimeout"),
                                            ("split", "RuntimeError")])
def test_a_peer_dying_during_communicator_creation_costs_the_regroup_deadline(world, scenario,
                                                                               error):
    survivor = world("survivor", scenario, f"ncclsem-{scenario}")
    victim = world("victim", scenario, f"ncclsem-{scenario}")
    res = survivor.result()
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert res["error"] == error, res
    assert "communicator initialization" in res["message"], res
    assert res["elapsed"] <= LIMIT_S + SLACK_S, res
    assert res["next_plan"] == [3.0, 3.0], f"no next plan in the same process: {res}"


# ---------------------------------------------------------------- in this process: aborts
@pytest.fixture
def double_former():
    import _nccl_double as double
    from hspmd_elastic.elastic.group import GroupFormer

    double.register()
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    former = GroupFormer(10.0, backend=double.NAME, abort_timeout_s=1.0)

    def form(version: int) -> None:
        former.form(version, f"127.0.0.1:{server.port}", 0, 1, aborted=lambda: False,
                    deadline=time.monotonic() + 10)

    yield former, form
    from hspmd_elastic.elastic.group import forget_process_groups

    forget_process_groups()
    former.close()


@pytest.mark.timeout(60)
def test_a_failed_abort_still_leaves_a_clean_process(double_former, monkeypatch):
    import _nccl_double as double
    from torch.distributed import distributed_c10d as c10d

    former, form = double_former
    form(1)
    calls = []

    def broken(self):
        calls.append(threading.current_thread().name)
        raise RuntimeError("ncclCommAbort failed: unhandled system error")

    monkeypatch.setattr(double.DoubleGroup, "abort", broken)
    form(2)  # leaving v1 aborts (it raises), forgets v1's groups, then forms v2
    assert calls == ["comm-abort-monitor"], calls
    assert dist.is_initialized() and dist.get_backend() == double.NAME
    assert len(c10d._world.pg_map) == 1  # v2's default group alone
    monkeypatch.undo()
    from hspmd_elastic.elastic.group import end_process_groups

    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: (_ for _ in ()).throw(
        RuntimeError("abort raised half-way")))
    assert end_process_groups() is not None  # torch's abort raised: still nothing left
    assert not dist.is_initialized() and not c10d._world.pg_map


@pytest.mark.timeout(60)
def test_an_abort_that_never_returns_is_fatal_in_one_line(double_former, monkeypatch):
    import _nccl_double as double
    from hspmd_elastic.elastic.monitor import CommAbortFailed

    former, form = double_former
    form(1)
    release = threading.Event()
    monkeypatch.setattr(double.DoubleGroup, "abort", lambda self: release.wait(30))
    try:
        with pytest.raises(CommAbortFailed, match=r"did not return within 1s"):
            former.abandoned(threading.Event())
    finally:
        release.set()
