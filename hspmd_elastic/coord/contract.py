"""Where the etcd schema meets the formats of ``hspmd_elastic.contract``.

The formats that cross processes (ids, device ids, worker states, the progress file, the
worker environment) live in ``hspmd_elastic.contract``, torch-free and etcd-free; this module
holds the two conversions that need the schema's records. Promises:

* ``worker_record(progress)`` is the ``schema.WorkerRecord`` an agent relays to
  ``workers/<node>/<local_rank>`` for a worker's ``contract.WorkerProgress``;
* ``plan_of(record)`` is the one way from a ``PlanRecord`` to its ``Plan``; it checks that the
  strategy's device ids are exactly the record's ranks.
"""

from __future__ import annotations

from hspmd_elastic.contract.progress import WorkerProgress
from hspmd_elastic.contract import schema
from hspmd_elastic.plan import Plan, PlanError


def worker_record(progress: WorkerProgress) -> schema.WorkerRecord:
    """The etcd record of a worker's progress report (its ``state`` stays with the agent)."""
    return schema.WorkerRecord(**progress.record_fields())


def plan_of(record: schema.PlanRecord) -> Plan:
    """The ``hspmd_elastic.plan.Plan`` of a published record; ``PlanError`` when its strategy
    is not a plan or its device ids are not exactly ``0..len(record.devices)-1``."""
    plan = Plan.from_dict(record.strategy)
    if plan.devices != tuple(range(len(record.devices))):
        raise PlanError(f"plan v{record.version}: strategy uses device ids {list(plan.devices)}; "
                        f"its {len(record.devices)} devices need ids 0..{len(record.devices) - 1}")
    return plan
