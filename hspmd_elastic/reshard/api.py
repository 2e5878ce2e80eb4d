"""Resharding by fused Batched-Send-Receive (BSR): the values and errors of the subsystem.

A reshard moves tensors from an old annotation to a new one. The planner (``planner.py``) is pure:
from the annotations, the devices whose old data still exists (``alive``), the node (host) of
every device and a link model (``links.py``), it computes a ``FusedSchedule`` that every rank
derives alone, identically. The executor (``executor.py``) runs one schedule over
torch.distributed.

Device ids in both annotations are ranks of the process group that runs the exchange. A device that
died carries an id that no alive rank uses, and is simply absent from ``alive``.

Promises of a schedule:
* every element of every new shard comes from exactly one source (a local copy or one sender);
* bytes on the wire equal the lower bound: the elements a receiver needs and does not hold itself;
* any live owner may send; the bytes are split over owners to minimise the estimated finish time
  of the exchange (same-device, same-host and cross-host links, each host's NIC shared by its
  devices; ``links.exchange_time``);
* a slice with no live owner is never silently skipped: planning raises ``ReshardError`` naming
  every tensor and index range that is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

from hspmd_elastic.annotations import Ranges, TensorAnnotation

# Bytes per element of the dtypes a schedule can carry, by torch's dtype name without "torch.".
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


class BSRError(Exception):
    """Base of every error the reshard subsystem raises."""


class ReshardPlanError(BSRError, ValueError):
    """The request cannot be planned as given (partial tensor, bad shape, unknown dtype...)."""


class ReshardError(BSRError):
    """Some slices of the new layout have no live owner: the data is gone from memory.

    ``missing`` lists ``(tensor_name, ranges)`` for every lost region; the caller decides whether
    to fall back to a checkpoint.
    """

    def __init__(self, missing: list[tuple[str, Ranges]]) -> None:
        self.missing = list(missing)
        names = sorted({name for name, _ in self.missing})
        shown = "; ".join(f"{name}{_fmt(r)}" for name, r in self.missing[:8])
        more = f" (+{len(self.missing) - 8} more)" if len(self.missing) > 8 else ""
        super().__init__(
            f"no live owner for {len(self.missing)} slice(s) of {len(names)} tensor(s) "
            f"{names}: {shown}{more}"
        )

    @property
    def missing_slices(self) -> list[tuple[str, Ranges]]:
        return self.missing


class ReshardCommError(BSRError):
    """The exchange itself failed (a peer closed the connection, the backend raised)."""


class ReshardTimeoutError(ReshardCommError, TimeoutError):
    """A send or receive did not complete before the deadline; the process group is unusable."""


def _fmt(ranges: Ranges) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in ranges) + "]"


def dtype_name(dtype: object) -> str:
    """``torch.float32`` or ``"float32"`` -> ``"float32"`` (no torch import needed)."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to reshard: its name, global shape, dtype and both annotations."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    old: TensorAnnotation
    new: TensorAnnotation

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in ITEMSIZE:
            raise ReshardPlanError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}"
            )

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Transfer:
    """A box of one tensor moving from ``src`` to ``dst`` (``src == dst``: a local copy).

    ``ranges`` are global, half-open index ranges per dimension.
    """

    tensor: str
    src: int
    dst: int
    ranges: Ranges
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    @property
    def numel(self) -> int:
        n = 1
        for lo, hi in self.ranges:
            n *= hi - lo
        return n


@dataclass(frozen=True)
class LinkStats:
    """Planned bytes per directed link and per rank."""

    bytes_per_link: dict[tuple[int, int], int]
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_link.values())

    @property
    def max_bytes_sent(self) -> int:
        return max(self.bytes_sent.values(), default=0)

    @property
    def max_bytes_received(self) -> int:
        return max(self.bytes_received.values(), default=0)

    @property
    def max_bytes_per_rank(self) -> int:
        """The busiest rank's traffic: the larger of what any rank sends or receives."""
        return max(self.max_bytes_sent, self.max_bytes_received)

    @classmethod
    def of(cls, transfers: tuple[Transfer, ...]) -> "LinkStats":
        links: dict[tuple[int, int], int] = {}
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for t in transfers:
            if t.is_local:
                continue
            links[(t.src, t.dst)] = links.get((t.src, t.dst), 0) + t.nbytes
            sent[t.src] = sent.get(t.src, 0) + t.nbytes
            received[t.dst] = received.get(t.dst, 0) + t.nbytes
        return cls(links, sent, received)


@dataclass(frozen=True)
class Schedule:
    """The plan for one tensor: local copies and transfers between ranks."""

    tensor: str
    shape: tuple[int, ...]
    local: tuple[Transfer, ...]
    transfers: tuple[Transfer, ...]

    def link_stats(self) -> LinkStats:
        return LinkStats.of(self.transfers)


