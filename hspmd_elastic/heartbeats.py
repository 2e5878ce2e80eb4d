"""One line that lets any training script (torchrun's kind too) be watched for hangs.

``hspmd_elastic.heartbeat(step)`` once per training step: under ``hspmd-launch`` the worker's
``HSPMD_PROGRESS_FILE`` is set, and the call writes the step there (``contract.progress
.write_progress``: one JSON object, atomically by rename); the node agent reads the file and
feeds its hang detector. Outside an agent (no ``HSPMD_PROGRESS_FILE``) the call does nothing.
The report's plan version is the worker's ``HSPMD_ROUND`` (restart mode) or, under an elastic
agent, ``HSPMD_PLAN_VERSION`` (the plan it was started for); 0 outside an agent. The worker
environment is read through ``contract.env.WorkerEnv``; a bad round or plan version is logged
once and reported as 0 (the heartbeat still reaches the agent).

Promises: torch-free, no etcd and no network (only ``hspmd_elastic.contract`` is imported);
a call never raises for an I/O error (a heartbeat must not end training: the error is logged
once); the file is rewritten only when the step changed, and at most every ``min_interval_s``
(default 0.1 s), so a tight loop costs almost nothing; a step that repeats writes nothing (the
agent reads the same step as "no progress").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Mapping, Optional

from hspmd_elastic.contract.env import EnvError, WorkerEnv
from hspmd_elastic.contract.progress import WorkerProgress, write_progress

log = logging.getLogger(__name__)

DEFAULT_MIN_INTERVAL_S = 0.1


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "0") or 0)
    except ValueError:
        return 0


class Heartbeat:
    """The writer behind ``heartbeat``; one per process (``path`` None: from the environment)."""

    def __init__(self, path: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                 min_interval_s: float = DEFAULT_MIN_INTERVAL_S):
        env = os.environ if env is None else env
        try:
            worker = WorkerEnv.from_env(env, fields=("progress_file", "round", "plan_version"))
        except EnvError as exc:
            log.warning("heartbeat: %s; reporting plan version 0", exc)
            worker = WorkerEnv.from_env(env, fields=("progress_file",))
        self.path = path if path is not None else worker.progress_file
        self.rank = _int(env, "RANK")
        self.local_rank = _int(env, "LOCAL_RANK")
        self.round = next((v for v in (worker.round, worker.plan_version) if v is not None), 0)
        self.min_interval_s = float(min_interval_s)
        self._lock = threading.Lock()
        self._count = -1
        self._written: Optional[int] = None
        self._written_at = float("-inf")
        self._first: Optional[tuple[int, float]] = None
        self._failed = False

    def beat(self, step: Optional[int] = None) -> bool:
        """Record ``step`` (None: one more than the previous call); True when the file was
        written by this call."""
        with self._lock:
            self._count = self._count + 1 if step is None else int(step)
            if self.path is None or self._count == self._written:
                return False
            now = time.monotonic()
            if self._written is not None and now - self._written_at < self.min_interval_s:
                return False
            return self._write(self._count, now)

    def _write(self, step: int, now: float) -> bool:
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        rate = (step - first_step) / (now - first_t) if now > first_t else 0.0
        progress = WorkerProgress(pid=os.getpid(), global_rank=self.rank,
                                  local_rank=self.local_rank, plan_version=self.round,
                                  step=step, last_progress_at=time.time(),
                                  steps_per_s=max(rate, 0.0))
        try:
            write_progress(self.path, progress)
        except OSError as exc:
            if not self._failed:
                log.warning("heartbeat: cannot write %s (%s); hang detection sees no progress",
                            self.path, exc)
            self._failed = True
            return False
        self._failed = False
        self._written, self._written_at = step, now
        return True


_default: Optional[Heartbeat] = None
_default_lock = threading.Lock()


def heartbeat(step: Optional[int] = None) -> bool:
    """Tell the node agent this worker is at ``step`` (call once per training step; None
    counts the calls). Does nothing outside ``hspmd-launch``. True when the file was written."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Heartbeat()
        beat = _default
    return beat.beat(step)
