"""How an elastic-mode agent judges the job's end (pure).

``judge(view)`` maps what one agent knows at one moment (``JobView``) to ``"running"``,
``SUCCEEDED`` or ``FAILED`` with a one-line reason; a recorded end (``rdzv/state``) always wins,
so every agent ends the same way. A worker that finished the job, or every node of the plan
done, is success; a ``switch-failed`` event, no usable device left, or (this agent leading) no
plan that keeps the ``--hspmd-redundancy`` guarantee, is failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.node.rendezvous import FAILED, SUCCEEDED, RoundState

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


def judge(view: JobView) -> tuple[str, str]:
    """Pure: ``("running" | SUCCEEDED | FAILED, reason)``; a recorded end wins."""
    if view.ended is not None:
        return view.ended.state, view.ended.reason
    if view.finished_worker:
        return SUCCEEDED, f"all devices of the plan finished ({view.finished_worker})"
    if view.nodes_done:
        return SUCCEEDED, "every node of the plan finished its workers"
    if view.switch_failed:
        return FAILED, "switch failed: " + one_line(view.switch_failed)
    if view.nodes and view.usable_devices == 0:
        return FAILED, "no usable device left in the job"
    if view.plan_shortfall:
        return FAILED, "no plan keeps the redundancy guarantee: " + one_line(view.plan_shortfall)
    return "running", ""


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """The first line of ``text``, cut to ``limit`` characters, control characters escaped (it
    may come from etcd and is printed on a terminal)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    line = line if len(line) <= limit else line[:limit - 3] + "..."
    return line.translate(_CONTROLS)
