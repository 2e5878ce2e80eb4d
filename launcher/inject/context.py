"""What every fault acts through and answers with: ``InjectContext`` (the job's etcd, the etcd
members and network topology the harness owns, and every process it stopped or started and every
link it cut, undone by ``close``), ``FaultAction`` (the base of the faults: ``inject(ctx)``),
``Injection`` (what a fault did) and ``Timer`` (a follow-up it asked for).

The faults themselves live in ``faults.py`` and ``throttle.py``, which both build on this module
(and ``faults.py`` re-exports ``InjectContext``).

Promises: ``InjectContext.close`` heals every link the harness cut, resumes every process it
stopped, removes the CPU cgroups it made and stops and reaps every agent it started, each wait
bounded by ``timeout``; a signal goes only to a proven process (``psutil`` checks its pid was
not reused), and one already gone is ``TargetNotFound``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from hspmd_elastic.coord.client import EtcdClient
from launcher.inject.api import InjectError, TargetNotFound
from launcher.inject.detect import Injected
from launcher.inject.scenario import FaultSpec
from launcher.inject.targets import Refused, WorkerTarget
from launcher.inject.topology import NetTopology, cut_link

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0

def _launcher_argv() -> list[str]:
    script = Path(sys.executable).parent / "hspmd-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "launcher.cli"]


@dataclass
class InjectContext:
    """What faults act through: the job's etcd, the etcd members the harness owns (for
    ``etcd-restart``), the network topology (for ``partition``), and the processes the harness
    started or stopped and the links it cut (cleaned up by ``close``)."""

    client: EtcdClient
    job: str
    etcd_members: Sequence[Any] = ()
    etcd_restart_cmd: Optional[str] = None  # etcd-restart through the user's command
    etcd_restart_timeout_s: float = 60.0
    etcd_by_pid: bool = False  # etcd-restart may act on the process proven to serve the job
    log_dir: Optional[str] = None  # output of started agents (a temporary directory if None)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    launcher_argv: list[str] = field(default_factory=_launcher_argv)
    spawned: dict[str, subprocess.Popen] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    topology: Optional[NetTopology] = None
    cut: set[tuple[str, str, str]] = field(default_factory=set)  # (netns, device, mode) cut
    refusals: list[str] = field(default_factory=list)  # processes records named, not signalled
    procs: dict[int, psutil.Process] = field(default_factory=dict)  # proven targets, by pid
    cpu_quota: Any = None  # throttle.Quotas: the CPU cgroups throttle made, removed by close

    def set_links(self, netns: str, devices: Sequence[str], up: bool,
                  mode: str = "down") -> None:
        """Cut (``up`` False) or heal ``devices`` of ``netns`` in ``mode`` (down, drop)."""
        for dev in devices:
            cut_link(netns, dev, mode, cut=not up)
            (self.cut.discard if up else self.cut.add)((netns, dev, mode))
        log.info("[%s] links %s of %s %s", self.job, ",".join(devices), netns,
                 "healed" if up else "down (cut)" if mode == "down"
                 else "dropping every packet (cut)")

    @property
    def endpoints(self) -> str:
        return ",".join(self.client.endpoints)

    def signal(self, proc: psutil.Process, sig: signal.Signals) -> None:
        """Send ``sig`` to a proven target (psutil checks its pid was not reused); a process
        already gone raises TargetNotFound."""
        pid = proc.pid
        self.procs[pid] = proc
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, ProcessLookupError) as exc:
            raise TargetNotFound(f"process {pid} of job {self.job} is gone") from exc
        except psutil.AccessDenied as exc:
            raise Refused(f"process {pid} of job {self.job}: permission denied") from exc
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig in (signal.SIGCONT, signal.SIGKILL):
            self.stopped.discard(pid)
        log.info("[%s] sent %s to pid %d", self.job, sig.name, pid)
        self.reap()

    def reap(self) -> None:
        for proc in self.spawned.values():
            proc.poll()

    def close(self, timeout: float = STOP_GRACE_S) -> None:
        """Heal the links it cut, resume what it stopped; stop and reap the agents it
        started."""
        if self.cpu_quota is not None:
            self.cpu_quota.close()
        for netns, dev, mode in sorted(self.cut):
            try:
                self.set_links(netns, [dev], up=True, mode=mode)
            except InjectError as exc:
                log.warning("[%s] healing a cut link: %s", self.job, exc)
        for pid in sorted(self.stopped):
            try:
                if pid in self.procs:
                    self.procs[pid].send_signal(signal.SIGCONT)
                else:
                    os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, psutil.Error):
                pass
        self.stopped.clear()
        live = [p for p in self.spawned.values() if p.poll() is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in live:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("[%s] agent pid %d ignored SIGTERM; killing it", self.job, proc.pid)
                proc.kill()
                proc.wait(timeout=timeout)


@dataclass
class Timer:
    """A follow-up action ``after_s`` seconds after the injection (resume, thaw, escalate)."""

    after_s: float
    label: str
    action: Callable[[], None]
    only_if_undetected: bool = False
    ends_fault: bool = False
    done: bool = False


@dataclass
class Injection:
    injected: Injected
    detail: dict[str, Any] = field(default_factory=dict)
    timers: list[Timer] = field(default_factory=list)


class FaultAction:
    """Base of the faults: ``inject(ctx)`` applies the fault now and says what it did."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec

    def inject(self, ctx: InjectContext) -> Injection:
        raise NotImplementedError

def worker_dict(w: WorkerTarget) -> dict[str, Any]:
    """The report's target of a worker fault."""
    return {"node": w.node, "local_rank": w.local_rank, "rank": w.rank}
