"""RoPE scaling kinds and tied embeddings against transformers, under every layout.

Tiny ``LlamaForCausalLM`` models (random init, float64, 2 layers, vocabulary 32) are built and
saved with ``save_pretrained`` here, one per variant; nothing is downloaded:

* ``linear``, ``dynamic``, ``yarn`` (a fractional ramp, its attention factor), ``llama3`` (all
  three wavelength bands) RoPE scaling, from ``rope_parameters``;
* ``tied``: ``tie_word_embeddings`` (the file holds no ``lm_head.weight``).

``dynamic`` is saved with ``max_position_embeddings=4`` and trained on rows of 8 tokens, so the
scaling is active: transformers recomputes its frequencies for an 8-token input, and so do we,
once, for the fixed training length.

On one device and, for every variant, under DP2, TP2, PP2 and a heterogeneous plan (a TP2
pipeline beside a PP2 pipeline), the model loads its slices, gives transformers' logits and loss
within 1e-10, trains two AdamW steps and equals transformers trained with ``torch.optim.AdamW``.
The tied model is also exported from the PP2 plan's pieces and loaded back, resharded from PP2 to
another plan by BSR, and trained from the seed under a plan whose two table holders have
different TP degrees. All these multi-rank runs share one gloo world of 4 ranks, which the tests
read (``_hf_worlds``).

As in test_hf.py, transformers computes RMSNorm and RoPE in float32; the float64 peer
(``float64_peer``) runs transformers' own RoPE functions (``ROPE_INIT_FUNCTIONS``) with their
float32 dtype read as float64, and the stock model is compared at float32 precision.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import torch
from safetensors import safe_open

from _hf_peer import (cut, float64_peer, hf_logits, loaded_on_one_device, max_diff, mean_ce,
                      seeded_llama, train_peer)
from _hf_worlds import checkpoints_world, each_run, run_results
from hspmd_elastic.graph.config import ModelConfig, ModelConfigError, param_specs
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.hf import (HFConfigError, config_from_hf, export_hf, hf_names,
                              initial_state_from_hf, local_param_ranges)
from hspmd_elastic.hf.config import config_to_hf
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

SEQ, ROWS, VOCAB, THETA, TOL = 8, 4, 32, 500.0, 1e-10
HF_KW = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
             num_hidden_layers=2, intermediate_size=32, max_position_embeddings=64,
             tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.2)
# variant -> (rope_parameters without rope_theta, or None: plain; other LlamaConfig fields)
VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, {"max_position_embeddings": 4}),
    # head_dim 8 over theta 500: dims [0, 1.05) ramp, so frequency 1 is mixed (0.95)
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
              "beta_fast": 4.0, "beta_slow": 0.5, "truncate": False}, {}),
    # wavelengths 6.3 (between 16/4 and 16/1: smoothed), 30, 140, 660 (divided by 8)
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, {}),
    "tied": (None, {"tie_word_embeddings": True}),
}
# the ModelConfig.rope_scaling each variant maps to
EXPECTED = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 4},
    "yarn": dict(VARIANTS["yarn"][0]),
    "llama3": dict(VARIANTS["llama3"][0]),
    "tied": None,
}
HETERO = Plan((Pipeline((Stage((0, 1), (0, 2)),), 1, 2),
               Pipeline((Stage((2,), (0, 1)), Stage((3,), (1, 2))), 1, 2)),
              global_batch=ROWS, num_layers=2)
PLANS = {
    "dp2": simple_plan(dp=2, num_layers=2, global_batch=ROWS),
    "tp2": simple_plan(tp=2, num_layers=2, global_batch=ROWS),
    "pp2": simple_plan(pp=2, num_layers=2, global_batch=ROWS, num_microbatches=2),
    "hetero": HETERO,
}
# The shared world (about 25 s on 2 busy cores; a failed run adds its peers' 60 s timeouts) runs
# in the first test that reads it.
WORLD_TIMEOUT_S, WORLD_TEST_TIMEOUT_S = 480, 540


# ---------------------------------------------------------------------------- the peer
def tiny_llama(variant: str):
    from transformers import LlamaConfig

    rope, extra = VARIANTS[variant]
    return seeded_llama(LlamaConfig(**{**HF_KW, **extra}, rope_parameters={
        **(rope or {"rope_type": "default"}), "rope_theta": THETA}))


def batches(count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen) for _ in range(count)]


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per variant: the model, its float64 peer, its saved directory and its ModelConfig."""
    root = tmp_path_factory.mktemp("hf-rope-tied")
    out = {}
    for variant in VARIANTS:
        model = tiny_llama(variant)
        path = str(root / variant)
        model.save_pretrained(path)
        out[variant] = types.SimpleNamespace(model=model, peer=float64_peer(model), path=path,
                                             config=config_from_hf(path, seq_len=SEQ))
    return out


