"""Min-max load balancing of splittable demands over restricted senders (pure).

Input: ``loads[senders] = bytes`` where ``senders`` is the tuple of ranks allowed to serve that
class of demands. Output: how many bytes each sender serves per class, such that every class is
fully served and the largest total any sender serves is as small as possible. This is a
transportation problem; the optimum is found exactly by binary search on the makespan ``T`` with a
max-flow feasibility test (source -> class [load] -> sender [inf] -> sink [T]). Graphs are tiny:
one node per distinct sender set and per sender, never per tensor.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping


class _FlowNetwork:
    """Dinic's max-flow on integer capacities, deterministic (edges kept in insertion order)."""

    def __init__(self, n: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def add_edge(self, u: int, v: int, cap: int) -> int:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)
        return len(self.to) - 2

    def max_flow(self, s: int, t: int) -> int:
        flow = 0
        while True:
            level = [-1] * len(self.adj)
            level[s] = 0
            queue = deque([s])
            while queue:
                u = queue.popleft()
                for e in self.adj[u]:
                    if self.cap[e] > 0 and level[self.to[e]] < 0:
                        level[self.to[e]] = level[u] + 1
                        queue.append(self.to[e])
            if level[t] < 0:
                return flow
            it = [0] * len(self.adj)
            while True:
                pushed = self._push(s, t, 1 << 62, level, it)
                if not pushed:
                    break
                flow += pushed

    def _push(self, u: int, t: int, limit: int, level: list[int], it: list[int]) -> int:
        if u == t:
            return limit
        while it[u] < len(self.adj[u]):
            e = self.adj[u][it[u]]
            v = self.to[e]
            if self.cap[e] > 0 and level[v] == level[u] + 1:
                pushed = self._push(v, t, min(limit, self.cap[e]), level, it)
                if pushed:
                    self.cap[e] -= pushed
                    self.cap[e ^ 1] += pushed
                    return pushed
            it[u] += 1
        return 0


def _route(
    loads: Mapping[tuple[int, ...], int], makespan: int
) -> tuple[int, dict[tuple[int, ...], dict[int, int]]]:
    classes = sorted(loads)
    senders = sorted({s for c in classes for s in c})
    index = {s: len(classes) + 1 + i for i, s in enumerate(senders)}
    source, sink = 0, len(classes) + len(senders) + 1
    net = _FlowNetwork(sink + 1)
    class_edges: dict[tuple[int, ...], dict[int, int]] = {}
    for i, c in enumerate(classes):
        net.add_edge(source, i + 1, loads[c])
        class_edges[c] = {s: net.add_edge(i + 1, index[s], loads[c]) for s in c}
    for s in senders:
        net.add_edge(index[s], sink, makespan)
    flow = net.max_flow(source, sink)
    quotas = {c: {s: loads[c] - net.cap[e] for s, e in edges.items()} for c, edges in class_edges.items()}
    return flow, quotas


def min_makespan(loads: Mapping[tuple[int, ...], int]) -> int:
    """The smallest possible largest per-sender total."""
    return _solve(loads)[0]


def balanced_quotas(loads: Mapping[tuple[int, ...], int]) -> dict[tuple[int, ...], dict[int, int]]:
    """Bytes per sender per class for a min-max schedule; every class's quotas sum to its load."""
    return _solve(loads)[1]


def _solve(loads: Mapping[tuple[int, ...], int]) -> tuple[int, dict[tuple[int, ...], dict[int, int]]]:
    loads = {tuple(c): int(v) for c, v in loads.items() if v > 0}
    if not loads:
        return 0, {}
    for c in loads:
        if not c:
            raise ValueError("a class of demands has no allowed sender")
    total = sum(loads.values())
    n_senders = len({s for c in loads for s in c})
    lo = max([-(-total // n_senders)] + [-(-v // len(c)) for c, v in loads.items()])
    hi = total
    while lo < hi:
        mid = (lo + hi) // 2
        if _route(loads, mid)[0] == total:
            hi = mid
        else:
            lo = mid + 1
    flow, quotas = _route(loads, lo)
    assert flow == total
    return lo, quotas
