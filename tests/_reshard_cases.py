"""Hypothesis strategies shared by the resharding property tests."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from hspmd_elastic.annotations import DistState, TensorAnnotation


@st.composite
def annotations(draw, ndim: int, pool: int, counts=(1, 1, 2, 3)):
    """A random annotation over some of ``pool`` devices: 1-3 sub-groups, each splitting or
    duplicating (at most 4 devices a sub-group, split counts from ``counts``), any order,
    uneven weights across sub-groups sometimes."""
    states = []
    for _ in range(draw(st.integers(1, 3))):
        s = {}
        for key in [-1] + list(range(ndim)):
            c = draw(st.sampled_from(counts))
            if c > 1 and math.prod(s.values()) * c <= 4:
                s[key] = c
        states.append(DistState(s, tuple(draw(st.permutations(sorted(s)))) if s else None))
    while sum(s.device_num for s in states) > pool:
        states.pop()
    hdim = draw(st.sampled_from([-1] + list(range(ndim)))) if len(states) > 1 else -1
    weights = None
    if hdim >= 0 and draw(st.booleans()):
        weights = tuple(draw(st.lists(st.integers(1, 3), min_size=len(states),
                                      max_size=len(states))))
    devices = draw(st.permutations(range(pool)))
    groups, at = [], 0
    for s in states:
        groups.append(tuple(devices[at:at + s.device_num]))
        at += s.device_num
    return TensorAnnotation.heterogeneous(groups, states, hdim, weights)
