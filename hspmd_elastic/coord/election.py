"""Leader election over etcd (the lease + create-revision recipe) with fenced leader writes.

Each candidate owns ``<job>/election/<lease-hex>``, bound to its session's lease. The candidate
whose key has the lowest create revision leads; every other candidate waits for the deletion of
its predecessor (the next-lower create revision) or of its own key, then re-reads. Promises:

* at most one candidate believes it leads at a time, up to the moment its key is deleted; a
  deposed leader cannot write shared state, because every leader-only write (``fenced_put``,
  ``fenced_txn``) is a transaction that compares the leader's own election key's create revision
  and is rejected with ``FencedWriteRejected`` once that key is gone;
* the leader writes ``<job>/leader`` (a ``LeaderRecord``, fenced, under its lease);
* ``on_change(bool)`` is called when leadership is gained or lost (on the election thread, or on
  the session's thread when its lease is lost: a lost lease drops leadership at once); the
  candidate then re-joins the line with the new lease;
* the loop is level-triggered: besides predecessor deletions it re-reads every ``recheck_s``;
  every call is bounded by the client's deadline, every wait by a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import (
    Compare,
    CompareTarget,
    CoordinationError,
    DeleteOp,
    EventType,
    FencedWriteRejected,
    GetOp,
    LeaseLostError,
    PutOp,
    TxnResult,
    WatchEvent,
)
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.watch import PrefixWatch

log = logging.getLogger(__name__)

ChangeCallback = Callable[[bool], None]
_MAX_REMEMBERED_DELETES = 1024


class Election:
    """One candidate of ``job``'s leader election, named ``node``, using ``session``'s lease."""

    def __init__(self, client: EtcdClient, session: LeasedSession, job: str, node: str,
                 on_change: Optional[ChangeCallback] = None, recheck_s: float = 1.0,
                 wall_clock: Callable[[], float] = time.time):
        self.client = client
        self.session = session
        self.job = job
        self.node = node
        self.prefix = schema.election_prefix(job)
        self.leader_key = schema.leader_key(job)
        self._on_change = on_change
        self._recheck_s = recheck_s
        self._wall = wall_clock
        self._cond = threading.Condition()  # guards the fields below
        self._key: Optional[str] = None
        self._rev = 0  # create revision of our key; the fence of our leader writes
        self._leading = False
        self._interest: set[str] = set()
        self._deleted: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch: Optional[PrefixWatch] = None
        session.add_listener(on_lost=self._session_lost, on_regranted=lambda _id: self._wake.set())

    # ------------------------------------------------------------------ public API
    @property
    def is_leader(self) -> bool:
        with self._cond:
            return self._leading

    @property
    def term(self) -> int:
        """Create revision of our election key while leading (0 otherwise)."""
        with self._cond:
            return self._rev if self._leading else 0

    @property
    def candidate_key(self) -> Optional[str]:
        with self._cond:
            return self._key

    def campaign(self, timeout: float) -> bool:
        """Join the election (once) and wait up to ``timeout`` seconds to lead; True if leading.

        On timeout the candidate stays in line; call again to keep waiting, ``resign()`` to
        leave. Raises a CoordinationError when etcd cannot be reached to join."""
        self._ensure_running()
        with self._cond:
            self._cond.wait_for(lambda: self._leading, timeout)
            return self._leading

    def leader(self) -> Optional[str]:
        """Node id of the current leader (lowest create revision), or None without candidates."""
        snap = self.client.get_prefix(self.prefix)
        if not len(snap):
            return None
        first = min(snap, key=lambda kv: kv.create_revision)
        return schema.decode(first.key, first.value).node

    def fenced_txn(self, compare: Sequence[Compare] = (), success: Sequence = ()) -> TxnResult:
        """``compare -> success`` only while we lead; FencedWriteRejected once deposed."""
        with self._cond:
            key, rev = self._key, self._rev if self._leading else 0
        if not key or not rev:
            raise FencedWriteRejected(key or self.prefix, rev, f"{self.node} does not lead")
        return self.client.fenced_txn(key, rev, compare, success)

    def fenced_put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Put ``key`` only while we lead; returns the revision of the write."""
        data = value.encode("utf-8") if isinstance(value, str) else value
        return self.fenced_txn((), [PutOp(key, data, lease)]).revision

    def resign(self, timeout: float = 5.0) -> None:
        """Leave the election: stop the loop, delete our key (and the leader key if ours)."""
        self._stop_loop(timeout)
        with self._cond:
            key, rev, leading = self._key, self._rev, self._leading
        if leading and rev:
            try:
                self.client.fenced_txn(key, rev, (), [DeleteOp(self.leader_key)])
            except CoordinationError as exc:
                log.info("election %s: %s: leader key not cleared: %s", self.job, self.node, exc)
        if key:
            try:
                self.client.delete(key)
            except CoordinationError as exc:
                log.warning("election %s: %s: could not delete %s: %s", self.job, self.node,
                            key, exc)
        with self._cond:
            self._key, self._rev = None, 0
        self._set_leading(False)

    close = resign

    # ------------------------------------------------------------------ loop
    def _ensure_running(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._stop.clear()
            thread = threading.Thread(target=self._run, name=f"election-{self.node}",
                                      daemon=True)
            self._thread = thread
        try:
            self.session.start()
            self._watch = PrefixWatch(self.client, self.prefix, self._on_event,
                                      name=f"election watch {self.node}").start()
        except BaseException:
            with self._cond:
                self._thread = None
            raise
        thread.start()

    def _stop_loop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if self._watch is not None:
            self._watch.stop(timeout)
            self._watch = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._step()
            except CoordinationError as exc:
                log.info("election %s: %s: %s; retrying", self.job, self.node, exc)
            except Exception:  # noqa: BLE001 - the election thread must survive
                log.exception("election %s: %s: unexpected error", self.job, self.node)
            self._wake.wait(self._recheck_s)

    def _step(self) -> None:
        lease = self.session.lease_id
        if lease is None:
            self._set_leading(False)
            return
        key, rev = self._ensure_candidate(lease)
        snap = self.client.get_prefix(self.prefix)
        line = sorted(snap, key=lambda kv: kv.create_revision)
        mine = next((i for i, kv in enumerate(line) if kv.key == key), None)
        if mine is None or line[mine].create_revision != rev:
            log.info("election %s: %s: candidate key %s vanished", self.job, self.node, key)
            with self._cond:
                self._rev = 0
            self._set_leading(False)
            self._wake.set()
            return
        if mine == 0:
            self._lead(key, rev, lease)
            self._watch_for({key}, snap.revision)
        else:
            self._set_leading(False)
            self._watch_for({line[mine - 1].key, key}, snap.revision)

    def _ensure_candidate(self, lease: int) -> tuple[str, int]:
        """Our key under the current lease, created if needed: (key, create revision)."""
        key = schema.election_key(self.job, lease)
        with self._cond:
            if self._key == key and self._rev:
                return key, self._rev
        value = schema.CandidateRecord(node=self.node, at=self._wall()).to_json()
        res = self.client.txn(
            [Compare(key, CompareTarget.CREATE, "==", 0)],
            [PutOp(key, value, lease), GetOp(key)],
            [GetOp(key)],
        )
        kv = res.gets[0] if res.gets else None
        if kv is None:
            raise LeaseLostError(lease, f"candidate key {key} was not created")
        with self._cond:
            self._key, self._rev = key, kv.create_revision
        log.info("election %s: %s is a candidate (%s, revision %d)", self.job, self.node, key,
                 kv.create_revision)
        return key, kv.create_revision

    def _lead(self, key: str, rev: int, lease: int) -> None:
        if self.is_leader:
            return
        record = schema.LeaderRecord(node=self.node, since=self._wall(), candidate_key=key,
                                     term=rev)
        try:
            self.client.fenced_put(key, rev, self.leader_key, record.to_json(), lease=lease)
        except FencedWriteRejected:
            self._set_leading(False)
            self._wake.set()
            return
        self._set_leading(True)

    def _watch_for(self, keys: set[str], read_revision: int) -> None:
        """Wake on deletion of any of ``keys``; also if one was deleted after our read."""
        with self._cond:
            self._interest = keys
            missed = any(self._deleted.get(k, 0) > read_revision for k in keys)
        if missed:
            self._wake.set()

    def _on_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.DELETE:
            return
        with self._cond:
            if len(self._deleted) >= _MAX_REMEMBERED_DELETES:
                self._deleted.clear()
            self._deleted[event.key] = event.revision
            relevant = event.key in self._interest
        if relevant:
            self._wake.set()

    def _session_lost(self, err: LeaseLostError) -> None:
        with self._cond:
            self._rev = 0
        self._set_leading(False)
        self._wake.set()

    def _set_leading(self, leading: bool) -> None:
        with self._cond:
            changed = leading != self._leading
            self._leading = leading
            term = self._rev
            self._cond.notify_all()
        if not changed:
            return
        if leading:
            log.info("election %s: %s leads (term %d)", self.job, self.node, term)
        else:
            log.info("election %s: %s no longer leads", self.job, self.node)
        if self._on_change is not None:
            try:
                self._on_change(leading)
            except Exception:  # noqa: BLE001
                log.exception("election %s: on_change callback failed", self.job)
