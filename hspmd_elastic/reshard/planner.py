"""Pure BSR planning: slices, owner map, local reuse, sender choice, fused schedule.

Every function here is a function of its arguments only (no torch, no I/O, no randomness, no
dependence on set or dict iteration order), so every rank computes the same schedule alone.

Steps for each tensor:
1. **Slices**: per dimension, the cut points of every old and new shard. Their product is the
   coarsest grid that refines both layouts (the finest common slicing); it also handles uneven,
   heterogeneous splits where an LCM of split counts would not.
2. **Owner map**: the owners of a grid cell are the live devices whose old shard contains it;
   replicas are alternatives.
3. **Per receiver and cell**: reuse the local copy when the receiver owns the cell; otherwise the
   allowed senders are the owners on the receiver's node if any (bandwidth first), else all owners.
   Adjacent cells with the same choice are merged back into larger boxes.
4. **Load balance** (all tensors of the fused schedule together): demands that share an allowed
   sender set form a class; a parametric max-flow finds the per-sender quotas that minimise the
   largest number of bytes any rank sends; each receiver of a class takes from every sender of
   the class in proportion to that sender's quota (so one receiver's bytes spread over all its
   links, not over the first sender's), and its boxes are dealt to meet those shares, cutting a
   box along its outermost dimension when a share ends inside it.

Unknown nodes (a device missing from ``node_of``) share no node with anyone.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

from hspmd_elastic.annotations import AnnotationError, Ranges, TensorAnnotation
from hspmd_elastic.reshard.api import (
    FusedSchedule,
    ReshardError,
    ReshardPlanError,
    Schedule,
    TensorSpec,
    Transfer,
)
from hspmd_elastic.reshard.balance import balanced_quotas

_LOCAL = "local"
_MISSING = "missing"


@dataclass(frozen=True)
class _Demand:
    """A box a receiver needs from one of ``senders``."""

    spec_index: int
    dst: int
    box: Ranges
    senders: tuple[int, ...]


def _numel(box: Ranges) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _contains(outer: Ranges, inner: Ranges) -> bool:
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner))


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


def _grid(shape: tuple[int, ...], boxes: Iterable[Ranges]) -> list[list[int]]:
    cuts = [{0, n} for n in shape]
    for box in boxes:
        for d, (lo, hi) in enumerate(box):
            cuts[d].update((lo, hi))
    return [sorted(c) for c in cuts]


def _cells_of(box: Ranges, grid: list[list[int]]) -> list[Ranges]:
    """The grid cells inside ``box`` (every shard is a union of whole cells)."""
    axes = []
    for (lo, hi), cuts in zip(box, grid):
        i, j = bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi)
        axes.append([(cuts[k], cuts[k + 1]) for k in range(i, j) if cuts[k] < cuts[k + 1]])
    cells: list[Ranges] = [()]
    for axis in axes:
        cells = [c + (iv,) for c in cells for iv in axis]
    return cells


def _merge_boxes(items: list[tuple[object, Ranges]]) -> list[tuple[object, Ranges]]:
    """Merge adjacent boxes with equal keys into larger boxes, one dimension at a time."""
    if not items:
        return []
    ndim = len(items[0][1])
    for d in reversed(range(ndim)):
        groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for key, box in items:
            groups[(key, box[:d], box[d + 1 :])].append(box[d])
        merged: list[tuple[object, Ranges]] = []
        for (key, head, tail), spans in groups.items():
            spans.sort()
            lo, hi = spans[0]
            for a, b in spans[1:]:
                if a == hi:
                    hi = b
                else:
                    merged.append((key, head + ((lo, hi),) + tail))
                    lo, hi = a, b
            merged.append((key, head + ((lo, hi),) + tail))
        items = merged
    return sorted(items, key=lambda kb: kb[1])


def _tensor_demands(
    spec_index: int,
    spec: TensorSpec,
    alive: frozenset[int],
    node_of: Mapping[int, str],
) -> tuple[list[Transfer], list[_Demand], list[Ranges]]:
    """Local copies, demands and missing boxes of one tensor."""
    old_shards = {d: r for d, r in spec.old.shards(spec.shape).items() if _numel(r) > 0}
    new_shards = {d: r for d, r in spec.new.shards(spec.shape).items() if _numel(r) > 0}
    grid = _grid(spec.shape, list(old_shards.values()) + list(new_shards.values()))
    live_owners = sorted(d for d in old_shards if d in alive)
    local: list[Transfer] = []
    demands: list[_Demand] = []
    missing: set[Ranges] = set()
    for dst in sorted(new_shards):
        dst_node = node_of.get(dst)
        keyed: list[tuple[object, Ranges]] = []
        for cell in _cells_of(new_shards[dst], grid):
            owners = tuple(o for o in live_owners if _contains(old_shards[o], cell))
            if dst in owners:
                keyed.append((_LOCAL, cell))
            elif not owners:
                missing.add(cell)  # one report per region, however many need it
            else:
                near = tuple(o for o in owners if dst_node is not None and node_of.get(o) == dst_node)
                keyed.append((near or owners, cell))
        for key, box in _merge_boxes(keyed):
            if key == _LOCAL:
                local.append(Transfer(spec.name, dst, dst, box, _numel(box) * spec.itemsize))
            else:
                demands.append(_Demand(spec_index, dst, box, key))  # type: ignore[arg-type]
    return local, demands, [box for _, box in _merge_boxes([(_MISSING, c) for c in missing])]


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
    by_class: dict[tuple[int, ...], list[_Demand]] = defaultdict(list)
    for dem in demands:
        by_class[dem.senders].append(dem)

    def nbytes(dem_spec: int, box: Ranges) -> int:
        return _numel(box) * specs[dem_spec].itemsize

    loads = {c: sum(nbytes(d.spec_index, d.box) for d in ds) for c, ds in by_class.items()}
    quotas = balanced_quotas(loads)
    out: list[Transfer] = []
    for senders in sorted(by_class):
        load = loads[senders]
        per_dst: dict[int, list[_Demand]] = defaultdict(list)
        for dem in by_class[senders]:
            per_dst[dem.dst].append(dem)
        for dst in sorted(per_dst):
            # This receiver's share of every sender's quota: its links carry proportional bytes.
            need = sum(nbytes(d.spec_index, d.box) for d in per_dst[dst])
            remaining = {s: need * quotas[senders][s] // load for s in senders}
            short = need - sum(remaining.values())  # < len(senders): floor rounding
            for s in sorted(senders, key=lambda s: (-quotas[senders][s], s))[:short]:
                remaining[s] += 1
            ordered = sorted(per_dst[dst],
                             key=lambda d: (-nbytes(d.spec_index, d.box), d.spec_index, d.box))
            for dem in ordered:
                spec = specs[dem.spec_index]
                box: Ranges | None = dem.box
                while box is not None:
                    src = max(senders, key=lambda s: (remaining[s], -s))
                    size = nbytes(dem.spec_index, box)
                    cut = (_cut(box, remaining[src], spec.itemsize)
                           if 0 < remaining[src] < size else None)
                    head, box = (cut[0], cut[1]) if cut else (box, None)
                    head_bytes = nbytes(dem.spec_index, head)
                    out.append(Transfer(spec.name, src, dem.dst, head, head_bytes))
                    remaining[src] -= head_bytes
    return out


def _plan(
    specs: tuple[TensorSpec, ...], alive: frozenset[int], node_items: tuple[tuple[int, str], ...]
) -> FusedSchedule:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ReshardPlanError(f"tensor names must be unique in a fused schedule, repeated: {dup}")
    node_of = dict(node_items)
    local: list[Transfer] = []
    demands: list[_Demand] = []
    missing: list[tuple[str, Ranges]] = []
    for i, spec in enumerate(specs):
        _check_spec(spec)
        spec_local, spec_demands, spec_missing = _tensor_demands(i, spec, alive, node_of)
        local.extend(spec_local)
        demands.extend(spec_demands)
        missing.extend((spec.name, box) for box in spec_missing)
    if missing:
        raise ReshardError(missing)
    order = {s.name: i for i, s in enumerate(specs)}
    dtype = {s.name: s.dtype for s in specs}
    transfers = sorted(
        _assign_senders(specs, demands),
        key=lambda t: (t.src, t.dst, dtype[t.tensor], order[t.tensor], t.ranges),
    )
    local.sort(key=lambda t: (t.dst, order[t.tensor], t.ranges))
    return FusedSchedule(specs, tuple(local), tuple(transfers))


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
    return _plan_cached(tuple(tensors), frozenset(alive), key_nodes)


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
    return Schedule(fused.specs[0].name, fused.specs[0].shape, fused.local, fused.transfers)


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()