def plain(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, rope_scaling=None)


# ---------------------------------------------------------------------------- config.json
def test_config_maps_rope_kinds_and_ties_and_exports_them(saved):
    from transformers import LlamaConfig

    for variant, s in saved.items():
        config = s.config
        assert config.rope_theta == THETA
        want = EXPECTED[variant]
        assert (None if config.rope_scaling is None else dict(config.rope_scaling)) == want
        assert config.tie_embeddings == (variant == "tied")
        assert ("lm_head.weight" in param_specs(config)) == (variant != "tied")
        assert ModelConfig.from_json(config.to_json()) == config and hash(config)
        data = json.loads(config.to_json())
        assert data.get("rope_scaling") == want and data.get("tie_embeddings") == \
            (True if variant == "tied" else None)
        # the transformers 4 form (rope_scaling, "type", rope_theta at the top) maps the same
        cfg = read_json(os.path.join(s.path, "config.json"))
        if want is not None:
            old = dict(cfg, rope_theta=THETA)
            rope = {k: v for k, v in old.pop("rope_parameters").items() if k != "rope_theta"}
            old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
            assert config_from_hf(old, seq_len=SEQ) == config, variant
        # exported both ways (without a source, and like the source) and read back: the same
        # config, and transformers reads the same RoPE
        for like in (None, cfg):
            out = config_to_hf(config, like=like)
            assert config_from_hf(out, seq_len=SEQ) == config, (variant, like is None)
            theirs = LlamaConfig(**out)
            assert theirs.tie_word_embeddings == (variant == "tied")
            assert theirs.rope_parameters["rope_type"] == (want or {}).get("rope_type", "default")
            assert theirs.max_position_embeddings == (4 if variant == "dynamic" else
                                                      SEQ if like is None else 64)
    # configs without either field keep their JSON
    assert "rope_scaling" not in ModelConfig().to_json()
    assert "tie_embeddings" not in ModelConfig().to_json()


