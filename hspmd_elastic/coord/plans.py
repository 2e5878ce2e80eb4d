"""Reading and publishing the job's plan (``plan/current`` + ``plan/head`` + ``plan/stamp`` +
``plan/layout`` + ``plan/history/<version>``).

Promises: ``publish_plan`` writes the three keys in one transaction fenced on the leader's
election key and on the ``plan/current`` revision the leader decided from, so a deposed leader
gets ``FencedWriteRejected`` and a leader racing a newer plan gets ``ConflictError``; the version
must be exactly one more than the current one; the record is stamped with the leader's node and
term (its fence), so etcd's revisions show which leadership wrote each plan.

``plan/head`` (``PlanHeadRecord``, built by the pure ``plan_head``) is what a node agent needs of
a plan: its version, store, step, the digest of the full record, and its devices and drains in
rank order as runs per node (``"node-7:0-7"``): a few bytes per node where the full record lists
every device in its strategy and inventory too (367 KiB at 8,000 devices). Node agents follow
the head. ``read_plan_head`` falls back to the full record when the head is missing or older
than ``plan/current`` (a plan published by a leader that predates the head).

Workers need more than the head (the strategy) but not the inventory, and learn of a new plan
from a smaller record still, as there are eight of them per node: ``plan/layout``
(``PlanLayoutRecord``, built by the pure ``plan_layout``: the head's fields plus the strategy
with its pipelines as runs, ``coord.strategy_runs``; ``layout_plan`` turns it back into the
``PlanRecord`` a switch needs) and ``plan/stamp`` (``PlanStampRecord``: version, created_at,
the digests of the record and of the layout: about 250 bytes). ``read_plan_stamp`` is the
stamp's ``read_plan_head``: when ``plan/current`` has no stamp of its own it returns the full
record, with a stamp built from it (``layout_digest`` empty).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from typing import Iterable, Optional, Union

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import Compare, CompareTarget, ConflictError, GetOp, PutOp
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.ids import device_id, parse_device_id
from hspmd_elastic.coord.election import Election
from hspmd_elastic.coord.strategy_runs import compact_strategy, expand_strategy
from hspmd_elastic.contract.errors import RecordError

log = logging.getLogger(__name__)

AnyPlan = Union[schema.PlanRecord, schema.PlanHeadRecord]


def read_plan(client: EtcdClient, job: str) -> tuple[Optional[schema.PlanRecord], int]:
    """The current plan (None before the first) and the mod revision of ``plan/current``."""
    key = schema.plan_current_key(job)
    kv = client.get(key)
    if kv is None:
        return None, 0
    return schema.decode(key, kv.value), kv.mod_revision


def publish_plan(election: Election, plan: schema.PlanRecord, read_revision: int,
                 current_version: int = 0) -> int:
    """Publish ``plan`` (with its head, stamp and layout) as the leader; ``read_revision`` is
    what ``read_plan`` returned (0: no plan yet). Returns the revision of the write."""
    if plan.version != current_version + 1:
        raise ValueError(
            f"plan version {plan.version} must be current version {current_version} + 1"
        )
    job = election.job
    plan = dataclasses.replace(plan, leader=election.node, term=election.term)
    current = schema.plan_current_key(job)
    res = election.fenced_txn([Compare(current, CompareTarget.MOD, "==", read_revision)],
                              plan_puts(job, plan))
    if not res.succeeded:
        raise ConflictError(
            f"plan v{plan.version} of job {job} not published: {current} changed after "
            f"revision {read_revision}"
        )
    return res.revision


def plan_puts(job: str, plan: schema.PlanRecord) -> list[PutOp]:
    """The writes that publish ``plan`` (pure): ``plan/current``, its head, its history entry,
    its stamp and, when its strategy has a layout, ``plan/layout``. ``publish_plan`` sends them
    in its fenced transaction; a test that plays the leader sends them in a plain one."""
    payload = schema.encode(plan)
    layout = _layout_payload(plan, payload)
    puts = [PutOp(schema.plan_current_key(job), payload),
            PutOp(schema.plan_head_key(job), schema.encode(plan_head(plan, payload))),
            PutOp(schema.plan_history_key(job, plan.version), payload),
            PutOp(schema.plan_stamp_key(job), schema.encode(plan_stamp(plan, payload, layout)))]
    if layout is not None:
        puts.append(PutOp(schema.plan_layout_key(job), layout))
    return puts


# ----------------------------------------------------------------------------- the head (pure)
def plan_digest(payload: bytes) -> str:
    """``sha256:<hex>`` of a plan record's bytes as stored in ``plan/current``."""
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def device_runs(devices: Iterable[str]) -> list[str]:
    """Device ids in order -> runs ``"<node>:<first>-<last>"`` (``"<node>:<index>"`` for one):
    consecutive devices of one node with consecutive indexes. ``expand_runs`` inverts it."""
    runs: list[list] = []  # [node, first, last]
    for dev in devices:
        node, index = parse_device_id(dev)
        if runs and runs[-1][0] == node and runs[-1][2] + 1 == index:
            runs[-1][2] = index
        else:
            runs.append([node, index, index])
    return [f"{n}:{a}" if a == b else f"{n}:{a}-{b}" for n, a, b in runs]


