"""The model's shape and its parameter table: pure values, no torch.

``param_specs(config)`` is the single source of truth for parameter names, full shapes, which
layer owns each parameter and along which dimension tensor parallelism splits it. The parallel
layers, the initialiser, the plan's annotation derivation and the gradient synchroniser all read
this table, so they cannot disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

# Layer indices for parameters outside the decoder blocks: the embedding lives with layer 0's
# stage (the first stage), the final norm and the LM head with the last layer's stage.
EMBED_LAYER = "embed"
HEAD_LAYER = "head"
# With tied embeddings the one table (embed.weight) is used by the first stage (lookup) and the
# last stage (LM head): both hold it (``holding_layers``).
TIED_LAYER = "tied"


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
    # Grouped-query attention: the number of key/value heads (None: num_heads, i.e. multi-head
    # attention). Query head j attends with key/value head j // (num_heads / num_kv_heads).
    num_kv_heads: Optional[int] = None
    # RoPE scaling (``ROPE_KINDS``): None is plain RoPE; else its kind and parameters as sorted
    # (key, value) pairs, given as a dict or pairs (``{"rope_type": "linear", "factor": 2.0}``)
    # and written to JSON as an object. See ``check_rope_scaling`` and model.rope_tables.
    rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None
    # One table for the input embedding and the LM head (``embed.weight``; no lm_head.weight).
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_layers", "ffn_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        kv = self.num_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ModelConfigError(f"num_kv_heads={kv!r} must be an integer >= 1 (or None)")
        if kv is not None and self.num_heads % kv:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={kv}")
        object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling,
                                                                    self.head_dim))
        if not isinstance(self.tie_embeddings, bool):
            raise ModelConfigError(f"tie_embeddings={self.tie_embeddings!r} must be true or false")
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
    def rope_kind(self) -> str:
        """The RoPE kind: ``default`` (plain) or a ``rope_type`` of ``ROPE_KINDS``."""
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    @property
    def rope_args(self) -> dict:
        """The RoPE scaling parameters without ``rope_type`` (empty for plain RoPE)."""
        return {k: v for k, v in (self.rope_scaling or ()) if k != "rope_type"}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads (``num_kv_heads``, else ``num_heads``)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("compute_dtype", "num_kv_heads", "rope_scaling"):
            if data[key] is None:  # configs without it read and write as before
                del data[key]
        if "rope_scaling" in data:
            data["rope_scaling"] = dict(self.rope_scaling)
        if not self.tie_embeddings:
            del data["tie_embeddings"]
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


# RoPE scaling kinds, as transformers' ``modeling_rope_utils`` computes them: kind -> (required
# keys, optional keys). ``original_max_position_embeddings`` is the context length the scaling
# starts from (for ``dynamic``: a Hugging Face config's ``max_position_embeddings``).
ROPE_KINDS: dict[str, tuple[frozenset, frozenset]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                        "truncate"})),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings"}), frozenset()),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rope_scaling(value: Any, head_dim: int) -> Optional[tuple[tuple[str, Any], ...]]:
    """``value`` (None, a dict or (key, value) pairs with ``rope_type``) as sorted pairs, checked:
    a known kind, exactly its keys, sound values; else a one-line ``ModelConfigError`` naming
    the key. Numbers become floats, ``original_max_position_embeddings`` an int."""
    if value is None:
        return None
    try:
        data = dict(value)
    except (TypeError, ValueError):
        raise ModelConfigError(f"rope_scaling={value!r} must be an object with a rope_type, "
                               "or null") from None
    kind = data.get("rope_type")
    if kind not in ROPE_KINDS:
        raise ModelConfigError(f"rope_scaling: rope_type={kind!r} is not supported; supported: "
                               f"{', '.join(map(repr, sorted(ROPE_KINDS)))} (or null: plain RoPE)")
    required, optional = ROPE_KINDS[kind]
    where = f"rope_scaling ({kind})"
    missing = sorted(required - set(data))
    if missing:
        raise ModelConfigError(f"{where}: missing {missing[0]}; {kind} needs {sorted(required)}")
    unknown = sorted(set(data) - required - optional - {"rope_type"})
    if unknown:
        raise ModelConfigError(f"{where}: unknown key {unknown[0]}={data[unknown[0]]!r}; valid: "
                               f"{sorted(required | optional)}")
    out: dict[str, Any] = {"rope_type": kind}
    for key in sorted(set(data) - {"rope_type"}):
        v = data[key]
        if key == "original_max_position_embeddings":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"{where}: {key}={v!r} must be an integer >= 1")
        elif key == "truncate":
            if not isinstance(v, bool):
                raise ModelConfigError(f"{where}: truncate={v!r} must be true or false")
        elif not _number(v) or v < (1 if key == "factor" else 0) or (key != "factor" and v == 0):
            bound = ">= 1" if key == "factor" else "> 0"
            raise ModelConfigError(f"{where}: {key}={v!r} must be a number {bound}")
        out[key] = v if key in ("original_max_position_embeddings", "truncate") else float(v)
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ModelConfigError(f"{where}: high_freq_factor={out['high_freq_factor']} must be "
                               f"> low_freq_factor={out['low_freq_factor']}")
    if kind == "yarn" and out.get("beta_fast", 32.0) <= out.get("beta_slow", 1.0):
        raise ModelConfigError(f"{where}: beta_fast={out.get('beta_fast', 32.0)} must be > "
                               f"beta_slow={out.get('beta_slow', 1.0)}")
    if kind == "dynamic" and head_dim <= 2:
        raise ModelConfigError(f"{where}: head_dim={head_dim} must be > 2 (the base grows with "
                               "the power head_dim / (head_dim - 2))")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: full shape, owning layer, TP split dim (None: replicated in the TP group).

    ``blocks``: the split dim holds this many indivisible blocks (the key/value heads of
    ``wk`` / ``wv``), None: no such limit. A TP degree ``t`` then cuts it into
    ``split_count(t)`` parts: ``t`` when ``t`` divides ``blocks``; when ``blocks`` divides ``t``,
    ``blocks`` parts, each held by ``t / blocks`` adjacent TP ranks (replicated KV heads).
    """

    name: str
    shape: tuple[int, ...]
    layer: object  # int decoder layer, EMBED_LAYER, HEAD_LAYER or TIED_LAYER
    split_dim: Optional[int]
    blocks: Optional[int] = None

    def split_count(self, tp: int) -> int:
        """Parts the split dim is cut into under TP degree ``tp`` (1 when not split)."""
        if self.split_dim is None:
            return 1
        return tp if self.blocks is None else math.gcd(tp, self.blocks)


