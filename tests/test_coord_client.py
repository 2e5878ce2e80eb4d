"""EtcdClient against a real etcd: reads, writes, transactions, fencing, leases, failures."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hspmd_elastic.coord import (
    Compare,
    CompareTarget,
    CoordinationError,
    EtcdClient,
    EtcdTimeoutError,
    EtcdUnavailableError,
    FencedWriteRejected,
    GetOp,
    LeaseLostError,
    PutOp,
    parse_endpoints,
)
from hspmd_elastic.coord.client import prefix_range_end
from _wait import Recorder, all_threads_stopped, wait_for


# ------------------------------------------------------------------------------ pure parts
def test_parse_endpoints_accepts_lists_and_schemes():
    assert parse_endpoints("127.0.0.1:2379, host-b:2380,http://c:1") == [
        ("127.0.0.1", 2379), ("host-b", 2380), ("c", 1)]


@pytest.mark.parametrize("bad", ["", "host", "host:", ":2379", "h:0", "h:99999", "h:12a"])
def test_parse_endpoints_names_the_bad_entry(bad):
    spec = f"ok:1,{bad}" if bad else bad
    with pytest.raises(ValueError) as err:
        parse_endpoints(spec)
    msg = str(err.value)
    assert "\n" not in msg
    assert repr(bad) in msg or "empty" in msg


def test_client_rejects_bad_arguments():
    with pytest.raises(ValueError, match="timeout"):
        EtcdClient("127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="'nope'"):
        EtcdClient(["127.0.0.1:1", "nope"])


def test_prefix_range_end():
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff") == b"\0"


# ------------------------------------------------------------------------------ real etcd
def test_get_put_delete_and_revisions(client):
    assert client.get("/t/a") is None
    r1 = client.put("/t/a", b"1")
    r2 = client.put("/t/b", "2")
    client.put("/t/a", b"3")
    kv = client.get("/t/a")
    assert kv.value == b"3" and kv.create_revision == r1 and kv.version == 2
    assert kv.mod_revision > r2
    snap = client.get_prefix("/t/")
    assert [k.key for k in snap] == ["/t/a", "/t/b"]
    assert snap.revision == client.revision() == kv.mod_revision
    assert client.delete("/t/a") is True
    assert client.delete("/t/a") is False
    client.put("/t/c", b"")
    assert client.delete_prefix("/t/") == 2
    assert len(client.get_prefix("/t/")) == 0


def test_put_if_absent_and_compare_and_set(client):
    assert client.put_if_absent("/t/k", b"a")
    assert not client.put_if_absent("/t/k", b"b")
    kv = client.get("/t/k")
    assert client.compare_and_set("/t/k", b"c", kv.mod_revision)
    assert not client.compare_and_set("/t/k", b"d", kv.mod_revision)  # stale revision
    assert client.get("/t/k").value == b"c"
    assert client.compare_and_set("/t/new", b"x", 0)  # 0: only if absent
    assert not client.compare_and_set("/t/new", b"y", 0)


def test_txn_returns_reads_of_the_branch_that_ran(client):
    res = client.txn([Compare("/t/x", CompareTarget.VERSION, "==", 0)],
                     [PutOp("/t/x", b"v"), GetOp("/t/x")], [GetOp("/t/x")])
    assert res.succeeded and res.gets[0].value == b"v"
    res2 = client.txn([Compare("/t/x", CompareTarget.VERSION, "==", 0)],
                      [PutOp("/t/x", b"w")], [GetOp("/t/x")])
    assert not res2.succeeded and res2.gets[0].create_revision == res.gets[0].create_revision


def test_fenced_writes(client):
    client.put("/t/fence", b"me")
    fence = client.get("/t/fence").create_revision
    client.fenced_put("/t/fence", fence, "/t/data", b"1")
    assert client.get("/t/data").value == b"1"
    # Inner compare fails but the fence holds: not an error, succeeded=False.
    res = client.fenced_txn("/t/fence", fence, [Compare("/t/data", CompareTarget.VALUE, "==", "0")],
                            [PutOp("/t/data", b"2")])
    assert not res.succeeded and client.get("/t/data").value == b"1"
    client.delete("/t/fence")
    with pytest.raises(FencedWriteRejected):
        client.fenced_put("/t/fence", fence, "/t/data", b"3")
    client.put("/t/fence", b"someone else")  # re-created: a new create revision
    with pytest.raises(FencedWriteRejected):
        client.fenced_put("/t/fence", fence, "/t/data", b"3")
    assert client.get("/t/data").value == b"1"


def test_leases(client):
    lease = client.grant(5)
    client.put("/t/leased", b"x", lease=lease)
    assert client.get("/t/leased").lease == lease
    assert client.refresh(lease) == 5
    assert 0 < client.lease_ttl(lease) <= 5
    assert client.revoke(lease) is True
    assert client.get("/t/leased") is None
    assert client.refresh(lease) <= 0
    assert client.lease_ttl(lease) == -1
    assert client.revoke(lease) is False
    with pytest.raises(LeaseLostError, match=f"{lease:016x}"):
        client.put("/t/leased", b"y", lease=lease)


def test_killed_etcd_fails_fast_then_recovers(etcd_server, client):
    client.put("/t/a", b"1")
    etcd_server.members[0].kill()
    for call in (lambda: client.get("/t/a", timeout=0.5), lambda: client.put("/t/a", b"2"),
                 lambda: client.grant(2, timeout=0.5)):
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailableError) as err:
            call()
        assert time.monotonic() - t0 < client.timeout + 2.0  # a deadline, not a hang
        assert "127.0.0.1" in str(err.value) and isinstance(err.value, CoordinationError)
        assert err.value.__cause__ is not None
    etcd_server.members[0].launch()
    etcd_server.members[0].wait_healthy()
    client.put("/t/a", b"3")  # the same client works again, within one call's deadline
    assert client.get("/t/a").value == b"3"


def test_a_frozen_etcd_gives_a_timeout_not_a_hang(etcd_server, client):
    client.put("/t/a", b"1")
    pid = etcd_server.members[0].proc.pid
    os.kill(pid, signal.SIGSTOP)  # alive, connected, silent: like a hung member
    try:
        wait_for(lambda: all_threads_stopped(pid), 5.0, "etcd's threads stopped")
        t0 = time.monotonic()
        with pytest.raises(EtcdTimeoutError, match="did not answer"):
            client.get("/t/a", timeout=0.5)
        assert time.monotonic() - t0 < 5.0  # the 0.5 s deadline, not a hang
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.get("/t/a").value == b"1"


def test_closed_client_raises_coordination_error(etcd_server):
    c = EtcdClient(etcd_server.endpoints, timeout=1.0)
    c.close()
    with pytest.raises(CoordinationError, match="closed"):
        c.get("/t/a")


@pytest.mark.cluster
def test_failover_when_the_member_in_use_dies(etcd_cluster3):
    c = EtcdClient(etcd_cluster3.endpoint_str, timeout=2.0)
    try:
        c.put("/t/a", b"1")
        used = c.current_endpoint
        victim = next(m for m in etcd_cluster3.members if m.endpoint == used)
        victim.kill()
        t0 = time.monotonic()
        c.put("/t/a", b"2")
        assert c.get("/t/a").value == b"2"
        assert c.current_endpoint != used
        assert time.monotonic() - t0 < 2 * c.timeout  # within the call, not a hang
    finally:
        c.close()


def test_etcd3_watcher_reports_a_broken_stream_instead_of_dying(etcd_server):
    # python3-etcd3's own watcher thread calls six.itervalues without importing six; importing
    # hspmd_elastic.coord gives it the shim, so its callbacks receive the stream error.
    import etcd3

    host, port = etcd_server.endpoints[0].split(":")
    raw = etcd3.MultiEndpointEtcd3Client([etcd3.Endpoint(host, int(port), secure=False)],
                                         timeout=2.0)
    got = Recorder()
    try:
        raw.add_watch_prefix_callback("/x/", got)
        etcd_server.members[0].kill()
        assert got.wait_for(lambda items: any(isinstance(i, Exception) for i in items), 5.0)
    finally:
        raw.close()
