"""Workers follow a slice of the plan: ``plan/stamp`` (a few bytes) to learn of a new plan and
``plan/layout`` (what a switch needs, read once per node and relayed) to switch.

The pure part (strategies as runs come back exactly; a layout gives the record's plan), the
publication (one transaction, digests), and a worker's ``PlanWatcher`` against a real etcd: it
resolves from the relay file, ``plan/layout`` or ``plan/current`` with digests checked, falls
back with a log line when a source is stale, missing or forged, and follows a leader that
predates stamps as before. The e2e tests (``test_elastic_e2e.py``, ``test_scale_small.py``) run
real workers on this path."""

from __future__ import annotations

import hashlib
import json
import logging
import random

import pytest

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.relay import read_relay, relay_file, relay_file_of, write_relay
from hspmd_elastic.coord import Election, EtcdClient, LeasedSession, publish_plan
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.coord.plans import (layout_plan, plan_digest, plan_layout, plan_stamp,
                                       read_plan_stamp)
from hspmd_elastic.coord.strategy_runs import RUNS, compact_strategy, expand_strategy
from hspmd_elastic.elastic.plan_watch import PlanWatcher
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from launcher.plan_relay import relay_plan
from _wait import wait_for

pytestmark = pytest.mark.timeout(60)

JOB = "slicejob"
WAIT = 10.0
SWITCH_FIELDS = ("version", "devices", "drain", "strategy", "store_endpoint", "step", "created_at")


def _random_plan(rng: random.Random) -> Plan:
    """Pipelines of a few shapes, on consecutive, shuffled or interleaved device ids."""
    layers = rng.choice([4, 6, 12])
    shapes = []
    for _ in range(rng.randint(1, 3)):
        cuts = sorted(rng.sample(range(1, layers), rng.randint(0, min(3, layers - 1))))
        bounds = [0, *cuts, layers]
        shapes.append([(rng.choice([1, 2, 4]), (a, b)) for a, b in zip(bounds, bounds[1:])])
    pipes_shape = [rng.choice(shapes) for _ in range(rng.randint(1, 12))]
    total = sum(tp for shape in pipes_shape for tp, _ in shape)
    ids = list(range(total))
    if rng.random() < 0.3:
        rng.shuffle(ids)
    elif rng.random() < 0.3:  # every other pipeline first: strided runs
        ids = ids[::2] + ids[1::2]
    it = iter(ids)
    pipes = [Pipeline(tuple(Stage(tuple(next(it) for _ in range(tp)), lay) for tp, lay in s),
                      1, 1) for s in pipes_shape]
    return Plan(tuple(pipes), len(pipes), layers)


def _record(version: int, plan: Plan, nodes: int = 0, drain=(), step: int = 3):
    devices = [f"n{i // 8}:{i % 8}" for i in range(len(plan.devices))]
    return schema.PlanRecord(version=version, reason="test", devices=devices,
                             strategy=plan.to_dict(), store_endpoint="h:1", created_at=1.5,
                             inventory={d: 1.0 for d in devices}, drain=list(drain), step=step)


def _same_switch(got: schema.PlanRecord, want: schema.PlanRecord) -> None:
    assert {f: getattr(got, f) for f in SWITCH_FIELDS} == {
        f: getattr(want, f) for f in SWITCH_FIELDS}
    assert plan_of(got) == plan_of(want)


