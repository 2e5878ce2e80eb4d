"""The vocabulary of live elasticity on the worker side: errors, the worker lifecycle, identity,
progress reports and switch timings.

A reader learns ``hspmd_elastic.elastic`` (and ``runtime.py`` / ``switch.py`` built on it) from
this file. Promises:

* every failure the runtime raises is an ``ElasticError`` subclass naming the root cause;
* the worker's lifecycle is the ``WorkerState`` machine (``hspmd_elastic.contract.progress``,
  shared with the agent) run by ``Lifecycle`` on the one ``coord.lifecycle.StateMachine``, with the
  table of allowed transitions below; an illegal transition is a bug and raises at once;
* progress reports are the contract's ``WorkerProgress`` handed to a ``ProgressReporter``; the
  ``FileReporter`` writes the progress file the node agent reads (``HSPMD_PROGRESS_FILE``); the
  agent owns the etcd key ``workers/<node>/<local_rank>``, the worker never writes it;
* the worker environment is read through ``contract.env.WorkerEnv`` (``WorkerIdentity.from_env``,
  ``reporter_from_env``): a bad value is a ``ConfigurationError`` naming the variable.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Protocol

from hspmd_elastic.contract.env import (ETCD_ENDPOINTS_ENV, JOB_ID_ENV, NODE_ID_ENV, EnvError,
                                        WorkerEnv)
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.contract.relay import relay_file_of
from hspmd_elastic.contract.progress import (  # noqa: F401 - the worker's vocabulary, re-exported
    WorkerProgress,
    WorkerState,
    write_progress,
)
from hspmd_elastic.coord.lifecycle import IllegalTransition, StateMachine  # noqa: F401
from hspmd_elastic.coord.security import EtcdSecurity, EtcdSecurityError
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
_SWITCHING = (WorkerState.REGROUPING, WorkerState.EXCHANGING, WorkerState.RESHARDING,
              WorkerState.BUILDING)
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.WAITING_PLAN: frozenset({WorkerState.REGROUPING, WorkerState.EXCLUDED,
                                         WorkerState.FAILED}),
    WorkerState.REGROUPING: frozenset({WorkerState.EXCHANGING}),
    WorkerState.EXCHANGING: frozenset({WorkerState.RESHARDING}),
    WorkerState.RESHARDING: frozenset({WorkerState.BUILDING}),
    WorkerState.BUILDING: frozenset({WorkerState.TRAINING, WorkerState.EXCLUDED}),  # drained
    WorkerState.TRAINING: frozenset({WorkerState.FINISHING}),
    WorkerState.FINISHING: frozenset({WorkerState.DONE}),
    WorkerState.DONE: frozenset(),
    WorkerState.EXCLUDED: frozenset(),
    WorkerState.FAILED: frozenset(),
}
# Any live state may fall back to waiting for a plan (a newer plan, a dead peer) or fail.
for _s in _SWITCHING + (WorkerState.TRAINING, WorkerState.FINISHING):
    TRANSITIONS[_s] = TRANSITIONS[_s] | {WorkerState.WAITING_PLAN, WorkerState.FAILED}


class Lifecycle(StateMachine[WorkerState]):
    """The worker's state machine (``TRANSITIONS``) with a timestamped history."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__("worker", TRANSITIONS, WorkerState.WAITING_PLAN, "start", clock=clock)


# ------------------------------------------------------------------------------- identity
LOCAL_RANK_ENV = "LOCAL_RANK"  # torchrun's name; both agents set it for each worker


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is: a device (worker slot) ``<node_id>:<local_rank>`` of a job, how it
    reaches etcd (endpoints; TLS and auth from ``HSPMD_ETCD_*``, as its agent has them), and
    where it may compute (``device_setting``: ``HSPMD_DEVICE``, auto, cuda or cpu; see
    ``hspmd_elastic.devices``), and where its agent relays the plan (``relay_file``: beside its
    ``HSPMD_PROGRESS_FILE``, ``contract.relay``; None: read from etcd)."""

    job: str
    node: str
    local_rank: int
    etcd_endpoints: str
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    device_setting: str = "auto"
    relay_file: Optional[str] = None

    @property
    def device(self) -> str:
        return device_id(self.node, self.local_rank)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "WorkerIdentity":
        """The identity the worker environment ``env`` (default ``os.environ``) gives;
        ``ConfigurationError`` naming what is missing or bad."""
        env = os.environ if env is None else env
        try:
            worker = WorkerEnv.from_env(env)
        except EnvError as exc:
            raise ConfigurationError(f"worker environment: {exc}") from None
        missing = [name for name, value in ((ETCD_ENDPOINTS_ENV, worker.etcd_endpoints),
                                            (JOB_ID_ENV, worker.job), (NODE_ID_ENV, worker.node),
                                            (LOCAL_RANK_ENV, env.get(LOCAL_RANK_ENV)))
                   if not value]
        if missing:
            raise ConfigurationError(f"worker environment lacks {missing}; an hspmd-aware script "
                                     "must run under hspmd-launch (or set them)")
        try:
            local_rank = int(env[LOCAL_RANK_ENV])
        except ValueError as exc:
            raise ConfigurationError(
                f"{LOCAL_RANK_ENV}={env[LOCAL_RANK_ENV]!r} must be an integer") from exc
        try:
            security = EtcdSecurity.from_env(env).checked()
        except EtcdSecurityError as exc:
            raise ConfigurationError(f"worker environment: {exc}") from exc
        return cls(worker.job, worker.node, local_rank, worker.etcd_endpoints, security,
                   worker.device or "auto", relay_file_of(worker.progress_file))


# ------------------------------------------------------------------------------- progress
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
        write_progress(self.path, progress)


def reporter_from_env(env: Optional[Mapping[str, str]] = None) -> ProgressReporter:
    """``HSPMD_PROGRESS_FILE`` set: a ``FileReporter`` there; otherwise a no-op."""
    path = WorkerEnv.from_env(env, fields=("progress_file",)).progress_file
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
    plan_from: str = ""  # where the worker read the plan: relay | layout | current (plan_watch)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out

    def numeric(self) -> dict[str, float]:
        """The numeric entries, as an EventRecord's ``timings`` wants them."""
        return {k: float(v) for k, v in self.as_dict().items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
