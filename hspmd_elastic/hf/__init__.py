"""Hugging Face checkpoints in and out, for the Llama family the decoder supports.

Modules:
  api.py      errors (HFConfigError, HFCheckpointError) and file names: pure, no torch
  config.py   config.json <-> ModelConfig, with the fields that are mapped, refused unless
              neutral, or ignored: pure, no torch
  weights.py  the name mapping, and reading each rank's own byte ranges of model.safetensors or
              of a sharded checkpoint's files (safetensors, never torch.load); a rank's initial
              training state; the project checkpoint of step 0 that runtime.run can start from
  export.py   the trained model (full tensors or the ranks' final_state pieces) written back as
              config.json + model.safetensors (+ index), which transformers loads

docs/checkpoints.md describes the supported configs, what is refused and why, and the layout.
Names are imported on first use, so ``config_from_hf`` does not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "HFConfigError": "api", "HFCheckpointError": "api",
    "config_from_hf": "config", "config_to_hf": "config", "read_hf_config": "config",
    "hf_names": "weights", "load_shards": "weights", "local_param_ranges": "weights",
    "initial_state_from_hf": "weights", "write_initial_checkpoint": "weights",
    "export_hf": "export", "full_params": "export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