# ------------------------------------------------------------------------------ pure
def test_strategies_as_runs_come_back_exactly_and_stay_small():
    rng = random.Random(1)
    for _ in range(300):
        strategy = _random_plan(rng).to_dict()
        compact = compact_strategy(strategy)
        assert RUNS in compact and expand_strategy(compact) == strategy
    big = simple_plan(dp=333, tp=8, pp=3, num_layers=63, global_batch=333 * 25,
                      num_microbatches=25).to_dict()
    compact = compact_strategy(big)
    assert len(compact[RUNS]) == 1 and expand_strategy(compact) == big
    assert len(json.dumps(compact)) < 300 and len(json.dumps(big)) > 80_000
    for other in ({}, {"tp": 1}, {**big, "extra": 1}, {"pipelines": "x", "schema": 1,
                                                        "global_batch": 1, "num_layers": 1}):
        assert compact_strategy(other) == other and expand_strategy(other) == other
    for bad in ([[0, 0, 0, 1, 1, []]], [[1, 0, 0, 1, 1, [[0, 0, 0, 1]]]], [[1, 0, 0, 1, 1, ["x"]]],
                "runs", [[1 << 30, 0, 1, 1, 1, [[0, 1, 0, 1]] * 8]]):
        with pytest.raises(ValueError):
            expand_strategy({RUNS: bad})


def test_a_layout_gives_the_plan_a_switch_needs():
    rng = random.Random(2)
    for version in range(1, 40):
        plan = _random_plan(rng)
        full = _record(version, plan)
        full.drain = rng.sample(full.devices, min(2, len(full.devices)))
        payload = schema.encode(full)
        layout = plan_layout(full, payload)
        assert layout.digest == plan_digest(payload)
        got = layout_plan(schema.decode(schema.plan_layout_key(JOB), schema.encode(layout)))
        _same_switch(got, full)
        assert (got.inventory, got.reason) == ({}, "")
    stamp = plan_stamp(full, payload, b"layout bytes")
    assert (stamp.version, stamp.digest, stamp.layout_digest) == (
        full.version, plan_digest(payload), "sha256:" + hashlib.sha256(b"layout bytes").hexdigest())
    assert plan_stamp(full, payload).layout_digest == ""


def test_the_relay_file_sits_beside_the_progress_files(tmp_path):
    path = relay_file(str(tmp_path))
    assert relay_file_of(str(tmp_path / "progress_3.json")) == path
    assert relay_file_of(None) is None and read_relay(path) is None
    write_relay(path, b"one")
    write_relay(path, b"two")
    assert read_relay(path) == b"two" and sorted(p.name for p in tmp_path.iterdir()) == [
        "plan_layout.json"]


# ------------------------------------------------------------------------------ with etcd
@pytest.fixture
def leader(etcd_server):
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    session = LeasedSession(client, ttl=5, name="leader")
    election = Election(client, session, JOB, "leader")
    assert election.campaign(5.0)
    published = []

    def publish(record: schema.PlanRecord) -> schema.PlanRecord:
        rev = client.get(schema.plan_current_key(JOB))
        publish_plan(election, record, rev.mod_revision if rev else 0, record.version - 1)
        published.append(record)
        return record

    try:
        yield client, publish
    finally:
        election.resign()
        session.stop()
        client.close()


@pytest.fixture
def worker_client(etcd_server):
    with EtcdClient(etcd_server.endpoints, timeout=2.0) as c:
        yield c


def _watcher(client, tmp_path=None, **kw) -> PlanWatcher:
    relay = relay_file(str(tmp_path)) if tmp_path is not None else None
    return PlanWatcher(client, JOB, relay_file=relay, **kw).start(5.0)


def test_publish_writes_stamp_and_layout_with_the_plan(leader):
    client, publish = leader
    full = publish(_record(1, simple_plan(dp=2, tp=2, num_layers=4, global_batch=4)))
    kvs = {k: client.get(k) for k in (schema.plan_current_key(JOB), schema.plan_stamp_key(JOB),
                                       schema.plan_layout_key(JOB), schema.plan_head_key(JOB))}
    assert len({kv.mod_revision for kv in kvs.values()}) == 1
    current, stamp_kv, layout_kv = (kvs[schema.plan_current_key(JOB)],
                                    kvs[schema.plan_stamp_key(JOB)],
                                    kvs[schema.plan_layout_key(JOB)])
    stamp = schema.decode(stamp_kv.key, stamp_kv.value)
    assert stamp.digest == plan_digest(current.value)
    assert stamp.layout_digest == plan_digest(layout_kv.value)
    assert len(stamp_kv.value) < 300
    assert read_plan_stamp(client, JOB) == (stamp, None, current.mod_revision)
    stored = schema.decode(current.key, current.value)
    _same_switch(layout_plan(schema.decode(layout_kv.key, layout_kv.value)), stored)
    assert stored.inventory == full.inventory


