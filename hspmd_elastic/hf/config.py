"""A Hugging Face Llama-family ``config.json`` as a ``ModelConfig``, and back. Pure: no torch.

Every field of the file is in exactly one of three tables, and a field in none is refused:

* ``_MAPPED``: fields that become ``ModelConfig`` fields (sizes, key/value heads, RoPE theta and
  scaling (``hf/rope.py``), tied embeddings, RMSNorm epsilon);
* ``_NEUTRAL``: fields that change the model unless they hold the value the decoder computes
  (no biases, SiLU, no dropout, ...); any other value is
  refused, naming the field, its value and what is supported;
* ``_IGNORED``: bookkeeping that does not change what is trained (token ids, cache and output
  switches, versions, names).

An unknown field is refused rather than ignored: a field we do not understand may change the
computation (a quantization config, a MoE router), and training silently on another model is the
one outcome worse than an error.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from hspmd_elastic.graph.config import ModelConfig, ModelConfigError
from hspmd_elastic.hf.api import CONFIG_FILE, HFConfigError
from hspmd_elastic.hf.rope import is_dynamic, rope_from_hf, rope_to_hf

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
STORAGE_DTYPES = ("float32", "float64", "bfloat16", "float16")
_DEFAULT_EPS = 1e-6  # transformers' LlamaConfig / MistralConfig defaults, used when a field is absent
_DEFAULT_THETA = 10000.0


def _is(value) -> Callable[[Any, dict, int], bool]:
    return lambda v, _cfg, _seq: v == value


# field -> (accepts(value, config, seq_len), what is supported): absent fields take the
# neutral value, as in transformers.
_NEUTRAL: dict[str, tuple[Callable[[Any, dict, int], bool], str]] = {
    "head_dim": (lambda v, c, _s: v is None or (type(v) is int and v * c.get(
        "num_attention_heads", 0) == c.get("hidden_size")), "null or hidden_size / num_attention_heads"),
    "hidden_act": (_is("silu"), "\"silu\" (the gated SiLU MLP)"),
    "attention_bias": (_is(False), "false (projections have no bias)"),
    "mlp_bias": (_is(False), "false (projections have no bias)"),
    "attention_dropout": (lambda v, _c, _s: v in (0, 0.0), "0.0 (no dropout)"),
    "sliding_window": (lambda v, _c, s: v is None or (isinstance(v, int) and v >= s),
                       "null or >= seq_len (then every position attends to the whole "
                       "training window, as the decoder does)"),
    "is_encoder_decoder": (_is(False), "false"),
    "add_cross_attention": (_is(False), "false"),
    "pruned_heads": (lambda v, _c, _s: not v, "empty"),
    # transformers (< 5) splits its matmuls into this many slices: the same function.
    "pretraining_tp": (lambda v, _c, _s: isinstance(v, int) and v >= 1, "an integer >= 1"),
}

_MAPPED = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "num_hidden_layers", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
           "initializer_range", "torch_dtype", "dtype", "architectures", "model_type",
           "tie_word_embeddings", "rope_scaling", "rope_parameters")

_IGNORED = frozenset({
    "_name_or_path", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "use_bfloat16", "tokenizer_class",
    "id2label", "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "chunk_size_feed_forward", "is_decoder", "tie_encoder_decoder", "max_length", "min_length",
    "do_sample", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "early_stopping", "num_return_sequences",
    "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "output_scores", "return_dict_in_generate",
})

_REQUIRED_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                  "intermediate_size")


def read_hf_config(path: str) -> dict:
    """The JSON object of ``path`` (a checkpoint directory or its ``config.json``)."""
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = json.load(f)
    except OSError as exc:
        raise HFConfigError(f"cannot read {file}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HFConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} must hold a JSON object, not {type(data).__name__}")
    return data


def config_from_hf(path_or_dict, *, seq_len: int, dtype: Optional[str] = None) -> ModelConfig:
    """The ``ModelConfig`` of a Llama / Mistral ``config.json`` (a checkpoint directory, the file,
    or its parsed dict); refuses, in one line naming it, any field the decoder cannot honour.

    ``seq_len`` is a training choice, not part of the checkpoint: the rows the sampler yields
    have ``seq_len + 1`` tokens. It must not exceed ``max_position_embeddings`` (the positions
    the checkpoint was trained for), except with dynamic NTK RoPE scaling, which is what extends
    the context beyond it (``hf/rope.py``). ``dtype`` is the training dtype; by default the
    checkpoint's own when ``ModelConfig`` supports it, else float32 (bfloat16 and float16
    weights widen to it exactly)."""
    cfg = path_or_dict if isinstance(path_or_dict, dict) else read_hf_config(path_or_dict)
    where = "config" if isinstance(path_or_dict, dict) else str(path_or_dict)
    _check_architecture(cfg, where)
    for name in _REQUIRED_INTS:
        value = cfg.get(name)
        if type(value) is not int or value < 1:
            raise HFConfigError(f"{where}: field {name}={value!r} must be a positive integer")
    unknown = sorted(set(cfg) - set(_MAPPED) - set(_NEUTRAL) - _IGNORED)
    if unknown:
        raise HFConfigError(f"{where}: field {unknown[0]}={cfg[unknown[0]]!r} is not understood "
                            f"(a field that may change the model is refused, not ignored)"
                            + (f"; also {unknown[1:]}" if len(unknown) > 1 else ""))
    if not isinstance(seq_len, int) or seq_len < 1:
        raise HFConfigError(f"seq_len={seq_len!r} must be a positive integer")
    for name, (accepts, supported) in _NEUTRAL.items():
        if name in cfg and not accepts(cfg[name], cfg, seq_len):
            raise HFConfigError(f"{where}: field {name}={json.dumps(cfg[name])} is not "
                                f"supported; supported: {supported}")
    rope_scaling = rope_from_hf(cfg, where)
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and (type(max_pos) is not int
                                or (seq_len > max_pos and not is_dynamic(cfg))):
        raise HFConfigError(f"{where}: seq_len={seq_len} exceeds field "
                            f"max_position_embeddings={max_pos!r}")
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise HFConfigError(f"{where}: field tie_word_embeddings={json.dumps(tied)} must be "
                            "true or false")
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=_kv_heads(cfg, where),
        num_layers=cfg["num_hidden_layers"],
        ffn_size=cfg["intermediate_size"], seq_len=seq_len, rope_theta=_rope_theta(cfg, where),
        norm_eps=_positive(cfg, "rms_norm_eps", _DEFAULT_EPS, where),
        init_std=_positive(cfg, "initializer_range", ModelConfig.init_std, where),
        dtype=dtype or _training_dtype(storage_dtype(cfg, where)),
        rope_scaling=rope_scaling, tie_embeddings=tied)


def _check_architecture(cfg: dict, where: str) -> None:
    archs = cfg.get("architectures")
    model_type = cfg.get("model_type")
    if archs is not None and (not isinstance(archs, list) or len(archs) != 1
                              or archs[0] not in ARCHITECTURES):
        raise HFConfigError(f"{where}: field architectures={json.dumps(archs)} is not supported; "
                            f"supported: one of {sorted(ARCHITECTURES)}")
    if model_type not in ARCHITECTURES.values() or (archs and ARCHITECTURES[archs[0]]
                                                    != model_type):
        raise HFConfigError(f"{where}: field model_type={json.dumps(model_type)} is not "
                            f"supported; supported: {sorted(set(ARCHITECTURES.values()))} "
                            "(matching architectures)")


def _kv_heads(cfg: dict, where: str) -> Optional[int]:
    """``num_key_value_heads`` as ``ModelConfig.num_kv_heads``: None (multi-head attention) when
    absent, null or ``num_attention_heads``; else a positive divisor of ``num_attention_heads``
    (grouped-query attention)."""
    value, heads = cfg.get("num_key_value_heads"), cfg["num_attention_heads"]
    if value is None or value == heads:
        return None
    if type(value) is not int or value < 1 or heads % value:
        raise HFConfigError(f"{where}: field num_key_value_heads={json.dumps(value)} is not "
                            f"supported; supported: a positive divisor of "
                            f"num_attention_heads={heads}")
    return value


def _rope_theta(cfg: dict, where: str) -> float:
    thetas = {float(v) for v in (cfg.get("rope_theta"),
                                 (cfg.get("rope_parameters") or {}).get("rope_theta"),
                                 (cfg.get("rope_scaling") or {}).get("rope_theta"))
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if len(thetas) > 1:
        raise HFConfigError(f"{where}: field rope_theta is given twice with different values "
                            f"{sorted(thetas)}")
    theta = thetas.pop() if thetas else _DEFAULT_THETA
    if theta <= 0:
        raise HFConfigError(f"{where}: field rope_theta={theta} must be > 0")
    return theta


def _positive(cfg: dict, name: str, default: float, where: str) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise HFConfigError(f"{where}: field {name}={value!r} must be a positive number")
    return float(value)


def storage_dtype(cfg: dict, where: str = "config") -> str:
    """The dtype the checkpoint's weights are stored in (``dtype``, or ``torch_dtype`` before
    transformers 5; float32 when neither is given)."""
    given = {k: cfg[k] for k in ("dtype", "torch_dtype") if cfg.get(k) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise HFConfigError(f"{where}: fields dtype={given['dtype']!r} and "
                            f"torch_dtype={given['torch_dtype']!r} differ")
    name, value = next(iter(given.items()), ("dtype", "float32"))
    if value not in STORAGE_DTYPES:
        raise HFConfigError(f"{where}: field {name}={value!r} is not supported; supported: "
                            f"one of {list(STORAGE_DTYPES)}")
    return value


def _training_dtype(stored: str) -> str:
    try:
        return ModelConfig(dtype=stored).dtype
    except ModelConfigError:
        return "float32"


def config_to_hf(config: ModelConfig, *, dtype: Optional[str] = None,
                 like: Optional[dict] = None) -> dict:
    """The ``config.json`` of ``config`` as a ``LlamaForCausalLM`` (weights stored in ``dtype``,
    default ``config.dtype``). ``like``: a source checkpoint's ``config.json``, whose
    architecture, token ids, ``max_position_embeddings`` and other fields are kept; the fields
    ``ModelConfig`` owns are overwritten. Without it, ``max_position_embeddings`` is
    ``seq_len``."""
    dtype = dtype or config.dtype
    if dtype not in STORAGE_DTYPES:
        raise HFConfigError(f"dtype={dtype!r} is not supported; supported: one of "
                            f"{list(STORAGE_DTYPES)}")
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "rope_scaling": None,
        "max_position_embeddings": config.seq_len, "initializer_range": config.init_std}
    if like is not None:
        config_from_hf(like, seq_len=config.seq_len)  # only a supported source is carried over
        out.update({k: v for k, v in like.items() if k not in ("dtype", "torch_dtype")})
    out.update(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
               num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
               num_hidden_layers=config.num_layers, intermediate_size=config.ffn_size,
               head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
               tie_word_embeddings=config.tie_embeddings)
    rope_to_hf(config, out)  # the source's form: rope_parameters (transformers 5) or rope_scaling
    # transformers 5 reads `dtype`, older releases `torch_dtype`.
    out["dtype" if like is not None and "dtype" in like else "torch_dtype"] = dtype
    return out
