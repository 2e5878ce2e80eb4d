"""The vocabulary of live elasticity on the worker side: errors, the worker lifecycle, identity,
progress reports and switch timings.

A reader learns ``hspmd_elastic.elastic`` (and ``runtime.py`` / ``switch.py`` built on it) from
this file. Promises:

* every failure the runtime raises is an ``ElasticError`` subclass naming the root cause;
* the worker's lifecycle is the ``WorkerState`` machine below: an enum, a table of allowed
  transitions and a timestamped history; an illegal transition is a bug and raises at once;
* progress reports are ``WorkerRecord``-compatible values handed to a ``ProgressReporter`` (the
  node agent owns the etcd key ``workers/<node>/<local_rank>``; the worker never writes it).
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Protocol

from hspmd_elastic.graph.comm import CommTimeoutError


# --------------------------------------------------------------------------------------- errors
class ElasticError(RuntimeError):
    """Root of the errors of the elastic worker runtime."""


class ConfigurationError(ElasticError):
    """The worker's environment or arguments are unusable (names the bad value)."""


class PlanWaitTimeout(ElasticError):
    """No usable plan (one newer than the current one, containing this device) arrived in time."""


class SwitchRequested(CommTimeoutError):
    """A newer plan was published while a communication was pending: abandon the step.

    A ``CommTimeoutError`` so that code which already treats a failed communication as "this
    step did not happen" handles it the same way.
    """

    def __init__(self, version: int, what: str):
        self.version = version
        super().__init__(f"plan v{version} published while waiting on {what}")


class SwitchError(ElasticError):
    """A switch could not complete and cannot be retried (the root cause is chained)."""


class UnrecoverableStateError(SwitchError):
    """Some training state has no live owner and no checkpoint can replace it."""


# ------------------------------------------------------------------------------- lifecycle
class WorkerState(enum.Enum):
    WAITING_PLAN = "waiting_plan"  # waiting for a plan newer than ours that contains this device
    REGROUPING = "regrouping"  # destroying the old process group, forming the plan's group
    EXCHANGING = "exchanging"  # agreeing on the resume step and on who holds what
    RESHARDING = "resharding"  # the fused BSR (or a checkpoint load)
    BUILDING = "building"  # building the specialized graph on the received state
    TRAINING = "training"
    FINISHING = "finishing"  # all steps done; waiting until every rank of the plan is done
    DONE = "done"
    EXCLUDED = "excluded"  # the newest plan does not use this device: the worker leaves
    FAILED = "failed"


_SWITCHING = (WorkerState.REGROUPING, WorkerState.EXCHANGING, WorkerState.RESHARDING,
              WorkerState.BUILDING)
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.WAITING_PLAN: frozenset({WorkerState.REGROUPING, WorkerState.EXCLUDED,
                                         WorkerState.FAILED}),
    WorkerState.REGROUPING: frozenset({WorkerState.EXCHANGING}),
    WorkerState.EXCHANGING: frozenset({WorkerState.RESHARDING}),
    WorkerState.RESHARDING: frozenset({WorkerState.BUILDING}),
    WorkerState.BUILDING: frozenset({WorkerState.TRAINING}),
    WorkerState.TRAINING: frozenset({WorkerState.FINISHING}),
    WorkerState.FINISHING: frozenset({WorkerState.DONE}),
    WorkerState.DONE: frozenset(),
    WorkerState.EXCLUDED: frozenset(),
    WorkerState.FAILED: frozenset(),
}
# Any live state may fall back to waiting for a plan (a newer plan, a dead peer) or fail.
for _s in _SWITCHING + (WorkerState.TRAINING, WorkerState.FINISHING):
    TRANSITIONS[_s] = TRANSITIONS[_s] | {WorkerState.WAITING_PLAN, WorkerState.FAILED}


class IllegalTransition(ElasticError):
    pass


