"""AdamW on local shards.

AdamW is elementwise, so running it on each rank's shard of a parameter, with the shard's own
moments, equals running it on the full tensor: the optimizer state is sharded exactly like its
parameter and shares its annotation. The step counter is one scalar, the same on every rank.
The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias-corrected moments).
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
        for name, p in self.params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
