"""Plans: how one model runs on a set of devices. Pure values, no torch.

A ``Plan`` is a list of pipelines (the data-parallel replicas). Each pipeline is a list of stages;
a stage is a tensor-parallel group of devices and the half-open range of decoder layers it holds.
Each pipeline runs its own number of micro-batches of its own size, so the data split across
pipelines may be uneven, but the micro-batch rows always add up to the plan's global batch: the
step computes the same thing whatever the plan.

Pipelines may differ in depth, TP degree and layer split. A plan that exists is valid: the
constructor rejects bad plans with a one-line ``PlanError`` naming the bad value.
``Plan.check_model(config)`` adds the checks that depend on the model (layer count, TP degrees
that must divide heads, FFN width and vocabulary, and divide or be a multiple of the key/value
heads: ``graph.config.tp_problem``; the sequence length, when the plan says which one it was
made for: ``seq_len``, set by the elastic leader from its model, ``at_seq_len``, and carried in
``to_dict`` only when set; it takes no part in a plan's equality).

``optimizer_shards`` says where the AdamW moments live: ``"replicated"`` (the default: on every
holder of a parameter slice, each holder running the whole update of its shard) or ``"uneven"``
(each row of a split parameter on one holder, the shares proportional to the pipelines' rows:
``graph/zero.py``; ``with_optimizer_shards`` sets it). It changes the training state's layout,
so it takes part in equality, and ``to_dict`` carries it only when not the default.

From a plan follow each parameter's layout (``param_layouts``): per pipeline, the TP group that
holds it, the dimension it is split along and into how many parts (fewer than the TP degree for
the key/value projections of a TP degree above ``num_kv_heads``: each part is then replicated on
adjacent TP ranks). ``param_annotations`` turns that into HSPMD annotations (a DG union of those
groups, hdim -1), which is all resharding between plans needs. A tied embedding
(``ModelConfig.tie_embeddings``) is held by two stages of a pipeline, its first (lookup) and its
last (LM head): it has a group for each, in every pipeline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from hspmd_elastic.annotations import DGUnion, DeviceGroup, DistState, DSUnion, TensorAnnotation
from hspmd_elastic.graph.config import ModelConfig, holding_layers, param_specs, tp_problem

SCHEMA = 1
OPTIMIZER_SHARDS = ("replicated", "uneven")  # Plan.optimizer_shards; the first is the default


class PlanError(ValueError):
    """An invalid plan; the message is one line naming the bad value and what would be valid."""


@dataclass(frozen=True)
class Stage:
    devices: tuple[int, ...]  # the TP group, in TP-rank order
    layers: tuple[int, int]  # [start, stop) of decoder layers

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))

    @property
    def tp(self) -> int:
        return len(self.devices)

    def holds(self, layer: int) -> bool:
        return self.layers[0] <= layer < self.layers[1]


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    num_microbatches: int
    microbatch_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def rows(self) -> int:
        return self.num_microbatches * self.microbatch_size

    def stage_of_layer(self, layer: int) -> Stage:
        for stage in self.stages:
            if stage.holds(layer):
                return stage
        raise PlanError(f"layer {layer} is held by no stage")


@dataclass(frozen=True)
class Placement:
    """Where one device sits in a plan."""

    pipeline: int
    stage: int
    tp_rank: int


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter is held: per pipeline, the TP group holding it (per holding stage: a tied
    embedding has two groups in a pipeline of several stages); the split dim or None.

    ``splits``: per group, the parts the split dim is cut into (None: each group's TP degree).
    A group of ``t`` devices with ``k < t`` parts holds part ``i // (t / k)`` on its ``i``-th
    device: each part on ``t / k`` adjacent TP ranks (replicated key/value heads).
    """

    groups: tuple[tuple[int, ...], ...]
    split_dim: Optional[int]
    shape: tuple[int, ...]
    splits: Optional[tuple[int, ...]] = None

    def parts(self, group: int) -> int:
        """Parts of the split dim in ``groups[group]`` (1 when not split)."""
        if self.split_dim is None:
            return 1
        return len(self.groups[group]) if self.splits is None else self.splits[group]

    def replicas(self, group: int) -> int:
        """Devices of ``groups[group]`` holding each part."""
        return len(self.groups[group]) // self.parts(group)

    def part_of(self, group: int, tp_rank: int) -> int:
        """The part that TP rank ``tp_rank`` of ``groups[group]`` holds."""
        return tp_rank // self.replicas(group)


