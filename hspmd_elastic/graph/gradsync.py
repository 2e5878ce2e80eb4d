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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from hspmd_elastic.plan import ParamLayout


@dataclass(frozen=True)
class SyncOp:
    """Sum a part of one parameter's gradient over ``members``.

    Split parameters: local rows ``[lo, hi)`` along ``dim``. Duplicated parameters (``dim`` None):
    the whole tensor, where this rank contributes flat elements ``[lo, hi)`` and zeros elsewhere.
    """

    name: str
    members: tuple[int, ...]
    dim: Optional[int]
    lo: int
    hi: int


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


def _param_ops(name: str, layout: ParamLayout, device: int) -> list[SyncOp]:
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
            ops.append(SyncOp(name, holders, layout.split_dim,
                              (lo - first) * rows, (hi - first) * rows))
    return ops


def sync_ops(layouts: dict[str, ParamLayout], device: int) -> list[SyncOp]:
    """The operations ``device`` joins, in an order every member of every group agrees on."""
    return [op for name, layout in layouts.items() for op in _param_ops(name, layout, device)]


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


def sync_gradients(ops: list[SyncOp], grads: dict, comm) -> None:
    """Run ``ops`` on ``grads`` (name -> gradient, updated in place): one all-reduce per group."""
    import torch

    by_group: dict[tuple[int, ...], list[SyncOp]] = {}
    for op in ops:
        by_group.setdefault(op.members, []).append(op)
    for members in sorted(by_group, key=lambda m: (len(m), m)):
        group_ops = by_group[members]
        parts = [_contribution(op, grads[op.name]) for op in group_ops]
        buf = comm.all_reduce(torch.cat(parts), members)
        for op, summed in zip(group_ops, torch.split(buf, [p.numel() for p in parts])):
            _write_back(op, grads[op.name], summed)
