"""NCCL as torch 2.13's ProcessGroupNCCL really behaves, met by the elastic runtime.

gloo fails a collective whose peer died within the group's timeout; NCCL does not: a ``Work``'s
future is done at enqueue, ``wait()`` only orders streams, the kernel spins on the dead peer, a
host sync behind it blocks until the communicators are aborted, and an aborted work then reports
success. These tests run real worker processes whose plan group is formed, by the production
``GroupFormer``, on a double with ProcessGroupNCCL's semantics (``tests/_nccl_double.py``, a c10d
backend registered through torch's own interface; docs/gpu.md, "NCCL as it really is", gives the
torch source line of each behaviour), a real etcd for the plan watch, and a real SIGKILL for the
peer. The survivor must be out at the limit (the error names what ended the wait: the limit, a
newer plan, the peer's error), through an abort issued from the monitor's thread, never trust a
wait the abort completed, and form the next plan's group in the same process, with a joiner: a
world of two whose all-reduce must sum both ranks. A survivor that hangs fails the test at its
bound; no pass or fail depends on how long anything took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import pytest
import torch.distributed as dist

from hspmd_elastic.elastic.group import ARMED_GRACE_S

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "nccl_double_worker.py")
LIMIT_S = 3.0
BOUND_S = 120.0  # a survivor still running then is hung (start-up included)
NEXT_PLAN = [7.0, 7.0]  # the next plan's all-reduce: the survivor's 3 + the joiner's 4
START_S = 120.0  # importing torch on a loaded 2-core machine


class Worker:
    def __init__(self, role: str, scenario: str, store: str, etcd: str, job: str,
                 limit_s: float = LIMIT_S, env: Optional[dict] = None):
        extra, env = env or {}, dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for name in list(env):
            if name.startswith("TORCH_NCCL_") or name == "NCCL_DOUBLE_TRANSPORT":
                env.pop(name)  # what the worker sets, not the test's environment
        env.update(extra)
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

    def start(role, scenario, job, limit_s=LIMIT_S, env=None):
        w = Worker(role, scenario, f"127.0.0.1:{server.port}", etcd_server.endpoints[0], job,
                   limit_s, env)
        started.append(w)
        return w

    start.server = server
    yield start
    for w in started:
        w.kill()


def _by_the_limit(text: str, limit_s: float = LIMIT_S) -> bool:
    """Whether ``text`` says the limit ended the wait: the watchdog's ``limit_s``, or the armed
    monitor's (``limit_s`` plus its grace)."""
    return any(f"within {s:g}s" in text for s in (limit_s, limit_s + ARMED_GRACE_S))


def _trio(world, scenario: str, job: str, limit_s: float = LIMIT_S, env=None):
    """The survivor, the victim and the joiner of the survivor's next plan."""
    return tuple(world(role, scenario, job, limit_s, env)
                 for role in ("survivor", "victim", "joiner"))


def _next_plan_computed(res: dict, joiner: Worker) -> None:
    """The survivor formed the next plan in the same process, with the joiner, and its group
    computes: each rank's all-reduce holds both ranks' values."""
    assert res["next_plan"] == NEXT_PLAN, f"no next plan in the same process: {res}"
    joined = joiner.result()
    assert joined["next_plan"] == NEXT_PLAN, joined
    assert joiner.proc.wait(30) == 0, "\n".join(joiner.lines[-20:])


def _left_by_abort(res: dict, joiner: Worker) -> None:
    assert res["abort_threads"], "nothing aborted the communicators"
    assert res["abort_threads"][0] != res["main"], \
        f"the abort ran on the thread that was stuck: {res['abort_threads']}"
    assert res["abort_threads"][0].startswith("comm-abort-monitor"), res["abort_threads"]
    assert res["watchdog_fired"] == [], res  # torch's own timeout never came first
    _next_plan_computed(res, joiner)


