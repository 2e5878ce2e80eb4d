"""``PlanWatcher``: a worker's view of the job's plans. It follows the few bytes of
``plan/stamp`` and reads, once per plan, only what its switch needs.

A worker needs two things of the plans: to learn at once that a plan newer than its own exists
(every pending wait asks, lock-only: ``newer_than``), and, to switch, the plan's devices, drains,
store, step and strategy (``wait_newer``). Promises:

* a ``PrefixWatch`` on ``plan/stamp`` (``PlanStampRecord``: version, created_at, the digests of
  ``plan/current`` and ``plan/layout``, about 250 bytes) announces every plan; ``seen_at``
  tells when this process first saw each version;
* a plan is resolved only when ``wait_newer`` returns it, from the first source that holds it:
  the node's relay file (``contract.relay``: the ``plan/layout`` bytes its agent read once for
  the whole node; waited for up to ``relay_wait_s`` once the file exists), ``plan/layout`` in
  etcd, then ``plan/current`` in etcd. A source counts only when its bytes hash to the digest
  the stamp gives for it, so a worker never mixes two plans; a missing or stale source falls
  through to the next with a log line; ``sources`` counts what each plan was resolved from;
* a plan published without a stamp (a leader that predates stamps) is still found:
  ``read_plan_stamp`` compares the stamp's mod revision with ``plan/current``'s (one
  transaction writes both) and then returns the full record; the watcher reads it at start,
  on every ``poll_s`` of a ``wait_newer``, and about every ``recheck_s`` (one compare, no
  value) from a thread of its own; once it met such a plan it also watches ``plan/current``,
  the old behaviour, for the rest of its life (logged once). So an older leader that takes over
  mid-job is noticed at once by a worker that waits for a plan (a peer died), within about a
  minute by one that trains on;
* every etcd call has the client's deadline, every wait a timeout; an etcd error while
  resolving is logged and retried on the next poll, never raised to the caller;
* ``watch`` makes its watches (default ``PrefixWatch``; a seam for the scale bench, which
  carries thousands of simulated workers' watches on a few streams).
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import Any, Callable, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.relay import read_relay, relay_signature
from hspmd_elastic.coord import EtcdClient, PrefixWatch
from hspmd_elastic.coord.api import Compare, CompareTarget, CoordinationError, EventType, WatchEvent
from hspmd_elastic.coord.plans import layout_plan, plan_digest, plan_stamp, read_plan_stamp

log = logging.getLogger(__name__)

# How often (on average; each pause drawn from 0.5 to 1.5 times it, so that the workers of a
# job do not ask together) the thread compares plan/current's revision with the stamp's. A
# compare is cheap but not free: 8,000 workers every 60 s are 133 requests a second.
RECHECK_S = 60.0
RELAY_WAIT_S = 5.0  # how long a resolution waits for the agent to relay the plan (file exists)
RELAY_POLL_S = (0.005, 0.05)  # how often it looks at the relay file meanwhile: first, at most
_KEEP = 4  # resolved plans kept, newest versions

Announced = schema.PlanStampRecord

_decoded_lock = threading.Lock()
_decoded: "collections.OrderedDict[str, schema.PlanRecord]" = collections.OrderedDict()


def _record_of_layout(payload: bytes, digest: str) -> schema.PlanRecord:
    """The record of a layout whose bytes hash to ``digest``: decoded once per process
    (``RecordError``/``ValueError`` for a bad value)."""
    with _decoded_lock:
        hit = _decoded.get(digest)
    if hit is not None:
        return hit
    record = layout_plan(schema.decode_as(schema.PlanLayoutRecord, payload, "plan/layout"))
    with _decoded_lock:
        _decoded[digest] = record
        while len(_decoded) > 2:
            _decoded.popitem(last=False)
    return record


class PlanWatcher:
    """The newest published plan of ``job`` (see the module docstring). ``relay_file``: the
    node's relay file (``contract.relay.relay_file_of``; None: etcd only). ``watch(client,
    key, callback, decode=, initial=, name=)``: makes a watch with ``start(timeout)``,
    ``stop(timeout)`` and ``event_bytes``, as ``PrefixWatch`` does."""

    def __init__(self, client: EtcdClient, job: str, wall_clock: Callable[[], float] = time.time,
                 relay_file: Optional[str] = None, recheck_s: float = RECHECK_S,
                 relay_wait_s: float = RELAY_WAIT_S, watch: Callable[..., Any] = PrefixWatch):
        self.client, self.job, self.relay_file = client, job, relay_file
        self._make_watch = watch
        self._wall, self._recheck_s, self._relay_wait_s = wall_clock, recheck_s, relay_wait_s
        self._cond = threading.Condition()
        self._latest: Optional[Announced] = None
        self._revision = 0  # plan/current's mod revision behind _latest
        self._records: dict[int, schema.PlanRecord] = {}
        self._seen_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._legacy: Any = None  # the plan/current watch, once a plan came without a stamp
        self._thread: Optional[threading.Thread] = None
        self._said_no_relay = False
        self.sources: collections.Counter = collections.Counter()  # relay, layout, current
        self._source_of: dict[int, str] = {}  # the newest resolved versions -> their source
        self._watch = watch(client, schema.plan_stamp_key(job), self._on_stamp, decode=True,
                            initial=True, name=f"plan stamp watch {job}")

    # ------------------------------------------------------------------------ lifecycle
    def start(self, timeout: Optional[float] = None) -> "PlanWatcher":
        self._watch.start(timeout)
        self._recheck()  # a plan without a stamp is found here
        self._thread = threading.Thread(target=self._recheck_loop, daemon=True,
                                        name=f"plan recheck {self.job}")
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._watch.stop(timeout)
        with self._cond:
            legacy = self._legacy
        if legacy is not None:
            legacy.stop(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------ announcements
    def _on_stamp(self, event: WatchEvent) -> None:
        if event.type is EventType.PUT and isinstance(event.record, schema.PlanStampRecord):
            self._announce(event.record, event.revision)

    def _on_current(self, event: WatchEvent) -> None:
        if event.type is EventType.PUT and isinstance(event.record, schema.PlanRecord):
            self._announce(plan_stamp(event.record, event.value), event.revision, event.record)

    def _announce(self, stamp: Announced, revision: int,
                  record: Optional[schema.PlanRecord] = None) -> None:
        with self._cond:
            if self._latest is None or stamp.version > self._latest.version:
                self._latest, self._revision = stamp, revision
                self._seen_at.setdefault(stamp.version, self._wall())
                self._cond.notify_all()
            if record is not None and stamp.digest == self._latest.digest:
                self._keep(record)

    def _keep(self, record: schema.PlanRecord) -> None:
        self._records[record.version] = record
        for v in sorted(self._records)[:-_KEEP]:
            del self._records[v]

    @property
    def latest(self) -> Optional[Announced]:
        """The stamp of the newest plan known (it has ``version`` and ``created_at``)."""
        with self._cond:
            return self._latest

    def seen_at(self, version: int) -> Optional[float]:
        with self._cond:
            return self._seen_at.get(version)

    @property
    def watch_bytes(self) -> int:
        """Bytes etcd sent this watcher's watches for the changes they delivered."""
        with self._cond:
            legacy = self._legacy
        return self._watch.event_bytes + (legacy.event_bytes if legacy is not None else 0)

    def newer_than(self, version: int) -> Optional[Announced]:
        """The newest plan's stamp if its version is above ``version`` (lock-only)."""
        latest = self.latest
        return latest if latest is not None and latest.version > version else None

    # ------------------------------------------------------------------------ waiting
    def wait_newer(self, version: int, timeout: float,
                   poll_s: float = 1.0) -> Optional[schema.PlanRecord]:
        """Block until a plan newer than ``version`` is known and resolved (None after
        ``timeout`` seconds). Reads the stamp every ``poll_s`` in case the watch lost an event
        or a plan came without a stamp."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._latest is not None and self._latest.version > version,
                    max(0.0, min(poll_s, deadline - time.monotonic())))
                latest = self._latest
                stamp = latest if latest is not None and latest.version > version else None
            if stamp is not None:
                record = self._resolve(stamp, deadline)
                if record is not None:
                    return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._poll()
            if stamp is not None:  # not resolved (superseded, or etcd failed): no busy loop
                with self._cond:
                    self._cond.wait_for(lambda: self._latest.version > stamp.version,
                                        min(poll_s, remaining))

    def _poll(self) -> None:
        try:
            stamp, record, revision = read_plan_stamp(self.client, self.job)
        except CoordinationError as exc:
            log.warning("job %s: reading plan/stamp failed (%s); trying again later", self.job,
                        exc)
            return
        if stamp is None:
            return
        if record is not None:
            self._follow_current(record.version)
        self._announce(stamp, revision, record)

    def _follow_current(self, version: int) -> None:
        with self._cond:
            if self._legacy is not None or self._stop.is_set():
                return
            log.warning("job %s: plan v%d has no plan/stamp of its own (a leader that predates "
                        "stamps published it): watching plan/current too", self.job, version)
            self._legacy = self._make_watch(self.client, schema.plan_current_key(self.job),
                                            self._on_current, decode=True, initial=False,
                                            name=f"plan watch {self.job}")
            legacy = self._legacy
        try:
            legacy.start(self.client.timeout)
        except CoordinationError as exc:  # the reads still find every plan; the next retries
            log.warning("job %s: watching plan/current failed: %s", self.job, exc)
            with self._cond:
                self._legacy = None

    def _recheck_loop(self) -> None:
        rng = random.Random()
        while not self._stop.wait(self._recheck_s * rng.uniform(0.5, 1.5)):
            self._recheck()

    def _recheck(self) -> None:
        """``_poll`` unless ``plan/current`` is still the plan of the newest stamp (one compare
        of mod revisions, no value read)."""
        with self._cond:
            revision = self._revision
        if revision:
            try:
                if self.client.txn([Compare(schema.plan_current_key(self.job),
                                            CompareTarget.MOD, "==", revision)]).succeeded:
                    return
            except CoordinationError as exc:
                log.debug("job %s: plan recheck failed: %s", self.job, exc)
                return
        self._poll()

    # ------------------------------------------------------------------------ resolving
    def _resolve(self, stamp: Announced, deadline: float) -> Optional[schema.PlanRecord]:
        """The record ``stamp`` announces, from the first source that holds it (None: none
        does now; the caller polls again)."""
        with self._cond:
            record = self._records.get(stamp.version)
        if record is not None:
            return record
        source = ""
        if stamp.layout_digest:
            payload, source = self._from_relay(stamp, deadline), "relay"
            if payload is None:
                if self.newer_than(stamp.version) is not None:
                    return None  # superseded while waiting: the caller resolves the newer plan
                try:
                    payload, newer = self._layout_from_etcd(stamp)
                except CoordinationError as exc:  # not a reason to read the whole record
                    log.warning("job %s: reading plan/layout failed: %s", self.job, exc)
                    return None
                if newer:
                    return None
                source = "layout"
            if payload is not None:
                try:
                    record = _record_of_layout(payload, stamp.layout_digest)
                except (CoordinationError, ValueError) as exc:
                    log.warning("job %s: plan v%d: its layout does not decode (%s): reading "
                                "plan/current", self.job, stamp.version, exc)
        if record is None:
            record, source = self._current_from_etcd(stamp), "current"
        if record is None or record.version != stamp.version:
            return None
        with self._cond:
            self._keep(record)
            self._source_of[record.version] = source
            while len(self._source_of) > _KEEP:
                del self._source_of[min(self._source_of)]
        self.sources[source] += 1
        return record

    def source_of(self, version: int) -> str:
        """Where plan ``version`` was resolved from (relay, layout, current; "" when it was
        not, or is no longer kept)."""
        with self._cond:
            return self._source_of.get(version, "")

    def _from_relay(self, stamp: Announced, deadline: float) -> Optional[bytes]:
        path = self.relay_file
        if path is None:
            return None
        if relay_signature(path) is None:
            if not self._said_no_relay:
                self._said_no_relay = True
                log.info("job %s: no plan relay file at %s (the node agent does not relay "
                         "plans): reading plan/layout from etcd", self.job, path)
            return None
        until = min(deadline, time.monotonic() + self._relay_wait_s)
        last, held = None, f"nothing, not v{stamp.version}"
        pause, most = RELAY_POLL_S
        while True:
            sig = relay_signature(path)
            if sig is not None and sig != last:
                last = sig
                payload = read_relay(path)
                if payload is not None and plan_digest(payload) == stamp.layout_digest:
                    return payload
                held = _described(payload, stamp)
            newer = self.newer_than(stamp.version)
            if newer is not None:
                return None  # superseded while waiting: the caller resolves the newer plan
            if time.monotonic() >= until:
                log.warning("job %s: the plan relay file %s still holds %s after %.1fs: "
                            "reading plan/layout from etcd", self.job, path, held,
                            self._relay_wait_s)
                return None
            time.sleep(pause)
            pause = min(2 * pause, most)

    def _layout_from_etcd(self, stamp: Announced) -> tuple[Optional[bytes], bool]:
        """(the layout's bytes when they are the stamp's, whether a newer plan replaced it);
        ``CoordinationError`` when etcd cannot be read."""
        kv = self.client.get(schema.plan_layout_key(self.job))
        if kv is not None and plan_digest(kv.value) == stamp.layout_digest:
            return kv.value, False
        held = _layout_version(kv.value) if kv is not None else None
        if held is not None and held > stamp.version:
            return None, True  # resolve that one instead
        log.warning("job %s: plan/layout holds %s: reading plan/current", self.job,
                    _described(kv.value if kv is not None else None, stamp))
        return None, False

    def _current_from_etcd(self, stamp: Announced) -> Optional[schema.PlanRecord]:
        key = schema.plan_current_key(self.job)
        try:
            kv = self.client.get(key)
            record = schema.decode(key, kv.value) if kv is not None else None
        except CoordinationError as exc:
            log.warning("job %s: reading plan/current failed: %s", self.job, exc)
            return None
        if record is None:
            return None
        if plan_digest(kv.value) == stamp.digest:
            return record
        if record.version > stamp.version:  # newer: announce it, resolved already
            self._announce(plan_stamp(record, kv.value), kv.mod_revision, record)
        else:
            log.warning("job %s: plan/current holds v%d, whose digest is not the one "
                        "plan/stamp gives for v%d", self.job, record.version, stamp.version)
        return None


def _layout_version(payload: bytes) -> Optional[int]:
    """The version of a layout's bytes (None if they do not decode)."""
    try:
        return schema.decode_as(schema.PlanLayoutRecord, payload, "plan/layout").version
    except CoordinationError:
        return None


def _described(payload: Optional[bytes], stamp: Announced) -> str:
    """What a layout's bytes hold instead of ``stamp``'s plan, for a log line."""
    if payload is None:
        return f"nothing, not v{stamp.version}"
    version = _layout_version(payload)
    if version is None:
        return f"a value that does not decode, not v{stamp.version}"
    if version == stamp.version:
        return f"other bytes than plan/stamp gives for v{version}"
    return f"v{version}, not v{stamp.version}"
