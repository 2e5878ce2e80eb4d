"""The fault-injection harness's vocabulary: errors, fault names, progress points, report rows.

A reader learns ``launcher.inject`` from this file. Promises:

* every error the harness raises is an ``InjectError`` with a one-line message naming the bad
  value (a scenario entry, a target that matches no process of the job, an etcd it does not
  own); ``ScenarioError`` is the usage error (the CLI exits 2 on it);
* ``FAULT_NAMES`` is the one list of fault kinds a scenario may use; ``FaultRow`` is what the
  report says about one fault, with every time in seconds since the scenario started
  (``None`` = did not happen);
* ``Report.job_end`` is how the job stood when the run finished (``JobEnd``: succeeded or
  failed with the reason etcd recorded, or running); a job that failed makes its last fault
  not recovered, and the run's exit non-zero;
* ``ProgressPoint`` is one observation of training progress: ``step`` counts completed steps
  (the state is at step ``step``), ``round`` is the restart round or plan version that ran it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SCENARIO_SCHEMA = 1
SCENARIO_KIND = "fault_scenario"

WORKER_FAULTS = ("kill-worker", "stop-worker", "hang")
AGENT_FAULTS = ("kill-agent", "freeze-agent")
DEVICE_FAULTS = ("xid", "ecc", "thermal", "lost", "suspect", "recover")
NETWORK_FAULTS = ("partition",)
ETCD_FAULTS = ("etcd-restart", "etcd-stall")  # the job should ride them through
# A worker's CPU capped (a real CFS quota: ``launcher.cgroups``), and the cap lifted.
SPEED_FAULTS = ("throttle", "unthrottle")
FAULT_NAMES = (*WORKER_FAULTS, *AGENT_FAULTS, *DEVICE_FAULTS, *ETCD_FAULTS, "join",
               *NETWORK_FAULTS, *SPEED_FAULTS)

# What a report row's ``outcome`` may say.
RECOVERED = "recovered"  # detected (when a reaction is expected) and training went on
SURVIVED = "survived"  # no reaction expected (etcd restart), and training went on
NOT_DETECTED = "not detected"  # injected, the job never reacted within the deadline
NOT_RECOVERED = "not recovered"  # detected, but training did not go on within the deadline
NOT_INJECTED = "not injected"  # the fault could not be applied (reason in ``note``)
OUTCOMES = (RECOVERED, SURVIVED, NOT_DETECTED, NOT_RECOVERED, NOT_INJECTED)

# How the job stood when the report was made (``JobEnd.state``): ``rdzv/state``'s end, or none.
JOB_SUCCEEDED, JOB_FAILED, JOB_RUNNING = "succeeded", "failed", "running"


# --------------------------------------------------------------------------------------- errors
class InjectError(Exception):
    """Root of the harness's errors; ``str(err)`` is one line."""


class ScenarioError(InjectError, ValueError):
    """A scenario file is malformed: names the file, the entry and what is wrong."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"bad scenario {where}: {problem}")


class TargetNotFound(InjectError):
    """No live process (or node, or device) of the job matches a fault's target."""


class NotOwnedError(InjectError):
    """The fault needs something the harness does not control (e.g. the etcd members)."""


# ---------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class ProgressPoint:
    """Training progress seen once: ``rank`` completed ``step`` steps in ``round`` at ``t``
    (wall-clock seconds). ``batch``: samples per step (global batch), when known."""

    rank: int
    round: int
    step: int
    t: float
    batch: Optional[int] = None


@dataclass
class FaultRow:
    """The report's line for one fault (times in seconds since the scenario started)."""

    index: int
    fault: str
    target: dict[str, Any]
    outcome: str = NOT_INJECTED
    injected_at: Optional[float] = None
    detected_at: Optional[float] = None
    detected_by: str = ""
    recovered_at: Optional[float] = None
    recovered_by: str = ""
    steps_lost: Optional[int] = None
    escalated: bool = False
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobEnd:
    """How the job stood when the harness finished, as etcd's ``rdzv/state`` recorded it:
    ``succeeded`` or ``failed`` with the agents' reason and ``at`` (seconds since the scenario
    started), or ``running`` (no end recorded yet)."""

    state: str
    reason: str = ""
    at: Optional[float] = None


@dataclass
class Report:
    """The whole run: one row per scenario entry, plus what the progress log says overall."""

    scenario: str
    job: str
    rows: list[FaultRow]
    started_at: float  # wall clock of the scenario start
    samples_lost: Optional[int] = None
    steps_skipped: Optional[int] = None
    final_step: Optional[int] = None
    job_end: Optional[JobEnd] = None  # None: not read (the run did not finish)
    stopped: str = ""  # why the run stopped early (a signal), "" when it ran to its end

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCENARIO_SCHEMA, "kind": "fault_report", "scenario": self.scenario,
                "job": self.job, "started_at": self.started_at,
                "samples_lost": self.samples_lost, "steps_skipped": self.steps_skipped,
                "final_step": self.final_step, "faults": [r.to_dict() for r in self.rows],
                "job_end": asdict(self.job_end) if self.job_end is not None else None,
                "stopped": self.stopped}
