"""Sender choice by estimated time: which owners serve each demanded box, and how much of it.

Input: demands ``(spec_index, receiver, box, owners)``; a ``LinkModel`` and the node map. Output:
transfers that serve every demanded element exactly once, from one of its owners, chosen so the
estimated finish time of the exchange (``links.exchange_time``) is small.

1. **Groups**: demands with the same receiver and owner set are one group of bytes. Its routes:
   each owner on the receiver's host (its ``send`` port into the receiver's ``recv`` port), and
   each other host holding an owner (that host's NIC ``out`` into the receiver host's NIC ``in``).
2. **Water-filling**: groups are placed most constrained first (fewest routes, then largest);
   each group's bytes are split over its routes so the busiest resource it touches finishes as
   early as possible (the level where its routes' spare capacity, limited on the receiver's side
   by the shared ``recv`` port and ``in`` NIC, holds exactly the group's bytes); inside each side
   (near owners, far hosts) the least busy senders fill first, to a common level, so senders end
   evenly when the receiver's side is what limits the group. Two more passes
   take each group out and place it again against everything else, which repairs the choices the
   first pass made before it knew the later groups. A route whose share would take less than one
   message start-up of its class (``LinkModel.cross_host_latency``, ``same_host_latency``) is
   left out and the group placed again: splitting a small demand off to another host does not
   finish it sooner.
3. **Boxes**: the fluid shares are rounded to whole bytes (largest remainders first), a far host's
   share goes to one of its owners (rotating with the receiver, so receivers draw on different
   devices), and the group's boxes are dealt largest first to the sender with the most bytes left,
   cut along their outermost dimension where a share ends inside a box.

Only + - * / min max on floats, in a fixed order: every rank computes the same schedule.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Mapping, Sequence

from hspmd_elastic.annotations import Ranges
from hspmd_elastic.reshard.api import TensorSpec, Transfer
from hspmd_elastic.reshard.links import LinkModel, host_of
from hspmd_elastic.reshard.slicing import numel

_PASSES = 3
_BISECTIONS = 40  # relative precision 2**-40 of a level: far below a byte of any real group


class _Group:
    """One receiver's demands that share an owner set, and its routes."""

    def __init__(self, dst: int, owners: tuple[int, ...], node_of: Mapping[int, str],
                 links: LinkModel) -> None:
        self.dst, self.owners = dst, owners
        self.items: list[tuple[int, int, Ranges]] = []  # (bytes, spec_index, box)
        self.nbytes = 0
        hd = host_of(node_of, dst)
        self.near = [o for o in owners if host_of(node_of, o) == hd]
        far: dict[object, list[int]] = defaultdict(list)
        for o in owners:
            h = host_of(node_of, o)
            if h != hd:
                far[h].append(o)
        self.far_hosts = sorted(far, key=repr)
        self.far_owners = [far[h] for h in self.far_hosts]
        self.recv, self.nic_in = ("recv", dst), ("in", hd)
        self.near_res = [("send", o) for o in self.near]
        self.far_res = [("out", h) for h in self.far_hosts]
        self.cap_port, self.cap_in = links.same_host, links.host_nic(hd)
        self.cap_out = [links.host_nic(h) for h in self.far_hosts]
        self.shares: list[float] = []  # bytes per route: near owners, then far hosts

    @property
    def routes(self) -> int:
        return len(self.near) + len(self.far_hosts)


def _side(level: float, t_dst: float, cap_dst: float, t_src: Sequence[float],
          cap_src: Sequence[float]) -> tuple[float, list[float]]:
    """Bytes one side (near or far) can take by ``level``, and each route's spare bytes."""
    spare = [max(0.0, (level - t) * c) for t, c in zip(t_src, cap_src)]
    return min(max(0.0, (level - t_dst) * cap_dst), sum(spare)), spare


def _place(g: _Group, busy: dict[tuple, float], links: LinkModel) -> list[float]:
    """``_place_on`` every route, then again without the routes whose share would take less
    than one message start-up of its link class, until none is left that small; the largest
    share's route always stays."""
    off: set[int] = set()
    while True:
        shares = _place_on(g, busy, off)
        n = len(g.near)
        small = [i for i, x in enumerate(shares) if 0 < x and i not in off
                 and (x / g.cap_port < links.same_host_latency if i < n
                      else x / min(g.cap_out[i - n], g.cap_in) < links.cross_host_latency)]
        keep = max(range(len(shares)), key=lambda i: (shares[i], -i))
        small = [i for i in small if i != keep]
        if not small:
            return shares
        off.update(small)


def _place_on(g: _Group, busy: dict[tuple, float], off: set[int]) -> list[float]:
    """Split ``g``'s bytes over its routes not in ``off`` at the lowest common finish level."""
    n = len(g.near)
    inf = float("inf")  # a route left out is busy for ever: it takes nothing
    t_near = [inf if i in off else busy.get(r, 0.0) for i, r in enumerate(g.near_res)]
    t_far = [inf if n + j in off else busy.get(r, 0.0) for j, r in enumerate(g.far_res)]
    t_recv, t_in = busy.get(g.recv, 0.0), busy.get(g.nic_in, 0.0)
    caps_near = [g.cap_port] * len(g.near)

    def take(level: float):
        near, spare_n = _side(level, t_recv, g.cap_port, t_near, caps_near) if g.near else (0.0, [])
        far, spare_f = _side(level, t_in, g.cap_in, t_far, g.cap_out) if g.far_hosts else (0.0, [])
        return near, spare_n, far, spare_f

    times = [t for t in t_near + t_far if t != inf] + [t_recv, t_in]
    lo, hi = min(times), max(times) + g.nbytes / min([g.cap_port, g.cap_in] + g.cap_out)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        near, _, far, _ = take(mid)
        if near + far >= g.nbytes:
            hi = mid
        else:
            lo = mid
    near, _, far, _ = take(hi)
    scale = g.nbytes / (near + far)
    return (_fill(near * scale, t_near, caps_near) if g.near else []) + \
        (_fill(far * scale, t_far, g.cap_out) if g.far_hosts else [])


