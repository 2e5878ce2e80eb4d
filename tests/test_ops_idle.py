"""Idle devices in what an operator sees (no etcd: production record types fed to
``JobView.build``): a device the current plan was made over but gives no role is ``idle`` in
``status --json`` (with why: the ``speeds`` decision's speed and step times with and without
it), in the terminal's "Speeds" table, and in a ``speeds`` event's one-line summary; a device
the plan uses, or a failed one, is not idle."""

from __future__ import annotations

import io

from rich.console import Console

from _events import event as typed_event
from hspmd_elastic.contract import schema
from hspmd_elastic.contract.events import IdleDevice
from hspmd_elastic.plan import Pipeline, Plan, Stage
from launcher.ops.events import event_summary
from launcher.ops.status import render, speed_rows
from launcher.ops.view import JobView

JOB = "idlejob"
NOW = 1_800_000_000.0
WHY = "speed 0.25: step 0.31 s with it, 0.28 s without"


def records(idle_event: bool = True) -> list:
    devs = [schema.DeviceInfo(i, "CPU", 1 << 30, "") for i in range(3)]
    node = schema.NodeRecord(host="h", agent_pid=10, devices=devs, state="running",
                             started_at=NOW - 100)
    layout = Plan((Pipeline((Stage((0,), (0, 2)),), 1, 4),), 4, 2)
    plan = schema.PlanRecord(version=2, reason="degrade n:1", devices=["n:0"],
                             strategy=layout.to_dict(), store_endpoint="h:1",
                             created_at=NOW - 40, inventory={"n:0": 1.0, "n:1": 0.25})
    speeds = schema.SpeedsDetail(
        plan_version=1, measured={"n:0": 1.0, "n:1": 0.25}, assumed={"n:0": 1.0, "n:1": 1.0},
        step_now_s=0.5, step_new_s=0.28, gain_s=40.0, cost_s=2.0, replan=True, reason="r",
        idle={"n:1": IdleDevice(0.25, 0.31, 0.28, WHY)})
    out = [(schema.node_key(JOB, "n"), node), (schema.plan_current_key(JOB), plan),
           (schema.device_key(JOB, "n", 2), schema.DeviceHealthRecord(
               state="failed", reason="Xid 79", xid=79, slowdown=None, at=NOW - 50))]
    if idle_event:
        out.append((schema.event_key(JOB, 1), typed_event(1, "speeds", speeds, "n", NOW - 45)))
    return out


def test_status_names_the_idle_device_with_the_numbers_of_the_decision():
    view = JobView.build(JOB, records(), now=NOW)
    devices = {d["id"]: d for n in view.document()["nodes"] for d in n["devices"]}
    assert devices["n:1"]["idle"] == WHY
    assert devices["n:0"]["idle"] is None and devices["n:2"]["idle"] is None  # used / failed
    rows = {r[0]: r for r in speed_rows(view)}
    assert rows["n:1"][5] == WHY and rows["n:0"][5] is None
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(view))
    shown = console.file.getvalue()
    assert "idle: why" in shown and WHY in shown


def test_without_a_decision_the_idle_device_is_named_plainly_and_the_event_says_why():
    view = JobView.build(JOB, records(idle_event=False), now=NOW)
    devices = {d["id"]: d for n in view.document()["nodes"] for d in n["devices"]}
    assert devices["n:1"]["idle"] == "plan v2 leaves it idle"
    [(_, ev)] = [r for r in records() if r[0] == schema.event_key(JOB, 1)]
    assert f"idle: n:1 ({WHY})" in event_summary(ev)
