"""Redundancy as a planned quantity: the copies of the parameters a plan keeps. Pure values.

A plan's *copies* are the fewest devices holding any parameter slice (each TP shard of every
layer, the embedding and the head) and the fewest nodes holding any slice. Every pipeline holds
every slice once, so the device count is the plan's number of pipelines (``cost.estimate_plan``'s
``Estimate.replica_devices``); the node count is ``cost.replica_nodes``. With ``c`` copies, the
loss of any ``c - 1`` devices (nodes) leaves a live owner of every slice: a switch from memory
instead of a checkpoint.

The rule of a replan that only speeds caused (no device came or went): its plan keeps the copies
the job is owed, unless no plan for the speeds does. Owed (``Copies.owed``) is what the current
plan has, up to ``SPARE_COPIES`` (two: any one loss is a switch from memory) or
``--hspmd-redundancy`` when that asks for more. Copies beyond that are the speed's to spend: a
slow device holding a third or fourth replica may be left idle (a plan over a subset of the
devices), one holding the second may not. Promises:

* ``Copies.of(estimate)`` / ``copies_of(plan, inventory)``: a plan's copies;
* ``keep(options, copies)``: the planner options under which ``plan_for`` ranks the plans that
  keep what ``copies`` owes (``owed(options.redundancy)``) above every other, then the ones that lose the fewest (``shortfall``): the
  least trade that exists, never a silent one;
* ``weigh(before, after, fastest, redundancy)``: the verdict journaled with the decision,
  ``KEPT`` when the chosen plan keeps every owed copy (``why`` names the faster plan that would not have, if any) and
  ``TRADED`` when it loses some (``why`` says none keeps them), one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import Estimate, Inventory, PlannerOptions

KEPT = "kept"  # the chosen plan holds every slice on the devices and nodes owed (see owed)
TRADED = "traded"  # it holds some slice on fewer: no plan for the speeds keeps them
SPARE_COPIES = 2  # the copies a speed replan keeps when the job has them: one loss is survived


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

    def owed(self, redundancy: int = 1) -> "Copies":
        """The copies a speed-only replan must keep: these, up to ``SPARE_COPIES`` or
        ``redundancy`` (the larger), on devices and on nodes alike."""
        most = max(SPARE_COPIES, redundancy)
        return Copies(min(self.devices, most), min(self.nodes, most))

    def describe(self) -> str:
        return (f"every parameter slice on {self.devices} device(s) and {self.nodes} "
                f"node(s)")


def copies_of(plan, inventory: Inventory) -> Copies:
    """``plan``'s copies over ``inventory``'s nodes (its devices must be in it)."""
    return Copies(len(plan.pipelines), cost.replica_nodes(plan, inventory.devices_by_id))


def keep(options: PlannerOptions, copies: Copies) -> PlannerOptions:
    """``options`` that rank the plans keeping what ``copies`` owes first
    (``Copies.owed(options.redundancy)`` as ``PlannerOptions.keep_copies`` and
    ``keep_copy_nodes``); never below what they already ask."""
    owed = copies.owed(options.redundancy)
    return replace(options, keep_copies=max(options.keep_copies, owed.devices),
                   keep_copy_nodes=max(options.keep_copy_nodes, owed.nodes))


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
          fastest: Optional[tuple[Copies, float, float]] = None,
          redundancy: int = 1) -> Verdict:
    """The verdict on going from ``before`` to ``after`` copies, against what ``before`` owes
    (``Copies.owed(redundancy)``). ``fastest``: the fastest plan found and the chosen one's step
    times, ``(copies, fastest_s, chosen_s)``, when it differs from the chosen plan; it is named
    when it would have lost owed copies."""
    owed = before.owed(redundancy)
    if after.covers(owed):
        why = f"{after.describe()}, as before ({before.devices}/{before.nodes})" \
            if after.covers(before) else \
            (f"{after.describe()} (was {before.devices}/{before.nodes}): the copies beyond "
             f"{owed.devices}/{owed.nodes} spent on speed")
        if fastest is not None and not fastest[0].covers(owed) and fastest[1] < fastest[2]:
            why += (f"; a plan of {fastest[1]:.4g} s per step (against {fastest[2]:.4g} s) would "
                    f"hold some slice on {fastest[0].devices} device(s) and "
                    f"{fastest[0].nodes} node(s): not taken")
        return Verdict(KEPT, why)
    return Verdict(TRADED, f"no plan for these speeds keeps {owed.devices} device(s) and "
                           f"{owed.nodes} node(s) per parameter slice: "
                           f"{after.describe()}")
