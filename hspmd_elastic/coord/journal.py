"""The job's event journal: ``events/<seq>`` with gap-free sequence numbers.

Promises: ``append_event`` (``append_events`` for several, up to ``EVENTS_PER_TXN`` per
transaction) allocates the next sequence number with a compare-and-set on ``event_seq`` and
writes the event in the same transaction, so concurrent writers never share or
skip a number; a transaction retried after a lost answer is recognised (the event is found
written) instead of being appended twice; it gives up with ``EtcdTimeoutError`` after ``timeout``
seconds of contention. A bad record at ``event_seq`` is logged once and counted past, never
taken for an outage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.errors import RecordError
from hspmd_elastic.coord.api import Compare, CompareTarget, EtcdTimeoutError, PutOp
from hspmd_elastic.coord.client import EtcdClient

log = logging.getLogger(__name__)

EVENTS_PER_TXN = 100  # etcd refuses a transaction of more than 128 operations by default


@dataclass(frozen=True)
class NewEvent:
    """An event to append: its type, node, typed detail (``contract.events``: the dataclass
    ``EVENT_DETAILS[type]`` names, checked here) and timings (``EventRecord`` without the
    sequence number and time, which the append assigns)."""

    type: str
    node: Optional[str]
    detail: schema.Detail
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        schema.check_detail(self.type, self.detail)


def append_event(client: EtcdClient, job: str, type: str, node: Optional[str],
                 detail: schema.Detail, timings: Optional[dict[str, float]] = None,
                 timeout: float = 5.0,
                 wall_clock: Callable[[], float] = time.time) -> schema.EventRecord:
    """Append one event to ``job``'s journal and return it (with its sequence number)."""
    return append_events(client, job, [NewEvent(type, node, detail, dict(timings or {}))],
                         timeout, wall_clock)[0]


def append_events(client: EtcdClient, job: str, events: Sequence[NewEvent],
                  timeout: float = 5.0, wall_clock: Callable[[], float] = time.time,
                  per_txn: int = EVENTS_PER_TXN) -> list[schema.EventRecord]:
    """Append ``events`` in order with consecutive sequence numbers, ``per_txn`` of them per
    transaction (one compare-and-set of ``event_seq`` each: a leader's hundreds of change events
    cost a few writes, not hundreds); returns them as written."""
    out: list[schema.EventRecord] = []
    for i in range(0, len(events), per_txn):
        out += _append_chunk(client, job, events[i:i + per_txn], timeout, wall_clock)
    return out


def _append_chunk(client, job, events, timeout, wall_clock) -> list[schema.EventRecord]:
    counter_key = schema.event_seq_key(job)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(counter_key)
        last = _counter(client, job, kv)
        at = wall_clock()
        records = [schema.new_event_record(last + 1 + i, e.type, e.node, e.detail, e.timings,
                                           at) for i, e in enumerate(events)]
        payloads = [schema.encode(r) for r in records]
        res = client.txn(
            [Compare(counter_key, CompareTarget.MOD, "==", kv.mod_revision if kv else 0)],
            [PutOp(counter_key, schema.CounterRecord(value=last + len(records)).to_json()),
             *(PutOp(schema.event_key(job, r.seq), p) for r, p in zip(records, payloads))],
        )
        if res.succeeded or _already_written(client, job, records[-1].seq, payloads[-1]):
            return records
    kinds = ", ".join(sorted({e.type for e in events}))
    raise EtcdTimeoutError(f"append {kinds} event(s) to job {job}: sequence contended for "
                           f"{timeout}s")


def _counter(client: EtcdClient, job: str, kv) -> int:
    """The last allocated sequence number. A bad record at ``event_seq`` is not an outage: it
    is logged once, and the count goes on from the newest event in the journal (the
    compare-and-set then overwrites the bad value with a good one)."""
    if kv is None:
        return 0
    key = schema.event_seq_key(job)
    try:
        return schema.decode(key, kv.value).value
    except RecordError as exc:
        newest = 0
        for ev in client.get_prefix(schema.events_prefix(job)):
            tail = ev.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                newest = max(newest, int(tail))
        if (job, kv.mod_revision) not in _bad_counters:
            _bad_counters.add((job, kv.mod_revision))
            log.warning("%s; the journal goes on from its newest event, seq %d", exc, newest)
        return newest


_bad_counters: set[tuple[str, int]] = set()  # (job, mod revision) of bad counters logged


def _already_written(client: EtcdClient, job: str, seq: int, payload: bytes) -> bool:
    """True when ``events/<seq>`` holds exactly ``payload``: our own write, applied by etcd on an
    attempt whose answer was lost and then retried by the client."""
    kv = client.get(schema.event_key(job, seq))
    return kv is not None and kv.value == payload


def read_events(client: EtcdClient, job: str, after_seq: int = 0) -> list[schema.EventRecord]:
    """The journal's events with ``seq > after_seq``, in order (bad records raise RecordError)."""
    snap = client.get_prefix(schema.events_prefix(job))
    events = [schema.decode(kv.key, kv.value) for kv in snap]
    return [e for e in events if e.seq > after_seq]
