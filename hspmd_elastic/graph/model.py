"""The one model definition: a Llama-style decoder written with the tensor-parallel layers.

``StageModule(config, layers, tp, first=..., last=...)`` builds any slice of the model for any TP
group: the embedding when it is the first stage, decoder layers ``[start, stop)``, and the final
norm with the LM head when it is the last stage. Parameter names are the global names of
``config.param_specs`` (``layers.3.attn.wq.weight``) whatever the slice, so the plan, the
initialiser and resharding all speak of the same tensors. Parameters are allocated empty; values
come from ``init.py`` or from received shards.

Attention is ``F.scaled_dot_product_attention`` (causal), which picks a fused kernel where the
device and dtype have one. The last stage returns its TP rank's vocabulary shard of the logits;
``token_loss_sum`` turns them into losses with ``vocab_parallel_cross_entropy``, so full-vocabulary
logits never exist under TP.

Precision (``ModelConfig.dtype`` / ``compute_dtype``): parameters, gradients and optimizer state
are in ``dtype`` (the master weights). With ``compute_dtype="bfloat16"`` the stage runs under
``torch.autocast`` (``compute_context``): matrix products and attention take bfloat16 copies of
their inputs and weights, while the residual stream, norms, the embedding lookup and the loss
stay in float32, so activations between stages and every gradient are float32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear,
                                        TPGroup, VocabParallelEmbedding, enter_tp,
                                        vocab_parallel_cross_entropy)


def torch_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype of parameters, gradients, optimizer state and inter-stage activations."""
    return getattr(torch, config.dtype)


def compute_context(config: ModelConfig, device: torch.device | str):
    """Where a forward pass runs: autocast to ``compute_dtype`` for mixed precision, else
    nothing (backward passes run outside it, in the dtypes their forward chose)."""
    if not config.mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, config.math_dtype))


def rope_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin, [seq_len, head_dim], for the rotate-half form of rotary embeddings."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; the tables are cast to x's dtype (bfloat16 under
    autocast)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention; each TP rank holds num_heads / tp whole heads."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        h, dt = config.hidden_size, torch_dtype(config)
        self.heads, self.head_dim = config.num_heads // tp.size, config.head_dim
        self.wq = ColumnParallelLinear(h, h, tp, dtype=dt)
        self.wk = ColumnParallelLinear(h, h, tp, dtype=dt)
        self.wv = ColumnParallelLinear(h, h, tp, dtype=dt)
        self.wo = RowParallelLinear(h, h, tp, dtype=dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

        q = apply_rope(heads(self.wq(x)), cos, sin)
        k = apply_rope(heads(self.wk(x)), cos, sin)
        v = heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.wo(out)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        h, f, dt = config.hidden_size, config.ffn_size, torch_dtype(config)
        self.w_gate = ColumnParallelLinear(h, f, tp, dtype=dt)
        self.w_up = ColumnParallelLinear(h, f, tp, dtype=dt)
        self.w_down = RowParallelLinear(f, h, tp, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        dt = torch_dtype(config)
        self.tp = tp
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=dt)
        self.attn = Attention(config, tp)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=dt)
        self.mlp = SwiGLU(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(enter_tp(self.attn_norm(x), self.tp), cos, sin)
        return x + self.mlp(enter_tp(self.mlp_norm(x), self.tp))


class StageModule(nn.Module):
    """Layers ``[start, stop)`` on one TP group, plus the embedding / head at the model's ends.

    Forward takes token ids on the first stage, hidden states [batch, seq, hidden] otherwise, and
    returns this TP rank's logits [batch, seq, vocab / tp] (vocabulary columns from
    ``vocab_start``) on the last stage.
    """

    def __init__(self, config: ModelConfig, layers: tuple[int, int], tp: TPGroup, *,
                 first: bool, last: bool) -> None:
        super().__init__()
        dt = torch_dtype(config)
        self.config, self.tp, self.first, self.last = config, tp, first, last
        if first:
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dt)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, tp) for i in range(*layers)})
        if last:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=dt)
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, tp,
                                                dtype=dt)
            self.vocab_start = tp.index * (config.vocab_size // tp.size)
        cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta, dt)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        s = x.shape[1]
        for layer in self.layers.values():
            x = layer(x, self.cos[:s], self.sin[:s])
        if self.last:
            x = self.lm_head(enter_tp(self.norm(x), self.tp))
        return x


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                   vocab_start: int = 0) -> torch.Tensor:
    """Sum of token cross-entropies of the last stage's logits (this TP rank's vocabulary columns
    from ``vocab_start``); the same value on every TP rank. The caller divides by the global
    token count. Low-precision logits are reduced in float32."""
    if tp.size == 1:
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum")
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_start).sum()
