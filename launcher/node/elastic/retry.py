"""Stuck switches: workers that wait after their switch into the current plan failed.

A switch can fail on every rank with nothing wrong in the cluster: on a busy host the first
collective of a new group times out on all of them, or a transient network hiccup breaks the
exchange. Each rank then waits for a newer plan (``WAITING_PLAN`` at the plan's version), but no
failure, leave or unreachable peer makes the leader publish one. This module tells the agent
when to ask for the plan again (``retry/<node>``, see ``ElasticNode``).

Promises (pure, on an injected clock):

* a slot is *stuck* while its live worker's latest report says ``waiting_plan`` at the current
  plan's version (it took part in that plan, then left it), for the same pid;
* ``observe`` returns the stuck slots once the first of them has waited ``after_s``, else
  None; a slot that trains again, another pid, or another plan version starts afresh;
* ``after_s`` is meant to exceed the time a real change takes to reach a plan (a lease TTL, the
  leader's debounce): a retry is for what nothing else explains, and a premature one costs
  little (a plan still naming a dead peer is superseded during its regroup).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

from hspmd_elastic.contract.progress import WorkerState

MIN_RETRY_AFTER_S = 5.0


def retry_after_s(lease_ttl_s: float) -> float:
    """How long stuck workers wait before their agent asks for a retry: two lease TTLs (a dead
    peer's lease expires within one, and the leader replans it away), at least 5 s."""
    return max(2.0 * float(lease_ttl_s), MIN_RETRY_AFTER_S)


class StuckSwitches:
    """Tracks the node's workers waiting after a failed switch (see the module docstring)."""

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic):
        if after_s <= 0:
            raise ValueError(f"after_s={after_s} must be > 0")
        self.after_s, self._clock = after_s, clock
        self._since: dict[tuple[int, int, int], float] = {}  # (slot, pid, version) -> since

    def observe(self, plan_version: int, running: Mapping[int, int],
                reports: Mapping[int, object]) -> Optional[tuple[list[int], float]]:
        """(stuck slots, how long the first waited) once that is ``after_s`` or more; else
        None. ``running``: slot -> pid of its live worker; ``reports``: slot -> latest report
        (``state``, ``plan_version``, ``pid``)."""
        now = self._clock()
        stuck = set()
        for lr, pid in running.items():
            rep = reports.get(lr)
            if (plan_version > 0 and rep is not None and getattr(rep, "pid", None) == pid
                    and getattr(rep, "state", "") == WorkerState.WAITING_PLAN.value
                    and getattr(rep, "plan_version", 0) == plan_version):
                stuck.add((lr, pid, plan_version))
        self._since = {k: self._since.get(k, now) for k in stuck}
        if not stuck:
            return None
        waited = now - min(self._since.values())
        if waited < self.after_s:
            return None
        return sorted(lr for lr, _, _ in stuck), waited
