"""Redundancy as a planned quantity: the copies of the parameters a plan keeps. Pure values.

A plan's *copies* are the fewest devices holding any parameter slice (each TP shard of every
layer, the embedding and the head) and the fewest nodes holding any slice. Every pipeline holds
every slice once, so the device count is the plan's number of pipelines (``cost.estimate_plan``'s
``Estimate.replica_devices``); the node count is ``cost.replica_nodes``. With ``c`` copies, the
loss of any ``c - 1`` devices (nodes) leaves a live owner of every slice: a switch from memory
instead of a checkpoint.

The rule of a replan that only speeds caused (no device came or went): its plan keeps the copies
the current plan has, unless no plan for the speeds does. Promises:

* ``Copies.of(estimate)`` / ``copies_of(plan, inventory)``: a plan's copies;
* ``keep(options, copies)``: the planner options under which ``plan_for`` ranks the plans that
  keep ``copies`` above every other, then the ones that lose the fewest (``shortfall``): the
  least trade that exists, never a silent one;
* ``weigh(before, after, fastest)``: the verdict journaled with the decision, ``KEPT`` when the
  chosen plan keeps every copy (``why`` names the faster plan that would not have, if any) and
  ``TRADED`` when it loses some (``why`` says none keeps them), one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import Estimate, Inventory, PlannerOptions

KEPT = "kept"  # the chosen plan holds every slice on as many devices and nodes as before
TRADED = "traded"  # it holds some slice on fewer: no plan for the speeds keeps them


@dataclass(frozen=True, order=True)
class Copies:
    """The fewest devices and the fewest nodes any parameter slice of a plan lives on."""

    devices: int
    nodes: int

    @classmethod
    def of(cls, estimate: Estimate) -> "Copies":
        return cls(estimate.replica_devices, estimate.replica_nodes)

    def covers(self, other: "Copies") -> bool:
        """Whether these copies are at least ``other``'s, on devices and on nodes."""
        return self.devices >= other.devices and self.nodes >= other.nodes

    def describe(self) -> str:
        return (f"every parameter slice on {self.devices} device(s) and {self.nodes} "
                f"node(s)")


def copies_of(plan, inventory: Inventory) -> Copies:
    """``plan``'s copies over ``inventory``'s nodes (its devices must be in it)."""
    return Copies(len(plan.pipelines), cost.replica_nodes(plan, inventory.devices_by_id))


def keep(options: PlannerOptions, copies: Copies) -> PlannerOptions:
    """``options`` that rank the plans keeping ``copies`` first (``PlannerOptions.keep_copies``
    and ``keep_copy_nodes``); never below what they already ask."""
    return replace(options, keep_copies=max(options.keep_copies, copies.devices),
                   keep_copy_nodes=max(options.keep_copy_nodes, copies.nodes))


def shortfall(estimate: Estimate, options: PlannerOptions) -> tuple[int, int]:
    """(nodes, devices) a plan's copies fall short of ``options``' keep: (0, 0) keeps them.
    Node copies come first: a node holds many devices, losing one is the larger risk."""
    return (max(0, options.keep_copy_nodes - estimate.replica_nodes),
            max(0, options.keep_copies - estimate.replica_devices))


@dataclass(frozen=True)
class Verdict:
    """What a replan did to the job's redundancy, for its journal entry."""

    outcome: str  # KEPT or TRADED
    why: str


def weigh(before: Copies, after: Copies,
          fastest: Optional[tuple[Copies, float, float]] = None) -> Verdict:
    """The verdict on going from ``before`` to ``after`` copies. ``fastest``: the fastest plan
    found and the chosen one's step times, ``(copies, fastest_s, chosen_s)``, when it differs
    from the chosen plan; it is named when it would have lost copies."""
    if after.covers(before):
        why = f"{after.describe()}, as before ({before.devices}/{before.nodes})"
        if fastest is not None and not fastest[0].covers(before) and fastest[1] < fastest[2]:
            why += (f"; a plan of {fastest[1]:.4g} s per step (against {fastest[2]:.4g} s) would "
                    f"hold some slice on {fastest[0].devices} device(s) and "
                    f"{fastest[0].nodes} node(s): not taken")
        return Verdict(KEPT, why)
    return Verdict(TRADED, f"no plan for these speeds keeps {before.devices} device(s) and "
                           f"{before.nodes} node(s) per parameter slice: "
                           f"{after.describe()}")
