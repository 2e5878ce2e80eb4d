"""The leader's measured speeds (``launcher.leader.stragglers.StragglerWatch``), driven with
worker records and a clock of the test's: what it samples, when it replans, what it journals,
and how it calibrates the cost model. The whole loop on real throttled workers is
``tests/test_straggler_replans.py``."""

from __future__ import annotations

import pytest

from _elastic_job import TINY
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import plan_for, profile_from_config
from hspmd_elastic.planner.calibrate import predicted_busy_s
from launcher.leader.planning import default_planner_options
from launcher.leader.snapshot import DeviceView
from launcher.leader.speeds import StragglerPolicy
from launcher.leader.stragglers import StragglerWatch

pytestmark = pytest.mark.timeout(60)
MID = ModelConfig(vocab_size=64, hidden_size=64, num_heads=4, num_layers=2, ffn_size=256,
                  seq_len=32, dtype="float64")
DEVS = ["n:0", "n:1"]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def plan_record(version: int, rows: tuple[int, int], speeds=(1.0, 1.0)) -> schema.PlanRecord:
    plan = Plan(tuple(Pipeline((Stage((i,), (0, MID.num_layers)),), 1, r)
                      for i, r in enumerate(rows)), sum(rows), MID.num_layers)
    return schema.PlanRecord(version=version, reason="t", devices=list(DEVS),
                             strategy=plan.to_dict(), store_endpoint="h:1", created_at=0.0,
                             inventory=dict(zip(DEVS, speeds)))


USABLE = {d: DeviceView(d, "n", i, "CPU", 64 << 20) for i, d in enumerate(DEVS)}


def records(version: int, step: int, busy: tuple[float, float]) -> dict:
    return {("n", i): schema.WorkerRecord(pid=100 + i, global_rank=i, local_rank=i,
                                          plan_version=version, step=step,
                                          last_progress_at=0.0, steps_per_s=1.0, busy_s=b)
            for i, b in enumerate(busy)}


def run(watch: StragglerWatch, clock: Clock, current, busy, steps: range,
        planned: dict = None) -> dict:
    """Observe ``steps``; the speeds to plan for that ``observe`` returned last (it returns
    them as a value each time: the leader passes that into its snapshot)."""
    planned = {} if planned is None else planned
    for step in steps:
        clock.t += 1.0
        planned = watch.observe(lambda: records(current.version, step, busy), current, USABLE)
    return planned


def test_a_device_four_times_slower_is_planned_for_and_journaled_once():
    clock, journal = Clock(), []
    watch = StragglerWatch(profile_from_config(MID), 16, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=5.0), clock, journal.append)
    v1 = plan_record(1, (8, 8))
    assert run(watch, clock, v1, (0.1, 0.4), range(1, 12)) == {"n:1": 0.25}
    [event] = [d for d in journal if d.replan]
    assert event.measured == {"n:0": 1.0, "n:1": 0.25} and event.assumed == {"n:0": 1.0,
                                                                               "n:1": 1.0}
    assert event.step_new_s < event.step_now_s and event.gain_s > 1.5 * event.cost_s
    assert "n:1 1->0.25" in event.reason
    # nothing new under the same plan: no further decision, no further event
    before = len(journal)
    assert run(watch, clock, v1, (0.1, 0.4), range(12, 30)) == {"n:1": 0.25}  # unchanged
    assert len(journal) == before


def test_the_same_speeds_and_noise_within_a_quantum_change_nothing():
    clock, journal = Clock(), []
    watch = StragglerWatch(profile_from_config(MID), 16, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=0.0), clock, journal.append)
    v1 = plan_record(1, (8, 8))
    assert run(watch, clock, v1, (0.1, 0.105), range(1, 20)) == {} and journal == []


def test_a_gain_too_small_for_the_switch_is_journaled_but_not_acted_on():
    clock, journal = Clock(), []
    watch = StragglerWatch(profile_from_config(TINY), 4, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=0.0), clock, journal.append)
    watch.switch_cost_s = 1e6  # a switch that costs more than any gain
    v1 = schema.PlanRecord(version=1, reason="t", devices=list(DEVS), strategy=Plan(
        tuple(Pipeline((Stage((i,), (0, 2)),), 1, 2) for i in range(2)), 4, 2).to_dict(),
        store_endpoint="h:1", created_at=0.0, inventory={d: 1.0 for d in DEVS})
    assert run(watch, clock, v1, (0.01, 0.04), range(1, 12)) == {}
    assert journal and not journal[0].replan
    assert "keep the plan" in journal[0].reason


def test_recovery_after_the_dwell_gives_the_work_back_and_the_cost_model_is_calibrated():
    clock, journal = Clock(), []
    watch = StragglerWatch(profile_from_config(MID), 16, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=5.0), clock, journal.append)
    assert run(watch, clock, plan_record(1, (8, 8)), (0.1, 0.4), range(1, 12))
    v2 = plan_record(2, (13, 3), (1.0, 0.25))
    # the slow device recovered: each device's busy time is what the cost model predicts for
    # its share at full speed
    profile = profile_from_config(MID)
    inventory = watch._inventory(v2, USABLE, {})
    busy = tuple(predicted_busy_s(plan_of(v2), profile, inventory, r) for r in range(2))
    # back at full speed: nothing left to plan around
    assert run(watch, clock, v2, busy, range(12, 40)) == {}
    assert watch.calibration is None  # fitted when the next plan's predictions are made
    clock.t += 1.0
    watch.observe(lambda: records(3, 41, (0.1, 0.1)), plan_record(3, (8, 8)), USABLE)
    assert watch.calibration is not None and watch.calibration.samples >= 2


def test_a_bucketed_plan_is_predicted_bucket_by_bucket_and_adds_no_calibration():
    from hspmd_elastic.planner.buckets import profile_at

    profile = profile_from_config(MID)
    watch = StragglerWatch(profile, 16, plan_for, default_planner_options,
                           StragglerPolicy(dwell_s=5.0), Clock(), [].append)
    short = Plan(tuple(Pipeline((Stage((i,), (0, 2)),), 1, 6) for i in range(2)), 12, 2)
    long_ = Plan((Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, 2))), 4, 1),), 4, 2)
    record = plan_record(1, (8, 8))
    record.buckets = [{"window": 8, "start": 0, "strategy": short.to_dict()},
                      {"window": MID.seq_len, "start": 12, "strategy": long_.to_dict()}]
    got = watch._predictions(record, USABLE)
    inventory = watch._inventory(record, USABLE, {})
    for rank, dev in enumerate(DEVS):
        want = (predicted_busy_s(short, profile_at(profile, 8), inventory, rank)
                + predicted_busy_s(long_, profile, inventory, rank))
        assert got[dev] == pytest.approx(want, rel=1e-12)
        assert got[dev] != pytest.approx(predicted_busy_s(plan_of(record), profile, inventory,
                                                          rank), rel=1e-3)
    watch._busy[(1, "n:0")] = 0.1
    watch._note_nominal(record, USABLE, {"n:0": 1.0})
    assert not watch._measurements
