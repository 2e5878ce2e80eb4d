"""``EtcdClient``: the one place in hspmd-elastic that talks to etcd.

Built over ``etcd3.MultiEndpointEtcd3Client`` (its endpoints, gRPC channels and failover choice of
a member); requests are sent on the chosen channel with a deadline per call. Promises:

* every call has a deadline (``timeout`` seconds unless a call says otherwise); a member that
  refuses or drops a call is marked failed for ``retry_after`` seconds and the call is retried on
  the next member until the deadline, so losing the member in use costs one retry, not an error;
* when no member can be reached the call fails within its deadline with ``EtcdUnavailableError``;
  a call that etcd did not answer in time fails with ``EtcdTimeoutError``;
* no etcd3/grpc exception escapes: everything is a ``CoordinationError`` chained to its cause;
* reads are linearizable; prefix reads are sorted by key and carry the store revision;
* at import, python3-etcd3's watch thread gets the ``six`` shim it forgot to import, so a broken
  stream of an ``etcd3`` watcher reports its error instead of dying with ``NameError``;
* with ``security`` (``EtcdSecurity``) the channels are TLS and, with a user, every request
  (streams too) carries an auth token fetched on first use; a token etcd no longer knows (etcd
  restarted, or the token's TTL ran out) is fetched again and the call retried, within its
  deadline; a refused handshake, a wrong password or a denied key is ``EtcdAuthError`` at once
  (one line, no retry); gRPC's own log lines are off unless ``GRPC_VERBOSITY`` says otherwise;
* ``kv_bytes_received`` counts the bytes of the KV responses (reads, transactions, writes) it
  received: each protobuf message's size, what etcd sent before gRPC's few bytes of framing;
* ``answering_member`` is the member that answered the last call; when a call is answered by
  another member than the one before, ``failovers`` counts it and one warning says
  ``etcd client moved from member A to B`` (once per move, none while no member answers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from collections.abc import Sequence
from typing import Callable, Optional, TypeVar

# gRPC core writes handshake failures to stderr itself; our errors already say what failed, in
# one line. Read by gRPC when it is first imported, hence before etcd3 and grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import etcd3  # noqa: E402
import etcd3.watch  # noqa: E402
import grpc  # noqa: E402
from etcd3 import etcdrpc  # noqa: E402
from etcd3 import exceptions as etcd3_exceptions  # noqa: E402

from hspmd_elastic.coord.api import (  # noqa: E402
    Compare,
    CompareTarget,
    CoordinationError,
    DeleteOp,
    EtcdAuthError,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdUnavailableError,
    FencedWriteRejected,
    GetOp,
    KeyValue,
    LeaseLostError,
    PutOp,
    RangeResult,
    TxnResult,
)
from hspmd_elastic.coord.auth import (  # noqa: E402
    RENEWALS,
    TokenAuth,
    TokenInterceptor,
    client_security,
    denial,
    is_stale_token,
    tls_message,
    tls_refusal,
)
from hspmd_elastic.coord.endpoints import (  # noqa: E402,F401 - re-exported
    _normalize_endpoints, format_endpoint, parse_endpoints)
from hspmd_elastic.coord.security import EtcdSecurity  # noqa: E402

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRY_AFTER_S = 2.0
_BACKOFF_FIRST_S = 0.02
_BACKOFF_MAX_S = 0.25
# Reconnect quickly to a restarted member (gRPC's default backoff grows to minutes).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_TARGETS = {
    CompareTarget.CREATE: (etcdrpc.Compare.CREATE, "create_revision"),
    CompareTarget.MOD: (etcdrpc.Compare.MOD, "mod_revision"),
    CompareTarget.VERSION: (etcdrpc.Compare.VERSION, "version"),
    CompareTarget.VALUE: (etcdrpc.Compare.VALUE, "value"),
}
_OPS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


def _patch_etcd3_watch_six() -> None:
    """etcd3/watch.py ``Watcher._run`` calls ``six.itervalues`` without importing six."""
    if not hasattr(etcd3.watch, "six"):
        etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))


_patch_etcd3_watch_six()


def _count_of(prefix: str) -> "etcdrpc.RangeRequest":
    """A count-only read of every key under ``prefix`` (no value is sent)."""
    return etcdrpc.RangeRequest(key=_b(prefix), range_end=prefix_range_end(_b(prefix)),
                                count_only=True)


def prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd range_end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # the whole key space


def _b(s: str | bytes) -> bytes:
    return s.encode("utf-8") if isinstance(s, str) else bytes(s)


def _kv(kv) -> KeyValue:
    return KeyValue(
        key=kv.key.decode("utf-8", errors="replace"),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


class EtcdClient:
    """Thread-safe etcd v3 client with member failover and a deadline on every call.

    ``endpoints``: ``"host:port"`` strings (``https://host:port`` turns TLS on), ``(host, port)``
    pairs, or one comma-separated string. ``timeout``: seconds per call (retries included).
    ``retry_after``: seconds a member that failed a call is skipped while others remain.
    ``security``: TLS and user authentication (``EtcdSecurity``; default plain). Bad endpoints
    or unusable security files raise ``ValueError`` naming them; nothing is sent to etcd here.
    """

    def __init__(
        self,
        endpoints: str | Sequence,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = DEFAULT_RETRY_AFTER_S,
        security: Optional[EtcdSecurity] = None,
    ):
        if timeout <= 0:
            raise ValueError(f"etcd timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._addresses = _normalize_endpoints(endpoints)
        security = client_security(endpoints, security)
        if security.uses_tls or security.uses_auth:
            security = security.checked() if security._pem is None else security
        self.security = security
        creds = security.channel_credentials() if security.uses_tls else None
        # etcd3 makes the gRPC target "host:port": an IPv6 host goes in brackets ([::1]:2379)
        eps = [
            etcd3.Endpoint(f"[{h}]" if ":" in h else h, p, secure=creds is not None,
                           creds=creds, time_retry=retry_after, opts=_CHANNEL_OPTIONS)
            for h, p in self._addresses
        ]
        self._etcd = etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout, failover=True)
        self._lock = threading.Lock()
        self._closed = False
        self._auth = TokenAuth(security) if security.uses_auth else None
        self._wrapped: dict[int, grpc.Channel] = {}  # id(raw channel) -> channel with the token
        # bytes of the KV responses (reads, transactions) received: what etcd sent this client
        self.kv_bytes_received = 0
        self._count_lock = threading.Lock()
        self.answering_member: Optional[str] = None  # host:port that answered the last call
        self.failovers = 0  # calls answered by another member than the call before

    # ------------------------------------------------------------------------ plumbing
    @property
    def endpoints(self) -> list[str]:
        return [format_endpoint(h, p) for h, p in self._addresses]

    @property
    def current_endpoint(self) -> str:
        """``host:port`` of the member calls currently go to."""
        with self._lock:
            return self._etcd.endpoint_in_use.netloc

    def _pick(self):
        """(endpoint, channel) of a member not marked failed, or (None, None)."""
        with self._lock:
            if self._closed:
                raise CoordinationError("etcd client is closed")
            before = self._etcd.endpoint_in_use.netloc
            try:
                channel = self._etcd.channel
            except etcd3_exceptions.NoServerAvailableError:
                return None, None
            endpoint = self._etcd.endpoint_in_use
        if endpoint.netloc != before:
            log.info("etcd: failing over from member %s to %s", before, endpoint.netloc)
        return endpoint, channel

    def _mark_failed(self, endpoint, exc: BaseException) -> None:
        with self._lock:
            endpoint.fail()
        log.debug("etcd member %s failed a call (%s); trying another", endpoint.netloc,
                 _describe(exc))

    def report_failure(self, channel: grpc.Channel) -> None:
        """Mark the member behind ``channel`` failed (a stream found it silent)."""
        with self._lock:
            for ep in self._etcd.endpoints.values():
                if ep.channel is channel or self._wrapped.get(id(ep.channel)) is channel:
                    ep.fail()
                    log.info("etcd member %s reported silent; avoiding it for now", ep.netloc)

    def _unmark_all(self) -> None:
        """Every member failed recently: give all of them another chance (a fresh round)."""
        with self._lock:
            for ep in self._etcd.endpoints.values():
                ep.last_failed = 0

    def call(self, what: str, fn: Callable[[grpc.Channel, float], T],
             timeout: Optional[float] = None) -> T:
        """Run ``fn(channel, attempt_timeout)`` against a live member, failing over until the
        deadline. Exposed for the coordination layer's own modules (watch streams)."""
        budget = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + budget
        backoff, last_exc = _BACKOFF_FIRST_S, None
        refused: dict[str, grpc.RpcError] = {}  # member -> its failed TLS handshake
        renewals = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._deadline_error(what, budget, last_exc) from last_exc
            endpoint, channel = self._pick()
            if endpoint is None:
                time.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                self._unmark_all()
                continue
            attempt = min(remaining if len(self._addresses) == 1 else max(remaining / 2, 0.2),
                          remaining)
            token = None
            try:
                if self._auth is not None:
                    token = self._auth.token(channel, attempt, what)
                result = fn(self._channel_for(channel), attempt)
                self._answered_by(endpoint.netloc)
                return result
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if is_stale_token(exc) and self._auth is not None and renewals < RENEWALS:
                    renewals += 1  # etcd restarted or the token expired: fetch a new one
                    self._auth.drop(token)
                    continue
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _wrap_rpc_error(what, exc, self.security) from exc
                if tls_refusal(exc):
                    refused[endpoint.netloc] = exc
                    if len(refused) == len(self._addresses):
                        raise EtcdAuthError(tls_message(what, endpoint.netloc, exc,
                                                         self.security)) from exc
                self._mark_failed(endpoint, exc)
                last_exc = exc
            except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel!"
                raise CoordinationError(f"{what}: etcd client is closed") from exc

    def _answered_by(self, member: str) -> None:
        with self._count_lock:
            before, self.answering_member = self.answering_member, member
            moved = before is not None and before != member
            self.failovers += moved
        if moved:
            log.warning("etcd client moved from member %s to %s", before, member)

    def _deadline_error(self, what: str, budget: float,
                        last_exc: Optional[BaseException]) -> CoordinationError:
        timed_out = (isinstance(last_exc, grpc.RpcError) and hasattr(last_exc, "code")
                     and last_exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
        if timed_out:
            return EtcdTimeoutError(f"{what}: etcd did not answer within {budget:.1f}s")
        hint = ""
        if (not self.security.uses_tls and isinstance(last_exc, grpc.RpcError)
                and "Socket closed" in _describe(last_exc)):
            hint = (" (an etcd that serves TLS closes plain connections: give its CA, or "
                    "https:// endpoints)")
        return EtcdUnavailableError(
            f"{what}: no etcd member of {','.join(self.endpoints)} reachable within "
            f"{budget:.1f}s (last error: {_describe(last_exc)}){hint}"
        )

    def _channel_for(self, channel: grpc.Channel) -> grpc.Channel:
        """``channel``, or with auth the same channel sending the current token."""
        if self._auth is None:
            return channel
        with self._lock:
            wrapped = self._wrapped.get(id(channel))
            if wrapped is None:
                wrapped = grpc.intercept_channel(channel, TokenInterceptor(self._auth))
                self._wrapped[id(channel)] = wrapped
        return wrapped

    def renew_token(self) -> None:
        """Forget the auth token: the next call fetches a new one (a stream found it stale)."""
        if self._auth is not None:
            self._auth.drop(None)

    def _kv_call(self, what: str, method: str, request, timeout: Optional[float] = None):
        resp = self.call(
            what, lambda ch, t: getattr(etcdrpc.KVStub(ch), method)(request, t), timeout
        )
        size = resp.ByteSize()
        with self._count_lock:
            self.kv_bytes_received += size
        return resp

    def _lease_call(self, what: str, method: str, request, timeout: Optional[float] = None):
        return self.call(
            what, lambda ch, t: getattr(etcdrpc.LeaseStub(ch), method)(request, t), timeout
        )

    # ------------------------------------------------------------------------ reads
    def get(self, key: str, timeout: Optional[float] = None) -> Optional[KeyValue]:
        resp = self._kv_call(f"get {key}", "Range", etcdrpc.RangeRequest(key=_b(key)), timeout)
        return _kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, timeout: Optional[float] = None) -> RangeResult:
        """Every key under ``prefix`` sorted by key, with the revision the read was served at."""
        req = etcdrpc.RangeRequest(
            key=_b(prefix),
            range_end=prefix_range_end(_b(prefix)),
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        resp = self._kv_call(f"get prefix {prefix}", "Range", req, timeout)
        return RangeResult(kvs=tuple(_kv(kv) for kv in resp.kvs), revision=resp.header.revision)

    def revision(self, timeout: Optional[float] = None, prefix: Optional[str] = None) -> int:
        """The store's current revision (a linearizable read). ``prefix``: count the keys
        under it instead of reading key ``"\\0"``; with etcd's auth on, give one the user may
        read (a job's prefix)."""
        req = etcdrpc.RangeRequest(key=b"\0", count_only=True) if prefix is None \
            else _count_of(prefix)
        return self._kv_call("current revision", "Range", req, timeout).header.revision

    def count_prefix(self, prefix: str, timeout: Optional[float] = None) -> int:
        """How many keys are under ``prefix`` (a count-only read: no value is sent)."""
        return int(self._kv_call(f"count prefix {prefix}", "Range", _count_of(prefix),
                                 timeout).count)

    # ------------------------------------------------------------------------ writes
    def put(self, key: str, value: bytes | str, lease: int = 0,
            timeout: Optional[float] = None) -> int:
        """Write ``key``; returns the revision of the write. A dead lease -> LeaseLostError."""
        req = etcdrpc.PutRequest(key=_b(key), value=_b(value), lease=lease or 0)
        try:
            return self._kv_call(f"put {key}", "Put", req, timeout).header.revision
        except LeaseLostError as exc:
            raise LeaseLostError(lease, exc.reason) from exc

    def delete(self, key: str, timeout: Optional[float] = None) -> bool:
        """Delete ``key``; True when it existed."""
        req = etcdrpc.DeleteRangeRequest(key=_b(key))
        return self._kv_call(f"delete {key}", "DeleteRange", req, timeout).deleted > 0

    def delete_prefix(self, prefix: str, timeout: Optional[float] = None) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        req = etcdrpc.DeleteRangeRequest(key=_b(prefix), range_end=prefix_range_end(_b(prefix)))
        return self._kv_call(f"delete prefix {prefix}", "DeleteRange", req, timeout).deleted

    def compact(self, revision: int, timeout: Optional[float] = None) -> None:
        """Compact the store's history up to ``revision`` (old revisions become unreadable)."""
        req = etcdrpc.CompactionRequest(revision=revision, physical=True)
        self._kv_call(f"compact to {revision}", "Compact", req, timeout)

    # ------------------------------------------------------------------------ transactions
    def txn(self, compare: Sequence[Compare], success: Sequence = (), failure: Sequence = (),
            timeout: Optional[float] = None) -> TxnResult:
        """One etcd transaction over our own ``Compare``/``PutOp``/``DeleteOp``/``GetOp``."""
        req = _txn_request(compare, success, failure)
        resp = self._kv_call("txn", "Txn", req, timeout)
        return _txn_result(resp)

    def put_if_absent(self, key: str, value: bytes | str, lease: int = 0,
                      timeout: Optional[float] = None) -> bool:
        """Create ``key`` only if it does not exist; True when this call created it."""
        cmp = Compare(key, CompareTarget.CREATE, "==", 0)
        return self.txn([cmp], [PutOp(key, _b(value), lease)], timeout=timeout).succeeded

    def compare_and_set(self, key: str, value: bytes | str, mod_revision: int, lease: int = 0,
                        timeout: Optional[float] = None) -> bool:
        """Write ``key`` only if its mod_revision is ``mod_revision`` (0: only if absent)."""
        cmp = Compare(key, CompareTarget.MOD, "==", mod_revision)
        return self.txn([cmp], [PutOp(key, _b(value), lease)], timeout=timeout).succeeded

    def fenced_txn(self, fence_key: str, fence_revision: int, compare: Sequence[Compare] = (),
                   success: Sequence = (), timeout: Optional[float] = None) -> TxnResult:
        """Run ``compare -> success`` only while ``fence_key`` exists with create_revision
        ``fence_revision``. Raises FencedWriteRejected when the fence fails; otherwise returns
        the inner result (``succeeded`` False when only ``compare`` failed)."""
        if fence_revision <= 0:
            raise FencedWriteRejected(fence_key, fence_revision, "no fence held")
        fence = Compare(fence_key, CompareTarget.CREATE, "==", fence_revision)
        inner = etcdrpc.RequestOp(request_txn=_txn_request(compare, success, ()))
        req = etcdrpc.TxnRequest(compare=[_compare(fence)], success=[inner])
        resp = self._kv_call(f"fenced txn on {fence_key}", "Txn", req, timeout)
        if not resp.succeeded:
            raise FencedWriteRejected(fence_key, fence_revision)
        return _txn_result(resp.responses[0].response_txn, resp.header.revision)

    def fenced_put(self, fence_key: str, fence_revision: int, key: str, value: bytes | str,
                   lease: int = 0, timeout: Optional[float] = None) -> int:
        """Put ``key`` only while the fence holds; returns the write's revision."""
        res = self.fenced_txn(fence_key, fence_revision, (), [PutOp(key, _b(value), lease)],
                              timeout)
        return res.revision

    # ------------------------------------------------------------------------ leases
    def grant(self, ttl: int, timeout: Optional[float] = None) -> int:
        """Grant a lease of ``ttl`` seconds (etcd rounds up to its minimum); returns its id."""
        resp = self._lease_call(f"grant lease ttl={ttl}", "LeaseGrant",
                                etcdrpc.LeaseGrantRequest(TTL=int(ttl)), timeout)
        if resp.error:
            raise EtcdRequestError(f"grant lease ttl={ttl}: {resp.error}")
        return resp.ID

    def revoke(self, lease_id: int, timeout: Optional[float] = None) -> bool:
        """Revoke a lease (deleting its keys); False when it was already gone."""
        try:
            self._lease_call(f"revoke lease {lease_id:016x}", "LeaseRevoke",
                             etcdrpc.LeaseRevokeRequest(ID=lease_id), timeout)
        except LeaseLostError:
            return False
        return True

    def refresh(self, lease_id: int, timeout: Optional[float] = None) -> int:
        """One keep-alive for ``lease_id``; returns the TTL etcd granted (<= 0: lease gone)."""

        def once(channel: grpc.Channel, t: float) -> int:
            call = etcdrpc.LeaseStub(channel).LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), t
            )
            try:
                for resp in call:
                    return resp.TTL
                return 0
            finally:
                call.cancel()

        return self.call(f"refresh lease {lease_id:016x}", once, timeout)

    def lease_ttl(self, lease_id: int, timeout: Optional[float] = None) -> int:
        """Remaining TTL of a lease in seconds; -1 when etcd does not know it."""
        resp = self._lease_call(f"lease ttl {lease_id:016x}", "LeaseTimeToLive",
                                etcdrpc.LeaseTimeToLiveRequest(ID=lease_id), timeout)
        return resp.TTL

    # ------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._etcd.close()

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EtcdClient({','.join(self.endpoints)}, timeout={self.timeout}, "
                f"{self.security.describe()})")


