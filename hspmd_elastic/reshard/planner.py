"""Pure BSR planning: tensor classes, what moves (``slicing``), senders by time, fused schedule.

Every function here is a function of its arguments only (no torch, no I/O, no randomness, no
dependence on set or dict iteration order), so every rank computes the same schedule alone.

1. **Classes**: tensors that share shape and both annotations move alike; ``slicing.class_plan``
   computes their local copies, demands and missing boxes once (owners found through a per-cell
   index, never by scanning every owner), and each tensor of the class reuses the result.
2. **Senders** (all tensors of the fused schedule together, ``senders.choose_senders``): every
   owner of a demanded box may serve it, wherever it sits; shares are chosen to minimise the
   estimated finish time of the exchange under a ``LinkModel`` (same device, same host, cross
   host with each host's NIC shared), splitting a receiver's demand over several owners when
   that finishes sooner.
3. **Local copies** stay per class (``LocalCopies``): a rank expands only its own.

Results are cached by their inputs (specs, alive set, node map, link model).
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

from hspmd_elastic.annotations import AnnotationError, Ranges, TensorAnnotation
from hspmd_elastic.reshard.api import (
    FusedSchedule,
    LocalCopies,
    ReshardError,
    ReshardPlanError,
    Schedule,
    TensorSpec,
)
from hspmd_elastic.reshard.links import DEFAULT_LINKS, LinkModel
from hspmd_elastic.reshard.senders import choose_senders
from hspmd_elastic.reshard.slicing import class_plan


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


class _Request:
    """The cache key of a request: specs, alive set and node map.

    Annotations of a large model are many equal objects of hundreds of groups each; hashing is
    done once per distinct object (ids are stable while the key holds the specs), and equality
    checks identity first, so a repeated request costs little more than its own iteration.
    """

    def __init__(self, specs: tuple[TensorSpec, ...], alive: frozenset[int],
                 node_items: tuple[tuple[int, str], ...], links: LinkModel) -> None:
        self.specs, self.alive, self.node_items, self.links = specs, alive, node_items, links
        memo: dict[int, int] = {}
        self.ann_hash = lambda ann: memo.get(id(ann)) or memo.setdefault(id(ann), hash(ann))
        self._hash = hash((tuple((s.name, s.shape, s.dtype, self.ann_hash(s.old),
                                  self.ann_hash(s.new)) for s in specs), alive, node_items,
                           links))

        self._equal: dict[tuple[int, int], bool] = {}

    def same(self, a: TensorAnnotation, b: TensorAnnotation) -> bool:
        """``a == b``, identity first, each pair of distinct objects compared once."""
        if a is b:
            return True
        key = (id(a), id(b))
        found = self._equal.get(key)
        if found is None:
            found = self._equal[key] = a == b
        return found

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Request) and self._hash == other._hash
                and self.specs == other.specs and self.alive == other.alive
                and self.node_items == other.node_items and self.links == other.links)


def _classes(request: _Request) -> list[list[int]]:
    """Indices of the specs, grouped by (shape, old, new), in order of first appearance."""
    buckets: dict[tuple, list[list[int]]] = {}
    specs = request.specs
    for i, spec in enumerate(specs):
        key = (spec.shape, request.ann_hash(spec.old), request.ann_hash(spec.new))
        for members in buckets.setdefault(key, []):
            first = specs[members[0]]
            if request.same(first.old, spec.old) and request.same(first.new, spec.new):
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
    demands: list[tuple[int, int, Ranges, tuple[int, ...]]] = []
    missing_of: dict[int, tuple[Ranges, ...]] = {}
    for members in classes:
        first = specs[members[0]]
        moves = class_plan(first.shape, first.old, first.new, alive)
        for i in members:
            demands.extend((i, dst, box, owners) for dst, box, owners in moves.demands)
            if moves.missing:
                missing_of[i] = moves.missing
        parts.append((tuple((i, specs[i].name, specs[i].itemsize) for i in members), moves.local))
    if missing_of:
        raise ReshardError([(specs[i].name, box) for i in sorted(missing_of)
                            for box in missing_of[i]])
    order = {s.name: i for i, s in enumerate(specs)}
    dtype = {s.name: s.dtype for s in specs}
    transfers = sorted(
        choose_senders(specs, demands, node_of, request.links),
        key=lambda t: (t.src, t.dst, dtype[t.tensor], order[t.tensor], t.ranges),
    )
    return FusedSchedule(specs, LocalCopies(parts), tuple(transfers))


_plan_cached = functools.lru_cache(maxsize=32)(_plan)


def fused_bsr_schedule(
    tensors: Iterable[TensorSpec], alive: Iterable[int], node_of: Mapping[int, str],
    links: LinkModel = DEFAULT_LINKS,
) -> FusedSchedule:
    """One schedule moving every tensor from its old to its new annotation.

    ``alive``: devices whose old shards still exist. ``node_of``: node name (host) of each device.
    ``links``: bandwidths of the link classes (default: ``links.DEFAULT_LINKS``). Raises ``ReshardError`` listing every slice without a live owner, ``ReshardPlanError`` for a
    request that cannot be planned. Results are cached by their inputs.
    """
    key_nodes = tuple(sorted((int(d), str(n)) for d, n in node_of.items()))
    return _plan_cached(_Request(tuple(tensors), frozenset(alive), key_nodes, links))


def plan_tensor(
    name: str,
    shape: tuple[int, ...],
    old: TensorAnnotation,
    new: TensorAnnotation,
    alive: Iterable[int],
    node_of: Mapping[int, str],
    dtype: str = "float32",
    links: LinkModel = DEFAULT_LINKS,
) -> Schedule:
    """The BSR plan of a single tensor (balanced on its own)."""
    fused = fused_bsr_schedule([TensorSpec(name, tuple(shape), dtype, old, new)], alive, node_of,
                               links)
    return Schedule(fused.specs[0].name, fused.specs[0].shape, tuple(fused.local),
                    fused.transfers)


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()
