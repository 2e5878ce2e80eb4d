"""What a plan's training state is made of, without building anything: names, full shapes,
dtypes and annotations of every state tensor. Pure, no torch.

Resharding needs exactly this on both sides of a switch: ``state_specs(config, old_plan)`` and
``state_specs(config, new_plan)`` name the same tensors with their old and new annotations.

Names: the parameter name for a parameter, ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` for its
AdamW moments (the parameter's annotation), ``optim.step`` for the step counter (an int64 scalar
that every device of the plan holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd_elastic.annotations import TensorAnnotation
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.plan import Plan

EXP_AVG, EXP_AVG_SQ, STEP = ".exp_avg", ".exp_avg_sq", "optim.step"


@dataclass(frozen=True)
class StateSpec:
    shape: tuple[int, ...]  # the full (unsharded) shape
    dtype: str  # a torch dtype name: "float64", "float32", "int64"
    annotation: TensorAnnotation


def state_specs(config: ModelConfig, plan: Plan) -> dict[str, StateSpec]:
    """Every state tensor of ``plan`` training ``config``, in a fixed order."""
    specs = param_specs(config)
    out = {}
    for name, ann in plan.param_annotations(config).items():
        for suffix in ("", EXP_AVG, EXP_AVG_SQ):
            out[name + suffix] = StateSpec(specs[name].shape, config.dtype, ann)
    out[STEP] = StateSpec((), "int64", plan.replicated_annotation())
    return out


def local_shapes(config: ModelConfig, plan: Plan, device: int) -> dict[str, tuple[int, ...]]:
    """The shape of every state tensor ``device`` holds under ``plan`` (from the annotations)."""
    out = {}
    for name, spec in state_specs(config, plan).items():
        slices = spec.annotation.local_slices(device, spec.shape)
        if slices is not None:
            out[name] = tuple(hi - lo for lo, hi in slices)
    return out
