"""Leases kept alive in the background, and sessions whose keys survive a lost lease.

etcd clients do not keep leases alive by themselves. Promises:

* ``KeepAlive`` refreshes one lease every TTL/3 on a daemon thread; it declares the lease lost
  when etcd says so (TTL <= 0, lease not found) or when no refresh succeeded for longer than the
  TTL (etcd unreachable), calls ``on_lost(LeaseLostError)`` once and stops;
* ``LeasedSession`` owns a lease and the keys put through it: on loss it calls its listeners,
  grants a new lease, re-creates every owned key under it (latest value) and calls the
  ``on_regranted`` listeners; ``stop()`` revokes the lease, deleting the owned keys;
* the decision "alive / unreachable / lost" is the pure ``LeaseTracker`` (injectable clock);
  every wait is bounded, every etcd call has a deadline, all state is guarded by locks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from hspmd_elastic.coord.api import Clock, CoordinationError, LeaseLostError, PutOp
from hspmd_elastic.coord.client import EtcdClient

log = logging.getLogger(__name__)

LostCallback = Callable[[LeaseLostError], None]
RegrantedCallback = Callable[[int], None]
_MIN_PERIOD_S = 0.05


class LeaseVerdict(enum.Enum):
    ALIVE = "alive"
    UNREACHABLE = "unreachable"  # no answer yet, but the lease may still be alive
    LOST = "lost"


@dataclass
class LeaseTracker:
    """Pure bookkeeping of one lease: when to refresh and when to give it up."""

    ttl: float
    last_ok: float

    @property
    def period(self) -> float:
        return max(self.ttl / 3.0, _MIN_PERIOD_S)

    def refreshed(self, now: float, granted_ttl: int) -> LeaseVerdict:
        if granted_ttl <= 0:
            return LeaseVerdict.LOST
        self.last_ok = now
        return LeaseVerdict.ALIVE

    def unreachable(self, now: float) -> LeaseVerdict:
        return LeaseVerdict.LOST if now - self.last_ok > self.ttl else LeaseVerdict.UNREACHABLE

    def next_delay(self, now: float, verdict: LeaseVerdict) -> float:
        """Seconds until the next refresh: a period when alive; sooner while unreachable, so
        the lease is declared lost close to its TTL."""
        if verdict is LeaseVerdict.ALIVE:
            return self.period
        left = self.ttl - (now - self.last_ok)
        return max(min(self.period / 2, left), _MIN_PERIOD_S)


def _safe_call(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a listener must not kill the keep-alive thread
        log.exception("lease listener %r failed", fn)


class KeepAlive:
    """Refresh ``lease_id`` every TTL/3 until stopped or lost (then ``on_lost`` is called)."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: float,
                 on_lost: Optional[LostCallback] = None, clock: Clock = time.monotonic):
        self.client = client
        self.lease_id = lease_id
        self.ttl = float(ttl)
        self._on_lost = on_lost
        self._clock = clock
        self.tracker = LeaseTracker(ttl=self.ttl, last_ok=clock())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[LeaseLostError] = None

    def tick(self) -> tuple[LeaseVerdict, Optional[LeaseLostError]]:
        """One refresh; returns the verdict and, when lost, the error describing why."""
        timeout = max(min(self.tracker.period, self.client.timeout), 0.2)
        try:
            granted = self.client.refresh(self.lease_id, timeout=timeout)
        except LeaseLostError as exc:
            return LeaseVerdict.LOST, LeaseLostError(self.lease_id, exc.reason)
        except CoordinationError as exc:
            verdict = self.tracker.unreachable(self._clock())
            if verdict is LeaseVerdict.LOST:
                return verdict, LeaseLostError(
                    self.lease_id, f"no refresh succeeded for over {self.ttl:g}s ({exc})"
                )
            log.debug("lease %016x refresh failed, retrying: %s", self.lease_id, exc)
            return verdict, None
        verdict = self.tracker.refreshed(self._clock(), granted)
        if verdict is LeaseVerdict.LOST:
            return verdict, LeaseLostError(self.lease_id, "etcd reports the lease expired")
        return verdict, None

    def next_delay(self, verdict: LeaseVerdict) -> float:
        return self.tracker.next_delay(self._clock(), verdict)

    def start(self) -> "KeepAlive":
        self._thread = threading.Thread(
            target=self._run, name=f"lease-{self.lease_id:016x}", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = self.tracker.period
        while not self._stop.wait(delay):
            verdict, err = self.tick()
            if verdict is LeaseVerdict.LOST:
                self.lost = err
                log.warning("%s", err)
                if self._on_lost is not None:
                    _safe_call(self._on_lost, err)
                return
            delay = self.next_delay(verdict)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop refreshing (the lease is not revoked) and join the thread within ``timeout``."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class LeasedSession:
    """A lease plus the keys written under it, re-created under a new lease after a loss.

    ``put`` starts the session on first use (granting the lease). ``on_lost`` is called with the
    ``LeaseLostError`` whenever the lease is lost; ``on_regranted`` with the new lease id once the
    owned keys exist again.
    """

    def __init__(self, client: EtcdClient, ttl: float = 5.0,
                 on_lost: Optional[LostCallback] = None,
                 on_regranted: Optional[RegrantedCallback] = None,
                 clock: Clock = time.monotonic, name: str = "session"):
        if ttl < 1:
            raise ValueError(f"lease ttl must be >= 1 second (etcd's minimum), got {ttl!r}")
        self.client = client
        self.ttl = float(ttl)
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below
        self._write_lock = threading.Lock()  # orders owned-key writes against re-creation
        self._owned: dict[str, bytes] = {}
        self._lease_id: Optional[int] = None
        self._keepalive: Optional[KeepAlive] = None
        self._needs_rewrite = False
        self._lost_listeners: list[LostCallback] = [on_lost] if on_lost else []
        self._regrant_listeners: list[RegrantedCallback] = [on_regranted] if on_regranted else []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.losses = 0

    # ------------------------------------------------------------------ public API
    @property
    def lease_id(self) -> Optional[int]:
        """The current lease id; None before start and while a lost lease is being replaced."""
        with self._lock:
            return self._lease_id

    @property
    def started(self) -> bool:
        return self._thread is not None

    def add_listener(self, on_lost: Optional[LostCallback] = None,
                     on_regranted: Optional[RegrantedCallback] = None) -> None:
        with self._lock:
            if on_lost:
                self._lost_listeners.append(on_lost)
            if on_regranted:
                self._regrant_listeners.append(on_regranted)

    def start(self) -> "LeasedSession":
        """Grant the lease and start refreshing it (idempotent). Raises CoordinationError."""
        with self._lock:
            if self._thread is not None:
                return self
            if self._stop.is_set():
                raise CoordinationError(f"{self.name}: session was stopped")
        lease_id = self.client.grant(int(round(self.ttl)))
        with self._lock:
            if self._thread is not None:  # lost a start race: keep the winner's lease
                self.client.revoke(lease_id)
                return self
            self._lease_id = lease_id
            self._keepalive = KeepAlive(self.client, lease_id, self.ttl, clock=self._clock)
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-lease",
                                            daemon=True)
            self._thread.start()
        log.info("%s: lease %016x granted (ttl %gs)", self.name, lease_id, self.ttl)
        return self

    def put(self, key: str, value: bytes | str) -> int:
        """Write an owned key under the session's lease; returns the write's revision.

        The key is remembered (latest value) and re-created after a lease loss. While the lease
        is being replaced this raises LeaseLostError; the value is still written once a new lease
        exists.
        """
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        if not self.started:
            self.start()
        with self._write_lock:
            with self._lock:
                self._owned[key] = data
                lease_id = self._lease_id
            if lease_id is None:
                raise LeaseLostError(None, f"{self.name}: no lease now; {key} is written when a "
                                     "new lease is granted")
            try:
                return self.client.put(key, data, lease=lease_id)
            except LeaseLostError:
                self._wake.set()  # let the keep-alive thread confirm and recover now
                raise

    def put_many(self, items: Mapping[str, bytes]) -> int:
        """``put`` for several owned keys in one transaction: one etcd revision, one raft
        proposal, however many keys. Returns the write's revision."""
        data = {k: (v.encode("utf-8") if isinstance(v, str) else bytes(v))
                for k, v in items.items()}
        if not self.started:
            self.start()
        with self._write_lock:
            with self._lock:
                self._owned.update(data)
                lease_id = self._lease_id
            if lease_id is None:
                raise LeaseLostError(None, f"{self.name}: no lease now; {len(data)} key(s) are "
                                     "written when a new lease is granted")
            try:
                return self.client.txn([], [PutOp(k, v, lease_id) for k, v in data.items()]
                                       ).revision
            except LeaseLostError:
                self._wake.set()
                raise

    def delete(self, key: str) -> bool:
        """Forget an owned key and delete it from etcd."""
        with self._write_lock:
            with self._lock:
                self._owned.pop(key, None)
            return self.client.delete(key)

    def owned_keys(self) -> list[str]:
        with self._lock:
            return sorted(self._owned)

    def stop(self, revoke: bool = True, timeout: float = 5.0) -> None:
        """Stop refreshing; revoke the lease (deleting owned keys) unless ``revoke`` is False."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                self.client.revoke(lease_id, timeout=min(timeout, self.client.timeout))
            except CoordinationError as exc:
                log.warning("%s: could not revoke lease %016x: %s", self.name, lease_id, exc)

    def __enter__(self) -> "LeasedSession":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        delay = self.ttl / 3.0
        while not self._stop.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            delay = self._step()

    def _step(self) -> float:
        """One round: refresh, or recover a lost lease. Returns the delay until the next."""
        keepalive = self._keepalive
        if self.lease_id is None or keepalive is None:
            return self._recover()
        if self._needs_rewrite:
            self._rewrite_owned(keepalive.lease_id)
        verdict, err = keepalive.tick()
        if verdict is LeaseVerdict.LOST:
            self._lose(err)
            return self._recover()
        return keepalive.next_delay(verdict)

    def _lose(self, err: LeaseLostError) -> None:
        with self._lock:
            self._lease_id = None
            self.losses += 1
            listeners = list(self._lost_listeners)
        log.warning("%s: %s; re-granting", self.name, err)
        for fn in listeners:
            _safe_call(fn, err)

    def _recover(self) -> float:
        """Grant a new lease and re-create the owned keys; retry soon when etcd is away."""
        old = self._keepalive.lease_id if self._keepalive else None
        try:
            lease_id = self.client.grant(int(round(self.ttl)),
                                         timeout=max(min(self.ttl / 3, self.client.timeout), 0.2))
        except CoordinationError as exc:
            log.debug("%s: cannot grant a new lease yet: %s", self.name, exc)
            return max(self.ttl / 6, _MIN_PERIOD_S)
        if self._stop.is_set():  # stopped while granting: do not leak the new lease
            self._revoke_quietly(lease_id)
            return _MIN_PERIOD_S
        keepalive = KeepAlive(self.client, lease_id, self.ttl, clock=self._clock)
        with self._lock:
            self._keepalive = keepalive
            self._lease_id = lease_id
        self._rewrite_owned(lease_id)
        if old is not None:
            self._revoke_quietly(old)
        log.info("%s: new lease %016x, %d owned key(s) re-created", self.name, lease_id,
                 len(self.owned_keys()))
        with self._lock:
            listeners = list(self._regrant_listeners)
        for fn in listeners:
            _safe_call(fn, lease_id)
        return keepalive.tracker.period

    def _rewrite_owned(self, lease_id: int) -> None:
        with self._write_lock:
            with self._lock:
                owned = dict(self._owned)
            try:
                for key, value in owned.items():
                    self.client.put(key, value, lease=lease_id)
                self._needs_rewrite = False
            except CoordinationError as exc:
                self._needs_rewrite = True
                log.warning("%s: re-creating owned keys failed, will retry: %s", self.name, exc)

    def _revoke_quietly(self, lease_id: int) -> None:
        """The old lease may outlive an etcd restart: drop it so its leftovers vanish."""
        try:
            self.client.revoke(lease_id, timeout=0.5)
        except CoordinationError:
            pass
