"""``--hspmd-model``: what the leader plans for, as a planner ``ModelProfile``.

The value is a preset name (``llama-7b``), a JSON file or an inline JSON object (a
``ModelConfig`` or the profile's fields: ``planner.profile_from_dict``), or a Hugging Face
checkpoint directory (one holding ``config.json``): its config (``hf.config_from_hf``, which
refuses what the decoder cannot train) at the sequence length of ``--hspmd-seq-len``, which
``config.json`` does not hold. Bad values are a one-line ``ConfigError`` naming them.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from hspmd_elastic.graph.config import ModelConfigError
from hspmd_elastic.hf import config_from_hf
from hspmd_elastic.hf.api import CONFIG_FILE
from launcher.api import ConfigError



def _planner():
    """The planner package, imported on first use: it loads numpy and scipy, which
    ``hspmd-launch --help`` and most usage errors never need."""
    import hspmd_elastic.planner as planner  # startup

    return planner


def parse_model(value: str, seq_len: Optional[int] = None):
    """``--hspmd-model``: a preset name, a JSON file, an inline JSON object or a Hugging Face
    checkpoint directory (with ``seq_len``, ``--hspmd-seq-len``) -> ModelProfile."""
    planner = _planner()
    text = str(value).strip()
    valid = (f"use a JSON file, an inline JSON object or a preset ({', '.join(planner.PRESETS)}), or "
             "a Hugging Face checkpoint directory")
    if os.path.isdir(text):
        return _hf_profile(value, seq_len)
    if seq_len is not None:
        raise ConfigError(f"--hspmd-seq-len {seq_len} is only used with a Hugging Face "
                          f"checkpoint directory as --hspmd-model (not {value!r})")
    if text.lower() in planner.PRESETS:
        return planner.preset(text)
    try:
        if text.startswith("{"):
            data = json.loads(text)
        elif os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                data = json.load(f)
        else:
            raise ConfigError(f"invalid --hspmd-model value {value!r}: no such file; {valid}")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid --hspmd-model value {value!r}: not readable JSON "
                          f"({str(exc).splitlines()[0]})") from None
    try:
        return planner.profile_from_dict(data)
    except planner.PlannerError as exc:
        raise ConfigError(f"invalid --hspmd-model value {value!r}: {exc}") from None


def _hf_profile(value: str, seq_len: Optional[int]):
    """The profile of the Hugging Face checkpoint directory ``value`` trained at ``seq_len``."""
    if not os.path.isfile(os.path.join(value, CONFIG_FILE)):
        raise ConfigError(f"invalid --hspmd-model value {value!r}: a directory without "
                          f"{CONFIG_FILE} (a Hugging Face checkpoint directory holds one)")
    if seq_len is None:
        raise ConfigError(f"--hspmd-model {value!r} is a Hugging Face checkpoint directory: "
                          "give --hspmd-seq-len N (the training sequence length)")
    if seq_len < 1:
        raise ConfigError(f"invalid --hspmd-seq-len value {seq_len}: must be >= 1")
    try:
        config = config_from_hf(value, seq_len=seq_len)
        return _planner().profile_from_config(config, name=value)
    except ModelConfigError as exc:
        raise ConfigError(f"invalid --hspmd-model value {value!r}: {exc}") from None