def _kill_victim_then_go(survivor: Worker, victim: Worker) -> None:
    survivor.expect("FORMED", START_S)
    victim.expect("FORMED", START_S)
    victim.kill()  # a real SIGKILL, while the survivor holds the plan's group
    survivor.proc.stdin.write("GO\n")
    survivor.proc.stdin.flush()


def test_a_dead_peer_makes_the_survivor_leave_its_collective_through_an_abort(world):
    survivor, victim, joiner = _trio(world, "collective", "ncclsem-a")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res  # not a host sync that never returns
    assert _by_the_limit(res["message"]), res
    _left_by_abort(res, joiner)


def test_a_host_sync_behind_a_dead_peer_is_released_by_the_monitor_thread(world):
    survivor, victim, joiner = _trio(world, "hostsync", "ncclsem-b")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res
    # the monitor's limit (plus its grace) ended the host sync, nothing else
    assert res["fired"] and _by_the_limit(res["fired"]), res
    _left_by_abort(res, joiner)


def test_a_newer_plan_releases_a_blocked_host_sync_before_the_limit(world, etcd_server):
    job = "ncclsem-c"
    survivor, victim, joiner = _trio(world, "hostsync", job, 60.0)
    _kill_victim_then_go(survivor, victim)
    survivor.expect("SYNC", START_S)  # about to block in the host sync
    _publish_newer_plan(etcd_server, job)
    res = survivor.result()
    assert res["error"] == "SwitchRequested", res
    # the newer plan ended it, not the 60 s limit
    assert "a newer plan was published" in res["fired"], res
    assert "no communication completed" not in res["fired"], res
    _left_by_abort(res, joiner)


def _publish_newer_plan(etcd_server, job: str) -> None:
    from hspmd_elastic.coord import EtcdClient
    from hspmd_elastic.coord.plans import plan_puts
    from hspmd_elastic.contract import schema
    from hspmd_elastic.plan import simple_plan

    record = schema.PlanRecord(version=2, reason="test", devices=["n0:0"],
                               strategy=simple_plan(dp=1, num_layers=2, global_batch=2).to_dict(),
                               store_endpoint="127.0.0.1:1", created_at=time.time())
    with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
        client.txn([], plan_puts(job, record))  # as a leader publishes: the stamp announces it


@pytest.mark.parametrize("scenario", ["create", "split"])
def test_a_peer_dying_during_communicator_creation_costs_the_regroup_deadline(world, scenario):
    """NCCL makes a communicator ready only at its first operation (the default group's at
    ``form``, the sub-groups' after ``Comm.create``): that wait is bounded by our deadline."""
    survivor, victim, joiner = _trio(world, scenario, f"ncclsem-{scenario}")
    res = survivor.result()
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert res["error"] == "RegroupTimeout", res
    # our deadline, or torch's creation bound set to fire by it (TORCH_NCCL_NONBLOCKING_TIMEOUT)
    assert "not ready by the deadline" in res["message"] or \
        "NCCL timeout in" in res["message"], res
    _next_plan_computed(res, joiner)


def test_a_newer_plan_during_communicator_creation_is_seen_at_once(world, etcd_server):
    """The first operation waits for readiness inside torch, holding the mutex an abort needs,
    up to TORCH_NCCL_NONBLOCKING_TIMEOUT: it runs on a helper thread, so a newer plan ends the
    wait at once, and the communicator is aborted once its creation ends, off the main thread
    (the next plan forms meanwhile)."""
    job, deadline_s = "ncclsem-creating", 30.0
    survivor, victim, joiner = _trio(world, "creating", job, deadline_s)
    assert victim.proc.wait(START_S) == -signal.SIGKILL
    survivor.expect("FORMING", START_S)
    _publish_newer_plan(etcd_server, job)
    res = survivor.result()
    assert res["error"] == "RegroupAborted", res  # not RegroupTimeout after the whole bound
    _next_plan_computed(res, joiner)
    # no wait for the bound: v1's communicator still waited for readiness when v2 computed
    assert res["creations_waiting"] == 1, res


