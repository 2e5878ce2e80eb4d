"""Worker exits and the verdicts a node agent makes about its own slots.

Promises: a worker exit is a ``WorkerExit`` (exit code, or the killing signal); it is journaled
once as a ``failure`` event (``report_worker_exit``: pid, exit code, signal, device, plan
version) and fails its slot with a verdict of origin ``exit`` (so the leader does not
journal it again); ``SlotVerdicts`` keeps such verdicts (exits, hangs) sticky
and lets the worst of them and the health source's win.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.coord.journal import append_event
from launcher.health.api import DeviceState, Verdict

_SEVERITY = {DeviceState.HEALTHY: 0, DeviceState.DEGRADED: 1, DeviceState.SUSPECT: 2,
             DeviceState.FAILED: 3}


@dataclass(frozen=True)
class WorkerExit:
    """A worker process that ended: ``exitcode`` (None when killed) or ``signal``."""

    local_rank: int
    pid: int
    exitcode: Optional[int]
    signal: Optional[int] = None

    @classmethod
    def from_returncode(cls, local_rank: int, pid: int, returncode: int) -> "WorkerExit":
        if returncode < 0:
            return cls(local_rank, pid, None, -returncode)
        return cls(local_rank, pid, returncode, None)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"worker pid {self.pid} killed by {name}"
        return f"worker pid {self.pid} exited with code {self.exitcode}"

    def verdict(self, at: float = 0.0) -> Verdict:
        return Verdict.failed(self.describe(), at=at, origin=schema.VerdictOrigin.EXIT.value)


def report_worker_exit(client: EtcdClient, job: str, node: str, exit: WorkerExit,
                       plan_version: Optional[int] = None,
                       wall_clock: Callable[[], float] = time.time) -> schema.EventRecord:
    """Journal a worker exit as a ``failure`` event (pid, exit code, signal, device)."""
    return append_event(client, job, "failure", node, schema.FailureDetail(
        devices=[device_id(node, exit.local_rank)], reason=exit.describe(),
        plan_version=plan_version or 0,
        exits=[schema.ExitInfo(exit.local_rank, exit.pid, exit.exitcode, exit.signal)],
    ), wall_clock=wall_clock)


class SlotVerdicts:
    """Verdicts the agent itself made about its slots (worker exit, hang); sticky, worst wins
    over what the health source says."""

    def __init__(self) -> None:
        self._failed: dict[int, Verdict] = {}

    def fail(self, local_rank: int, verdict: Verdict) -> None:
        self._failed.setdefault(local_rank, verdict)

    def clear(self, local_rank: int) -> None:
        self._failed.pop(local_rank, None)

    def failed(self) -> dict[int, Verdict]:
        return dict(self._failed)

    def merged(self, source: Mapping[int, Verdict], slots: Iterable[int]) -> dict[int, Verdict]:
        """One verdict per slot (healthy when nobody says otherwise), the worst one winning."""
        out = {i: Verdict.healthy() for i in slots}
        for verdicts in (source, self._failed):
            for i, v in verdicts.items():
                if i not in out or _SEVERITY[v.state] >= _SEVERITY[out[i].state]:
                    out[i] = v
        return out
