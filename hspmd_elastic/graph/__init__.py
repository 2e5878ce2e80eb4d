"""Graph specialization: one model definition, executed per rank as its plan dictates.

Modules:
  config.py      ModelConfig and the parameter table (names, full shapes, split dims): pure, no torch
  comm.py        the process groups a plan needs and every wait on them, with deadlines
  layers.py      tensor-parallel layers (vocab-parallel embedding, column/row-parallel linear,
                 vocab-parallel cross-entropy)
  model.py       the one Llama-style decoder definition, built for a layer range and a TP group
                 (SDPA attention; bf16 compute under autocast when ModelConfig.compute_dtype says)
  init.py        deterministic, plan-independent parameter initialisation from a seed
  pipeline.py    the 1F1B schedule (pure) and its execution with point-to-point activations
  gradsync.py    gradient synchronisation across pipelines of different layouts (split all-reduce)
  optim.py       AdamW on local shards (torch._foreach_* ops), state annotated like its parameters,
                 or on owned rows only, staged then committed (uneven optimizer shards)
  zero.py        uneven optimizer shards: the owner of every row of a split parameter (pure)
  state.py       names, full shapes, dtypes and annotations of a plan's training state (pure)
  specialize.py  SpecializedModel: build / load / step / state_tensors for one rank
  reference.py   the dense single-device semantics every specialization must reproduce

This package does not import torch at import time, so ``plan.py`` can use ``config.py`` in
processes (the leader) that never train.
"""

from importlib import import_module

# Public names, imported on first use so that ``config`` stays torch-free.
_EXPORTS = {
    "ModelConfig": "config", "ModelConfigError": "config", "param_specs": "config",
    "Comm": "comm", "Waiter": "comm", "deadline_waiter": "comm",
    "GraphError": "comm", "CommTimeoutError": "comm",
    "AdamWConfig": "optim",
    "StateSpec": "state", "state_specs": "state", "local_shapes": "state",
    "SpecializedModel": "specialize", "StateError": "specialize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
