"""What the leader writes to the job's journal after it published a plan.

Promises: one event per change of the decision (``leave``, ``join``, ``failure``, ``stall``,
``drain``, ``unreachable``,
``degrade``, ``recover``, ``retry``; changes marked ``journaled``, i.e. failures and stalls a node agent
journaled already, are not repeated), then one ``replan`` event with the version, the reason,
the planner, the store, the step, the changes (``contract.events.PlanChange``, structured:
readers never parse the reason) and the timings of detection -> publication, all in as few
transactions as etcd allows (``coord.journal.append_events``). The plan is out
already when this runs: a journal write that fails is logged, never retried, never raised.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.journal import NewEvent, append_events
from launcher.leader.decide import PlanDecision
from launcher.leader.planning import PlannedLayout
from launcher.leader.snapshot import ClusterSnapshot

log = logging.getLogger(__name__)


def journal_publication(client: EtcdClient, job: str, node: str, decision: PlanDecision,
                        layout: PlannedLayout, current: Optional[schema.PlanRecord],
                        snap: ClusterSnapshot, timings: dict[str, float],
                        wall_clock: Callable[[], float]) -> None:
    """The change events and the replan event of one publication by ``node``'s leader."""
    events = [NewEvent(c.kind.value, c.node,
                       schema.change_detail(c.kind.value, list(c.devices), c.detail,
                                            decision.version))
              for c in decision.changes if not c.journaled]
    events.append(NewEvent("replan", node, schema.ReplanDetail(
        version=decision.version, previous_version=current.version if current else 0,
        reason=decision.reason, device_count=len(layout.devices), planner=layout.planner,
        store_endpoint=decision.store_endpoint, step=snap.step,
        changes=[c.record() for c in decision.changes]), timings))
    try:
        append_events(client, job, events, wall_clock=wall_clock)
    except CoordinationError as exc:
        log.warning("[%s] leader %s: plan v%d published but not journaled: %s", job, node,
                    decision.version, exc)
