"""Pure decisions of a switch: who holds usable state, which step to resume, how old device ids
map to the new group's ranks, and the tensors the fused BSR moves. No torch, no I/O.

Step consistency. A step changes state only after all of its communication completed, and every
step ends with a collective over all the plan's devices, so when a peer dies during step ``s`` some
survivors may have finished ``s`` (they hold step ``s+1`` state) while others have not (step ``s``);
nobody can be two steps apart. Each rank normally keeps a one-step undo copy: its state before
its last completed step (``runtime.run(undo=...)``: with the model, in host memory, or none; a rank
without one reports ``NO_STEP``, and a switch that would need it reads a checkpoint or fails
naming the missing copy).
The switch resumes at the smallest step any holder of the newest state has; a holder that is one
step ahead rolls back to its undo copy. Holders that can present the resume step are the owners
the BSR may read from; every other rank of the new plan (joiners, stale holders) starts empty.
Owners may hold different plan versions (a switch committed by some ranks only): the BSR reads
each in its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hspmd_elastic.annotations import (DUPLICATE, Annotation, BoxAnnotation, DGUnion, DSUnion,
                                       TensorAnnotation)
from hspmd_elastic.contract.ids import node_of
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.plan import Plan
from hspmd_elastic.reshard import TensorSpec

NO_STEP = -1


@dataclass(frozen=True)
class Holding:
    """What one rank of the new group brings: the plan version its state belongs to (0: none),
    the step its state is at, the step of its undo copy (``NO_STEP``: none) and the newest
    complete checkpoint it can see (``NO_STEP``: none)."""

    version: int = 0
    step: int = NO_STEP
    undo_step: int = NO_STEP
    checkpoint_step: int = NO_STEP

    def encode(self) -> list[int]:
        return [self.version, self.step, self.undo_step, self.checkpoint_step]

    @classmethod
    def decode(cls, values: Sequence[int]) -> "Holding":
        return cls(*(int(v) for v in values))


@dataclass(frozen=True)
class Decision:
    """The agreed outcome of the exchange, identical on every rank."""

    source_version: int  # 0: nobody holds state (a fresh start)
    resume_step: int
    owners: tuple[int, ...]  # new ranks whose state (live or undo) is at resume_step
    rollback: tuple[int, ...]  # owners that must restore their undo copy first

    @property
    def fresh(self) -> bool:
        return self.source_version == 0


def decide(holdings: Sequence[Holding]) -> Decision:
    """Resume step and owners from every rank's ``Holding`` (indexed by new rank).

    The resume step is the smallest step among holders of the newest state version. Holders of
    an older version (a previous switch that some ranks committed and others did not) hold the
    same training state in another layout and are owners too when they can present that step.
    """
    holders = [r for r, h in enumerate(holdings) if h.version > 0]
    if not holders:
        return Decision(0, 0, (), ())
    source = max(holdings[r].version for r in holders)
    resume = min(holdings[r].step for r in holders if holdings[r].version == source)
    owners = tuple(r for r in holders if resume in (holdings[r].step, holdings[r].undo_step))
    rollback = tuple(r for r in owners if holdings[r].step != resume)
    return Decision(source, resume, owners, rollback)


def checkpoint_step(holdings: Sequence[Holding]) -> int:
    """The newest checkpoint every rank can see (``NO_STEP`` if some rank sees none)."""
    return min(h.checkpoint_step for h in holdings)


@dataclass(frozen=True)
class Source:
    """A plan version whose state some owners hold: its plan and its device id strings."""

    version: int
    plan: Plan
    devices: tuple[str, ...]


def old_to_new_ids(old_devices: Sequence[str], new_devices: Sequence[str],
                   owners: Sequence[int], offset: Optional[int] = None) -> dict[int, int]:
    """Map each device id of an old plan to an id in the new group's numbering.

    An old device that is an owner (of this old plan's state) keeps its state under its new
    rank; every other old device (dead, dropped, holding nothing usable) gets an id no rank of
    the new group uses, ``offset + old_id`` (default offset: the new world size), so the BSR
    treats it as a lost owner.
    """
    offset = len(new_devices) if offset is None else offset
    new_rank = {d: r for r, d in enumerate(new_devices)}
    owner_set = set(owners)
    out = {}
    for old_id, device in enumerate(old_devices):
        r = new_rank.get(device)
        out[old_id] = r if r is not None and r in owner_set else offset + old_id
    return out


def reshard_request(config: ModelConfig, sources: Sequence[Source],
                    holdings: Sequence[Holding], owners: Sequence[int],
                    new_devices: Sequence[str],
                    new_plan: Plan) -> tuple[list[TensorSpec], dict[int, str]]:
    """The fused BSR's tensors (old annotation: where the owners hold them, in new-rank ids;
    new annotation: ``new_plan``) and the node of every id they mention.

    Each source version's plan is relabelled into the new numbering with its own owners; ids of
    devices that hold nothing usable are distinct across sources. With several sources, a
    tensor's old annotation is the union of their sub-groups: every sub-group of a plan's
    parameter annotation holds a full replica (hdim -1), so the union does too; uneven optimizer
    shards' moments (explicit boxes) merge as the union of their boxes.
    """
    nodes = {r: node_of(d) for r, d in enumerate(new_devices)}
    old: dict[str, list[TensorAnnotation]] = {}
    offset = len(new_devices)
    for src in sorted(sources, key=lambda s: s.version):
        mine = [r for r in owners if holdings[r].version == src.version]
        mapping = old_to_new_ids(src.devices, new_devices, mine, offset)
        offset += len(src.devices)
        for old_id, new_id in mapping.items():
            nodes.setdefault(new_id, node_of(src.devices[old_id]))
        for name, spec in state_specs(config, src.plan.relabel(mapping)).items():
            old.setdefault(name, []).append(spec.annotation)
    specs = [TensorSpec(name, spec.shape, spec.dtype, _union(name, old[name], spec.shape),
                        spec.annotation)
             for name, spec in state_specs(config, new_plan).items()]
    return specs, nodes


def _union(name: str, annotations: list[Annotation], shape: tuple[int, ...]) -> Annotation:
    if len(annotations) == 1:
        return annotations[0]
    if any(isinstance(a, BoxAnnotation) for a in annotations):  # uneven optimizer shards
        return BoxAnnotation.union(annotations, shape)
    if any(a.states.hdim != DUPLICATE for a in annotations):
        raise ValueError(f"{name}: only replicated (hdim -1) layouts can be merged")
    groups = [g for a in annotations for g in a.groups.groups]
    states = [st for a in annotations for st in a.states.states]
    return TensorAnnotation(DGUnion(groups), DSUnion(states, hdim=DUPLICATE))
