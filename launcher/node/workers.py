"""Worker processes of one node: spawn, monitor, signal, stop, reap.

Promises:

* every worker runs in its own session (so a terminal's Ctrl-C reaches only the agent, which
  forwards it) and dies with the agent: it gets SIGKILL from the kernel if the agent dies first
  (``PR_SET_PDEATHSIG``, set by an exec shim), so a SIGKILLed agent leaves no orphan;
* ``poll()`` is level-triggered: it reports the state of every worker from ``waitpid`` and
  psutil (exit code, or ``-signum`` for a signal, like Popen), whatever was missed before;
* every worker's process group is also registered with the agent's guard process
  (``launcher.node.reaper``), which SIGKILLs the whole group, the worker's own children
  included, when the agent dies in any way;
* ``stop()`` sends the signal (SIGTERM by default) to each worker's process group and to every
  descendant found by psutil, waits up to the grace period, then SIGKILLs what is left and reaps
  it; it returns only when no process of the group is alive (or after the kill deadline, logging
  the survivors by pid); a second interrupt (``reaper.escalate``) cuts the grace period short;
* nothing here talks to etcd; the agent records what this module reports.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil

from hspmd_elastic.contract.env import CGROUP_PROCS_ENV
from launcher.api import WorkerSpawnError
from launcher.logs import WorkerLogPaths, open_console_tails
from launcher.node import reaper

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0

# Workers die with the agent: a tiny exec shim asks the kernel for SIGKILL when the agent dies
# (PR_SET_PDEATHSIG survives exec), checks the agent is still its parent, then execs the real
# command in place (same pid). A preexec_fn would do it without the shim, but a fork that runs
# Python in the child trips the fork handlers of the agent's gRPC threads (etcd client) and
# can abort the child; without preexec_fn, subprocess forks with vfork and runs no handlers.
# With CGROUP_PROCS_ENV in its environment (a worker's memory cgroup, made beforehand: elastic
# memory.py) the shim joins that cgroup first, so all the worker allocates is charged to it.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(137)\n"
    f"cg = os.environ.pop({CGROUP_PROCS_ENV!r}, '')\n"
    "cg and os.write(os.open(cg, os.O_WRONLY), str(os.getpid()).encode())\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: tuple[str, ...]) -> list[str]:
    """``argv`` wrapped so that the process gets SIGKILL when this (agent) process dies."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


class WorkerGroupState(enum.Enum):
    INIT = "init"
    HEALTHY = "healthy"  # all running (or some already exited 0)
    SUCCEEDED = "succeeded"  # all exited 0
    FAILED = "failed"  # at least one exited non-zero or by a signal
    STOPPED = "stopped"  # stopped by the agent


@dataclass
class Worker:
    local_rank: int
    global_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    logs: WorkerLogPaths
    proc: Optional[subprocess.Popen] = None
    exitcode: Optional[int] = None
    exited_at: Optional[float] = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1


