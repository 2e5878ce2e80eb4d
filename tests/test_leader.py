"""The leader against a real etcd: agents are real LeasedSessions writing real records.

The failover case runs on a real 3-member cluster: the leader's agent dies mid-replan (with the
etcd member it talked to) and another candidate takes over and publishes the right plan.

No sleeps as synchronisation: every wait is on watched keys (or the leader's own state) with a
deadline; debounce clocks are injected where a test needs to hold a replan back.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from hspmd_elastic.coord import (
    EtcdClient,
    LeasedSession,
    PrefixWatch,
    read_events,
    read_plan,
)
from hspmd_elastic.contract import schema
from _clock import FakeClock
from _wait import Recorder, wait_for
from hspmd_elastic.coord.lifecycle import IllegalTransition
from hspmd_elastic.planner import ModelProfile, PlannerOptions, plan_for
from launcher.node.elastic.devices import device_table, node_record
from launcher.leader import Leader, LeaderState, Outcome

JOB = "ljob"
WAIT = 10.0
PROFILE = ModelProfile("tiny", num_layers=2, hidden_size=32, ffn_size=64, num_heads=4,
                       vocab_size=64, seq_len=16)
BATCH = 8


def every_worker(inventory, profile, global_batch, current_plan=None, options=None):
    """``plan_for`` with every usable device given a role (``use_all_devices``): these tests
    follow the devices through replans, and the tiny model's fixed costs would leave some
    idle otherwise."""
    return plan_for(inventory, profile, global_batch, current_plan,
                    replace(options or PlannerOptions(), use_all_devices=True))


class Agent:
    """A simulated node agent: its own client and lease, its node and device records, and
    (optionally) a Leader on the same session, as the real agent runs it."""

    def __init__(self, endpoints, name: str, slots: int = 2, ttl: float = 2):
        self.name = name
        self.client = EtcdClient(endpoints, timeout=1.0)
        self.session = LeasedSession(self.client, ttl=ttl, name=f"agent {name}")
        self.slots = slots
        self.leader = None

    def up(self, state: str = "ready") -> "Agent":
        rec = node_record(f"h-{self.name}", device_table(self.name, self.slots), state, 0.0,
                          store_endpoint=f"127.0.0.1:{29000 + ord(self.name[-1])}", pid=100)
        self.session.put(schema.node_key(JOB, self.name), rec.to_json())
        return self

    def verdict(self, index: int, state: str, reason: str = "", slowdown=None) -> None:
        rec = schema.DeviceHealthRecord(state=state, reason=reason, xid=None, slowdown=slowdown,
                                        at=0.0)
        self.session.put(schema.device_key(JOB, self.name, index), rec.to_json())

    def lead(self, planner_fn=every_worker, debounce_s: float = 0.1, **kw) -> Leader:
        self.leader = Leader(self.client, self.session, JOB, self.name, planner_fn, PROFILE,
                             BATCH, debounce_s=debounce_s, election_recheck_s=0.3, **kw)
        return self.leader.start()

    def crash(self) -> None:
        """The agent process dies: no more refreshes, nothing revoked, nothing resigned; its
        keys (node record, candidacy) expire with the lease."""
        self.session.stop(revoke=False, timeout=3.0)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.stop(timeout=3.0)
        self.session.stop(timeout=3.0)
        self.client.close()


class Cluster:
    def __init__(self, endpoints):
        self.endpoints = endpoints
        self.agents: list[Agent] = []
        self.client = EtcdClient(endpoints, timeout=1.0)
        self.plans = Recorder()
        self.watch = PrefixWatch(self.client, schema.plan_history_prefix(JOB), self._on_plan,
                                 decode=True, initial=True).start()

    def _on_plan(self, ev) -> None:
        if ev.record is not None:
            self.plans(ev.record)

    def agent(self, name: str, **kw) -> Agent:
        a = Agent(self.endpoints, name, **kw)
        self.agents.append(a)
        return a

    def wait_plan(self, version: int, timeout: float = WAIT) -> schema.PlanRecord:
        ok = self.plans.wait_for(lambda ps: any(p.version == version for p in ps), timeout)
        assert ok, f"plan v{version} not published in {timeout}s: {self.plans.items}"
        return next(p for p in self.plans.items if p.version == version)

    def versions(self) -> list[int]:
        return [p.version for p in self.plans.items]

    def events(self) -> list[schema.EventRecord]:
        return read_events(self.client, JOB)

    def close(self) -> None:
        self.watch.stop(3.0)
        for a in self.agents:
            a.close()
        self.client.close()


@pytest.fixture
def cluster(etcd_server):
    c = Cluster(etcd_server.endpoints)
    yield c
    c.close()


def _ticks_then(leader: Leader, state: LeaderState, timeout: float = WAIT) -> None:
    wait_for(lambda: leader.state is state, timeout, f"the leader {state.name}")


# ------------------------------------------------------------------------------------------------
def test_initial_plan_once_all_expected_nodes_are_there(cluster):
    a = cluster.agent("a").up()
    leader = a.lead(min_nodes=2)
    _ticks_then(leader, LeaderState.WATCHING)
    assert leader.pending is None and read_plan(cluster.client, JOB)[0] is None
    cluster.agent("b").up()
    v1 = cluster.wait_plan(1)
    assert v1.reason == "start" and v1.devices == ["a:0", "a:1", "b:0", "b:1"]
    assert v1.store_endpoint == "127.0.0.1:29097"  # the leader's own node hosts the store
    assert v1.inventory == {d: 1.0 for d in v1.devices}
    assert sorted(d for p in v1.strategy["pipelines"] for s in p["stages"]
                  for d in s["devices"]) == [0, 1, 2, 3]
    wait_for(lambda: [e.type for e in cluster.events()] == ["join", "join", "replan"],
             WAIT, "the events join, join, replan")
    replan = cluster.events()[-1]
    detail = schema.event_detail(replan)
    assert replan.node == "a" and detail.version == 1 and detail.previous_version == 0
    assert detail.planner == "plan_for" and detail.device_count == 4
    assert replan.timings["detect_to_publish_s"] >= 0.0
    assert cluster.versions() == [1] and leader.outcomes == [Outcome.PUBLISHED]
    states = [t.state for t in leader.history()]
    assert states == [LeaderState.FOLLOWER, LeaderState.WATCHING, LeaderState.DEBOUNCING,
                      LeaderState.PLANNING, LeaderState.PUBLISHING, LeaderState.WATCHING]
    assert all(a.at <= b.at for a, b in zip(leader.history(), leader.history()[1:]))
    leader.stop(timeout=3.0)
    leader.stop(timeout=3.0)  # stopping again is a no-op: STOPPED once in the history
    assert [t.state for t in leader.history()][-2:] == [LeaderState.WATCHING,
                                                        LeaderState.STOPPED]
    with pytest.raises(IllegalTransition, match="leader state stopped -> watching"):
        leader._transition(LeaderState.WATCHING, "a bug")


def test_lease_expiry_replans_without_the_node(cluster):
    a = cluster.agent("a").up()
    b = cluster.agent("b").up()
    a.lead(min_nodes=2)
    cluster.wait_plan(1)
    b.crash()
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:0", "a:1"] and v2.reason == "leave b"
    wait_for(lambda: [e.type for e in cluster.events()][-2:] == ["leave", "replan"],
             WAIT, "the events leave, replan")
    leave = cluster.events()[-2]
    assert leave.node == "b" and schema.event_detail(leave).devices == ["b:0", "b:1"]
    assert cluster.versions() == [1, 2]


def test_a_replan_waits_while_held_and_is_decided_again_after(cluster):
    """``hold`` (the agent's etcd-outage policy reconciling) keeps a due replan back; a node
    whose record vanished and came back meanwhile switches nothing, one that stays gone is
    planned away once the hold ends."""
    held = threading.Event()
    held.set()
    a = cluster.agent("a").up()
    b = cluster.agent("b").up()
    leader = a.lead(min_nodes=2, hold=held.is_set)
    # The first plan is held back as well: the hold is about any replan.
    wait_for(lambda: leader.state is LeaderState.DEBOUNCING and leader._held,
             WAIT, "the first plan held while debouncing")
    held.clear()
    cluster.wait_plan(1)
    held.set()
    cluster.client.delete(schema.node_key(JOB, "b"))  # as if b's lease expired in an outage
    wait_for(lambda: leader.pending is not None and leader._held,
             WAIT, "b's leave pending and held")
    assert leader.pending.reason == "leave b"
    b.up()  # b's agent re-creates its record under its lease
    wait_for(lambda: leader.state is LeaderState.WATCHING, WAIT, "the leader watching again")
    held.clear()
    leader.poke()
    wait_for(lambda: leader.state is LeaderState.WATCHING and leader.pending is None,
             WAIT, "the leader watching with nothing pending")
    held.set()
    cluster.client.delete(schema.node_key(JOB, "b"))
    wait_for(lambda: leader.pending is not None and leader._held,
             WAIT, "b's leave pending and held")
    assert read_plan(cluster.client, JOB)[0].version == 1
    held.clear()  # b stayed gone: now it is a node that left
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:0", "a:1"] and v2.reason == "leave b"
    assert cluster.versions() == [1, 2]


def test_failed_verdict_is_excluded_and_degraded_reaches_the_planner(cluster):
    inventories = []

    def planner(inventory, profile, global_batch, current_plan=None, options=None):
        inventories.append(inventory)
        return every_worker(inventory, profile, global_batch, current_plan, options)

    a = cluster.agent("a").up()
    b = cluster.agent("b").up()
    a.lead(planner_fn=planner, min_nodes=2)
    cluster.wait_plan(1)
    a.verdict(1, "failed", "Xid 79: GPU fell off the bus")
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:0", "b:0", "b:1"]
    assert v2.reason == "failure a:1: Xid 79: GPU fell off the bus"
    b.verdict(0, "degraded", "thermal slowdown", slowdown=0.5)
    v3 = cluster.wait_plan(3)
    assert v3.reason == "degrade b:0: speed 100% -> 50%"
    assert v3.inventory == {"a:0": 1.0, "b:0": 0.5, "b:1": 1.0}
    slow = [d for d in inventories[-1].devices if d.node == "b" and d.slowdown != 1.0]
    assert len(slow) == 1 and slow[0].slowdown == 2.0
    assert [d.usable for d in inventories[1].devices] == [True, False, True, True]  # a:1 lost
    assert len(inventories[-1].devices) == 3  # a:1 is in neither v2 nor the cluster
    wait_for(lambda: [e.type for e in cluster.events()] == [
        "join", "join", "replan", "failure", "replan", "degrade", "replan"], WAIT,
        "the failure, degrade and replan events")


def test_a_join_gives_a_bigger_plan(cluster):
    a = cluster.agent("a").up()
    a.lead()
    assert cluster.wait_plan(1).devices == ["a:0", "a:1"]
    cluster.agent("c", slots=3).up()
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:0", "a:1", "c:0", "c:1", "c:2"] and v2.reason == "join c"
    wait_for(lambda: any(e.type == "join" and e.node == "c" for e in cluster.events()),
             WAIT, "c's join event")


def test_two_failures_in_quick_succession_make_one_publication(cluster):
    clock = FakeClock(1000.0)
    a = cluster.agent("a", slots=3).up()
    b = cluster.agent("b", slots=3).up()
    leader = a.lead(debounce_s=1.0, clock=clock, min_nodes=2, max_debounce_s=5.0)
    wait_for(lambda: leader.state is LeaderState.DEBOUNCING, WAIT, "the leader debouncing")
    clock.advance(1.5)
    leader.poke()
    cluster.wait_plan(1)
    wait_for(lambda: leader.state is LeaderState.WATCHING, WAIT, "the leader watching")
    a.verdict(2, "failed", "ecc")
    wait_for(lambda: leader.pending is not None and "a:2" in leader.pending.reason,
             WAIT, "a:2's failure pending")
    clock.advance(0.5)  # within the window: the second failure restarts it
    b.verdict(0, "failed", "Xid 48")
    wait_for(lambda: leader.pending is not None and "b:0" in leader.pending.reason,
             WAIT, "b:0's failure pending")
    clock.advance(0.6)  # 1.1s since the first, 0.6s since the second: still waiting
    leader.poke()
    wait_for(lambda: leader.state is LeaderState.DEBOUNCING, WAIT, "the leader debouncing")
    assert read_plan(cluster.client, JOB)[0].version == 1
    clock.advance(0.5)
    leader.poke()
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:0", "a:1", "b:1", "b:2"]
    assert v2.reason == "failure a:2: ecc; failure b:0: Xid 48"
    wait_for(lambda: leader.state is LeaderState.WATCHING, WAIT, "the leader watching")
    replan = [e for e in cluster.events() if e.type == "replan"][-1]
    assert replan.timings["detect_to_publish_s"] == pytest.approx(1.6)
    history = cluster.client.get_prefix(schema.plan_history_prefix(JOB))
    assert [schema.decode(kv.key, kv.value).version for kv in history] == [1, 2]
    assert cluster.versions() == [1, 2] and leader.outcomes.count(Outcome.PUBLISHED) == 2


def test_a_storm_stops_at_the_debounce_bound_and_versions_stay_consecutive(cluster):
    clock = FakeClock(1000.0)
    a = cluster.agent("a", slots=4).up()
    leader = a.lead(debounce_s=1.0, clock=clock, max_debounce_s=2.0)
    wait_for(lambda: leader.state is LeaderState.DEBOUNCING, WAIT, "the leader debouncing")
    clock.advance(1.0)
    leader.poke()
    cluster.wait_plan(1)
    wait_for(lambda: leader.state is LeaderState.WATCHING, WAIT, "the leader watching")
    for i in (0, 1, 2):  # a failure every 0.8 s keeps the window open until the bound
        a.verdict(i, "failed", f"ecc {i}")
        wait_for(lambda i=i: leader.pending is not None
                 and f"a:{i}" in leader.pending.reason, WAIT, f"a:{i}'s failure pending")
        clock.advance(0.8)
        leader.poke()
    v2 = cluster.wait_plan(2)
    assert v2.devices == ["a:3"]
    assert cluster.versions() == [1, 2]


def test_a_publication_that_loses_a_race_re_reads_and_converges(cluster):
    raced = {"armed": False}

    def racing_planner(inventory, profile, global_batch, current_plan=None, options=None):
        if raced["armed"]:  # another writer publishes v2 while we plan: our v2 must lose
            raced["armed"] = False
            other = schema.PlanRecord(version=2, reason="elsewhere", devices=["a:0", "a:1"],
                                      strategy={}, store_endpoint="127.0.0.1:29097",
                                      created_at=0.0, inventory={"a:0": 1.0, "a:1": 1.0})
            cluster.client.put(schema.plan_current_key(JOB), other.to_json())
            cluster.client.put(schema.plan_history_key(JOB, 2), other.to_json())
        return every_worker(inventory, profile, global_batch, current_plan, options)

    a = cluster.agent("a").up()
    leader = a.lead(planner_fn=racing_planner)
    cluster.wait_plan(1)
    wait_for(lambda: leader.state is LeaderState.WATCHING, WAIT, "the leader watching")
    raced["armed"] = True
    a.verdict(1, "failed", "ecc")
    v3 = cluster.wait_plan(3)
    assert v3.devices == ["a:0"] and v3.reason == "failure a:1: ecc"
    wait_for(lambda: [p.version for p in leader.publications] == [1, 3],
             WAIT, "publications v1 and v3")
    assert Outcome.CONFLICT in leader.outcomes
    assert cluster.versions() == [1, 2, 3]


def test_a_deposed_leaders_publish_is_rejected(cluster):
    gate, entered = threading.Event(), threading.Event()
    hold = {"on": False}

    def slow_planner(inventory, profile, global_batch, current_plan=None, options=None):
        if hold["on"]:
            entered.set()
            gate.wait(WAIT)
        return every_worker(inventory, profile, global_batch, current_plan, options)

    nodes = [cluster.agent("a").up(), cluster.agent("b").up()]
    # Leaders on sessions of their own, so deposing one leaves its node's records alone.
    a_leader_session = LeasedSession(nodes[0].client, ttl=2, name="leader a")
    a = Leader(nodes[0].client, a_leader_session, JOB, "a", slow_planner, PROFILE, BATCH,
               debounce_s=0.05, election_recheck_s=0.3, min_nodes=2).start()
    b_leader_session = LeasedSession(nodes[1].client, ttl=2, name="leader b")
    b = Leader(nodes[1].client, b_leader_session, JOB, "b", every_worker, PROFILE, BATCH,
               debounce_s=0.05, election_recheck_s=0.3, min_nodes=2)
    try:
        cluster.wait_plan(1)
        assert a.election.is_leader
        b.start()
        hold["on"] = True
        nodes[1].verdict(1, "failed", "ecc")
        assert entered.wait(WAIT)  # a is planning v2
        cluster.client.revoke(a_leader_session.lease_id)  # a's term ends under it
        v2 = cluster.wait_plan(2)
        assert v2.devices == ["a:0", "a:1", "b:0"]
        wait_for(lambda: [p.version for p in b.publications] == [2], WAIT, "b's publication of v2")
        gate.set()
        wait_for(lambda: Outcome.DEPOSED in a.outcomes,
                 WAIT, lambda: f"a deposed (outcomes: {a.outcomes})")
        wait_for(lambda: a.state is LeaderState.FOLLOWER, WAIT, "a to follow")
        assert [p.version for p in a.publications] == [1]
        assert read_plan(cluster.client, JOB)[0].reason == v2.reason == "failure b:1: ecc"
        assert cluster.versions() == [1, 2]
    finally:
        gate.set()
        for leader, session in ((a, a_leader_session), (b, b_leader_session)):
            leader.stop(timeout=3.0)
            session.stop(timeout=3.0)


def test_the_leaders_agent_dies_mid_replan_and_another_takes_over(etcd_cluster3):
    cluster = Cluster(etcd_cluster3.endpoints)
    try:
        a = cluster.agent("a").up()
        b = cluster.agent("b").up()
        held = FakeClock(1000.0)  # a's debounce clock: never advanced once v1 is out
        leader_a = a.lead(debounce_s=0.5, clock=held, min_nodes=2)
        wait_for(lambda: leader_a.state is LeaderState.DEBOUNCING, WAIT, "leader a debouncing")
        held.advance(1.0)
        leader_a.poke()
        v1 = cluster.wait_plan(1)
        assert v1.devices == ["a:0", "a:1", "b:0", "b:1"] and v1.store_endpoint.endswith(":29097")
        leader_b = b.lead(debounce_s=0.1, min_nodes=2)
        wait_for(lambda: leader_a.state is LeaderState.WATCHING, WAIT, "leader a watching")

        b.verdict(1, "failed", "ecc")
        # a is mid-replan:
        wait_for(lambda: leader_a.pending is not None, WAIT, "leader a's replan pending")
        used = a.client.current_endpoint
        a.crash()
        next(m for m in etcd_cluster3.members if m.endpoint == used).kill()

        v2 = cluster.wait_plan(2)
        assert v2.devices == ["b:0"]
        assert v2.reason == "leave a; failure b:1: ecc; store 127.0.0.1:29097 -> 127.0.0.1:29098"
        assert v2.store_endpoint.endswith(":29098")  # a's store died with it
        wait_for(lambda: [p.version for p in leader_b.publications] == [2],
                 WAIT, "b's publication of v2")
        assert [p.version for p in leader_a.publications] == [1]
        assert Outcome.PUBLISHED not in leader_a.outcomes[1:]
        assert leader_a.state is LeaderState.FOLLOWER
        assert cluster.versions() == [1, 2]
        wait_for(lambda: [e.type for e in cluster.events()][-3:] ==
                 ["leave", "failure", "replan"], WAIT, "the events leave, failure, replan")
    finally:
        cluster.close()
