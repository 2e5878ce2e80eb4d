"""The event journal: gap-free, unique sequence numbers under concurrent writers (real etcd)."""

from __future__ import annotations

import threading

from hspmd_elastic.coord import EtcdClient, append_event
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.journal import read_events

JOB = "jjob"


def test_concurrent_appends_get_unique_consecutive_numbers(etcd_server):
    clients = [EtcdClient(etcd_server.endpoints, timeout=2.0) for _ in range(3)]
    errors = []

    def writer(client, name):
        try:
            for i in range(5):
                append_event(client, JOB, "join", name, schema.ChangeDetail(
                    devices=[f"{name}:{i}"]), timings={"detect_s": 0.01})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(c, f"n{k}")) for k, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    try:
        assert not errors and not any(t.is_alive() for t in threads)
        events = read_events(clients[0], JOB)
        assert [e.seq for e in events] == list(range(1, 16))
        for n in ("n0", "n1", "n2"):
            assert [schema.event_detail(e).devices for e in events if e.node == n] == [
                [f"{n}:{i}"] for i in range(5)]
        counter = clients[0].get(schema.event_seq_key(JOB))
        assert schema.decode(counter.key, counter.value).value == 15
        assert [e.seq for e in read_events(clients[0], JOB, after_seq=13)] == [14, 15]
    finally:
        for c in clients:
            c.close()


def test_a_batch_is_consecutive_in_few_transactions_and_interleaves_with_single_appends(
        etcd_server):
    from hspmd_elastic.coord import NewEvent, append_events

    job = "jbatch"
    with EtcdClient(etcd_server.endpoints, timeout=2.0) as client:
        replan = schema.ReplanDetail(1, 0, "start", 1, "dp", "a:1")
        append_event(client, job, "replan", "a", replan)
        before = client.revision(prefix=schema.job_prefix(job))
        batch = [NewEvent("join", f"n{i}", schema.ChangeDetail(devices=[f"n{i}:0"]))
                 for i in range(250)]
        written = append_events(client, job, batch, per_txn=100)
        assert [e.seq for e in written] == list(range(2, 252))
        assert client.revision(prefix=schema.job_prefix(job)) == before + 3  # 100 + 100 + 50
        append_event(client, job, "replan", "a", replan)
        events = read_events(client, job)
        assert [e.seq for e in events] == list(range(1, 253))
        assert [e.node for e in events[1:251]] == [f"n{i}" for i in range(250)]
        assert events[-1].type == "replan"
