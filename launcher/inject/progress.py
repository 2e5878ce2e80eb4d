"""Where the harness reads a job's training progress: ``ProgressPoint``s from the JSON-lines
progress files a training script writes (``FileProgress``) or from the job's ``workers/``
records (``EtcdProgress``, fed by ``JobObserver``'s watch).

Promises: ``poll`` never raises and returns every point seen so far, oldest first; a line still
being written is read on a later poll; a point without a step, or with step 0, is no progress.
A file can hold a worker's progress report (``HSPMD_PROGRESS_FILE``), read by that format's one
reader, ``hspmd_elastic.contract.progress.progress_from_dict``; any other object is a harness
line (``step``, ``round``, ``rank``, ``t``, optional ``batch``).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import Optional, Protocol

from hspmd_elastic.contract.progress import progress_from_dict
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import EventType, WatchEvent
from launcher.inject.api import ProgressPoint


class ProgressSource(Protocol):
    def poll(self) -> list[ProgressPoint]:
        """Every progress point known so far (new ones appended), never raises."""


def _point(body: dict, default_t: float) -> Optional[ProgressPoint]:
    report = progress_from_dict(body, 0)
    if report is not None:  # a worker's progress report (the progress file's format)
        return ProgressPoint(report.global_rank, report.plan_version, report.step,
                             report.last_progress_at)
    try:  # a harness line
        rank = int(body.get("rank", 0))
        rnd = int(body.get("round", 0))
        step = int(body["step"])
        t = float(body.get("t", default_t))
        batch = body.get("batch")
        return ProgressPoint(rank, rnd, step, t, int(batch) if batch is not None else None)
    except (KeyError, TypeError, ValueError):
        return None


class FileProgress:
    """Progress from files matching a glob: JSON lines (one object per completed step: ``step``
    completed, ``round``, ``rank``, ``t``, optional ``batch``) or a worker's progress file
    (``HSPMD_PROGRESS_FILE``: one report rewritten by rename, ``contract.progress``). Each poll
    reads only what was appended since the last one (a file replaced by a rename is read again
    from its start)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._points: dict[tuple[int, int, int], ProgressPoint] = {}
        self._read: dict[str, tuple[int, int]] = {}  # path -> (inode, offset of the next line)

    def poll(self) -> list[ProgressPoint]:
        now = time.time()
        for path in sorted(glob.glob(self.pattern)):
            for line in self._new_lines(path):
                try:
                    body = json.loads(line)
                except ValueError:
                    continue
                p = _point(body, now) if isinstance(body, dict) else None
                if p is not None and p.step > 0:
                    self._points.setdefault((p.rank, p.round, p.step), p)
        return sorted(self._points.values(), key=lambda p: p.t)

    def _new_lines(self, path: str) -> list[str]:
        try:
            with open(path, "rb") as fh:
                inode = os.fstat(fh.fileno()).st_ino
                seen_inode, offset = self._read.get(path, (inode, 0))
                if seen_inode != inode:
                    offset = 0
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return []
        complete = data.rfind(b"\n") + 1  # a line still being written waits for next time
        if complete == 0 and data.strip().startswith(b"{") and data.strip().endswith(b"}"):
            complete = len(data)  # one object without a newline (rewritten by rename)
        self._read[path] = (inode, offset + complete)
        return data[:complete].decode("utf-8", "replace").splitlines()


class EtcdProgress:
    """Progress from the job's ``workers/`` records (``step``, ``plan_version``), as the agent
    publishes its workers' heartbeats."""

    def __init__(self) -> None:
        self._points: dict[tuple[int, int, int], ProgressPoint] = {}
        self._lock = threading.Lock()

    def on_worker(self, ev: WatchEvent) -> None:
        rec = ev.record
        if ev.type is EventType.PUT and isinstance(rec, schema.WorkerRecord) and rec.step > 0:
            p = ProgressPoint(rec.global_rank, rec.plan_version, rec.step, rec.last_progress_at)
            with self._lock:
                self._points.setdefault((p.rank, p.round, p.step), p)

    def poll(self) -> list[ProgressPoint]:
        with self._lock:
            return sorted(self._points.values(), key=lambda p: p.t)


def default_progress(pattern: Optional[str]) -> Optional[ProgressSource]:
    """``--progress`` value -> source (None: the workers' etcd records)."""
    if not pattern:
        return None
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "*")
    return FileProgress(pattern)
