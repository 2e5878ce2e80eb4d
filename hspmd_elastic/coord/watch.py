"""``PrefixWatch``: ordered, gap-free change delivery for a key prefix, across etcd failures.

Promises:

* the callback sees PUT/DELETE events (key, value, revision, type) in revision order, on one
  thread, each at most once; a callback that raises is logged and the watch goes on;
* a broken stream (member killed, etcd restarted, stream cancelled by the server) is re-opened on
  any live member from ``last delivered revision + 1``, so no event is lost across a restart;
* if that revision was compacted away, ``on_error`` gets a ``WatchCompactedError`` and the watch
  resyncs from a full read: synthetic PUTs for every current key, synthetic DELETEs for keys it
  had seen that are gone, then it resumes after the read's revision;
* ``initial=True`` lists the prefix first (synthetic PUTs from one read) and then watches from
  right after that read, so a consumer sees the whole state and every later change;
* with ``decode=True`` each PUT carries its schema record; a bad record is logged in one line,
  passed to ``on_error`` as a ``RecordError`` and skipped (never a crash);
* ``start(timeout)`` returns once the first stream is registered (later writes will be seen);
  ``stop(timeout)`` cancels the stream and joins the thread within the timeout;
* with etcd's auth on, a stream etcd cancels for a stale token (etcd restarted, the token
  expired) is re-opened with a new token; one it cancels for a denied prefix is an
  ``EtcdAuthError``: ``start`` raises it at once, later ones go to ``on_error`` (the watch keeps
  retrying, in case the user's roles are fixed);
* ``event_bytes`` counts the bytes of the stream's responses that carried events (each protobuf
  message's size): what etcd sent this watch for the changes it delivered.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import grpc
from etcd3 import etcdrpc

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import (
    CoordinationError,
    EtcdAuthError,
    EtcdUnavailableError,
    EventType,
    RecordError,
    WatchCompactedError,
    WatchEvent,
)
from hspmd_elastic.coord.auth import denial, is_stale_token_reason
from hspmd_elastic.coord.client import EtcdClient, _b, _describe, prefix_range_end

log = logging.getLogger(__name__)

EventCallback = Callable[[WatchEvent], None]
ErrorCallback = Callable[[CoordinationError], None]
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 0.5
DEFAULT_PROGRESS_S = 5.0


class _Liveness:
    """What the request side of a stream needs to notice a silent member."""

    def __init__(self, progress_s: Optional[float]):
        self.progress_s = progress_s
        self.last_seen = time.monotonic()
        self.silent = False
        self.call = None

    def seen(self) -> None:
        self.last_seen = time.monotonic()


class _StreamBroken(Exception):
    """The current stream ended; re-open it from the next revision."""


class _Compacted(Exception):
    def __init__(self, compact_revision: int):
        super().__init__(compact_revision)
        self.compact_revision = compact_revision


class PrefixWatch:
    """Watch every key under ``prefix`` starting at ``start_revision`` (default: from now).

    ``initial=True`` first delivers every current key as a synthetic PUT (one consistent read),
    then every change after that read: the usual "list, then watch" without a gap.
    ``progress_s``: every so often the watch asks etcd for a progress report; a stream silent for
    twice that long (a frozen or partitioned member) is dropped and re-opened on another member.
    """

    def __init__(self, client: EtcdClient, prefix: str, callback: EventCallback,
                 start_revision: Optional[int] = None,
                 on_error: Optional[ErrorCallback] = None,
                 decode: bool = False, name: Optional[str] = None, initial: bool = False,
                 progress_s: Optional[float] = DEFAULT_PROGRESS_S):
        if initial and start_revision is not None:
            raise ValueError("PrefixWatch: give start_revision or initial=True, not both")
        self.client = client
        self._initial = initial
        self._progress_s = progress_s
        self.prefix = prefix
        self._callback = callback
        self._on_error = on_error
        self._decode = decode
        self.name = name or f"watch {prefix}"
        self._next_rev: Optional[int] = start_revision
        self._known: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._call = None
        self._gate: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        self.streams_opened = 0
        self.event_bytes = 0  # bytes of the watch responses that carried events
        self.last_error: Optional[BaseException] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def next_revision(self) -> Optional[int]:
        """The revision the watch resumes from if its stream breaks now."""
        with self._lock:
            return self._next_rev

    def start(self, timeout: Optional[float] = None) -> "PrefixWatch":
        """Start watching; returns once registered, or raises EtcdUnavailableError."""
        budget = self.client.timeout if timeout is None else timeout
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started (a PrefixWatch starts once)")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + budget
        while not self._registered.wait(min(0.05, max(deadline - time.monotonic(), 0.0))):
            refused = self.last_error
            if isinstance(refused, EtcdAuthError):
                self.stop()
                raise EtcdAuthError(str(refused)) from refused
            if time.monotonic() >= deadline:
                self.stop()
                raise EtcdUnavailableError(
                    f"{self.name}: could not register a watch within {budget:.1f}s "
                    f"({_describe(self.last_error)})"
                )
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cancel_stream()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%s: watch thread did not stop within %.1fs", self.name, timeout)

    def __enter__(self) -> "PrefixWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _cancel_stream(self) -> None:
        with self._lock:
            call, gate = self._call, self._gate
        if gate is not None:
            gate.set()
        if call is not None:
            call.cancel()

    # ------------------------------------------------------------------ stream loop
    def _run(self) -> None:
        delay = _RETRY_FIRST_S
        while self._initial and not self._stop.is_set() and not self._load_snapshot():
            self._stop.wait(delay)
            delay = min(delay * 2, _RETRY_MAX_S)
        while not self._stop.is_set():
            try:
                self._stream_once()
                delay = _RETRY_FIRST_S
            except _Compacted as exc:
                self._resync(exc.compact_revision)
                continue
            except (_StreamBroken, CoordinationError) as exc:
                self.last_error = exc
                if self._stop.is_set():
                    break
                if isinstance(exc, EtcdAuthError):
                    self._report(exc)
                log.info("%s: stream broke (%s); resuming from revision %s", self.name,
                         exc, self.next_revision)
            except Exception:  # noqa: BLE001 - the watch thread must survive anything
                log.exception("%s: unexpected error; re-opening the stream", self.name)
            self._stop.wait(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    def _create_request(self):
        create = etcdrpc.WatchCreateRequest(
            key=_b(self.prefix), range_end=prefix_range_end(_b(self.prefix))
        )
        rev = self.next_revision
        if rev is not None:
            create.start_revision = rev
        return etcdrpc.WatchRequest(create_request=create)

    def _open(self):
        """Open a stream on a live member and wait for its creation; (call, gate, response)."""
        request = self._create_request()

        def attempt(channel: grpc.Channel, t: float):
            gate = threading.Event()
            live = _Liveness(self._progress_s)
            call = etcdrpc.WatchStub(channel).Watch(_requests(request, gate, self._stop, live))
            live.call = call
            timer = threading.Timer(t, call.cancel)
            timer.daemon = True
            timer.start()
            try:
                first = next(call)
            except grpc.RpcError as exc:
                gate.set()
                if exc.code() == grpc.StatusCode.CANCELLED and not self._stop.is_set():
                    raise _DeadlineRpcError() from exc
                raise
            except StopIteration:
                gate.set()
                raise _DeadlineRpcError() from None
            finally:
                timer.cancel()
            return call, gate, first, live, channel

        return self.client.call(f"{self.name}: open stream", attempt)

    def _stream_once(self) -> None:
        call, gate, first, live, channel = self._open()
        with self._lock:
            self._call, self._gate = call, gate
            if self._next_rev is None and first.created:
                self._next_rev = first.header.revision + 1
        self.streams_opened += 1
        if self._stop.is_set():
            self._cancel_stream()
            return
        try:
            self._handle(first)
            self._registered.set()
            for resp in call:
                live.seen()
                self._handle(resp)
            raise _StreamBroken("stream ended by the server")
        except grpc.RpcError as exc:
            if self._stop.is_set():
                return
            if live.silent:
                self.client.report_failure(channel)
                raise _StreamBroken(
                    f"no answer to a progress request for {2 * live.progress_s:g}s"
                ) from exc
            raise _StreamBroken(_describe(exc)) from exc
        finally:
            gate.set()
            call.cancel()
            with self._lock:
                self._call = self._gate = None

    def _handle(self, resp) -> None:
        if resp.compact_revision:
            raise _Compacted(resp.compact_revision)
        if resp.canceled:
            reason = resp.cancel_reason or "no reason"
            if is_stale_token_reason(reason):
                self.client.renew_token()  # the next stream authenticates again
            elif "ermission" in reason or "nauthenticated" in reason:
                code = None if "ermission" in reason else grpc.StatusCode.UNAUTHENTICATED
                why = denial(reason, code, self.client.security) or reason
                raise EtcdAuthError(f"{self.name}: {why}")
            raise _StreamBroken(f"watch cancelled by etcd: {reason}")
        if not resp.events:
            return
        self.event_bytes += resp.ByteSize()
        top = 0
        for ev in resp.events:
            rev = ev.kv.mod_revision
            top = max(top, rev)
            if self.next_revision is not None and rev < self.next_revision:
                continue  # replayed after a resume: already delivered
            self._deliver(_event(ev), rev)
        with self._lock:
            self._next_rev = max(self._next_rev or 0, top + 1)

    # ------------------------------------------------------------------ delivery
    def _deliver(self, event: WatchEvent, rev: int) -> None:
        if event.type is EventType.PUT:
            self._known.add(event.key)
            if self._decode:
                try:
                    event = _with_record(event)
                except RecordError as exc:
                    log.warning("%s: skipping bad record at revision %d: %s", self.name, rev, exc)
                    self._report(exc)
                    return
        else:
            self._known.discard(event.key)
        try:
            self._callback(event)
        except Exception:  # noqa: BLE001 - a consumer bug must not stop the watch
            log.exception("%s: callback failed on %s %s", self.name, event.type.value, event.key)

    def _report(self, err: CoordinationError) -> None:
        if self._on_error is None:
            return
        try:
            self._on_error(err)
        except Exception:  # noqa: BLE001
            log.exception("%s: error callback failed", self.name)

    def _resync(self, compact_revision: int) -> None:
        err = WatchCompactedError(self.prefix, self.next_revision or 0, compact_revision)
        log.warning("%s: %s", self.name, err)
        self._report(err)
        if not self._load_snapshot():
            # The re-opened stream reports the compaction again, and the resync is retried.
            self._stop.wait(_RETRY_MAX_S)

    def _load_snapshot(self) -> bool:
        """Deliver the prefix's current state as synthetic events; resume after that read."""
        try:
            snap = self.client.get_prefix(self.prefix)
        except CoordinationError as exc:
            self.last_error = exc
            log.info("%s: full read failed (%s); retrying", self.name, exc)
            return False
        current = {kv.key for kv in snap}
        for kv in snap:
            ev = WatchEvent(EventType.PUT, kv.key, kv.value, kv.mod_revision,
                            kv.create_revision, synthetic=True)
            self._deliver(ev, kv.mod_revision)
        for key in sorted(self._known - current):
            self._deliver(WatchEvent(EventType.DELETE, key, b"", snap.revision, synthetic=True),
                          snap.revision)
        with self._lock:
            self._next_rev = snap.revision + 1
        self._registered.set()
        return True


