"""How an elastic-mode agent judges the job's end (pure).

``judge(view)`` maps what one agent knows at one moment (``JobView``) to ``"running"``,
``SUCCEEDED`` or ``FAILED`` with a one-line reason; a recorded end (``rdzv/state``) always wins,
so every agent ends the same way. A worker that finished the job, or every node of the plan
done, is success; a ``switch-failed`` event, the same error journaled by two worker exits (the
script's error, ``exits.ScriptErrors``: it wins over "no usable device", which is only its
consequence), no usable device left, or (this agent leading) no plan that keeps the
``--hspmd-redundancy`` guarantee or a model that no plan fits even on the largest cluster the
job can have, or a plan that does not fit the enforced memory (``--hspmd-enforce-memory``: the OOM
killer ended a worker of this node; first of the failures, as the others are its consequences),
is failure. A cause that came from etcd is shown by its first line, escaped and
cut (``contract.text.first_line``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hspmd_elastic.contract.text import first_line
from hspmd_elastic.contract.rounds import FAILED, SUCCEEDED, RoundState

MAX_REASON = 300  # characters of a root cause shown in the one-line error


@dataclass(frozen=True)
class JobView:
    """What one agent knows about the job's end at one moment (see ``judge``)."""

    ended: Optional[RoundState] = None  # rdzv/state, when terminal
    finished_worker: str = ""  # a worker of this node reported it finished the job
    nodes_done: bool = False  # every node of the current plan marked its slots done
    switch_failed: str = ""  # the error of a switch-failed event
    nodes: int = 0  # live node records
    usable_devices: int = -1  # -1: not known
    plan_shortfall: str = ""  # this agent's leader found no plan keeping --hspmd-redundancy
    script_error: str = ""  # two worker exits journaled the same error (ScriptError.describe)
    plan_impossible: str = ""  # this agent's leader: no plan fits the largest cluster possible
    memory_error: str = ""  # an OOM kill under --hspmd-enforce-memory (elastic.memory.describe)


def judge(view: JobView) -> tuple[str, str]:
    """Pure: ``("running" | SUCCEEDED | FAILED, reason)``; a recorded end wins."""
    if view.ended is not None:
        return view.ended.state, view.ended.reason
    if view.finished_worker:
        return SUCCEEDED, f"all devices of the plan finished ({view.finished_worker})"
    if view.nodes_done:
        return SUCCEEDED, "every node of the plan finished its workers"
    if view.memory_error:
        return FAILED, first_line(view.memory_error, MAX_REASON)
    if view.switch_failed:
        return FAILED, "switch failed: " + first_line(view.switch_failed, MAX_REASON)
    if view.script_error:
        return FAILED, first_line(view.script_error, MAX_REASON * 2)
    if view.nodes and view.usable_devices == 0:
        return FAILED, "no usable device left in the job"
    if view.plan_shortfall:
        return FAILED, ("no plan keeps the redundancy guarantee: "
                        + first_line(view.plan_shortfall, MAX_REASON))
    if view.plan_impossible:
        return FAILED, first_line(view.plan_impossible, MAX_REASON * 2)
    return "running", ""

