"""Hypothesis strategies of hostile etcd values for every key of the schema registry
(``schema.REGISTRY``), for ``tests/test_security_fuzz.py``.

For a ``KeySpec`` and the key's parameters, ``valid(spec, params)`` draws a record that decodes
at that key (every field of its type, each ``CHOICES`` field one of its values, the key's
bindings agreeing), built from the record's own type hints: a record type added to the registry
is covered without a change here, and a field type this module cannot draw fails loudly.
``hostile(spec, params)`` draws what an attacker with write access to the job's prefix may put
there instead, every one of which ``schema.decode`` must refuse with a ``RecordError``:

* ``garbage``: arbitrary bytes, text that is not JSON, deep nesting, a value over the key's
  size limit;
* ``wrong JSON type``: a JSON value that is not an object, or the key's record with one field
  of another JSON type, a field missing, an unknown field added;
* ``another key's record``: a valid record of another record type;
* ``wrong binding``: the key's record whose bound field contradicts the key;
* ``huge number``: an int field beyond a float's range, a float literal that overflows;
* ``NaN``: a float field written as ``NaN``, ``Infinity`` or ``-Infinity``;
* ``schema``: the key's record with a missing, older, newer or mistyped ``schema``, or a
  ``kind`` that is not its own; a field outside its ``CHOICES``.

``draw(strategy, n, seed)`` returns ``n`` examples of a strategy from a seeded, bounded
hypothesis run (no shrinking, no example database): the live fuzz draws its values with it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.events import EVENT_DETAILS
from hspmd_elastic.contract.records import MAX_VALUE_BYTES, MAX_VALUE_BYTES_BY_KIND, SCHEMA_VERSION

HOSTILE_KINDS = ("garbage", "wrong JSON type", "another key's record", "wrong binding",
                 "huge number", "NaN", "schema")
_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_JSON_SCALAR = st.none() | st.booleans() | st.integers(-2**53, 2**53) | _TEXT \
    | st.floats(allow_nan=False, allow_infinity=False)
_JSON = st.recursive(_JSON_SCALAR, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=8)


# ------------------------------------------------------------------------------ valid records
def _field_value(tp: Any, choices: tuple[str, ...] | None = None) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if choices:
        return st.sampled_from(choices)
    if tp is Any:
        return _JSON
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return st.none() | _field_value(inner[0])
    if origin is list:
        return st.lists(_field_value(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(_TEXT, _field_value(args[1]), max_size=3)
    if dataclasses.is_dataclass(tp):
        return _body(tp)
    simple = {str: _TEXT, int: st.integers(0, 2**53), bool: st.booleans(),
              float: st.floats(-1e12, 1e12, allow_nan=False)}
    if tp in simple:
        return simple[tp]
    raise TypeError(f"no strategy for field type {tp!r}: teach tests/_hostile.py about it")


def _body(cls: type) -> st.SearchStrategy:
    """The fields of a ``cls`` record or nested type as a JSON object (no schema/kind)."""
    hints, choices = typing.get_type_hints(cls), getattr(cls, "CHOICES", {})
    fields = {f.name: _field_value(hints[f.name], choices.get(f.name))
              for f in dataclasses.fields(cls)}
    if cls is schema.EventRecord:  # the detail is the type's dataclass
        return st.sampled_from(sorted(EVENT_DETAILS)).flatmap(
            lambda t: st.fixed_dictionaries(dict(fields, type=st.just(t),
                                                 detail=_body(EVENT_DETAILS[t]))))
    return st.fixed_dictionaries(fields)


def _bound(spec: schema.KeySpec, params: dict[str, str], body: dict) -> dict:
    for param, fname in spec.bindings:
        body[fname] = params[param] if param == "node_id" else int(params[param])
    return body


def valid(spec: schema.KeySpec, params: dict[str, str]) -> st.SearchStrategy:
    """A record body (with ``schema`` and ``kind``) that decodes at the key."""
    return _body(spec.record).map(lambda b: _bound(spec, params, {
        "schema": SCHEMA_VERSION, "kind": spec.record.KIND, **b}))


def dumps(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, allow_nan=True).encode("utf-8")


# ----------------------------------------------------------------------------- hostile values
def _fields(cls: type, kinds: tuple[type, ...]) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if hints[f.name] in kinds
            or any(a in kinds for a in typing.get_args(hints[f.name]))]


def _with(body: dict, name: str, raw: str) -> bytes:
    """``body`` as JSON with field ``name``'s value replaced by the literal ``raw``."""
    mark = "\x00HOSTILE\x00"
    return dumps(dict(body, **{name: mark})).replace(json.dumps(mark).encode(), raw.encode())


def _limit(spec: schema.KeySpec) -> int:
    return MAX_VALUE_BYTES_BY_KIND.get(spec.record.KIND, MAX_VALUE_BYTES)


