"""Gradient synchronisation across pipelines whose layouts differ (split all-reduce).

Each pipeline holds a full replica of every parameter, sharded over that pipeline's TP group, so
gradients must be summed across pipelines. When TP degrees differ the shards do not line up; the
finest common slicing does: cut the split dimension into ``lcm(tp_p)`` micro-blocks. Micro-block
``j`` is held in pipeline ``p`` by TP rank ``j * tp_p // lcm``; the holders of one micro-block,
one per pipeline, all-reduce it. Neighbouring micro-blocks with the same holders form one
operation, and all operations of one group travel in one buffer.

Parameters duplicated inside a TP group (norm scales) are summed over all their holders at once,
each holder contributing only its ``1/tp`` share (zeros elsewhere), so each pipeline counts once.

Gradients arrive already weighted by each micro-batch's share of the global batch (the loss is
divided by the global token count), so the plain sum is the gradient of the global mean.
``sync_ops`` is pure; ``sync_gradients`` is the thin effect over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hspmd_elastic.plan import ParamLayout, lcm_tp


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


def _block_runs(groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first, stop, holders) for each run of micro-blocks with the same holders."""
    blocks = lcm_tp(groups)
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for j in range(blocks):
        holders = tuple(g[j * len(g) // blocks] for g in groups)
        if runs and runs[-1][2] == holders:
            runs[-1] = (runs[-1][0], j + 1, holders)
        else:
            runs.append((j, j + 1, holders))
    return runs


def _param_ops(name: str, layout: ParamLayout, device: int) -> list[SyncOp]:
    mine = [(p, g.index(device)) for p, g in enumerate(layout.groups) if device in g]
    if not mine or len(layout.groups) < 2:
        return []
    _, tp_rank = mine[0]
    tp = len(layout.groups[mine[0][0]])
    if layout.split_dim is None:
        numel = 1
        for n in layout.shape:
            numel *= n
        members = tuple(sorted(d for g in layout.groups for d in g))
        return [SyncOp(name, members, None, numel * tp_rank // tp, numel * (tp_rank + 1) // tp)]
    blocks = lcm_tp(layout.groups)
    rows = layout.shape[layout.split_dim] // blocks
    first, stop = tp_rank * blocks // tp, (tp_rank + 1) * blocks // tp
    ops = []
    for lo, hi, holders in _block_runs(layout.groups):
        lo, hi = max(lo, first), min(hi, stop)
        if lo < hi:
            ops.append(SyncOp(name, tuple(sorted(holders)), layout.split_dim,
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
