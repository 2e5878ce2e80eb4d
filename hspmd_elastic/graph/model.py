"""The one model definition: a Llama-style decoder written with the tensor-parallel layers.

``StageModule(config, layers, tp, first=..., last=...)`` builds any slice of the model for any TP
group: the embedding when it is the first stage, decoder layers ``[start, stop)``, and the final
norm with the LM head when it is the last stage (with tied embeddings the head is ``embed.weight``,
so the last stage holds that too). Parameter names are the global names of
``config.param_specs`` (``layers.3.attn.wq.weight``) whatever the slice, so the plan, the
initialiser and resharding all speak of the same tensors. Parameters are allocated empty; values
come from ``init.py`` or from received shards.

Attention is ``F.scaled_dot_product_attention`` (causal), which picks a fused kernel where the
device and dtype have one. Rows that pack several documents carry segment ids (``document_masks``:
1..k per document, 0 for padding): attention is then causal *and* within one segment, and the
loss counts a target only where it continues a real document, so a packed row computes what its
documents would one at a time. The last stage returns its TP rank's vocabulary shard of the logits;
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
import math

import torch
import torch.nn.functional as F
from torch import nn

from hspmd_elastic.documents import block_mask, loss_mask  # the one rule, with the data
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


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (float64) of ``config``'s RoPE and the factor its
    cos / sin are multiplied by, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them:

    * plain: ``theta ** (-2i / d)``; ``linear``: those divided by ``factor``;
    * ``dynamic`` (NTK): the base grows to ``theta * (factor * L / L0 - (factor - 1)) ** (d / (d
      - 2))``, ``L0`` = ``original_max_position_embeddings``, ``L = max(seq_len, L0)``: the
      frequencies transformers uses for an input of exactly ``seq_len`` tokens (every training
      row), so plain RoPE when ``seq_len <= L0``;
    * ``yarn``: interpolated (divided by ``factor``) below the ``beta_slow`` rotations over
      ``L0``, extrapolated (plain) above ``beta_fast``, a linear ramp between; cos and sin times
      ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ratio of the two ``mscale``
      forms);
    * ``llama3``: wavelengths above ``L0 / low_freq_factor`` divided by ``factor``, below ``L0 /
      high_freq_factor`` kept, smoothly mixed between.
    """
    d, kind, a = config.head_dim, config.rope_kind, config.rope_args
    exponent = torch.arange(0, d, 2, dtype=torch.float64) / d
    base = config.rope_theta
    if kind == "dynamic":
        length, original = max(config.seq_len, a["original_max_position_embeddings"]), \
            a["original_max_position_embeddings"]
        base = base * (a["factor"] * length / original - (a["factor"] - 1)) ** (d / (d - 2))
    inv = 1.0 / base ** exponent
    scale = 1.0
    if kind == "linear":
        inv = inv / a["factor"]
    elif kind == "llama3":
        original, factor = a["original_max_position_embeddings"], a["factor"]
        low, high = a["low_freq_factor"], a["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mixed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        inv = torch.where(medium, mixed, scaled)
    elif kind == "yarn":
        inv, scale = _yarn(inv, d, base, a)
    return inv, scale


def _yarn(inv: torch.Tensor, d: int, base: float, a: dict) -> tuple[torch.Tensor, float]:
    factor, original = a["factor"], a["original_max_position_embeddings"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    scale = a.get("attention_factor")
    if scale is None:
        both = a.get("mscale") and a.get("mscale_all_dim")
        scale = mscale(a["mscale"]) / mscale(a["mscale_all_dim"]) if both else mscale(1.0)

    def correction(rotations: float) -> float:  # the dim whose wavelength fits `rotations` in L0
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(a.get("beta_fast", 32.0)), correction(a.get("beta_slow", 1.0))
    if a.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp), float(scale)


def rope_tables(config: ModelConfig, dtype: torch.dtype):
    """cos and sin, [seq_len, head_dim], for the rotate-half form of rotary embeddings, with
    ``config``'s RoPE scaling (``rope_frequencies``); computed in float64, then cast."""
    inv, scale = rope_frequencies(config)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; the tables are cast to x's dtype (bfloat16 under
    autocast)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention; each TP rank holds num_heads / tp whole query heads.

    Grouped-query attention: query head ``j`` uses key/value head ``j // (num_heads /
    num_kv_heads)``. A TP rank holds the key/value heads its query heads use: ``num_kv_heads /
    tp`` of them when ``tp`` divides ``num_kv_heads``, else (``tp`` a multiple of it) the one head
    ``rank * num_kv_heads // tp``, which ``tp / num_kv_heads`` adjacent ranks then share. Each
    local key/value head is repeated for its local query heads (``repeat_interleave``)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        h, dt = config.hidden_size, torch_dtype(config)
        self.heads, self.head_dim = config.num_heads // tp.size, config.head_dim
        kv_parts = math.gcd(tp.size, config.kv_heads)  # ParamSpec.split_count of wk / wv
        self.kv_heads = config.kv_heads // kv_parts
        kv_rows = config.kv_heads * config.head_dim
        self.wq = ColumnParallelLinear(h, h, tp, dtype=dt)
        self.wk = ColumnParallelLinear(h, kv_rows, tp, dtype=dt, parts=kv_parts)
        self.wv = ColumnParallelLinear(h, kv_rows, tp, dtype=dt, parts=kv_parts)
        self.wo = RowParallelLinear(h, h, tp, dtype=dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t, n):
            return t.view(b, s, n, self.head_dim).transpose(1, 2)

        q = apply_rope(heads(self.wq(x), self.heads), cos, sin)
        k = apply_rope(heads(self.wk(x), self.kv_heads), cos, sin)
        v = heads(self.wv(x), self.kv_heads)
        if self.kv_heads != self.heads:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) if mask is None else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(enter_tp(self.attn_norm(x), self.tp), cos, sin, mask)
        return x + self.mlp(enter_tp(self.mlp_norm(x), self.tp))


