"""HSPMD annotations: device order, heterogeneous unions, validation messages, JSON round-trip."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.annotations import (
    AnnotationError,
    DGUnion,
    DeviceGroup,
    DistState,
    DSUnion,
    TensorAnnotation,
    split_bounds,
)


def test_order_last_key_varies_fastest():
    ds = DistState({-1: 2, 1: 2})
    assert ds.order == (-1, 1)
    assert [ds.coords(i) for i in range(4)] == [
        {1: 0, -1: 0},
        {1: 1, -1: 0},
        {1: 0, -1: 1},
        {1: 1, -1: 1},
    ]
    flipped = DistState({-1: 2, 1: 2}, order=(1, -1))
    assert flipped.coords(1) == {-1: 1, 1: 0}
    assert all(ds.index_of(ds.coords(i)) == i for i in range(4))


def test_count_one_keys_are_dropped_and_compare_equal():
    assert DistState({0: 4, -1: 1}) == DistState({0: 4})
    assert DistState({0: 4}).count(-1) == 1
    assert hash(DistState({0: 2, 1: 2})) == hash(DistState({1: 2, 0: 2}))


def test_tp_inside_dp_slices():
    ann = TensorAnnotation.single_group([0, 1, 2, 3], {-1: 2, 1: 2})
    shape = (4, 8)
    assert ann.local_slices(0, shape) == ((0, 4), (0, 4))
    assert ann.local_slices(1, shape) == ((0, 4), (4, 8))
    assert ann.local_slices(2, shape) == ((0, 4), (0, 4))
    assert ann.local_slices(9, shape) is None


def test_hetero_tp_4_2_2_column_weight():
    # HSPMD's worked example: three replicas with TP degrees 4, 2, 2 over 8 devices.
    ann = TensorAnnotation.replicated([[0, 1, 2, 3], [4, 5], [6, 7]], [{1: 4}, {1: 2}, {1: 2}])
    shape = (16, 8)
    assert ann.local_slices(3, shape) == ((0, 16), (6, 8))
    assert ann.local_slices(5, shape) == ((0, 16), (4, 8))
    assert ann.local_slices(6, shape) == ((0, 16), (0, 4))
    ann.validate(shape)


def test_uneven_batch_split_across_subgroups():
    ann = TensorAnnotation.heterogeneous(
        [[0, 1], [2], [3]], [{-1: 2}, {}, {}], hdim=0, hweights=(2, 1, 1)
    )
    shape = (8, 3)
    assert ann.local_slices(0, shape) == ((0, 4), (0, 3))
    assert ann.local_slices(1, shape) == ((0, 4), (0, 3))
    assert ann.local_slices(2, shape) == ((4, 6), (0, 3))
    assert ann.local_slices(3, shape) == ((6, 8), (0, 3))


def test_uneven_layer_rows_with_exact_sizes_as_weights():
    ann = TensorAnnotation.heterogeneous(
        [[0, 1], [2], [3]], [{0: 2}, {}, {}], hdim=0, hweights=(512, 256, 256)
    )
    shape = (1024, 4)
    ann.validate(shape)
    assert [ann.local_slices(d, shape)[0] for d in range(4)] == [
        (0, 256),
        (256, 512),
        (512, 768),
        (768, 1024),
    ]


def test_partial_is_reported_per_device():
    ann = TensorAnnotation.replicated([[0, 1], [2]], [{-2: 2}, {}])
    assert ann.is_partial(0) and ann.is_partial(1)
    assert not ann.is_partial(2)
    assert not ann.is_partial(7)
    assert TensorAnnotation.heterogeneous([[0], [1]], [{}, {}], hdim=-2).is_partial(1)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TensorAnnotation.single_group([0, 1, 2], {0: 2}), "has 3 devices but"),
        (lambda: DGUnion((DeviceGroup((0, 1)), DeviceGroup((1, 2)))), "sub-groups overlap"),
        (lambda: DeviceGroup((0, 0)), "more than once"),
        (lambda: DeviceGroup(()), "at least one device"),
        (lambda: DeviceGroup((-1,)), "must be >= 0"),
        (lambda: DistState({-3: 2}), "key -3 is invalid"),
        (lambda: DistState({0: 0}), "must be >= 1"),
        (lambda: DistState({0: 2, 1: 2}, order=(0,)), "exactly once"),
        (lambda: DSUnion((DistState({}),), hdim=-1, hweights=(1,)), "need hdim >= 0"),
        (lambda: DSUnion((DistState({}), DistState({})), hdim=0, hweights=(1,)), "1 entries"),
        (lambda: DSUnion((DistState({}),), hdim=0, hweights=(0,)), "must be >= 1"),
        (
            lambda: TensorAnnotation(DGUnion((DeviceGroup((0,)),)), DSUnion((DistState({}),) * 2)),
            "1 device sub-groups but 2",
        ),
    ],
)
def test_construction_errors_name_the_bad_value(build, message):
    with pytest.raises(AnnotationError, match=message):
        build()


@pytest.mark.parametrize(
    "ann, shape, message",
    [
        (TensorAnnotation.single_group([0, 1], {2: 2}), (4, 4), "split dim 2 is out of range"),
        (TensorAnnotation.heterogeneous([[0], [1]], [{}, {}], hdim=1), (4,), "hdim 1 is out"),
        (TensorAnnotation.single_group([0, 1, 2], {0: 3}), (4, 4), "does not split exactly 3"),
        (
            TensorAnnotation.heterogeneous([[0], [1]], [{}, {}], hdim=0, hweights=(2, 1)),
            (4, 1),
            "does not split exactly by hweights",
        ),
    ],
)
def test_validate_errors(ann, shape, message):
    with pytest.raises(AnnotationError, match=message):
        ann.validate(shape)


def test_inexact_shapes_still_slice_deterministically():
    ann = TensorAnnotation.single_group([0, 1, 2], {0: 3})
    ann.validate((4, 4), exact=False)
    assert [ann.local_slices(d, (4, 4))[0] for d in range(3)] == [(0, 1), (1, 2), (2, 4)]
    assert split_bounds(10, (1, 1, 1, 1)) == (0, 2, 5, 7, 10)


def test_bad_json_is_an_annotation_error():
    with pytest.raises(AnnotationError, match="not valid JSON"):
        TensorAnnotation.from_json("{")
    with pytest.raises(AnnotationError, match="not a TensorAnnotation"):
        TensorAnnotation.from_json('{"groups": [[0]]}')


# -- properties ---------------------------------------------------------------------------------

SMALL = settings(max_examples=60, deadline=None)


@st.composite
def annotations_with_shape(draw):
    """A random (possibly heterogeneous, uneven) annotation with an exactly fitting shape."""
    ndim = draw(st.integers(1, 3))
    hsize = draw(st.integers(1, 3))
    hdim = draw(st.sampled_from([-1] + list(range(ndim)))) if hsize > 1 else -1
    weights = (
        tuple(draw(st.lists(st.integers(1, 3), min_size=hsize, max_size=hsize)))
        if hdim >= 0 and draw(st.booleans())
        else None
    )
    states, factors = [], [1] * ndim
    for _ in range(hsize):
        s = {}
        for key in [-1] + list(range(ndim)):
            c = draw(st.sampled_from([1, 1, 2, 3]))
            if c > 1:
                s[key] = c
        keys = sorted(s)
        order = tuple(draw(st.permutations(keys))) if keys else None
        states.append(DistState(s, order))
        for d in range(ndim):
            factors[d] = math.lcm(factors[d], s.get(d, 1))
    if hdim >= 0:
        w = weights or (1,) * hsize
        # every part of hdim must split exactly by its own local count
        factors[hdim] = sum(w) * math.lcm(*[s.count(hdim) for s in states])
    shape = tuple(f * draw(st.integers(1, 2)) for f in factors)
    devices = draw(st.permutations(range(sum(st_.device_num for st_ in states))))
    groups, at = [], 0
    for s in states:
        groups.append(tuple(devices[at : at + s.device_num]))
        at += s.device_num
    ann = TensorAnnotation.heterogeneous(groups, states, hdim, weights)
    return ann, shape


def _cells(ranges):
    return set(itertools.product(*[range(lo, hi) for lo, hi in ranges]))


@SMALL
@given(annotations_with_shape())
def test_json_and_pickle_round_trip(case):
    ann, shape = case
    for again in (TensorAnnotation.from_json(ann.to_json()), pickle.loads(pickle.dumps(ann))):
        assert again == ann
        assert hash(again) == hash(ann)
        assert again.shards(shape) == ann.shards(shape)


@SMALL
@given(annotations_with_shape())
def test_each_subgroup_covers_its_part_exactly_once_per_replica(case):
    ann, shape = case
    ann.validate(shape)
    total = math.prod(shape)
    per_group = []
    for group, state in zip(ann.groups.groups, ann.states.states):
        cover: dict[tuple, int] = {}
        for d in group:
            for c in _cells(ann.local_slices(d, shape)):
                cover[c] = cover.get(c, 0) + 1
        replicas = state.count(-1) * state.count(-2)
        assert set(cover.values()) <= {replicas}
        per_group.append(set(cover))
    if ann.states.hdim >= 0:
        assert sum(len(c) for c in per_group) == total
        assert len(set().union(*per_group)) == total
    else:
        assert all(len(c) == total for c in per_group)