def test_a_wait_completed_by_the_abort_is_never_a_success(world):
    """NCCL completes an aborted work with no error (``isCompleted`` skips the error check once
    the communicator is aborted): the armed monitor aborts at its limit while the watchdog
    still waits on a collective, and the wait must raise (whether it saw the abort begin or the
    work complete first), never return partial data."""
    survivor, victim, joiner = _trio(world, "aborted", "ncclsem-aborted")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res
    assert "this plan's communicators were aborted" in res["message"], res
    assert "loss" not in res, res
    _left_by_abort(res, joiner)


def test_a_bsr_receive_completed_by_the_abort_is_never_returned(world, etcd_server):
    """The same for the fused BSR: its receive from the dead peer is posted (the double reports
    it enqueued: ``POSTED``), then a newer plan makes the armed monitor abort (the limit, 60 s,
    never comes first: the abort always lands after the post); the receive completes as an
    aborted work does, and the exchange must raise, never return what it received."""
    job = "ncclsem-bsr"
    survivor, victim, joiner = _trio(world, "bsr", job, 60.0)
    _kill_victim_then_go(survivor, victim)
    survivor.expect("POSTED", START_S)
    _publish_newer_plan(etcd_server, job)
    res = survivor.result()
    assert res["error"] == "ReshardCommError", res
    assert "1 transfer(s) completed only because the communicators were aborted (step 0: a " \
        "newer plan was published)" in res["message"], res
    assert "received" not in res, res
    _left_by_abort(res, joiner)


def test_two_hung_groups_are_aborted_together(world):
    """torch runs each group's abort on a thread of its own, so an NCCL group call around them
    covers nothing, and an abort can block behind another group's hung kernel: the aborts run
    at once, within a bound that one abort after the other never meets."""
    survivor, victim, joiner = _trio(world, "hung2", "ncclsem-h2")
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] is None, res  # not CommAbortFailed
    assert len(res["abort_threads"]) == 2, res
    _left_by_abort(res, joiner)


DUMP_ENV = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "3", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
            "TORCH_NCCL_COORD_CHECK_MILSEC": "200"}  # torch's 480 s, 15 s and 1 s, scaled down


def test_a_failure_leaves_no_dump_that_kills_a_later_worker_nor_a_stall(world):
    """torch's watchdog, on a work it times out, writes ``exception_dump`` at the root of the
    plan's store and sleeps 4 x the dump wait; the heartbeat monitor of any process's first
    group that sees the key terminates that process after its heartbeat timeout, and the
    group's destructor joins the sleeping watchdog. A worker that joins the survivor's next
    plan must live, and the survivor must not wait for a destructor on its main thread."""
    survivor = world("survivor", "dump", "ncclsem-dump", env=DUMP_ENV)
    victim = world("victim", "dump", "ncclsem-dump", env=DUMP_ENV)
    _kill_victim_then_go(survivor, victim)
    joiner = world("joiner", "dump", "ncclsem-dump", env=DUMP_ENV)  # its first group: after
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res
    assert res["watchdog_fired"] == [], res  # torch's own timeout never came first
    stalls = [(t, s) for t, s in res["destructor_waits"] if t == res["main"] and s > 0.5]
    assert not stalls, f"the main thread waited for a group's destructor: {res}"
    assert not world.server.check(["exception_dump"]), "torch's dump key was written"
    _next_plan_computed(res, joiner)  # and the joiner lived through the heartbeat window