class StageModule(nn.Module):
    """Layers ``[start, stop)`` on one TP group, plus the embedding / head at the model's ends.

    Forward takes token ids on the first stage, hidden states [batch, seq, hidden] otherwise, and
    returns this TP rank's logits [batch, seq, vocab / tp] (vocabulary columns from
    ``vocab_start``) on the last stage.

    Tied embeddings (``config.tie_embeddings``): the head is ``embed.weight``, the same
    vocabulary rows ``[vocab_start, vocab_start + vocab / tp)`` the lookup holds. A stage that is
    first and last uses its one Parameter for both; a last stage that is not first holds an
    ``embed`` module too (parameter ``embed.weight``), used only as the head weight (the
    column-parallel path: ``enter_tp``, then ``F.linear``). Its gradient there is the head's
    part; the gradient sync adds the first stage's (lookup) part, as it adds other pipelines'.
    """

    def __init__(self, config: ModelConfig, layers: tuple[int, int], tp: TPGroup, *,
                 first: bool, last: bool) -> None:
        super().__init__()
        dt = torch_dtype(config)
        self.config, self.tp, self.first, self.last = config, tp, first, last
        if first or (last and config.tie_embeddings):
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dt)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, tp) for i in range(*layers)})
        if last:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=dt)
            if not config.tie_embeddings:
                self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, tp,
                                                    dtype=dt)
            self.vocab_start = tp.index * (config.vocab_size // tp.size)
        cos, sin = rope_tables(config, dt)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: the attention mask of packed documents (``document_masks``), or None for
        plain causal attention."""
        if self.first:
            x = self.embed(x)
        s = x.shape[1]
        for layer in self.layers.values():
            x = layer(x, self.cos[:s], self.sin[:s], mask)
        if self.last:
            x = enter_tp(self.norm(x), self.tp)
            x = F.linear(x, self.embed.weight) if self.config.tie_embeddings else self.lm_head(x)
        return x


def document_masks(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: for rows of segment ids [rows, seq + 1] (1..k: the documents packed in a row, 0:
    padding), the attention mask of the inputs [rows, 1, seq, seq] (causal and within one
    document; padding sees itself only, so no row of the softmax is empty) and the loss
    weights of the targets [rows, seq] (1 where the target continues the input's real
    document, else 0): ``hspmd_elastic.documents.block_mask`` and ``loss_mask``."""
    return block_mask(segments[:, :-1]), loss_mask(segments)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                   vocab_start: int = 0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of token cross-entropies of the last stage's logits (this TP rank's vocabulary columns
    from ``vocab_start``); the same value on every TP rank. ``weights`` (shape of ``targets``):
    each token's weight (``document_masks``: 0 for padding and document boundaries). The caller
    divides by the global count of the tokens that count. Low-precision logits are reduced in
    float32."""
    if tp.size == 1:
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        if weights is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="sum")
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 reduction="none")
        return (losses * weights.reshape(-1).to(losses.dtype)).sum()
    losses = vocab_parallel_cross_entropy(logits, targets, tp, vocab_start)
    return losses.sum() if weights is None else (losses * weights.to(losses.dtype)).sum()
