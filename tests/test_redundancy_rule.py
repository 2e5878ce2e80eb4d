"""The redundancy rule of speed-driven replans (``hspmd_elastic.planner.copies``), without
processes: a plan's copies of the parameters, the search keeping them when asked (a slow
device keeps its replica with fewer rows instead of the job losing it to a pipeline), the
verdict on a trade, and the leader's two uses of it (``planning.make_layout`` for a decision
that answers speeds alone, ``StragglerWatch`` for the ``speeds`` event). The rule under a real
throttle and a real kill is ``tests/test_redundancy_replans.py``."""

from __future__ import annotations

import pytest

from hspmd_elastic.contract import schema
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import (Device, Inventory, PlannerError, PlannerOptions,
                                   estimate_plan, plan_for, profile_from_config,
                                   spec_for_device)
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.copies import KEPT, TRADED, Copies, copies_of, keep, weigh
from hspmd_elastic.planner.solve import split_rows
from launcher.leader.decide import Change, ChangeKind, PlanDecision
from launcher.leader.planning import default_planner_options, make_layout, speed_only
from launcher.leader.snapshot import DeviceView
from launcher.leader.speeds import StragglerPolicy
from launcher.leader.stragglers import StragglerWatch

pytestmark = pytest.mark.timeout(60)

# The model of the report: a speed replan made v2 a pipeline over two CPU workers.
ISSUE = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_layers=4, ffn_size=256,
                    seq_len=64)
PROFILE = profile_from_config(ISSUE)
CPU = spec_for_device("CPU", None)
BATCH = 8
DEVS = ["node-a:0", "node-a:1"]


def inventory(slowdown: float = 1.0, nodes=("n", "n")) -> Inventory:
    return Inventory((Device(0, nodes[0], CPU), Device(1, nodes[1], CPU, slowdown=slowdown)))


def dp(rows=(4, 4)) -> Plan:
    return Plan(tuple(Pipeline((Stage((i,), (0, 4)),), 1, r) for i, r in enumerate(rows)),
                sum(rows), 4)


PIPE = Plan((Pipeline((Stage((0,), (0, 3)), Stage((1,), (3, 4))), 1, BATCH),), BATCH, 4)
EVERY = PlannerOptions(use_all_devices=True)  # what the leader asks for on CPU workers


# ------------------------------------------------------------------------------- copies
def test_copies_count_devices_and_nodes_holding_every_slice():
    assert copies_of(dp(), inventory()) == Copies(2, 1)
    assert copies_of(PIPE, inventory()) == Copies(1, 1)
    assert copies_of(dp(), inventory(nodes=("a", "b"))) == Copies(2, 2)
    tp2 = Plan((Pipeline((Stage((0, 1), (0, 4)),), 1, BATCH),), BATCH, 4)
    assert copies_of(tp2, inventory()) == Copies(1, 1)  # each shard on one device
    for plan in (dp(), PIPE, tp2):
        est = estimate_plan(plan, inventory(), PROFILE)
        assert Copies.of(est) == copies_of(plan, inventory())


def test_the_device_count_is_every_slice_s_holders_counted_one_by_one():
    """``replica_devices`` (the number of pipelines) against the general count of
    ``cost.replica_nodes`` with every device its own failure domain, on mixed TP plans."""
    class Own:
        def __init__(self, d):
            self.node = f"d{d}"

    specs = [Inventory(tuple(Device(i, "n", CPU) for i in range(6)))]
    plan = Plan((Pipeline((Stage((0, 1), (0, 2)), Stage((2,), (2, 4))), 1, 4),
                 Pipeline((Stage((3,), (0, 1)), Stage((4, 5), (1, 4))), 1, 4)), BATCH, 4)
    assert cost.replica_nodes(plan, {d: Own(d) for d in range(6)}) == 2
    assert estimate_plan(plan, specs[0], PROFILE).replica_devices == 2


def test_keep_never_lowers_what_options_already_ask_and_bad_values_are_refused():
    opts = keep(PlannerOptions(keep_copies=3), Copies(2, 1))
    assert (opts.keep_copies, opts.keep_copy_nodes) == (3, 1)
    with pytest.raises(PlannerError, match="keep_copies=-1 must be an integer >= 0"):
        PlannerOptions(keep_copies=-1)


