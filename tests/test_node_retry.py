"""The node agent's stuck-switch rule (``launcher.node.elastic.retry``): pure, on an injected clock."""

from __future__ import annotations

import pytest

from hspmd_elastic.contract.progress import WorkerProgress
from launcher.node.elastic.retry import StuckSwitches, retry_after_s


def report(pid: int, version: int, state: str) -> WorkerProgress:
    return WorkerProgress(pid=pid, global_rank=0, local_rank=0, plan_version=version, step=3,
                          last_progress_at=0.0, steps_per_s=0.0, state=state)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_workers_waiting_after_the_current_plan_ask_once_they_waited_long_enough():
    clock = Clock()
    stuck = StuckSwitches(5.0, clock)
    running = {0: 10, 1: 11}
    waiting = {0: report(10, 2, "waiting_plan"), 1: report(11, 2, "training")}
    assert stuck.observe(2, running, waiting) is None
    clock.t += 4.9
    assert stuck.observe(2, running, waiting) is None
    clock.t += 0.2
    assert stuck.observe(2, running, waiting) == ([0], pytest.approx(5.1))
    # The other slot joins the wait later: both are named, timed from the first.
    waiting[1] = report(11, 2, "waiting_plan")
    assert stuck.observe(2, running, waiting) == ([0, 1], pytest.approx(5.1))
    # Training again (a plan came) ends it; a new wait starts afresh.
    both = {0: report(10, 2, "training"), 1: report(11, 2, "training")}
    assert stuck.observe(2, running, both) is None
    assert stuck.observe(2, running, waiting) is None


@pytest.mark.parametrize("case", ["older plan", "another pid", "not running", "fresh worker",
                                  "regrouping"])
def test_what_is_not_a_stuck_switch(case):
    clock = Clock()
    stuck = StuckSwitches(1.0, clock)
    running, version = {0: 10}, 3
    rep = report(10, 3, "waiting_plan")
    if case == "older plan":  # it waits for a plan that uses it after an older one
        rep = report(10, 2, "waiting_plan")
    elif case == "another pid":  # the slot's live worker has not reported yet
        rep = report(9, 3, "waiting_plan")
    elif case == "not running":
        running = {}
    elif case == "fresh worker":  # started for the plan, not switched into it yet
        rep = report(10, 0, "waiting_plan")
    elif case == "regrouping":  # a switch in progress is bounded by its own deadlines
        rep = report(10, 3, "regrouping")
    stuck.observe(version, running, {0: rep})
    clock.t += 60.0
    assert stuck.observe(version, running, {0: rep}) is None


def test_the_retry_delay_is_two_lease_ttls_and_at_least_five_seconds():
    assert retry_after_s(10.0) == 20.0 and retry_after_s(2.0) == 5.0
    with pytest.raises(ValueError, match="after_s=0"):
        StuckSwitches(0.0)
