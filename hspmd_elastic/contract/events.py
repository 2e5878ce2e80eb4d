"""The event journal's details: one dataclass per event type, registered like ``KeySpec``.

An event (``records.EventRecord`` at ``events/<seq>``) is ``{seq, type, node, detail, timings,
at}``. ``detail`` is the JSON of the dataclass ``EVENT_DETAILS[type]`` names; ``timings`` holds
only numbers (seconds, bytes) for people and dashboards. Promises:

* ``EVENT_DETAILS`` maps every event type to its detail dataclass; ``EVENT_TYPES`` is its keys,
  in journal-reading order; docs/etcd-schema.md's event table is checked against it by a test;
* writers build the dataclass (``NewEvent(type, node, detail)`` checks the pairing), readers get
  it back with ``schema.event_detail(event)``; ``schema.decode`` refuses an event whose detail
  does not fit its type (a missing, unknown or mistyped field), naming the field: no reader
  guesses at a shape;
* every change a leader journals (``join``, ``leave``, ``failure``, ``stall``, ``drain``,
  ``unreachable``, ``degrade``, ``recover``, ``retry``) has at least ``devices``, ``reason`` and
  ``plan_version``; a ``replan`` lists its changes as ``PlanChange`` objects, never as prose;
* switch pairing (a ``replan`` that replaces a plan starts a switch, the ``switch-done`` /
  ``switch-failed`` of the same ``plan_version`` ends it) is read by ``schema.switch_of``, next
  to ``schema.event_detail`` which it needs.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class EventType(str, enum.Enum):
    """The type of an event (the ``type`` field of ``events/<seq>``)."""

    FAILURE = "failure"
    JOIN = "join"
    LEAVE = "leave"
    DEGRADE = "degrade"
    RECOVER = "recover"
    STALL = "stall"
    REPLAN = "replan"
    SWITCH_DONE = "switch-done"
    SWITCH_FAILED = "switch-failed"
    RESTART = "restart"
    FALLBACK = "fallback"
    DRAIN = "drain"
    DRAINED = "drained"
    UNREACHABLE = "unreachable"
    RETRY = "retry"
    SPEEDS = "speeds"


@dataclass
class Detail:
    """Base of every event detail: a dataclass whose JSON is the event's ``detail``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ExitInfo:
    """One worker process that ended (nested in ``FailureDetail.exits``): its exit code, or the
    signal that killed it (``exitcode`` None, ``signal`` the number)."""

    local_rank: int
    pid: int
    exitcode: Optional[int]
    signal: Optional[int] = None
    global_rank: Optional[int] = None
    error_file: str = ""  # the worker's torchrun error file (TORCHELASTIC_ERROR_FILE)
    message: str = ""  # its first line of error, when the worker wrote one
    host: str = ""  # the host its agent runs on (for the failure summary)


@dataclass
class ChangeDetail(Detail):
    """A change in the cluster the leader (elastic mode) or a node agent (restart mode) saw:
    ``devices`` concerned (ids ``<node>:<index>``), why, and the plan it changes."""

    devices: list[str] = field(default_factory=list)
    reason: str = ""
    plan_version: int = 0  # the plan the change leads to (0: none yet, or restart mode)
    round: Optional[int] = None  # restart mode: the rendezvous round it ends
    nodes: list[str] = field(default_factory=list)  # nodes that joined or left (membership)


@dataclass
class FailureDetail(ChangeDetail):
    """Devices lost: a worker that died (``exits``, journaled by its agent), a device fault or
    a device no longer reported (journaled by the leader)."""

    exits: list[ExitInfo] = field(default_factory=list)


@dataclass
class StallDetail(ChangeDetail):
    """A worker that made no progress for longer than the hang rule allows (killed by its
    agent): where it stopped and for how long."""

    local_rank: Optional[int] = None
    pid: Optional[int] = None
    step: Optional[int] = None
    stalled_s: Optional[float] = None


@dataclass
class PlanChange:
    """One change a plan answers (nested in ``ReplanDetail.changes``)."""

    kind: str  # an EventType of a change: join, leave, failure, stall, drain, ...
    node: str
    devices: list[str] = field(default_factory=list)
    reason: str = ""

    def describe(self) -> str:
        """One line for people: ``failure n1:0,n1:1: why``, ``join n2``."""
        if self.kind in (EventType.JOIN.value, EventType.LEAVE.value):
            return f"{self.kind} {self.node}"
        what = f"{self.kind} {','.join(self.devices)}"
        return f"{what}: {self.reason}" if self.reason else what


@dataclass
class ReplanDetail(Detail):
    """The leader published plan ``version`` over ``device_count`` devices."""

    version: int
    previous_version: int  # 0: the job's first plan
    reason: str  # for people: the changes described, or "start"
    device_count: int
    planner: str
    store_endpoint: str
    step: Optional[int] = None  # the furthest step any worker had reported
    changes: list[PlanChange] = field(default_factory=list)


