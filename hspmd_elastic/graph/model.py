"""The one model definition: a Llama-style decoder written with the tensor-parallel layers.

``StageModule(config, layers, tp, first=..., last=...)`` builds any slice of the model for any TP
group: the embedding when it is the first stage, decoder layers ``[start, stop)``, and the final
norm with the LM head when it is the last stage. Parameter names are the global names of
``config.param_specs`` (``layers.3.attn.wq.weight``) whatever the slice, so the plan, the
initialiser and resharding all speak of the same tensors. Parameters are allocated empty; values
come from ``init.py`` or from received shards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear,
                                        TPGroup, VocabParallelEmbedding, enter_tp)


def torch_dtype(config: ModelConfig) -> torch.dtype:
    return getattr(torch, config.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin, [seq_len, head_dim], for the rotate-half form of rotary embeddings."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]."""
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
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
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
    returns logits [batch, seq, vocab] (duplicated in the TP group) on the last stage.
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
                                                gather_output=True, dtype=dt)
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


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies; the caller divides by the global token count."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
