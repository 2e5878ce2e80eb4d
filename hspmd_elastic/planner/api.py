"""The planner's interface: inputs, options, results and errors. Pure values, no I/O.

``plan_for(inventory, profile, global_batch, current_plan=None, options=PlannerOptions())``
(in ``search``) turns a snapshot of the cluster into a ``PlanResult``: the chosen ``Plan``, its
``Estimate`` and the ranked alternatives. The same inputs always give the same result.

Units: FLOP/s as TFLOP/s, memory in bytes, bandwidth in GB/s (1e9 bytes per second), time in
seconds. Device ids are the inventory's ints; on CPU jobs they are the workers' global ranks.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional

from hspmd_elastic.plan import OPTIMIZER_SHARDS

if TYPE_CHECKING:
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.plan import Plan

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


def fmt_bytes(n: float) -> str:
    """``1.5 GiB``, ``24.0 MiB``, ``512.0 KiB`` or ``12 B``: the largest unit that keeps n >= 1."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


_UNITS = {"kib": KiB, "mib": MiB, "gib": GiB}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_bytes(text: str) -> int:
    """``"24MiB"``, ``"1.5 GiB"``, ``"512KiB"`` -> bytes (> 0); ``PlannerError`` names a bad
    value and the units (KiB, MiB, GiB)."""
    match = _SIZE.match(str(text))
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise PlannerError(f"size {text!r}: expected a number and a unit, KiB, MiB or GiB "
                           "(e.g. 24MiB)")
    value = int(float(match.group(1)) * unit)
    if value < 1:
        raise PlannerError(f"size {text!r} must be at least 1 byte")
    return value


class PlannerError(ValueError):
    """Bad planner input; the message is one line naming the bad value."""


