"""Idle devices in the leader's speed path, driven with worker records and a clock of the
test's (``launcher.leader.stragglers``): a device the plan leaves idle is measured by its
worker's probes (``WorkerRecord.probe_s`` / ``probes``, ``hspmd_elastic.elastic.busy.probe``),
comes back by the straggler rule when it got fast, and the ``speeds`` decision names the idle
devices with their numbers (``SpeedsDetail.idle``). Also the straight speed path's pieces:
``observe`` returns the speeds to plan for as a value, ``snapshot.with_measured`` is the one
fold of a measured speed, the probe's schedule is bounded, and the agent's idle slots."""

from __future__ import annotations

import math
import time

import pytest

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.elastic.busy import ProbeSchedule, probe, probe_rows
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import plan_for, profile_from_config
from hspmd_elastic.planner.calibrate import predicted_busy_s
from launcher.leader.planning import default_planner_options
from launcher.leader.snapshot import MEASURED, DeviceView, build_snapshot, with_measured
from launcher.leader.speeds import StragglerPolicy
from launcher.leader.stragglers import StragglerWatch, idle_devices, probe_predicted_s
from launcher.node.elastic.workers import idle_local_ranks

pytestmark = pytest.mark.timeout(60)
MID = ModelConfig(vocab_size=64, hidden_size=64, num_heads=4, num_layers=2, ffn_size=256,
                  seq_len=32, dtype="float64")
DEVS = ["n:0", "n:1", "n:2"]
USABLE = {d: DeviceView(d, "n", i, "CPU", 64 << 20) for i, d in enumerate(DEVS)}
IDLE = "n:2"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def idle_plan(version: int = 1, idle_speed: float = 0.25) -> schema.PlanRecord:
    """A plan over n:0 and n:1 (8 rows each, micro-batches of 4) made over n:2 too, at
    ``idle_speed``, which it leaves idle."""
    plan = Plan(tuple(Pipeline((Stage((i,), (0, MID.num_layers)),), 4, 2) for i in range(2)),
                16, MID.num_layers)
    return schema.PlanRecord(version=version, reason="t", devices=DEVS[:2],
                             strategy=plan.to_dict(), store_endpoint="h:1", created_at=0.0,
                             inventory={"n:0": 1.0, "n:1": 1.0, IDLE: idle_speed})


def watch_of(clock: Clock, journal: list) -> StragglerWatch:
    return StragglerWatch(profile_from_config(MID), 16, plan_for, default_planner_options,
                          StragglerPolicy(dwell_s=0.0), clock, journal.append)


def drive(watch: StragglerWatch, clock: Clock, current, probe_slowdown: float, steps: range,
          version=None) -> dict:
    """The plan's workers at the cost model's predicted busy time (full speed), the idle
    worker's probes ``probe_slowdown`` times the predicted probe; the last value returned."""
    profile = profile_from_config(MID)
    inventory = watch._inventory(current, USABLE, {})
    busy = [predicted_busy_s(plan_of(current), profile, inventory, r) for r in range(2)]
    rows = probe_rows(plan_of(current))
    probe_s = probe_predicted_s(profile, inventory.devices[2].spec, rows) * probe_slowdown
    out: dict = {}
    for step in steps:
        clock.t += 1.0
        recs = {("n", i): schema.WorkerRecord(pid=1 + i, global_rank=i, local_rank=i,
                                              plan_version=current.version, step=step,
                                              last_progress_at=0.0, steps_per_s=1.0,
                                              busy_s=busy[i]) for i in range(2)}
        recs[("n", 2)] = schema.WorkerRecord(
            pid=3, global_rank=-1, local_rank=2, step=0, last_progress_at=0.0,
            plan_version=current.version if version is None else version, steps_per_s=0.0,
            probe_s=probe_s, probes=step)
        out = watch.observe(lambda: recs, current, USABLE)
    return out


def test_an_idle_device_measured_fast_by_its_probes_comes_back_by_the_rule():
    clock, journal = Clock(), []
    watch = watch_of(clock, journal)
    v1 = idle_plan()
    assert idle_devices(v1, USABLE) == [IDLE]
    assert drive(watch, clock, v1, 1.0, range(1, 16)) == {}  # a value: nothing below 1
    [event] = journal
    assert event.replan and event.measured == {"n:0": 1.0, "n:1": 1.0, IDLE: 1.0}
    assert event.assumed[IDLE] == 0.25 and event.step_new_s < event.step_now_s
    assert f"{IDLE} 0.25->1" in event.reason
    assert event.idle == {}  # the plan it leads to uses every device


def test_an_idle_device_still_slow_changes_nothing_and_a_stale_probe_is_no_sample():
    clock, journal = Clock(), []
    watch = watch_of(clock, journal)
    assert drive(watch, clock, idle_plan(), 4.0, range(1, 16)) == {} and journal == []
    clock2, journal2 = Clock(), []
    watch2 = watch_of(clock2, journal2)
    # fast probes, but reported under another plan version: no sample, no decision
    assert drive(watch2, clock2, idle_plan(2), 1.0, range(1, 16), version=1) == {}
    assert journal2 == []


