"""A bad record is skipped, never taken for an etcd outage (``coord.journal``,
``launcher/node/elastic/mode.py``).

Garbage at ``event_seq`` used to raise ``RecordError`` (a ``CoordinationError``) out of the
agent's append of a failure event: the agent logged "etcd unreachable" and its leader held the
next replan for the reconcile window. Real etcd, real agents and workers, a real SIGKILL.
"""

from __future__ import annotations

import os
import signal

import pytest

from _elastic_job import ElasticLaunchJob

from hspmd_elastic.contract import schema
from hspmd_elastic.coord import append_event, read_events

pytestmark = pytest.mark.multiproc


def test_a_bad_counter_is_counted_past_from_the_newest_event(client):
    job = "badseq"
    first = append_event(client, job, "join", "n1", schema.ChangeDetail(devices=["n1:0"]))
    client.put(schema.event_seq_key(job), b"\x00not json")
    second = append_event(client, job, "leave", "n1", schema.ChangeDetail(devices=["n1:0"]))
    assert (first.seq, second.seq) == (1, 2)
    assert [e.seq for e in read_events(client, job)] == [1, 2]
    assert schema.decode(schema.event_seq_key(job),
                         client.get(schema.event_seq_key(job)).value).value == 2


def test_garbage_at_event_seq_is_no_outage_and_the_failure_is_replanned(etcd_server, tmp_path,
                                                                       marker):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="badseq") as job:
        job.start("node-a", 2, nnodes="1")
        pids = job.wait_paused(["node-a:0", "node-a:1"])
        job.client.put(schema.event_seq_key(job.name), b'{"schema": 2, "kind": "counter"}')
        victim = pids.pop("node-a:1")
        os.kill(victim, signal.SIGKILL)
        job.release.touch()
        job.finish(90)
        job.assert_recovered(pids)
        err = job.agents["node-a"].stderr()
        assert "etcd unreachable" not in err and "holding the replan" not in err, err[-3000:]
        failures = [e for e in job.events() if e.type == "failure"]
        assert [schema.event_detail(e).devices for e in failures] == [["node-a:1"]]
