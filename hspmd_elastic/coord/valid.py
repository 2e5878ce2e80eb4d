"""Reading values from etcd that anyone able to write the job's prefix may have put there.

Promises:

* ``parse_value(raw, key, limit, what)`` parses one value as strict JSON: at most ``limit``
  bytes of UTF-8, no ``NaN``/``Infinity``, no number beyond a float's range, no nesting deep
  enough to exhaust the stack; anything else is a ``RecordError`` naming the key, whose message
  never echoes the value whole;
* ``decode_valid(kvs, log, where)`` decodes many values with ``schema.decode`` and returns the
  good ones as (key, record) pairs; a bad one is skipped, never raised, and logged as a warning
  once per (key, revision), so a reader that polls does not repeat itself: one forged record
  cannot take a reader down, nor flood its log;
* ``decode_or_none(kv, log, where)`` is the same for one value (None when absent or bad).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Iterable, Optional

from hspmd_elastic.coord.api import RecordError

_REMEMBERED = 4096  # bad (key, revision) pairs remembered so that each is logged once
_seen: "OrderedDict[tuple, None]" = OrderedDict()
_seen_lock = threading.Lock()


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
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
        return json.loads(data.decode("utf-8"), parse_float=_finite, parse_constant=_constant)
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
    from hspmd_elastic.coord import schema

    out = []
    for kv in kvs:
        key, value, revision = _parts(kv)
        try:
            out.append((key, schema.decode(key, value)))
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