class Lifecycle:
    """The worker's state machine with a timestamped history (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.state = WorkerState.WAITING_PLAN
        self.history: list[tuple[WorkerState, float]] = [(self.state, clock())]

    def to(self, state: WorkerState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"worker state {self.state.value} -> {state.value} "
                                    f"is not allowed; allowed: "
                                    f"{sorted(s.value for s in TRANSITIONS[self.state])}")
        self.state = state
        self.history.append((state, self._clock()))

    @property
    def since(self) -> float:
        return self.history[-1][1]


# ------------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is: a device (worker slot) ``<node_id>:<local_rank>`` of a job."""

    job: str
    node: str
    local_rank: int
    etcd_endpoints: str

    @property
    def device(self) -> str:
        return f"{self.node}:{self.local_rank}"

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "WorkerIdentity":
        env = os.environ if env is None else env
        missing = [k for k in ("HSPMD_ETCD_ENDPOINTS", "HSPMD_JOB_ID", "HSPMD_NODE_ID",
                               "LOCAL_RANK") if not env.get(k)]
        if missing:
            raise ConfigurationError(f"worker environment lacks {missing}; an hspmd-aware script "
                                     "must run under hspmd-launch (or set them)")
        try:
            local_rank = int(env["LOCAL_RANK"])
        except ValueError as exc:
            raise ConfigurationError(
                f"LOCAL_RANK={env['LOCAL_RANK']!r} must be an integer") from exc
        return cls(env["HSPMD_JOB_ID"], env["HSPMD_NODE_ID"], local_rank,
                   env["HSPMD_ETCD_ENDPOINTS"])


def node_of_device(device: str) -> str:
    """``"<node_id>:<local_rank>"`` -> ``"<node_id>"``."""
    return device.rsplit(":", 1)[0]


# ------------------------------------------------------------------------------- progress
@dataclass(frozen=True)
class WorkerProgress:
    """A progress report; the fields of ``schema.WorkerRecord`` plus the worker's state."""

    pid: int
    global_rank: int
    local_rank: int
    plan_version: int
    step: int
    last_progress_at: float
    steps_per_s: float
    state: str = WorkerState.TRAINING.value

    def to_worker_record(self):
        from hspmd_elastic.coord.schema import WorkerRecord

        return WorkerRecord(pid=self.pid, global_rank=self.global_rank, local_rank=self.local_rank,
                            plan_version=self.plan_version, step=self.step,
                            last_progress_at=self.last_progress_at, steps_per_s=self.steps_per_s)


class ProgressReporter(Protocol):
    def report(self, progress: WorkerProgress) -> None: ...


class NullReporter:
    def report(self, progress: WorkerProgress) -> None:
        pass


class FileReporter:
    """Writes the latest report as one JSON object, atomically (tmp file + rename)."""

    def __init__(self, path: str):
        self.path = path

    def report(self, progress: WorkerProgress) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(progress), f)
        os.replace(tmp, self.path)


def reporter_from_env(env: Optional[dict] = None) -> ProgressReporter:
    """``HSPMD_PROGRESS_FILE`` set: a ``FileReporter`` there; otherwise a no-op."""
    path = (os.environ if env is None else env).get("HSPMD_PROGRESS_FILE")
    return FileReporter(path) if path else NullReporter()


# -------------------------------------------------------------------------------- timings
@dataclass
class SwitchTimings:
    """What one switch cost on one rank (seconds, bytes). ``detect_s``: from the plan's
    publication (``PlanRecord.created_at``) to this worker noticing it; ``stall_s``: from the
    first failed communication to noticing the plan (the wait for the leader)."""

    from_version: int
    to_version: int
    rank: int
    detect_s: float = 0.0
    stall_s: float = 0.0
    regroup_s: float = 0.0
    exchange_s: float = 0.0
    bsr_s: float = 0.0
    bsr_bytes_total: int = 0
    bsr_bytes_sent: int = 0
    bsr_bytes_received: int = 0
    rebuild_s: float = 0.0
    total_s: float = 0.0
    resume_step: int = 0
    rolled_back: bool = False
    source: str = "bsr"  # bsr | checkpoint | init
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out

    def numeric(self) -> dict[str, float]:
        """The numeric entries, as an EventRecord's ``timings`` wants them."""
        return {k: float(v) for k, v in self.as_dict().items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
