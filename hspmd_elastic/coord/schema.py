"""The etcd key schema of a job and its typed records (CONTRACT: read by dashboards and etcdctl).

Promises:

* every key lives under ``/hspmd/v1/jobs/<job_id>/`` and is built by one function of
  ``keys.py`` (re-exported here); numbers in keys are zero-padded so lexicographic order is
  numeric order;
* every value is a UTF-8 JSON object with ``"schema": 1`` and a ``"kind"`` naming its record
  type; no pickle, no base64; fields added after a record type was first written have defaults
  and may be absent from older values (they decode to the default);
* ``REGISTRY`` is the single table of key patterns -> record types; ``decode(key, raw)`` uses it
  and returns the right record or raises ``RecordError`` naming the key and what is wrong
  (malformed JSON, missing or unknown schema, wrong kind, missing/unknown/mistyped fields, a
  field that contradicts the key); docs/etcd-schema.md is checked against it by a test.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hspmd_elastic.contract.ids import ID_PATTERN
from hspmd_elastic.coord.api import RecordError
from hspmd_elastic.coord.keys import (  # noqa: F401 (re-exported: the schema's key builders)
    PAD,
    ROOT,
    ID_RE,
    job_prefix,
    nodes_prefix,
    node_key,
    devices_prefix,
    device_key,
    workers_prefix,
    worker_key,
    reach_prefix,
    reach_key,
    retry_prefix,
    retry_key,
    leader_key,
    election_prefix,
    election_key,
    plan_current_key,
    plan_head_key,
    plan_history_prefix,
    plan_history_key,
    events_prefix,
    event_key,
    event_seq_key,
    fault_script_key,
    switch_prefix,
    switch_ack_key,
    rdzv_prefix,
    rdzv_state_key,
    rdzv_round_prefix,
    rdzv_join_key,
    rdzv_master_key,
    rdzv_done_key,
)
from hspmd_elastic.coord.valid import parse_value

SCHEMA_VERSION = 1


DEVICE_STATES = ("healthy", "degraded", "suspect", "failed")
NODE_STATES = ("joining", "ready", "running", "switching", "draining", "leaving", "failed")
EVENT_TYPES = (
    "failure", "join", "leave", "degrade", "recover", "stall", "replan",
    "switch-start", "switch-done", "switch-failed", "restart", "fallback", "drain", "drained",
    "unreachable", "retry",
)
SWITCH_STATES = ("joined", "ready", "done", "failed")
RDZV_STATES = ("joining", "closed", "succeeded", "failed")

# Largest value of a record, in bytes of JSON: ``encode`` refuses and ``decode`` rejects more.
# Plans, the rendezvous state and fault scripts grow with the cluster; the others do not.
MAX_VALUE_BYTES = 64 * 1024
MAX_VALUE_BYTES_BY_KIND = {"plan": 1 << 20, "plan_head": 1 << 20, "rdzv_state": 1 << 20,
                           "fault_script": 1 << 20, "event": 256 * 1024}


# ----------------------------------------------------------------------------------------- records
@dataclass
class Record:
    """Base of every record: JSON with ``schema`` and ``kind`` plus the dataclass fields."""

    KIND: ClassVar[str] = ""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def to_dict(self) -> dict[str, Any]:
        body = {"schema": SCHEMA_VERSION, "kind": self.KIND}
        body.update(dataclasses.asdict(self))
        return body

    def to_json(self) -> bytes:
        """Compact, key-sorted UTF-8 JSON; NaN and infinities are refused (not JSON)."""
        try:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                              allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"<{self.KIND} record>", f"not encodable as JSON: {exc}") from exc
        return text.encode("utf-8")


@dataclass
class DeviceInfo:
    """One accelerator of a node (nested in NodeRecord.devices)."""

    index: int
    type: str
    memory_bytes: int
    uuid: str
    speed: float = 1.0  # declared by the node: relative to the type's nominal (1.0 nominal)


@dataclass
class NodeRecord(Record):
    KIND: ClassVar[str] = "node"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": NODE_STATES}

    host: str
    agent_pid: int
    devices: list[DeviceInfo]
    state: str
    started_at: float
    store_endpoint: str = ""  # host:port of the TCPStore this agent hosts ("" when none)


@dataclass
class DeviceHealthRecord(Record):
    KIND: ClassVar[str] = "device_health"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": DEVICE_STATES}

    state: str
    reason: str
    xid: Optional[int]
    slowdown: Optional[float]
    at: float


@dataclass
class WorkerRecord(Record):
    KIND: ClassVar[str] = "worker"

    pid: int
    global_rank: int
    local_rank: int
    plan_version: int
    step: int
    last_progress_at: float
    steps_per_s: float


@dataclass
class ReachRecord(Record):
    """The peers a node cannot reach over the data network (written while it sees any)."""

    KIND: ClassVar[str] = "reach"

    node: str
    unreachable: list[str]
    at: float


@dataclass
class RetryRecord(Record):
    """A node whose workers wait after a switch into ``plan_version`` failed with no change in
    the cluster to explain it (written while they wait; the leader publishes the plan again)."""

    KIND: ClassVar[str] = "retry"

    node: str
    plan_version: int
    slots: list[int]
    waited_s: float
    at: float


@dataclass
class CandidateRecord(Record):
    KIND: ClassVar[str] = "candidate"

    node: str
    at: float


@dataclass
class LeaderRecord(Record):
    KIND: ClassVar[str] = "leader"

    node: str
    since: float
    candidate_key: str
    term: int


@dataclass
class PlanRecord(Record):
    KIND: ClassVar[str] = "plan"

    version: int
    reason: str
    devices: list[str]
    strategy: dict[str, Any]
    store_endpoint: str
    created_at: float
    # Every device usable when the plan was made -> its speed relative to nominal (1.0 =
    # nominal): the leader replans when the cluster no longer matches it.
    inventory: dict[str, float] = field(default_factory=dict)
    # Devices of the previous plan that leave this one alive (suspect: drained): they join the
    # switch's group after the plan's ranks, serve as BSR sources only, then leave.
    drain: list[str] = field(default_factory=list)
    # Who wrote it: the leader's node and term (the create revision of its election key, the
    # fence of the write). Optional: older values without them read as "" and 0.
    leader: str = ""
    term: int = 0
    # The furthest step any worker had reported when the plan was made, or the previous plan's
    # if larger (0: nobody trained yet): a switch where nobody holds state starts from the seed
    # only when it is 0.
    step: int = 0


@dataclass
class PlanHeadRecord(Record):
    """What a node agent needs of the current plan, written in the same transaction as
    ``plan/current`` (``coord.plans``): a few bytes per node instead of the whole strategy."""

    KIND: ClassVar[str] = "plan_head"

    version: int
    created_at: float
    store_endpoint: str
    step: int
    # sha256 of the plan record's bytes as stored in plan/current ("sha256:<hex>")
    digest: str
    # The plan's devices in rank order as runs "<node>:<first>-<last>" (or "<node>:<index>"):
    # consecutive ranks on one node with consecutive device indexes.
    devices: list[str]
    drain: list[str] = field(default_factory=list)  # the plan's drain list, as runs too


@dataclass
class EventRecord(Record):
    KIND: ClassVar[str] = "event"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"type": EVENT_TYPES}

    seq: int
    type: str
    node: Optional[str]
    detail: dict[str, Any]
    timings: dict[str, float]
    at: float


@dataclass
class CounterRecord(Record):
    KIND: ClassVar[str] = "counter"

    value: int


@dataclass
class FaultScriptRecord(Record):
    """Scripted device faults for one node (fault drills); read by ``ScriptedHealthSource``."""

    KIND: ClassVar[str] = "fault_script"

    faults: list[dict[str, Any]]


@dataclass
class SwitchAckRecord(Record):
    KIND: ClassVar[str] = "switch_ack"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": SWITCH_STATES}

    node: str
    plan_version: int
    state: str
    at: float


@dataclass
class RdzvParticipant:
    """One node of a closed restart-mode round (nested in RdzvStateRecord.participants)."""

    node: str
    host: str
    local_world_size: int
    node_rank: Optional[int]
    create_revision: int


@dataclass
class RdzvStateRecord(Record):
    KIND: ClassVar[str] = "rdzv_state"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": RDZV_STATES}

    round: int
    state: str
    restart_count: int
    participants: list[RdzvParticipant]
    reason: str
    at: float


@dataclass
class RdzvJoinRecord(Record):
    KIND: ClassVar[str] = "rdzv_join"

    node: str
    host: str
    local_world_size: int
    node_rank: Optional[int]
    at: float


@dataclass
class RdzvMasterRecord(Record):
    KIND: ClassVar[str] = "rdzv_master"

    node: str
    addr: str
    port: int
    at: float


@dataclass
class RdzvDoneRecord(Record):
    KIND: ClassVar[str] = "rdzv_done"

    node: str
    at: float


RECORD_TYPES: tuple[type[Record], ...] = (
    NodeRecord, DeviceHealthRecord, WorkerRecord, ReachRecord, RetryRecord, CandidateRecord,
    LeaderRecord, PlanRecord, PlanHeadRecord, EventRecord, CounterRecord, FaultScriptRecord,
    SwitchAckRecord, RdzvStateRecord, RdzvJoinRecord, RdzvMasterRecord, RdzvDoneRecord,
)
NESTED_TYPES: tuple[type, ...] = (DeviceInfo, RdzvParticipant)


# ---------------------------------------------------------------------------------------- registry
_PARAM_RE = {
    "node_id": ID_PATTERN,
    "index": r"\d+",
    "local_rank": r"\d+",
    "lease_hex": r"[0-9a-f]{16}",
    "version": rf"\d{{{PAD}}}",
    "seq": rf"\d{{{PAD}}}",
    "round": rf"\d{{{PAD}}}",
}


@dataclass(frozen=True)
class KeySpec:
    """One row of the schema: a key pattern relative to the job prefix and its record type.

    ``lease`` says which lease the key is bound to (``agent``, ``candidate``, ``leader`` or
    ``none``); ``bindings`` maps key parameters to record fields that must agree with them.
    """

    pattern: str
    record: type[Record]
    lease: str
    writer: str
    bindings: tuple[tuple[str, str], ...] = ()
    regex: re.Pattern = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        parts = re.split(r"<([a-z_]+)>", self.pattern)
        rx = "".join(
            f"(?P<{p}>{_PARAM_RE[p]})" if i % 2 else re.escape(p) for i, p in enumerate(parts)
        )
        object.__setattr__(self, "regex", re.compile(f"^{rx}$"))


REGISTRY: tuple[KeySpec, ...] = (
    KeySpec("nodes/<node_id>", NodeRecord, "agent", "node agent"),
    KeySpec("devices/<node_id>/<index>", DeviceHealthRecord, "agent", "node agent"),
    KeySpec("workers/<node_id>/<local_rank>", WorkerRecord, "agent", "node agent",
            (("local_rank", "local_rank"),)),
    KeySpec("reach/<node_id>", ReachRecord, "agent", "node agent", (("node_id", "node"),)),
    KeySpec("retry/<node_id>", RetryRecord, "agent", "node agent", (("node_id", "node"),)),
    KeySpec("election/<lease_hex>", CandidateRecord, "candidate", "every leader candidate"),
    KeySpec("leader", LeaderRecord, "leader", "leader"),
    KeySpec("plan/current", PlanRecord, "none", "leader (fenced)"),
    KeySpec("plan/head", PlanHeadRecord, "none", "leader (fenced)"),
    KeySpec("plan/history/<version>", PlanRecord, "none", "leader (fenced)",
            (("version", "version"),)),
    KeySpec("events/<seq>", EventRecord, "none", "any agent or the leader", (("seq", "seq"),)),
    KeySpec("event_seq", CounterRecord, "none", "any agent or the leader (compare-and-set)"),
    KeySpec("switch/<version>/<node_id>", SwitchAckRecord, "agent", "node agent",
            (("version", "plan_version"), ("node_id", "node"))),
    KeySpec("faults/<node_id>", FaultScriptRecord, "none", "fault injector (hspmd-launch inject)"),
    KeySpec("rdzv/state", RdzvStateRecord, "none", "node agents (compare-and-set)"),
    KeySpec("rdzv/rounds/<round>/joined/<node_id>", RdzvJoinRecord, "agent", "node agent",
            (("node_id", "node"),)),
    KeySpec("rdzv/rounds/<round>/master", RdzvMasterRecord, "agent", "node 0 of the round"),
    KeySpec("rdzv/rounds/<round>/done/<node_id>", RdzvDoneRecord, "none", "node agent",
            (("node_id", "node"),)),
)


def match_key(key: str) -> tuple[str, KeySpec, dict[str, str]]:
    """Return (job_id, spec, params) for a schema key, or raise RecordError."""
    if not key.startswith(ROOT):
        raise RecordError(key, f"key is not under {ROOT}")
    job, sep, rest = key[len(ROOT):].partition("/")
    if not sep or not ID_RE.match(job):
        raise RecordError(key, "key does not name a valid job id")
    for spec in REGISTRY:
        m = spec.regex.match(rest)
        if m:
            return job, spec, m.groupdict()
    raise RecordError(key, f"no record type is registered for {rest!r}")


# ----------------------------------------------------------------------------- encode / decode
def encode(record: Record) -> bytes:
    """UTF-8 JSON of a record, validated as decode would validate it."""
    raw = record.to_json()
    _from_dict(type(record), _parse(type(record), raw, "<encode>"), "<encode>", "")
    return raw


def _parse(cls: type[Record], raw: bytes | str, key: str) -> Any:
    return parse_value(raw, key, MAX_VALUE_BYTES_BY_KIND.get(cls.KIND, MAX_VALUE_BYTES),
                       f"{cls.KIND} records")


def decode(key: str, raw: bytes | str) -> Record:
    """Decode the value stored at ``key`` into the record type the registry names for it."""
    _, spec, params = match_key(key)
    record = decode_as(spec.record, raw, key)
    for param, fname in spec.bindings:
        want = params[param] if param == "node_id" else int(params[param])
        if getattr(record, fname) != want:
            raise RecordError(key, f"field {fname}={getattr(record, fname)!r} contradicts the key")
    return record


def decode_as(cls: type[Record], raw: bytes | str, key: str = "<value>") -> Record:
    """Decode ``raw`` as a ``cls`` record (no key pattern check)."""
    body = _parse(cls, raw, key)
    if not isinstance(body, dict):
        raise RecordError(key, f"expected a JSON object, got {type(body).__name__}")
    schema = body.pop("schema", None)
    if schema is None:
        raise RecordError(key, "missing 'schema' field")
    if schema != SCHEMA_VERSION:
        raise RecordError(key, f"unknown schema {schema!r} (this code reads {SCHEMA_VERSION})")
    kind = body.pop("kind", None)
    if kind != cls.KIND:
        raise RecordError(key, f"kind {kind!r} where {cls.KIND!r} ({cls.__name__}) belongs")
    return _from_dict(cls, body, key, "")


def _from_dict(cls: type, body: dict, key: str, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    body = {k: v for k, v in body.items() if k not in ("schema", "kind")} if not path else body
    optional = {f.name for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING}
    missing = [n for n in names if n not in body and n not in optional]
    unknown = sorted(set(body) - set(names))
    if missing:
        raise RecordError(key, f"missing field(s) {', '.join(path + n for n in missing)}")
    if unknown:
        raise RecordError(key, f"unknown field(s) {', '.join(path + n for n in unknown)}")
    values = {n: _coerce(body[n], hints[n], key, path + n) for n in names if n in body}
    for fname, allowed in getattr(cls, "CHOICES", {}).items():
        if values[fname] is not None and values[fname] not in allowed:
            raise RecordError(
                key, f"{path}{fname}={values[fname]!r} is not one of {', '.join(allowed)}"
            )
    return cls(**values)


def _coerce(value: Any, tp: Any, key: str, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, path)
    if origin is list:
        _expect(isinstance(value, list), value, "a list", key, path)
        return [_coerce(v, args[0], key, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _expect(isinstance(value, dict), value, "an object", key, path)
        return {k: _coerce(v, args[1], key, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        _expect(isinstance(value, dict), value, "an object", key, path)
        return _from_dict(tp, value, key, path + ".")
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _expect(ok and abs(value) <= sys.float_info.max, value, "a number", key, path)
        return float(value)
    if tp is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), value, "an integer",
                key, path)
        return value
    if tp is str:
        _expect(isinstance(value, str), value, "a string", key, path)
        return value
    if tp is bool:
        _expect(isinstance(value, bool), value, "a boolean", key, path)
        return value
    raise TypeError(f"schema field type {tp!r} at {path} is not supported")


def _expect(ok: bool, value: Any, what: str, key: str, path: str) -> None:
    if not ok:
        shown = repr(value) if not isinstance(value, (str, list, dict)) or len(value) < 40 \
            else f"of length {len(value)}"
        raise RecordError(key, f"field {path[:80]} must be {what}, got {type(value).__name__} "
                               f"{shown[:80]}")


def type_name(tp: Any) -> str:
    """The type of a record field as docs/etcd-schema.md spells it (e.g. ``int | null``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} | null"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return tp.__name__


def describe_fields(cls: type) -> list[tuple[str, str]]:
    """(field name, type name) of a record or nested type, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f.name, type_name(hints[f.name])) for f in dataclasses.fields(cls)]
