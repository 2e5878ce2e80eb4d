"""The planner's integer solvers against brute force on small instances."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.planner.solve import minmax_layers, pipeline_layers, split_rows

_coef = st.floats(min_value=0.1, max_value=10.0, allow_nan=False, allow_infinity=False)


def _compositions(total: int, caps: list[int]):
    for combo in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(combo) == total:
            yield combo


@st.composite
def _stages(draw):
    n = draw(st.integers(1, 4))
    total = draw(st.integers(n, 10))
    fixed = [draw(_coef) for _ in range(n)]
    per = [draw(_coef) for _ in range(n)]
    caps = [draw(st.integers(1, total)) for _ in range(n)]
    return fixed, per, caps, total


@settings(max_examples=60, deadline=None)
@given(_stages())
def test_minmax_layers_is_optimal(case):
    fixed, per, caps, total = case
    got = minmax_layers(fixed, per, caps, total)
    options = list(_compositions(total, caps))
    if not options:
        assert got is None
        return
    assert sum(got) == total and all(1 <= l <= c for l, c in zip(got, caps))
    cost = lambda ls: max(f + p * l for f, p, l in zip(fixed, per, ls))  # noqa: E731
    assert cost(got) <= min(cost(o) for o in options) + 1e-9


@settings(max_examples=25, deadline=None)
@given(_stages(), st.integers(1, 8))
def test_pipeline_layers_minimises_1f1b_time(case, m):
    fixed, per, caps, total = case
    got = pipeline_layers(fixed, per, caps, total, m)
    options = list(_compositions(total, caps))
    if not options:
        assert got is None
        return

    def cost(ls):
        t = [f + p * l for f, p, l in zip(fixed, per, ls)]
        return sum(t) + (m - 1) * max(t)

    assert sum(got) == total and all(1 <= l <= c for l, c in zip(got, caps))
    assert cost(got) <= min(cost(o) for o in options) * (1 + 1e-6)


@st.composite
def _classes(draw):
    k = draw(st.integers(1, 2))
    return [(draw(_coef), draw(_coef), draw(st.integers(1, 2))) for _ in range(k)]


@settings(max_examples=60, deadline=None)
@given(_classes(), st.integers(1, 9))
def test_split_rows_is_optimal(classes, total):
    got = split_rows(classes, total)
    flat = [(f, r) for f, r, cnt in classes for _ in range(cnt)]
    rows = [x for part in got for x in part]
    assert sum(rows) == total and min(rows) >= 0
    assert [len(part) for part in got] == [cnt for _, _, cnt in classes]

    def cost(rs):
        return max((f + r * x) if x else 0.0 for (f, r), x in zip(flat, rs))

    best = min(cost(c) for c in itertools.product(range(total + 1), repeat=len(flat))
               if sum(c) == total)
    assert cost(rows) <= best * (1 + 1e-9) + 1e-12


def test_split_rows_uneven_batch_over_equal_pipelines():
    assert sorted(split_rows([(1.0, 1.0, 3)], 7)[0]) == [2, 2, 3]
