"""One job view per process (``launcher.jobview.WatchedJob``) against a real etcd.

The view's tables follow etcd through its watches (keyed like the records), readers wait on its
condition with a deadline, bad records are skipped and logged once, holders are counted; a
leader given the view holds its tables only while it leads; the injector's observer reads
through one. Last, an agent run in this process that leads and draws the progress bar holds
ONE set of watches (each prefix once), and notices a failed switch through the view.

No sleeps as synchronisation: every wait is on the view's condition or a bounded ``wait_for``.
"""

from __future__ import annotations

import collections
import io
import logging
import time
import uuid

import pytest

from _elastic_job import write_tiny
from _events import failed, replan
from _wait import wait_for

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.rounds import RoundState
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.journal import append_event
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.watch import PrefixWatch
from hspmd_elastic.planner import ModelProfile, plan_for
from launcher.inject.detect import JobObserver
from launcher.jobview import Table, WatchedJob
from launcher.leader import Leader, LeaderState
from launcher.node.elastic.devices import device_table, node_record

pytestmark = pytest.mark.timeout(120)

WAIT = 10.0
PROFILE = ModelProfile("tiny", num_layers=2, hidden_size=32, ffn_size=64, num_heads=4,
                       vocab_size=64, seq_len=16)


@pytest.fixture
def job() -> str:
    return f"jv-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def view(client, job):
    v = WatchedJob(client, job, name="test")
    yield v
    v.close()


def _node(host: str = "h") -> schema.NodeRecord:
    return schema.NodeRecord(host=host, agent_pid=1, devices=[], state="ready", started_at=0.0)


def _verdict(state: str = "healthy") -> schema.DeviceHealthRecord:
    return schema.DeviceHealthRecord(state=state, reason="", xid=None, slowdown=None, at=0.0)


def test_tables_follow_etcd_and_readers_wait_on_a_change(client, view, job):
    client.put(schema.node_key(job, "a"), schema.encode(_node()))
    view.acquire(list(Table), 5.0)
    assert view.nodes() == {"a": _node()}  # the listing is in before acquire returns
    gen = view.generation
    started = time.monotonic()
    assert view.wait(gen, 0.2) == gen  # no change: the wait ends at its deadline
    assert time.monotonic() - started >= 0.19

    worker = schema.WorkerRecord(pid=7, global_rank=0, local_rank=1, plan_version=1, step=3,
                                 last_progress_at=0.0, steps_per_s=1.0)
    client.put(schema.device_key(job, "a", 1), schema.encode(_verdict("failed")))
    client.put(schema.worker_key(job, "a", 1), schema.encode(worker))
    client.put(schema.reach_key(job, "a"), schema.encode(
        schema.ReachRecord(node="a", unreachable=["b"], at=0.0)))
    client.put(schema.retry_key(job, "a"), schema.encode(
        schema.RetryRecord(node="a", plan_version=1, slots=[1], waited_s=1.0, at=0.0)))
    client.put(schema.switch_ack_key(job, 2, "a"), schema.encode(
        schema.SwitchAckRecord(node="a", plan_version=2, state="done", at=0.0)))
    client.put(schema.rdzv_done_key(job, 2, "a"), schema.encode(
        schema.RdzvDoneRecord(node="a", at=0.0)))
    for v in (1, 2):
        append_event(client, job, "replan", "a", replan(v))
    assert view.wait(gen, WAIT) != gen  # woken by the first change
    assert view.wait_for(lambda: len(view.events_after(0)) == 2, WAIT)
    assert view.verdicts() == {("a", 1): _verdict("failed")}
    assert view.workers() == {("a", 1): worker}
    assert set(view.rows(Table.REACH)) == set(view.rows(Table.RETRY)) == {"a"}
    assert [a.node for a in view.acks(2)] == ["a"] and view.acks(1) == []
    assert view.done_nodes(2) == {"a"} and view.done_nodes(1) == set()
    assert [e.seq for e in view.events_after(1)] == [2]
    assert [e.seq for e in view.events_after(0, limit=1)] == [1]

    assert view.job_end() is None
    client.put(schema.rdzv_state_key(job), RoundState(round=2, state="closed", restart_count=0)
               .encode())
    assert view.wait_for(view.round_state, WAIT).state == "closed"
    assert view.job_end() is None  # not an end: a restart-mode round
    client.put(schema.rdzv_state_key(job), RoundState(round=2, state="failed", restart_count=0,
                                                      reason="why").encode())
    assert view.wait_for(view.job_end, WAIT).reason == "why"

    client.delete(schema.node_key(job, "a"))
    assert view.wait_for(lambda: not view.nodes(), WAIT)


