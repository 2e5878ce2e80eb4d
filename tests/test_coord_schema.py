"""Key schema and records: builders, ordering, JSON round-trips, typed decode errors."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.coord import RecordError
from hspmd_elastic.contract import schema

JOB = "job-1"

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True)


def _strategy(tp, cls=None, name=None):
    choices = getattr(cls, "CHOICES", {}).get(name) if cls else None
    if choices:
        return st.sampled_from(choices)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return _json
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        inner = [a for a in args if a is not type(None)][0]
        return st.none() | _strategy(inner)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), _strategy(args[1]), max_size=3)
    if dataclasses.is_dataclass(tp):
        return _record_strategy(tp)
    return {int: st.integers(0, 2**53), float: _finite, str: st.text(max_size=12),
            bool: st.booleans()}[tp]


def _record_strategy(cls):
    if cls is schema.EventRecord:
        return _event_strategy()
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _strategy(hints[f.name], cls, f.name)
                             for f in dataclasses.fields(cls)})


def _event_strategy():
    """An event whose detail is its type's dataclass (anything else does not encode)."""
    def build(type_, detail, seq, node, timings, at):
        return schema.new_event_record(seq, type_, node, detail, timings, at)

    return st.sampled_from(schema.EVENT_TYPES).flatmap(lambda t: st.builds(
        build, st.just(t), _record_strategy(schema.EVENT_DETAILS[t]),
        st.integers(0, 10**schema.PAD - 1),  # an event's seq is a key's padded number
        st.none() | _ids, st.dictionaries(st.text(max_size=6), _finite, max_size=3), _finite))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(schema.RECORD_TYPES).flatmap(_record_strategy))
def test_every_record_round_trips_through_json(record):
    raw = schema.encode(record)
    body = json.loads(raw.decode("utf-8"))
    assert body["schema"] == schema.SCHEMA_VERSION and body["kind"] == record.KIND
    assert schema.decode_as(type(record), raw) == record


@settings(max_examples=60, deadline=None)
@given(_event_strategy())
def test_every_event_detail_round_trips_through_its_dataclass(event):
    back = schema.decode(schema.event_key(JOB, event.seq), schema.encode(event))
    detail = schema.event_detail(back)
    assert type(detail) is schema.EVENT_DETAILS[event.type]
    assert detail.to_dict() == event.detail and back == event


