"""One line that lets any training script (torchrun's kind too) be watched for hangs.

``hspmd_elastic.heartbeat(step)`` once per training step: under ``hspmd-launch`` the worker's
``HSPMD_PROGRESS_FILE`` is set, and the call writes the step there (``coord.contract
.write_progress``: one JSON object, atomically by rename); the node agent reads the file and
feeds its hang detector. Outside an agent (no ``HSPMD_PROGRESS_FILE``) the call does nothing.

Promises: torch-free, no etcd and no network (the contract module is imported on the first
call that writes); a call never raises for an I/O error (a heartbeat must not end training:
the error is logged once); the file is rewritten only when the step changed, and at most every
``min_interval_s`` (default 0.1 s), so a tight loop costs almost nothing; a step that repeats
writes nothing (the agent reads the same step as "no progress").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Mapping, Optional

log = logging.getLogger(__name__)

PROGRESS_FILE_ENV = "HSPMD_PROGRESS_FILE"  # the same name as coord.contract.PROGRESS_FILE_ENV
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
        self.path = path if path is not None else env.get(PROGRESS_FILE_ENV, "") or None
        self.rank = _int(env, "RANK")
        self.local_rank = _int(env, "LOCAL_RANK")
        self.round = _int(env, "HSPMD_ROUND")
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
        from hspmd_elastic.coord.contract import WorkerProgress, write_progress

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
