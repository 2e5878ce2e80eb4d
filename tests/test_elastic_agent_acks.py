"""Switch acks (``switch/<version>/<node_id>``) written by the elastic node agent: the pure
decision (``ack_state``), the progress reports it reads (the worker's lifecycle state beside its
``WorkerRecord``), and one node driven through several plans against a real etcd with real
worker processes: joined -> ready -> done, nothing for a plan without the node, failed when a
worker exits non-zero mid-switch (an etcd error there loses neither the verdict nor the ack),
each state written once, old versions pruned; the agent acts on ``plan/head`` and reads the full
``plan/current`` only when no head of it exists."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

import pytest

from hspmd_elastic.coord import EtcdClient, LeasedSession
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError, EtcdUnavailableError, PutOp
from hspmd_elastic.coord.plans import plan_head
from _wait import wait_for
from hspmd_elastic.coord.contract import worker_record
from hspmd_elastic.contract.progress import (
    TRAINED_STATES,
    WorkerProgress,
    read_progress,
    write_progress,
)
from launcher.node.elastic.acks import ACK_KEEP, ack_state
from launcher.node.elastic.devices import device_table
from launcher.node.elastic.node import ElasticNode
from launcher.node.elastic.workers import ElasticWorkers
from launcher.logs import WorkerLogPaths
from _clock import FakeClock

JOB = "ackjob"
WAIT = 10.0
# A worker that lives until the test writes its exit code into the file named by argv[1].
WORKER = ("import os, sys, time\n"
          "path = sys.argv[1]\n"
          "while not os.path.exists(path):\n"
          "    time.sleep(0.02)\n"
          "sys.exit(int(open(path).read()))\n")


def _report(pid: int, version: int, state: str, lr: int = 0) -> WorkerProgress:
    return WorkerProgress(pid=pid, global_rank=lr, local_rank=lr, plan_version=version, step=0,
                          last_progress_at=0.0, steps_per_s=0.0, state=state)


# ------------------------------------------------------------------------------ pure decision
def test_trained_states_are_the_runtime_states_at_or_past_training():
    from hspmd_elastic.elastic.api import WorkerState

    assert TRAINED_STATES == {s.value for s in (WorkerState.TRAINING, WorkerState.FINISHING,
                                                WorkerState.DONE)}


def test_ack_state_is_the_least_advanced_slot_and_a_failed_slot_fails_the_node():
    running = {0: 10, 1: 11}
    v3 = {0: _report(10, 3, "regrouping"), 1: _report(11, 3, "training", 1)}
    assert ack_state(3, [0, 1], running, {}, (), ()) == "joined"  # no report yet
    assert ack_state(3, [0, 1], running, {0: v3[0]}, (), ()) == "joined"
    assert ack_state(3, [0, 1], running, {0: _report(10, 2, "training"), 1: v3[1]},
                     (), ()) == "joined"  # slot 0 still trains under the old plan
    assert ack_state(3, [0, 1], running, v3, (), ()) == "ready"
    assert ack_state(3, [1], running, v3, (), ()) == "done"
    assert ack_state(3, [0, 1], running, {0: _report(10, 3, "finishing"), 1: v3[1]},
                     (), ()) == "done"
    # A report of another pid (a previous worker's) says nothing about the live one.
    assert ack_state(3, [1], running, {1: _report(99, 3, "training", 1)}, (), ()) == "joined"
    assert ack_state(3, [0, 1], running, v3, (), failed={0}) == "failed"
    assert ack_state(3, [1], running, v3, (), failed={0}) == "done"  # slot 0 is not in plan
    assert ack_state(3, [5], running, {}, (), ()) == "joined"  # its worker is not started


def test_ack_state_of_slots_whose_worker_exited_0():
    done = {0: _report(10, 3, "done")}
    assert ack_state(3, [0], {}, done, succeeded={0}, failed=()) == "done"
    assert ack_state(3, [0], {}, {}, succeeded={0}, failed=()) == "done"  # reports nothing
    assert ack_state(3, [0], {}, {0: _report(10, 2, "excluded")}, {0}, ()) == "joined"
    assert ack_state(4, [0], {}, done, succeeded={0}, failed=()) == "joined"  # finished v3


def test_progress_reports_carry_the_worker_state(tmp_path):
    path = tmp_path / "progress_1.json"
    report = {"pid": 7, "global_rank": 4, "local_rank": 1, "plan_version": 2, "step": 12,
              "last_progress_at": 1.5e9, "steps_per_s": 3.0, "state": "regrouping"}
    path.write_text(json.dumps(report))
    got = read_progress(str(path), 1)
    assert got.state == "regrouping" and (got.pid, got.plan_version) == (7, 2)
    assert worker_record(got) == schema.WorkerRecord(
        pid=7, global_rank=4, local_rank=1, plan_version=2, step=12, last_progress_at=1.5e9,
        steps_per_s=3.0)
    path.write_text(json.dumps({k: v for k, v in report.items() if k != "state"}))
    assert read_progress(str(path), 1).state == ""
    path.write_text(json.dumps({**report, "state": 3}))
    assert read_progress(str(path), 1) is None
    path.write_text(json.dumps([report]))
    assert read_progress(str(path), 1) is None


def test_the_progress_file_round_trips_between_the_planes(tmp_path):
    """What the worker runtime writes (``FileReporter``) is what the agent reads back."""
    from hspmd_elastic.elastic.api import FileReporter

    path = str(tmp_path / "progress_0.json")
    sent = WorkerProgress(pid=5, global_rank=3, local_rank=0, plan_version=4, step=9,
                          last_progress_at=1.7e9, steps_per_s=2.5, state="finishing")
    FileReporter(path).report(sent)
    assert read_progress(path, 0) == sent
    write_progress(path, WorkerProgress(**{**sent.__dict__, "step": 10}))
    assert read_progress(path, 0).step == 10 and not os.path.exists(path + ".tmp")


# ------------------------------------------------------------------------------ real etcd
def _log_paths(tmp_path):
    def paths(version: int, lr: int) -> WorkerLogPaths:
        d = tmp_path / "logs" / f"v{version}" / str(lr)
        d.mkdir(parents=True, exist_ok=True)
        return WorkerLogPaths(str(d / "out"), str(d / "err"), str(d / "error.json"), False,
                              False, True)
    return paths


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class AckHarness:
    """One node ``n`` with two slots, its plans put by hand (no leader), its workers real
    processes; the test writes their progress reports as the runtime would."""

    def __init__(self, etcd, tmp_path, clock=None):
        self.tmp = tmp_path
        self.client = EtcdClient(etcd.endpoints, timeout=1.0)
        self.session = LeasedSession(self.client, ttl=2, name="agent n")
        self.wall = FakeClock(1.7e9)
        self.workers = ElasticWorkers(JOB, "n", [sys.executable, "-c", WORKER,
                                                 str(tmp_path / "exit_${local_rank}")],
                                      etcd.endpoints, _log_paths(tmp_path))
        self.node = ElasticNode(self.client, self.session, JOB, "n", "127.0.0.1",
                                device_table("n", 2), self.workers, wall_clock=self.wall,
                                plan_recheck_s=0.0,  # each tick reads the plan
                                **({"clock": clock} if clock is not None else {}))

    def publish(self, version: int, devices: list[str]) -> None:
        rec = schema.PlanRecord(version=version, reason="t", devices=devices, strategy={},
                                store_endpoint="", created_at=0.0)
        self.client.put(schema.plan_current_key(JOB), schema.encode(rec))

    def report(self, lr: int, version: int, state: str, step: int = 0) -> None:
        self.wall.now += 1.0
        data = {"pid": self.workers.running()[lr], "global_rank": lr, "local_rank": lr,
                "plan_version": version, "step": step, "last_progress_at": self.wall.now,
                "steps_per_s": 0.0, "state": state}
        _atomic_write(self.workers.progress_file(lr), json.dumps(data))

    def exit(self, lr: int, code: int) -> None:
        _atomic_write(str(self.tmp / f"exit_{lr}"), str(code))

    def ack_kv(self, version: int):
        return self.client.get(schema.switch_ack_key(JOB, version, "n"))

    def ack(self, version: int) -> Optional[str]:
        kv = self.ack_kv(version)
        return None if kv is None else schema.decode(kv.key, kv.value).state

    def acked_versions(self) -> list[int]:
        prefix = schema.switch_prefix(JOB)
        return sorted(int(kv.key[len(prefix):].split("/")[0])
                      for kv in self.client.get_prefix(prefix))

    def tick(self) -> Optional[str]:
        """One tick (it reads the plan and the reports synchronously), then the ack of the
        node's current plan."""
        self.node.tick()
        return self.ack(self.node.plan_version)

    def close(self) -> None:
        self.node.stop(grace_s=2.0, timeout=3.0)
        self.session.stop(timeout=3.0)
        self.client.close()


