"""The node agent's vocabulary: what a mode is, what it is given, and how it ends.

``NodeAgent`` (``agent.py``) is a thin shell: signals, the etcd lease, the log directory and the
etcd-outage policy. It runs one **mode** through the small protocol ``Mode``:

* ``start()`` once; then ``tick()`` again and again: one level-triggered step that re-reads the
  world and converges, and returns ``None`` while the mode runs or its ``ModeOutcome`` once it
  ended (each tick waits at most about ``--monitor-interval`` on ``AgentContext.wait``, which
  ends early on a signal);
* ``stop(cause)`` exactly once at the end, whatever happened: ``cause`` is None after an outcome
  of the mode's own, or a ``StopCause`` (a handled signal, or the one-line error that ended the
  run); it stops and reaps the mode's workers, records the mode's terminal state and returns
  the final ``ModeOutcome``. It never raises.

Restart mode (``restart/mode.py``, torchrun's semantics) and elastic mode (``elastic/mode.py``,
``--hspmd-elastic``) are the two implementations. A mode reaches the shell's resources only
through ``AgentContext``, never through the shell's fields.
"""

from __future__ import annotations

import enum
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from hspmd_elastic.contract.rounds import Participant
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.lease import LeasedSession
from launcher.api import LaunchConfig, RankAssignment, SignalReceived
from launcher.console import WaitBar
from launcher.logs import RunLogDir
from launcher.node import reaper
from launcher.node.outage import EtcdOutagePolicy


class End(str, enum.Enum):
    """How a mode ended; the agent exits 0 only on SUCCEEDED."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class ModeOutcome:
    """A mode's end: ``reason`` is one line; ``error_line`` is what the agent prints after
    ``hspmd-launch: error:`` (empty on success)."""

    end: End
    reason: str = ""
    error_line: str = ""

    @property
    def ok(self) -> bool:
        return self.end is End.SUCCEEDED


@dataclass(frozen=True)
class StopCause:
    """Why the shell stops a mode that has not ended by itself."""

    signum: Optional[int] = None  # a handled signal
    error: str = ""  # the one-line error (a LaunchError, or etcd lost for too long)

    def outcome(self) -> ModeOutcome:
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            return ModeOutcome(End.INTERRUPTED, name,
                               f"process {os.getpid()} got signal: {self.signum} ({name})")
        return ModeOutcome(End.FAILED, self.error, self.error)


class AgentContext:
    """What the shell gives its mode: the launch config, etcd (client, leased session), the
    node's identity, the clock, the log directory, the progress bar, the outage policy and the
    abort signal."""

    def __init__(self, config: LaunchConfig, client: EtcdClient, session: LeasedSession,
                 host: str, logdir: RunLogDir, bar: WaitBar, outage: EtcdOutagePolicy,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.client, self.session = config, client, session
        self.host, self.logdir, self.bar, self.outage = host, logdir, bar, outage
        self.clock = clock
        self.abort = threading.Event()
        self.signum: Optional[int] = None
        self.started_at = time.time()

    @property
    def job(self) -> str:
        return self.config.rdzv.run_id

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def signal(self, signum: int) -> None:
        """A handled signal arrived: the first one is kept, and every wait ends. A second one
        (a second Ctrl-C) escalates: the workers get SIGKILL without their grace period."""
        if self.signum is None:
            self.signum = signum
        else:
            reaper.escalate()
        self.abort.set()

    def check_abort(self) -> None:
        """Raise ``SignalReceived`` once a signal arrived."""
        if self.abort.is_set():
            raise SignalReceived(self.signum or 0, "abort")

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when a signal cut it short."""
        return self.abort.wait(seconds)


class Mode(Protocol):
    """A way to run the node's workers (see the module docstring)."""

    def start(self) -> None: ...

    def tick(self) -> Optional[ModeOutcome]: ...

    def stop(self, cause: Optional[StopCause]) -> ModeOutcome: ...


@dataclass(frozen=True)
class RoundInfo:
    """A closed restart-mode round as one node sees it (its workers' ranks: ``env.worker_env``)."""

    round: int  # HSPMD_ROUND
    restart_count: int  # TORCHELASTIC_RESTART_COUNT
    participants: tuple[Participant, ...]  # in node order: the round's closing order
    assignment: RankAssignment  # this node's ranks (RANK, GROUP_RANK, WORLD_SIZE, ...)
