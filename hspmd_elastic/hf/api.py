"""The errors and file names of Hugging Face checkpoint support. Pure: no torch."""

from __future__ import annotations

from hspmd_elastic.graph.config import ModelConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' own default for save_pretrained's max_shard_size ("5GB").
DEFAULT_SHARD_BYTES = 5 * 10**9


class HFConfigError(ModelConfigError):
    """A ``config.json`` the decoder cannot train (one line, naming the field and its value)."""


class HFCheckpointError(ValueError):
    """Checkpoint files that cannot be read or written as this model's weights (one line,
    naming the file or tensor)."""