@pytest.fixture
def harness(etcd_server, tmp_path):
    h = AckHarness(etcd_server, tmp_path)
    h.node.start()
    yield h
    h.close()


def test_a_node_acks_joined_ready_done_and_writes_each_state_once(harness):
    h = harness
    h.publish(1, ["n:0", "m:0", "n:1"])
    assert h.tick() == "joined"  # the workers just started: nothing reported yet
    kv = h.ack_kv(1)
    rec = schema.decode(kv.key, kv.value)
    assert (rec.node, rec.plan_version, rec.at) == ("n", 1, h.wall.now)
    assert kv.lease == h.session.lease_id  # goes with the node
    assert sorted(h.workers.running()) == [0, 1]
    h.report(0, 1, "regrouping")
    assert h.tick() == "joined"  # slot 1 has not reported plan v1 yet
    h.report(1, 1, "exchanging")
    assert h.tick() == "ready"
    assert schema.decode(kv.key, h.ack_kv(1).value).at == h.wall.now
    h.report(0, 1, "training")
    assert h.tick() == "ready"  # slot 1 still switches
    h.report(1, 1, "finishing")
    assert h.tick() == "done"
    for _ in range(3):
        assert h.tick() == "done"
    assert h.ack_kv(1).version == 3  # joined, ready, done: one write each

    # A plan without this node: no ack; the node's ack of v1 stays.
    h.publish(2, ["m:0", "m:1"])
    h.node.tick()
    assert h.node.plan_version == 2 and h.acked_versions() == [1]


