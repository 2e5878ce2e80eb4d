"""What a reshard moves, for one class of tensors: slices, owner index, local reuse, demands.

A class is every tensor of a request that shares its shape and both annotations: they slice the
same way, have the same owners and need the same boxes, so the work here is done once per class
and the planner stamps the result onto each tensor's name. Pure: a function of its arguments only
(no set or dict iteration order leaks into the result).

1. **Slices**: per dimension, the cut points of every old and new shard. Their product is the
   coarsest grid that refines both layouts (the finest common slicing); it also handles uneven,
   heterogeneous splits where an LCM of split counts would not.
2. **Owner index**: per dimension and slice, the set of live old shards covering it, as a bitset
   over the live owners (built by one sweep over the cut points). A cell's owners are the AND of
   its slices' sets, so no receiver ever scans the list of owners; replicas are alternatives.
3. **Per receiver and cell**: reuse the local copy when the receiver owns the cell; a cell with no
   owner is missing; otherwise it is demanded from its owners. Adjacent cells with the same
   outcome are merged back into larger boxes.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

from hspmd_elastic.annotations import Ranges, TensorAnnotation

_LOCAL = "local"
_MISSING = "missing"


@dataclass(frozen=True)
class ClassPlan:
    """The movement of one tensor class, independent of names and dtypes.

    ``local``: per receiver, the boxes it copies from its own old shard (sorted).
    ``demands``: ``(receiver, box, owners)``; ``owners`` are the live devices holding all of box,
    ascending. ``missing``: boxes some receiver needs and no live device holds (merged, sorted).
    """

    local: Mapping[int, tuple[Ranges, ...]]
    demands: tuple[tuple[int, Ranges, tuple[int, ...]], ...]
    missing: tuple[Ranges, ...]


def numel(box: Ranges) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _grid(shape: tuple[int, ...], boxes: Iterable[Ranges]) -> list[list[int]]:
    cuts = [{0, n} for n in shape]
    for box in boxes:
        for d, (lo, hi) in enumerate(box):
            cuts[d].update((lo, hi))
    return [sorted(c) for c in cuts]


def merge_boxes(items: list[tuple[object, Ranges]]) -> list[tuple[object, Ranges]]:
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


def _coverage(cuts: list[int], spans: list[tuple[int, int, int]]) -> list[int]:
    """Per slice ``[cuts[k], cuts[k+1])``, the OR of the bits of the spans ``(lo, hi, bit)``
    covering it (every span starts and ends on a cut)."""
    at = {c: k for k, c in enumerate(cuts)}
    starts = [0] * len(cuts)
    ends = [0] * len(cuts)
    for lo, hi, bit in spans:
        starts[at[lo]] |= bit
        ends[at[hi]] |= bit
    out, cur = [], 0
    for k in range(len(cuts) - 1):
        cur = (cur & ~ends[k]) | starts[k]
        out.append(cur)
    return out


class _OwnerIndex:
    """Owners of any grid cell by bitset intersection; owner tuples decoded once per set."""

    def __init__(self, grid: list[list[int]], owners: list[int], shards: Mapping[int, Ranges]):
        self.owners = owners
        self.bit = {o: 1 << i for i, o in enumerate(owners)}
        self.masks = [
            _coverage(cuts, [(shards[o][d][0], shards[o][d][1], self.bit[o]) for o in owners])
            for d, cuts in enumerate(grid)
        ]
        self.all = (1 << len(owners)) - 1
        self._decoded: dict[int, tuple[int, ...]] = {}

    def mask(self, slices: tuple[int, ...]) -> int:
        m = self.all
        for d, k in enumerate(slices):
            m &= self.masks[d][k]
        return m

    def decode(self, mask: int) -> tuple[int, ...]:
        found = self._decoded.get(mask)
        if found is None:
            found, rest = [], mask
            while rest:
                low = rest & -rest
                found.append(self.owners[low.bit_length() - 1])
                rest ^= low
            found = self._decoded[mask] = tuple(found)
        return found


def _slice_ranges(box: Ranges, grid: list[list[int]]) -> list[range]:
    """Per dimension, the slice indices inside ``box`` (every shard is a union of whole slices)."""
    out = []
    for (lo, hi), cuts in zip(box, grid):
        i, j = bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi)
        out.append(range(i, j))
    return out


def _cells(box: Ranges, grid: list[list[int]]) -> list[tuple[tuple[int, ...], Ranges]]:
    """(slice indices, cell) of every non-empty grid cell inside ``box``."""
    cells: list[tuple[tuple[int, ...], Ranges]] = [((), ())]
    for d, axis in enumerate(_slice_ranges(box, grid)):
        cuts = grid[d]
        spans = [(k, (cuts[k], cuts[k + 1])) for k in axis if cuts[k] < cuts[k + 1]]
        cells = [(ks + (k,), c + (iv,)) for ks, c in cells for k, iv in spans]
    return cells


def class_plan(
    shape: tuple[int, ...],
    old: TensorAnnotation,
    new: TensorAnnotation,
    alive: frozenset[int],
) -> ClassPlan:
    """Local copies, demands and missing boxes of every tensor of shape ``shape`` moving from
    ``old`` to ``new``; every live owner of a demanded box is listed."""
    old_shards = {d: r for d, r in old.shards(shape).items() if numel(r) > 0}
    new_shards = {d: r for d, r in new.shards(shape).items() if numel(r) > 0}
    grid = _grid(shape, list(old_shards.values()) + list(new_shards.values()))
    live = sorted(d for d in old_shards if d in alive)
    index = _OwnerIndex(grid, live, old_shards)
    local: dict[int, tuple[Ranges, ...]] = {}
    demands: list[tuple[int, Ranges, tuple[int, ...]]] = []
    missing: set[Ranges] = set()
    for dst in sorted(new_shards):
        dst_bit = index.bit.get(dst, 0)
        keyed: list[tuple[object, Ranges]] = []
        for slices, cell in _cells(new_shards[dst], grid):
            mask = index.mask(slices)
            if mask & dst_bit:
                keyed.append((_LOCAL, cell))
            elif not mask:
                missing.add(cell)  # one report per region, however many need it
            else:
                keyed.append((index.decode(mask), cell))
        mine = []
        for key, box in merge_boxes(keyed):
            if key == _LOCAL:
                mine.append(box)
            else:
                demands.append((dst, box, key))  # type: ignore[arg-type]
        if mine:
            local[dst] = tuple(mine)
    lost = tuple(box for _, box in merge_boxes([(_MISSING, c) for c in missing]))
    return ClassPlan(local, tuple(demands), lost)
