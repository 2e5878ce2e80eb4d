"""Hugging Face checkpoints in and out, against transformers itself.

A tiny ``LlamaForCausalLM`` (random init, float64, untied, MHA, 2 layers, vocabulary 32) is built
and saved with ``save_pretrained`` here: once as one ``model.safetensors``, once in 4 KB shards
with an index. Nothing is downloaded. Our dense reference, the one-device model and a TP2 + PP2
plan (one gloo world) loaded from it give transformers' logits and loss within 1e-10; after
training steps the parameters equal transformers trained with ``torch.optim.AdamW``; exported
weights load back into transformers with the same logits.

transformers computes RMSNorm and the RoPE angles in float32 whatever the model's dtype
(``LlamaRMSNorm`` casts to float32, ``LlamaRotaryEmbedding`` uses ``.float()``), so a float64
comparison at 1e-10 runs a copy (``float64_peer``) where those two compute in float64 with the
same formulas; every other part (projections, ``rotate_half``, attention, MLP, head) is
transformers' own. The unmodified model is compared too, at float32 precision.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _hf_peer import float64_peer, hf_logits, mean_ce, seeded_llama, train_peer
from _world import run_world
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.specialize import SpecializedModel
from hspmd_elastic.hf import (HFCheckpointError, HFConfigError, config_from_hf, export_hf,
                              hf_names, initial_state_from_hf, load_shards, local_param_ranges,
                              write_initial_checkpoint)
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

SEQ, ROWS, VOCAB = 8, 4, 32
HF_KW = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
             num_hidden_layers=2, intermediate_size=32, max_position_embeddings=64,
             tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.2)
THETA = 500.0
TOL = 1e-10
# Pipeline 0: TP2 over both layers; pipeline 1: PP2, one layer per stage (two rows each).
HETERO = Plan((Pipeline((Stage((0, 1), (0, 2)),), 1, 2),
               Pipeline((Stage((2,), (0, 1)), Stage((3,), (1, 2))), 1, 2)),
              global_batch=ROWS, num_layers=2)


# ---------------------------------------------------------------------------- the peer
def tiny_llama(**overrides):
    from transformers import LlamaConfig

    return seeded_llama(LlamaConfig(**{**HF_KW, **overrides}, rope_parameters={
        "rope_type": "default", "rope_theta": THETA}))


def batches(count: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen) for _ in range(count)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model, its float64 peer, and its checkpoint saved whole and in 4 KB shards."""
    model = tiny_llama()
    root = tmp_path_factory.mktemp("hf")
    single, sharded = str(root / "single"), str(root / "sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="4KB")
    assert not os.path.exists(os.path.join(single, "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    config = config_from_hf(single, seq_len=SEQ)
    return types.SimpleNamespace(model=model, peer=float64_peer(model), single=single,
                                 sharded=sharded, config=config, root=root)


def full_read(path: str, config: ModelConfig, stats=None) -> dict[str, torch.Tensor]:
    wanted = {n: tuple((0, k) for k in s.shape) for n, s in param_specs(config).items()}
    return load_shards(path, config, wanted, stats)


def reference_logits(params, batch, config):
    from hspmd_elastic.graph import reference as r

    x = params["embed.weight"][batch[:, :-1]]
    for i in range(config.num_layers):
        x = r._layer(x, params, i, config)
    return r._rms(x, params["norm.weight"], config.norm_eps) @ params["lm_head.weight"].T


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------- config.json
def test_config_maps_the_llama_fields(saved):
    assert saved.config == ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2,
                                       ffn_size=32, seq_len=SEQ, rope_theta=THETA, norm_eps=1e-5,
                                       init_std=0.2, dtype="float64")
    # A transformers 4 style file: rope_theta at the top, torch_dtype; bfloat16 trains in float32.
    old = dict(read_json(os.path.join(saved.single, "config.json")), torch_dtype="bfloat16",
               rope_theta=THETA, rope_scaling=None, pretraining_tp=1, _name_or_path="x")
    del old["rope_parameters"], old["dtype"]
    assert config_from_hf(old, seq_len=SEQ) == ModelConfig(**dict(
        vars(saved.config), dtype="float32"))
    assert config_from_hf(old, seq_len=SEQ, dtype="float64").dtype == "float64"


def test_mistral_config_maps_and_its_sliding_window_must_cover_seq_len(tmp_path):
    from transformers import MistralConfig

    MistralConfig(**HF_KW, sliding_window=16).save_pretrained(str(tmp_path))
    config = config_from_hf(str(tmp_path), seq_len=SEQ)
    assert (config.hidden_size, config.num_layers, config.norm_eps) == (16, 2, 1e-5)
    with pytest.raises(HFConfigError, match=r"field sliding_window=16 is not supported"):
        config_from_hf(str(tmp_path), seq_len=32)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, r"field num_key_value_heads=3 is not supported; supported: a "
                                 r"positive divisor of num_attention_heads=2"),
    ({"tie_word_embeddings": 1}, r"field tie_word_embeddings=1 must be true or false"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     r"field rope_scaling.rope_type=\"longrope\" is not supported; supported: default, dyn"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"field rope_parameters \(llama3\): missing high_freq_factor"),
    ({"hidden_act": "gelu"}, r"field hidden_act=\"gelu\" is not supported; supported: \"silu\""),
    ({"attention_bias": True}, r"field attention_bias=true is not supported"),
    ({"head_dim": 4}, r"field head_dim=4 is not supported"),
    ({"architectures": ["Qwen2ForCausalLM"]}, r"field architectures=\[\"Qwen2ForCausalLM\"\]"),
    ({"quantization_config": {"bits": 4}}, r"field quantization_config=\{'bits': 4\} is not "
                                           r"understood"),
    ({"hidden_size": 0}, r"field hidden_size=0 must be a positive integer"),
    ({"max_position_embeddings": 4}, r"seq_len=8 exceeds field max_position_embeddings=4"),
    ({"dtype": "int8"}, r"field dtype='int8' is not supported"),
])
def test_config_refusals_are_one_line_naming_the_field(saved, change, message):
    cfg = dict(read_json(os.path.join(saved.single, "config.json")), **change)
    with pytest.raises(HFConfigError, match=message) as err:
        config_from_hf(cfg, seq_len=SEQ)
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


