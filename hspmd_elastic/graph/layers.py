"""Tensor-parallel layers over one TP group.

Activations between layers are duplicated across the TP group. The layers keep that invariant:

* ``enter_tp`` (identity forward, all-reduce backward) marks where a duplicated activation feeds
  sharded weights, so the input gradient, partial on each rank, is summed back to a duplicate;
* ``ColumnParallelLinear`` holds a slice of the output features; its output is sharded, or
  all-gathered back to a duplicate (``gather_output``, used by the LM head);
* ``RowParallelLinear`` holds a slice of the input features and all-reduces its partial output;
* ``VocabParallelEmbedding`` holds a slice of the vocabulary and all-reduces the looked-up rows.

With TP degree 1 every collective is skipped and the layers are plain dense layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hspmd_elastic.graph.comm import Comm


@dataclass(frozen=True)
class TPGroup:
    """The TP group of one stage as seen from one of its ranks."""

    devices: tuple[int, ...]
    index: int  # this rank's TP rank (its position in ``devices``)
    comm: Comm | None  # None only when the group has one device

    @property
    def size(self) -> int:
        return len(self.devices)

    @classmethod
    def single(cls) -> "TPGroup":
        return cls((0,), 0, None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.size == 1 else self.comm.all_reduce(t, self.devices)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t] if self.size == 1 else self.comm.all_gather(t, self.devices)


class _EnterTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.width = tp, x.shape[-1]
        return torch.cat(tp.all_gather(x.contiguous()), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.tp.index * ctx.width
        return grad[..., lo:lo + ctx.width].contiguous(), None


def enter_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _EnterTP.apply(x, tp)


def reduce_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceTP.apply(x, tp)


def gather_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _GatherTP.apply(x, tp)


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Values come from the initialiser or from received shards, never from here.
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W [out, in] split along out; the input must have entered the TP region."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *,
                 gather_output: bool = False, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.weight = _empty(out_features // tp.size, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return gather_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T with W [out, in] split along in; x is sharded on its last dim, y duplicated."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _empty(out_features, in_features // tp.size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_tp(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows [index*V/tp, (index+1)*V/tp) of the embedding table; output duplicated."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup, *,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.tp = tp
        rows = vocab_size // tp.size
        self.lo, self.hi = tp.index * rows, (tp.index + 1) * rows
        self.weight = _empty(rows, dim, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        mine = (tokens >= self.lo) & (tokens < self.hi)
        local = torch.where(mine, tokens - self.lo, torch.zeros_like(tokens))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return reduce_tp(rows, self.tp)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; duplicated across the TP group."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