def test_a_worker_reads_the_layout_once_relayed_by_its_agent(leader, worker_client, tmp_path):
    client, publish = leader
    plans = _watcher(worker_client, tmp_path)
    try:
        v1 = publish(_record(1, simple_plan(dp=2, tp=2, num_layers=4, global_batch=4)))
        head = schema.decode(schema.plan_head_key(JOB),
                             client.get(schema.plan_head_key(JOB)).value)
        assert relay_plan(client, JOB, head, str(tmp_path))  # the agent's one call per plan
        got = plans.wait_newer(0, WAIT)
        _same_switch(got, client_record(client))
        assert got.strategy == v1.strategy and plans.sources == {"relay": 1}
        assert plans.seen_at(1) is not None and plans.newer_than(0).version == 1

        v2 = publish(_record(2, simple_plan(dp=1, tp=4, num_layers=4, global_batch=4),
                             drain=["n9:0"]))
        wait_for(lambda: plans.newer_than(1), WAIT, "the stamp of v2 announced")
        head = schema.decode(schema.plan_head_key(JOB),
                             client.get(schema.plan_head_key(JOB)).value)
        assert relay_plan(client, JOB, head, str(tmp_path))
        got = plans.wait_newer(1, WAIT)
        assert (got.version, got.drain) == (2, ["n9:0"]) and got.strategy == v2.strategy
        assert plans.sources == {"relay": 2}
        assert plans.wait_newer(1, WAIT) is got  # resolved once
    finally:
        plans.stop()


def client_record(client) -> schema.PlanRecord:
    kv = client.get(schema.plan_current_key(JOB))
    return schema.decode(kv.key, kv.value)


def test_a_stale_or_missing_slice_falls_back_with_a_log_line(leader, worker_client, tmp_path,
                                                            caplog):
    client, publish = leader
    caplog.set_level(logging.INFO, logger="hspmd_elastic.elastic.plan_watch")
    plans = _watcher(worker_client, tmp_path, relay_wait_s=0.3)
    try:
        # no relay file: plan/layout from etcd
        publish(_record(1, simple_plan(dp=2, tp=1, num_layers=4, global_batch=4)))
        _same_switch(plans.wait_newer(0, WAIT), client_record(client))
        assert plans.sources == {"layout": 1}
        assert "no plan relay file" in caplog.text

        # the relay file still holds v1 (the agent did not relay v2): plan/layout after a wait
        write_relay(relay_file(str(tmp_path)), client.get(schema.plan_layout_key(JOB)).value)
        publish(_record(2, simple_plan(dp=4, tp=1, num_layers=4, global_batch=4)))
        _same_switch(plans.wait_newer(1, WAIT), client_record(client))
        assert plans.sources == {"layout": 2}
        assert "still holds v1, not v2" in caplog.text

        # a forged relay file and a forged plan/layout (right version, other bytes): the digests
        # refuse both and the full record is read
        publish(_record(3, simple_plan(dp=1, tp=2, num_layers=4, global_batch=4)))
        layout = schema.decode(schema.plan_layout_key(JOB),
                               client.get(schema.plan_layout_key(JOB)).value)
        layout.store_endpoint = "evil:1"
        forged = schema.encode(layout)
        write_relay(relay_file(str(tmp_path)), forged)
        client.put(schema.plan_layout_key(JOB), forged)
        got = plans.wait_newer(2, WAIT)
        assert got.store_endpoint == "h:1" and got.inventory  # the full record
        assert plans.sources == {"layout": 2, "current": 1}
        assert "other bytes than plan/stamp gives for v3" in caplog.text

        # no plan/layout at all
        publish(_record(4, simple_plan(dp=2, tp=2, num_layers=4, global_batch=4)))
        client.delete(schema.plan_layout_key(JOB))
        _same_switch(plans.wait_newer(3, WAIT), client_record(client))
        assert plans.sources["current"] == 2
        assert "plan/layout holds nothing, not v4" in caplog.text
    finally:
        plans.stop()