@dataclass(frozen=True)
class Plan:
    pipelines: tuple[Pipeline, ...]
    global_batch: int
    num_layers: int
    # The sequence length the plan was made for (the leader's model); None: not said.
    seq_len: Optional[int] = field(default=None, compare=False)
    # Where the AdamW moments live (OPTIMIZER_SHARDS): on every holder, or one owner per row.
    optimizer_shards: str = OPTIMIZER_SHARDS[0]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        _validate(self)

    # ---- queries -------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(d for p in self.pipelines for s in p.stages for d in s.devices))

    def locate(self, device: int) -> Placement:
        for pi, pipe in enumerate(self.pipelines):
            for si, stage in enumerate(pipe.stages):
                if device in stage.devices:
                    return Placement(pi, si, stage.devices.index(device))
        raise PlanError(f"device {device} is not in the plan; devices: {list(self.devices)}")

    def stage_of(self, device: int) -> Stage:
        where = self.locate(device)
        return self.pipelines[where.pipeline].stages[where.stage]

    def batch_rows(self, pipeline: int) -> tuple[int, int]:
        """The contiguous [start, stop) rows of the global batch that ``pipeline`` takes."""
        start = sum(p.rows for p in self.pipelines[:pipeline])
        return start, start + self.pipelines[pipeline].rows

    def microbatch_rows(self, pipeline: int, index: int) -> tuple[int, int]:
        start = self.batch_rows(pipeline)[0] + index * self.pipelines[pipeline].microbatch_size
        return start, start + self.pipelines[pipeline].microbatch_size

    def relabel(self, mapping: Mapping[int, int]) -> "Plan":
        """This plan with every device id ``d`` replaced by ``mapping[d]`` (a KeyError names an
        id the mapping lacks); the layout is unchanged."""
        pipes = tuple(Pipeline(tuple(Stage(tuple(mapping[d] for d in s.devices), s.layers)
                                     for s in p.stages), p.num_microbatches, p.microbatch_size)
                      for p in self.pipelines)
        return Plan(pipes, self.global_batch, self.num_layers, self.seq_len,
                    self.optimizer_shards)

    def at_seq_len(self, seq_len: Optional[int]) -> "Plan":
        """This plan, made for sequences of ``seq_len`` tokens (``check_model`` holds a model
        to it)."""
        return self if seq_len == self.seq_len else replace(self, seq_len=seq_len)

    def with_optimizer_shards(self, mode: str) -> "Plan":
        """This plan with its AdamW moments held as ``mode`` says (``OPTIMIZER_SHARDS``)."""
        return self if mode == self.optimizer_shards else replace(self, optimizer_shards=mode)

    # ---- model-dependent -----------------------------------------------------------------
    def check_model(self, config: ModelConfig) -> None:
        """Raise ``PlanError`` unless this plan can run ``config``."""
        if config.num_layers != self.num_layers:
            raise PlanError(
                f"plan has num_layers={self.num_layers}, model has {config.num_layers}")
        if self.seq_len is not None and config.seq_len != self.seq_len:
            raise PlanError(
                f"plan was made for seq_len={self.seq_len}, model has seq_len="
                f"{config.seq_len}: give the script the sequence length the launcher plans "
                "for (--hspmd-model, --hspmd-seq-len)")
        for pi, pipe in enumerate(self.pipelines):
            for si, stage in enumerate(pipe.stages):
                problem = tp_problem(config, stage.tp)
                if problem is not None:
                    raise PlanError(f"pipeline {pi} stage {si}: {problem}")
        for name, layout in self._layouts(config).items():
            dim = layout.split_dim
            parts = [layout.parts(p) for p in range(len(layout.groups))]
            if dim is not None and layout.shape[dim] % math.lcm(*parts):
                raise PlanError(
                    f"{name}: dim {dim} of size {layout.shape[dim]} does not cut into the common "
                    f"slices of {parts} parts (TP degrees {[len(g) for g in layout.groups]})")

    def param_layouts(self, config: ModelConfig) -> dict[str, ParamLayout]:
        """Each parameter's holders per pipeline and its split dim, in ``param_specs`` order."""
        self.check_model(config)
        return self._layouts(config)

    def _layouts(self, config: ModelConfig) -> dict[str, ParamLayout]:
        out = {}
        for name, spec in param_specs(config).items():
            # one group per distinct holding stage per pipeline: a tied embedding is held by
            # the first and the last stage (disjoint groups, so the gradient sync sums them)
            layers = holding_layers(spec.layer, config.num_layers)
            groups = tuple(dict.fromkeys(p.stage_of_layer(layer).devices for layer in layers)
                           for p in self.pipelines)
            groups = tuple(g for per_pipe in groups for g in per_pipe)
            splits = None if spec.blocks is None else tuple(spec.split_count(len(g))
                                                            for g in groups)
            out[name] = ParamLayout(groups, spec.split_dim, spec.shape, splits)
        return out

    def param_annotations(self, config: ModelConfig) -> dict[str, TensorAnnotation]:
        """Each parameter's ``TensorAnnotation``: a DG union of its holding TP groups, hdim -1.

        Local states: ``{split_dim: tp}`` for sharded weights, ``{-1: tp}`` for duplicated ones,
        and ``DistState({split_dim: k, -1: tp // k}, order=(split_dim, -1))`` for a weight cut
        into ``k < tp`` parts (replicated key/value heads: the split dim varies slower, the
        replicas fastest, so TP rank ``i`` holds part ``i // (tp / k)``). AdamW moments share
        their parameter's annotation.
        """
        out = {}
        for name, layout in self.param_layouts(config).items():
            groups = DGUnion([DeviceGroup(list(g)) for g in layout.groups])
            states = DSUnion([_local_state(layout, p) for p in range(len(layout.groups))],
                             hdim=-1)
            out[name] = TensorAnnotation(groups, states)
        return out

    def replicated_annotation(self) -> TensorAnnotation:
        """A scalar or small tensor that every device of the plan holds whole (e.g. a step count)."""
        devs = list(self.devices)
        return TensorAnnotation(DGUnion([DeviceGroup(devs)]), DSUnion([DistState({-1: len(devs)})]))

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {
            "schema": SCHEMA,
            "global_batch": self.global_batch,
            "num_layers": self.num_layers,
            "pipelines": [
                {"num_microbatches": p.num_microbatches, "microbatch_size": p.microbatch_size,
                 "stages": [{"devices": list(s.devices), "layers": list(s.layers)}
                            for s in p.stages]}
                for p in self.pipelines
            ],
        }
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        if self.optimizer_shards != OPTIMIZER_SHARDS[0]:
            out["optimizer_shards"] = self.optimizer_shards
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"plan must be a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise PlanError(f"plan schema={data.get('schema')!r}; this code reads schema {SCHEMA}")
        optional = {"seq_len", "optimizer_shards"} & set(data)
        _expect_keys("plan", data, {"schema", "global_batch", "num_layers", "pipelines"}
                     | optional)
        pipes = []
        for pi, p in enumerate(data["pipelines"]):
            _expect_keys(f"pipeline {pi}", p, {"num_microbatches", "microbatch_size", "stages"})
            stages = []
            for si, s in enumerate(p["stages"]):
                _expect_keys(f"pipeline {pi} stage {si}", s, {"devices", "layers"})
                if len(s["layers"]) != 2:
                    raise PlanError(f"pipeline {pi} stage {si}: layers={s['layers']} must be "
                                    "[start, stop]")
                stages.append(Stage(tuple(s["devices"]), tuple(s["layers"])))
            pipes.append(Pipeline(tuple(stages), p["num_microbatches"], p["microbatch_size"]))
        return cls(tuple(pipes), data["global_batch"], data["num_layers"], data.get("seq_len"),
                   data.get("optimizer_shards", OPTIMIZER_SHARDS[0]))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def simple_plan(*, dp: int = 1, tp: int = 1, pp: int = 1, num_layers: int,
                global_batch: int, num_microbatches: int = 1) -> Plan:
    """A homogeneous plan: ``dp`` equal pipelines of ``pp`` stages of ``tp`` devices, even layers."""
    if num_layers % pp:
        raise PlanError(f"pp={pp} does not divide num_layers={num_layers}")
    if global_batch % (dp * num_microbatches):
        raise PlanError(f"dp*num_microbatches={dp * num_microbatches} does not divide "
                        f"global_batch={global_batch}")
    per = num_layers // pp
    size = global_batch // (dp * num_microbatches)
    pipes, dev = [], 0
    for _ in range(dp):
        stages = []
        for s in range(pp):
            stages.append(Stage(tuple(range(dev, dev + tp)), (s * per, (s + 1) * per)))
            dev += tp
        pipes.append(Pipeline(tuple(stages), num_microbatches, size))
    return Plan(tuple(pipes), global_batch, num_layers)