@dataclass
class SwitchDoneDetail(Detail):
    """The workers run plan ``plan_version`` (written once, by its rank 0)."""

    plan_version: int
    from_version: int  # 0: the job's first plan (workers started from the seed)
    source: str  # where the state came from: bsr | checkpoint | init | hf (--init-from)
    rolled_back: bool = False  # the step in flight was undone
    bytes_moved: int = 0  # bytes the BSR moved between ranks (all ranks' sends)
    resume_step: int = 0


@dataclass
class SwitchFailedDetail(Detail):
    """The switch into ``plan_version`` could not complete (state lost, no checkpoint)."""

    plan_version: int
    error: str
    why: str = ""
    from_version: int = 0


@dataclass
class FallbackDetail(Detail):
    """A switch took the state from a checkpoint: part of it was held by nobody alive."""

    plan_version: int
    error: str
    checkpoint_step: int
    steps_redone: int


@dataclass
class DrainedDetail(Detail):
    """A drained (suspect) device handed its state over by BSR and left the plan."""

    plan_version: int
    device: str
    resume_step: int


@dataclass
class RestartDetail(Detail):
    """Restart mode: the worker group restarts in rendezvous round ``round``."""

    round: int
    restart_count: int
    reason: str


@dataclass
class IdleDevice:
    """A usable device a plan leaves idle, and why (nested in ``SpeedsDetail.idle``): its
    measured speed and the cost model's step time of the best plan with it and without it."""

    speed: float  # measured (1.0: the fastest device); the speed the plan assumed before one
    step_with_s: float  # predicted step time of the best plan that uses it (0: none found)
    step_without_s: float  # predicted step time of the plan that leaves it idle
    reason: str  # the above in one line


@dataclass
class SpeedsDetail(Detail):
    """The leader weighed the devices' measured speeds against the current plan: the numbers,
    whether a plan for the measured speeds pays for its switch (``replan``), and what that
    plan does to the job's redundancy (a speed-driven plan keeps it unless none can)."""

    plan_version: int  # the plan the speeds were measured under
    measured: dict[str, float]  # device -> speed measured under it (1.0: the fastest)
    assumed: dict[str, float]  # device -> speed the plan was made for
    step_now_s: float  # predicted step time of the current plan at the measured speeds
    step_new_s: float  # predicted step time of the best plan for the measured speeds
    gain_s: float  # predicted time saved over the horizon
    cost_s: float  # predicted cost of the switch
    replan: bool
    reason: str
    # The copies of the parameters (``planner.copies``): the fewest devices and nodes any
    # parameter slice lives on under the current plan and under the best plan for the
    # measured speeds (0: not predicted), and whether that plan keeps them (``kept``) or,
    # no plan for the speeds keeping them, loses some (``traded``), with why in one line.
    copies_before: int = 0
    copies_after: int = 0
    copy_nodes_before: int = 0
    copy_nodes_after: int = 0
    redundancy: str = ""
    redundancy_reason: str = ""
    # The devices the plan this decision leads to leaves idle (the best plan's on a replan, the
    # current plan's otherwise), each with its speed and step times with and without it.
    idle: dict[str, IdleDevice] = field(default_factory=dict)


EVENT_DETAILS: dict[str, type[Detail]] = {
    EventType.FAILURE.value: FailureDetail,
    EventType.JOIN.value: ChangeDetail,
    EventType.LEAVE.value: ChangeDetail,
    EventType.DEGRADE.value: ChangeDetail,
    EventType.RECOVER.value: ChangeDetail,
    EventType.STALL.value: StallDetail,
    EventType.REPLAN.value: ReplanDetail,
    EventType.SWITCH_DONE.value: SwitchDoneDetail,
    EventType.SWITCH_FAILED.value: SwitchFailedDetail,
    EventType.RESTART.value: RestartDetail,
    EventType.FALLBACK.value: FallbackDetail,
    EventType.DRAIN.value: ChangeDetail,
    EventType.DRAINED.value: DrainedDetail,
    EventType.UNREACHABLE.value: ChangeDetail,
    EventType.RETRY.value: ChangeDetail,
    EventType.SPEEDS.value: SpeedsDetail,
}
EVENT_TYPES: tuple[str, ...] = tuple(EVENT_DETAILS)
NESTED_DETAIL_TYPES: tuple[type, ...] = (ExitInfo, PlanChange, IdleDevice)
# The event types a leader journals for the changes a plan answers (``PlanChange.kind``).
CHANGE_TYPES: tuple[str, ...] = ("join", "leave", "failure", "stall", "drain", "unreachable",
                                 "degrade", "recover", "retry")


def check_detail(type_: str, detail: Detail) -> None:
    """Raise ``ValueError`` unless ``detail`` is the dataclass ``type_``'s events carry."""
    want = EVENT_DETAILS.get(type_)
    if want is None:
        raise ValueError(f"unknown event type {type_!r} (one of {', '.join(EVENT_TYPES)})")
    if type(detail) is not want:
        raise ValueError(f"a {type_} event carries a {want.__name__}, "
                         f"not a {type(detail).__name__}")


def change_detail(kind: str, devices: list[str], reason: str, plan_version: int) -> Detail:
    """The detail of a change event the leader journals (any of ``CHANGE_TYPES``)."""
    return EVENT_DETAILS[kind](devices=list(devices), reason=reason, plan_version=plan_version)