def test_a_decision_not_to_replan_names_the_idle_device_with_its_step_times():
    clock, journal = Clock(), []
    watch = watch_of(clock, journal)
    watch.switch_cost_s = 1e6  # no gain pays for it: keep the plan
    drive(watch, clock, idle_plan(), 1.0, range(1, 16))
    [event] = journal
    assert not event.replan
    idle = event.idle[IDLE]
    assert idle.speed == 1.0 and idle.step_without_s == pytest.approx(event.step_now_s)
    assert 0 < idle.step_with_s < idle.step_without_s  # using it would be faster
    assert f"{idle.step_with_s:.3g} s with it" in idle.reason
    # the detail round-trips through the journal's schema
    record = schema.new_event_record(1, schema.EventType.SPEEDS.value, "n", event, {}, 0.0)
    back = schema.event_detail(schema.decode(schema.event_key("j", 1), schema.encode(record)))
    assert back.idle[IDLE] == idle


def test_with_measured_is_the_one_fold_of_a_measured_speed():
    healthy = USABLE["n:0"]
    slow = with_measured(healthy, 0.5)
    assert (slow.state, slow.speed, slow.origin) == ("degraded", 0.5, MEASURED)
    assert with_measured(healthy, 1.0) is healthy  # not slower: unchanged
    failed = DeviceView("n:1", "n", 1, "CPU", 0, "failed", 0.0)
    assert with_measured(failed, 0.5) is failed
    node = schema.NodeRecord(host="h", agent_pid=1, state="running", started_at=0.0,
                             devices=[schema.DeviceInfo(index=0, type="CPU",
                                                        memory_bytes=64 << 20, uuid="")])
    snap = build_snapshot({"n": node}, {}, measured={"n:0": 0.5})
    assert snap.device("n:0") == with_measured(build_snapshot({"n": node}, {}).device("n:0"),
                                               0.5)


def test_the_probe_is_bounded_and_touches_no_process_group():
    import torch
    import torch.distributed as dist

    took = probe(MID, 4, torch.device("cpu"))
    assert math.isfinite(took) and took > 0 and not dist.is_initialized()
    # repeated for min_s at least, at most ``most`` times: the time of one repetition
    started = time.perf_counter()
    one = probe(MID, 4, torch.device("cpu"), min_s=60.0, most=3)
    assert 0 < one < (time.perf_counter() - started) / 2  # three ran, not the 60 s
    schedule = ProbeSchedule(every_s=2.0, duty=0.1)
    assert schedule.due(0.0)
    schedule.done(10.0, 0.05)  # a short probe: the period bounds it
    assert not schedule.due(11.9) and schedule.due(12.0)
    schedule.done(20.0, 1.0)  # a long probe: at most 10% of the time
    assert schedule.wait_s(20.0) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="duty=0"):
        ProbeSchedule(duty=0)


def test_the_agent_runs_idle_workers_only_on_nodes_the_plan_uses():
    plan = idle_plan()
    assert idle_local_ranks(plan, "n", [0, 1, 2, 3], skip=[3]) == [2]
    assert idle_local_ranks(plan, "spare", [0, 1], skip=[]) == []  # a spare: no worker


def test_the_speed_path_is_one_line_from_observe_to_the_decision():
    """view -> ``observe`` (a value) -> ``build_snapshot(measured=...)`` -> ``decide``: a
    device measured four times slower becomes a ``degrade`` change of the next plan, at the
    quantised speed, and nothing else carries the speed."""
    from launcher.leader.decide import ChangeKind, decide

    clock, journal = Clock(), []
    watch = watch_of(clock, journal)
    plan = Plan(tuple(Pipeline((Stage((i,), (0, MID.num_layers)),), 1, 8) for i in range(2)),
                16, MID.num_layers)
    current = schema.PlanRecord(version=1, reason="t", devices=DEVS[:2], strategy=plan.to_dict(),
                                store_endpoint="h:1", created_at=0.0,
                                inventory={"n:0": 1.0, "n:1": 1.0})
    usable = {d: USABLE[d] for d in DEVS[:2]}
    measured: dict = {}
    for step in range(1, 16):
        clock.t += 1.0
        recs = {("n", i): schema.WorkerRecord(pid=1 + i, global_rank=i, local_rank=i,
                                              plan_version=1, step=step, last_progress_at=0.0,
                                              steps_per_s=1.0, busy_s=(0.1, 0.4)[i])
                for i in range(2)}
        measured = watch.observe(lambda: recs, current, usable)
    assert measured == {"n:1": 0.25}
    node = schema.NodeRecord(host="h", agent_pid=1, state="running", started_at=0.0,
                             devices=[schema.DeviceInfo(index=i, type="CPU",
                                                        memory_bytes=64 << 20, uuid="")
                                      for i in range(2)], store_endpoint="h:1")
    snap = build_snapshot({"n": node}, {}, "n", measured=measured)
    decision = decide(snap, current)
    assert decision is not None and decision.inventory == {"n:0": 1.0, "n:1": 0.25}
    assert [(c.kind, c.devices) for c in decision.changes] == [(ChangeKind.DEGRADE, ("n:1",))]
    # the same records without the value: the cluster matches the plan
    assert decide(build_snapshot({"n": node}, {}, "n"), current) is None
