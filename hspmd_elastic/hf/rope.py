"""RoPE fields of a Hugging Face ``config.json`` as ``ModelConfig.rope_scaling``, and back. Pure.

Two forms name the same thing: ``rope_scaling`` (transformers 4: ``{"rope_type" or "type":
kind, "factor": ...}`` with ``rope_theta`` at the top) and ``rope_parameters`` (transformers 5:
the same keys plus ``rope_theta``). Either, or both when they agree, is read; ``rope_type``
``default`` (or no field) is plain RoPE. Supported kinds are ``graph.config.ROPE_KINDS``
(``linear``, ``dynamic``, ``yarn``, ``llama3``), with transformers' defaults filled in where the
file may leave a key out:

* ``original_max_position_embeddings`` (``yarn``, ``llama3``): default ``max_position_embeddings``,
  as transformers' ``standardize_rope_params`` sets it;
* ``dynamic``: transformers scales from ``max_position_embeddings``; it becomes
  ``original_max_position_embeddings`` here, and is written back as ``max_position_embeddings``;
* ``yarn`` without ``factor``: ``max_position_embeddings / original_max_position_embeddings``.

Anything else (another kind, an unknown key such as ``partial_rotary_factor``, a bad value) is a
one-line ``HFConfigError`` naming the field and the key.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from hspmd_elastic.graph.config import ROPE_KINDS, ModelConfig, ModelConfigError, \
    check_rope_scaling
from hspmd_elastic.hf.api import HFConfigError

FIELDS = ("rope_scaling", "rope_parameters")
_ORIGINAL = "original_max_position_embeddings"


def _one(cfg: dict, field: str, where: str) -> Optional[dict]:
    """The scaling one field names (None: absent, null or ``default``), with defaults filled."""
    value = cfg.get(field)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise HFConfigError(f"{where}: field {field}={json.dumps(value)} must be an object or "
                            "null")
    if "type" in value and "rope_type" in value and value["type"] != value["rope_type"]:
        raise HFConfigError(f"{where}: field {field} has type={value['type']!r} and "
                            f"rope_type={value['rope_type']!r}, which differ")
    kind = value.get("rope_type", value.get("type", "default"))
    params = {k: v for k, v in value.items() if k not in ("rope_type", "type", "rope_theta")}
    if kind == "default":
        if params:
            key = sorted(params)[0]
            raise HFConfigError(f"{where}: field {field}.{key}={json.dumps(params[key])} is not "
                                "understood with rope_type default (plain RoPE)")
        return None
    if kind not in ROPE_KINDS:
        raise HFConfigError(f"{where}: field {field}.rope_type={json.dumps(kind)} is not "
                            f"supported; supported: default, {', '.join(sorted(ROPE_KINDS))}")
    max_pos = cfg.get("max_position_embeddings")
    if kind == "dynamic":
        if _ORIGINAL in params:
            raise HFConfigError(f"{where}: field {field}.{_ORIGINAL} is not understood with "
                                "rope_type dynamic (transformers scales from "
                                "max_position_embeddings)")
        if type(max_pos) is not int:
            raise HFConfigError(f"{where}: field max_position_embeddings={max_pos!r} must be an "
                                "integer: rope_type dynamic scales from it")
        params[_ORIGINAL] = max_pos
    elif kind in ("yarn", "llama3") and params.get(_ORIGINAL) is None and type(max_pos) is int:
        params[_ORIGINAL] = max_pos
    if kind == "yarn" and params.get("factor") is None and type(max_pos) is int \
            and isinstance(params.get(_ORIGINAL), int) and params[_ORIGINAL] > 0:
        params["factor"] = max_pos / params[_ORIGINAL]
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in params and params[key] is None:  # transformers reads null as the default
            del params[key]
    return {"rope_type": kind, **params}


def rope_from_hf(cfg: dict, where: str) -> Optional[tuple]:
    """``ModelConfig.rope_scaling`` of a ``config.json`` (None: plain RoPE)."""
    found = {field: _one(cfg, field, where) for field in FIELDS}
    given = {field: v for field, v in found.items() if v is not None}
    if len(given) == 2 and given["rope_scaling"] != given["rope_parameters"]:
        raise HFConfigError(f"{where}: fields rope_scaling={json.dumps(cfg['rope_scaling'])} and "
                            f"rope_parameters={json.dumps(cfg['rope_parameters'])} differ")
    if not given:
        return None
    field, value = next(iter(given.items()))
    try:
        return check_rope_scaling(value, cfg["hidden_size"] // cfg["num_attention_heads"])
    except ModelConfigError as exc:  # "rope_scaling (kind): what": name the file's field
        what = str(exc).removeprefix("rope_scaling").lstrip(": ")
        raise HFConfigError(f"{where}: field {field} {what}") from None


def is_dynamic(cfg: dict) -> bool:
    """Whether ``cfg`` asks for dynamic NTK scaling (then ``seq_len`` may exceed
    ``max_position_embeddings``: the scaling is what extends it)."""
    return any(isinstance(cfg.get(f), dict) and cfg[f].get("rope_type", cfg[f].get("type"))
               == "dynamic" for f in FIELDS)


def rope_to_hf(config: ModelConfig, out: dict) -> None:
    """Write ``config``'s RoPE into ``out`` (a ``config.json`` being built): ``rope_parameters``
    when ``out`` already has that form (a transformers 5 source), else ``rope_theta`` with
    ``rope_scaling``."""
    scaling: Optional[dict[str, Any]] = None
    if config.rope_scaling is not None:
        scaling = dict(config.rope_scaling)
        if config.rope_kind == "dynamic":
            out["max_position_embeddings"] = scaling.pop(_ORIGINAL)
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {**(scaling or {"rope_type": "default"}),
                                  "rope_theta": config.rope_theta}
        out.pop("rope_theta", None)
        out.pop("rope_scaling", None)
    else:
        out["rope_theta"] = config.rope_theta
        out["rope_scaling"] = scaling
