"""AdamW on local shards.

AdamW is elementwise, so running it on each rank's shard of a parameter, with the shard's own
moments, equals running it on the full tensor: the optimizer state is sharded exactly like its
parameter and shares its annotation. The step counter is one scalar, the same on every rank.
The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias-corrected moments), one
operation at a time over all local tensors with ``torch._foreach_*`` (on CUDA, multi-tensor
kernels: a handful of launches per step instead of several per parameter). Each operation is
the same elementwise arithmetic, in the same order, as the per-tensor form, so the results are
bitwise those of the per-tensor loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


class ShardedAdamW:
    """AdamW over named local parameters; state tensors are exposed for resharding."""

    def __init__(self, params: dict[str, torch.nn.Parameter], config: AdamWConfig) -> None:
        self.params, self.config = params, config
        self.exp_avg = {n: torch.zeros_like(p, memory_format=torch.contiguous_format)
                        for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p, memory_format=torch.contiguous_format)
                           for n, p in params.items()}
        self.step_count = torch.zeros((), dtype=torch.int64)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        t = int(self.step_count)
        lr, (b1, b2), eps, wd = (self.config.lr, self.config.betas, self.config.eps,
                                 self.config.weight_decay)
        bias1, bias2_sqrt = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
        names = list(self.params)
        params = [self.params[n].data for n in names]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in self.params.values()]
        m = [self.exp_avg[n] for n in names]
        v = [self.exp_avg_sq[n] for n in names]
        torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-lr / bias1)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
