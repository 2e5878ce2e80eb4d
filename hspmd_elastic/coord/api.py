"""The coordination layer's vocabulary: errors, small value types and transaction operations.

A reader learns ``hspmd_elastic.coord`` from this file. Promises:

* every failure that crosses the coordination boundary is a ``CoordinationError`` subclass; no
  etcd3 or grpc exception escapes (they are chained with ``raise ... from exc``);
* values returned by the client are plain frozen dataclasses (``KeyValue``, ``RangeResult``,
  ``WatchEvent``), independent of the etcd3 library's types;
* transaction operations (``Compare``, ``PutOp``, ``DeleteOp``) are plain data; the client
  translates them.
* ``CoordinationError`` and ``RecordError`` are defined in ``hspmd_elastic.contract.errors``
  (a bad record is a contract matter, not a transport one) and re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from hspmd_elastic.contract.errors import CoordinationError, RecordError  # noqa: F401

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic`` in production, a fake in unit tests)."""


# --------------------------------------------------------------------------------------- errors
class EtcdUnavailableError(CoordinationError):
    """No etcd member could be reached (all refused, or none answered) before the deadline."""


class EtcdTimeoutError(CoordinationError):
    """An etcd call did not complete before its deadline."""


class EtcdRequestError(CoordinationError):
    """etcd answered with an error about the request itself (bad argument, internal error...)."""


class EtcdAuthError(CoordinationError):
    """etcd refused this client: a failed TLS handshake (no client certificate, or one it does
    not trust; a server certificate the given CA does not verify), a wrong user name or
    password, or a user whose roles do not allow the key. Retrying does not help."""


class FencedWriteRejected(CoordinationError):
    """A fenced write was refused: the fence key is gone or was re-created (writer deposed)."""

    def __init__(self, fence_key: str, expected_create_revision: int, detail: str = ""):
        self.fence_key = fence_key
        self.expected_create_revision = expected_create_revision
        msg = (
            f"fenced write rejected: fence {fence_key!r} no longer has "
            f"create_revision {expected_create_revision}"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


class ConflictError(CoordinationError):
    """A compare-and-set lost: the key changed since it was read (re-read and decide again)."""


class LeaseLostError(CoordinationError):
    """A lease expired, was revoked, or could not be refreshed for longer than its TTL."""

    def __init__(self, lease_id: Optional[int], reason: str):
        self.lease_id = lease_id
        self.reason = reason
        lease = "none" if lease_id is None else f"{lease_id:016x}"
        super().__init__(f"lease {lease} lost: {reason}")


class WatchCompactedError(CoordinationError):
    """A watch could not resume: the revision it needed was compacted away (it resyncs)."""

    def __init__(self, prefix: str, wanted_revision: int, compact_revision: int):
        self.prefix = prefix
        self.wanted_revision = wanted_revision
        self.compact_revision = compact_revision
        super().__init__(
            f"watch on {prefix!r} wanted revision {wanted_revision} but etcd compacted up to "
            f"{compact_revision}; resyncing from a full read"
        )


# --------------------------------------------------------------------------------- value types
@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it. Revisions are etcd's (``create_revision`` orders creation)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class RangeResult:
    """The keys of a range read plus the store revision the read was served at."""

    kvs: tuple[KeyValue, ...]
    revision: int

    def __iter__(self) -> Iterator[KeyValue]:
        return iter(self.kvs)

    def __len__(self) -> int:
        return len(self.kvs)

    def as_dict(self) -> dict[str, KeyValue]:
        return {kv.key: kv for kv in self.kvs}


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix.

    ``revision`` is the event's mod revision (for DELETE: the deletion revision). ``synthetic``
    marks events made up from a full read after a compaction resync, not seen on a stream.
    ``record`` holds the decoded schema record when the watch decodes values (None otherwise, and
    for DELETE events).
    """

    type: EventType
    key: str
    value: bytes
    revision: int
    create_revision: int = 0
    synthetic: bool = False
    record: object = None


# ---------------------------------------------------------------------------- txn operations
class CompareTarget(enum.Enum):
    CREATE = "create"  # create_revision (0 when the key does not exist)
    MOD = "mod"  # mod_revision (0 when the key does not exist)
    VERSION = "version"  # number of puts since creation (0 when absent)
    VALUE = "value"


@dataclass(frozen=True)
class Compare:
    """``<target>(key) <op> value`` with op one of ``== != < >``."""

    key: str
    target: CompareTarget
    op: str
    value: object

    def __post_init__(self) -> None:
        if self.op not in ("==", "!=", "<", ">"):
            raise ValueError(f"compare op must be one of == != < >, got {self.op!r}")


@dataclass(frozen=True)
class PutOp:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class GetOp:
    key: str


@dataclass(frozen=True)
class TxnResult:
    """Outcome of a transaction: which branch ran, the revision after it, and read results.

    ``gets`` holds, in order, the result of each ``GetOp`` of the branch that ran (None when the
    key is absent).
    """

    succeeded: bool
    revision: int
    gets: tuple[Optional[KeyValue], ...] = field(default_factory=tuple)
