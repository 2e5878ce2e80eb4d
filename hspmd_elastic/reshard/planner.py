"""Pure BSR planning: tensor classes, what moves (``slicing``), sender choice, fused schedule.

Every function here is a function of its arguments only (no torch, no I/O, no randomness, no
dependence on set or dict iteration order), so every rank computes the same schedule alone.

1. **Classes**: tensors that share shape and both annotations move alike; ``slicing.class_plan``
   computes their local copies, demands and missing boxes once (owners found through a per-cell
   index, never by scanning every owner), and each tensor of the class reuses the result. Allowed
   senders of a demand are the owners on the receiver's node if any (bandwidth first), else all.
2. **Load balance** (all tensors of the fused schedule together): demands that share an allowed
   sender set form a class; a parametric max-flow finds the per-sender quotas that minimise the
   largest number of bytes any rank sends; each receiver of a class takes from every sender of
   the class in proportion to that sender's quota (so one receiver's bytes spread over all its
   links, not over the first sender's), and its boxes are dealt to meet those shares, cutting a
   box along its outermost dimension when a share ends inside it.
3. **Local copies** stay per class (``LocalCopies``): a rank expands only its own.

Unknown nodes (a device missing from ``node_of``) share no node with anyone.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

from hspmd_elastic.annotations import AnnotationError, Ranges, TensorAnnotation
from hspmd_elastic.reshard.api import (
    FusedSchedule,
    LocalCopies,
    ReshardError,
    ReshardPlanError,
    Schedule,
    TensorSpec,
    Transfer,
)
from hspmd_elastic.reshard.balance import balanced_quotas
from hspmd_elastic.reshard.slicing import class_plan, numel as _numel


@dataclass(frozen=True)
class _Demand:
    """A box a receiver needs from one of ``senders``."""

    spec_index: int
    dst: int
    box: Ranges
    senders: tuple[int, ...]


def _check_spec(spec: TensorSpec) -> None:
    for which, ann in (("old", spec.old), ("new", spec.new)):
        if ann.any_partial():
            raise ReshardPlanError(
                f"tensor {spec.name!r}: the {which} annotation is partial (-2); BSR moves only "
                "whole values, reduce the partial sums first"
            )
        try:
            ann.validate(spec.shape, exact=False)
        except AnnotationError as exc:
            raise ReshardPlanError(f"tensor {spec.name!r}, {which} annotation: {exc}") from exc


def _cut(box: Ranges, nbytes: int, itemsize: int) -> tuple[Ranges, Ranges] | None:
    """Split ``box`` along its outermost dimension of extent > 1 near ``nbytes`` for the head."""
    for d, (lo, hi) in enumerate(box):
        if hi - lo > 1:
            row = _numel(box) // (hi - lo) * itemsize
            rows = min(max((2 * nbytes + row) // (2 * row), 1), hi - lo - 1)
            head = box[:d] + ((lo, lo + rows),) + box[d + 1 :]
            tail = box[:d] + ((lo + rows, hi),) + box[d + 1 :]
            return head, tail
    return None


def _assign_senders(specs: tuple[TensorSpec, ...], demands: list[_Demand]) -> list[Transfer]:
    """Choose a sender for every demanded box so the busiest sender sends as little as possible
    and each receiver's bytes spread over its senders' links in proportion to their quotas."""
    by_class: dict[tuple[int, ...], list[tuple[int, _Demand]]] = defaultdict(list)
    for dem in demands:
        by_class[dem.senders].append((_numel(dem.box) * specs[dem.spec_index].itemsize, dem))

    loads = {c: sum(size for size, _ in ds) for c, ds in by_class.items()}
    quotas = balanced_quotas(loads)
    out: list[Transfer] = []
    for senders in sorted(by_class):
        load = loads[senders]
        per_dst: dict[int, list[tuple[int, _Demand]]] = defaultdict(list)
        for item in by_class[senders]:
            per_dst[item[1].dst].append(item)
        for dst in sorted(per_dst):
            # This receiver's share of every sender's quota: its links carry proportional bytes.
            need = sum(size for size, _ in per_dst[dst])
            remaining = {s: need * quotas[senders][s] // load for s in senders}
            short = need - sum(remaining.values())  # < len(senders): floor rounding
            for s in sorted(senders, key=lambda s: (-quotas[senders][s], s))[:short]:
                remaining[s] += 1
            # The sender with the most bytes left (lowest id on ties) serves the next box.
            heap = [(-left, s) for s, left in remaining.items()]
            heapq.heapify(heap)
            for size, dem in sorted(per_dst[dst],
                                    key=lambda it: (-it[0], it[1].spec_index, it[1].box)):
                itemsize = specs[dem.spec_index].itemsize
                name = specs[dem.spec_index].name
                box: Ranges | None = dem.box
                while box is not None:
                    left, src = heap[0]
                    left = -left
                    cut = _cut(box, left, itemsize) if 0 < left < size else None
                    head, box = (cut[0], cut[1]) if cut else (box, None)
                    head_bytes = _numel(head) * itemsize if cut else size
                    out.append(Transfer(name, src, dem.dst, head, head_bytes))
                    heapq.heapreplace(heap, (-(left - head_bytes), src))
                    size -= head_bytes
    return out


class _Request:
    """The cache key of a request: specs, alive set and node map.

    Annotations of a large model are many equal objects of hundreds of groups each; hashing is
    done once per distinct object (ids are stable while the key holds the specs), and equality
    checks identity first, so a repeated request costs little more than its own iteration.
    """

    def __init__(self, specs: tuple[TensorSpec, ...], alive: frozenset[int],
                 node_items: tuple[tuple[int, str], ...]) -> None:
        self.specs, self.alive, self.node_items = specs, alive, node_items
        memo: dict[int, int] = {}
        self.ann_hash = lambda ann: memo.get(id(ann)) or memo.setdefault(id(ann), hash(ann))
        self._hash = hash((tuple((s.name, s.shape, s.dtype, self.ann_hash(s.old),
                                  self.ann_hash(s.new)) for s in specs), alive, node_items))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Request) and self._hash == other._hash
                and self.specs == other.specs and self.alive == other.alive
                and self.node_items == other.node_items)


def _classes(request: _Request) -> list[list[int]]:
    """Indices of the specs, grouped by (shape, old, new), in order of first appearance."""
    buckets: dict[tuple, list[list[int]]] = {}
    specs = request.specs
    for i, spec in enumerate(specs):
        key = (spec.shape, request.ann_hash(spec.old), request.ann_hash(spec.new))
        for members in buckets.setdefault(key, []):
            first = specs[members[0]]
            if first.old == spec.old and first.new == spec.new:  # identity first, then value
                members.append(i)
                break
        else:
            buckets[key].append([i])
    return sorted((m for ms in buckets.values() for m in ms), key=lambda m: m[0])


def _plan(request: _Request) -> FusedSchedule:
    specs, alive = request.specs, request.alive
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ReshardPlanError(f"tensor names must be unique in a fused schedule, repeated: {dup}")
    node_of = dict(request.node_items)
    classes = _classes(request)
    for members in classes:
        _check_spec(specs[members[0]])  # the first spec that fails is named, as a loop would
    parts = []
    demands: list[_Demand] = []
    missing_of: dict[int, tuple[Ranges, ...]] = {}
    for members in classes:
        first = specs[members[0]]
        moves = class_plan(first.shape, first.old, first.new, alive, node_of, near_first=True)
        for i in members:
            demands.extend(_Demand(i, dst, box, owners) for dst, box, owners in moves.demands)
            if moves.missing:
                missing_of[i] = moves.missing
        parts.append((tuple((i, specs[i].name, specs[i].itemsize) for i in members), moves.local))
    if missing_of:
        raise ReshardError([(specs[i].name, box) for i in sorted(missing_of)
                            for box in missing_of[i]])
    order = {s.name: i for i, s in enumerate(specs)}
    dtype = {s.name: s.dtype for s in specs}
    transfers = sorted(
        _assign_senders(specs, demands),
        key=lambda t: (t.src, t.dst, dtype[t.tensor], order[t.tensor], t.ranges),
    )
    return FusedSchedule(specs, LocalCopies(parts), tuple(transfers))


_plan_cached = functools.lru_cache(maxsize=32)(_plan)


def fused_bsr_schedule(
    tensors: Iterable[TensorSpec], alive: Iterable[int], node_of: Mapping[int, str]
) -> FusedSchedule:
    """One schedule moving every tensor from its old to its new annotation.

    ``alive``: devices whose old shards still exist. ``node_of``: node name of each device.
    Raises ``ReshardError`` listing every slice without a live owner, ``ReshardPlanError`` for a
    request that cannot be planned. Results are cached by their inputs.
    """
    key_nodes = tuple(sorted((int(d), str(n)) for d, n in node_of.items()))
    return _plan_cached(_Request(tuple(tensors), frozenset(alive), key_nodes))


def plan_tensor(
    name: str,
    shape: tuple[int, ...],
    old: TensorAnnotation,
    new: TensorAnnotation,
    alive: Iterable[int],
    node_of: Mapping[int, str],
    dtype: str = "float32",
) -> Schedule:
    """The BSR plan of a single tensor (balanced on its own)."""
    fused = fused_bsr_schedule([TensorSpec(name, tuple(shape), dtype, old, new)], alive, node_of)
    return Schedule(fused.specs[0].name, fused.specs[0].shape, tuple(fused.local),
                    fused.transfers)


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()
