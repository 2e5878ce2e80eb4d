"""Gradient synchronisation across pipelines whose layouts differ (split all-reduce).

Each pipeline holds a full replica of every parameter, sharded over that pipeline's TP group, so
gradients must be summed across pipelines. When TP degrees differ the shards do not line up; the
finest common slicing does: cut the split dimension into ``lcm(k_p)`` micro-blocks, ``k_p`` the
parts pipeline ``p`` cuts it into (``ParamLayout.parts``: its TP degree, or fewer for replicated
key/value heads). Micro-block ``j`` is part ``j * k_p // lcm`` in pipeline ``p``, held there by
the ``tp_p / k_p`` TP ranks of that part; all holders of one micro-block all-reduce it.
Neighbouring micro-blocks with the same holders form one operation, and all operations of one
group travel in one buffer.

Replicated key/value heads (a TP degree above ``num_kv_heads``): the ranks sharing a part each
back-propagate only their own query heads, so each holds a different partial gradient of the
part, and the sum over them (and over the other pipelines' holders) is the gradient. This needs
an operation even with a single pipeline; a part with a single holder in the whole plan needs
none.

Parameters duplicated inside a TP group (norm scales) are summed over all their holders at once,
each holder contributing only its ``1/tp`` share (zeros elsewhere), so each pipeline counts once.

Gradients arrive already weighted by each micro-batch's share of the global batch (the loss is
divided by the global token count), so the plain sum is the gradient of the global mean.
``sync_ops`` is pure; ``sync_gradients`` is the thin effect over it.

Uneven optimizer shards (``zero.py``, ``sync_ops(..., cuts=)``): each row of a split parameter has
one owner among its holders, so an operation carries ``owners`` (each owning member's rows of it)
and its sum goes to the owners only: one ``reduce_scatter`` per group (uneven sizes, one input
per member: what gloo and NCCL both take) instead of the all-reduce. After the owners' update,
``gather_rows`` brings every holder the new rows it does not own: one ``all_gather`` per group,
each member's rows padded to the largest share (torch's all_gather takes equal sizes only), then
written by ``apply_rows``. Unsplit parameters (no ``owners``) keep the all-reduce.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from hspmd_elastic.plan import ParamLayout


@dataclass(frozen=True)
class SyncOp:
    """Sum a part of one parameter's gradient over ``members``.

    Split parameters: local rows ``[lo, hi)`` along ``dim``. Duplicated parameters (``dim`` None):
    the whole tensor, where this rank contributes flat elements ``[lo, hi)`` and zeros elsewhere.
    ``owners`` (uneven optimizer shards): ``(member, lo, hi)``, the local rows of the operation
    each owning member gets the sum of (in this rank's local coordinates, ascending); empty: every
    member gets the whole sum.
    """

    name: str
    members: tuple[int, ...]
    dim: Optional[int]
    lo: int
    hi: int
    owners: tuple[tuple[int, int, int], ...] = ()

    def rows_of(self, member: int) -> tuple[int, int]:
        """The local rows ``[lo, hi)`` that ``member`` owns in this operation (empty: none)."""
        for d, lo, hi in self.owners:
            if d == member:
                return lo, hi
        return self.lo, self.lo


@functools.lru_cache(maxsize=256)
def _block_runs(layout: ParamLayout) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """(first, stop, holders) for each run of micro-blocks with the same holders (sorted)."""
    parts = [layout.parts(g) for g in range(len(layout.groups))]
    blocks = math.lcm(*parts)
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for j in range(blocks):
        held = []
        for g, group in enumerate(layout.groups):
            reps = layout.replicas(g)
            part = j * parts[g] // blocks
            held.extend(group[part * reps:(part + 1) * reps])
        holders = tuple(sorted(held))
        if runs and runs[-1][2] == holders:
            runs[-1] = (runs[-1][0], j + 1, holders)
        else:
            runs.append((j, j + 1, holders))
    return tuple(runs)


def _owners(cut, glo: int, ghi: int, offset: int) -> tuple[tuple[int, int, int], ...]:
    """The owner cut's pieces inside global rows ``[glo, ghi)``, as local rows (``- offset``)."""
    return tuple((d, max(a, glo) - offset, min(b, ghi) - offset)
                 for d, a, b in cut if max(a, glo) < min(b, ghi))


def _param_ops(name: str, layout: ParamLayout, device: int, cut=None) -> list[SyncOp]:
    mine = [(p, g.index(device)) for p, g in enumerate(layout.groups) if device in g]
    if not mine:
        return []
    group, tp_rank = mine[0]
    tp = len(layout.groups[group])
    if layout.split_dim is None:
        if len(layout.groups) < 2:  # duplicates inside one TP group get identical gradients
            return []
        numel = 1
        for n in layout.shape:
            numel *= n
        members = tuple(sorted(d for g in layout.groups for d in g))
        return [SyncOp(name, members, None, numel * tp_rank // tp, numel * (tp_rank + 1) // tp)]
    parts = layout.parts(group)
    blocks = math.lcm(*(layout.parts(g) for g in range(len(layout.groups))))
    rows = layout.shape[layout.split_dim] // blocks
    part = layout.part_of(group, tp_rank)
    first, stop = part * blocks // parts, (part + 1) * blocks // parts
    ops = []
    for lo, hi, holders in _block_runs(layout):
        lo, hi = max(lo, first), min(hi, stop)
        if lo < hi and len(holders) > 1:
            owners = () if cut is None else _owners(cut, lo * rows, hi * rows, first * rows)
            ops.append(SyncOp(name, holders, layout.split_dim,
                              (lo - first) * rows, (hi - first) * rows, owners))
    return ops


def sync_ops(layouts: dict[str, ParamLayout], device: int,
             cuts: Optional[Mapping[str, tuple[tuple[int, int, int], ...]]] = None
             ) -> list[SyncOp]:
    """The operations ``device`` joins, in an order every member of every group agrees on.
    ``cuts``: per split parameter, its owner cut (``zero.plan_cuts``; uneven optimizer shards)."""
    cuts = cuts or {}
    return [op for name, layout in layouts.items()
            for op in _param_ops(name, layout, device, cuts.get(name))]


def sync_group_members(layouts: dict[str, ParamLayout]) -> set[tuple[int, ...]]:
    """Every group any device synchronises over."""
    out = set()
    for name, layout in layouts.items():
        for group in layout.groups:
            for device in group:
                out.update(op.members for op in _param_ops(name, layout, device))
    return out


def _contribution(op: SyncOp, grad):
    if op.dim is None:
        flat = grad.reshape(-1)
        buf = flat.new_zeros(flat.numel())
        buf[op.lo:op.hi] = flat[op.lo:op.hi]
        return buf
    return grad.narrow(op.dim, op.lo, op.hi - op.lo).reshape(-1)


def _write_back(op: SyncOp, grad, summed) -> None:
    if op.dim is None:
        grad.copy_(summed.view_as(grad))
    else:
        part = grad.narrow(op.dim, op.lo, op.hi - op.lo)
        part.copy_(summed.view_as(part))


def _rows(op: SyncOp, tensor, lo: int, hi: int):
    return tensor.narrow(op.dim, lo, hi - lo)


def _by_group(ops: list[SyncOp]) -> list[tuple[tuple[int, ...], list[SyncOp]]]:
    by_group: dict[tuple[int, ...], list[SyncOp]] = {}
    for op in ops:
        by_group.setdefault(op.members, []).append(op)
    return [(m, by_group[m]) for m in sorted(by_group, key=lambda m: (len(m), m))]


def sync_gradients(ops: list[SyncOp], grads: dict, comm) -> None:
    """Run ``ops`` on ``grads`` (name -> gradient, updated in place): per group one all-reduce
    of its operations without owners, one reduce-scatter of those with owners (the rows this
    rank owns then hold the sum; its other rows are left as they were)."""
    for members, group_ops in _by_group(ops):
        whole = [op for op in group_ops if not op.owners]
        if whole:
            parts = [_contribution(op, grads[op.name]) for op in whole]
            buf = comm.all_reduce(torch.cat(parts), members)
            for op, summed in zip(whole, torch.split(buf, [p.numel() for p in parts])):
                _write_back(op, grads[op.name], summed)
        owned = [op for op in group_ops if op.owners]
        if owned:
            _reduce_scatter(owned, members, grads, comm)


def _reduce_scatter(ops: list[SyncOp], members: tuple[int, ...], grads: dict, comm) -> None:
    inputs = [torch.cat([_rows(op, grads[op.name], *op.rows_of(d)).reshape(-1) for op in ops])
              for d in members]  # group ranks follow the sorted members
    out = torch.empty_like(inputs[members.index(comm.rank)])
    what = f"reduce_scatter over {members}"
    work = comm.post(lambda: dist.reduce_scatter(out, inputs, group=comm.group(members),
                                                 async_op=True), what)
    comm.wait(work, what)
    at = 0
    for op in ops:
        target = _rows(op, grads[op.name], *op.rows_of(comm.rank))
        target.copy_(out[at:at + target.numel()].view_as(target))
        at += target.numel()


RowWrite = tuple[SyncOp, int, int, object]  # (operation, lo, hi, new rows) of a local tensor


def gather_rows(ops: list[SyncOp], new_rows: Callable[[str, int, int], object],
                shapes: Mapping[str, tuple[int, ...]], comm) -> list[RowWrite]:
    """After the owners' update: the rows of every operation with owners that other members
    own, new, from one padded all-gather per group. ``new_rows(name, lo, hi)``: this rank's new
    values of its own rows ``[lo, hi)``; ``shapes``: each parameter's local shard shape. Nothing
    is written: ``apply_rows`` does it once every communication of the step succeeded."""
    writes: list[RowWrite] = []
    for members, group_ops in _by_group([op for op in ops if op.owners]):
        row = {op.name: math.prod(shapes[op.name]) // shapes[op.name][op.dim] for op in group_ops}
        sizes = {d: sum((op.rows_of(d)[1] - op.rows_of(d)[0]) * row[op.name] for op in group_ops)
                 for d in members}
        mine = [new_rows(op.name, *op.rows_of(comm.rank)).reshape(-1) for op in group_ops]
        width = max(sizes.values())
        buf = torch.cat(mine + [mine[0].new_zeros(width - sizes[comm.rank])])
        for d, got in zip(members, comm.all_gather(buf, members)):
            if d == comm.rank:
                continue
            at = 0
            for op in group_ops:
                lo, hi = op.rows_of(d)
                n = (hi - lo) * row[op.name]
                if n:
                    writes.append((op, lo, hi, got[at:at + n]))
                at += n
    return writes


def apply_rows(writes: list[RowWrite], params: Mapping[str, object]) -> None:
    """Write ``gather_rows``'s rows into the local shards ``params`` (name -> tensor)."""
    for op, lo, hi, values in writes:
        target = _rows(op, params[op.name], lo, hi)
        target.copy_(values.view(target.shape))
