"""``plan/head``: the few bytes of a plan a node agent needs, published with ``plan/current``.

The pure part (runs of devices, a node's slots and ranks from the head equal to those from the
full record), the publication (one transaction: same mod revision, the digest of the stored
record), the reader's fallback to ``plan/current`` when the head is missing or older (a plan of a
leader that predates heads), and a node agent that follows the head through its watch alone."""

from __future__ import annotations

import hashlib
import random
import sys

import pytest

from hspmd_elastic.coord import Election, EtcdClient, LeasedSession, publish_plan
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.plans import (device_runs, expand_runs, node_ranks, plan_head,
                                       plan_nodes, read_plan_head)
from test_elastic_agent_acks import _log_paths
from launcher.node.elastic.devices import device_table
from launcher.node.elastic.node import ElasticNode
from launcher.node.elastic.workers import ElasticWorkers
from _wait import wait_for

JOB = "headjob"
WAIT = 10.0


def _plan(version: int, devices: list[str], drain: list[str] = ()) -> schema.PlanRecord:
    return schema.PlanRecord(version=version, reason="t", devices=list(devices),
                             strategy={"tp": 1}, store_endpoint="h:29500", created_at=5.0,
                             drain=list(drain), step=7)


def test_runs_round_trip_and_give_the_full_records_slots_and_ranks():
    rng = random.Random(0)
    for _ in range(200):
        nodes = [f"n{i}" for i in range(rng.randint(1, 6))]
        devices = [f"{n}:{i}" for n in nodes for i in range(rng.randint(0, 9))]
        if rng.random() < 0.5:
            rng.shuffle(devices)
        else:  # node after node, some slots missing: the planner's usual order
            devices = [d for d in devices if rng.random() < 0.8]
        drain = rng.sample(devices, min(2, len(devices)))
        full = _plan(3, devices, drain)
        head = plan_head(full)
        assert expand_runs(head.devices) == devices
        assert expand_runs(head.drain) == drain
        assert plan_nodes(head) == plan_nodes(full)
        for n in nodes + ["absent"]:
            assert node_ranks(head, n) == node_ranks(full, n)
    assert device_runs(["a:0", "a:1", "a:2", "b:0", "a:3", "a:5"]) == [
        "a:0-2", "b:0", "a:3", "a:5"]
    for bad in ("a", "a:", ":1", "a:x", "a:3-1", "a:1-"):
        with pytest.raises(ValueError, match=repr(bad).replace("[", r"\[")):
            expand_runs([bad])


def test_publish_writes_the_head_with_the_plan_and_readers_fall_back_without_one(etcd_server):
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    session = LeasedSession(client, ttl=5, name="leader")
    election = Election(client, session, JOB, "leader")
    try:
        assert read_plan_head(client, JOB) is None
        assert election.campaign(5.0)
        publish_plan(election, _plan(1, ["a:0", "a:1", "b:0"], drain=["c:3"]), 0)
        current = client.get(schema.plan_current_key(JOB))
        kv = client.get(schema.plan_head_key(JOB))
        history = client.get(schema.plan_history_key(JOB, 1))
        assert kv.mod_revision == current.mod_revision == history.mod_revision
        head = schema.decode(kv.key, kv.value)
        assert head.digest == "sha256:" + hashlib.sha256(current.value).hexdigest()
        assert history.value == current.value
        assert (head.version, head.created_at, head.store_endpoint, head.step) == (
            1, 5.0, "h:29500", 7)
        assert (head.devices, head.drain) == (["a:0-1", "b:0"], ["c:3"])
        assert read_plan_head(client, JOB) == head

        # A leader that predates heads publishes v2 to plan/current alone: the head is stale.
        v2 = schema.encode(_plan(2, ["b:0", "b:1"]))
        client.put(schema.plan_current_key(JOB), v2)
        got = read_plan_head(client, JOB)
        assert (got.version, got.devices) == (2, ["b:0-1"])
        assert got.digest == "sha256:" + hashlib.sha256(v2).hexdigest()
        client.delete(schema.plan_head_key(JOB))  # no head at all
        assert read_plan_head(client, JOB) == got
    finally:
        election.resign()
        session.stop()
        client.close()


def test_an_agent_follows_the_head_through_its_watch(etcd_server, tmp_path):
    """Only the first tick reads (``plan_recheck_s`` is an hour): every later plan comes from
    the watch on ``plan/head``, with this node's slots and ranks as the head gives them."""
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    session = LeasedSession(client, ttl=5, name="agent n")
    election = Election(client, session, JOB, "n")
    workers = ElasticWorkers(JOB, "n", [sys.executable, "-c", "import time; time.sleep(60)"],
                             etcd_server.endpoints, _log_paths(tmp_path))
    node = ElasticNode(client, session, JOB, "n", "127.0.0.1", device_table("n", 2), workers,
                       plan_recheck_s=3600.0)
    try:
        node.start()
        node.tick()
        assert node.plan_version == 0
        assert election.campaign(5.0)
        publish_plan(election, _plan(1, ["m:0", "n:1", "m:1"]), 0)

        def seen(version: int) -> bool:
            node.tick()
            return node.plan_version == version
        wait_for(lambda: seen(1), WAIT, "plan v1 applied")
        assert node.slot_plan == [1] and node.plan_nodes == {"m", "n"}
        # slot 0, which the plan leaves idle, runs an idle worker (no rank)
        assert node.records[1].global_rank == 1 and sorted(workers.running()) == [0, 1]
        ack = client.get(schema.switch_ack_key(JOB, 1, "n"))
        assert schema.decode(ack.key, ack.value).state == "joined"

        rev = client.get(schema.plan_current_key(JOB)).mod_revision
        publish_plan(election, _plan(2, ["m:0", "n:1", "n:0"]), rev, 1)
        wait_for(lambda: seen(2), WAIT, "plan v2 applied")
        assert node.slot_plan == [0, 1] and node.records[0].global_rank == 2
        assert sorted(workers.running()) == [0, 1]  # the survivor kept, slot 0 added
    finally:
        node.stop(grace_s=2.0, timeout=3.0)
        election.resign()
        session.stop()
        client.close()
