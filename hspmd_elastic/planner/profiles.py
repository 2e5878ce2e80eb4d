"""Model profiles: named presets for the benchmark models and profiles of runnable configs.

Presets (``llama-7b``, ``llama-13b``, ``llama-32b``) use BF16 weights, FP32 Adam state (master
copy plus two moments: 12 bytes per parameter) and 4096-token sequences. The 32B shape is the
usual 60-layer, 6656-wide model, given 64 heads of 104 so TP 8 divides it.

``profile_from_config`` describes the project's own decoder (``graph.config.ModelConfig``): same
parameter table, weights, gradients and AdamW moments in the config's dtype, and eager attention
that keeps its score matrix for backward. Plans made from such a profile are checked against the
config.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.planner.api import ModelProfile, PlannerError

PRESETS: dict[str, ModelProfile] = {
    "llama-7b": ModelProfile("llama-7b", num_layers=32, hidden_size=4096, ffn_size=11008,
                             num_heads=32, vocab_size=32000, seq_len=4096),
    "llama-13b": ModelProfile("llama-13b", num_layers=40, hidden_size=5120, ffn_size=13824,
                              num_heads=40, vocab_size=32000, seq_len=4096),
    "llama-32b": ModelProfile("llama-32b", num_layers=60, hidden_size=6656, ffn_size=17920,
                              num_heads=64, vocab_size=32000, seq_len=4096),
}

_DTYPE_BYTES = {"float32": 4, "float64": 8}


def preset(name: str) -> ModelProfile:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise PlannerError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
                           "(or a JSON file)") from None


def profile_from_config(config: ModelConfig, name: str = "config") -> ModelProfile:
    dt = _DTYPE_BYTES[config.dtype]
    act = (17 * config.hidden_size + 3 * config.num_heads * config.seq_len) * dt
    return ModelProfile(name, num_layers=config.num_layers, hidden_size=config.hidden_size,
                        ffn_size=config.ffn_size, num_heads=config.num_heads,
                        vocab_size=config.vocab_size, seq_len=config.seq_len,
                        param_bytes=dt, grad_bytes=dt, optimizer_bytes=2 * dt,
                        activation_bytes=dt, activation_bytes_per_token_layer=act, config=config,
                        num_kv_heads=config.num_kv_heads, tie_embeddings=config.tie_embeddings)


_PROFILE_KEYS = {"name", "num_layers", "hidden_size", "ffn_size", "num_heads", "vocab_size",
                 "seq_len", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                 "activation_bytes_per_token_layer", "num_kv_heads", "tie_embeddings"}


_CONFIG_KEYS = set(ModelConfig.__dataclass_fields__)
_CONFIG_ONLY = sorted(_CONFIG_KEYS - _PROFILE_KEYS)  # rope_theta, norm_eps, init_std, dtype


def profile_from_dict(data: Any) -> ModelProfile:
    """A profile from JSON: ``{"preset": "llama-7b", ...overrides}``, a ``ModelConfig`` JSON,
    or the ``ModelProfile`` fields.

    A ``ModelConfig`` is recognised by ``"schema": 1`` (what ``ModelConfig.to_json`` writes) or,
    without it, by a key only a config has (``dtype``, ``rope_theta``, ``norm_eps``,
    ``init_std``); its other keys must then be config fields too."""
    if not isinstance(data, Mapping):
        raise PlannerError(f"model must be a JSON object, got {type(data).__name__}")
    data = dict(data)
    if "preset" in data:
        base = preset(data.pop("preset"))
        fields = {k: getattr(base, k) for k in _PROFILE_KEYS}
        fields["activation_bytes_per_token_layer"] = None
        return _build_profile({**fields, **data})
    marks = sorted(set(data) & set(_CONFIG_ONLY))
    if "schema" in data or marks:
        return _config_profile(data, marks)
    return _build_profile(data)


def _config_profile(data: dict, marks: list[str]) -> ModelProfile:
    """A ``ModelConfig`` JSON (``marks``: the config-only keys that told it apart)."""
    if data.get("schema", 1) != 1:
        raise PlannerError(f"model config: schema={data['schema']!r}; the only schema is 1")
    unknown = sorted(set(data) - _CONFIG_KEYS - {"schema"})
    if unknown:
        why = f" (a ModelConfig, by its keys {marks})" if "schema" not in data else ""
        raise PlannerError(f"model config{why}: unknown keys {unknown}; a ModelConfig has "
                           f"{sorted(_CONFIG_KEYS)}")
    try:
        return profile_from_config(ModelConfig.from_json(json.dumps(dict(data, schema=1))))
    except (TypeError, ValueError) as exc:
        raise PlannerError(f"model config: {exc}") from None


def _build_profile(fields: dict) -> ModelProfile:
    unknown = sorted(set(fields) - _PROFILE_KEYS)
    if unknown:
        raise PlannerError(f"model profile: unknown keys {unknown}; known: {sorted(_PROFILE_KEYS)}"
                           f" (a ModelConfig JSON carries \"schema\": 1 and {_CONFIG_ONLY})")
    fields.setdefault("name", "custom")
    try:
        return ModelProfile(**fields)
    except TypeError as exc:
        raise PlannerError(f"model profile: {exc}") from None