def _garbage(spec: schema.KeySpec) -> st.SearchStrategy:
    over = _limit(spec) + 1
    return st.one_of(
        st.binary(max_size=64).filter(lambda b: not _is_object(b)),
        st.sampled_from([b"", b"{", b"{not json", b"\xff\xfe\x00", b"[" * 20_000,
                         b'{"a":' * 5_000, b"\x00" * 8, "\u202e<script>".encode()]),
        st.just(b'{"schema": 2, "pad": "' + b"x" * over + b'"}'))


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def _mutations(spec: schema.KeySpec, params: dict[str, str], body: dict) -> st.SearchStrategy:
    """Hostile variants of one valid ``body`` of the key's record type."""
    cls, out = spec.record, []
    names = [f.name for f in dataclasses.fields(cls)]
    ints, floats = _fields(cls, (int,)), _fields(cls, (float,))
    wrong = st.sampled_from([None, "1", [], {}, True, 1.5, "\x1b[2J"])
    out.append(st.tuples(st.sampled_from(names), wrong)
               .filter(lambda nv: not _fits(cls, nv[0], nv[1]))
               .map(lambda nv: dumps(dict(body, **{nv[0]: nv[1]}))))
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if required:
        out.append(st.sampled_from(required).map(
            lambda n: dumps({k: v for k, v in body.items() if k != n})))
    out.append(st.just(dumps(dict(body, injected="<script>"))))
    if ints:
        out.append(st.tuples(st.sampled_from(ints), st.integers(309, 4000), st.booleans()).map(
            lambda t: _with(body, t[0], ("-" if t[2] else "") + "1" + "0" * t[1])))
    if floats:
        out.append(st.tuples(st.sampled_from(floats), st.sampled_from(
            ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])).map(
            lambda t: _with(body, t[0], t[1])))
    out.append(st.sampled_from([None, 1, 3, "2", [2], -2, 2**64]).map(
        lambda s: dumps(dict(body, schema=s)) if s is not None
        else dumps({k: v for k, v in body.items() if k != "schema"})))
    others = sorted({s.record.KIND for s in schema.REGISTRY} - {cls.KIND})
    out.append(st.sampled_from([None, *others, "", "NODE"]).map(
        lambda k: dumps(dict(body, kind=k))))
    for fname in getattr(cls, "CHOICES", {}):
        out.append(_TEXT.filter(lambda v, f=fname: v not in cls.CHOICES[f]).map(
            lambda v, f=fname: dumps(dict(body, **{f: v}))))
    for param, fname in spec.bindings:
        want = params[param] if param == "node_id" else int(params[param])
        other = st.just(want + "x") if isinstance(want, str) else st.integers(0, 2**40).filter(
            lambda v, w=want: v != w)
        out.append(other.map(lambda v, f=fname: dumps(dict(body, **{f: v}))))
    return st.one_of(out)


def _fits(cls: type, name: str, value: Any) -> bool:
    """Whether ``value`` is of field ``name``'s type (then it is no wrong type)."""
    try:
        schema._coerce(value, typing.get_type_hints(cls)[name], "<k>", name)
    except schema.RecordError:
        return False
    return not (value is not None and name in getattr(cls, "CHOICES", {})
                and value not in cls.CHOICES[name])


def _foreign(spec: schema.KeySpec) -> st.SearchStrategy:
    """A valid record of another record type (its own key's bindings ignored)."""
    others = [s for s in schema.REGISTRY if s.record is not spec.record]
    return st.sampled_from(others).flatmap(
        lambda o: _body(o.record).map(lambda b: dumps(
            {"schema": SCHEMA_VERSION, "kind": o.record.KIND, **b})))


def hostile(spec: schema.KeySpec, params: dict[str, str]) -> st.SearchStrategy:
    """Values ``schema.decode`` must refuse at a key of ``spec`` with ``params``."""
    json_not_object = _JSON.filter(lambda v: not isinstance(v, dict)).map(dumps)
    return st.one_of(_garbage(spec), json_not_object, _foreign(spec),
                     valid(spec, params).flatmap(lambda b: _mutations(spec, params, b)))


# ------------------------------------------------------------------------------------ keys
PARAM_VALUES = {
    "node_id": st.from_regex(r"\Afz-[a-z0-9]{1,8}\Z"),
    "index": st.integers(0, 10**6).map(str),
    "local_rank": st.integers(0, 10**6).map(str),
    "lease_hex": st.from_regex(r"\A[0-9a-f]{16}\Z"),
    "version": st.integers(900_000, 10**12 - 1).map(lambda v: f"{v:012d}"),
    "seq": st.integers(900_000, 10**12 - 1).map(lambda v: f"{v:012d}"),
    "round": st.integers(900_000, 10**12 - 1).map(lambda v: f"{v:012d}"),
}


def params_of(spec: schema.KeySpec) -> list[str]:
    return [p for i, p in enumerate(spec.pattern.replace(">", "<").split("<")) if i % 2]


def key_params(spec: schema.KeySpec) -> st.SearchStrategy:
    """Parameters of a key of ``spec`` no live job of the tests uses (fake node ids, versions
    and sequence numbers far above a test job's)."""
    return st.fixed_dictionaries({p: PARAM_VALUES[p] for p in params_of(spec)})


def key_of(job: str, spec: schema.KeySpec, params: dict[str, str]) -> str:
    rest = spec.pattern
    for name, value in params.items():
        rest = rest.replace(f"<{name}>", value)
    return schema.job_prefix(job) + rest


# ------------------------------------------------------------------------------------ draws
def draw(strategy: st.SearchStrategy, n: int, seed_value: int = 0) -> list[Any]:
    """``n`` examples of ``strategy`` from a seeded hypothesis run (the same every time)."""
    got: list[Any] = []

    @seed(seed_value)
    @settings(max_examples=n, database=None, phases=(Phase.generate,), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: Any) -> None:
        got.append(value)

    collect()
    return got[:n]