def test_a_remote_error_surfaces_in_wait(world):
    """Over sockets a killed peer is an ``ncclRemoteError``: the survivor's own work sees it
    (``isCompleted`` checks the communicator's async error), ``wait()`` raises, and the
    watchdog reports it as a failed collective without waiting for its deadline."""
    env = {"NCCL_DOUBLE_TRANSPORT": "net"}
    survivor, victim, joiner = _trio(world, "collective", "ncclsem-net", 60.0, env=env)
    _kill_victim_then_go(survivor, victim)
    res = survivor.result()
    assert res["error"] == "CommTimeoutError", res
    assert "ncclRemoteError" in res["message"], res  # the peer's error, not the 60 s limit
    assert not _by_the_limit(res["message"] + str(res["fired"]), 60.0), res
    _next_plan_computed(res, joiner)


# ---------------------------------------------------------------- in this process: aborts
@pytest.fixture
def double_former():
    import _nccl_double as double
    from hspmd_elastic.elastic.group import GroupFormer

    double.register()
    double.reset_aborts()
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    former = GroupFormer(10.0, backend=double.NAME, abort_timeout_s=1.0)

    def form(version: int) -> None:
        former.form(version, f"127.0.0.1:{server.port}", 0, 1, aborted=lambda: False,
                    deadline=time.monotonic() + 10)

    yield former, form
    from hspmd_elastic.elastic.group import forget_process_groups

    double.reset_aborts()
    forget_process_groups()
    former.close()


@pytest.mark.timeout(60)
def test_a_failed_abort_still_leaves_a_clean_process(double_former):
    """ncclCommAbort failing (the double's own failure: an NCCL error raised by the abort)
    neither keeps the old group registered nor stops the next plan from forming."""
    import _nccl_double as double
    from torch.distributed import distributed_c10d as c10d

    former, form = double_former
    form(1)
    double.fail_aborts("unhandled system error")
    form(2)  # leaving v1 aborts (it raises), forgets v1's groups, then forms v2
    assert double.abort_threads == ["comm-abort-monitor"], double.abort_threads
    assert len(double.abort_errors) == 1 and "unhandled system error" in \
        double.abort_errors[0], double.abort_errors  # it did fail
    assert dist.is_initialized() and dist.get_backend() == double.NAME
    assert len(c10d._world.pg_map) == 1  # v2's default group alone
    from hspmd_elastic.elastic.group import end_process_groups

    double.fail_aborts("unhandled system error")
    assert end_process_groups() is not None  # the abort raised: still nothing left
    assert not dist.is_initialized() and not c10d._world.pg_map
    assert double.abort_threads == ["comm-abort-monitor", "MainThread"], double.abort_threads
    assert len(double.abort_errors) == 2, double.abort_errors


@pytest.mark.timeout(60)
def test_rank_prefixes_do_not_pile_up_over_plans(double_former, monkeypatch, capsys):
    """``init_process_group`` wraps ``sys.excepthook`` to prefix "[rankN]:" on every call; the
    former puts back the hook torch wrapped, so after three plans a traceback line carries
    one prefix."""
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # restored after the test
    _former, form = double_former
    for version in (1, 2, 3):
        form(version)
    try:
        raise ValueError("boom")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "ValueError: boom" in ln)
    assert line.count("[rank0]") == 1, err


@pytest.mark.timeout(60)
def test_an_abort_that_never_returns_is_fatal_in_one_line(double_former):
    """ncclCommAbort blocks behind another communicator's hung kernel (pytorch#119797, as the
    double's abort does): here a communicator of another world whose peer never acts. The abort
    of the plan's groups does not return within its bound: one line, and the process goes on."""
    import torch

    import _nccl_double as double
    from _wait import wait_for
    from hspmd_elastic.elastic.monitor import CommAbortFailed

    former, form = double_former
    form(1)
    store = dist.HashStore()
    for rank in (0, 1):  # both communicators made: ready, and the peer alive (this process)
        store.set(f"init/{rank}", str(os.getpid()))
    hung = double.DoubleGroup(store, 0, 2, 60.0)
    hung.allreduce([torch.ones(1)])  # spins on the stream: rank 1 never takes part
    wait_for(lambda: hung._core.spinning, 10, "the other communicator's hung all-reduce")
    try:
        with pytest.raises(CommAbortFailed, match=r"did not return within 1s"):
            former.abandoned(threading.Event())
        assert double.abort_threads == ["comm-abort-monitor"], double.abort_threads
    finally:
        hung.abort()  # the hung kernel ends: the blocked abort returns
    assert not hung._core.spinning


