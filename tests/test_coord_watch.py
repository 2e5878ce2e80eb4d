"""PrefixWatch against a real etcd: order, restarts without loss, compaction, bad records."""

from __future__ import annotations

import logging
import time

import pytest

from hspmd_elastic.coord import (
    EtcdClient,
    EventType,
    PrefixWatch,
    RecordError,
    WatchCompactedError,
)
from hspmd_elastic.contract import schema
from _wait import Recorder

WAIT = 5.0
JOB = "wjob"


def _keys(events):
    return [(e.type, e.key) for e in events]


def test_events_arrive_in_order_with_types_and_revisions(client):
    got = Recorder()
    with PrefixWatch(client, "/w/", got):
        r1 = client.put("/w/a", b"1")
        client.put("/elsewhere", b"x")
        client.put("/w/b", b"2")
        client.delete("/w/a")
        client.delete_prefix("/w/")
        assert got.wait_len(4, WAIT)
    ev = got.items
    assert _keys(ev) == [(EventType.PUT, "/w/a"), (EventType.PUT, "/w/b"),
                         (EventType.DELETE, "/w/a"), (EventType.DELETE, "/w/b")]
    assert ev[0].revision == r1 and ev[0].value == b"1" and ev[0].create_revision == r1
    assert [e.revision for e in ev] == sorted(e.revision for e in ev)
    assert ev[2].revision < ev[3].revision


def test_start_revision_replays_history(client):
    first = client.put("/w/a", b"1")
    client.put("/w/a", b"2")
    got = Recorder()
    with PrefixWatch(client, "/w/", got, start_revision=first):
        assert got.wait_len(2, WAIT)
    assert [e.value for e in got.items] == [b"1", b"2"]


def test_callback_errors_do_not_stop_the_watch(client, caplog):
    got = Recorder()

    def flaky(event):
        got(event)
        if event.value == b"boom":
            raise RuntimeError("consumer bug")

    with PrefixWatch(client, "/w/", flaky):
        client.put("/w/a", b"boom")
        client.put("/w/a", b"fine")
        assert got.wait_len(2, WAIT)
    assert "consumer bug" in caplog.text


def test_watch_resumes_after_etcd_restart_without_losing_events(etcd_server, client):
    got = Recorder()
    watch = PrefixWatch(client, "/w/", got).start()
    try:
        client.put("/w/before", b"0")
        assert got.wait_len(1, WAIT)
        opened = watch.streams_opened
        etcd_server.members[0].kill()
        etcd_server.members[0].launch()
        etcd_server.members[0].wait_healthy()
        # A second client writes right after the restart, racing the watch's reconnect:
        # whichever comes first, the resume from the last seen revision + 1 delivers all.
        with EtcdClient(etcd_server.endpoints, timeout=1.0) as writer:
            for i in range(20):
                writer.put(f"/w/k{i:02d}", str(i).encode())
        assert got.wait_len(21, WAIT), _keys(got.items)
        assert watch.streams_opened > opened
        client.put("/w/after", b"z")
        assert got.wait_len(22, WAIT)
    finally:
        watch.stop()
    keys = [e.key for e in got.items]
    assert keys == ["/w/before"] + [f"/w/k{i:02d}" for i in range(20)] + ["/w/after"]
    revs = [e.revision for e in got.items]
    assert revs == sorted(set(revs))  # in order, no duplicates


def test_compacted_start_reports_typed_error_and_resyncs(client):
    client.put("/w/a", b"1")
    client.put("/w/b", b"2")
    client.put("/w/a", b"3")
    client.compact(client.revision())
    got, errors = Recorder(), Recorder()
    with PrefixWatch(client, "/w/", got, start_revision=1, on_error=errors):
        assert errors.wait_len(1, WAIT)
        assert got.wait_len(2, WAIT)
        client.put("/w/c", b"4")
        assert got.wait_len(3, WAIT)
    err = errors.items[0]
    assert isinstance(err, WatchCompactedError) and err.compact_revision > 1
    ev = got.items
    assert [(e.key, e.value, e.synthetic) for e in ev] == [
        ("/w/a", b"3", True), ("/w/b", b"2", True), ("/w/c", b"4", False)]


def test_bad_record_is_logged_and_skipped(client, caplog):
    got, errors = Recorder(), Recorder()
    prefix = schema.nodes_prefix(JOB)
    good = schema.NodeRecord(host="h", agent_pid=1, devices=[], state="ready", started_at=0.0)
    with caplog.at_level(logging.WARNING, logger="hspmd_elastic.coord.watch"):
        with PrefixWatch(client, prefix, got, on_error=errors, decode=True):
            client.put(schema.node_key(JOB, "n0"), good.to_json())
            client.put(schema.node_key(JOB, "n1"), b"{oops")
            client.put(schema.node_key(JOB, "n2"), good.to_json())
            client.delete(schema.node_key(JOB, "n1"))
            assert got.wait_len(3, WAIT)
    assert [(e.type, e.key.rsplit("/", 1)[1]) for e in got.items] == [
        (EventType.PUT, "n0"), (EventType.PUT, "n2"), (EventType.DELETE, "n1")]
    assert got.items[0].record == good and got.items[2].record is None
    assert len(errors.items) == 1 and isinstance(errors.items[0], RecordError)
    assert errors.items[0].key == schema.node_key(JOB, "n1")
    lines = [r for r in caplog.records if "bad record" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage()


def test_start_fails_fast_without_etcd_and_stop_is_bounded(etcd_server, client):
    etcd_server.members[0].kill()
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        PrefixWatch(client, "/w/", Recorder()).start(timeout=1.0)
    assert type(err.value).__name__ == "EtcdUnavailableError"
    assert time.monotonic() - t0 < 6.0  # the 1 s budget, not a hang


def test_initial_lists_then_watches_without_a_gap(client):
    client.put("/w/a", b"1")
    client.put("/w/b", b"2")
    got = Recorder()
    with PrefixWatch(client, "/w/", got, initial=True):
        client.put("/w/c", b"3")
        client.delete("/w/a")
        assert got.wait_len(4, WAIT)
    assert [(e.type, e.key, e.synthetic) for e in got.items] == [
        (EventType.PUT, "/w/a", True), (EventType.PUT, "/w/b", True),
        (EventType.PUT, "/w/c", False), (EventType.DELETE, "/w/a", False)]
    with pytest.raises(ValueError, match="not both"):
        PrefixWatch(client, "/w/", got, start_revision=1, initial=True)