# ---------------------------------------------------------------------------- equality
@pytest.mark.parametrize("which", ["single", "sharded"])
def test_reference_and_one_device_model_equal_transformers(saved, which):
    path, config = getattr(saved, which), saved.config
    batch = batches(1)[0]
    want = hf_logits(saved.peer, batch)
    params = full_read(path, config)
    ref = reference_logits(params, batch, config)
    assert max_diff(ref, want) <= TOL
    # The RoPE row order is checked, not assumed: q/k rows in the interleaved order of Meta's
    # original checkpoints would give other logits.
    hd = config.head_dim
    swapped = dict(params)
    for name in (n for n in params if ".attn.wq." in n or ".attn.wk." in n):
        w = params[name]
        swapped[name] = w.view(-1, 2, hd // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
    assert max_diff(reference_logits(swapped, batch, config), want) > 1e-2
    from hspmd_elastic.graph.reference import reference_loss

    assert abs(reference_loss(params, batch, config).item() - mean_ce(want, batch).item()) <= TOL
    plan = simple_plan(num_layers=2, global_batch=ROWS)
    model = SpecializedModel.build(config, plan, 0, state=initial_state_from_hf(path, config,
                                                                                plan, 0))
    with torch.no_grad():
        assert max_diff(model.module(batch[:, :-1]), want) <= TOL
    # transformers unmodified (float32 RMSNorm and RoPE angles), and its own shifted loss.
    assert max_diff(ref, hf_logits(saved.model, batch)) <= 1e-5
    with torch.no_grad():
        stock = saved.model(input_ids=batch, labels=batch).loss.item()
    assert abs(stock - reference_loss(params, batch, config).item()) <= 1e-5


def test_training_from_the_checkpoint_equals_transformers_adamw(saved):
    steps, optim = batches(3, seed=9), AdamWConfig()
    plan = simple_plan(num_layers=2, global_batch=ROWS, num_microbatches=2)
    model = SpecializedModel.build(saved.config, plan, 0, optim=optim,
                                   state=initial_state_from_hf(saved.single, saved.config, plan, 0))
    losses = [model.step(b) for b in steps]
    trained = train_peer(saved.peer, steps, optim)
    assert abs(losses[0] - mean_ce(hf_logits(saved.peer, steps[0]), steps[0]).item()) <= TOL
    theirs = dict(trained.named_parameters())
    for name, hf in hf_names(saved.config).items():
        assert max_diff(model.local_params()[name], theirs[hf].detach()) <= TOL, name


def hetero_world(rank: int, world: int, path: str, config_json: str, plan_json: str,
                 steps: list) -> dict:
    """One rank of HETERO: logits before training, the losses of ``steps``, its final pieces."""
    import torch.distributed as dist

    config, plan = ModelConfig.from_json(config_json), Plan.from_json(plan_json)
    stats: dict = {}
    model = SpecializedModel.build(config, plan, rank, timeout_s=30,
                                   state=initial_state_from_hf(path, config, plan, rank, stats))
    tokens = steps[0][:, :-1]
    logits = None
    with torch.no_grad():
        if rank in (0, 1):  # TP2
            logits = model.module(tokens)
        elif rank == 2:  # PP2, first stage: its activations go to the second stage
            dist.send(model.module(tokens).contiguous(), 3)
        else:
            hidden = torch.empty(ROWS, SEQ, config.hidden_size, dtype=torch.float64)
            dist.recv(hidden, 2)
            logits = model.module(hidden)
    losses = [model.step(b) for b in steps]
    ranges = local_param_ranges(config, plan, rank)
    pieces = {n: (ranges[n], t) for n, t in model.local_params().items()}
    # Under TP the last stage may hand back its vocabulary columns only.
    start = getattr(model.module, "vocab_start", 0) if logits is not None else None
    return {"logits": logits, "vocab_start": start, "losses": losses, "pieces": pieces,
            "stats": stats}


@pytest.mark.multiproc
def test_tp2_and_pp2_load_train_and_export_like_transformers(saved, tmp_path):
    from transformers import LlamaForCausalLM

    steps = batches(2, seed=13)
    results = run_world(hetero_world, 4, (saved.sharded, saved.config.to_json(),
                                          HETERO.to_json(), steps), timeout_s=90)
    want = hf_logits(saved.peer, steps[0])
    columns = torch.zeros(VOCAB, dtype=torch.bool)
    for rank in (0, 1, 3):
        logits, start = results[rank]["logits"], results[rank]["vocab_start"]
        assert max_diff(logits, want[..., start:start + logits.shape[-1]]) <= TOL, rank
        if rank != 3:
            columns[start:start + logits.shape[-1]] = True
    assert bool(columns.all())  # TP2's ranks gave every vocabulary column between them
    assert all(abs(r["losses"][0] - mean_ce(want, steps[0]).item()) <= TOL for r in results)
    trained = train_peer(saved.peer, steps, AdamWConfig())
    theirs = dict(trained.named_parameters())
    from hspmd_elastic.runtime import gather_full

    tp2 = gather_full([results[0]["pieces"], results[1]["pieces"]],
                      {n: s.shape for n, s in param_specs(saved.config).items()})
    for name, hf in hf_names(saved.config).items():
        assert max_diff(tp2[name], theirs[hf].detach()) <= TOL, name
    # Export from the plan's pieces: one replica of every slice is there (pipeline 1's ranks).
    out = str(tmp_path / "export")
    export_hf(out, saved.config, [results[2]["pieces"], results[3]["pieces"]],
              max_shard_size=4000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    back = LlamaForCausalLM.from_pretrained(out).eval()
    for name, value in back.named_parameters():
        assert max_diff(value.detach(), theirs[name].detach()) <= TOL, name
    batch = batches(1, seed=17)[0]
    assert max_diff(hf_logits(float64_peer(back), batch), hf_logits(trained, batch)) <= TOL
    # A rank read its own slices only: from the files that hold them.
    index = read_json(os.path.join(saved.sharded, "model.safetensors.index.json"))
    names = hf_names(saved.config)
    for rank, r in enumerate(results):
        held = local_param_ranges(saved.config, HETERO, rank)
        assert sorted(r["stats"]["files"]) == sorted({index["weight_map"][names[n]]
                                                      for n in held}), rank


def test_a_rank_reads_only_its_slices(saved):
    full_stats: dict = {}
    full = full_read(saved.sharded, saved.config, full_stats)
    total = read_json(os.path.join(saved.sharded, "model.safetensors.index.json"))
    assert full_stats["bytes_read"] == total["metadata"]["total_size"]
    for plan in (HETERO, simple_plan(tp=2, pp=2, num_layers=2, global_batch=ROWS)):
        for rank in plan.devices:
            stats: dict = {}
            state = initial_state_from_hf(saved.sharded, saved.config, plan, rank, stats)
            held = local_param_ranges(saved.config, plan, rank)
            sizes = sum(8 * torch.Size([hi - lo for lo, hi in r]).numel() for r in held.values())
            assert stats["bytes_read"] == sizes < full_stats["bytes_read"]
            for name, ranges in held.items():
                want = full[name][tuple(slice(lo, hi) for lo, hi in ranges)]
                assert torch.equal(state[name], want), (rank, name)
                assert not state[name + ".exp_avg"].any()
            assert int(state["optim.step"]) == 0
    with pytest.raises(HFCheckpointError, match=r"ranges \(\(0, 40\),\) of tensor norm.weight"):
        load_shards(saved.single, saved.config, {"norm.weight": ((0, 40),)})


# ---------------------------------------------------------------------------- export
def test_export_loads_back_into_transformers(saved, tmp_path):
    from transformers import LlamaForCausalLM

    params = full_read(saved.single, saved.config)
    batch = batches(1, seed=3)[0]
    out = str(tmp_path / "whole")
    files = export_hf(out, saved.config, params, like=saved.single)
    assert [os.path.basename(f) for f in files] == ["model.safetensors", "config.json"]
    back = LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(hf_logits(back, batch), hf_logits(saved.model, batch))
    assert config_from_hf(out, seq_len=SEQ) == saved.config
    kept = read_json(os.path.join(out, "config.json"))
    assert kept["max_position_embeddings"] == 64 and kept["bos_token_id"] == 1  # from `like`
    # bfloat16 storage: what transformers makes of the same weights in bfloat16.
    half = str(tmp_path / "bf16")
    export_hf(half, saved.config, params, dtype="bfloat16")
    back = LlamaForCausalLM.from_pretrained(half)
    assert next(back.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(p, saved.model.get_parameter(n).to(torch.bfloat16))
               for n, p in back.named_parameters())
    with pytest.raises(HFCheckpointError, match=r"already holds config.json"):
        export_hf(out, saved.config, params)
    bad = dict(params, **{"norm.weight": params["norm.weight"] * float("nan")})
    with pytest.raises(HFCheckpointError, match=r"parameter norm.weight has 16 non-finite"):
        export_hf(str(tmp_path / "nan"), saved.config, bad)
    pieces = [{n: (tuple((0, k) for k in t.shape), t) for n, t in params.items()}]
    pieces[0]["lm_head.weight"] = (((0, 16), (0, 16)), params["lm_head.weight"][:16])
    with pytest.raises(HFCheckpointError, match=r"lm_head.weight has 256 elements that no rank"):
        export_hf(str(tmp_path / "gap"), saved.config, pieces)


# ---------------------------------------------------------------------------- bad files
def test_bad_checkpoints_are_one_line_errors_naming_the_tensor(saved, tmp_path):
    names = hf_names(saved.config)
    with safe_open(os.path.join(saved.single, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = read_json(os.path.join(saved.single, "config.json"))

    def checkpoint(name, weights):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        save_file(weights, str(path / "model.safetensors"))
        return str(path)

    cases = [
        (checkpoint("tied", {k: v for k, v in tensors.items() if k != "lm_head.weight"}),
         saved.config, r"lacks tensor lm_head.weight"),
        (checkpoint("bias", dict(tensors, **{"model.layers.0.self_attn.q_proj.bias":
                                             torch.zeros(16, dtype=torch.float64)})),
         saved.config, r"holds tensor model.layers.0.self_attn.q_proj.bias, which"),
        (saved.single, ModelConfig(**dict(vars(saved.config), vocab_size=64)),
         r"tensor model.embed_tokens.weight has shape \(32, 16\); the config says \(64, 16\)"),
    ]
    for path, config, message in cases:
        with pytest.raises(HFCheckpointError, match=message) as err:
            full_read(path, config)
        assert "\n" not in str(err.value)
    index = tmp_path / "escape"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {names["norm.weight"]: "../single/model.safetensors"}}))
    with pytest.raises(HFCheckpointError, match=r"maps to '../single/model.safetensors'"):
        full_read(str(index), saved.config)


# ---------------------------------------------------------------------------- runtime.run
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_elastic_run_starts_from_the_checkpoint(saved, elastic_job, tmp_path):
    """An HF checkpoint written as the project's checkpoint of step 0: ``runtime.run`` with
    ``checkpoint_dir`` starts a PP2 plan from it and trains like transformers does."""
    import dataclasses

    from _elastic import payload
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler

    ckpt = str(tmp_path / "ckpt")
    assert write_initial_checkpoint(saved.sharded, saved.config, ckpt) == 0
    with pytest.raises(HFCheckpointError, match=r"already holds the checkpoint of step 0"):
        write_initial_checkpoint(saved.sharded, saved.config, ckpt)
    pl = payload(config=dataclasses.asdict(saved.config), checkpoint_dir=ckpt, pause_at=None,
                 steps=3, global_batch=ROWS)
    job = elastic_job(pl)
    devices = ["n0:0", "n1:0"]
    for d in devices:
        job.spawn(d)
    job.publish(Plan((Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, 2))), 2, 2),),
                     global_batch=ROWS, num_layers=2), devices, reason="start")
    results = job.join(devices, timeout=90)
    for d, r in results.items():
        assert r["ok"], f"{d}: {r.get('traceback')}\n{job.log(d)}"
        first = r["switches"][0]
        assert first["source"] == "checkpoint" and first["resume_step"] == 0
    from hspmd_elastic.runtime import gather_full

    got = gather_full([r["final_state"] for r in results.values()],
                      {n: s.shape for n, s in param_specs(saved.config).items()})
    sample = synthetic_sampler(saved.config, pl["data_seed"])
    trained = train_peer(saved.peer, [global_batch_at(sample, s, ROWS) for s in range(3)],
                         AdamWConfig())
    theirs = dict(trained.named_parameters())
    for name, hf in hf_names(saved.config).items():
        assert max_diff(got[name], theirs[hf].detach()) <= 1e-9, name
