"""The etcd key schema of a job, its registry and its codec (CONTRACT: read by dashboards and
etcdctl). ``from hspmd_elastic.contract import schema`` gives the key builders (``keys``), the
records (``records``) and the event details (``events``) under one name.

Promises:

* every key lives under ``/hspmd/v1/jobs/<job_id>/`` and is built by one function of
  ``keys.py``; numbers in keys are zero-padded so lexicographic order is numeric order;
* every value is a UTF-8 JSON object with ``"schema": SCHEMA_VERSION`` and a ``"kind"`` naming
  its record type; no pickle, no base64; fields added after a record type was first written have
  defaults and may be absent from older values (they decode to the default);
* ``REGISTRY`` is the single table of key patterns -> record types; ``decode(key, raw)`` uses it
  and returns the right record or raises ``RecordError`` naming the key and what is wrong
  (malformed JSON, missing or unknown schema, wrong kind, missing/unknown/mistyped fields, a
  field that contradicts the key); docs/etcd-schema.md is checked against it by a test;
* ``parse_value(raw, key, limit, what)`` parses one value as strict JSON: at most ``limit``
  bytes of UTF-8, no ``NaN``/``Infinity``, no number beyond a float's range, no nesting deep
  enough to exhaust the stack; anything else is a ``RecordError`` naming the key, whose message
  never echoes the value whole;
* ``decode_valid(kvs, log, where)`` decodes many values with ``decode`` and returns the good ones
  as (key, record) pairs; a bad one is skipped, never raised, and logged as a warning once per
  (key, revision), so a reader that polls does not repeat itself: one forged record cannot take
  a reader down, nor flood its log; ``decode_or_none(kv, log, where)`` is the same for one value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import threading
import types
import typing
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from hspmd_elastic.contract.errors import RecordError
# the event details, re-exported: schema.<name> is the contract's one name
from hspmd_elastic.contract.events import (  # noqa: F401
    change_detail, CHANGE_TYPES, ChangeDetail, check_detail, Detail, DrainedDetail, EVENT_DETAILS,
    EVENT_TYPES, EventType, ExitInfo, FailureDetail, FallbackDetail, IdleDevice,
    NESTED_DETAIL_TYPES, PlanChange, ReplanDetail, RestartDetail, SpeedsDetail, StallDetail,
    SwitchDoneDetail, SwitchFailedDetail,
)
from hspmd_elastic.contract.ids import ID_PATTERN
# the key builders, re-exported
from hspmd_elastic.contract.keys import (  # noqa: F401
    check_id, claim_key, claims_prefix, device_key, devices_prefix, election_key, election_prefix,
    event_key, event_seq_key, events_prefix, fault_script_key, ID_RE, job_prefix, leader_key,
    node_key, nodes_prefix, PAD, plan_current_key, plan_head_key, plan_history_key,
    plan_history_prefix, plan_layout_key, plan_stamp_key, rdzv_done_key, rdzv_join_key,
    rdzv_master_key, rdzv_prefix, rdzv_round_prefix, rdzv_state_key, reach_key, reach_prefix,
    retry_key, retry_prefix, ROOT, switch_ack_key, switch_prefix, worker_key, workers_prefix,
)
# the records, re-exported
from hspmd_elastic.contract.records import (  # noqa: F401
    AGENT_MODES, CandidateRecord, CounterRecord, DEVICE_STATES, DeviceHealthRecord, DeviceInfo,
    EventRecord, FaultScriptRecord, GONE_NODE_STATES, LeaderRecord, MAX_VALUE_BYTES,
    MAX_VALUE_BYTES_BY_KIND, NESTED_TYPES, NODE_STATES, NodeClaimRecord, NodeRecord, NodeState,
    PlanHeadRecord, PlanLayoutRecord, PlanRecord, PlanStampRecord, RDZV_STATES, RdzvDoneRecord,
    RdzvJoinRecord, RdzvMasterRecord, RdzvParticipant, RdzvStateRecord, ReachRecord, Record,
    RECORD_TYPES, RetryRecord, SCHEMA_VERSION, SWITCH_STATES, SwitchAckRecord, VERDICT_ORIGINS,
    VerdictOrigin, WorkerRecord,
)

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
    KeySpec("plan/stamp", PlanStampRecord, "none", "leader (fenced)"),
    KeySpec("plan/layout", PlanLayoutRecord, "none", "leader (fenced)"),
    KeySpec("claims/<node_id>", NodeClaimRecord, "agent", "node agent (create-if-absent)",
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
    decoded = _from_dict(type(record), _parse(type(record), raw, "<encode>"), "<encode>", "")
    if isinstance(decoded, EventRecord):
        _detail_of(decoded, "<encode>")
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
    if isinstance(schema, int) and not isinstance(schema, bool) and 0 < schema < SCHEMA_VERSION:
        raise RecordError(key, f"schema {schema} was written by an older hspmd-elastic; this code "
                               f"reads schema {SCHEMA_VERSION} (run the job under a new job id)")
    if schema != SCHEMA_VERSION:
        raise RecordError(key, f"unknown schema {schema!r} (this code reads {SCHEMA_VERSION})")
    kind = body.pop("kind", None)
    if kind != cls.KIND:
        raise RecordError(key, f"kind {kind!r} where {cls.KIND!r} ({cls.__name__}) belongs")
    record = _from_dict(cls, body, key, "")
    if isinstance(record, EventRecord):
        _detail_of(record, key)
    return record


# ----------------------------------------------------------------------------- event details
def _detail_of(event: EventRecord, key: str) -> Detail:
    cls = EVENT_DETAILS[event.type]  # the type was checked against EVENT_TYPES already
    return _from_dict(cls, event.detail, key, "detail.")


def event_detail(event: EventRecord) -> Detail:
    """The typed detail of a decoded event (``events.EVENT_DETAILS[event.type]``); a detail
    that does not fit its type (an event built by hand) raises ``RecordError``."""
    return _detail_of(event, f"<{event.type} event #{event.seq}>")


def new_event_record(seq: int, type_: str, node: Optional[str], detail: Detail,
                     timings: dict[str, float], at: float) -> EventRecord:
    """The ``EventRecord`` of a typed detail (``ValueError`` when the detail is not its type's)."""
    check_detail(type_, detail)
    return EventRecord(seq=seq, type=type_, node=node, detail=detail.to_dict(),
                       timings=dict(timings), at=at)


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
        if values.get(fname) is not None and values[fname] not in allowed:
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


# ------------------------------------------------------------------------- values from etcd
_REMEMBERED = 4096  # bad (key, revision) pairs remembered so that each is logged once
_seen: "OrderedDict[tuple, None]" = OrderedDict()
_seen_lock = threading.Lock()


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _integer(text: str) -> int:
    value = int(text)
    if abs(value) > sys.float_info.max:  # as for floats: no number beyond a float's range
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_value(raw: bytes | str, key: str, limit: int, what: str = "values") -> Any:
    """``raw`` parsed as strict JSON of at most ``limit`` bytes (``RecordError`` otherwise)."""
    data = raw.encode("utf-8", "replace") if isinstance(raw, str) else bytes(raw)
    if len(data) > limit:
        raise RecordError(key, f"value of {len(data)} bytes is over the {limit}-byte limit of "
                               f"{what}")
    try:
        return json.loads(data.decode("utf-8"), parse_float=_finite, parse_int=_integer,
                          parse_constant=_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(key, f"malformed JSON: {exc}") from exc
    except RecursionError:
        raise RecordError(key, "malformed JSON: nested too deeply") from None


def _first_time(where: str, key: str, revision: Any) -> bool:
    mark = (where, key, revision)
    with _seen_lock:
        if mark in _seen:
            _seen.move_to_end(mark)
            return False
        _seen[mark] = None
        while len(_seen) > _REMEMBERED:
            _seen.popitem(last=False)
        return True


def _parts(kv: Any) -> tuple[str, bytes, Any]:
    if isinstance(kv, tuple):
        key, value = kv[0], kv[1]
        return key, value, hash(value)
    return kv.key, kv.value, getattr(kv, "mod_revision", None) or hash(kv.value)


def decode_valid(kvs: Iterable[Any], log: Optional[logging.Logger] = None, where: str = "",
                 bad: Optional[list] = None) -> list[tuple[str, Any]]:
    """(key, record) of every value in ``kvs`` (``KeyValue``s or (key, value) pairs) that
    decodes; the others are logged once and skipped (appended to ``bad`` as (key, problem))."""
    out = []
    for kv in kvs:
        key, value, revision = _parts(kv)
        try:
            out.append((key, decode(key, value)))
        except RecordError as exc:
            if bad is not None:
                bad.append((key, exc.problem))
            if log is not None and _first_time(where, key, revision):
                log.warning("%sskipping a bad record: %s", f"{where}: " if where else "", exc)
    return out


def decode_or_none(kv: Any, log: Optional[logging.Logger] = None, where: str = "") -> Any:
    """The record of one ``KeyValue`` (None when ``kv`` is None or its value is bad)."""
    if kv is None:
        return None
    good = decode_valid([kv], log, where)
    return good[0][1] if good else None


# ----------------------------------------------------------------------------- switch pairing
@dataclass(frozen=True)
class SwitchMark:
    """What an event says about a switch: it ``starts`` one into ``to_version`` (a ``replan``
    that replaces a plan) or ends one (``done`` or ``failed``)."""

    to_version: int
    from_version: int
    phase: str  # start | done | failed
    bytes_moved: int = 0
    reason: str = ""


def switch_of(event: Any, detail: Optional[Detail] = None) -> Optional[SwitchMark]:
    """The switch ``event`` (an ``EventRecord``) starts or ends, or None. ``detail``: its typed
    detail when the caller has it already (else read from the event)."""
    if event.type not in (EventType.REPLAN.value, EventType.SWITCH_DONE.value,
                          EventType.SWITCH_FAILED.value):
        return None
    if detail is None:
        detail = event_detail(event)
    if isinstance(detail, ReplanDetail):
        if detail.previous_version <= 0:
            return None  # the first plan: nothing to switch from
        return SwitchMark(detail.version, detail.previous_version, "start", 0, detail.reason)
    if isinstance(detail, SwitchDoneDetail):
        return SwitchMark(detail.plan_version, detail.from_version, "done", detail.bytes_moved)
    if isinstance(detail, SwitchFailedDetail):
        return SwitchMark(detail.plan_version, detail.from_version, "failed", 0,
                          detail.error + (f" ({detail.why})" if detail.why else ""))
    return None
