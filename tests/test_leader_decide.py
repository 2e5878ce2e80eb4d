"""The leader's pure parts: snapshot, decision, planning adapter, state table."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import device_id, parse_device_id
from hspmd_elastic.plan import Plan
from hspmd_elastic.planner import ModelProfile, PlanInfeasibleError, plan_for
from launcher.leader import (
    TRANSITIONS,
    ChangeKind,
    LeaderState,
    PlanningFailed,
    build_snapshot,
    decide,
    make_layout,
    plan_record,
    select_nodes,
)
from launcher.node.elastic.devices import device_table

PROFILE = ModelProfile("tiny", num_layers=2, hidden_size=32, ffn_size=64, num_heads=4,
                       vocab_size=64, seq_len=16)


def node(name: str, n: int = 2, state: str = "ready", store: bool = True) -> schema.NodeRecord:
    endpoint = f"h-{name}:29{ord(name[-1]) % 100:03d}" if store else ""
    return schema.NodeRecord(host=f"h-{name}", agent_pid=1, devices=device_table(name, n),
                             state=state, started_at=0.0, store_endpoint=endpoint)


def verdict(state: str, reason: str = "", slowdown=None, origin: str = "health"
            ) -> schema.DeviceHealthRecord:
    return schema.DeviceHealthRecord(state=state, reason=reason, xid=None, slowdown=slowdown,
                                     at=0.0, origin=origin)


def published(decision, version=None) -> schema.PlanRecord:
    """The plan a leader would publish for ``decision`` (fallback planner: fast, pure)."""
    layout = make_layout(decision, None, None, PROFILE, 8)
    return plan_record(decision, layout, 0.0)


def test_device_ids_round_trip_and_sort_numerically():
    assert parse_device_id(device_id("node-a.1", 12)) == ("node-a.1", 12)
    with pytest.raises(ValueError, match="not <node_id>:<index>"):
        parse_device_id("node-a")
    nodes = {"a": node("a", 12)}
    d = decide(build_snapshot(nodes, {}), None)
    assert [x.id for x in d.devices][:3] == ["a:0", "a:1", "a:2"]
    assert [x.id for x in d.devices][-1] == "a:11"


def test_snapshot_excludes_failed_and_gone_and_keeps_degraded_speed():
    nodes = {"a": node("a"), "b": node("b"), "c": node("c", state="leaving")}
    verdicts = {("a", 1): verdict("failed", "Xid 79"), ("b", 0): verdict("degraded", "hot", 0.5),
                ("b", 1): verdict("degraded", "throttled", None)}
    snap = build_snapshot(nodes, verdicts, "b")
    usable = snap.usable()
    assert sorted(usable) == ["a:0", "b:0", "b:1"]
    assert usable["b:0"].speed == 0.5 and usable["b:0"].state == "degraded"
    assert usable["b:1"].speed == 0.5  # unknown slowdown: summarize_device_health's default
    assert snap.device("a:1").reason == "Xid 79"
    assert snap.alive_nodes() == ["a", "b"]
    assert snap.store_for("b")[0] == "b"
    assert snap.store_for("c")[0] == "a"  # a leaving node hosts no store; lowest live node id
    assert build_snapshot({"a": node("a", store=False)}, {}).store_for("a") == ("", "")


def test_initial_plan_waits_for_min_nodes():
    assert decide(build_snapshot({}, {}), None) is None
    one = build_snapshot({"a": node("a")}, {}, "a")
    assert decide(one, None, min_nodes=2) is None
    d = decide(build_snapshot({"a": node("a"), "b": node("b")}, {}, "a"), None, min_nodes=2)
    assert d.version == 1 and d.reason == "start"
    assert [c.kind for c in d.changes] == [ChangeKind.JOIN, ChangeKind.JOIN]
    assert d.store_node == "a" and d.inventory == {"a:0": 1.0, "a:1": 1.0, "b:0": 1.0, "b:1": 1.0}


def test_no_change_no_decision_and_each_kind_of_change_is_named():
    nodes = {"a": node("a"), "b": node("b")}
    v1 = published(decide(build_snapshot(nodes, {}, "a"), None))
    assert decide(build_snapshot(nodes, {}, "a"), v1) is None

    gone = decide(build_snapshot({"a": node("a")}, {}, "a"), v1)
    assert gone.version == 2 and gone.reason == "leave b"
    assert [(c.kind, c.devices) for c in gone.changes] == [(ChangeKind.LEAVE, ("b:0", "b:1"))]

    failed = decide(build_snapshot(nodes, {("b", 1): verdict("failed", "Xid 79")}, "a"), v1)
    assert failed.reason == "failure b:1: Xid 79" and not failed.changes[0].journaled

    exits = decide(build_snapshot(nodes, {("b", 1): verdict("failed", "code 3", origin="exit")},
                                  "a"), v1)
    assert exits.changes[0].kind is ChangeKind.FAILURE and exits.changes[0].journaled
    # the origin, not the text, says who journaled it: a health verdict reading like an exit
    # is the leader's to journal
    mimic = decide(build_snapshot(nodes, {("b", 1): verdict("failed", "worker exit: code 3")},
                                  "a"), v1)
    assert mimic.changes[0].kind is ChangeKind.FAILURE and not mimic.changes[0].journaled
    stall = decide(build_snapshot(nodes, {("a", 0): verdict("failed", "hung", origin="stall")},
                                  "a"), v1)
    assert stall.changes[0].kind is ChangeKind.STALL and stall.reason == "stall a:0: hung"
    assert stall.changes[0].journaled

    slow = decide(build_snapshot(nodes, {("b", 0): verdict("degraded", "hot", 0.25)}, "a"), v1)
    assert slow.reason == "degrade b:0: speed 100% -> 25%"
    assert slow.inventory["b:0"] == 0.25
    v2 = published(slow)
    healed = decide(build_snapshot(nodes, {}, "a"), v2)
    assert healed.reason == "recover b:0: speed 25% -> 100%" and healed.version == 3

    joined = decide(build_snapshot({**nodes, "c": node("c", 1)}, {}, "a"), v1)
    assert joined.reason == "join c" and joined.changes[0].devices == ("c:0",)
    regrown = decide(build_snapshot({"a": node("a", 3), "b": node("b")}, {}, "a"), v1)
    assert regrown.changes[0].kind is ChangeKind.RECOVER and regrown.changes[0].devices == ("a:2",)
    shrunk = decide(build_snapshot({"a": node("a", 1), "b": node("b")}, {}, "a"), v1)
    assert shrunk.reason == "failure a:1: device no longer reported"
    left = decide(build_snapshot({"a": node("a"), "b": node("b", state="leaving")}, {}, "a"), v1)
    assert left.reason == "leave b" and left.changes[0].detail == "node leaving"


def test_store_host_change_alone_replans_and_several_changes_are_ordered():
    nodes = {"a": node("a"), "b": node("b")}
    v1 = published(decide(build_snapshot(nodes, {}, "a"), None))
    moved = {"a": node("a", store=False), "b": node("b")}
    d = decide(build_snapshot(moved, {}, "a"), v1)
    assert d.changes == () and d.store_node == "b" and d.reason.startswith("store h-a:")
    many = decide(build_snapshot({"a": node("a", 3), "c": node("c")},
                                 {("a", 0): verdict("failed", "ecc"),
                                  ("a", 1): verdict("degraded", "hot", 0.5)}, "a"), v1)
    assert [c.kind for c in many.changes] == [ChangeKind.JOIN, ChangeKind.LEAVE,
                                              ChangeKind.FAILURE, ChangeKind.DEGRADE,
                                              ChangeKind.RECOVER]
    assert many.reason == ("join c; leave b; failure a:0: ecc; degrade a:1: speed 100% -> 50%; "
                           "recover a:2")


def test_a_plan_without_inventory_is_read_as_its_devices_at_full_speed():
    nodes = {"a": node("a")}
    old = schema.PlanRecord(version=4, reason="x", devices=["a:0", "a:1"], strategy={},
                            store_endpoint=nodes["a"].store_endpoint, created_at=0.0)
    assert decide(build_snapshot(nodes, {}, "a"), old) is None
    d = decide(build_snapshot(nodes, {("a", 1): verdict("failed", "x")}, "a"), old)
    assert d.version == 5 and [x.id for x in d.devices] == ["a:0"]


# ---- the maximum of --nnodes: hot spares -------------------------------------------------------
def test_beyond_max_nodes_the_lowest_ids_are_planned_and_the_rest_are_spares():
    nodes = {"c": node("c"), "a": node("a"), "b": node("b")}
    d = decide(build_snapshot(nodes, {}, "c"), None, min_nodes=1, max_nodes=2)
    assert d.version == 1 and d.reason == "start"
    assert [x.id for x in d.devices] == ["a:0", "a:1", "b:0", "b:1"]
    assert [(c.kind, c.node) for c in d.changes] == [(ChangeKind.JOIN, "a"), (ChangeKind.JOIN, "b")]
    assert select_nodes(build_snapshot(nodes, {}), None, 2) == (("a", "b"), ("c",))
    # the spare may lead: the store stays the leader's own, as without a maximum
    assert d.store_node == "c"


def test_the_current_plan_keeps_its_nodes_and_a_node_joining_a_full_plan_waits():
    v1 = published(decide(build_snapshot({"b": node("b"), "c": node("c")}, {}, "b"), None,
                          max_nodes=2))
    full = {"a": node("a"), "b": node("b"), "c": node("c")}
    snap = build_snapshot(full, {}, "b")
    assert decide(snap, v1, max_nodes=2) is None  # "a" has the lowest id but plans stay put
    assert select_nodes(snap, v1, 2) == (("b", "c"), ("a",))
    assert decide(snap, v1, max_nodes=3).reason == "join a"  # room left: an ordinary join


def test_a_planned_node_lost_is_replaced_by_the_lowest_spare():
    three = {"a": node("a"), "b": node("b"), "c": node("c"), "d": node("d")}
    v1 = published(decide(build_snapshot(three, {}, "a"), None, min_nodes=2, max_nodes=2))
    assert v1.inventory.keys() == {"a:0", "a:1", "b:0", "b:1"}
    for gone in ({"a": node("a"), "c": node("c"), "d": node("d")},  # left / lease expired
                 {**three, "b": node("b", state="leaving")},  # leaving
                 three):  # every device of b failed (verdicts below)
        verdicts = ({("b", 0): verdict("failed", "ecc"), ("b", 1): verdict("failed", "ecc")}
                    if gone is three else {})
        snap = build_snapshot(gone, verdicts, "a")
        d = decide(snap, v1, min_nodes=2, max_nodes=2)
        assert d.version == 2 and [x.id for x in d.devices] == ["a:0", "a:1", "c:0", "c:1"]
        joins = [c for c in d.changes if c.kind is ChangeKind.JOIN]
        assert [(c.node, c.devices) for c in joins] == [("c", ("c:0", "c:1"))]
        assert "d" not in {c.node for c in d.changes}
        assert d == decide(snap, v1, min_nodes=2, max_nodes=2)  # no flip-flop between spares
        v2 = published(d)
        # b coming back does not displace c: it is the spare now
        assert decide(build_snapshot(three, {}, "a"), v2, min_nodes=2, max_nodes=2) is None


def test_min_nodes_and_max_nodes_together():
    one = build_snapshot({"a": node("a")}, {}, "a")
    assert decide(one, None, min_nodes=2, max_nodes=2) is None  # the minimum still gates
    d = decide(one, None, min_nodes=1, max_nodes=2)
    assert [x.node for x in d.devices] == ["a", "a"]
    with pytest.raises(ValueError, match="min_nodes"):
        decide(one, None, min_nodes=3, max_nodes=2)
    # a plan over more nodes than the maximum (made under a larger one) sheds the highest ids
    v1 = published(decide(build_snapshot({"a": node("a"), "b": node("b"), "c": node("c")},
                                         {}, "a"), None))
    d = decide(build_snapshot({"a": node("a"), "b": node("b"), "c": node("c")}, {}, "a"), v1,
               max_nodes=2)
    assert {x.node for x in d.devices} == {"a", "b"}
    assert [(c.kind, c.node) for c in d.changes] == [(ChangeKind.LEAVE, "c")]


def test_max_nodes_none_or_not_exceeded_changes_nothing():
    worlds = [{"a": node("a")}, {"a": node("a"), "b": node("b")},
              {"a": node("a"), "b": node("b", 1), "c": node("c", state="leaving")},
              {"a": node("a"), "b": node("b")}]
    verdicts = [{}, {("b", 1): verdict("failed", "x")}, {("a", 0): verdict("degraded", "h", .5)},
                {("b", 0): verdict("failed", "x"), ("b", 1): verdict("failed", "x")}]
    for nodes in worlds:
        for v in verdicts:
            snap = build_snapshot(nodes, v, "a")
            base = decide(snap, None)
            assert decide(snap, None, max_nodes=None) == base == decide(snap, None, max_nodes=2)
            if base is None:
                continue
            cur = published(base)
            for other in worlds:
                later = build_snapshot(other, {}, "a")
                assert decide(later, cur, max_nodes=None) == decide(later, cur) == decide(
                    later, cur, max_nodes=2)


# ---- exhaustive: every pair of small worlds ---------------------------------------------------
_SLOT_STATES = ("ok", "slow", "dead")
_NODE_WORLDS = [None] + list(itertools.product(_SLOT_STATES, repeat=2))


def _world(spec):
    nodes, verdicts = {}, {}
    for name, slots in zip(("a", "b"), spec):
        if slots is None:
            continue
        nodes[name] = node(name)
        for i, s in enumerate(slots):
            if s == "slow":
                verdicts[(name, i)] = verdict("degraded", "hot", 0.5)
            elif s == "dead":
                verdicts[(name, i)] = verdict("failed", "ecc")
    return build_snapshot(nodes, verdicts, "a")


def _expected_inventory(spec):
    return {device_id(name, i): 0.5 if s == "slow" else 1.0
            for name, slots in zip(("a", "b"), spec) if slots is not None
            for i, s in enumerate(slots) if s != "dead"}


def test_decide_exhaustively_over_pairs_of_worlds():
    worlds = list(itertools.product(_NODE_WORLDS, repeat=2))
    plans = {}
    for spec in worlds:
        d = decide(_world(spec), None)
        inv = _expected_inventory(spec)
        if not inv:
            assert d is None
            continue
        assert d.inventory == inv and [x.id for x in d.devices] == sorted(inv)
        plans[spec] = published(d)
    checked = 0
    for before, plan in plans.items():
        for after in worlds:
            d = decide(_world(after), plan)
            inv = _expected_inventory(after)
            store_moved = after[0] is None and before[0] is not None
            if not inv:
                assert d is None
            elif inv == plan.inventory and not store_moved:
                assert d is None, (before, after)
            else:
                assert d is not None and d.version == 2 and d.inventory == inv, (before, after)
                assert d.reason and (d.changes or store_moved)
                gone = set(plan.inventory) - set(inv)
                named = {dev for c in d.changes for dev in c.devices}
                assert gone <= named
                assert d == decide(_world(after), plan)  # deterministic
            checked += 1
    assert checked == len(plans) * len(worlds)


# ---- planning -----------------------------------------------------------------------------------
def test_layout_without_planner_is_the_fallback_over_compact_ids():
    nodes = {"a": node("a"), "b": node("b")}
    d = decide(build_snapshot(nodes, {("a", 0): verdict("failed", "x")}, "a"), None)
    layout = make_layout(d, None, None, PROFILE, 8)
    assert layout.planner == "fallback-dp" and layout.devices == ("a:1", "b:0", "b:1")
    assert layout.plan.devices == (0, 1, 2)
    rec = plan_record(d, layout, 1.0)
    assert Plan.from_dict(rec.strategy) == layout.plan
    schema.encode(rec)


def test_layout_with_the_planner_gets_slowdowns_and_the_current_plan():
    seen = []

    def planner(inventory, profile, global_batch, current_plan=None, options=None):
        seen.append((inventory, current_plan, options))
        # every device busy, so the layout covers every device this test names
        return plan_for(inventory, profile, global_batch, current_plan,
                        replace(options, use_all_devices=True))

    nodes = {"a": node("a"), "b": node("b")}
    d1 = decide(build_snapshot(nodes, {}, "a"), None)
    l1 = make_layout(d1, None, planner, PROFILE, 8)
    assert l1.planner == "plan_for" and set(l1.devices) == {"a:0", "a:1", "b:0", "b:1"}
    assert not seen[0][2].use_all_devices  # CPU slots too: a slow worker may be left idle
    assert seen[0][2].cross_node_replicas  # two nodes: every slice on both, a node loss reshards
    assert l1.plan.devices == (0, 1, 2, 3)
    v1 = plan_record(d1, l1, 0.0)
    d2 = decide(build_snapshot(nodes, {("a", 0): verdict("failed", "x"),
                                       ("b", 1): verdict("degraded", "hot", 0.5)}, "a"), v1)
    l2 = make_layout(d2, v1, planner, PROFILE, 8)
    inv, current, _ = seen[1]
    by_id = {dev.id: dev for dev in inv.devices}
    assert len(by_id) == 4 and not by_id[0].usable  # a:0 is id 0, failed
    assert by_id[3].slowdown == 2.0  # b:1 at half speed
    assert current is not None and set(current.devices) == {0, 1, 2, 3}
    assert set(l2.devices) == {"a:1", "b:0", "b:1"}
    assert l2.plan.devices == (0, 1, 2)
    assert sum(p.rows for p in l2.plan.pipelines) == 8


def test_one_node_does_not_ask_for_cross_node_replicas():
    seen = []

    def planner(inventory, profile, global_batch, current_plan=None, options=None):
        seen.append(options)
        return plan_for(inventory, profile, global_batch, current_plan, options)

    d = decide(build_snapshot({"a": node("a", 3)}, {}, "a"), None)
    assert make_layout(d, None, planner, PROFILE, 6).planner == "plan_for"
    assert not seen[0].use_all_devices and not seen[0].cross_node_replicas


def test_layout_falls_back_on_planner_errors_but_not_on_infeasibility():
    d = decide(build_snapshot({"a": node("a")}, {}, "a"), None)

    def broken(*args, **kwargs):
        raise RuntimeError("not finished")

    assert make_layout(d, None, broken, PROFILE, 8).planner == "fallback-dp"

    def infeasible(*args, **kwargs):
        raise PlanInfeasibleError("model needs 80 GiB, devices have 16 GiB")

    with pytest.raises(PlanningFailed, match="80 GiB"):
        make_layout(d, None, infeasible, PROFILE, 8)


def test_every_leader_state_can_stop_and_stopped_is_terminal():
    assert set(TRANSITIONS) == set(LeaderState)
    for state, targets in TRANSITIONS.items():
        if state is LeaderState.STOPPED:
            assert not targets
        else:
            assert LeaderState.STOPPED in targets and LeaderState.FOLLOWER in targets or \
                state is LeaderState.FOLLOWER


def test_records_written_before_the_optional_fields_still_decode():
    job = "j"
    old_node = (b'{"schema":2,"kind":"node","host":"h","agent_pid":1,"devices":[],'
                b'"state":"ready","started_at":0.0}')
    rec = schema.decode(schema.node_key(job, "a"), old_node)
    assert rec.store_endpoint == ""
    old_plan = (b'{"schema":2,"kind":"plan","version":1,"reason":"start","devices":["a:0"],'
                b'"strategy":{},"store_endpoint":"h:1","created_at":0.0}')
    plan = schema.decode(schema.plan_current_key(job), old_plan)
    assert plan.inventory == {}
    verdict_without_origin = (b'{"schema":2,"kind":"device_health","state":"failed",'
                              b'"reason":"Xid 79","xid":79,"slowdown":null,"at":0.0}')
    assert schema.decode(schema.device_key(job, "a", 0), verdict_without_origin).origin == "health"
    with pytest.raises(schema.RecordError, match="missing field"):
        schema.decode(schema.node_key(job, "a"), b'{"schema":2,"kind":"node","host":"h"}')
    with pytest.raises(schema.RecordError, match="inventory"):
        schema.decode(schema.plan_current_key(job), old_plan[:-1] + b',"inventory":[1]}')


# ------------------------------------------------------------------------ drain and reachability
def test_a_suspect_device_of_the_plan_with_a_running_worker_is_drained():
    nodes = {"a": node("a"), "b": node("b")}
    current = published(decide(build_snapshot(nodes, {}), None))
    rec = schema.WorkerRecord(pid=1, global_rank=0, local_rank=0, plan_version=1, step=3,
                              last_progress_at=0.0, steps_per_s=1.0)
    running = {("a", 0): rec, ("a", 1): rec, ("b", 0): rec}  # b:1's worker has exited
    verdicts = {("a", 1): verdict("suspect", "row remapping pending"),
                ("b", 1): verdict("suspect", "3 non-fatal Xids")}
    snap = build_snapshot(nodes, verdicts, workers=running)
    assert snap.nodes["a"].devices[1].state == "suspect" and "a:1" not in snap.usable()
    d = decide(snap, current)
    assert [x.id for x in d.devices] == ["a:0", "b:0"]
    assert d.drain == ("a:1",)  # b:1 holds nothing any more: it simply leaves
    assert [(c.kind, c.devices, c.detail) for c in d.changes] == [
        (ChangeKind.DRAIN, ("a:1",), "row remapping pending"),
        (ChangeKind.DRAIN, ("b:1",), "3 non-fatal Xids")]
    after = published(d)
    assert after.drain == ["a:1"] and "a:1" not in after.devices
    # The next decision does not drain it again: it no longer computes in the plan.
    assert decide(build_snapshot(nodes, verdicts, workers=running), after) is None


def test_a_working_device_the_next_plan_leaves_idle_is_drained_so_its_state_moves():
    """A speed replan (here a measured speed) whose plan leaves a usable, running device out
    (the planner found it costs more than it adds): the plan drains it, so state only it holds
    (an uneven optimizer shard) leaves by network before its worker leaves; devices the plan
    keeps and devices whose worker has exited are not drained."""
    nodes = {"a": node("a"), "b": node("b")}
    current = published(decide(build_snapshot(nodes, {}), None))
    rec = schema.WorkerRecord(pid=1, global_rank=0, local_rank=0, plan_version=1, step=3,
                              last_progress_at=0.0, steps_per_s=1.0)
    running = {("a", 0): rec, ("a", 1): rec, ("b", 0): rec}  # b:1's worker has exited
    snap = build_snapshot(nodes, {}, workers=running, measured={"a:1": 0.25})
    d = decide(snap, current)
    assert d is not None and d.drain == () and d.retiring == ("a:0", "a:1", "b:0")
    layout = make_layout(d, current, None, PROFILE, 8)
    idled = replace(layout, devices=tuple(x for x in layout.devices if x != "a:1"))
    assert plan_record(d, idled, 0.0).drain == ["a:1"]  # left out while it works: drained
    assert plan_record(d, layout, 0.0).drain == []  # a plan that keeps every device drains none


def test_a_node_a_majority_cannot_reach_is_cut_off_until_the_reports_end():
    nodes = {n: node(n, 1) for n in "abc"}
    current = published(decide(build_snapshot(nodes, {}), None))
    planned = frozenset("abc")

    def reach(**unreachable):
        return {n: schema.ReachRecord(node=n, unreachable=list(u), at=0.0)
                for n, u in unreachable.items()}

    # c's data link is down: a and b cannot reach it, and it reaches nobody.
    cut = reach(a="c", b="c", c="ab")
    snap = build_snapshot(nodes, {}, reach=cut, planned=planned)
    assert snap.nodes["c"].cut_off == "unreachable over the data network from a, b"
    assert not snap.nodes["a"].cut_off and not snap.nodes["b"].cut_off
    d = decide(snap, current)
    assert [x.id for x in d.devices] == ["a:0", "b:0"]
    assert [(c.kind, c.node) for c in d.changes] == [(ChangeKind.UNREACHABLE, "c")]
    after = published(d)
    # Left out of the plan, c stays cut while the plan's nodes still cannot reach it ...
    assert decide(build_snapshot(nodes, {}, reach=cut, planned=frozenset("ab")), after) is None
    # ... and comes back as a join once they can.
    back = decide(build_snapshot(nodes, {}, reach=reach(c="ab"), planned=frozenset("ab")), after)
    assert [(c.kind, c.node) for c in back.changes] == [(ChangeKind.JOIN, "c")]
    # One report is no majority; two nodes that lose each other cannot tell who is cut.
    assert not any(v.cut_off for v in build_snapshot(nodes, {}, reach=reach(a="c"),
                                                     planned=planned).nodes.values())
    two = {n: node(n, 1) for n in "ab"}
    snap2 = build_snapshot(two, {}, reach=reach(a="b", b="a"), planned=frozenset("ab"))
    assert not any(v.cut_off for v in snap2.nodes.values())
    # A cut node hosts no store.
    assert snap.store_for("c")[0] == "a"


def test_a_retry_request_for_the_current_plan_publishes_it_again_only_when_nothing_changed():
    nodes = {"a": node("a"), "b": node("b")}
    v1 = published(decide(build_snapshot(nodes, {}, "a"), None))

    def retry(**versions):
        return {n: schema.RetryRecord(node=n, plan_version=v, slots=[0], waited_s=5.0, at=0.0)
                for n, v in versions.items()}

    again = decide(build_snapshot(nodes, {}, "a", retry=retry(b=1)), v1)
    assert again.version == 2 and [x.id for x in again.devices] == list(v1.devices)
    assert [(c.kind, c.node, c.devices) for c in again.changes] == [
        (ChangeKind.RETRY, "b", ("b:0", "b:1"))]
    assert again.reason == "retry b:0,b:1: the switch into v1 failed with no change to explain it"
    assert published(again).strategy == v1.strategy
    # A request about an older plan, or from a node that is gone or not planned, is no retry.
    assert decide(build_snapshot(nodes, {}, "a", retry=retry(b=0)), v1) is None
    assert decide(build_snapshot({**nodes, "c": node("c", state="leaving")}, {}, "a",
                                 retry=retry(c=1)), v1) is None
    # Any real change wins: it publishes a new plan anyway, which the workers switch into.
    failed = decide(build_snapshot(nodes, {("b", 1): verdict("failed", "Xid 79")}, "a",
                                   retry=retry(a=1, b=1)), v1)
    assert [c.kind for c in failed.changes] == [ChangeKind.FAILURE]