def test_a_worker_exiting_mid_switch_fails_the_ack_and_an_etcd_error_loses_nothing(harness,
                                                                               monkeypatch):
    h = harness
    h.publish(1, ["n:0", "n:1"])
    h.node.tick()
    h.report(0, 1, "training")
    h.report(1, 1, "training")
    assert h.tick() == "done"
    h.publish(2, ["n:1", "n:0", "m:0"])  # a switch: both survivors take part
    assert h.tick() == "joined"  # they still train under v1
    h.report(0, 2, "resharding")
    assert h.tick() == "joined"

    # Slot 1's worker dies mid-switch while etcd refuses the ack: the exit verdict still
    # reaches etcd (published before the ack), and the ack is written once etcd takes it.
    put = h.session.put

    def flaky_put(key, value):
        if key.startswith(schema.switch_prefix(JOB)):
            raise EtcdUnavailableError("injected: etcd refuses the switch ack")
        return put(key, value)

    monkeypatch.setattr(h.session, "put", flaky_put)
    errors = []

    def tick_despite_errors() -> bool:
        try:
            h.node.tick()
        except CoordinationError as exc:
            errors.append(exc)
        return 1 in h.node.slots.failed()

    h.exit(1, 3)
    wait_for(tick_despite_errors, WAIT, "slot 1 failed despite the etcd errors", interval=0.05)
    assert errors and all("injected" in str(e) for e in errors)
    verdict = schema.decode(schema.device_key(JOB, "n", 1),
                            h.client.get(schema.device_key(JOB, "n", 1)).value)
    assert verdict.state == "failed" and verdict.origin == "exit"
    assert "code 3" in verdict.reason
    assert h.client.get(schema.worker_key(JOB, "n", 1)) is None
    assert h.ack(2) == "joined"
    monkeypatch.setattr(h.session, "put", put)
    assert h.tick() == "failed"
    h.report(0, 2, "training")  # the survivor finishes its switch: v2 stays failed
    assert h.tick() == "failed" and h.ack_kv(2).version == 2  # joined, failed
    assert h.ack(1) == "done"  # v1 was done before the exit: it stays done

    # The next plan leaves the failed slot out: the survivor alone can make it done.
    h.publish(3, ["n:0", "m:0"])
    h.report(0, 3, "training")
    assert h.tick() == "done" and h.ack_kv(3).version == 1  # reached within one tick


