"""The contract between the control plane and the data plane, beside the etcd schema.

Torch-free: the node agent, the leader, the ops tools and the worker runtime all import it, and
each item below exists only here. What crosses between the planes is the etcd schema
(``schema.py``), this module, the worker environment (``launcher.node.workers``) and the progress
file. Promises:

* **device ids**: a device (a worker slot) is ``"<node_id>:<index>"``; ``device_id`` makes one,
  ``parse_device_id`` reads one back or raises ``ValueError`` naming it, ``node_of`` is its node;
  in a published plan the ints of ``strategy`` index ``PlanRecord.devices``;
* **worker states**: ``WorkerState`` is the worker runtime's lifecycle (its transition table is
  in ``hspmd_elastic.elastic.api``); ``TRAINED_STATES`` are the states at or past training
  under a plan (the agent's switch acks), ``DONE_STATES`` the final states of a worker that
  finished the job;
* **the progress file**: a worker under an agent writes its latest ``WorkerProgress`` to the file
  named by ``HSPMD_PROGRESS_FILE`` (``write_progress``: one JSON object, atomically by rename);
  the agent reads it with ``read_progress`` (None while absent or not readable yet) and relays
  the ``WorkerRecord`` part to ``workers/<node>/<local_rank>``; the worker never writes etcd;
* **plans**: ``plan_of(record)`` is the one way from a ``PlanRecord`` to its ``Plan``; it checks
  that the strategy's device ids are exactly the record's ranks.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

from hspmd_elastic.coord import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.plan import Plan, PlanError

PROGRESS_FILE_ENV = "HSPMD_PROGRESS_FILE"


# ----------------------------------------------------------------------------------- devices
def device_id(node: str, index: int) -> str:
    """The id of slot ``index`` of ``node``."""
    return f"{node}:{index}"


def parse_device_id(dev: str) -> tuple[str, int]:
    """``"<node_id>:<index>"`` -> ``(node_id, index)``; ValueError naming ``dev`` otherwise."""
    node, sep, index = str(dev).rpartition(":")
    if not sep or not node or not index.isdigit():
        raise ValueError(f"device id {dev!r} is not <node_id>:<index>")
    return node, int(index)


def node_of(dev: str) -> str:
    """The node of device ``dev``."""
    return parse_device_id(dev)[0]


def device_sort_key(dev: str) -> tuple[str, int]:
    """Devices in node order, then index order (``n0:2`` before ``n0:10``)."""
    return parse_device_id(dev)


# ----------------------------------------------------------------------------------- workers
class WorkerState(enum.Enum):
    """The worker runtime's lifecycle (its table: ``hspmd_elastic.elastic.api.TRANSITIONS``)."""

    WAITING_PLAN = "waiting_plan"  # waiting for a plan newer than ours that contains this device
    REGROUPING = "regrouping"  # destroying the old process group, forming the plan's group
    EXCHANGING = "exchanging"  # agreeing on the resume step and on who holds what
    RESHARDING = "resharding"  # the fused BSR (or a checkpoint load)
    BUILDING = "building"  # building the specialized graph on the received state
    TRAINING = "training"
    FINISHING = "finishing"  # all steps done; waiting until every rank of the plan is done
    DONE = "done"
    EXCLUDED = "excluded"  # the newest plan does not use this device: the worker leaves
    FAILED = "failed"


# A worker reporting one of these for a plan has switched into that plan.
TRAINED_STATES = frozenset({WorkerState.TRAINING.value, WorkerState.FINISHING.value,
                            WorkerState.DONE.value})
# Final states of a worker that finished the job.
DONE_STATES = frozenset({WorkerState.DONE.value})
# Final states of a worker that left by itself because the newest plan does not use its device:
# the device is not at fault, and a later plan may use it again.
LEFT_STATES = frozenset({WorkerState.EXCLUDED.value})


@dataclass
class WorkerProgress(schema.WorkerRecord):
    """One progress report: a ``schema.WorkerRecord`` (what the agent relays to etcd) plus the
    worker's state (a ``WorkerState`` value; "" in a report that names none)."""

    state: str = WorkerState.TRAINING.value

    def to_worker_record(self) -> schema.WorkerRecord:
        return schema.WorkerRecord(**{f.name: getattr(self, f.name)
                                      for f in fields(schema.WorkerRecord)})


# What a report file must hold (the slot number is the agent's own).
_RECORD_FIELDS = tuple(f.name for f in fields(schema.WorkerRecord) if f.name != "local_rank")


def write_progress(path: str, progress: WorkerProgress) -> None:
    """Replace the progress file with ``progress`` (tmp file + rename: readers never see half)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(progress), f)
    os.replace(tmp, path)


def read_progress(path: str, local_rank: int) -> Optional[WorkerProgress]:
    """The latest report in the progress file of slot ``local_rank``; None while the file is
    absent, or not (yet) a valid report (the agent's slot number wins over the file's)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        fields = {k: data[k] for k in _RECORD_FIELDS}
        state = data.get("state", "")
        if not isinstance(state, str):
            raise TypeError(f"state {state!r} is not a string")
        progress = WorkerProgress(local_rank=local_rank, state=state, **fields)
        schema.encode(progress.to_worker_record())  # validates the field types
        return progress
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CoordinationError):
        return None


# ----------------------------------------------------------------------------------- plans
def plan_of(record: schema.PlanRecord) -> Plan:
    """The ``hspmd_elastic.plan.Plan`` of a published record; ``PlanError`` when its strategy
    is not a plan or its device ids are not exactly ``0..len(record.devices)-1``."""
    plan = Plan.from_dict(record.strategy)
    if plan.devices != tuple(range(len(record.devices))):
        raise PlanError(f"plan v{record.version}: strategy uses device ids {list(plan.devices)}; "
                        f"its {len(record.devices)} devices need ids 0..{len(record.devices) - 1}")
    return plan