# ------------------------------------------------------------------------------- the search
def test_the_fastest_plan_for_a_straggler_drops_the_replica_and_the_rule_keeps_it():
    """The report's v2: at a tenth of the speed, the fastest plan using both workers is the
    pipeline [0 L0-3 > 1 L3-4]; kept copies give a heterogeneous DP plan instead, the slow
    device with one row of eight (its replica kept), faster than the old even split."""
    slow = inventory(10.0)
    unkept = plan_for(slow, PROFILE, BATCH, current_plan=dp(), options=EVERY)
    assert Copies.of(unkept.estimate) == Copies(1, 1)  # what the job got: no redundancy

    kept = plan_for(slow, PROFILE, BATCH, current_plan=dp(),
                    options=keep(EVERY, copies_of(dp(), slow)))
    assert Copies.of(kept.estimate) == Copies(2, 1)
    rows = {p.stages[0].devices[0]: p.rows for p in kept.plan.pipelines}
    assert rows[1] < rows[0] and rows[1] >= 1 and sum(rows.values()) == BATCH
    assert kept.estimate.step_time_s < estimate_plan(dp(), slow, PROFILE).step_time_s


def test_without_a_current_plan_the_fast_pass_alone_keeps_every_pipeline_a_row():
    kept = plan_for(inventory(10.0), PROFILE, BATCH, options=keep(EVERY, Copies(2, 1)))
    assert [p.rows for p in kept.plan.pipelines] in ([7, 1], [1, 7]), kept.plan


def test_copies_no_plan_can_keep_are_traded_for_the_fewest_lost():
    """Three copies owed (``--hspmd-redundancy 3``'s floor) on two devices: none keeps them."""
    asked = PlannerOptions(use_all_devices=True, keep_copies=3)
    result = plan_for(inventory(10.0), PROFILE, BATCH, options=keep(asked, Copies(3, 1)))
    after = Copies.of(result.estimate)
    assert after == Copies(2, 1)  # the most two devices hold
    verdict = weigh(Copies(3, 1), after, redundancy=3)
    assert verdict.outcome == TRADED and "no plan for these speeds keeps 3 device(s)" in \
        verdict.why


def test_copies_beyond_two_are_spent_on_speed_and_the_second_never_is():
    """Owed: what the plan has, up to two (one loss survived) or the redundancy asked."""
    assert Copies(4, 2).owed() == Copies(2, 2) and Copies(4, 1).owed(3) == Copies(3, 1)
    assert Copies(1, 1).owed() == Copies(1, 1)
    assert keep(PlannerOptions(), Copies(4, 1)).keep_copies == 2
    spent = weigh(Copies(4, 1), Copies(2, 1))
    assert spent.outcome == KEPT and "the copies beyond 2/1 spent on speed" in spent.why
    assert weigh(Copies(2, 1), Copies(1, 1)).outcome == TRADED
    assert weigh(Copies(4, 1), Copies(2, 1), redundancy=3).outcome == TRADED


def test_a_kept_verdict_names_the_faster_plan_it_did_not_take():
    verdict = weigh(Copies(2, 1), Copies(2, 1), (Copies(1, 1), 0.1, 0.16))
    assert verdict.outcome == KEPT
    assert "a plan of 0.1 s per step (against 0.16 s)" in verdict.why and "not taken" in \
        verdict.why
    assert "not taken" not in weigh(Copies(2, 1), Copies(2, 1)).why


@pytest.mark.parametrize("classes, total, least", [
    ([(0.1, 0.01, 1), (1.0, 0.1, 1)], 8, 1),
    ([(0.0, 1.0, 3), (5.0, 10.0, 2)], 20, 1),
    ([(0.0, 1.0, 1), (100.0, 10.0, 4)], 7, 1),
    ([(0.0, 1.0, 1), (100.0, 10.0, 4)], 7, 2),  # 10 > 7 rows: the floor is dropped
])
def test_split_rows_gives_every_pipeline_its_least_rows_when_the_batch_allows(classes, total,
                                                                               least):
    rows = split_rows(classes, total, least)
    flat = [r for cls in rows for r in cls]
    assert sum(flat) == total
    pipes = sum(cnt for _, _, cnt in classes)
    if least * pipes <= total:
        assert min(flat) >= least
    unfloored = split_rows(classes, total)
    assert sum(map(sum, unfloored)) == total
    if least * pipes > total:
        assert rows == unfloored


# ------------------------------------------------------------------------------- the leader
VIEWS = {d: DeviceView(d, "node-a", i, "CPU", 0) for i, d in enumerate(DEVS)}