class PlanInfeasibleError(PlannerError):
    """No plan runs the model on the usable devices; the message names the shortfall.

    ``needed_bytes`` and ``available_bytes`` are set when memory is the reason (per device or in
    total, as the message says); both are None for other reasons (e.g. no healthy device).
    """

    def __init__(self, message: str, *, needed_bytes: Optional[int] = None,
                 available_bytes: Optional[int] = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes

    @property
    def shortfall_bytes(self) -> Optional[int]:
        if self.needed_bytes is None or self.available_bytes is None:
            return None
        return max(0, self.needed_bytes - self.available_bytes)


class RedundancyError(PlanInfeasibleError):
    """Plans exist, but none keeps every parameter slice on ``PlannerOptions.redundancy``
    nodes; the message names the shortfall (too few nodes, or memory counted at most one replica
    per node, or no layout within memory)."""


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


@dataclass(frozen=True)
class DeviceSpec:
    """A device type: speed, memory and links. ``mfu``: the fraction of peak a step achieves."""

    name: str
    peak_tflops: float
    memory_bytes: int
    intra_node_gbps: float  # per device, to peers on the same node (NVLink, PCIe, shared memory)
    inter_node_gbps: float  # per device, to other nodes (IB/RoCE NIC share, TCP)
    mfu: float = 0.5
    microbatch_overhead_s: float = 0.0005  # fixed cost per micro-batch per stage (launches, Python)
    link_latency_s: float = 1e-5  # start-up cost of one collective or send/receive
    # per local parameter element per step, whatever the rows (optimizer update, gradient copies)
    update_s_per_param: float = 0.0
    # True: the device's collectives and sends run on its own host CPU (gloo on a CPU worker):
    # a slower device moves bytes and starts collectives slower by the same factor
    # (``Device.link_gbps``), so a group's collective runs at its slowest member's speed
    host_links: bool = False

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_bytes", "intra_node_gbps", "inter_node_gbps", "mfu"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise PlannerError(f"device type {self.name!r}: {name}={value!r} must be > 0")
        if self.mfu > 1:
            raise PlannerError(f"device type {self.name!r}: mfu={self.mfu} must be <= 1")
        for name in ("microbatch_overhead_s", "link_latency_s", "update_s_per_param"):
            if not getattr(self, name) >= 0:
                raise PlannerError(f"device type {self.name!r}: {name}={getattr(self, name)!r} "
                                   "must be >= 0")


@dataclass(frozen=True)
class Device:
    """One device of the inventory. ``slowdown`` > 1 means degraded (2.0: half speed)."""

    id: int
    node: str
    spec: DeviceSpec
    health: Health = Health.HEALTHY
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if type(self.health) is not Health:
            object.__setattr__(self, "health", Health(self.health))
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0:
            raise PlannerError(f"device id={self.id!r} must be an integer >= 0")
        if not (self.slowdown >= 1.0 and math.isfinite(self.slowdown)):
            raise PlannerError(f"device {self.id}: slowdown={self.slowdown!r} must be >= 1")
        if self.health is Health.HEALTHY and self.slowdown != 1.0:
            object.__setattr__(self, "health", Health.DEGRADED)

    @property
    def usable(self) -> bool:
        return self.health is not Health.FAILED

    @property
    def flops(self) -> float:
        """Effective FLOP/s this device sustains now (peak x mfu / slowdown)."""
        return self.spec.peak_tflops * 1e12 * self.spec.mfu / self.slowdown

    def link_gbps(self, across_nodes: bool) -> float:
        """GB/s this device moves to a peer (``inter_node_gbps`` across nodes); on host-bound
        links (``DeviceSpec.host_links``) divided by the slowdown."""
        gbps = self.spec.inter_node_gbps if across_nodes else self.spec.intra_node_gbps
        return gbps / self.slowdown if self.spec.host_links else gbps

    @property
    def link_latency_s(self) -> float:
        """Start-up cost of one collective step on this device; on host-bound links times the
        slowdown."""
        latency = self.spec.link_latency_s
        return latency * self.slowdown if self.spec.host_links else latency


@dataclass(frozen=True)
class Inventory:
    """The devices the planner may use, in any order; ids must be unique."""

    devices: tuple[Device, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(sorted(self.devices, key=lambda d: d.id)))
        ids = [d.id for d in self.devices]
        for a, b in zip(ids, ids[1:]):
            if a == b:
                raise PlannerError(f"device id {a} appears twice in the inventory")

    def by_id(self) -> dict[int, Device]:
        return {d.id: d for d in self.devices}

    @cached_property
    def devices_by_id(self) -> Mapping[int, Device]:
        """``by_id()`` as a read-only mapping, built once (an inventory never changes): the
        planner looks devices up for every candidate it scores."""
        return MappingProxyType(self.by_id())

    @cached_property
    def usable(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.usable)

    def with_health(self, failed: tuple[int, ...] = (),
                    slowdown: Optional[dict[int, float]] = None) -> "Inventory":
        """A copy with ``failed`` devices marked failed and the given slowdown factors applied."""
        slowdown = dict(slowdown or {})
        known = self.by_id()
        for dev in list(failed) + list(slowdown):
            if dev not in known:
                raise PlannerError(f"device {dev} is not in the inventory; ids: "
                                   f"{min(known)}..{max(known)}" if known else
                                   f"device {dev} is not in the inventory; it is empty")
        out = []
        for d in self.devices:
            if d.id in failed:
                out.append(Device(d.id, d.node, d.spec, Health.FAILED, d.slowdown))
            elif d.id in slowdown:
                out.append(Device(d.id, d.node, d.spec, Health.DEGRADED, float(slowdown[d.id])))
            else:
                out.append(d)
        return Inventory(tuple(out))


@dataclass(frozen=True)
class ModelProfile:
    """What the planner needs to know about a decoder-only model.

    Byte counts are per element: ``param_bytes`` (weights), ``grad_bytes``, ``optimizer_bytes``
    (all optimizer state per parameter, e.g. fp32 master + two Adam moments = 12) and
    ``activation_bytes`` (activations exchanged between stages and TP ranks).
    ``activation_bytes_per_token_layer``: activation memory one token keeps for backward in one
    layer without TP (default 17 activation elements per hidden unit, the usual estimate with a
    fused attention kernel). ``num_kv_heads``: key/value heads of grouped-query attention
    (None: ``num_heads``); it sizes the key/value projections and limits the TP degrees
    (``tp_valid``). ``config`` is set when the profile comes from a runnable ``ModelConfig``;
    the planner then checks its plans against it.
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    activation_bytes_per_token_layer: Optional[int] = None
    config: Optional["ModelConfig"] = field(default=None, compare=False, repr=False)
    num_kv_heads: Optional[int] = None
    # tied input and output embeddings: the first and the last stage each hold the one table
    # (head_params counts it on the last), a one-stage pipeline holds it once
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_size", "num_heads", "vocab_size",
                     "seq_len", "param_bytes", "activation_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"model {self.name!r}: {name}={value!r} must be an integer >= 1")
        kv = self.num_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1
                               or self.num_heads % kv):
            raise PlannerError(f"model {self.name!r}: num_kv_heads={kv!r} must be an integer "
                               f">= 1 dividing num_heads={self.num_heads}")
        if self.activation_bytes_per_token_layer is None:
            object.__setattr__(self, "activation_bytes_per_token_layer",
                               17 * self.hidden_size * self.activation_bytes)

    # ---- parameter and FLOP counts ----------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_size(self) -> int:
        """Rows of each key/value projection (``num_kv_heads`` x head width)."""
        return self.kv_heads * (self.hidden_size // self.num_heads)

    @property
    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn_size
        return 2 * h * h + 2 * self.kv_size * h + 3 * h * f + 2 * h

    def layer_params_per_device(self, tp: int) -> float:
        """One decoder layer's parameters on each device of a TP group of ``tp``: a ``1/tp``
        share, plus ``kv_replica_params``."""
        return self.layer_params / tp + self.kv_replica_params(tp)

    def kv_replica_params(self, tp: int) -> float:
        """What a device of a TP group of ``tp`` holds of one layer beyond its ``1/tp`` share: a
        ``tp`` above ``num_kv_heads`` leaves one whole key/value head of each projection on
        every device (replicated); 0 otherwise."""
        parts = math.gcd(tp, self.kv_heads)
        if parts == tp:
            return 0.0
        kv_params = 2 * self.kv_size * self.hidden_size
        return kv_params / parts - kv_params / tp

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.hidden_size

    @property
    def total_params(self) -> int:
        return (self.num_layers * self.layer_params + self.head_params
                + (0 if self.tie_embeddings else self.embed_params))

    @property
    def state_bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs of one decoder layer for one token (matmuls and attention)."""
        h, f, s = self.hidden_size, self.ffn_size, self.seq_len
        return 2.0 * (2 * h * h + 2 * self.kv_size * h + 3 * h * f) + 4.0 * s * h

    @property
    def head_flops_per_token(self) -> float:
        return 2.0 * self.vocab_size * self.hidden_size

    def tp_sizes(self) -> dict[str, int]:
        """Sizes every TP degree must divide (whole heads per rank, FFN, vocab, hidden)."""
        return {"num_heads": self.num_heads, "ffn_size": self.ffn_size,
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size}

    def tp_valid(self, tp: int) -> bool:
        """Whether TP degree ``tp`` can run this model: it divides every size of ``tp_sizes``
        and divides ``num_kv_heads`` or is a multiple of it (``graph.config.tp_problem``).
        Valid degrees mix: any set of them has an LCM that still cuts every split dimension."""
        kv = self.kv_heads
        return all(size % tp == 0 for size in self.tp_sizes().values()) and \
            (kv % tp == 0 or tp % kv == 0)


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the search. The defaults suit both GPU clusters and small CPU jobs.

    ``tp_degrees`` / ``pp_degrees`` restrict the search (a configured template); None: search.
    ``cross_node_replicas``: rank plans where every parameter slice lives on two nodes or more
    (one node loss then needs no checkpoint) above all others (a preference).
    ``redundancy``: a hard constraint: every parameter slice (each TP shard of every layer, the
    embedding and the head) lives on at least this many nodes; no plan breaking it is returned,
    and when none meets it ``plan_for`` raises ``RedundancyError`` naming the shortfall. 1: none.
    ``use_all_devices``: an explicit opt-in: rank plans that leave no usable device idle above
    all others, even when the cost model says the extra devices do not shorten the step (a job
    whose every worker must have a role). Without it the search also lays out subsets of the
    usable devices (``planner.subsets``) and leaves a device idle when it costs more than it
    adds; ``Estimate.idle`` says why.
    ``switch_weight``: weight of the switch traffic from ``current_plan``: a plan's score is its
    step time x (1 + switch_weight x moved bytes / one replica's state bytes). Independently,
    plans within ``tie_tolerance`` of the best score are ordered by moved bytes.
    ``memory_fraction``: the part of a device's memory the planner may fill.
    ``keep_copies`` / ``keep_copy_nodes``: the redundancy a replan must not lower
    (``planner.copies``): plans holding every parameter slice on at least ``keep_copies``
    devices and ``keep_copy_nodes`` nodes are ranked above all others, and among the rest the
    ones that lose the fewest copies first (a preference: the least redundancy trade that
    exists). With ``keep_copies`` above 1 every pipeline of a layout gets a row at least, so a
    slow device keeps its replica with little work instead of none. 0: nothing to keep.
    ``optimizer_shards``: where the plans' AdamW moments live (``Plan.optimizer_shards``):
    ``"replicated"`` or ``"uneven"`` (each device updates, and keeps the moments of, about its
    pipeline's share of the rows: ``planner.zero_cost``).
    """

    tp_degrees: Optional[tuple[int, ...]] = None
    pp_degrees: Optional[tuple[int, ...]] = None
    max_microbatch_size: Optional[int] = None
    cross_node_replicas: bool = False
    redundancy: int = 1
    use_all_devices: bool = False
    switch_weight: float = 0.0
    tie_tolerance: float = 0.01
    memory_fraction: float = 0.9
    alternatives: int = 3
    refine: int = 4  # candidates re-solved exactly (integer program) after the fast pass
    keep_copies: int = 0
    keep_copy_nodes: int = 0
    optimizer_shards: str = OPTIMIZER_SHARDS[0]

    def __post_init__(self) -> None:
        if self.optimizer_shards not in OPTIMIZER_SHARDS:
            raise PlannerError(f"optimizer_shards={self.optimizer_shards!r}; valid: "
                               f"{', '.join(OPTIMIZER_SHARDS)}")
        for name in ("tp_degrees", "pp_degrees"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(value)
                object.__setattr__(self, name, value)
                if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                    for v in value):
                    raise PlannerError(f"{name}={value!r} must be positive integers")
        if isinstance(self.redundancy, bool) or not isinstance(self.redundancy, int) \
                or self.redundancy < 1:
            raise PlannerError(f"redundancy={self.redundancy!r} must be an integer >= 1")
        for name in ("keep_copies", "keep_copy_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlannerError(f"{name}={value!r} must be an integer >= 0")
        if not 0 < self.memory_fraction <= 1:
            raise PlannerError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        if self.switch_weight < 0 or self.tie_tolerance < 0:
            raise PlannerError("switch_weight and tie_tolerance must be >= 0")
        if self.max_microbatch_size is not None and self.max_microbatch_size < 1:
            raise PlannerError(f"max_microbatch_size={self.max_microbatch_size} must be >= 1")
        if self.refine < 1 or self.alternatives < 0:
            raise PlannerError(f"refine={self.refine} must be >= 1, alternatives >= 0")


@dataclass(frozen=True)
class IdleDevice:
    """Why a usable device has no role in the chosen plan (``Estimate.idle``).

    ``speed``: its effective FLOP/s over the fastest usable device's (1.0: as fast);
    ``step_time_with_s``: the predicted step time of the best plan the search found that gives
    it work (None: none it scored does, e.g. for memory); ``step_time_without_s``: the chosen
    plan's; ``reason``: one line with those numbers, e.g. ``"device 3 idle: at 0.25x the fastest
    device's speed the best plan using it takes 0.41 s/step vs 0.22 s without"``."""

    id: int
    speed: float
    reason: str
    step_time_with_s: Optional[float]
    step_time_without_s: float


@dataclass(frozen=True)
class Estimate:
    """The cost model's verdict on one plan. ``idle`` is filled on a search's chosen plan only
    (``plan_for``, ``subsets.best_uniform``): one ``IdleDevice`` per device of
    ``unused_devices``; elsewhere it is empty."""

    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    pipeline_times_s: tuple[float, ...]
    stage_times_s: tuple[tuple[float, ...], ...]  # per pipeline, per stage, one micro-batch
    grad_sync_s: float
    bubble_fraction: float  # idle share of the slowest pipeline's time
    memory_bytes: dict[int, int]  # per device used
    memory_limit_bytes: dict[int, int]
    unused_devices: tuple[int, ...]  # usable devices the plan leaves idle
    cross_node_replicas: bool  # every parameter slice is held on >= 2 nodes
    switch_bytes: Optional[int] = None  # bytes moved from current_plan (None: no current plan)
    replica_nodes: int = 1  # the fewest nodes any parameter slice is held on
    replica_devices: int = 1  # the fewest devices any parameter slice is held on
    idle: tuple[IdleDevice, ...] = ()  # why each unused device is idle (the chosen plan only)


@dataclass(frozen=True)
class Candidate:
    """One ranked plan with its estimate and a short description of its layout."""

    plan: "Plan"
    estimate: Estimate
    label: str
    score: float


@dataclass(frozen=True)
class PlanResult:
    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    profile: ModelProfile = field(repr=False)
    inventory: Inventory = field(repr=False)

    @property
    def plan(self) -> "Plan":
        return self.chosen.plan

    @property
    def estimate(self) -> Estimate:
        return self.chosen.estimate

    # its account for people and its JSON: ``explain.explain(result)`` and
    # ``explain.result_to_dict(result)`` (the presentation sits above the API)