def lcm_tp(groups: tuple[tuple[int, ...], ...]) -> int:
    return math.lcm(*(len(g) for g in groups))


def _local_state(layout: ParamLayout, group: int) -> DistState:
    tp = len(layout.groups[group])
    if layout.split_dim is None:
        return DistState({-1: tp})
    dim, parts = layout.split_dim, layout.parts(group)
    return DistState({dim: parts, -1: tp // parts}, order=(dim, -1))


# ---- validation ----------------------------------------------------------------------------

def _expect_keys(what: str, data: Any, keys: set) -> None:
    if not isinstance(data, dict):
        raise PlanError(f"{what} must be a JSON object, got {type(data).__name__}")
    if set(data) != keys:
        missing, extra = sorted(keys - set(data)), sorted(set(data) - keys)
        raise PlanError(f"{what}: missing keys {missing}, unknown keys {extra}")


def _positive_int(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what}={value!r} must be a positive integer")


def _validate(plan: Plan) -> None:
    _positive_int("global_batch", plan.global_batch)
    _positive_int("num_layers", plan.num_layers)
    if plan.seq_len is not None:
        _positive_int("seq_len", plan.seq_len)
    if plan.optimizer_shards not in OPTIMIZER_SHARDS:
        raise PlanError(f"optimizer_shards={plan.optimizer_shards!r}; valid: "
                        f"{', '.join(repr(m) for m in OPTIMIZER_SHARDS)}")
    if not plan.pipelines:
        raise PlanError("plan has no pipelines; need at least one")
    seen: dict[int, tuple[int, int]] = {}
    for pi, pipe in enumerate(plan.pipelines):
        _positive_int(f"pipeline {pi} num_microbatches", pipe.num_microbatches)
        _positive_int(f"pipeline {pi} microbatch_size", pipe.microbatch_size)
        if not pipe.stages:
            raise PlanError(f"pipeline {pi} has no stages; need at least one")
        _validate_layers(pi, pipe, plan.num_layers)
        for si, stage in enumerate(pipe.stages):
            _validate_devices(pi, si, stage, seen)
    _validate_batch(plan)


def _validate_layers(pi: int, pipe: Pipeline, num_layers: int) -> None:
    expected = 0
    for si, stage in enumerate(pipe.stages):
        start, stop = stage.layers
        if start >= stop:
            raise PlanError(f"pipeline {pi} stage {si}: layers [{start}, {stop}) is empty; "
                            "need start < stop")
        if start > expected:
            raise PlanError(f"pipeline {pi} stage {si}: layers [{start}, {stop}) leave a gap: "
                            f"layers [{expected}, {start}) are held by no stage")
        if start < expected:
            raise PlanError(f"pipeline {pi} stage {si}: layers [{start}, {stop}) overlap the "
                            f"previous stage, which ends at {expected}")
        expected = stop
    if expected != num_layers:
        raise PlanError(f"pipeline {pi}: stages end at layer {expected}, "
                        f"num_layers={num_layers}; layers [{expected}, {num_layers}) are uncovered"
                        if expected < num_layers else
                        f"pipeline {pi}: stages end at layer {expected}, beyond "
                        f"num_layers={num_layers}")


def _validate_devices(pi: int, si: int, stage: Stage, seen: dict) -> None:
    if not stage.devices:
        raise PlanError(f"pipeline {pi} stage {si} has no devices; need at least one")
    if len(set(stage.devices)) != len(stage.devices):
        dup = sorted({d for d in stage.devices if stage.devices.count(d) > 1})
        raise PlanError(f"pipeline {pi} stage {si} lists device(s) {dup} more than once: "
                        f"{list(stage.devices)}")
    for d in stage.devices:
        if d < 0:
            raise PlanError(f"pipeline {pi} stage {si}: device {d} must be >= 0")
        if d in seen:
            where = seen[d]
            raise PlanError(f"device {d} is in two stages: pipeline {where[0]} stage {where[1]} "
                            f"and pipeline {pi} stage {si}")
        seen[d] = (pi, si)


def _validate_batch(plan: Plan) -> None:
    total = sum(p.rows for p in plan.pipelines)
    if total != plan.global_batch:
        parts = ", ".join(f"pipeline {i}: {p.num_microbatches}x{p.microbatch_size}"
                          for i, p in enumerate(plan.pipelines))
        raise PlanError(f"micro-batches sum to {total} rows ({parts}), "
                        f"global_batch={plan.global_batch}")
