"""A real 3-member etcd cluster: losing the member in use keeps leases, watches and elections."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from hspmd_elastic.coord import (
    Election,
    EtcdClient,
    EventType,
    LeasedSession,
    PrefixWatch,
)
from hspmd_elastic.contract import schema
from _wait import Recorder, all_threads_stopped, never, wait_for

pytestmark = pytest.mark.cluster

JOB = "cjob"
WAIT = 8.0


def test_member_loss_keeps_lease_watch_and_election(etcd_cluster3, caplog):
    c1 = EtcdClient(etcd_cluster3.endpoints, timeout=2.0)
    c2 = EtcdClient(etcd_cluster3.endpoints, timeout=2.0)
    s1 = LeasedSession(c1, ttl=1, on_lost=Recorder(), name="agent a")
    s2 = LeasedSession(c2, ttl=1, name="agent b")
    lost = Recorder()
    s1.add_listener(on_lost=lost)
    events = Recorder()
    watch = PrefixWatch(c1, schema.job_prefix(JOB) + "nodes/", events)
    a = Election(c1, s1, JOB, "a", recheck_s=0.5)
    b = Election(c2, s2, JOB, "b", recheck_s=0.5)
    try:
        watch.start()
        node_a = schema.node_key(JOB, "a")
        s1.put(node_a, b"a")
        assert a.campaign(WAIT) and not b.campaign(0.3)
        assert events.wait_len(1, WAIT)

        used = c1.current_endpoint
        victim = next(m for m in etcd_cluster3.members if m.endpoint == used)
        moves = c1.failovers
        with caplog.at_level(logging.WARNING, logger="hspmd_elastic.coord.client"):
            victim.kill()
            c1.put(schema.node_key(JOB, "x"), b"after kill")  # fails over to a live member
        assert c1.current_endpoint != used and c1.answering_member == c1.current_endpoint
        # The move is counted and said (what a test of a whole job reads from stderr); the
        # lease keepalive shares the client, so it may have moved once more meanwhile.
        assert c1.failovers > moves
        assert any(r.getMessage().startswith(f"etcd client moved from member {used} to ")
                   for r in caplog.records), caplog.text
        assert events.wait_for(lambda ev: any(e.key.endswith("/x") for e in ev), WAIT)
        # The lease outlives several TTLs on the surviving members, without a loss.
        never(lambda: lost.items or c1.get(node_a) is None, 2.5, "node a's lease lost")
        assert c1.get(node_a).lease == s1.lease_id
        assert a.is_leader and not b.is_leader

        a.resign()  # b, on its own client, sees its predecessor go and takes over
        assert b.campaign(WAIT)
        b.fenced_put(schema.plan_current_key(JOB), b"{}")
        s1.stop()  # revokes: the node record disappears, the watch sees it
        assert events.wait_for(
            lambda ev: (EventType.DELETE, node_a) in [(e.type, e.key) for e in ev], WAIT)
    finally:
        watch.stop()
        for e in (a, b):
            e.resign(timeout=2.0)
        for s in (s1, s2):
            s.stop(timeout=2.0)
        c1.close()
        c2.close()


def test_watch_on_a_restarted_member_gets_what_was_written_while_it_was_down(etcd_cluster3):
    m0, m1, m2 = etcd_cluster3.members
    watcher = EtcdClient([m0.endpoint], timeout=1.0)  # this watch can only use member 0
    writer = EtcdClient([m1.endpoint, m2.endpoint], timeout=2.0)
    events = Recorder()
    watch = PrefixWatch(watcher, "/c/", events)
    try:
        watch.start()
        writer.put("/c/before", b"0")
        assert events.wait_len(1, WAIT)
        m0.kill()
        for i in range(10):  # quorum of two: the cluster accepts writes while member 0 is down
            writer.put(f"/c/k{i}", str(i).encode())
        writer.delete("/c/k3")
        assert len(events.items) == 1
        m0.launch()
        m0.wait_healthy()
        assert events.wait_len(12, WAIT), [e.key for e in events.items]
    finally:
        watch.stop()
        watcher.close()
        writer.close()
    got = [(e.type, e.key) for e in events.items]
    assert got == ([(EventType.PUT, "/c/before")] + [(EventType.PUT, f"/c/k{i}") for i in range(10)]
                   + [(EventType.DELETE, "/c/k3")])


def test_watch_leaves_a_frozen_member(etcd_cluster3):
    watcher = EtcdClient(etcd_cluster3.endpoints, timeout=1.0)
    events = Recorder()
    watch = PrefixWatch(watcher, "/f/", events, progress_s=0.3)
    lost = Recorder()
    session = LeasedSession(watcher, ttl=2, on_lost=lost, name="agent f")
    frozen = None
    try:
        watch.start()
        session.put("/g/node", b"alive")
        used = watcher.current_endpoint
        frozen = next(m for m in etcd_cluster3.members if m.endpoint == used)
        others = [m.endpoint for m in etcd_cluster3.members if m is not frozen]
        os.kill(frozen.proc.pid, signal.SIGSTOP)  # connected but silent: a hung or cut-off member
        wait_for(lambda: all_threads_stopped(frozen.proc.pid), 5.0,
                 "the frozen member's threads stopped")
        with EtcdClient(others, timeout=2.0) as writer:
            for i in range(5):
                writer.put(f"/f/k{i}", b"v")
        assert events.wait_len(5, WAIT), [e.key for e in events.items]
        assert [e.key for e in events.items] == [f"/f/k{i}" for i in range(5)]
        assert watcher.current_endpoint != used
        # The lease is refreshed through the other members: it outlives more than a TTL.
        never(lambda: lost.items, 2.5, "the lease lost")
        assert watcher.get("/g/node").lease == session.lease_id
    finally:
        if frozen is not None and frozen.proc is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        session.stop(timeout=2.0)
        watch.stop()
        watcher.close()