# ---------------------------------------------------------------------------- helpers
def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return "none"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _wrap_rpc_error(what: str, exc: grpc.RpcError,
                    security: Optional[EtcdSecurity] = None) -> CoordinationError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.NOT_FOUND and "lease" in (details or ""):
        return LeaseLostError(None, f"{what}: {details}")
    denied = denial(details or "", code, security or EtcdSecurity())
    if denied:
        return EtcdAuthError(f"{what}: {denied}")
    if code == grpc.StatusCode.CANCELLED:
        return EtcdUnavailableError(f"{what}: call cancelled ({details})")
    return EtcdRequestError(f"{what}: etcd refused the request ({_describe(exc)})")


def _compare(c: Compare):
    target, attr = _TARGETS[c.target]
    msg = etcdrpc.Compare(key=_b(c.key), target=target, result=_OPS[c.op])
    setattr(msg, attr, _b(c.value) if c.target is CompareTarget.VALUE else int(c.value))
    return msg


def _request_op(op):
    if isinstance(op, PutOp):
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=_b(op.key), value=_b(op.value), lease=op.lease)
        )
    if isinstance(op, DeleteOp):
        end = prefix_range_end(_b(op.key)) if op.prefix else b""
        return etcdrpc.RequestOp(
            request_delete_range=etcdrpc.DeleteRangeRequest(key=_b(op.key), range_end=end)
        )
    if isinstance(op, GetOp):
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=_b(op.key)))
    raise TypeError(f"unsupported txn operation {op!r}: use PutOp, DeleteOp or GetOp")


def _txn_request(compare, success, failure):
    return etcdrpc.TxnRequest(
        compare=[_compare(c) for c in compare],
        success=[_request_op(op) for op in success],
        failure=[_request_op(op) for op in failure],
    )


def _txn_result(resp, revision: Optional[int] = None) -> TxnResult:
    gets = []
    for r in resp.responses:
        if r.WhichOneof("response") == "response_range":
            kvs = r.response_range.kvs
            gets.append(_kv(kvs[0]) if kvs else None)
    rev = revision if revision is not None else resp.header.revision
    return TxnResult(succeeded=resp.succeeded, revision=rev, gets=tuple(gets))
