"""Deterministic parameter initialisation, independent of the plan.

Every parameter's full value is a function of (seed, parameter name) only: norms start at one,
everything else is N(0, init_std) drawn from a generator seeded by the seed and the name. A rank
materialises the full tensor and keeps its shard (the ranges its annotation names), so any plan
starts from the same weights.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from hspmd_elastic.graph.config import ModelConfig, ParamSpec, param_specs


def full_param(spec: ParamSpec, config: ModelConfig, seed: int) -> torch.Tensor:
    dtype = getattr(torch, config.dtype)
    if len(spec.shape) == 1:
        return torch.ones(spec.shape, dtype=dtype)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    values = torch.randn(spec.shape, generator=gen, dtype=torch.float64) * config.init_std
    return values.to(dtype)


def local_part(full: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The half-open index ``ranges`` (one per dimension) of ``full``, as a copy: a rank's shard,
    with the ranges its annotation gives (``TensorAnnotation.local_slices``)."""
    return full[tuple(slice(lo, hi) for lo, hi in ranges)].clone()


def full_params(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return {name: full_param(spec, config, seed) for name, spec in param_specs(config).items()}
