"""Writing the trained model as a Hugging Face checkpoint that ``transformers`` loads.

``export_hf(out_dir, config, state)`` writes ``config.json`` and ``model.safetensors``, or, when
the weights exceed ``max_shard_size`` bytes, ``model-0000i-of-0000n.safetensors`` files with
``model.safetensors.index.json``, as ``save_pretrained`` does. ``state`` is either the full
parameters (our names) or the ranks' ``RunResult.final_state`` pieces, which are assembled with
``gather_full`` (also ``runtime.gather_full``): that is how a model trained under any plan is
exported (every rank of the final plan hands back its slices with their global index ranges; one
replica of each slice is enough). Names map back through ``weights.hf_names``; no row is
permuted (see weights.py). A tied model writes no ``lm_head.weight`` (``tie_word_embeddings:
true``: transformers ties it on load).

Files are written atomically (``files``: a temporary name, fsync, rename; a failed write leaves
no temporary file); ``config.json`` comes last, so a directory with a ``config.json`` holds a
whole checkpoint. A directory that already holds weights is refused: a stale
``model.safetensors`` beside a new index would be loaded instead of it.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from hspmd_elastic.files import atomic_open, atomic_path
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.hf.api import (CONFIG_FILE, DEFAULT_SHARD_BYTES, INDEX_FILE, SINGLE_FILE,
                                  HFCheckpointError)
from hspmd_elastic.hf.config import config_to_hf, read_hf_config
from hspmd_elastic.hf.weights import hf_names

Pieces = Sequence[Mapping[str, tuple[tuple, torch.Tensor]]]


def export_hf(out_dir: str, config: ModelConfig,
              state: Union[Mapping[str, torch.Tensor], Pieces], *,
              dtype: Optional[str] = None, max_shard_size: int = DEFAULT_SHARD_BYTES,
              like: Union[str, dict, None] = None) -> list[str]:
    """Write ``state`` (full parameters by our names, or the ranks' ``final_state`` pieces) to
    ``out_dir`` as a ``LlamaForCausalLM`` checkpoint stored in ``dtype`` (default
    ``config.dtype``); the files written, ``config.json`` last. ``like``: the source
    checkpoint (its directory or ``config.json`` dict), whose other fields are kept
    (``config.config_to_hf``)."""
    if max_shard_size < 1:
        raise HFCheckpointError(f"max_shard_size={max_shard_size} must be >= 1 byte")
    full = full_params(config, state)
    hf_config = config_to_hf(config, dtype=dtype,
                             like=read_hf_config(like) if isinstance(like, str) else like)
    out_dtype = getattr(torch, dtype or config.dtype)
    names = hf_names(config)
    tensors = {names[n]: t.detach().to("cpu", out_dtype).contiguous() for n, t in full.items()}
    _refuse_existing(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    groups = _shard(tensors, max_shard_size)
    written = []
    if len(groups) == 1:
        written.append(_save(tensors, os.path.join(out_dir, SINGLE_FILE)))
    else:
        weight_map = {}
        for i, group in enumerate(groups, 1):
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            written.append(_save({n: tensors[n] for n in group}, os.path.join(out_dir, file)))
            weight_map.update({n: file for n in group})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        written.append(_write_json({"metadata": {"total_size": total}, "weight_map": weight_map},
                                   os.path.join(out_dir, INDEX_FILE)))
    written.append(_write_json(hf_config, os.path.join(out_dir, CONFIG_FILE)))
    return written


def gather_full(pieces: list[dict[str, tuple[tuple, torch.Tensor]]],
                shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Assemble full tensors from several ranks' ``final_state`` (every element must appear)."""
    out = {}
    for name, shape in shapes.items():
        full = torch.full(shape, float("nan"), dtype=torch.float64)
        for part in pieces:
            if name in part:
                ranges, tensor = part[name]
                full[tuple(slice(lo, hi) for lo, hi in ranges)] = tensor.to(torch.float64)
        out[name] = full
    return out


def full_params(config: ModelConfig,
                state: Union[Mapping[str, torch.Tensor], Pieces]) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor, checked: all names, the config's shapes, finite values;
    ``state`` given as ranks' pieces is assembled first (``gather_full``), and an
    element that no piece covers is an error naming the tensor."""
    specs = param_specs(config)
    if isinstance(state, Mapping):
        unknown = sorted(set(state) - set(specs))
        if unknown:
            raise HFCheckpointError(f"tensor {unknown[0]} is not a parameter of the model")
        full, what = dict(state), "non-finite values"
    else:
        for piece in state:
            unknown = sorted(set(piece) - set(specs))
            if unknown:
                raise HFCheckpointError(f"piece tensor {unknown[0]} is not a parameter of the "
                                        "model")
        full = gather_full(list(state), {n: s.shape for n, s in specs.items()})
        what = "elements that no rank's piece covers, or non-finite values"
    for name, spec in specs.items():
        value = full.get(name)
        if value is None:
            raise HFCheckpointError(f"parameter {name} is missing from the state to export")
        if tuple(value.shape) != tuple(spec.shape):
            raise HFCheckpointError(f"parameter {name} has shape {tuple(value.shape)}; the config "
                                    f"says {tuple(spec.shape)}")
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise HFCheckpointError(f"parameter {name} has {bad} {what}")
    return full


def _refuse_existing(out_dir: str) -> None:
    if not os.path.isdir(out_dir):
        return
    present = sorted(f for f in os.listdir(out_dir)
                     if f.endswith(".safetensors") or f in (INDEX_FILE, CONFIG_FILE))
    if present:
        raise HFCheckpointError(f"{out_dir} already holds {present[0]}; export to an empty "
                                "directory")


def _shard(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _save(tensors: Mapping[str, torch.Tensor], path: str) -> str:
    try:
        with atomic_path(path) as tmp:
            save_file(dict(tensors), tmp, metadata={"format": "pt"})
    except OSError as exc:
        raise HFCheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def _write_json(obj, path: str) -> str:
    try:
        with atomic_open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as exc:
        raise HFCheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
