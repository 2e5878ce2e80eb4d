"""The leader: the elected node agent that turns failure, join and slow-down into a new plan.

Package map (pure parts first; only ``loop`` does I/O):

* ``snapshot``: records -> ``ClusterSnapshot`` (``build_snapshot``), with each verdict's
  ``origin`` (an agent's own ``exit`` / ``stall`` verdicts were journaled already);
* ``decide``: the pure decision: ``decide(snapshot, current_plan)`` -> ``PlanDecision`` or
  None, with ``select_nodes`` (planned nodes and hot spares under ``--nnodes`` max);
* ``planning``: the typed planner adapter: ``make_layout`` calls a ``PlannerFn`` (normally
  ``hspmd_elastic.planner.plan_for``) or falls back to ``fallback_dp_plan``; ``plan_record``;
* ``journal``: the change and ``replan`` events written after a publication;
* ``loop``: the effect loop: ``Leader`` (election, watches, debounce, fenced publication) and
  its state machine ``LeaderState`` / ``TRANSITIONS``.

Device ids are the shared contract in ``hspmd_elastic.contract.ids``; ``plan_of`` is in
``hspmd_elastic.coord.contract`` and the state-machine helper in ``hspmd_elastic.coord.lifecycle``.
"""

from launcher.leader.decide import (
    Change,
    ChangeKind,
    PlanDecision,
    assumed_inventory,
    decide,
    largest_cluster,
    select_nodes,
)
from launcher.leader.loop import TRANSITIONS, Leader, LeaderState, Outcome, Publication
from launcher.leader.planning import (
    LeaderError,
    PlannedLayout,
    PlannerFn,
    PlanningFailed,
    RedundantPlanner,
    default_planner_options,
    make_layout,
    plan_record,
)
from launcher.leader.snapshot import (
    GONE_NODE_STATES,
    ClusterSnapshot,
    DeviceView,
    NodeView,
    build_snapshot,
)

__all__ = [
    "GONE_NODE_STATES", "TRANSITIONS", "Change", "ChangeKind",
    "ClusterSnapshot", "DeviceView", "Leader", "LeaderError", "LeaderState", "NodeView",
    "Outcome", "PlanDecision", "PlannedLayout", "PlannerFn", "PlanningFailed", "Publication",
    "RedundantPlanner",
    "assumed_inventory", "build_snapshot", "decide", "default_planner_options", "largest_cluster",
    "make_layout",
    "plan_record", "select_nodes",
]
