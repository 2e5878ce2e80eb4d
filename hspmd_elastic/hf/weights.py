"""Reading a Hugging Face checkpoint's weights, each rank only its own slices.

Names: ``hf_names(config)`` maps every name of ``graph.config.param_specs`` to its Hugging Face
name (``layers.3.attn.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``). With tied
embeddings there is no ``lm_head.weight``: the head is ``model.embed_tokens.weight``. Shapes are the
same on both sides (linear weights are ``[out, in]``), and no row is permuted: Hugging Face's
Llama checkpoints are stored for ``rotate_half`` RoPE (each head's first half pairs with its
second half), which is the convention of ``graph.model.apply_rope`` and ``graph.reference``.

Reading: ``load_shards(path, config, wanted)`` opens ``model.safetensors``, or the files of
``model.safetensors.index.json`` that hold a wanted tensor (no other file is opened), with
``safetensors.safe_open``, and copies only the wanted index ranges out of the memory-mapped file
(``get_slice``), so a rank reads about its share of the checkpoint. Never ``torch.load``: a
safetensors file is a JSON header and raw bytes, and reading it runs no code.

``initial_state_from_hf(path, config, plan, rank)`` is a rank's whole local training state
(parameters from the checkpoint, zero AdamW moments, step 0): what ``SpecializedModel.build(...,
state=...)`` binds. ``write_initial_checkpoint`` turns the checkpoint into the project's own
checkpoint of step 0, which ``runtime.run(checkpoint_dir=...)`` starts from under any plan.
"""

from __future__ import annotations

import json
import os
import re
from typing import Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open

from hspmd_elastic.elastic.checkpoint import CheckpointWriter, latest_complete
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.state import EXP_AVG, EXP_AVG_SQ, STEP, local_shapes, state_specs
from hspmd_elastic.hf.api import INDEX_FILE, SINGLE_FILE, HFCheckpointError
from hspmd_elastic.plan import Plan, simple_plan

Ranges = tuple[tuple[int, int], ...]

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight",
          "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight",
          "attn.wo.weight": "self_attn.o_proj.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.w_gate.weight": "mlp.gate_proj.weight",
          "mlp.w_up.weight": "mlp.up_proj.weight",
          "mlp.w_down.weight": "mlp.down_proj.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# Buffers that transformers < 4.31 saved with the weights; recomputed, never trained.