_RUN_RE = re.compile(r"^(?P<node>.+):(?P<first>\d+)(?:-(?P<last>\d+))?$")


def _parse_run(run: str) -> tuple[str, int, int]:
    m = _RUN_RE.match(str(run))
    first = int(m["first"]) if m else 0
    last = int(m["last"]) if m and m["last"] is not None else first
    if m is None or last < first:
        raise ValueError(f"device run {run!r} is not <node_id>:<first>[-<last>]")
    return m["node"], first, last


def expand_runs(runs: Iterable[str]) -> list[str]:
    """Runs (``device_runs``) -> the device ids in order; ValueError naming a bad run."""
    out = []
    for run in runs:
        node, first, last = _parse_run(run)
        out.extend(device_id(node, i) for i in range(first, last + 1))
    return out


def plan_head(plan: schema.PlanRecord, payload: Optional[bytes] = None) -> schema.PlanHeadRecord:
    """The head of ``plan``; ``payload``: its bytes in ``plan/current`` (default: encoded)."""
    payload = schema.encode(plan) if payload is None else payload
    return schema.PlanHeadRecord(
        version=plan.version, created_at=plan.created_at, store_endpoint=plan.store_endpoint,
        step=plan.step, digest=plan_digest(payload), devices=device_runs(plan.devices),
        drain=device_runs(plan.drain))


def plan_layout(plan: schema.PlanRecord,
                payload: Optional[bytes] = None) -> schema.PlanLayoutRecord:
    """The layout of ``plan``: what a worker's switch needs; ``payload`` as in ``plan_head``."""
    head = plan_head(plan, payload)
    return schema.PlanLayoutRecord(
        version=plan.version, created_at=plan.created_at, store_endpoint=plan.store_endpoint,
        step=plan.step, digest=head.digest, devices=head.devices, drain=head.drain,
        strategy=compact_strategy(plan.strategy), buckets=plan.buckets)


def plan_stamp(plan: schema.PlanRecord, payload: Optional[bytes] = None,
               layout: Optional[bytes] = None) -> schema.PlanStampRecord:
    """The stamp of ``plan``; ``layout``: the bytes of its ``plan/layout`` value (None: none)."""
    payload = schema.encode(plan) if payload is None else payload
    return schema.PlanStampRecord(
        version=plan.version, created_at=plan.created_at, digest=plan_digest(payload),
        layout_digest=plan_digest(layout) if layout is not None else "")


def layout_plan(layout: schema.PlanLayoutRecord) -> schema.PlanRecord:
    """The ``PlanRecord`` a worker switches with, rebuilt from ``layout``: devices, drain,
    strategy, length buckets, store, step and times as published; ``reason``, ``inventory``, ``leader`` and
    ``term`` are left empty (a switch reads none of them). ``ValueError`` on a bad run."""
    return schema.PlanRecord(
        version=layout.version, reason="", devices=expand_runs(layout.devices),
        strategy=expand_strategy(layout.strategy), store_endpoint=layout.store_endpoint,
        created_at=layout.created_at, drain=expand_runs(layout.drain), step=layout.step,
        buckets=layout.buckets)