def test_a_leader_without_stamps_is_followed_as_before(leader, worker_client, caplog):
    """v1 has a stamp; v2 and v3 come from a leader that writes ``plan/current`` alone. A
    waiting worker finds v2 by its reads; a training one (no wait) by its recheck; after that
    it watches ``plan/current`` and sees v3 at once."""
    client, publish = leader
    caplog.set_level(logging.WARNING, logger="hspmd_elastic.elastic.plan_watch")
    waiting = _watcher(worker_client)
    training = _watcher(worker_client, recheck_s=0.2)
    try:
        publish(_record(1, simple_plan(dp=2, tp=1, num_layers=4, global_batch=4)))
        assert waiting.wait_newer(0, WAIT).version == 1
        old = _record(2, simple_plan(dp=1, tp=1, num_layers=4, global_batch=4))
        client.put(schema.plan_current_key(JOB), schema.encode(old))
        got = waiting.wait_newer(1, WAIT, poll_s=0.1)
        _same_switch(got, old)
        assert got.inventory == old.inventory  # the full record, read by the poll
        wait_for(lambda: training.newer_than(1), WAIT, "the recheck found v2")
        assert "has no plan/stamp of its own" in caplog.text

        v3 = _record(3, simple_plan(dp=2, tp=2, num_layers=4, global_batch=4))
        client.put(schema.plan_current_key(JOB), schema.encode(v3))
        for plans in (waiting, training):
            wait_for(lambda: plans.newer_than(2), WAIT, "v3 from the plan/current watch")
            _same_switch(plans.wait_newer(2, 0.0), v3)
        stamp, record, _ = read_plan_stamp(client, JOB)
        assert record == v3 and stamp.layout_digest == ""
    finally:
        waiting.stop()
        training.stop()


class _PublishAfterFirstRead:
    """A client that lets ``publish`` run right after its first read of ``plan/stamp``: a plan
    published between ``read_plan_stamp``'s read and its compare."""

    def __init__(self, client, publish):
        self.client, self.publish, self.fired = client, publish, False

    def get(self, key, timeout=None):
        kv = self.client.get(key, timeout=timeout)
        if key == schema.plan_stamp_key(JOB) and not self.fired:
            self.fired = True
            self.publish()
        return kv

    def txn(self, *args, **kw):
        return self.client.txn(*args, **kw)


def test_a_plan_published_between_stamp_read_and_compare_is_no_legacy_plan(leader):
    client, publish = leader
    publish(_record(1, simple_plan(dp=2, tp=1, num_layers=4, global_batch=4)))
    racing = _PublishAfterFirstRead(client, lambda: publish(
        _record(2, simple_plan(dp=1, tp=2, num_layers=4, global_batch=4))))
    stamp, record, revision = read_plan_stamp(racing, JOB)
    assert racing.fired and record is None  # the stamp of v2, not the full record
    assert stamp.version == 2 and revision == client.get(
        schema.plan_current_key(JOB)).mod_revision


def test_a_newer_plan_while_resolving_is_resolved_instead(leader, worker_client, tmp_path):
    """The stamp of v1 is announced; before the worker resolves it, v2 replaces every record:
    the worker never returns a mix, it returns v2."""
    client, publish = leader
    plans = _watcher(worker_client, tmp_path, relay_wait_s=0.3)
    try:
        publish(_record(1, simple_plan(dp=2, tp=1, num_layers=4, global_batch=4)))
        wait_for(lambda: plans.newer_than(0), WAIT, "v1 announced")
        plans.stop()  # no more announcements: the worker learns of v2 only by reading
        publish(_record(2, simple_plan(dp=1, tp=2, num_layers=4, global_batch=4)))
        got = plans.wait_newer(0, WAIT, poll_s=0.1)
        _same_switch(got, client_record(client))
    finally:
        plans.stop()
