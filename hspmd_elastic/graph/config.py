"""The model's shape and its parameter table: pure values, no torch.

``param_specs(config)`` is the single source of truth for parameter names, full shapes, which
layer owns each parameter and along which dimension tensor parallelism splits it. The parallel
layers, the initialiser, the plan's annotation derivation and the gradient synchroniser all read
this table, so they cannot disagree.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

# Layer indices for parameters outside the decoder blocks: the embedding lives with layer 0's
# stage (the first stage), the final norm and the LM head with the last layer's stage.
EMBED_LAYER = "embed"
HEAD_LAYER = "head"


class ModelConfigError(ValueError):
    """A model configuration that cannot describe a decoder (one line, naming the bad value)."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32
    hidden_size: int = 16
    num_heads: int = 2
    num_layers: int = 4
    ffn_size: int = 32
    seq_len: int = 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # dtype: parameters (the master weights), their gradients and the AdamW moments, hence every
    # state tensor a switch moves. compute_dtype: the matrix products of forward and backward
    # (torch.autocast); None computes in dtype. "bfloat16" is mixed precision: see model.py.
    dtype: str = "float64"
    compute_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_layers", "ffn_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "float64"):
            raise ModelConfigError(f"dtype={self.dtype!r}; valid: 'float32', 'float64'")
        valid = (self.dtype, "bfloat16") if self.dtype == "float32" else (self.dtype,)
        if self.compute_dtype is not None and self.compute_dtype not in valid:
            raise ModelConfigError(
                f"compute_dtype={self.compute_dtype!r} with dtype={self.dtype!r}; valid: "
                f"{', '.join(repr(v) for v in valid)} or None (bfloat16 needs float32 "
                "master weights)")

    @property
    def math_dtype(self) -> str:
        """The dtype the matrix products run in (``compute_dtype``, else ``dtype``)."""
        return self.compute_dtype or self.dtype

    @property
    def mixed_precision(self) -> bool:
        return self.math_dtype != self.dtype

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_json(self) -> str:
        data = asdict(self)
        if data["compute_dtype"] is None:  # configs without it read and write as before
            del data["compute_dtype"]
        return json.dumps({"schema": 1, **data}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"model config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.pop("schema", None) != 1:
            raise ModelConfigError("model config JSON must be an object carrying \"schema\": 1")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ModelConfigError(f"model config has unknown keys {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: full shape, owning layer, TP split dim (None: replicated in the TP group)."""

    name: str
    shape: tuple[int, ...]
    layer: object  # int decoder layer, EMBED_LAYER or HEAD_LAYER
    split_dim: Optional[int]


def layer_param_specs(config: ModelConfig, layer: int) -> list[ParamSpec]:
    h, f = config.hidden_size, config.ffn_size
    p = f"layers.{layer}."
    col, row = 0, 1  # weights are [out, in]: column-parallel splits out, row-parallel splits in
    return [
        ParamSpec(p + "attn_norm.weight", (h,), layer, None),
        ParamSpec(p + "attn.wq.weight", (h, h), layer, col),
        ParamSpec(p + "attn.wk.weight", (h, h), layer, col),
        ParamSpec(p + "attn.wv.weight", (h, h), layer, col),
        ParamSpec(p + "attn.wo.weight", (h, h), layer, row),
        ParamSpec(p + "mlp_norm.weight", (h,), layer, None),
        ParamSpec(p + "mlp.w_gate.weight", (f, h), layer, col),
        ParamSpec(p + "mlp.w_up.weight", (f, h), layer, col),
        ParamSpec(p + "mlp.w_down.weight", (h, f), layer, row),
    ]


def param_specs(config: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of the model, in a fixed order (embedding, layers, final norm, head)."""
    specs = [ParamSpec("embed.weight", (config.vocab_size, config.hidden_size), EMBED_LAYER, 0)]
    for layer in range(config.num_layers):
        specs.extend(layer_param_specs(config, layer))
    specs.append(ParamSpec("norm.weight", (config.hidden_size,), HEAD_LAYER, None))
    specs.append(ParamSpec("lm_head.weight", (config.vocab_size, config.hidden_size), HEAD_LAYER, 0))
    return {s.name: s for s in specs}


def resolve_layer(layer: object, num_layers: int) -> int:
    """The decoder layer whose stage holds a parameter of ``layer``."""
    if layer == EMBED_LAYER:
        return 0
    if layer == HEAD_LAYER:
        return num_layers - 1
    return int(layer)


def tp_divisibility(config: ModelConfig) -> dict[str, int]:
    """Sizes a TP degree must divide: heads (whole heads per rank), FFN width and vocabulary."""
    return {"num_heads": config.num_heads, "ffn_size": config.ffn_size,
            "vocab_size": config.vocab_size}
