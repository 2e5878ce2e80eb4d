"""Switch acks: how far a node got into a plan, written to ``switch/<version>/<node>``.

``ack_state`` is pure. ``joined`` when the node sees a plan that uses it, ``ready`` when every
one of its slots in the plan has a live worker reporting that plan version, ``done`` when they
all report a state at or past training for it (``contract.TRAINED_STATES``), ``failed`` when one
of those slots' workers exits non-zero or is killed as hung before ``done``. An ack only moves
forward (``ACK_ORDER``); writing version ``v`` deletes the node's acks below ``v - ACK_KEEP``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from hspmd_elastic.contract.progress import TRAINED_STATES, WorkerProgress

ACK_ORDER = ("joined", "ready", "done")  # the forward path; ``failed`` ends it from any of them
ACK_KEEP = 4  # writing the ack of version v deletes this node's acks of versions below v - 4


def ack_state(version: int, slots: Iterable[int], running: Mapping[int, int],
              reports: Mapping[int, WorkerProgress], succeeded: Iterable[int],
              failed: Iterable[int]) -> str:
    """Pure: how far this node got into plan ``version`` (a ``schema.SWITCH_STATES`` value).

    ``slots``: the node's slots in the plan; ``running``: slot -> pid of its live worker;
    ``reports``: slot -> its worker's latest report (an exited worker's final one); ``succeeded``
    / ``failed``: slots whose worker exited 0 / exited non-zero or was declared hung. A failed
    slot fails the node (it cannot take part). Otherwise the node is as far as its least
    advanced slot: ``done`` when the slot's worker reports this version in a state at or past
    training (or exited 0 after such a report, or exited 0 reporting nothing at all: a script
    without a progress reporter has no other way to say it finished), ``ready`` when its live
    worker reports this version in another state (it is switching or starting), else ``joined``.
    """
    failed, succeeded = set(failed), set(succeeded)
    least = len(ACK_ORDER) - 1
    for lr in slots:
        if lr in failed:
            return "failed"
        rep = reports.get(lr)
        ours = rep is not None and rep.plan_version == version
        if lr in running:
            if not ours or rep.pid != running[lr]:
                level = 0
            else:
                level = 2 if rep.state in TRAINED_STATES else 1
        elif lr in succeeded:
            level = 2 if rep is None or (ours and rep.state in TRAINED_STATES) else 0
        else:  # no worker (yet)
            level = 0
        least = min(least, level)
    return ACK_ORDER[least]