def record(plan: Plan, speeds=(1.0, 1.0)) -> schema.PlanRecord:
    return schema.PlanRecord(version=1, reason="start", devices=list(DEVS),
                             strategy=plan.to_dict(), store_endpoint="h:1", created_at=0.0,
                             inventory=dict(zip(DEVS, speeds)))


def decision(kind: ChangeKind, devices, speed: float = 0.125) -> PlanDecision:
    views = tuple(DeviceView(d, "node-a", i, "CPU", 0, state="degraded" if i else "healthy",
                             speed=speed if i else 1.0)
                  for i, d in enumerate(DEVS) if d in devices)
    return PlanDecision(2, "t", (Change(kind, "node-a", ("node-a:1",)),), views,
                        "node-a", "h:1")


def test_a_decision_is_speed_only_when_no_device_came_or_went():
    current = record(dp())
    assert speed_only(decision(ChangeKind.DEGRADE, DEVS), current)
    assert speed_only(decision(ChangeKind.RECOVER, DEVS), current)
    assert not speed_only(decision(ChangeKind.FAILURE, DEVS), current)
    assert not speed_only(decision(ChangeKind.DEGRADE, DEVS[:1]), current)
    assert not speed_only(decision(ChangeKind.DEGRADE, DEVS), None)


def test_a_degrade_replan_keeps_both_replicas_and_a_lost_device_does_not_bind_it():
    layout = make_layout(decision(ChangeKind.DEGRADE, DEVS, 0.1), record(dp()), plan_for,
                         PROFILE, BATCH, default_planner_options(list(VIEWS.values())))
    assert len(layout.plan.pipelines) == 2, layout.plan  # DP2 with uneven rows
    assert sorted(p.rows for p in layout.plan.pipelines) == [1, 7]
    # the old rule's plan for the same speeds, had the straggler been a join: one copy
    fresh = make_layout(decision(ChangeKind.DEGRADE, DEVS, 0.1), None, plan_for, PROFILE,
                        BATCH, default_planner_options(list(VIEWS.values())))
    assert len(fresh.plan.pipelines) == 1, fresh.plan


def records(version: int, step: int, busy) -> dict:
    return {("node-a", i): schema.WorkerRecord(pid=100 + i, global_rank=i, local_rank=i,
                                               plan_version=version, step=step,
                                               last_progress_at=0.0, steps_per_s=1.0,
                                               busy_s=b)
            for i, b in enumerate(busy)}


def test_the_speeds_event_records_the_copies_kept():
    clock = [0.0]
    journal: list = []
    watch = StragglerWatch(PROFILE, BATCH, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=0.0), lambda: clock[0], journal.append)
    current = record(dp())
    for step in range(1, 14):
        clock[0] += 1.0
        watch.observe(lambda: records(1, step, (0.1, 1.0)), current, VIEWS)
    [event] = [d for d in journal if d.replan]
    assert (event.copies_before, event.copies_after) == (2, 2)
    assert (event.copy_nodes_before, event.copy_nodes_after) == (1, 1)
    assert event.redundancy == KEPT and "as before (2/1)" in event.redundancy_reason
    assert "redundancy kept" in event.reason and event.step_new_s < event.step_now_s
    # the event reads back through the contract with its new fields
    again = schema.SpeedsDetail(**event.to_dict())
    assert again == event


# ------------------------------------------------------------------------------- status
def test_status_shows_what_the_newest_speed_decision_did_to_the_copies():
    from types import SimpleNamespace

    from _events import event
    from launcher.ops.events import event_summary
    from launcher.ops.status import redundancy_line

    base = dict(plan_version=3, measured={"a:0": 1.0, "a:1": 0.125},
                assumed={"a:0": 1.0, "a:1": 1.0}, step_now_s=0.5, step_new_s=0.2,
                gain_s=90.0, cost_s=2.0, replan=True, reason="r")
    old = event(1, "speeds", schema.SpeedsDetail(**base))  # journaled before the rule
    kept = event(2, "speeds", schema.SpeedsDetail(
        **base, copies_before=2, copies_after=2, copy_nodes_before=1, copy_nodes_after=1,
        redundancy=KEPT, redundancy_reason="as before [b]"))
    assert "copies" not in event_summary(old)
    assert "copies 2 -> 2 device(s), 1 -> 1 node(s) kept: replan" in event_summary(kept)
    assert redundancy_line(SimpleNamespace(events=[old])) is None
    line = redundancy_line(SimpleNamespace(events=[old, kept]))
    assert line == ("redundancy kept (plan v3): copies 2 -> 2 device(s), 1 -> 1 node(s); "
                    "as before [b]")