def test_a_bad_record_is_skipped_and_logged_once(client, view, job, caplog):
    caplog.set_level(logging.WARNING, logger="launcher.jobview")
    client.put(schema.node_key(job, "bad"), b"{not json")
    client.put(schema.nodes_prefix(job) + "not/a/node", b"{}")  # a key outside the schema
    client.put(schema.node_key(job, "good"), schema.encode(_node()))
    view.acquire([Table.NODES], 5.0)
    assert set(view.nodes()) == {"good"}
    view.release([Table.NODES])
    assert view.nodes() == {} and view.watching() == []  # nobody holds it: stopped, emptied
    view.acquire([Table.NODES], 5.0)  # listed again: the same bad values, not logged again
    assert set(view.nodes()) == {"good"}
    skipped = [r for r in caplog.records if "skipping a bad record" in r.getMessage()]
    assert len(skipped) == 2, [r.getMessage() for r in skipped]
    client.put(schema.node_key(job, "good"), b"[]")  # a good record turned bad: no record
    assert view.wait_for(lambda: "good" not in view.nodes(), WAIT)
    client.put(schema.node_key(job, "bad"), schema.encode(_node("fixed")))
    assert view.wait_for(lambda: view.nodes().get("bad") == _node("fixed"), WAIT)


def test_holders_are_counted_and_listeners_see_each_change(client, view, job):
    seen = []
    token = view.subscribe(lambda ev: seen.append((ev.type.value, ev.key, ev.record)),
                           [Table.NODES])
    view.acquire([Table.NODES, Table.DEVICES], 5.0)
    view.acquire([Table.NODES], 5.0)  # a second reader: no second watch
    assert sorted(view.watching()) == sorted([schema.nodes_prefix(job),
                                              schema.devices_prefix(job)])
    client.put(schema.node_key(job, "a"), schema.encode(_node()))
    client.put(schema.device_key(job, "a", 0), schema.encode(_verdict()))
    assert view.wait_for(lambda: view.nodes() and view.verdicts(), WAIT)
    view.release([Table.NODES, Table.DEVICES])
    assert view.watching() == [schema.nodes_prefix(job)] and view.verdicts() == {}
    assert view.nodes() == {"a": _node()}
    client.delete(schema.node_key(job, "a"))
    assert view.wait_for(lambda: not view.nodes(), WAIT)
    view.unsubscribe(token)
    assert seen == [("PUT", schema.node_key(job, "a"), _node()),
                    ("DELETE", schema.node_key(job, "a"), None)]
    view.release([Table.NODES])
    assert view.watching() == []


def test_a_leader_holds_its_tables_only_while_it_leads(client, view, job):
    session = LeasedSession(client, ttl=2, name="agent a")
    rec = node_record("h-a", device_table("a", 2), "ready", 0.0, store_endpoint="127.0.0.1:1")
    session.put(schema.node_key(job, "a"), schema.encode(rec))
    view.acquire([Table.NODES, Table.DEVICES, Table.HEAD], 5.0)  # the agent's own readers
    leader = Leader(client, session, job, "a", plan_for, PROFILE, 8, debounce_s=0.05,
                    election_recheck_s=0.3, view=view)
    try:
        leader.start()
        head = view.wait_for(lambda: view.head(), WAIT)
        assert head is not None and head.version == 1
        wait_for(lambda: leader.publications and leader.state is LeaderState.WATCHING, WAIT,
                 "the leader back to watching after its publication")
        watched = view.watching()
        assert len(watched) == len(set(watched)) == 7  # agent 3 + leader 4 more, none twice
        assert view.plan()[0].version == 1
    finally:
        leader.stop(3.0)
        session.stop(timeout=3.0)
    assert sorted(view.watching()) == sorted([schema.nodes_prefix(job), schema.devices_prefix(job),
                                              schema.plan_head_key(job)])
    assert view.plan() == (None, 0) and view.workers() == {}  # released: emptied