@pytest.mark.parametrize("change, message", [
    ({"rope_type": "longrope"}, r"rope_type='longrope' is not supported; supported: 'dynamic', "
                                r"'linear', 'llama3', 'yarn'"),
    ({"rope_type": "linear"}, r"rope_scaling \(linear\): missing factor"),
    ({"rope_type": "linear", "factor": 0.5}, r"\(linear\): factor=0.5 must be a number >= 1"),
    ({"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.5},
     r"\(linear\): unknown key partial_rotary_factor=0.5"),
    ({"rope_type": "yarn", "factor": 4}, r"\(yarn\): missing original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 1,
      "beta_slow": 2}, r"\(yarn\): beta_fast=1.0 must be > beta_slow=2.0"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
      "truncate": "yes"}, r"\(yarn\): truncate='yes' must be true or false"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
      "original_max_position_embeddings": 8}, r"high_freq_factor=1.0 must be > low_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 0},
     r"\(dynamic\): original_max_position_embeddings=0 must be an integer >= 1"),
    ({"rope_type": "linear", "factor": float("nan")}, r"factor=nan must be a number >= 1"),
])
def test_bad_rope_scaling_is_a_one_line_error_naming_the_key(change, message):
    with pytest.raises(ModelConfigError, match=message) as err:
        ModelConfig(rope_scaling=change)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelConfigError, match=r"rope_scaling=\[1, 2\] must be an object"):
        ModelConfig(rope_scaling=[1, 2])
    with pytest.raises(ModelConfigError, match=r"tie_embeddings=1 must be true or false"):
        ModelConfig(tie_embeddings=1)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": THETA}},
     r"field rope_parameters.rope_type=\"longrope\" is not supported; supported: default, "
     r"dynamic, linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": THETA}},
     r"field rope_parameters \(linear\): missing factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": THETA, "factor": 2.0}},
     r"field rope_parameters.factor=2.0 is not understood with rope_type default"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0},
      "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": THETA}},
     r"fields rope_scaling=.* and rope_parameters=.* differ"),
    ({"rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 2.0}},
     r"field rope_scaling has type='linear' and rope_type='yarn', which differ"),
    ({"rope_scaling": "linear"}, r"field rope_scaling=\"linear\" must be an object or null"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA,
                          "original_max_position_embeddings": 8}},
     r"rope_parameters.original_max_position_embeddings is not understood with rope_type dyn"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA},
      "max_position_embeddings": 4}, r"seq_len=8 exceeds field max_position_embeddings=4"),
    ({"tie_word_embeddings": "yes"}, r"field tie_word_embeddings=\"yes\" must be true or false"),
])
def test_bad_hf_rope_and_tie_fields_are_one_line_errors(saved, change, message):
    cfg = dict(read_json(os.path.join(saved["linear"].path, "config.json")), **change)
    with pytest.raises(HFConfigError, match=message) as err:
        config_from_hf(cfg, seq_len=SEQ)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- one device
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_and_one_device_equal_transformers(saved, variant):
    from hspmd_elastic.graph.specialize import SpecializedModel

    s = saved[variant]
    steps, optim = batches(2, seed=3), AdamWConfig()
    one = loaded_on_one_device(s, steps, optim, TOL)
    model, want, plan, state = one.model, one.want, one.plan, one.state
    with torch.no_grad():
        got = model.module(steps[0][:, :-1])
    assert max_diff(got, want) <= TOL
    # the stock model (float32 RMSNorm and RoPE) agrees at float32 precision: the float64 peer
    # runs transformers' formulas
    assert max_diff(got, hf_logits(s.model, steps[0])) <= 1e-5
    if variant == "tied":  # one Parameter for lookup and head
        assert [n for n, _ in model.module.named_parameters()].count("embed.weight") == 1
        assert "lm_head.weight" not in dict(model.module.named_parameters())
        assert s.model.lm_head.weight is s.model.model.embed_tokens.weight
    else:  # the scaling is checked, not assumed: plain RoPE gives other logits
        unscaled = SpecializedModel.build(plain(s.config), plan, 0, state=state)
        with torch.no_grad():
            assert max_diff(unscaled.module(steps[0][:, :-1]), want) > 1e-4
    losses = [model.step(b) for b in steps]
    assert abs(losses[0] - mean_ce(want, steps[0]).item()) <= TOL
    theirs = dict(train_peer(s.peer, steps, optim).named_parameters())
    for name, hf in hf_names(s.config).items():
        value = model.local_params()[name]
        assert bool(torch.isfinite(value).all()) and max_diff(value, theirs[hf].detach()) <= TOL