@dataclass
class WorkerGroup:
    """The workers of one round on this node."""

    role: str
    workers: list[Worker]
    state: WorkerGroupState = WorkerGroupState.INIT
    _files: list = field(default_factory=list)
    _tail_stop: threading.Event = field(default_factory=threading.Event)
    _tails: list = field(default_factory=list)

    # ------------------------------------------------------------------------------- start
    def start(self) -> None:
        self._tails = open_console_tails(
            self.role, {w.local_rank: w.logs for w in self.workers}, self._tail_stop
        )
        try:
            for w in self.workers:
                self._spawn(w)
        except BaseException:
            self.stop(signal.SIGKILL, grace_s=0.0)
            raise
        self.state = WorkerGroupState.HEALTHY

    def _stream(self, path: Optional[str], console: bool):
        if path is not None:
            f = open(path, "ab", buffering=0)
            self._files.append(f)
            return f
        return None if console else subprocess.DEVNULL

    def _spawn(self, w: Worker) -> None:
        stdout = self._stream(w.logs.stdout, w.logs.console)
        stderr = self._stream(w.logs.stderr, w.logs.console)
        try:
            w.proc = subprocess.Popen(
                die_with_parent(w.argv), env=w.env, stdout=stdout, stderr=stderr,
                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            raise WorkerSpawnError(f"cannot start worker {w.local_rank}: "
                                   f"{' '.join(w.argv)}: {exc}") from exc
        reaper.guard_group(w.proc.pid)  # its whole tree dies with the agent, SIGKILL included
        log.debug("started worker local_rank=%s rank=%s pid=%s", w.local_rank, w.global_rank,
                  w.proc.pid)

    # ----------------------------------------------------------------------------- monitor
    def poll(self) -> WorkerGroupState:
        """Refresh every worker's exit status and return the group's state."""
        if self.state in (WorkerGroupState.INIT, WorkerGroupState.STOPPED):
            return self.state
        for w in self.workers:
            if w.exitcode is None and w.proc is not None:
                code = w.proc.poll()
                if code is None and _is_zombie(w.proc.pid):
                    code = w.proc.wait(timeout=1.0)
                if code is not None:
                    w.exitcode, w.exited_at = code, time.time()
        if any(w.exitcode not in (None, 0) for w in self.workers):
            self.state = WorkerGroupState.FAILED
        elif all(w.exitcode == 0 for w in self.workers):
            self.state = WorkerGroupState.SUCCEEDED
            self.finish_logs()
        else:
            self.state = WorkerGroupState.HEALTHY
        return self.state

    def failed_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.exitcode not in (None, 0)]

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.proc is not None]

    # -------------------------------------------------------------------------------- stop
    def signal_all(self, signum: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                _signal_tree(w.proc.pid, signum)

    def stop(self, signum: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """Signal, wait up to ``grace_s``, SIGKILL the rest, reap. Idempotent.

        Each worker leads its own process group, so signalling the group also reaches
        descendants that outlived their worker; descendants that left the group are found
        by psutil while their worker is alive.
        """
        procs = [w.proc for w in self.workers if w.proc is not None]
        groups = [p.pid for p in procs]
        tree = [d for d in _descendants(procs) if _pgid(d) not in groups]
        if not _anything_alive(procs, groups, tree):
            self._settle(groups)
            return
        log.info("stopping %d worker(s) with %s (grace %.1fs)",
                 sum(p.poll() is None for p in procs), signal.Signals(signum).name, grace_s)
        _signal_all(groups, tree, signum)
        if not _wait_quiet(procs, groups, tree, time.monotonic() + grace_s):
            log.warning("sending SIGKILL to what is still alive after %.1fs", grace_s)
            _signal_all(groups, tree, signal.SIGKILL)
            if not _wait_quiet(procs, groups, tree, time.monotonic() + KILL_WAIT_S,
                                   hurry=False):
                log.error("processes survived SIGKILL: %s",
                          [p.pid for p in procs if p.poll() is None]
                          + [d.pid for d in tree if _alive(d)])
                self._settle([g for g in groups if not _group_alive(g)])
                return
        self._settle(groups)

    def _settle(self, reaped: list[int]) -> None:
        for pgid in reaped:
            reaper.release_group(pgid)
        for w in self.workers:
            if w.proc is not None and w.exitcode is None:
                w.exitcode, w.exited_at = w.proc.poll(), time.time()
        self.state = WorkerGroupState.STOPPED
        self.finish_logs()

    def finish_logs(self) -> None:
        """Stop copying the workers' output to the console and close their log files (when
        every worker of the group has exited, or the group is stopped)."""
        self._tail_stop.set()
        for t in self._tails:
            t.join(timeout=2.0)
        self._tails = []
        for f in self._files:
            try:
                f.close()
            except OSError:
                pass
        self._files = []


# ----------------------------------------------------------------------------------- helpers
def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    found = []
    for p in procs:
        if p.poll() is not None:
            continue
        try:
            found.extend(psutil.Process(p.pid).children(recursive=True))
        except psutil.Error:
            pass
    return found


def _group_alive(pgid: int) -> bool:
    """A live (non-zombie) process is in group ``pgid``: zombies of orphans whose reaper is
    slow (or absent, in some containers) do not count."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _anything_alive(procs: list[subprocess.Popen], groups: list[int],
                    tree: list[psutil.Process]) -> bool:
    return (any(p.poll() is None for p in procs) or any(_group_alive(g) for g in groups)
            or any(_alive(d) for d in tree))


def _signal_all(groups: list[int], tree: list[psutil.Process], signum: int) -> None:
    for pgid in groups:
        _signal_tree(pgid, signum)
    for d in tree:
        _signal_proc(d, signum)


def _wait_quiet(procs: list[subprocess.Popen], groups: list[int], tree: list[psutil.Process],
                deadline: float, hurry: bool = True) -> bool:
    """Reap workers until nothing of theirs is alive (True) or the deadline (False)."""
    while True:
        if not _anything_alive(procs, groups, tree):
            return True
        if time.monotonic() >= deadline or (hurry and reaper.hurried()):  # 2nd Ctrl-C: KILL
            return False
        time.sleep(0.05)


def _signal_tree(pid: int, signum: int) -> None:
    """The worker's process group (its own session: pgid == pid), once; the worker alone when
    the group is gone."""
    try:
        os.killpg(pid, signum)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _pgid(p: psutil.Process) -> int:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return -1


def _signal_proc(p: psutil.Process, signum: int) -> None:
    try:
        p.send_signal(signum)
    except psutil.Error:
        pass
