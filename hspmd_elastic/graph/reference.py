"""The dense single-device semantics that every specialized graph must reproduce.

Written independently of the parallel layers, as plain functions of a dict of full parameters, and
trained with ``torch.optim.AdamW``: it is the oracle for the multi-process tests and a reading
aid for the model. Loss: mean token cross-entropy over the whole global batch.

It stays explicit where the model takes fast paths, so it checks them rather than sharing them:
attention is softmax(QK^T / sqrt(d)) V with a causal mask (the model: ``F.scaled_dot_product_
attention``), the loss is ``F.cross_entropy`` on full-vocabulary logits (the model: the
vocabulary-parallel cross-entropy under TP), and the optimizer is ``torch.optim.AdamW`` with its
per-tensor loop (the model: ``ShardedAdamW``'s foreach form).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.init import full_params
from hspmd_elastic.graph.optim import AdamWConfig


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, seq, config):
    d = config.head_dim
    freqs = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _layer(x, p, i, config):
    b, s, h = x.shape
    nh, hd = config.num_heads, config.head_dim
    pre = f"layers.{i}."
    y = _rms(x, p[pre + "attn_norm.weight"], config.norm_eps)
    q, k, v = (y @ p[pre + f"attn.{n}.weight"].T for n in ("wq", "wk", "wv"))
    q, k, v = (t.reshape(b, s, nh, hd).permute(0, 2, 1, 3) for t in (q, k, v))
    q, k = _rope(q, s, config), _rope(k, s, config)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool))
    scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
    att = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).permute(0, 2, 1, 3)
    x = x + att.reshape(b, s, h) @ p[pre + "attn.wo.weight"].T
    y = _rms(x, p[pre + "mlp_norm.weight"], config.norm_eps)
    gate, up = y @ p[pre + "mlp.w_gate.weight"].T, y @ p[pre + "mlp.w_up.weight"].T
    return x + (gate * torch.sigmoid(gate) * up) @ p[pre + "mlp.w_down.weight"].T


def reference_loss(params: dict, batch: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Mean cross-entropy of next-token prediction over ``batch`` [rows, seq+1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    x = params["embed.weight"][inputs]
    for i in range(config.num_layers):
        x = _layer(x, params, i, config)
    logits = _rms(x, params["norm.weight"], config.norm_eps) @ params["lm_head.weight"].T
    return F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))


def reference_train(config: ModelConfig, seed: int, batches: list, optim: AdamWConfig):
    """Train from the seed's initial weights on ``batches``; returns (params, losses)."""
    params = {k: v.clone().requires_grad_(True) for k, v in full_params(config, seed).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = reference_loss(params, batch, config)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in params.items()}, losses