# Boxes at least this large travel as their own message (no packing where the memory layout of
# both ends allows); smaller boxes of one (sender, receiver, dtype) share one packed buffer.
SOLO_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a fused schedule: boxes of one dtype carried together.

    Sender and receiver derive the same messages, in the same order, with the same tags, from the
    schedule alone; the payload is the boxes' elements, box after box, each in row-major order.
    """

    src: int
    dst: int
    dtype: str
    tag: int
    boxes: tuple[Transfer, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.boxes)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.boxes)


class LocalCopies(Sequence[Transfer]):
    """The local copies of a fused schedule, kept once per class of tensors that move alike and
    expanded on demand: ``of(rank)`` builds one rank's copies only.

    ``parts``: ``((tensors, boxes_by_rank), ...)`` where ``tensors`` lists ``(order, name,
    itemsize)`` and ``boxes_by_rank`` maps a rank to the boxes it copies of each of them. As a
    sequence it is sorted by (rank, tensor order, box) and compares equal to that tuple.
    """

    def __init__(self, parts: Iterable[tuple[tuple[tuple[int, str, int], ...],
                                             Mapping[int, tuple[Ranges, ...]]]]) -> None:
        self._parts = tuple(parts)
        self._all: tuple[Transfer, ...] | None = None

    def of(self, rank: int) -> tuple[Transfer, ...]:
        items = []
        for tensors, boxes_by_rank in self._parts:
            for box in boxes_by_rank.get(rank, ()):
                size = _numel(box)
                items.extend((order, box, name, size * itemsize) for order, name, itemsize in tensors)
        items.sort(key=lambda item: (item[0], item[1]))
        return tuple(Transfer(name, rank, rank, box, nbytes) for _, box, name, nbytes in items)

    def ranks(self) -> list[int]:
        return sorted({r for _, boxes_by_rank in self._parts for r in boxes_by_rank})

    def _expanded(self) -> tuple[Transfer, ...]:
        if self._all is None:
            self._all = tuple(t for rank in self.ranks() for t in self.of(rank))
        return self._all

    def __len__(self) -> int:
        return sum(len(tensors) * len(boxes) for tensors, by_rank in self._parts
                   for boxes in by_rank.values())

    def __iter__(self) -> Iterator[Transfer]:
        return iter(self._expanded())

    def __getitem__(self, index):  # type: ignore[override]
        return self._expanded()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LocalCopies, tuple, list)):
            return self._expanded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expanded())

    def __add__(self, other: object) -> tuple[Transfer, ...]:
        return self._expanded() + tuple(other)  # type: ignore[arg-type]

    def __radd__(self, other: object) -> tuple[Transfer, ...]:
        return tuple(other) + self._expanded()  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"LocalCopies({len(self)} copies over {len(self.ranks())} ranks)"


def _numel(box: Ranges) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


@dataclass(frozen=True)
class FusedSchedule:
    """One schedule for many tensors (parameters and optimizer states together).

    ``local``: copies a rank makes from its own old shards, sorted by (rank, tensor, box): a tuple,
    or a ``LocalCopies`` that the planner fills per class of tensors (use ``local_of(rank)`` to
    read one rank's). ``transfers``: boxes between ranks, sorted by (sender, receiver, dtype,
    tensor, box), which is the packing order of every message.
    ``solo_bytes``: boxes at least this large travel as their own message (see ``messages_of``).
    """

    specs: tuple[TensorSpec, ...]
    local: Sequence[Transfer]
    transfers: tuple[Transfer, ...]
    solo_bytes: int = SOLO_MESSAGE_BYTES
    _by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.specs})
        if not isinstance(self.local, LocalCopies):
            object.__setattr__(self, "local", tuple(self.local))

    def local_of(self, rank: int) -> tuple[Transfer, ...]:
        """The local copies ``rank`` makes, in schedule order."""
        if isinstance(self.local, LocalCopies):
            return self.local.of(rank)
        return tuple(t for t in self.local if t.dst == rank)

    def spec(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def messages_of(self, rank: int) -> list[Message]:
        """Every message ``rank`` sends or receives, in posting order (the same on both ends)."""
        by_pair: dict[tuple[int, int, str], list[Transfer]] = {}
        for t in self.transfers:
            if rank in (t.src, t.dst):
                by_pair.setdefault((t.src, t.dst, self.spec(t.tensor).dtype), []).append(t)
        out: list[Message] = []
        tags: dict[tuple[int, int], int] = {}
        for (src, dst, dtype), boxes in sorted(by_pair.items()):
            packed = tuple(b for b in boxes if b.nbytes < self.solo_bytes)
            groups = ([packed] if packed else []) + [(b,) for b in boxes if b.nbytes >= self.solo_bytes]
            for group in groups:
                tag = tags.get((src, dst), 0)
                tags[(src, dst)] = tag + 1
                out.append(Message(src, dst, dtype, tag, group))
        return out

    def link_stats(self) -> LinkStats:
        return LinkStats.of(self.transfers)


@dataclass
class ExchangeStats:
    """What one rank measured while executing a fused schedule."""

    rank: int
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    bytes_copied_locally: int = 0
    messages: int = 0
    pack_s: float = 0.0
    local_s: float = 0.0  # local copies, done while the transfers are in flight (part of comm_s)
    comm_s: float = 0.0
    unpack_s: float = 0.0
    total_s: float = 0.0

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.bytes_received.values())
