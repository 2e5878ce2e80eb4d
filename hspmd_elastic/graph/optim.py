"""AdamW on local shards.

AdamW is elementwise, so running it on each rank's shard of a parameter, with the shard's own
moments, equals running it on the full tensor: by default the optimizer state is sharded exactly
like its parameter and shares its annotation. With ``owned`` (uneven optimizer shards,
``zero.py``) a parameter's moments cover only the rows ``[lo, hi)`` along ``dim`` of the local
shard that this rank owns, and only those rows are updated; ``staged_step`` then computes the
update out of place (the state is unchanged until ``commit``), so the owners can exchange the
new rows before anything changes. The step counter is one scalar, the same on every rank.
The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias-corrected moments), one
operation at a time over all local tensors with ``torch._foreach_*`` (on CUDA, multi-tensor
kernels: a handful of launches per step instead of several per parameter). Each operation is
the same elementwise arithmetic, in the same order, as the per-tensor form, so the results are
bitwise those of the per-tensor loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

# A parameter's owned local rows: (dim, lo, hi) of its local shard.
OwnedRows = tuple[int, int, int]


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class Staged:
    """An update computed but not applied: the step it makes, and per parameter the new owned
    rows and moments (``ShardedAdamW.commit`` applies it)."""

    step: int
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]


class ShardedAdamW:
    """AdamW over named local parameters; state tensors are exposed for resharding.

    ``owned``: per parameter, the local rows this rank updates (absent: the whole shard)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], config: AdamWConfig,
                 owned: Optional[Mapping[str, OwnedRows]] = None) -> None:
        self.params, self.config = params, config
        self.owned = dict(owned or {})
        self.exp_avg = {n: torch.zeros_like(self.own(n, p), memory_format=torch.contiguous_format)
                        for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(self.own(n, p),
                                               memory_format=torch.contiguous_format)
                           for n, p in params.items()}
        self.step_count = torch.zeros((), dtype=torch.int64)

    def own(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of ``tensor`` (shaped like parameter ``name``'s shard) this rank owns."""
        rows = self.owned.get(name)
        return tensor if rows is None else tensor.narrow(rows[0], rows[1], rows[2] - rows[1])

    def _grads(self, names: list[str]) -> list[torch.Tensor]:
        return [self.own(n, self.params[n].grad) if self.params[n].grad is not None
                else torch.zeros_like(self.own(n, self.params[n])) for n in names]

    @torch.no_grad()
    def step(self) -> None:
        """One update, in place."""
        self.step_count += 1
        names = list(self.params)
        self._adamw(int(self.step_count), [self.own(n, self.params[n].data) for n in names],
                    self._grads(names), [self.exp_avg[n] for n in names],
                    [self.exp_avg_sq[n] for n in names], in_place=True)

    @torch.no_grad()
    def staged_step(self) -> Staged:
        """The next update of the owned rows, out of place: no state changes (the same
        arithmetic as ``step``, into new tensors)."""
        names = list(self.params)
        t = int(self.step_count) + 1
        params, m, v = self._adamw(t, [self.own(n, self.params[n].data) for n in names],
                                   self._grads(names), [self.exp_avg[n] for n in names],
                                   [self.exp_avg_sq[n] for n in names], in_place=False)
        return Staged(t, dict(zip(names, params)), dict(zip(names, m)), dict(zip(names, v)))

    @torch.no_grad()
    def commit(self, staged: Staged) -> None:
        """Apply ``staged``: the owned rows are copied in, the new moments replace the old."""
        for n in self.params:
            self.own(n, self.params[n].data).copy_(staged.params[n])
        self.exp_avg.update(staged.exp_avg)
        self.exp_avg_sq.update(staged.exp_avg_sq)
        self.step_count.fill_(staged.step)

    def _adamw(self, t: int, params: list, grads: list, m: list, v: list, in_place: bool
               ) -> tuple[list, list, list]:
        lr, (b1, b2), eps, wd = (self.config.lr, self.config.betas, self.config.eps,
                                 self.config.weight_decay)
        bias1, bias2_sqrt = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
        if in_place:
            torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
        else:
            params = torch._foreach_mul(params, 1 - lr * wd)
            m = torch._foreach_lerp(m, grads, 1 - b1)
            v = torch._foreach_mul(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-lr / bias1)
        return params, m, v

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
