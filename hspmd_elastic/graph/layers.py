"""Tensor-parallel layers over one TP group.

Activations between layers are duplicated across the TP group. The layers keep that invariant:

* ``enter_tp`` (identity forward, all-reduce backward) marks where a duplicated activation feeds
  sharded weights, so the input gradient, partial on each rank, is summed back to a duplicate;
* ``ColumnParallelLinear`` holds a slice of the output features; its output is sharded;
* ``RowParallelLinear`` holds a slice of the input features and all-reduces its partial output;
* ``VocabParallelEmbedding`` holds a slice of the vocabulary and all-reduces the looked-up rows;
* ``vocab_parallel_cross_entropy`` takes the LM head's vocabulary-sharded logits and computes the
  token losses with three all-reduces of one value per token (max, sum of exponentials, target
  logit) instead of gathering full-vocabulary logits; its backward needs no communication.

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

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t if self.size == 1 else self.comm.all_reduce(t, self.devices, op)

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


def enter_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _EnterTP.apply(x, tp)


def reduce_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceTP.apply(x, tp)


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Values come from the initialiser or from received shards, never from here.
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W [out, in] split along out; the input must have entered the TP region.

    ``parts``: the number of slices of out (default the TP degree); fewer than the TP degree
    means each slice is replicated on adjacent TP ranks (the key/value heads of grouped-query
    attention when the TP degree exceeds their number)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *,
                 dtype: torch.dtype = torch.float64, parts: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _empty(out_features // (parts or tp.size), in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Token cross-entropies from logits sharded along the vocabulary (Megatron's scheme).

    loss = log(sum_v exp(z_v - m)) - (z_t - m), m the global max: every rank reduces its shard
    to one value per token, and the TP group sums (or maxes) those. The gradient of the shard,
    softmax(z) - onehot(t) restricted to the shard's columns, uses only these reduced values."""

    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_start):
        ctx.dtype = logits.dtype
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        width = logits.shape[-1]
        top = tp.all_reduce(logits.max(dim=-1).values.detach().clone(), op="max")
        shifted = logits - top.unsqueeze(-1)
        local = targets - vocab_start
        mine = (local >= 0) & (local < width)
        local = torch.where(mine, local, torch.zeros_like(local))
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        # one buffer, one all-reduce for both sums
        exp = shifted.exp()
        sums = tp.all_reduce(torch.stack([exp.sum(dim=-1), target_logit]))
        sum_exp, target_logit = sums[0], sums[1]
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax over the whole vocabulary, this shard
        ctx.save_for_backward(exp, local, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                                 vocab_start: int) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``targets``) of logits whose last dim holds vocabulary
    columns ``[vocab_start, vocab_start + width)``; every TP rank gets the same losses. Low
    precision logits are reduced in float32."""
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_start)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; duplicated across the TP group."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
