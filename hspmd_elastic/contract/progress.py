"""Worker states and the progress file: how a worker tells its node agent how far it got.

Promises:

* **worker states**: ``WorkerState`` is the worker runtime's lifecycle (its transition table is
  in ``hspmd_elastic.elastic.api``); ``TRAINED_STATES`` are the states at or past training
  under a plan (the agent's switch acks), ``DONE_STATES`` the final states of a worker that
  finished the job, ``LEFT_STATES`` those of a worker that left because the newest plan does
  not use its device;
* **the progress file**: a worker under an agent writes its latest ``WorkerProgress`` to the file
  the agent names in its environment (``WorkerEnv.progress_file``): one JSON object with
  ``PROGRESS_FIELDS``, ``state`` and the ``OPTIONAL_PROGRESS_FIELDS`` (``busy_s``: the
  rank's own compute time per step; ``probe_s`` and ``probes``: an idle device's probes),
  replaced atomically by rename (``write_progress``); nothing else writes that format;
* the format has one reader: ``progress_from_dict`` checks one decoded object (every field of
  ``PROGRESS_FIELDS`` present with its type: integers that are not booleans, finite numbers;
  an optional field absent is its default; ``state`` a string, "" when absent; other keys
  ignored) and ``read_progress`` reads a file with
  it; both answer None for anything that is not (yet) a valid report, never raise. The agent
  relays the ``schema.WorkerRecord`` part to ``workers/<node>/<local_rank>``
  (``coord.contract.worker_record``); the worker never writes etcd.

Torch-free and etcd-free (``hspmd_elastic.contract``).
"""

from __future__ import annotations

import enum
import json
import math
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Mapping, Optional

from hspmd_elastic.files import atomic_write

MAX_PROGRESS_BYTES = 1 << 16  # a report is a few hundred bytes; a bigger file is not one


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
class WorkerFields:
    """What a worker reports of itself, which its agent relays to etcd: the fields of both
    ``WorkerProgress`` (the report, with the worker's state) and ``schema.WorkerRecord`` (the
    record of ``workers/<node>/<local_rank>``), defined once here."""

    pid: int
    global_rank: int
    local_rank: int
    plan_version: int
    step: int
    last_progress_at: float
    steps_per_s: float
    # seconds of the rank's own compute per step (the step's time minus its waits on peers'
    # collectives and point-to-point), the median over the plan's recent steps; 0: not measured
    # (yet). The leader's measured speeds come from it.
    busy_s: float = 0.0
    # a worker whose device the plan leaves idle (it waits for a plan that uses it): its probe's
    # time in seconds (``elastic.busy.probe``, the median of its recent ones) and how many it ran
    # under ``plan_version`` (the leader's sample marker); 0: none
    probe_s: float = 0.0
    probes: int = 0


_TYPES = {"int": int, "float": float}
# The fields of a report besides ``state`` -> their type (``WorkerFields`` without a default),
# and those a report may leave out (a script's own heartbeat does): name -> (type, default).
PROGRESS_FIELDS: dict[str, type] = {
    f.name: _TYPES[f.type] for f in fields(WorkerFields) if f.default is MISSING}
OPTIONAL_PROGRESS_FIELDS: dict[str, tuple[type, Any]] = {
    f.name: (_TYPES[f.type], f.default) for f in fields(WorkerFields) if f.default is not MISSING}


@dataclass
class WorkerProgress(WorkerFields):
    """One progress report: the ``WorkerFields`` (what the agent relays to etcd) plus the
    worker's state (a ``WorkerState`` value; "" in a report that names none)."""

    state: str = WorkerState.TRAINING.value

    def record_fields(self) -> dict[str, Any]:
        """The ``WorkerFields`` of this report (a ``schema.WorkerRecord``'s arguments)."""
        return {f.name: getattr(self, f.name) for f in fields(WorkerFields)}


def _typed(value: Any, tp: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    if tp is int:
        if not isinstance(value, int):
            raise TypeError(f"{value!r} is not an integer")
        return value
    if isinstance(value, int) and abs(value) > sys.float_info.max:
        raise ValueError("an integer out of the range of numbers")
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not finite")
    return float(value)


def progress_from_dict(data: Any, local_rank: int) -> Optional[WorkerProgress]:
    """The report one decoded progress object holds, or None when it is not a valid report
    (see the module docstring). ``local_rank``: the agent's slot number, which wins over the
    object's."""
    if not isinstance(data, Mapping):
        return None
    try:
        values = {name: _typed(data[name], tp) for name, tp in PROGRESS_FIELDS.items()
                  if name != "local_rank"}
        values.update({name: _typed(data.get(name, default), tp)
                       for name, (tp, default) in OPTIONAL_PROGRESS_FIELDS.items()})
    except (KeyError, TypeError, ValueError):
        return None
    state = data.get("state", "")
    if not isinstance(state, str):
        return None
    return WorkerProgress(local_rank=local_rank, state=state, **values)


def write_progress(path: str, progress: WorkerProgress) -> None:
    """Replace the progress file with ``progress`` (a uniquely named temporary file + rename:
    readers never see half)."""
    # durable=False: no fsync. The file is a heartbeat rewritten after every step and read only
    # while the job runs; the rename alone rules out a torn read, and what a power loss would
    # undo (the last reports) nobody reads after one, so an fsync per step would be pure cost.
    atomic_write(path, json.dumps(asdict(progress)), durable=False)


def read_progress(path: str, local_rank: int) -> Optional[WorkerProgress]:
    """The latest report in the progress file of slot ``local_rank``; None while the file is
    absent, or not (yet) a valid report (the agent's slot number wins over the file's)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROGRESS_BYTES + 1)
        if len(raw) > MAX_PROGRESS_BYTES:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return progress_from_dict(data, local_rank)
