"""Leader election against a real etcd: one leader at a time, hand-over, fencing."""

from __future__ import annotations

import dataclasses

import pytest

from hspmd_elastic.coord import (
    Election,
    EtcdClient,
    FencedWriteRejected,
    LeasedSession,
)
from hspmd_elastic.contract import schema
from _wait import Recorder, wait_for

JOB = "ejob"
WAIT = 6.0


class Candidates:
    """Creates candidates with their own session and client; cleans them up."""

    def __init__(self, endpoints):
        self.endpoints = endpoints
        self.made: dict[str, tuple[EtcdClient, LeasedSession, Election, Recorder]] = {}

    def add(self, node: str) -> Election:
        client = EtcdClient(self.endpoints, timeout=1.0)
        session = LeasedSession(client, ttl=2, name=f"agent {node}")
        changes = Recorder()
        election = Election(client, session, JOB, node, on_change=changes, recheck_s=0.5)
        self.made[node] = (client, session, election, changes)
        return election

    def session(self, node: str) -> LeasedSession:
        return self.made[node][1]

    def changes(self, node: str) -> list:
        return self.made[node][3].items

    def leaders(self) -> list[str]:
        return sorted(n for n, (_, _, e, _) in self.made.items() if e.is_leader)

    def close(self) -> None:
        for client, session, election, _ in self.made.values():
            election.resign(timeout=2.0)
            session.stop(timeout=2.0)
            client.close()


@pytest.fixture
def candidates(etcd_server):
    c = Candidates(etcd_server.endpoints)
    yield c
    c.close()


def test_two_then_three_candidates_hand_over_and_fence(client, candidates):
    a = candidates.add("a")
    assert a.campaign(WAIT)
    b = candidates.add("b")
    assert not b.campaign(0.3)
    assert candidates.leaders() == ["a"]
    assert a.leader() == b.leader() == "a"

    rec = schema.decode(schema.leader_key(JOB), client.get(schema.leader_key(JOB)).value)
    assert rec.node == "a" and rec.term == a.term and rec.candidate_key == a.candidate_key
    assert client.get(a.candidate_key).lease == candidates.session("a").lease_id

    c = candidates.add("c")
    assert not c.campaign(0.3)
    assert candidates.leaders() == ["a"]

    # Revoking the leader's lease deletes its key: the next in line (b, not c) takes over.
    a_key, a_term = a.candidate_key, a.term
    client.revoke(candidates.session("a").lease_id)
    assert b.campaign(WAIT)
    wait_for(lambda: not a.is_leader, WAIT, "a to see it is deposed")
    assert candidates.leaders() == ["b"]
    assert candidates.changes("a")[:2] == [True, False]
    wait_for(lambda: b.leader() == "b", WAIT, "b to see itself leader")
    rec = schema.decode(schema.leader_key(JOB), client.get(schema.leader_key(JOB)).value)
    assert rec.node == "b" and rec.term == b.term > a_term

    # The deposed leader cannot write shared state, whether it knows it was deposed or not.
    plan_key = schema.plan_current_key(JOB)
    with pytest.raises(FencedWriteRejected):
        client.fenced_put(a_key, a_term, plan_key, b"{}")  # a's stale fence
    with pytest.raises(FencedWriteRejected):
        a.fenced_put(plan_key, b"{}")
    b.fenced_put(plan_key, b"{}")
    assert client.get(plan_key).value == b"{}"

    # b resigns: c (earlier in line than a's re-joined candidacy) leads.
    b.resign()
    assert c.campaign(WAIT)
    assert candidates.leaders() == ["c"]
    wait_for(lambda: a.leader() == "c", WAIT, "a to see c leading")


def test_exactly_one_leader_among_three_through_resignations(candidates):
    elections = [candidates.add(n) for n in ("n1", "n2", "n3")]
    assert elections[0].campaign(WAIT)
    for e in elections[1:]:
        assert not e.campaign(0.2)
    for i in range(2):
        assert candidates.leaders() == [f"n{i + 1}"]
        elections[i].resign()
        assert elections[i + 1].campaign(WAIT)
    assert candidates.leaders() == ["n3"]
    wait_for(lambda: elections[0].leader() == "n3", WAIT, "n1 to see n3 leading")


def test_publish_plan_is_fenced_and_compare_and_set(client, candidates):
    from hspmd_elastic.coord import ConflictError, publish_plan, read_plan

    def plan(version):
        return schema.PlanRecord(version=version, reason="test", devices=["a:0"], strategy={},
                                 store_endpoint="a:1", created_at=0.0)

    a = candidates.add("a")
    assert a.campaign(WAIT)
    assert read_plan(client, JOB) == (None, 0)
    publish_plan(a, plan(1), read_revision=0)
    current, rev = read_plan(client, JOB)
    assert current == dataclasses.replace(plan(1), leader="a", term=a.term)  # stamped
    assert a.term > 0
    with pytest.raises(ConflictError):
        publish_plan(a, plan(2), read_revision=0, current_version=1)  # decided from a stale read
    with pytest.raises(ValueError, match="version"):
        publish_plan(a, plan(3), read_revision=rev, current_version=1)
    publish_plan(a, plan(2), read_revision=rev, current_version=1)
    history = client.get_prefix(schema.plan_history_prefix(JOB))
    assert [schema.decode(kv.key, kv.value).version for kv in history] == [1, 2]
    a.resign()
    with pytest.raises(FencedWriteRejected):
        publish_plan(a, plan(3), read_revision=read_plan(client, JOB)[1], current_version=2)