def test_old_versions_acks_are_pruned(harness):
    h = harness
    written = []
    for version in range(1, 10):
        if version == 4:  # a plan without this node writes nothing, and prunes too
            h.publish(version, ["m:0"])
            h.node.tick()
        else:
            h.publish(version, ["n:0"])
            h.node.tick()
            h.report(0, version, "training")
            assert h.tick() == "done"
            written.append(version)
        assert h.acked_versions() == [v for v in written if v >= version - ACK_KEEP]
    assert h.acked_versions() == [5, 6, 7, 8, 9]
    prefix = schema.switch_prefix(JOB)
    assert [k for k in h.session.owned_keys() if k.startswith(prefix)] == [
        schema.switch_ack_key(JOB, v, "n") for v in (5, 6, 7, 8, 9)]


def test_progress_records_are_written_at_most_once_a_second_in_one_transaction(etcd_server,
                                                                                tmp_path):
    mono = FakeClock(100.0)
    h = AckHarness(etcd_server, tmp_path, clock=mono)
    h.node.start()
    try:
        h.publish(1, ["n:0", "n:1"])
        h.tick()

        def steps():
            return {lr: (schema.decode(kv.key, kv.value).step, kv.mod_revision)
                    for lr in (0, 1) if (kv := h.client.get(schema.worker_key(JOB, "n", lr)))}

        h.report(0, 1, "training", step=1)
        h.report(1, 1, "training", step=1)
        h.tick()  # a new plan version in the reports: written at once
        first = steps()
        assert {lr: s for lr, (s, _r) in first.items()} == {0: 1, 1: 1}
        assert first[0][1] == first[1][1]  # both slots in one revision
        for step in (2, 3, 4):  # steps within the same second: no write
            h.report(0, 1, "training", step=step)
            h.report(1, 1, "training", step=step)
            h.tick()
            assert steps() == first
        mono.advance(1.0)
        h.tick()
        later = steps()
        assert {lr: s for lr, (s, _r) in later.items()} == {0: 4, 1: 4}
        assert later[0][1] == later[1][1] > first[0][1]
    finally:
        h.close()



def test_the_agent_acts_on_the_head_and_reads_the_full_plan_only_without_one(harness):
    """A head written with its plan is what the agent acts on (here it disagrees with the full
    record on purpose: the agent follows the head); a plan published to ``plan/current`` alone
    (a leader that predates heads: the head left is stale) is read from the full record."""
    h = harness
    full = schema.PlanRecord(version=1, reason="t", devices=["m:0", "n:0", "n:1"], strategy={},
                             store_endpoint="", created_at=0.0)
    head = dataclasses.replace(plan_head(full), devices=["m:0", "n:1"])
    h.client.txn([], [PutOp(schema.plan_current_key(JOB), schema.encode(full)),
                      PutOp(schema.plan_head_key(JOB), schema.encode(head))])
    assert h.tick() == "joined"
    # slot 0, which the head leaves idle, runs an idle worker (no rank)
    assert h.node.slot_plan == [1] and sorted(h.workers.running()) == [0, 1]
    assert h.node.records[1].global_rank == 1
    h.publish(2, ["n:1", "n:0"])  # plan/current alone
    assert h.tick() == "joined"
    assert h.node.plan_version == 2 and h.node.slot_plan == [0, 1]
    assert h.node.records[0].global_rank == 1 and sorted(h.workers.running()) == [0, 1]