# ---------------------------------------------------------------- pipeline p2p on the double
def train_on_the_double(rank: int, world: int, payload: dict) -> dict:
    """A rank of ``run_world``: leaves the harness's gloo group, forms a plan group on the NCCL
    double through the production ``GroupFormer``, checks that point-to-point ignores tags and
    keeps the order, then trains a pipelined plan through the production ``Watchdog`` and
    ``Comm`` (sends held and batched with the next receive, as on CUDA)."""
    import torch

    import _nccl_double as double
    from test_graph_train import make_batches
    from hspmd_elastic.coord import EtcdClient
    from hspmd_elastic.elastic.group import GroupFormer
    from hspmd_elastic.elastic.watchdog import PlanWatcher, Watchdog
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.plan import Plan

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    dist.destroy_process_group()
    double.register()
    former = GroupFormer(30.0, backend=double.NAME)
    former.form(1, f"127.0.0.1:{store.port}", rank, world, aborted=lambda: False,
                deadline=time.monotonic() + 60)
    client = EtcdClient([payload["etcd"]], timeout=5.0)
    plans = PlanWatcher(client, "ncclsem-pp").start(10.0)
    watchdog = Watchdog(plans, lambda: 1, 30.0, on_abandon=former.abandoned,
                        monitor=former.monitor)
    out: dict = {}
    if rank == 0:  # two messages to rank 1, tagged 5 then 3
        works = [dist.isend(torch.tensor([1.0]), 1, tag=5), dist.isend(torch.tensor([2.0]), 1,
                                                                        tag=3)]
        for work in works:
            watchdog(work, "send")
    else:  # received asking for tag 3 first: NCCL matches by order, not by tag
        first, second = torch.zeros(1), torch.zeros(1)
        works = [dist.irecv(first, 0, tag=3), dist.irecv(second, 0, tag=5)]
        for work in works:
            watchdog(work, "recv")
        out["received"] = [first.item(), second.item()]
    config, plan = ModelConfig.from_json(payload["config"]), Plan.from_json(payload["plan"])
    comm = Comm.create(plan, config, rank, timeout_s=30.0, waiter=watchdog, store=former.store,
                       group_timeout_s=former.group_timeout_s)
    former.ready(list(comm.groups.values()), "the plan's groups", lambda: False,
                 time.monotonic() + 60)
    model = SpecializedModel.build(config, plan, rank, seed=payload["seed"], comm=comm)
    out["losses"] = [model.step(b) for b in make_batches(config, payload["steps"])]
    out["params"], out["ordered_p2p"] = model.local_params(), comm.ordered_p2p
    plans.stop()
    client.close()
    return out


@pytest.mark.timeout(180)
def test_a_pipeline_on_nccl_semantics_equals_the_reference(etcd_server):
    """1F1B over point-to-point that matches by order and ignores tags: the pipelined plan
    trains to the fault-free reference's parameters."""
    from _world import run_world
    from test_graph_train import CONFIG, GLOBAL_BATCH, SEED, STEPS, assert_matches_reference
    from hspmd_elastic.plan import simple_plan

    plan = simple_plan(pp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=4)
    results = run_world(train_on_the_double, 2, ({
        "config": CONFIG.to_json(), "plan": plan.to_json(), "seed": SEED, "steps": STEPS,
        "etcd": etcd_server.endpoints[0]},))
    assert results[1]["received"] == [1.0, 2.0], results[1]["received"]  # order, not tags
    assert all(r["ordered_p2p"] for r in results)  # the CUDA path: sends batched with receives
    assert_matches_reference(plan, results)
