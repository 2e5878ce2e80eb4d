"""HSPMD sharding annotations: which device holds which part of a tensor.

Pure Python, no torch. The types are immutable, hashable values with a JSON form, so plans can be
published through etcd and resharding plans can be cached by annotation.

Vocabulary (HSPMD):

* ``DeviceGroup``: an ordered tuple of device ids (global ranks in the group that runs the plan).
* ``DistState``: ordinary SPMD inside one group. ``states`` maps a key to a split count: ``-1``
  duplicate (replicas), ``-2`` partial (values pending a sum), ``0..ndim-1`` tensor dimensions.
  The product of the counts equals the group size. ``order`` lists the keys with count > 1 and fixes
  how a device's index in its group maps to shard coordinates: walk ``order`` from the last key to
  the first, ``coord[k] = i % states[k]`` then ``i //= states[k]``; the last key varies fastest.
  The canonical default order is the keys sorted ascending: partial, then duplicate, then dimensions
  in increasing order. So ``{-1: 2, 1: 2}`` over ``(0, 1, 2, 3)`` puts the two shards of dim 1 on
  adjacent devices (0, 1) and (2, 3) and makes 0 and 2 replicas (tensor parallel inside data
  parallel).
* ``DGUnion``: disjoint sub-groups. ``DSUnion``: one ``DistState`` per sub-group plus ``hdim``, the
  dimension split *across* sub-groups (``-1``: every sub-group holds a full replica; ``-2``: every
  sub-group holds a partial sum; ``d >= 0``: dimension ``d`` is split across sub-groups).
* ``TensorAnnotation``: a ``DGUnion`` with its ``DSUnion``.
* ``BoxAnnotation``: explicit per-device boxes (global index ranges) of one tensor shape, for
  layouts no split rule describes (the uneven optimizer shards of ``graph/zero.py``: each row on
  one owner, shares by weight). Resharding reads every annotation through the same queries
  (``devices``, ``local_slices``, ``shards``, ``any_partial``, ``validate``), so BSR plans from
  either kind; ``Annotation`` is their union.

Uneven (heterogeneous) splits are expressed with integer ``hweights`` on the ``DSUnion``: sub-group
``i`` holds the share ``hweights[i] / sum(hweights)`` of dimension ``hdim``. Weights are
proportions, so one annotation fits every tensor that shares the layout; pass the exact sizes as
weights (``(512, 256, 256)``) to pin them. A batch split 2:1:1 is ``hweights=(2, 1, 1)``. Inside a
sub-group the split stays even, as in SPMD.

Index rule: a range of length ``L`` cut by integer weights ``w`` has boundaries
``L * (w_0 + ... + w_k) // sum(w)``; an even split into ``n`` parts uses weights of 1. When the
shape divides exactly (what ``validate(shape)`` requires by default) this is the obvious split; for
other shapes it is still well defined, so planning never depends on luck in sizes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

DUPLICATE = -1
PARTIAL = -2

Ranges = tuple[tuple[int, int], ...]


class AnnotationError(ValueError):
    """An annotation is malformed or does not fit a tensor; the message names the bad value."""


def split_bounds(length: int, weights: Sequence[int]) -> tuple[int, ...]:
    """Boundaries (``len(weights) + 1`` of them, from 0 to ``length``) of a weighted split."""
    total = sum(weights)
    bounds = [0]
    acc = 0
    for w in weights:
        acc += w
        bounds.append(length * acc // total)
    return tuple(bounds)


def _split_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    length = hi - lo
    return lo + length * index // parts, lo + length * (index + 1) // parts


def _check_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AnnotationError(f"{what} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class DeviceGroup:
    """An ordered group of distinct device ids (non-negative ints)."""

    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not devices:
            raise AnnotationError("DeviceGroup needs at least one device, got ()")
        for d in devices:
            if _check_int(d, "device id") < 0:
                raise AnnotationError(f"device id must be >= 0, got {d} in {devices}")
        if len(set(devices)) != len(devices):
            dup = sorted({d for d in devices if devices.count(d) > 1})
            raise AnnotationError(f"DeviceGroup {devices} lists device(s) {dup} more than once")
        object.__setattr__(self, "devices", devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __contains__(self, device: object) -> bool:
        return device in self.devices

    def __iter__(self):
        return iter(self.devices)

    def index(self, device: int) -> int:
        return self.devices.index(device)


class DistState:
    """SPMD distribution inside one device group: split counts per key and the device order.

    Keys with count 1 are dropped (``count(k)`` returns 1 for them), so equal distributions compare
    equal whatever way they were written.
    """

    __slots__ = ("_states", "_order")

    def __init__(self, states: Mapping[int, int], order: Sequence[int] | None = None) -> None:
        normalized: dict[int, int] = {}
        for key, count in dict(states).items():
            _check_int(key, "DistState key")
            _check_int(count, f"split count for key {key}")
            if key < PARTIAL:
                raise AnnotationError(
                    f"DistState key {key} is invalid: use -1 (duplicate), -2 (partial) or a dim >= 0"
                )
            if count < 1:
                raise AnnotationError(f"split count for key {key} must be >= 1, got {count}")
            if count > 1:
                normalized[key] = count
        self._states = tuple(sorted(normalized.items()))
        keys = tuple(k for k, _ in self._states)
        if order is None:
            resolved = keys
        else:
            for k in order:
                _check_int(k, "order key")
            resolved = tuple(k for k in order if normalized.get(k, 1) > 1)
            if len(set(resolved)) != len(resolved) or set(resolved) != set(keys):
                raise AnnotationError(
                    f"order {tuple(order)} must list each key with count > 1 exactly once: {keys}"
                )
        self._order = resolved

    # -- values ---------------------------------------------------------------------------------
    @property
    def states(self) -> dict[int, int]:
        """The split counts greater than 1, as a fresh dict."""
        return dict(self._states)

    @property
    def order(self) -> tuple[int, ...]:
        return self._order

    def count(self, key: int) -> int:
        return dict(self._states).get(key, 1)

    @property
    def device_num(self) -> int:
        return math.prod(c for _, c in self._states)

    @property
    def is_partial(self) -> bool:
        return self.count(PARTIAL) > 1

    def split_dims(self) -> tuple[int, ...]:
        """Tensor dimensions split by this state, ascending."""
        return tuple(k for k, _ in self._states if k >= 0)

    def coords(self, index: int) -> dict[int, int]:
        """Shard coordinate per key for the device at ``index`` in its group (last key fastest)."""
        if not 0 <= index < self.device_num:
            raise AnnotationError(f"device index {index} is outside 0..{self.device_num - 1}")
        counts = dict(self._states)
        coords: dict[int, int] = {}
        for key in reversed(self._order):
            coords[key] = index % counts[key]
            index //= counts[key]
        return coords

    def index_of(self, coords: Mapping[int, int]) -> int:
        """Inverse of ``coords``: the device index holding the given coordinates."""
        counts = dict(self._states)
        index = 0
        for key in self._order:
            index = index * counts[key] + coords.get(key, 0)
        return index

    # -- protocol -------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DistState)
            and self._states == other._states
            and self._order == other._order
        )

    def __hash__(self) -> int:
        return hash((self._states, self._order))

    def __repr__(self) -> str:
        return f"DistState({dict(self._states)!r}, order={self._order!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"states": {str(k): c for k, c in self._states}, "order": list(self._order)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DistState":
        try:
            states = {int(k): c for k, c in data["states"].items()}
            order = data.get("order")
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            raise AnnotationError(f"not a DistState object: {data!r}") from exc
        return cls(states, None if order is None else tuple(order))


@dataclass(frozen=True)
class DGUnion:
    """Disjoint device sub-groups."""

    groups: tuple[DeviceGroup, ...]

    def __post_init__(self) -> None:
        groups = tuple(g if isinstance(g, DeviceGroup) else DeviceGroup(tuple(g)) for g in self.groups)
        if not groups:
            raise AnnotationError("DGUnion needs at least one sub-group, got ()")
        seen: dict[int, int] = {}
        for i, group in enumerate(groups):
            for d in group:
                if d in seen:
                    raise AnnotationError(
                        f"device {d} is in sub-group {seen[d]} and sub-group {i}: sub-groups overlap"
                    )
                seen[d] = i
        object.__setattr__(self, "groups", groups)

    def __len__(self) -> int:
        return len(self.groups)

    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g)


@dataclass(frozen=True)
class DSUnion:
    """One ``DistState`` per sub-group, how the tensor divides across sub-groups, and the weights.

    ``hdim``: ``-1`` each sub-group holds a full replica, ``-2`` each holds a partial sum,
    ``d >= 0`` dimension ``d`` is split across sub-groups by ``hweights`` (``None``: evenly).
    """

    states: tuple[DistState, ...]
    hdim: int = DUPLICATE
    hweights: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        states = tuple(self.states)
        if not states:
            raise AnnotationError("DSUnion needs at least one DistState, got ()")
        for s in states:
            if not isinstance(s, DistState):
                raise AnnotationError(f"DSUnion states must be DistState values, got {s!r}")
        _check_int(self.hdim, "hdim")
        if self.hdim < PARTIAL:
            raise AnnotationError(f"hdim {self.hdim} is invalid: use -1, -2 or a dim >= 0")
        weights = self.hweights
        if weights is not None:
            weights = tuple(weights)
            if self.hdim < 0:
                raise AnnotationError(
                    f"hweights {weights} need hdim >= 0 (they split a dimension), got hdim={self.hdim}"
                )
            if len(weights) != len(states):
                raise AnnotationError(
                    f"hweights {weights} has {len(weights)} entries for {len(states)} sub-groups"
                )
            for w in weights:
                if _check_int(w, "hweight") < 1:
                    raise AnnotationError(f"hweights must be >= 1, got {weights}")
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "hweights", weights)

    @property
    def hsize(self) -> int:
        return len(self.states)

    def weights(self) -> tuple[int, ...]:
        """Split weights across sub-groups (all 1 when even)."""
        return self.hweights if self.hweights is not None else (1,) * self.hsize

    def max_dim(self) -> int:
        """Largest tensor dimension this union refers to (-1 if none)."""
        dims = [d for s in self.states for d in s.split_dims()]
        return max(dims + [self.hdim if self.hdim >= 0 else -1])


@dataclass(frozen=True)
class TensorAnnotation:
    """Where a tensor lives: sub-groups of devices and how each holds the tensor."""

    groups: DGUnion
    states: DSUnion
    _where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.groups) != self.states.hsize:
            raise AnnotationError(
                f"{len(self.groups)} device sub-groups but {self.states.hsize} DistStates"
            )
        where: dict[int, tuple[int, int]] = {}
        for i, (group, state) in enumerate(zip(self.groups.groups, self.states.states)):
            if len(group) != state.device_num:
                raise AnnotationError(
                    f"sub-group {i} {group.devices} has {len(group)} devices but its DistState "
                    f"{state.states} splits into {state.device_num} (product of counts)"
                )
            for index, d in enumerate(group):
                where[d] = (i, index)
        object.__setattr__(self, "_where", where)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def single_group(
        cls, devices: Sequence[int], states: Mapping[int, int], order: Sequence[int] | None = None
    ) -> "TensorAnnotation":
        """Plain SPMD over one group, e.g. ``single_group([0, 1, 2, 3], {1: 4})``."""
        return cls(DGUnion((DeviceGroup(tuple(devices)),)), DSUnion((DistState(states, order),)))

    @classmethod
    def replicated(
        cls, groups: Sequence[Sequence[int]], local_states: Sequence[Mapping[int, int] | DistState]
    ) -> "TensorAnnotation":
        """Every sub-group holds the whole tensor, each sharded by its own local state."""
        return cls.heterogeneous(groups, local_states, hdim=DUPLICATE)

    @classmethod
    def heterogeneous(
        cls,
        groups: Sequence[Sequence[int]],
        local_states: Sequence[Mapping[int, int] | DistState],
        hdim: int = DUPLICATE,
        hweights: Sequence[int] | None = None,
    ) -> "TensorAnnotation":
        """A union: ``hdim`` split across sub-groups by ``hweights``, ``local_states`` inside."""
        states = tuple(s if isinstance(s, DistState) else DistState(s) for s in local_states)
        return cls(
            DGUnion(tuple(DeviceGroup(tuple(g)) for g in groups)),
            DSUnion(states, hdim, None if hweights is None else tuple(hweights)),
        )

    # -- queries --------------------------------------------------------------------------------
    def devices(self) -> tuple[int, ...]:
        return self.groups.devices()

    def locate(self, device: int) -> tuple[int, int] | None:
        """(sub-group index, index inside the sub-group) of ``device``, or None."""
        return self._where.get(device)

    def is_partial(self, device: int) -> bool:
        """True when ``device`` holds a partial sum (either inside its group or across groups)."""
        where = self._where.get(device)
        if where is None:
            return False
        return self.states.hdim == PARTIAL or self.states.states[where[0]].is_partial

    def any_partial(self) -> bool:
        return self.states.hdim == PARTIAL or any(s.is_partial for s in self.states.states)

    def local_slices(self, device: int, shape: Sequence[int]) -> Ranges | None:
        """Half-open index ranges per dimension that ``device`` holds, or None if it holds nothing."""
        where = self._where.get(device)
        if where is None:
            return None
        group_index, index = where
        ranges = [(0, int(n)) for n in shape]
        hdim = self.states.hdim
        if hdim >= 0:
            self._check_dim(hdim, len(shape), "hdim")
            bounds = split_bounds(ranges[hdim][1], self.states.weights())
            ranges[hdim] = (bounds[group_index], bounds[group_index + 1])
        state = self.states.states[group_index]
        coords = state.coords(index)
        for key, coord in coords.items():
            if key >= 0:
                self._check_dim(key, len(shape), "split dim")
                lo, hi = ranges[key]
                ranges[key] = _split_range(lo, hi, state.count(key), coord)
        return tuple(ranges)

    def shards(self, shape: Sequence[int]) -> dict[int, Ranges]:
        """``local_slices`` of every device, keyed by device id."""
        out: dict[int, Ranges] = {}
        for d in self.devices():
            ranges = self.local_slices(d, shape)
            assert ranges is not None
            out[d] = ranges
        return out

    def validate(self, shape: Sequence[int], exact: bool = True) -> None:
        """Raise ``AnnotationError`` if the annotation does not fit ``shape``.

        Checks that every referenced dimension exists and, with ``exact``, that every split is
        exact (no rounding, no empty shard).
        """
        shape = tuple(shape)
        for n in shape:
            if _check_int(n, "dimension size") < 0:
                raise AnnotationError(f"shape {shape} has a negative size")
        ndim = len(shape)
        hdim = self.states.hdim
        if hdim >= 0:
            self._check_dim(hdim, ndim, "hdim")
        for i, state in enumerate(self.states.states):
            for d in state.split_dims():
                self._check_dim(d, ndim, f"sub-group {i} split dim")
        if not exact:
            return
        if hdim >= 0:
            weights = self.states.weights()
            total = sum(weights)
            if shape[hdim] * min(weights) < total or any(shape[hdim] * w % total for w in weights):
                raise AnnotationError(
                    f"dim {hdim} of size {shape[hdim]} does not split exactly by hweights {weights}"
                )
        for group_index, state in enumerate(self.states.states):
            for dim in state.split_dims():
                whole = self._parent_length(dim, group_index, shape)
                count = state.count(dim)
                if whole % count or whole < count:
                    raise AnnotationError(
                        f"dim {dim} of size {whole} in sub-group {group_index} does not split "
                        f"exactly {count} ways"
                    )

    def _parent_length(self, dim: int, group_index: int, shape: tuple[int, ...]) -> int:
        if dim != self.states.hdim:
            return shape[dim]
        bounds = split_bounds(shape[dim], self.states.weights())
        return bounds[group_index + 1] - bounds[group_index]

    @staticmethod
    def _check_dim(dim: int, ndim: int, what: str) -> None:
        if not 0 <= dim < ndim:
            raise AnnotationError(f"{what} {dim} is out of range for a {ndim}-d tensor")

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible object (ints, lists and string keys only)."""
        return {
            "groups": [list(g.devices) for g in self.groups.groups],
            "states": [s.to_dict() for s in self.states.states],
            "hdim": self.states.hdim,
            "hweights": None if self.states.hweights is None else list(self.states.hweights),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorAnnotation":
        try:
            groups = [tuple(g) for g in data["groups"]]
            states = [DistState.from_dict(s) for s in data["states"]]
            hdim = data.get("hdim", DUPLICATE)
            hweights = data.get("hweights")
        except (KeyError, TypeError) as exc:
            raise AnnotationError(f"not a TensorAnnotation object: {data!r}") from exc
        return cls.heterogeneous(groups, states, hdim, hweights)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "TensorAnnotation":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AnnotationError(f"annotation is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise AnnotationError(f"annotation JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)


@dataclass(frozen=True)
class BoxAnnotation:
    """Each device's box of a tensor of one ``shape``, given explicitly: ``boxes`` is
    ``((device, ((lo, hi), ...)), ...)`` with distinct devices, one half-open range per dimension
    inside ``shape``. Boxes may overlap (replicas) or be empty (a device that holds no element
    still has its empty local tensor). Whole values only: never partial."""

    shape: tuple[int, ...]
    boxes: tuple[tuple[int, Ranges], ...]
    _where: dict[int, Ranges] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape = tuple(_check_int(n, "dimension size") for n in self.shape)
        boxes = tuple(sorted((_check_int(d, "device id"), tuple((int(lo), int(hi)) for lo, hi in b))
                             for d, b in self.boxes))
        where: dict[int, Ranges] = {}
        for d, box in boxes:
            if d < 0 or d in where:
                raise AnnotationError(f"BoxAnnotation: device {d} is negative or listed twice")
            if len(box) != len(shape) or any(not 0 <= lo <= hi <= n
                                              for (lo, hi), n in zip(box, shape)):
                raise AnnotationError(f"BoxAnnotation: device {d}'s box {box} does not fit "
                                      f"shape {shape}")
            where[d] = box
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "boxes", boxes)
        object.__setattr__(self, "_where", where)

    def devices(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.boxes)

    def locate(self, device: int) -> tuple[int, int] | None:
        """(0, position among the devices) of ``device``, or None (as ``TensorAnnotation``)."""
        return (0, self.devices().index(device)) if device in self._where else None

    def is_partial(self, device: int) -> bool:
        return False

    def any_partial(self) -> bool:
        return False

    def local_slices(self, device: int, shape: Sequence[int]) -> Ranges | None:
        """``device``'s box, or None if it holds nothing; ``shape`` must be the annotation's."""
        self._check_shape(shape)
        return self._where.get(device)

    def shards(self, shape: Sequence[int]) -> dict[int, Ranges]:
        self._check_shape(shape)
        return dict(self._where)

    def validate(self, shape: Sequence[int], exact: bool = True) -> None:
        """Raise ``AnnotationError`` unless ``shape`` is the annotation's (boxes are exact)."""
        self._check_shape(shape)

    def _check_shape(self, shape: Sequence[int]) -> None:
        if tuple(shape) != self.shape:
            raise AnnotationError(f"BoxAnnotation of shape {self.shape} used for shape "
                                  f"{tuple(shape)}")

    @classmethod
    def of(cls, annotation: "Annotation", shape: Sequence[int]) -> "BoxAnnotation":
        """Any annotation's boxes for ``shape``, as a ``BoxAnnotation``."""
        if isinstance(annotation, BoxAnnotation):
            annotation.validate(shape)
            return annotation
        if annotation.any_partial():
            raise AnnotationError("a partial annotation has no boxes of whole values")
        return cls(tuple(int(n) for n in shape), tuple(annotation.shards(shape).items()))

    @classmethod
    def union(cls, annotations: Sequence["Annotation"], shape: Sequence[int]) -> "BoxAnnotation":
        """Every device's box of ``annotations`` (their devices must be distinct)."""
        return cls(tuple(int(n) for n in shape),
                   tuple(item for a in annotations for item in cls.of(a, shape).boxes))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape),
                "boxes": [[d, [list(r) for r in box]] for d, box in self.boxes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BoxAnnotation":
        try:
            return cls(tuple(data["shape"]),
                       tuple((d, tuple(tuple(r) for r in box)) for d, box in data["boxes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise AnnotationError(f"not a BoxAnnotation object: {data!r}") from exc


Annotation = TensorAnnotation | BoxAnnotation