def test_tied_layouts_hold_the_table_on_both_ends(saved):
    """A tied embedding is held by the first and the last stage of each pipeline (once in a
    one-stage pipeline); the planner counts its memory on both."""
    from hspmd_elastic.graph.gradsync import sync_ops
    from hspmd_elastic.planner import profile_from_config
    from hspmd_elastic.planner.cost import stage_params

    config = saved["tied"].config
    layouts = {k: p.param_layouts(config)["embed.weight"].groups for k, p in PLANS.items()}
    assert layouts == {"dp2": ((0,), (1,)), "tp2": ((0, 1),), "pp2": ((0,), (1,)),
                       "hetero": ((0, 1), (2,), (3,))}
    ann = HETERO.param_annotations(config)["embed.weight"]
    assert [ann.local_slices(d, (VOCAB, 16)) for d in range(4)] == \
        [((0, 16), (0, 16)), ((16, 32), (0, 16)), ((0, 32), (0, 16)), ((0, 32), (0, 16))]
    # PP2: the two stages sum their parts of the gradient; TP2 alone needs no sync
    assert [(op.members, op.lo, op.hi) for op in sync_ops(PLANS["pp2"].param_layouts(config), 0)
            if op.name == "embed.weight"] == [((0, 1), 0, VOCAB)]
    assert not [op for op in sync_ops(PLANS["tp2"].param_layouts(config), 0)
                if op.name == "embed.weight"]
    profile, untied = profile_from_config(config), profile_from_config(
        dataclasses.replace(config, tie_embeddings=False))
    table = VOCAB * 16
    assert untied.total_params - profile.total_params == table
    assert stage_params(profile, 1, True, False) == stage_params(untied, 1, True, False)
    assert stage_params(profile, 1, False, True) == stage_params(untied, 1, False, True)
    assert stage_params(untied, 2, True, True) - stage_params(profile, 2, True, True) == table


# ---------------------------------------------------------------------------- the world
# One world of 4 ranks runs, in turn, every variant under every plan of PLANS, the tied model's
# reshard (``_reshard_run``) and its training under MIXED (``_mixed_run``): ``rope_world``. The
# tests below each read one run.
LAYOUT_RUNS = [(variant, key) for variant in VARIANTS for key in PLANS]
LAYOUT_STEPS, RESHARD_STEPS, MIXED_STEPS = batches(2, seed=11), batches(3, seed=23), \
    batches(3, seed=29)


def _pipeline_logits(model, plan: Plan, rank: int, tokens: torch.Tensor, group):
    """This rank's logits (its vocabulary columns) of its pipeline's rows of ``tokens``; None
    on a stage that is not the last. Activations go to the same TP rank of the next stage."""
    import torch.distributed as dist

    where = plan.locate(rank)
    stages = plan.pipelines[where.pipeline].stages
    lo, hi = plan.batch_rows(where.pipeline)
    x = tokens[lo:hi]
    with torch.no_grad():
        if where.stage > 0:
            x = torch.empty(hi - lo, SEQ, model.config.hidden_size, dtype=torch.float64)
            dist.recv(x, stages[where.stage - 1].devices[where.tp_rank], group=group)
        out = model.module(x)
        if where.stage < len(stages) - 1:
            dist.send(out.contiguous(), stages[where.stage + 1].devices[where.tp_rank],
                      group=group)
            return None
    return (lo, hi), out


def _layout_run(rank: int, path: str, config: ModelConfig, plan: Plan, group):
    """One plan on the ranks it uses (every rank creates its groups): logits from the
    checkpoint, the training steps' losses, the final pieces."""
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel

    comm = Comm.create(plan, config, rank, timeout_s=60)
    if rank not in plan.devices:
        return None
    state = initial_state_from_hf(path, config, plan, rank)
    model = SpecializedModel.build(config, plan, rank, comm=comm, state=state)
    logits = _pipeline_logits(model, plan, rank, LAYOUT_STEPS[0][:, :-1], group)
    losses = [model.step(b) for b in LAYOUT_STEPS]
    ranges = local_param_ranges(config, plan, rank)
    return {"logits": logits, "vocab_start": getattr(model.module, "vocab_start", 0),
            "losses": losses, "names": [n for n, _ in model.module.named_parameters()],
            "pieces": {n: (ranges[n], t) for n, t in model.local_params().items()}}