def _layout_payload(plan: schema.PlanRecord, payload: bytes) -> Optional[bytes]:
    try:
        return schema.encode(plan_layout(plan, payload))
    except (RecordError, ValueError) as exc:  # workers then read plan/current, as before
        log.warning("plan v%d: no plan/layout written: %s", plan.version, exc)
        return None


def node_ranks(plan: AnyPlan, node: str) -> dict[int, int]:
    """Pure: slot -> rank of ``node``'s devices in ``plan`` (a full record or its head)."""
    out, rank = {}, 0
    if isinstance(plan, schema.PlanHeadRecord):
        for run in plan.devices:
            name, first, last = _parse_run(run)
            if name == node:
                out.update({i: rank + i - first for i in range(first, last + 1)})
            rank += last - first + 1
        return out
    for rank, dev in enumerate(plan.devices):
        name, index = parse_device_id(dev)
        if name == node:
            out[index] = rank
    return out


def plan_nodes(plan: AnyPlan) -> frozenset:
    """Pure: the nodes ``plan`` (a full record or its head) gives devices."""
    if isinstance(plan, schema.PlanHeadRecord):
        return frozenset(_parse_run(run)[0] for run in plan.devices)
    return frozenset(parse_device_id(d)[0] for d in plan.devices)


# ----------------------------------------------------------------------------- reading the head
def read_plan_head(client: EtcdClient, job: str) -> Optional[schema.PlanHeadRecord]:
    """The current plan's head (None before the first plan): ``plan/head`` when it was written
    with ``plan/current`` (same mod revision: one small read and one compare), otherwise built
    from ``plan/current`` (one full read: a plan published by a leader without heads)."""
    head_key, current = schema.plan_head_key(job), schema.plan_current_key(job)
    kv = client.get(head_key)
    if kv is not None:
        res = client.txn([Compare(current, CompareTarget.MOD, "==", kv.mod_revision)],
                         failure=[GetOp(current)])
        if res.succeeded:
            return schema.decode(head_key, kv.value)
        full = res.gets[0] if res.gets else None
    else:
        full = client.get(current)
    if full is None:
        return None
    return plan_head(schema.decode(current, full.value), full.value)


def read_plan_stamp(client: EtcdClient, job: str, timeout: Optional[float] = None,
                    ) -> tuple[Optional[schema.PlanStampRecord], Optional[schema.PlanRecord], int]:
    """(stamp, record, revision) of the current plan ((None, None, 0) before the first plan).

    ``plan/stamp`` when it was written with ``plan/current`` (same mod revision: one small read
    and one compare; ``record`` None; a plan published between the two is checked the same
    way, up to three times); otherwise the full record, with a stamp built from it
    (``layout_digest`` empty): a plan published by a leader that predates stamps, or a stamp
    that does not decode (logged). ``revision``: the mod revision of ``plan/current``."""
    stamp_key, current = schema.plan_stamp_key(job), schema.plan_current_key(job)
    kv = client.get(stamp_key, timeout=timeout)
    for _ in range(3):
        stamp = schema.decode_or_none(kv, log, f"job {job}")
        if stamp is None:
            break
        res = client.txn([Compare(current, CompareTarget.MOD, "==", kv.mod_revision)],
                         failure=[GetOp(stamp_key)], timeout=timeout)
        if res.succeeded:
            return stamp, None, kv.mod_revision
        fresh = res.gets[0] if res.gets else None
        if fresh is None or fresh.mod_revision == kv.mod_revision:
            break  # plan/current moved on without its stamp
        kv = fresh  # a newer plan came with its stamp: check that one
    full = client.get(current, timeout=timeout)
    if full is None:
        return None, None, 0
    record = schema.decode(current, full.value)
    return plan_stamp(record, full.value), record, full.mod_revision
