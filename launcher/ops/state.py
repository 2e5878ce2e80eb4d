"""Reading a job's state from etcd: one-shot (``read_view``) or kept current (``JobStateCache``).

Promises:

* read-only: nothing here writes, deletes or leases anything in etcd;
* ``read_view`` is one linearizable prefix read; ``JobNotFoundError`` when the prefix is empty,
  ``EtcdUnreachableError`` (chained) when etcd cannot be read within the timeout;
  ``require_job`` is the same decision from a count (every command that acts on a job by id
  refuses an unknown one at once with the same line);
* ``JobStateCache`` holds the job's records from ONE ``PrefixWatch`` on the job prefix (list,
  then watch; after a compaction the watch resyncs from a full read, so the cache converges to
  etcd again): it never polls; every applied change bumps ``version`` and wakes
  ``wait_changed``; ``view()`` builds the pure ``JobView`` from the cache, once per version;
* the cache also keeps what a snapshot cannot show: a bounded series of (time, steps/s, step)
  samples taken whenever the workers' progress changes, and the leader terms it has seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from hspmd_elastic.coord import PrefixWatch
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError, EventType, RecordError, WatchEvent
from hspmd_elastic.coord.client import EtcdClient

from launcher.ops.api import EtcdUnreachableError, JobNotFoundError, THROUGHPUT_SAMPLES
from launcher.ops.view import JobView, decode_pairs, job_rate

log = logging.getLogger(__name__)

WallClock = Callable[[], float]


def require_job(client: EtcdClient, job: str, timeout: Optional[float] = None) -> int:
    """How many keys the job has: ``JobNotFoundError`` when none (a wrong id, or a job not
    started), ``EtcdUnreachableError`` (chained) when etcd cannot be read."""
    prefix = schema.job_prefix(job)
    try:
        count = client.count_prefix(prefix, timeout=timeout)
    except CoordinationError as exc:
        raise EtcdUnreachableError(f"cannot read {prefix} from etcd: {exc}") from exc
    if not count:
        raise JobNotFoundError(job, prefix)
    return count


def read_view(client: EtcdClient, job: str, timeout: Optional[float] = None,
              wall_clock: WallClock = time.time) -> JobView:
    """The job's view from one prefix read."""
    prefix = schema.job_prefix(job)
    try:
        snap = client.get_prefix(prefix, timeout=timeout)
    except CoordinationError as exc:
        raise EtcdUnreachableError(f"cannot read {prefix} from etcd: {exc}") from exc
    if not len(snap):
        raise JobNotFoundError(job, prefix)
    good, bad = decode_pairs((kv.key, kv.value) for kv in snap)
    return JobView.build(job, good, now=wall_clock(), revision=snap.revision, bad=bad)


class JobStateCache:
    """The job's records kept current from a watch on its prefix."""

    def __init__(self, client: EtcdClient, job: str, wall_clock: WallClock = time.time,
                 max_samples: int = THROUGHPUT_SAMPLES):
        self.job = job
        self.prefix = schema.job_prefix(job)
        self._client = client
        self._wall = wall_clock
        self._records: dict[str, schema.Record] = {}
        self._bad: dict[str, str] = {}
        self._revision = 0
        self._version = 0
        self._samples: deque = deque(maxlen=max_samples)
        self._last_progress: Optional[tuple] = None
        self._terms: set[int] = set()
        self._resyncs = 0
        self._cond = threading.Condition()
        self._view: Optional[tuple[int, JobView]] = None
        self._watch = PrefixWatch(client, self.prefix, self._on_event, initial=True,
                                  on_error=self._on_error, name=f"ops watch {job}")

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: Optional[float] = None) -> "JobStateCache":
        """Load the prefix and start watching; EtcdUnreachableError if etcd does not answer."""
        try:
            self._watch.start(timeout)
        except CoordinationError as exc:
            raise EtcdUnreachableError(f"cannot watch {self.prefix}: {exc}") from exc
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._watch.stop(timeout)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> "JobStateCache":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ reading
    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def empty(self) -> bool:
        """Whether the job's prefix holds no key (a wrong job id, or a job not started yet)."""
        with self._cond:
            return not self._records and not self._bad

    @property
    def resyncs(self) -> int:
        """How many times the watch had to resync from a full read (compaction)."""
        with self._cond:
            return self._resyncs

    def wait_changed(self, after: int, timeout: float) -> int:
        """Block until ``version > after`` or ``timeout`` seconds; returns the version."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._version <= after:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._version

    def view(self) -> JobView:
        """The current ``JobView`` (built once per change)."""
        with self._cond:
            if self._view is not None and self._view[0] == self._version:
                return self._view[1]
            version = self._version
            records = sorted(self._records.items())
            bad = sorted(self._bad.items())
            revision, samples, terms = self._revision, list(self._samples), len(self._terms)
        view = JobView.build(self.job, records, now=self._wall(), revision=revision, bad=bad,
                             samples=samples, leader_changes=terms)
        with self._cond:
            if self._version == version:
                self._view = (version, view)
        return view

    # ------------------------------------------------------------------ watch callbacks
    def _on_error(self, err: CoordinationError) -> None:
        if not isinstance(err, RecordError):
            with self._cond:
                self._resyncs += 1
            log.info("[%s] dashboard state: %s", self.job, err)

    def _on_event(self, event: WatchEvent) -> None:
        with self._cond:
            self._apply(event)
            self._revision = max(self._revision, event.revision)
            self._version += 1
            self._cond.notify_all()

    def _apply(self, event: WatchEvent) -> None:
        key = event.key
        if event.type is EventType.DELETE:
            self._records.pop(key, None)
            self._bad.pop(key, None)
        else:
            try:
                record = schema.decode(key, event.value)
            except RecordError as exc:
                self._records.pop(key, None)
                self._bad[key] = exc.problem
                return
            self._bad.pop(key, None)
            self._records[key] = record
            if isinstance(record, schema.LeaderRecord):
                self._terms.add(record.term)
        if key.startswith(self.prefix + "workers/"):
            self._sample()

    def _sample(self) -> None:
        """Append a throughput sample when the workers' progress changed."""
        workers = [r for r in self._records.values() if isinstance(r, schema.WorkerRecord)]
        rate = job_rate([(w.step, w.steps_per_s) for w in workers]) or 0.0
        step = max((w.step for w in workers), default=0)
        progress = (rate, step, len(workers))
        if progress == self._last_progress:
            return
        self._last_progress = progress
        self._samples.append((round(self._wall(), 3), rate, step))
