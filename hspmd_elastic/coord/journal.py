"""The job's event journal: ``events/<seq>`` with gap-free sequence numbers.

Promises: ``append_event`` allocates the next sequence number with a compare-and-set on
``event_seq`` and writes the event in the same transaction, so concurrent writers never share or
skip a number; a transaction retried after a lost answer is recognised (the event is found
written) instead of being appended twice; it gives up with ``EtcdTimeoutError`` after ``timeout``
seconds of contention.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import Compare, CompareTarget, EtcdTimeoutError, PutOp
from hspmd_elastic.coord.client import EtcdClient


def append_event(client: EtcdClient, job: str, type: str, node: Optional[str] = None,
                 detail: Optional[dict[str, Any]] = None,
                 timings: Optional[dict[str, float]] = None, timeout: float = 5.0,
                 wall_clock: Callable[[], float] = time.time) -> schema.EventRecord:
    """Append one event to ``job``'s journal and return it (with its sequence number)."""
    counter_key = schema.event_seq_key(job)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(counter_key)
        last = schema.decode(counter_key, kv.value).value if kv else 0
        event = schema.EventRecord(seq=last + 1, type=type, node=node, detail=dict(detail or {}),
                                   timings=dict(timings or {}), at=wall_clock())
        payload = schema.encode(event)
        res = client.txn(
            [Compare(counter_key, CompareTarget.MOD, "==", kv.mod_revision if kv else 0)],
            [PutOp(counter_key, schema.CounterRecord(value=last + 1).to_json()),
             PutOp(schema.event_key(job, last + 1), payload)],
        )
        if res.succeeded or _already_written(client, job, event.seq, payload):
            return event
    raise EtcdTimeoutError(f"append {type} event to job {job}: sequence contended for {timeout}s")


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