class _DeadlineRpcError(grpc.RpcError):
    """Opening a stream timed out: seen by the client as DEADLINE_EXCEEDED (fail over)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "watch stream was not created in time"


def _requests(create_request, gate: threading.Event, stop: threading.Event, live: _Liveness):
    """The request side of a watch stream: one create, then hold the stream open, asking for a
    progress report every ``live.progress_s`` and cancelling the call when answers stop."""
    yield create_request
    period = live.progress_s or 0.5
    while not gate.wait(period):
        if stop.is_set():
            return
        if live.progress_s is None:
            continue
        if time.monotonic() - live.last_seen > 2 * live.progress_s:
            live.silent = True
            live.call.cancel()
            return
        yield etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())


def _event(ev) -> WatchEvent:
    kind = EventType.DELETE if ev.type == type(ev).DELETE else EventType.PUT
    return WatchEvent(
        type=kind,
        key=ev.kv.key.decode("utf-8", errors="replace"),
        value=bytes(ev.kv.value),
        revision=ev.kv.mod_revision,
        create_revision=ev.kv.create_revision,
    )


def _with_record(event: WatchEvent) -> WatchEvent:
    record = schema.decode(event.key, event.value)
    return WatchEvent(event.type, event.key, event.value, event.revision, event.create_revision,
                      event.synthetic, record)

