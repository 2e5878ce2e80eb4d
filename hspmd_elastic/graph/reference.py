"""The dense single-device semantics that every specialized graph must reproduce.

Written independently of the parallel layers, as plain functions of a dict of full parameters, and
trained with ``torch.optim.AdamW``: it is the oracle for the multi-process tests and a reading
aid for the model. Loss: mean token cross-entropy over the whole global batch.

It stays explicit where the model takes fast paths, so it checks them rather than sharing them:
attention is softmax(QK^T / sqrt(d)) V with a causal mask, key/value heads expanded to the
query heads by an explicit index (the model: ``F.scaled_dot_product_attention`` after
``repeat_interleave``), the loss is ``F.cross_entropy`` on full-vocabulary logits (the model: the
vocabulary-parallel cross-entropy under TP), and the optimizer is ``torch.optim.AdamW`` with its
per-tensor loop (the model: ``ShardedAdamW``'s foreach form). RoPE frequencies are computed one
at a time in Python floats (the model: ``rope_frequencies``' tensor form); with tied embeddings
the logits use ``embed.weight``, and ``reference_train`` trains that one tensor.

Placement: every table it builds (RoPE angles, the causal mask, the key/value head index) is
made on the device of the activations, so it runs where its parameters and batch are (CUDA
included). It is an oracle, not a baseline: ``scripts/bench_step --mfu`` measures the step
against transformers' ``LlamaForCausalLM``, not against this.
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


def _rope_frequency(i, config):
    """Frequency ``i`` of ``head_dim / 2``, one at a time in Python floats (the scaling kinds of
    transformers' ``modeling_rope_utils``; ``dynamic`` for rows of ``config.seq_len`` tokens)."""
    d, kind, a = config.head_dim, config.rope_kind, config.rope_args
    theta = config.rope_theta
    if kind == "dynamic":
        old = a["original_max_position_embeddings"]
        grown = a["factor"] * max(config.seq_len, old) / old - a["factor"] + 1
        theta = theta * grown ** (d / (d - 2))
    f = 1.0 / theta ** (2 * i / d)
    if kind == "linear":
        return f / a["factor"]
    if kind == "llama3":
        old, wavelength = a["original_max_position_embeddings"], 2 * math.pi / f
        low, high = a["low_freq_factor"], a["high_freq_factor"]
        if wavelength < old / high:
            return f
        if wavelength > old / low:
            return f / a["factor"]
        t = (old / wavelength - low) / (high - low)
        return (1 - t) * f / a["factor"] + t * f
    if kind == "yarn":
        old = a["original_max_position_embeddings"]
        # the dims that turn beta_fast and beta_slow times over the original context
        bounds = [d * math.log(old / (beta * 2 * math.pi)) / (2 * math.log(theta))
                  for beta in (a.get("beta_fast", 32.0), a.get("beta_slow", 1.0))]
        if a.get("truncate", True):
            bounds = [math.floor(bounds[0]), math.ceil(bounds[1])]
        lo, hi = max(bounds[0], 0), min(bounds[1], d - 1)
        hi = hi + 0.001 if hi == lo else hi
        interpolated = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        return interpolated * f / a["factor"] + (1 - interpolated) * f
    return f


def _rope_scale(config):
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    a = config.rope_args
    if config.rope_kind != "yarn":
        return 1.0
    if "attention_factor" in a:
        return a["attention_factor"]

    def m(k):
        return 1.0 if a["factor"] <= 1 else 0.1 * k * math.log(a["factor"]) + 1

    if "mscale" in a and "mscale_all_dim" in a:
        return m(a["mscale"]) / m(a["mscale_all_dim"])
    return m(1.0)


def _rope(x, seq, config):
    d = config.head_dim
    freqs = torch.tensor([_rope_frequency(i, config) for i in range(d // 2)],
                         dtype=torch.float64, device=x.device)
    ang = torch.arange(seq, dtype=torch.float64, device=x.device)[:, None] * freqs[None, :]
    scale = _rope_scale(config)
    cos, sin = (torch.cos(ang) * scale).to(x.dtype), (torch.sin(ang) * scale).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _layer(x, p, i, config, segments=None):
    b, s, h = x.shape
    nh, kv, hd = config.num_heads, config.kv_heads, config.head_dim
    pre = f"layers.{i}."
    y = _rms(x, p[pre + "attn_norm.weight"], config.norm_eps)
    q, k, v = (y @ p[pre + f"attn.{n}.weight"].T for n in ("wq", "wk", "wv"))
    q = q.reshape(b, s, nh, hd).permute(0, 2, 1, 3)
    k, v = (t.reshape(b, s, kv, hd).permute(0, 2, 1, 3) for t in (k, v))
    q, k = _rope(q, s, config), _rope(k, s, config)
    # grouped-query attention: query head j reads key/value head j // (nh / kv)
    kv_of = torch.tensor([j * kv // nh for j in range(nh)], device=x.device)
    k, v = k[:, kv_of], v[:, kv_of]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
    if segments is not None:  # packed documents: a token sees only its own document
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
    att = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).permute(0, 2, 1, 3)
    x = x + att.reshape(b, s, h) @ p[pre + "attn.wo.weight"].T
    y = _rms(x, p[pre + "mlp_norm.weight"], config.norm_eps)
    gate, up = y @ p[pre + "mlp.w_gate.weight"].T, y @ p[pre + "mlp.w_up.weight"].T
    return x + (gate * torch.sigmoid(gate) * up) @ p[pre + "mlp.w_down.weight"].T


def reference_loss(params: dict, batch: torch.Tensor, config: ModelConfig,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of next-token prediction over ``batch`` [rows, seq+1]. With
    ``segments`` (the rows' segment ids, 0: padding) the rows pack documents: attention stays
    inside each document, and the mean is over the targets that continue a real document."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    seg = None if segments is None else segments[:, :-1]
    x = params["embed.weight"][inputs]
    for i in range(config.num_layers):
        x = _layer(x, params, i, config, seg)
    head = params["embed.weight" if config.tie_embeddings else "lm_head.weight"]
    logits = _rms(x, params["norm.weight"], config.norm_eps) @ head.T
    if segments is None:
        return F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    counts = ((segments[:, 1:] == seg) & (seg > 0)).reshape(-1)
    losses = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1),
                             reduction="none")
    return losses[counts].sum() / counts.sum()


def reference_train(config: ModelConfig, seed: int, batches: list, optim: AdamWConfig,
                    segments: list | None = None):
    """Train from the seed's initial weights on ``batches`` (with ``segments``: each batch's
    segment ids, packed documents); returns (params, losses)."""
    params = {k: v.clone().requires_grad_(True) for k, v in full_params(config, seed).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    losses = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        loss = reference_loss(params, batch, config, None if segments is None else segments[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in params.items()}, losses