def layer_param_specs(config: ModelConfig, layer: int) -> list[ParamSpec]:
    h, f = config.hidden_size, config.ffn_size
    kv, kv_rows = config.kv_heads, config.kv_heads * config.head_dim
    p = f"layers.{layer}."
    col, row = 0, 1  # weights are [out, in]: column-parallel splits out, row-parallel splits in
    return [
        ParamSpec(p + "attn_norm.weight", (h,), layer, None),
        ParamSpec(p + "attn.wq.weight", (h, h), layer, col),
        ParamSpec(p + "attn.wk.weight", (kv_rows, h), layer, col, kv),
        ParamSpec(p + "attn.wv.weight", (kv_rows, h), layer, col, kv),
        ParamSpec(p + "attn.wo.weight", (h, h), layer, row),
        ParamSpec(p + "mlp_norm.weight", (h,), layer, None),
        ParamSpec(p + "mlp.w_gate.weight", (f, h), layer, col),
        ParamSpec(p + "mlp.w_up.weight", (f, h), layer, col),
        ParamSpec(p + "mlp.w_down.weight", (h, f), layer, row),
    ]


def param_specs(config: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of the model, in a fixed order (embedding, layers, final norm, head).

    With ``tie_embeddings`` there is no ``lm_head.weight``: ``embed.weight`` (layer
    ``TIED_LAYER``) is the LM head too, held by the first and the last stage."""
    embed = TIED_LAYER if config.tie_embeddings else EMBED_LAYER
    specs = [ParamSpec("embed.weight", (config.vocab_size, config.hidden_size), embed, 0)]
    for layer in range(config.num_layers):
        specs.extend(layer_param_specs(config, layer))
    specs.append(ParamSpec("norm.weight", (config.hidden_size,), HEAD_LAYER, None))
    if not config.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (config.vocab_size, config.hidden_size),
                               HEAD_LAYER, 0))
    return {s.name: s for s in specs}


def resolve_layer(layer: object, num_layers: int) -> int:
    """The decoder layer whose stage holds a parameter of ``layer`` (not ``TIED_LAYER``, which
    two stages may hold: ``holding_layers``)."""
    if layer == EMBED_LAYER:
        return 0
    if layer == HEAD_LAYER:
        return num_layers - 1
    if layer == TIED_LAYER:
        raise ValueError("a tied parameter is held by two stages; use holding_layers")
    return int(layer)


def holding_layers(layer: object, num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose stages hold a parameter of ``layer``: one, or for
    ``TIED_LAYER`` the first and the last (one when the model has a single layer)."""
    if layer == TIED_LAYER:
        return (0,) if num_layers == 1 else (0, num_layers - 1)
    return (resolve_layer(layer, num_layers),)


def tp_divisibility(config: ModelConfig) -> dict[str, int]:
    """Sizes a TP degree must divide: heads (whole heads per rank), FFN width and vocabulary.

    Not the whole rule under grouped-query attention: see ``tp_problem``."""
    return {"num_heads": config.num_heads, "ffn_size": config.ffn_size,
            "vocab_size": config.vocab_size}


def tp_problem(config: ModelConfig, tp: int) -> Optional[str]:
    """Why TP degree ``tp`` cannot run ``config`` (one line), or None when it can.

    ``tp`` must divide ``tp_divisibility``'s sizes, and either divide ``num_kv_heads`` (each
    rank holds whole key/value heads of its own) or be a multiple of it (each key/value head is
    replicated on ``tp / num_kv_heads`` adjacent ranks, one head per rank)."""
    for what, size in tp_divisibility(config).items():
        if size % tp:
            return f"TP degree {tp} does not divide {what}={size}"
    kv = config.kv_heads
    if kv % tp and tp % kv:
        return (f"TP degree {tp} neither divides nor is a multiple of num_kv_heads={kv} "
                "(each rank must hold whole key/value heads, or one replicated head)")
    return None


def tp_valid(config: ModelConfig, tp: int) -> bool:
    """True when TP degree ``tp`` can run ``config`` (``tp_problem`` finds nothing)."""
    return tp_problem(config, tp) is None
