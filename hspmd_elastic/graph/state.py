"""What a plan's training state is made of, without building anything: names, full shapes,
dtypes and annotations of every state tensor. Pure, no torch.

Resharding needs exactly this on both sides of a switch: ``state_specs(config, old_plan)`` and
``state_specs(config, new_plan)`` name the same tensors with their old and new annotations.

Names: the parameter name for a parameter, ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` for its
AdamW moments, ``optim.step`` for the step counter (an int64 scalar that every device of the plan
holds). The moments share the parameter's annotation when ``plan.optimizer_shards`` is
``"replicated"``; in ``"uneven"`` mode a split parameter's moments have explicit per-device boxes
(``annotations.BoxAnnotation``: each holder its owned rows, ``zero.moment_annotations``), which
BSR and the checkpoints read like any other annotation.
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd_elastic.annotations import Annotation
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.zero import moment_annotations
from hspmd_elastic.plan import Plan

EXP_AVG, EXP_AVG_SQ, STEP = ".exp_avg", ".exp_avg_sq", "optim.step"


@dataclass(frozen=True)
class StateSpec:
    shape: tuple[int, ...]  # the full (unsharded) shape
    dtype: str  # a torch dtype name: "float64", "float32", "int64"
    annotation: Annotation


def state_specs(config: ModelConfig, plan: Plan) -> dict[str, StateSpec]:
    """Every state tensor of ``plan`` training ``config``, in a fixed order."""
    specs = param_specs(config)
    out = {}
    params = plan.param_annotations(config)
    moments = moment_annotations(plan, config, params)
    for name, ann in params.items():
        out[name] = StateSpec(specs[name].shape, config.dtype, ann)
        for suffix in (EXP_AVG, EXP_AVG_SQ):
            out[name + suffix] = StateSpec(specs[name].shape, config.dtype, moments[name])
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
