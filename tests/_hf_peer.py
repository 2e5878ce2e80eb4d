"""The float64 transformers peer the Hugging Face tests compare against.

transformers computes RMSNorm and the RoPE angles in float32 whatever the model's dtype, so the
float64 comparisons run a copy (``float64_peer``) whose RMSNorm computes in float64 with the same
formula and whose RoPE runs transformers' own frequency functions (``ROPE_INIT_FUNCTIONS``, any
kind) with their float32 dtype read as float64; everything else is transformers' own. Also the
small helpers those tests share: logits, the mean token loss, AdamW training of the peer, a
checkpoint loaded on one device (``loaded_on_one_device``).
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F

from hspmd_elastic.graph.config import param_specs
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.hf import initial_state_from_hf
from hspmd_elastic.plan import simple_plan


class _Float64Torch:
    """``torch`` as transformers' RoPE functions see it in the peer: float32 reads as float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


def _transformers_rope(config, seq_len: int):
    """transformers' own (inverse frequencies, attention factor) for ``config``, in float64."""
    import transformers.modeling_rope_utils as mru

    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        d = config.head_dim
        theta = config.rope_parameters["rope_theta"]
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0
    real, mru.torch = mru.torch, _Float64Torch()
    try:  # dynamic: what its forward recomputes for an input of seq_len tokens
        inv, scale = mru.ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    finally:
        mru.torch = real
    assert inv.dtype == torch.float64
    return inv, scale


def float64_peer(model):
    """A copy of ``model`` whose RMSNorm and RoPE compute in float64 (module docstring)."""
    peer = copy.deepcopy(model)

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    def rotary(self, x, position_ids):
        inv, scale = _transformers_rope(self.config, int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    for module in peer.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(rms_norm, module)
        elif type(module).__name__ == "LlamaRotaryEmbedding":
            module.forward = types.MethodType(rotary, module)
    return peer


def seeded_llama(config, seed: int = 0):
    """``LlamaForCausalLM(config)`` in float64 from ``seed``, its norm scales drawn from
    U(0.5, 1.5) (they start at one: this makes them tell the layers apart)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch[:, :-1]).logits


def mean_ce(logits, batch):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_peer(model, steps, optim: AdamWConfig):
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    for batch in steps:
        opt.zero_grad()
        mean_ce(model(input_ids=batch[:, :-1]).logits, batch).backward()
        opt.step()
    return model.eval()


def loaded_on_one_device(saved, steps, optim: AdamWConfig, tol: float) -> types.SimpleNamespace:
    """A saved checkpoint (``saved``: its directory ``path``, its ``ModelConfig`` ``config``, its
    float64 ``peer``) loaded on one device: the one-device ``plan`` (a step's rows its global
    batch), the loaded ``state`` and its ``params``, the ``SpecializedModel`` (``model``) built
    from it with ``optim``, and the peer's logits of ``steps[0]`` (``want``). Asserts first that
    the dense reference's loss of the loaded parameters is the peer's, within ``tol``."""
    from hspmd_elastic.graph.reference import reference_loss
    from hspmd_elastic.graph.specialize import SpecializedModel

    want = hf_logits(saved.peer, steps[0])
    plan = simple_plan(num_layers=saved.config.num_layers, global_batch=len(steps[0]))
    state = initial_state_from_hf(saved.path, saved.config, plan, 0)
    params = {n: state[n] for n in param_specs(saved.config)}
    assert abs(reference_loss(params, steps[0], saved.config).item()
               - mean_ce(want, steps[0]).item()) <= tol
    model = SpecializedModel.build(saved.config, plan, 0, state=state, optim=optim)
    return types.SimpleNamespace(plan=plan, state=state, params=params, model=model, want=want)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def cut(full: torch.Tensor, ranges) -> torch.Tensor:
    return full[tuple(slice(lo, hi) for lo, hi in ranges)]
