"""Reading and publishing the job's plan (``plan/current`` + ``plan/history/<version>``).

Promises: ``publish_plan`` writes both keys in one transaction fenced on the leader's election
key and on the ``plan/current`` revision the leader decided from, so a deposed leader gets
``FencedWriteRejected`` and a leader racing a newer plan gets ``ConflictError``; the version must
be exactly one more than the current one; the record is stamped with the leader's node and
term (its fence), so etcd's revisions show which leadership wrote each plan.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import Compare, CompareTarget, ConflictError, PutOp
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.election import Election


def read_plan(client: EtcdClient, job: str) -> tuple[Optional[schema.PlanRecord], int]:
    """The current plan (None before the first) and the mod revision of ``plan/current``."""
    key = schema.plan_current_key(job)
    kv = client.get(key)
    if kv is None:
        return None, 0
    return schema.decode(key, kv.value), kv.mod_revision


def publish_plan(election: Election, plan: schema.PlanRecord, read_revision: int,
                 current_version: int = 0) -> int:
    """Publish ``plan`` as the leader; ``read_revision`` is what ``read_plan`` returned (0: no
    plan yet). Returns the revision of the write."""
    if plan.version != current_version + 1:
        raise ValueError(
            f"plan version {plan.version} must be current version {current_version} + 1"
        )
    job = election.job
    plan = dataclasses.replace(plan, leader=election.node, term=election.term)
    payload = schema.encode(plan)
    current = schema.plan_current_key(job)
    res = election.fenced_txn(
        [Compare(current, CompareTarget.MOD, "==", read_revision)],
        [PutOp(current, payload), PutOp(schema.plan_history_key(job, plan.version), payload)],
    )
    if not res.succeeded:
        raise ConflictError(
            f"plan v{plan.version} of job {job} not published: {current} changed after "
            f"revision {read_revision}"
        )
    return res.revision
