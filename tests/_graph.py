"""What the graph tests (``tests/test_graph_*.py``, ``tests/test_gqa.py``) share.

``train_each_plan`` is the body of a gloo world (``_world.run_world``) that trains the
specialized model of every plan of a list in turn, each from the same seed, and returns per plan
what this rank holds and its losses. ``annotated_module`` builds the ``StageModule`` one rank of
a plan allocates, and checks that the shards it allocates are the ones its annotations name.
"""

from __future__ import annotations

from typing import Callable, Optional

from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.layers import TPGroup
from hspmd_elastic.graph.model import StageModule
from hspmd_elastic.graph.state import local_shapes
from hspmd_elastic.plan import Plan, Stage


def train_each_plan(rank: int, payload: dict, train: Callable) -> list[Optional[dict]]:
    """For each plan of ``payload["plans"]`` (JSON) on ``payload["config"]`` (JSON): this rank's
    ``SpecializedModel`` (seed ``payload["seed"]``, the plan's ``Comm``), trained by
    ``train(model)``, which returns the losses. Per plan, ``{"params": its local parameters,
    "losses": ...}``, or None where the plan leaves this rank out."""
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel

    config = ModelConfig.from_json(payload["config"])
    out = []
    for text in payload["plans"]:
        plan = Plan.from_json(text)
        comm = Comm.create(plan, config, rank, timeout_s=30)
        if rank not in plan.devices:
            out.append(None)
            continue
        model = SpecializedModel.build(config, plan, rank, seed=payload["seed"], comm=comm)
        losses = train(model)
        out.append({"params": model.local_params(), "losses": losses})
    return out


def annotated_module(config: ModelConfig, plan: Plan, device: int) -> tuple[StageModule, Stage]:
    """The ``StageModule`` ``device`` allocates under ``plan`` (no process group), and its
    stage; asserts that its parameters have the shapes of the shards its annotations name."""
    where = plan.locate(device)
    pipe = plan.pipelines[where.pipeline]
    stage = pipe.stages[where.stage]
    module = StageModule(config, stage.layers, TPGroup(stage.devices, where.tp_rank, None),
                         first=where.stage == 0, last=where.stage == len(pipe.stages) - 1)
    held = {n: s for n, s in local_shapes(config, plan, device).items()
            if n in param_specs(config)}
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == held
    return module, stage
