"""Leases: the pure tracker, keep-alive, expiry, loss and re-creation of owned keys (real etcd)."""

from __future__ import annotations

import pytest

from hspmd_elastic.coord import (
    EventType,
    KeepAlive,
    LeasedSession,
    LeaseLostError,
    LeaseTracker,
    LeaseVerdict,
    PrefixWatch,
)
from hspmd_elastic.contract import schema
from _wait import Recorder, never, wait_for

JOB = "ljob"
WAIT = 6.0


# ------------------------------------------------------------------------------ pure tracker
def test_tracker_verdicts_follow_the_clock():
    t = LeaseTracker(ttl=3.0, last_ok=100.0)
    assert t.period == 1.0
    assert t.refreshed(101.0, granted_ttl=3) is LeaseVerdict.ALIVE and t.last_ok == 101.0
    assert t.next_delay(101.0, LeaseVerdict.ALIVE) == 1.0
    assert t.unreachable(103.5) is LeaseVerdict.UNREACHABLE
    assert 0 < t.next_delay(103.5, LeaseVerdict.UNREACHABLE) <= 0.5
    assert t.unreachable(104.01) is LeaseVerdict.LOST
    assert t.refreshed(104.5, granted_ttl=0) is LeaseVerdict.LOST
    assert t.last_ok == 101.0  # a refusal is not a refresh


def test_session_rejects_sub_second_ttl():
    with pytest.raises(ValueError, match="ttl"):
        LeasedSession(client=None, ttl=0.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ real etcd
def _node_record() -> bytes:
    return schema.NodeRecord(host="h", agent_pid=1, devices=[], state="ready",
                             started_at=0.0).to_json()


def test_keepalive_holds_a_key_for_many_ttls(client):
    lease = client.grant(1)
    client.put("/l/k", b"v", lease=lease)
    lost = Recorder()
    ka = KeepAlive(client, lease, ttl=1, on_lost=lost).start()
    try:
        # Bounded check: still present after 3 TTLs (without refreshes it is gone after ~1).
        never(lambda: client.get("/l/k") is None or lost.items, 3.0,
              "the leased key or the lease lost")
    finally:
        ka.stop()
    assert client.get("/l/k") is not None and not lost.items
    client.revoke(lease)


def test_expiry_deletes_the_node_record_and_a_watch_sees_it(client):
    key = schema.node_key(JOB, "n0")
    events = Recorder()
    with PrefixWatch(client, schema.nodes_prefix(JOB), events):
        session = LeasedSession(client, ttl=1, name="agent n0")
        session.put(key, _node_record())
        assert events.wait_len(1, WAIT)
        session.stop(revoke=False)  # the agent "dies": nobody refreshes the lease any more
        assert events.wait_len(2, WAIT)
    assert [(e.type, e.key) for e in events.items] == [(EventType.PUT, key),
                                                       (EventType.DELETE, key)]
    assert client.get(key) is None


def test_lost_lease_is_reported_regranted_and_keys_recreated(client):
    key = schema.node_key(JOB, "n1")
    lost, regranted = Recorder(), Recorder()
    session = LeasedSession(client, ttl=1, on_lost=lost, on_regranted=regranted)
    try:
        session.put(key, b"v1")
        session.put(key, _node_record())  # the latest value is what comes back
        old = session.lease_id
        client.revoke(old)  # e.g. an operator, or etcd expiring it during a long pause
        assert lost.wait_len(1, WAIT) and regranted.wait_len(1, WAIT)
        assert isinstance(lost.items[0], LeaseLostError) and lost.items[0].lease_id == old
        new = regranted.items[0]
        assert new != old and session.lease_id == new
        kv = client.get(key)
        assert kv is not None and kv.lease == new and kv.value == _node_record()
        assert session.owned_keys() == [key]
    finally:
        session.stop()
    assert client.get(key) is None  # stop() revokes: owned keys vanish at once


def test_put_many_is_one_revision_of_owned_keys_under_the_lease(client):
    keys = [schema.worker_key(JOB, "n1", i) for i in range(3)]
    session = LeasedSession(client, ttl=2)
    try:
        before = client.revision(prefix=schema.job_prefix(JOB))
        rev = session.put_many({k: f"v{i}".encode() for i, k in enumerate(keys)})
        assert rev == before + 1  # three keys, one write
        kvs = [client.get(k) for k in keys]
        assert [kv.value for kv in kvs] == [b"v0", b"v1", b"v2"]
        assert {kv.lease for kv in kvs} == {session.lease_id} and {kv.mod_revision
                                                                   for kv in kvs} == {rev}
        assert session.owned_keys() == sorted(keys)
    finally:
        session.stop()
    assert all(client.get(k) is None for k in keys)


def test_etcd_away_longer_than_ttl_loses_and_regrants(etcd_server, client):
    key = schema.node_key(JOB, "n2")
    lost, regranted = Recorder(), Recorder()
    session = LeasedSession(client, ttl=1, on_lost=lost, on_regranted=regranted)
    try:
        session.put(key, _node_record())
        old = session.lease_id
        etcd_server.members[0].kill()
        assert lost.wait_len(1, WAIT)
        assert "no refresh succeeded" in str(lost.items[0])
        with pytest.raises(LeaseLostError):
            session.put(key, _node_record())  # remembered, written once a lease exists
        etcd_server.members[0].launch()
        etcd_server.members[0].wait_healthy()
        assert regranted.wait_len(1, WAIT)
        wait_for(lambda: (kv := client.get(key)) is not None and kv.lease != old, WAIT,
                 "the key re-created under the new lease")
        assert client.get(key).lease == session.lease_id
    finally:
        session.stop()