_SKIPPED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Our parameter name -> its Hugging Face name, for every parameter, in param_specs order."""
    out = {}
    for name in param_specs(config):
        m = _LAYER_RE.match(name)
        hf = _TOP.get(name) if m is None else \
            (f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}" if m.group(2) in _LAYER else None)
        if hf is None:
            raise HFCheckpointError(f"parameter {name} has no Hugging Face name")
        out[name] = hf
    return out


def checkpoint_files(path: str) -> dict[str, str]:
    """Hugging Face tensor name -> the file that holds it, from ``model.safetensors.index.json``
    (no weight file is opened) or the header of ``model.safetensors``."""
    index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFCheckpointError(f"{index} has no readable weight_map: {exc}") from None
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index}: weight_map must be an object")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _FILE_RE.match(file):
                # only plain .safetensors names of the checkpoint's own directory are read
                raise HFCheckpointError(f"{index}: tensor {name} maps to {file!r}, not a "
                                        ".safetensors file of the checkpoint directory")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    if os.path.exists(single):
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise HFCheckpointError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise HFCheckpointError(f"cannot read {file} as safetensors: {exc}") from None


def _check_names(path: str, files: Mapping[str, str], names: Mapping[str, str],
                 tied: bool = False) -> None:
    """Every parameter is in the checkpoint, and the checkpoint holds nothing else (but a tied
    model's ``lm_head.weight``, which transformers ties to the embedding on load: not read)."""
    missing = [hf for hf in names.values() if hf not in files]
    if missing:
        raise HFCheckpointError(f"{path} lacks tensor {missing[0]}"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    known = set(names.values())
    extra = sorted(n for n in files if n not in known and not _SKIPPED.match(n)
                   and not (tied and n == "lm_head.weight"))
    if extra:
        raise HFCheckpointError(f"{path} holds tensor {extra[0]}, which this model does not have"
                                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def load_shards(path: str, config: ModelConfig, wanted: Mapping[str, Optional[Ranges]],
                stats: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """The ``wanted`` index ranges (per dimension, half-open; None: nothing) of parameters of
    ``config``, read from the Hugging Face checkpoint directory ``path`` in ``config.dtype``.

    Only files holding a wanted tensor are opened, and only the wanted ranges are copied out of
    them. ``stats`` (when given): ``bytes_read`` grows by the bytes copied out of the files (in
    the stored dtype), ``files`` lists the files opened. A missing or unexpected tensor, a shape
    other than the config's, a range outside the tensor, or a non-finite value is a
    ``HFCheckpointError`` naming the tensor."""
    names = hf_names(config)
    specs = param_specs(config)
    files = checkpoint_files(path)
    _check_names(path, files, names, config.tie_embeddings)
    by_file: dict[str, list[tuple[str, Ranges]]] = {}
    for name, ranges in wanted.items():
        if name not in names:
            raise HFCheckpointError(f"wanted tensor {name} is not a parameter of the model")
        if ranges is not None:
            _check_ranges(name, ranges, specs[name].shape)
            by_file.setdefault(files[names[name]], []).append((name, tuple(ranges)))
    dtype = getattr(torch, config.dtype)
    out, read, opened = {}, 0, []
    for file in sorted(by_file):
        with _open(file) as f:
            opened.append(os.path.basename(file))
            for name, ranges in by_file[file]:
                tensor = _read(f, file, names[name], ranges, specs[name].shape)
                read += tensor.numel() * tensor.element_size()
                value = tensor.to(dtype).contiguous()
                if not bool(torch.isfinite(value).all()):
                    raise HFCheckpointError(f"{file}: tensor {names[name]} holds non-finite "
                                            f"values in {list(ranges)}")
                out[name] = value
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + read
        stats.setdefault("files", []).extend(opened)
    return out


def _check_ranges(name: str, ranges, shape) -> None:
    ok = len(ranges) == len(shape) and all(
        len(r) == 2 and 0 <= r[0] <= r[1] <= n for r, n in zip(ranges, shape))
    if not ok:
        raise HFCheckpointError(f"wanted ranges {ranges} of tensor {name} do not fit its shape "
                                f"{tuple(shape)}")


def _read(f, file: str, hf: str, ranges: Ranges, shape) -> torch.Tensor:
    try:
        view = f.get_slice(hf)
        stored = tuple(view.get_shape())
        if stored != tuple(shape):
            raise HFCheckpointError(f"{file}: tensor {hf} has shape {stored}; the config says "
                                    f"{tuple(shape)}")
        tensor = view[tuple(slice(lo, hi) for lo, hi in ranges)]
    except SafetensorError as exc:
        raise HFCheckpointError(f"{file}: cannot read tensor {hf}: {exc}") from None
    if not tensor.is_floating_point():
        raise HFCheckpointError(f"{file}: tensor {hf} has dtype {tensor.dtype}; weights must be "
                                "floating point")
    return tensor


def local_param_ranges(config: ModelConfig, plan: Plan, rank: int) -> dict[str, Ranges]:
    """The index ranges of every parameter ``rank`` holds under ``plan`` (its annotations)."""
    specs = state_specs(config, plan)
    out = {}
    for name in param_specs(config):
        ranges = specs[name].annotation.local_slices(rank, specs[name].shape)
        if ranges is not None:
            out[name] = tuple(ranges)
    return out


def initial_state_from_hf(path: str, config: ModelConfig, plan: Plan, rank: int,
                          stats: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """``rank``'s local training state under ``plan``, starting from the checkpoint at ``path``:
    its parameter slices (only those are read), zero AdamW moments and step 0, named as
    ``SpecializedModel.state_tensors`` names them (``build(..., state=...)`` binds it)."""
    plan.check_model(config)
    plan.locate(rank)  # a rank the plan does not use is a PlanError naming it
    state: dict[str, torch.Tensor] = {}
    shapes = local_shapes(config, plan, rank)  # moments: the owned rows with uneven shards
    for name, value in load_shards(path, config, local_param_ranges(config, plan, rank),
                                   stats).items():
        state[name] = value
        state[name + EXP_AVG] = value.new_zeros(shapes[name + EXP_AVG])
        state[name + EXP_AVG_SQ] = value.new_zeros(shapes[name + EXP_AVG_SQ])
    state[STEP] = torch.zeros((), dtype=torch.int64)
    return state


def write_initial_checkpoint(path: str, config: ModelConfig, checkpoint_dir: str, *,
                             timeout_s: float = 600.0) -> int:
    """Write the checkpoint at ``path`` as the project's checkpoint of step 0 under
    ``checkpoint_dir`` (one shard holding every tensor: the state of a one-device plan), and
    return 0. ``runtime.run(..., checkpoint_dir=checkpoint_dir)`` then starts from these
    weights under any plan: the first switch finds nobody holding state and reads each rank's
    own slices of the newest complete checkpoint. Refused when ``checkpoint_dir`` already holds
    a complete checkpoint (the newest one wins, so step 0 would be ignored or replaced)."""
    existing = latest_complete(checkpoint_dir)
    if existing >= 0:
        raise HFCheckpointError(f"{checkpoint_dir} already holds the checkpoint of step "
                                f"{existing}; write the initial checkpoint to an empty directory")
    plan = simple_plan(num_layers=config.num_layers, global_batch=1)
    state = initial_state_from_hf(path, config, plan, 0)
    writer = CheckpointWriter(checkpoint_dir, every=1, keep=0)
    writer.submit(0, config, plan, 0, state)
    if not writer.flush(timeout_s):
        raise HFCheckpointError(f"writing the initial checkpoint to {checkpoint_dir} took longer "
                                f"than {timeout_s:g}s")
    if writer.errors:
        raise HFCheckpointError(writer.errors[0])
    return 0