def test_the_injectors_observer_reads_through_one_view(client, job):
    observer = JobObserver(client, job).start(5.0)
    try:
        assert sorted(observer.view.watching()) == sorted([
            schema.events_prefix(job), schema.devices_prefix(job), schema.workers_prefix(job),
            schema.rdzv_prefix(job), schema.plan_head_key(job)])
        gen = observer.view.generation
        for state in ("failed", "healthy"):  # the history of verdicts, not just the last
            client.put(schema.device_key(job, "a", 0), schema.encode(_verdict(state)))
        append_event(client, job, "replan", "a", replan(1, 0))
        assert observer.wait_change(gen, WAIT) != gen
        assert observer.view.wait_for(lambda: len(observer.verdicts()) == 2
                                      and observer.events(), WAIT)
        assert [v.state for v in observer.verdicts()] == ["failed", "healthy"]
        assert observer.baseline().last_seq == 1 and observer.job_ended() is None
        client.put(schema.rdzv_state_key(job), RoundState(round=1, state="succeeded",
                                                          restart_count=0).encode())
        assert observer.view.wait_for(observer.job_ended, WAIT) == "succeeded"
    finally:
        observer.stop()
    assert observer.view.watching() == []


# ------------------------------------------------------------ one process, one set of watches
class _LiveWatches:
    """Every ``PrefixWatch`` of this process that was started and not stopped."""

    def __init__(self, monkeypatch):
        self.live: dict[int, str] = {}
        start, stop = PrefixWatch.start, PrefixWatch.stop

        def counted_start(watch, timeout=None):
            out = start(watch, timeout)
            self.live[id(watch)] = watch.prefix
            return out

        def counted_stop(watch, timeout=5.0):
            self.live.pop(id(watch), None)
            return stop(watch, timeout)

        monkeypatch.setattr(PrefixWatch, "start", counted_start)
        monkeypatch.setattr(PrefixWatch, "stop", counted_stop)

    def prefixes(self) -> list[str]:
        return sorted(self.live.values())


@pytest.mark.parametrize("ending", ["switch-failed", "ended-elsewhere"])
def test_an_agent_that_leads_and_draws_the_bar_holds_one_set_of_watches(
        etcd_server, tmp_path, job, monkeypatch, ending):
    from launcher.cli import build_config, launch_command
    from launcher.console import WaitBar
    from launcher.node.agent import NodeAgent
    from launcher.node.api import End, StopCause

    watches = _LiveWatches(monkeypatch)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    params = launch_command.make_context("hspmd-launch", [
        "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", "n0",
        "--hspmd-lease-ttl", "2", "--monitor-interval", "0.05", "--shutdown-timeout", "3",
        "--log-dir", str(tmp_path / "logs"), "--hspmd-health-source", "none",
        "--hspmd-elastic", "--hspmd-model", str(write_tiny(tmp_path / "model.json")),
        "--hspmd-global-batch", "4", "--hspmd-debounce", "0.05", str(script)]).params
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    agent = NodeAgent(build_config(params), client)
    agent.ctx.bar = WaitBar(stream=io.StringIO(), enabled=True)  # as on a terminal
    mode = agent.make_mode()
    try:
        mode.start()
        leader = mode.node.leader
        wait_for(lambda: mode.tick() is None and mode.node.plan_version == 1
                 and leader.state is LeaderState.WATCHING, 30, "plan v1 applied by the leader")
        assert mode.view is mode.node.view is leader.view is mode._waits.view  # one instance
        counts = collections.Counter(watches.prefixes())
        assert all(n == 1 for n in counts.values()), counts  # no prefix watched twice
        view_prefixes = {schema.nodes_prefix(job), schema.devices_prefix(job),
                         schema.events_prefix(job), schema.rdzv_prefix(job),
                         schema.switch_prefix(job), schema.plan_head_key(job),
                         schema.workers_prefix(job), schema.reach_prefix(job),
                         schema.retry_prefix(job), schema.plan_current_key(job)}
        assert set(mode.view.watching()) == view_prefixes
        assert set(counts) == view_prefixes | {schema.election_prefix(job)}  # + the campaign

        if ending == "switch-failed":
            # A failed switch, journaled by a worker: the agent sees it through the view and
            # declares the job's end (rdzv/state), once.
            append_event(client, job, "switch-failed", "n0",
                         failed(2, "plan v2: no live owner", 1))
            why = "switch failed: plan v2: no live owner"
        else:  # another agent recorded the job's end: this one ends the same way
            why = "ended by another agent"
            client.put(schema.rdzv_state_key(job), RoundState(
                round=1, state="failed", restart_count=0, reason=why).encode())
        outcome = wait_for(lambda: mode.tick(), 30, "the agent judging the job failed")
        assert outcome.end is End.FAILED and why in outcome.reason, outcome
        ended = mode.view.wait_for(mode.view.job_end, WAIT)
        assert ended.state == "failed" and ended.reason == why
    finally:
        mode.stop(None if mode.state.value == "failed" else StopCause(signum=15))
        agent._leave()
        client.close()
    assert watches.prefixes() == []  # every watch stopped with the agent