def rope_world(rank: int, world: int, paths: dict, config_jsons: dict) -> dict:
    """The runs of LAYOUT_RUNS, then "reshard" and "mixed" (the tied model), in turn; per run
    this rank's result or its traceback (``each_run``)."""
    configs = {v: ModelConfig.from_json(j) for v, j in config_jsons.items()}

    def body(run, group):
        if run == "reshard":
            return _reshard_run(rank, paths["tied"], configs["tied"], group)
        if run == "mixed":
            return _mixed_run(rank, configs["tied"])
        variant, key = run
        return _layout_run(rank, paths[variant], configs[variant], PLANS[key], group)

    return each_run(rank, world, LAYOUT_RUNS + ["reshard", "mixed"], body)


@pytest.fixture(scope="module")
def world(saved, tmp_path_factory):
    """The runs' results, per rank (the world runs once per session)."""
    return checkpoints_world(tmp_path_factory, "hf-rope-tied", rope_world, 4, saved,
                             timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained(saved):
    """Per variant, the peer trained by transformers on LAYOUT_STEPS."""
    cache: dict = {}

    def of(variant):
        if variant not in cache:
            cache[variant] = train_peer(saved[variant].peer, LAYOUT_STEPS, AdamWConfig())
        return cache[variant]

    return of


@pytest.mark.multiproc
@pytest.mark.timeout(WORLD_TEST_TIMEOUT_S)
@pytest.mark.parametrize("variant, key", LAYOUT_RUNS, ids=[f"{v}-{k}" for v, k in LAYOUT_RUNS])
def test_every_layout_equals_transformers(world, saved, trained, variant, key):
    s, plan = saved[variant], PLANS[key]
    results = run_results(world, (variant, key), plan.devices)
    want = hf_logits(s.peer, LAYOUT_STEPS[0])
    want_loss = mean_ce(want, LAYOUT_STEPS[0]).item()
    theirs = {n: p.detach() for n, p in trained(variant).named_parameters()}
    names = hf_names(s.config)
    columns = torch.zeros(ROWS, VOCAB, dtype=torch.int64)
    for rank, r in results.items():
        if r["logits"] is not None:
            (lo, hi), logits = r["logits"]
            cols = slice(r["vocab_start"], r["vocab_start"] + logits.shape[-1])
            assert max_diff(logits, want[lo:hi, :, cols]) <= TOL, (key, rank)
            columns[lo:hi, cols] += 1
        assert abs(r["losses"][0] - want_loss) <= TOL, (key, rank)
        for name, (ranges, value) in r["pieces"].items():
            assert bool(torch.isfinite(value).all()), (key, rank, name)
            assert max_diff(value, cut(theirs[names[name]], ranges)) <= TOL, (key, rank, name)
        if variant == "tied":  # no lm_head anywhere
            assert "lm_head.weight" not in r["names"], (key, rank)
    assert bool((columns >= 1).all()), key  # every row and vocabulary column was checked
    if variant == "tied" and key == "pp2":  # the last stage holds embed.weight as its head
        assert results[1]["names"][0] == "embed.weight"


@pytest.mark.multiproc
@pytest.mark.timeout(WORLD_TEST_TIMEOUT_S)
def test_tied_export_from_pp2_pieces_loads_back_tied(world, saved, trained, tmp_path):
    """Exported from PP2's pieces: no separate lm_head, and transformers ties it on load."""
    from transformers import LlamaForCausalLM

    s, peer = saved["tied"], trained("tied")
    results = run_results(world, ("tied", "pp2"), (0, 1))
    theirs = {n: p.detach() for n, p in peer.named_parameters()}
    out = str(tmp_path / "export")
    export_hf(out, s.config, [results[r]["pieces"] for r in (0, 1)], like=s.path)
    assert read_json(os.path.join(out, "config.json"))["tie_word_embeddings"] is True
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    back = LlamaForCausalLM.from_pretrained(out).eval()
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for name, value in back.named_parameters():
        assert max_diff(value.detach(), theirs[name]) <= TOL, name
    batch = batches(1, seed=17)[0]
    assert max_diff(hf_logits(float64_peer(back), batch), hf_logits(peer, batch)) <= TOL
    assert config_from_hf(out, seq_len=SEQ) == s.config


# ---------------------------------------------------------------------------- reshard
OLD = simple_plan(pp=2, num_layers=2, global_batch=ROWS, num_microbatches=2)
# Two pipelines: TP2 on the new ranks 2 and 3; PP2 with the old stages' devices swapped.
NEW = Plan((Pipeline((Stage((2, 3), (0, 2)),), 1, 2),
            Pipeline((Stage((1,), (0, 1)), Stage((0,), (1, 2))), 1, 2)),
           global_batch=ROWS, num_layers=2)


def _reshard_run(rank: int, path: str, config: ModelConfig, group) -> dict:
    """Train OLD (PP2) on the first steps, reshard every state tensor to NEW by BSR, train on."""
    import torch.distributed as dist

    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.reshard import TensorSpec, fused_bsr_schedule
    from hspmd_elastic.reshard.executor import execute_fused

    steps = RESHARD_STEPS
    out: dict = {}
    comm = Comm.create(OLD, config, rank, timeout_s=60)
    local: dict = {}
    if rank in OLD.devices:
        model = SpecializedModel.build(config, OLD, rank, comm=comm,
                                       state=initial_state_from_hf(path, config, OLD, rank))
        for b in steps[:2]:
            model.step(b)
        local = {n: t for n, (t, _) in model.state_tensors().items()}
        out["old"] = {n: t.clone() for n, t in local.items()}
    dist.barrier(group=group)
    old, new = state_specs(config, OLD), state_specs(config, NEW)
    specs = [TensorSpec(n, old[n].shape, old[n].dtype, old[n].annotation, new[n].annotation)
             for n in old]
    schedule = fused_bsr_schedule(specs, set(OLD.devices), {})
    received, _ = execute_fused(schedule, rank, local, timeout_s=60, group=group)
    out["new"] = {n: t.clone() for n, t in received.items()}
    comm = Comm.create(NEW, config, rank, timeout_s=60)
    model = SpecializedModel.build(config, NEW, rank, comm=comm, state=received)
    model.step(steps[2])
    ranges = local_param_ranges(config, NEW, rank)
    out["pieces"] = {n: (ranges[n], t) for n, t in model.local_params().items()}
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(WORLD_TEST_TIMEOUT_S)
def test_reshard_of_a_tied_model_moves_embed_and_its_moments(world, saved):
    s = saved["tied"]
    config, steps = s.config, RESHARD_STEPS
    results = run_results(world, "reshard")
    # under PP2 both stages hold the whole table, with the same values and moments
    for suffix in ("", ".exp_avg", ".exp_avg_sq"):
        a, b = (results[r]["old"]["embed.weight" + suffix] for r in (0, 1))
        assert torch.equal(a, b) and bool(a.abs().sum() > 0), suffix
    full = dict(results[0]["old"])
    full.update({n: t for n, t in results[1]["old"].items() if n not in full})
    new = state_specs(config, NEW)
    for rank in range(4):
        got = results[rank]["new"]
        mine = {n for n, spec in new.items()
                if spec.annotation.local_slices(rank, spec.shape) is not None}
        assert set(got) == mine, rank
        for name in mine:
            ranges = new[name].annotation.local_slices(rank, new[name].shape)
            assert torch.equal(got[name], cut(full[name], ranges)), (rank, name)
    # the new ranks 2 and 3 got vocabulary halves of the table; rank 0, now the last stage,
    # keeps the whole table (its head) and gets layer 1
    assert got["embed.weight.exp_avg"].shape == (VOCAB // 2, 16)
    assert results[0]["new"]["embed.weight"].shape == (VOCAB, 16)
    assert "layers.1.attn.wq.weight" in results[0]["new"]
    assert "layers.1.attn.wq.weight" not in results[1]["new"]
    # and training goes on as transformers does
    theirs = {n: p.detach() for n, p in train_peer(s.peer, steps, AdamWConfig())
              .named_parameters()}
    names = hf_names(config)
    for rank in range(4):
        for name, (ranges, value) in results[rank]["pieces"].items():
            assert max_diff(value, cut(theirs[names[name]], ranges)) <= TOL, (rank, name)


# ---------------------------------------------------------------------------- mixed TP ends
# Pipeline 0: TP1 first stage, TP2 last stage (the table's two holders cut it differently);
# pipeline 1: one device holding everything.
MIXED = Plan((Pipeline((Stage((0,), (0, 1)), Stage((1, 2), (1, 2))), 2, 1),
              Pipeline((Stage((3,), (0, 2)),), 1, 2)),
             global_batch=ROWS, num_layers=2)


def _mixed_run(rank: int, config: ModelConfig) -> dict:
    from hspmd_elastic.graph.specialize import SpecializedModel

    model = SpecializedModel.build(config, MIXED, rank, seed=5, timeout_s=60)
    losses = [model.step(b) for b in MIXED_STEPS]
    ranges = local_param_ranges(config, MIXED, rank)
    return {"losses": losses,
            "pieces": {n: (ranges[n], t) for n, t in model.local_params().items()}}


@pytest.mark.multiproc
@pytest.mark.timeout(WORLD_TEST_TIMEOUT_S)
def test_tied_training_with_different_tp_degrees_on_its_two_ends(world, saved):
    """The first stage holds the whole table, the last stage's TP2 ranks a half each: the sync
    sums each half over its three holders; three steps from the seed equal ``reference_train``."""
    from hspmd_elastic.graph.gradsync import sync_ops
    from hspmd_elastic.graph.reference import reference_train

    config, steps, optim = saved["tied"].config, MIXED_STEPS, AdamWConfig()
    layout = MIXED.param_layouts(config)["embed.weight"]
    assert layout.groups == ((0,), (1, 2), (3,))
    assert [(op.members, op.lo, op.hi) for op in sync_ops(MIXED.param_layouts(config), 0)
            if op.name == "embed.weight"] == [((0, 1, 3), 0, 16), ((0, 2, 3), 16, 32)]
    results = run_results(world, "mixed")
    ref, losses = reference_train(config, 5, steps, optim)
    assert set(ref) == set(param_specs(config)) and "lm_head.weight" not in ref
    for rank, r in results.items():
        assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= TOL, rank
        for name, (ranges, value) in r["pieces"].items():
            assert bool(torch.isfinite(value).all()), (rank, name)
            assert max_diff(value, cut(ref[name], ranges)) <= TOL, (rank, name)


def test_a_tied_checkpoint_may_still_hold_lm_head(saved, tmp_path):
    """transformers ties the head on load, so a stored lm_head.weight is skipped, not read;
    an untied config still needs it."""
    import shutil

    from safetensors.torch import save_file

    from hspmd_elastic.hf import load_shards

    s = saved["tied"]
    with safe_open(os.path.join(s.path, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert "lm_head.weight" not in tensors
    path = tmp_path / "with-head"
    path.mkdir()
    shutil.copy(os.path.join(s.path, "config.json"), path / "config.json")
    save_file(dict(tensors, **{"lm_head.weight": torch.zeros(VOCAB, 16, dtype=torch.float64)}),
              str(path / "model.safetensors"))
    wanted = {n: tuple((0, k) for k in spec.shape) for n, spec in param_specs(s.config).items()}
    got = load_shards(str(path), s.config, wanted)
    assert torch.equal(got["embed.weight"], tensors["model.embed_tokens.weight"])
    from hspmd_elastic.hf import HFCheckpointError

    untied = dataclasses.replace(s.config, tie_embeddings=False)
    with pytest.raises(HFCheckpointError, match=r"lacks tensor lm_head.weight"):
        load_shards(s.path, untied, {})