def _fill(total: float, t_src: Sequence[float], cap_src: Sequence[float]) -> list[float]:
    """``total`` bytes over sources busy until ``t_src``: the least busy fill first, up to one
    common finish level (so the senders end as evenly as the loads allow)."""
    if total <= 0:
        return [0.0] * len(t_src)
    finite = [t for t in t_src if t != float("inf")]
    lo, hi = min(finite), max(finite) + total / min(cap_src)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if sum(max(0.0, (mid - t) * c) for t, c in zip(t_src, cap_src)) >= total:
            hi = mid
        else:
            lo = mid
    spare = [max(0.0, (hi - t) * c) for t, c in zip(t_src, cap_src)]
    room = sum(spare)
    return [x * total / room for x in spare]


def _apply(g: _Group, shares: list[float], busy: dict[tuple, float], sign: float) -> None:
    n = len(g.near)
    for i, share in enumerate(shares):
        if share <= 0:
            continue
        if i < n:
            busy[g.near_res[i]] = busy.get(g.near_res[i], 0.0) + sign * share / g.cap_port
            busy[g.recv] = busy.get(g.recv, 0.0) + sign * share / g.cap_port
        else:
            j = i - n
            busy[g.far_res[j]] = busy.get(g.far_res[j], 0.0) + sign * share / g.cap_out[j]
            busy[g.nic_in] = busy.get(g.nic_in, 0.0) + sign * share / g.cap_in


def _quotas(g: _Group) -> dict[int, int]:
    """Whole bytes per sender from the fluid shares (largest remainders first, then route order);
    a far host's share goes to one of its owners, rotating with the receiver."""
    floors = [int(s) for s in g.shares]
    short = g.nbytes - sum(floors)
    by_rest = sorted(range(len(floors)), key=lambda i: (-(g.shares[i] - floors[i]), i))
    for i in by_rest[:short]:
        floors[i] += 1
    out: dict[int, int] = {}
    n = len(g.near)
    for i, q in enumerate(floors):
        if q <= 0:
            continue
        if i < n:
            src = g.near[i]
        else:
            owners = g.far_owners[i - n]
            src = owners[g.dst % len(owners)]
        out[src] = out.get(src, 0) + q
    return out


def _cut(box: Ranges, nbytes: int, itemsize: int) -> tuple[Ranges, Ranges] | None:
    """Split ``box`` along its outermost dimension of extent > 1 near ``nbytes`` for the head."""
    for d, (lo, hi) in enumerate(box):
        if hi - lo > 1:
            row = numel(box) // (hi - lo) * itemsize
            rows = min(max((2 * nbytes + row) // (2 * row), 1), hi - lo - 1)
            head = box[:d] + ((lo, lo + rows),) + box[d + 1 :]
            tail = box[:d] + ((lo + rows, hi),) + box[d + 1 :]
            return head, tail
    return None


def _deal(g: _Group, quotas: dict[int, int], specs: Sequence[TensorSpec]) -> list[Transfer]:
    """The group's boxes, largest first, to the sender with the most bytes left (lowest id on
    ties), cut where a sender's quota ends inside a box."""
    heap = [(-left, s) for s, left in sorted(quotas.items())]
    heapq.heapify(heap)
    out = []
    for size, spec_index, box in sorted(g.items, key=lambda it: (-it[0], it[1], it[2])):
        itemsize, name = specs[spec_index].itemsize, specs[spec_index].name
        rest: Ranges | None = box
        while rest is not None:
            left, src = heap[0]
            left = -left
            cut = _cut(rest, left, itemsize) if 0 < left < size else None
            head, rest = (cut[0], cut[1]) if cut else (rest, None)
            head_bytes = numel(head) * itemsize if cut else size
            out.append(Transfer(name, src, g.dst, head, head_bytes))
            heapq.heapreplace(heap, (-(left - head_bytes), src))
            size -= head_bytes
    return out


def choose_senders(specs: Sequence[TensorSpec],
                   demands: Sequence[tuple[int, int, Ranges, tuple[int, ...]]],
                   node_of: Mapping[int, str], links: LinkModel) -> list[Transfer]:
    """Transfers serving every ``(spec_index, receiver, box, owners)`` demand (see the module)."""
    groups: dict[tuple[int, tuple[int, ...]], _Group] = {}
    for spec_index, dst, box, owners in demands:
        g = groups.get((dst, owners))
        if g is None:
            g = groups[(dst, owners)] = _Group(dst, owners, node_of, links)
        size = numel(box) * specs[spec_index].itemsize
        g.items.append((size, spec_index, box))
        g.nbytes += size
    order = sorted(groups.values(), key=lambda g: (g.routes, -g.nbytes, g.dst, g.owners))
    busy: dict[tuple, float] = {}
    for g in order:
        g.shares = _place(g, busy, links)
        _apply(g, g.shares, busy, 1.0)
    for _ in range(_PASSES - 1):
        for g in order:
            _apply(g, g.shares, busy, -1.0)
            g.shares = _place(g, busy, links)
            _apply(g, g.shares, busy, 1.0)
    out: list[Transfer] = []
    for g in sorted(order, key=lambda g: (g.dst, g.owners)):
        out.extend(_deal(g, _quotas(g), specs))
    return out