def _sample(cls):
    """One instance of a detail dataclass with every field set (nested ones included)."""
    def value(tp):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
            return value([a for a in args if a is not type(None)][0])
        if origin is list:
            return [value(args[0])]
        if origin is dict:
            return {value(args[0]): value(args[1])}
        if dataclasses.is_dataclass(tp):
            return _sample(tp)
        return {int: 3, float: 1.5, str: "n0:1", bool: True}[tp]
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: value(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("type_", schema.EVENT_TYPES)
def test_a_detail_key_no_dataclass_declares_is_refused(type_):
    """Walk the registry: for every event type, a detail with a key its dataclass does not
    declare, one missing a required field, or the dataclass of another type is refused."""
    cls = schema.EVENT_DETAILS[type_]
    hints = typing.get_type_hints(cls)
    sample = _sample(cls)
    good = schema.new_event_record(1, type_, "n0", sample, {}, 0.0)
    key = schema.event_key(JOB, 1)
    assert schema.decode(key, schema.encode(good)) == good
    forged = dict(json.loads(schema.encode(good)), detail=dict(good.detail, bytes_moved_x=1))
    with pytest.raises(RecordError, match="unknown field.*detail.bytes_moved_x"):
        schema.decode(key, json.dumps(forged))
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        body = dict(json.loads(schema.encode(good)))
        body["detail"] = {k: v for k, v in good.detail.items() if k != name}
        with pytest.raises(RecordError, match=f"missing field.*detail.{name}"):
            schema.decode(key, json.dumps(body))
    assert hints  # every detail declares its fields
    other = next(c for c in (schema.ReplanDetail, schema.RestartDetail) if c is not cls)
    with pytest.raises(ValueError, match=f"a {type_} event carries a {cls.__name__}"):
        schema.new_event_record(1, type_, "n0", _sample(other), {}, 0.0)


def test_a_record_of_the_older_schema_is_refused_in_one_line():
    old = b'{"schema": 1, "kind": "node", "host": "h", "agent_pid": 1, "devices": [], ' \
          b'"state": "ready", "started_at": 0.0}'
    with pytest.raises(RecordError) as err:
        schema.decode(KEY, old)
    assert "schema 1 was written by an older hspmd-elastic" in str(err.value)
    assert "\n" not in str(err.value)


@settings(max_examples=30, deadline=None)
@given(node=_ids, index=st.integers(0, 64), version=st.integers(0, 10**6),
       seq=st.integers(0, 10**6))
def test_keys_match_their_registry_pattern(node, index, version, seq):
    cases = {
        schema.node_key(JOB, node): schema.NodeRecord,
        schema.device_key(JOB, node, index): schema.DeviceHealthRecord,
        schema.worker_key(JOB, node, index): schema.WorkerRecord,
        schema.election_key(JOB, 0x1234abcd): schema.CandidateRecord,
        schema.leader_key(JOB): schema.LeaderRecord,
        schema.plan_current_key(JOB): schema.PlanRecord,
        schema.plan_history_key(JOB, version): schema.PlanRecord,
        schema.event_key(JOB, seq): schema.EventRecord,
        schema.event_seq_key(JOB): schema.CounterRecord,
        schema.switch_ack_key(JOB, version, node): schema.SwitchAckRecord,
        schema.rdzv_state_key(JOB): schema.RdzvStateRecord,
        schema.rdzv_join_key(JOB, seq, node): schema.RdzvJoinRecord,
        schema.rdzv_master_key(JOB, seq): schema.RdzvMasterRecord,
        schema.rdzv_done_key(JOB, seq, node): schema.RdzvDoneRecord,
    }
    for key, cls in cases.items():
        assert key.startswith(f"/hspmd/v1/jobs/{JOB}/")
        job, spec, _ = schema.match_key(key)
        assert job == JOB and spec.record is cls


@given(st.lists(st.integers(0, 10**11), min_size=2, max_size=20))
def test_padded_keys_sort_numerically(numbers):
    keys = [schema.plan_history_key(JOB, n) for n in numbers]
    assert sorted(keys) == [schema.plan_history_key(JOB, n) for n in sorted(numbers)]
    events = [schema.event_key(JOB, n) for n in numbers]
    assert sorted(events) == [schema.event_key(JOB, n) for n in sorted(numbers)]


@pytest.mark.parametrize("bad", ["", "a/b", "-x", "x y", "é", "a" * 129])
def test_bad_ids_are_refused_with_one_line(bad):
    with pytest.raises(ValueError, match="node id") as err:
        schema.node_key(JOB, bad)
    assert "\n" not in str(err.value)


def test_bad_numbers_are_refused():
    with pytest.raises(ValueError, match="plan version"):
        schema.plan_history_key(JOB, -1)
    with pytest.raises(ValueError, match="12 digits"):
        schema.event_key(JOB, 10**12)


def _node(**kw):
    base = dict(host="h", agent_pid=1, devices=[schema.DeviceInfo(0, "H200", 1 << 30, "GPU-x")],
                state="ready", started_at=1.5)
    base.update(kw)
    return schema.NodeRecord(**base)


KEY = schema.node_key(JOB, "n0")


@pytest.mark.parametrize("raw, problem", [
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"kind": "node"}', "missing 'schema'"),
    (b'{"schema": 3, "kind": "node"}', "unknown schema 3"),
    (b'{"schema": 2, "kind": "worker"}', "kind 'worker'"),
    (b'{"schema": 2, "kind": "node", "host": "h"}', "missing field(s) agent_pid"),
])
def test_decode_names_key_and_problem(raw, problem):
    with pytest.raises(RecordError) as err:
        schema.decode(KEY, raw)
    assert err.value.key == KEY and problem in str(err.value) and KEY in str(err.value)


def test_decode_checks_field_types_choices_and_key_bindings():
    body = json.loads(_node().to_json())
    for field, value, problem in [
        ("agent_pid", "7", "agent_pid must be an integer"),
        ("agent_pid", True, "agent_pid must be an integer"),
        ("started_at", "now", "started_at must be a number"),
        ("devices", {}, "devices must be a list"),
        ("state", "dancing", "not one of"),
        ("extra", 1, r"unknown field\(s\) extra"),
    ]:
        bad = dict(body, **{field: value})
        with pytest.raises(RecordError, match=problem):
            schema.decode(KEY, json.dumps(bad).encode())
    bad_dev = dict(body, devices=[{"index": 0, "type": "x", "memory_bytes": "big", "uuid": "u"}])
    with pytest.raises(RecordError, match=r"devices\[0\].memory_bytes"):
        schema.decode(KEY, json.dumps(bad_dev).encode())
    plan = schema.PlanRecord(version=3, reason="r", devices=[], strategy={}, store_endpoint="h:1",
                             created_at=0.0)
    assert schema.decode(schema.plan_history_key(JOB, 3), plan.to_json()) == plan
    with pytest.raises(RecordError, match="contradicts the key"):
        schema.decode(schema.plan_history_key(JOB, 4), plan.to_json())


def test_decode_rejects_unknown_keys():
    with pytest.raises(RecordError, match="no record type"):
        schema.decode(f"/hspmd/v1/jobs/{JOB}/nope", b"{}")
    with pytest.raises(RecordError, match="not under"):
        schema.decode("/other/x", b"{}")


def test_encode_refuses_non_json_values():
    with pytest.raises(RecordError, match="not encodable"):
        schema.encode(_node(started_at=float("nan")))
    assert b"pickle" not in schema.encode(_node())
