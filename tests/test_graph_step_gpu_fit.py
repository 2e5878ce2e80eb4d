"""The training step's GPU-fit parts, on CPUs: the foreach AdamW is bitwise the per-tensor
arithmetic, the vocabulary-parallel cross-entropy equals the dense one (values and gradients,
over a real 2-rank TP group too), a rank samples only the rows it reads and still trains like
the dense reference, the undo copy's modes, and bf16 compute with float32 master weights (it
trains, its state stays float32, and a fused BSR moves that state between plans).

The ``cuda`` cases (the host undo copy, bf16 training) carry the ``gpu`` marker and skip without
CUDA (on a GPU machine: ``pytest -m gpu tests/test_graph_step_gpu_fit.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _world import run_world
from hspmd_elastic.elastic.agree import NO_STEP, Holding, decide
from hspmd_elastic.elastic.api import ConfigurationError, SwitchError
from hspmd_elastic.graph.config import ModelConfig, ModelConfigError
from hspmd_elastic.graph.layers import TPGroup, vocab_parallel_cross_entropy
from hspmd_elastic.graph.optim import AdamWConfig, ShardedAdamW
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.graph.specialize import SpecializedModel, rank_rows
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from hspmd_elastic.runtime import global_batch_at, rows_at, synthetic_sampler
from hspmd_elastic.switch import Held, _missing_undo

NO_CUDA = None if torch.cuda.is_available() else \
    f"torch {torch.__version__} cannot use CUDA (a CPU-only build, or no GPU)"
DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))])]
CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=4, ffn_size=32,
                     seq_len=8)
BF16 = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=4, ffn_size=32,
                   seq_len=8, dtype="float32", compute_dtype="bfloat16")
SEED, GLOBAL_BATCH = 7, 8


# ---------------------------------------------------------------------------- AdamW
def _per_tensor_adamw(params, grads, m, v, t, c: AdamWConfig) -> None:
    """The per-tensor AdamW the foreach form replaced, operation for operation."""
    (b1, b2) = c.betas
    bias1, bias2_sqrt = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
    for p, g, mi, vi in zip(params, grads, m, v):
        p.mul_(1 - c.lr * c.weight_decay)
        mi.lerp_(g, 1 - b1)
        vi.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(mi, (vi.sqrt() / bias2_sqrt).add_(c.eps), value=-c.lr / bias1)


def test_foreach_adamw_is_bitwise_the_per_tensor_loop_in_float64():
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = {f"p{i}": torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for i, s in enumerate(shapes)}
    mine = [p.detach().clone() for p in params.values()]
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    config = AdamWConfig(lr=3e-2, weight_decay=0.1)
    opt = ShardedAdamW(params, config)
    for t in range(1, 5):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        grads[1] = grads[1] if t % 2 else torch.zeros(shapes[1], dtype=torch.float64)
        for p, g in zip(params.values(), grads):
            p.grad = None if t % 2 == 0 and g.abs().sum() == 0 else g.clone()
        opt.step()
        _per_tensor_adamw(mine, grads, m, v, t, config)
    for (name, p), want, wm, wv in zip(params.items(), mine, m, v):
        assert torch.equal(p.detach(), want), name
        assert torch.equal(opt.exp_avg[name], wm) and torch.equal(opt.exp_avg_sq[name], wv)
    assert int(opt.step_count) == 4


# ---------------------------------------------------------------------------- cross-entropy
def test_vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy_with_its_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 4), generator=gen)
    got = vocab_parallel_cross_entropy(logits, targets, TPGroup.single(), 0)
    want = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none")
    assert (got.reshape(-1) - want).abs().max().item() <= 1e-13
    assert torch.autograd.gradcheck(
        lambda z: vocab_parallel_cross_entropy(z, targets, TPGroup.single(), 0), (logits,))


def vocab_parallel_pair(rank: int, world: int, payload: dict) -> dict:
    """Each rank holds half of the vocabulary's logits; losses and shard gradients come back."""
    from hspmd_elastic.graph.comm import Comm

    plan = simple_plan(tp=2, num_layers=4, global_batch=GLOBAL_BATCH)
    comm = Comm.create(plan, CONFIG, rank, timeout_s=30)
    tp = TPGroup((0, 1), rank, comm)
    out = {}
    for dtype in (torch.float64, torch.bfloat16):
        full, targets = payload["logits"].to(dtype), payload["targets"]
        width = full.shape[-1] // 2
        shard = full[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, targets, tp, rank * width)
        loss.sum().backward()
        out[str(dtype)] = {"loss": loss.detach(), "grad": shard.grad}
    return out


def test_vocab_parallel_cross_entropy_over_a_tp_group_of_two_equals_the_dense_one():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 32, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, 32, (2, 5), generator=gen)
    results = run_world(vocab_parallel_pair, 2, ({"logits": logits, "targets": targets},))
    dense = logits.clone().requires_grad_(True)
    want = F.cross_entropy(dense.reshape(-1, 32), targets.reshape(-1), reduction="none")
    want.sum().backward()
    exact = [r["torch.float64"] for r in results]
    for r in exact:
        assert (r["loss"].reshape(-1) - want.detach()).abs().max().item() <= 1e-13
    grad = torch.cat([exact[0]["grad"], exact[1]["grad"]], dim=-1)
    assert (grad - dense.grad).abs().max().item() <= 1e-13
    low = [r["torch.bfloat16"] for r in results]
    assert low[0]["loss"].dtype == torch.float32 and low[0]["grad"].dtype == torch.bfloat16
    assert torch.equal(low[0]["loss"], low[1]["loss"])  # every TP rank gets the same losses
    bf = logits.to(torch.bfloat16).double()
    ref = F.cross_entropy(bf.reshape(-1, 32), targets.reshape(-1), reduction="none")
    assert (low[0]["loss"].double().reshape(-1) - ref).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------- rows
# Pipeline 0: three stages (device 1 in the middle) over rows [0, 6); pipeline 1: TP2 over [6, 8).
ROWS_PLAN = Plan((Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, 3)), Stage((2,), (3, 4))), 3, 2),
                  Pipeline((Stage((3, 4), (0, 4)),), 1, 2)), GLOBAL_BATCH, 4)


def test_each_rank_reads_only_its_pipelines_rows_and_a_middle_stage_none():
    assert [rank_rows(ROWS_PLAN, r) for r in range(5)] == [(0, 6), (0, 0), (0, 6), (6, 8),
                                                          (6, 8)]
    calls = []
    sampler = synthetic_sampler(CONFIG, 1)

    def sample(i):
        calls.append(i)
        return sampler(i)

    rows = rows_at(sample, 3, GLOBAL_BATCH, (6, 8))
    assert calls == [30, 31]
    assert torch.equal(rows, global_batch_at(sampler, 3, GLOBAL_BATCH)[6:8])
    calls.clear()
    assert rows_at(sample, 3, GLOBAL_BATCH, (0, 0)).numel() == 0 and calls == []


def train_own_rows(rank: int, world: int, payload: dict) -> dict:
    """Train as the runtime does: each step, sample only ``model.batch_rows()``."""
    from hspmd_elastic.graph.comm import Comm

    plan = Plan.from_json(payload["plan"])
    comm = Comm.create(plan, CONFIG, rank, timeout_s=30)
    model = SpecializedModel.build(CONFIG, plan, rank, seed=SEED, comm=comm)
    sampler, calls = synthetic_sampler(CONFIG, 1), []

    def sample(i):
        calls.append(i)
        return sampler(i)

    losses = [model.step(rows_at(sample, s, GLOBAL_BATCH, model.batch_rows()))
              for s in range(payload["steps"])]
    return {"losses": losses, "params": model.local_params(), "calls": calls}


def test_ranks_sampling_only_their_rows_train_like_the_dense_reference():
    steps = 2
    results = run_world(train_own_rows, 5, ({"plan": ROWS_PLAN.to_json(), "steps": steps},))
    for rank, r in enumerate(results):
        lo, hi = rank_rows(ROWS_PLAN, rank)
        assert r["calls"] == [s * GLOBAL_BATCH + i for s in range(steps) for i in range(lo, hi)]
    sampler = synthetic_sampler(CONFIG, 1)
    batches = [global_batch_at(sampler, s, GLOBAL_BATCH) for s in range(steps)]
    ref, ref_losses = reference_train(CONFIG, SEED, batches, AdamWConfig())
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= 1e-9
    for rank in (0, 1, 2):  # TP1 stages: full tensors
        for name, p in results[rank]["params"].items():
            assert (p - ref[name]).abs().max().item() <= 1e-9, (rank, name)
    wq = torch.cat([results[3]["params"]["layers.0.attn.wq.weight"],
                    results[4]["params"]["layers.0.attn.wq.weight"]])
    assert (wq - ref["layers.0.attn.wq.weight"]).abs().max().item() <= 1e-9


def test_a_batch_of_the_wrong_rows_is_refused_naming_both_shapes():
    plan = simple_plan(dp=1, num_layers=4, global_batch=GLOBAL_BATCH)
    model = SpecializedModel.build(CONFIG, plan, 0, seed=SEED)
    with pytest.raises(Exception, match=r"batch shape \(3, 9\); expected \(8, 9\)"):
        model.step(torch.zeros(3, 9, dtype=torch.int64))


# ---------------------------------------------------------------------------- undo copy
def _held(undo_mode: str, device: str = "cpu") -> Held:
    plan = simple_plan(num_layers=4, global_batch=GLOBAL_BATCH)
    config = ModelConfig(**{**CONFIG.__dict__, "num_layers": 4})
    model = SpecializedModel.build(config, plan, 0, seed=SEED, device=device)
    return Held(1, plan, ["n:0"], model, undo_mode=undo_mode)


@pytest.mark.parametrize("device", DEVICES)
def test_host_undo_copy_lives_in_host_memory_and_restores_the_step_before(device):
    held = _held("host", device)
    sampler = synthetic_sampler(CONFIG, 1)
    batches = [global_batch_at(sampler, s, GLOBAL_BATCH) for s in range(2)]
    for b in batches:
        held.train_step(b)
    undo = held.tensors_at(1)
    assert all(t.device.type == "cpu" for t in undo.values())
    if device != "cpu":
        assert all(t.is_pinned() for t in undo.values())
    want, _ = reference_train(CONFIG, SEED, batches[:1], AdamWConfig())
    for name, ref in want.items():
        assert (undo[name].cpu() - ref).abs().max().item() <= 1e-12, name
    assert int(undo["optim.step"]) == 1


def test_undo_off_keeps_no_copy_and_a_switch_needing_one_names_it():
    held = _held("off")
    held.train_step(global_batch_at(synthetic_sampler(CONFIG, 1), 0, GLOBAL_BATCH))
    assert held.step == 1 and held.undo is None
    with pytest.raises(SwitchError, match="undo copy is off"):
        held.tensors_at(0)
    with pytest.raises(ConfigurationError, match="undo='gpu'; valid: 'device', 'host', 'off'"):
        _held("gpu")
    # rank 1 finished step 4 (state at 5) without an undo copy, rank 0 did not: rank 1 is no
    # owner, and a slice only it holds makes the switch name the missing undo copy
    holdings = [Holding(3, 4, 3, NO_STEP), Holding(3, 5, NO_STEP, NO_STEP)]
    decision = decide(holdings)
    assert decision.resume_step == 4 and decision.owners == (0,)
    assert _missing_undo(holdings, 4) == ("rank(s) [1] are at step 5 and keep no undo copy of "
                                          "step 4 (undo='off')")
    assert _missing_undo([Holding(3, 5, 4, NO_STEP), holdings[0]], 4) == ""


# ---------------------------------------------------------------------------- bf16
def test_compute_dtype_options_are_checked_in_one_line():
    assert BF16.mixed_precision and not CONFIG.mixed_precision
    assert ModelConfig.from_json(BF16.to_json()) == BF16
    assert "compute_dtype" not in CONFIG.to_json()  # configs without it serialise as before
    with pytest.raises(ModelConfigError, match="compute_dtype='bfloat16' with dtype='float64'"):
        ModelConfig(compute_dtype="bfloat16")
    with pytest.raises(ModelConfigError, match="compute_dtype='float16'"):
        ModelConfig(dtype="float32", compute_dtype="float16")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compute_trains_with_float32_master_weights_and_optimizer_state(device):
    plan = simple_plan(num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2)
    batch = global_batch_at(synthetic_sampler(BF16, 1), 0, GLOBAL_BATCH)
    model = SpecializedModel.build(BF16, plan, 0, seed=SEED, device=device)
    exact = SpecializedModel.build(ModelConfig(**{**BF16.__dict__, "compute_dtype": None}), plan,
                                   0, seed=SEED, device=device)
    losses = [model.step(batch) for _ in range(8)]
    first_exact = exact.step(batch)
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0] - 0.5, losses
    assert losses[0] != first_exact and abs(losses[0] - first_exact) < 0.05  # bf16, not fp32
    for name, (t, _ann) in model.state_tensors().items():
        want = torch.int64 if name == "optim.step" else torch.float32
        assert t.dtype == want and bool(torch.isfinite(t.float()).all()), name
    assert all(p.grad.dtype == torch.float32 for p in model.params.values())


def bf16_switch(rank: int, world: int, payload: dict) -> dict:
    """Train TP2 in bf16, move every state tensor to DP2 with one fused BSR, go on (on one
    batch, so the loss must keep falling across the switch)."""
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.state import state_specs
    from hspmd_elastic.reshard import TensorSpec, fused_bsr_schedule
    from hspmd_elastic.reshard.executor import execute_fused

    old, new = Plan.from_json(payload["old"]), Plan.from_json(payload["new"])
    sampler = synthetic_sampler(BF16, 1)
    comm = Comm.create(old, BF16, rank, timeout_s=30)
    model = SpecializedModel.build(BF16, old, rank, seed=SEED, comm=comm)
    losses = [model.step(rows_at(sampler, 0, GLOBAL_BATCH, model.batch_rows()))
              for _ in range(2)]
    before = {n: t.clone() for n, (t, _a) in model.state_tensors().items()}
    olds, news = state_specs(BF16, old), state_specs(BF16, new)
    specs = [TensorSpec(n, s.shape, s.dtype, olds[n].annotation, news[n].annotation)
             for n, s in news.items()]
    schedule = fused_bsr_schedule(specs, {0, 1}, {0: "node0", 1: "node0"})
    received, _stats = execute_fused(schedule, rank, before, "cpu", timeout_s=30)
    comm = Comm.create(new, BF16, rank, timeout_s=30)
    model = SpecializedModel.build(BF16, new, rank, state=received, comm=comm)
    losses += [model.step(rows_at(sampler, 0, GLOBAL_BATCH, model.batch_rows()))
               for _ in range(2)]
    return {"before": before, "received": received, "losses": losses,
            "after": {n: t.clone() for n, (t, _a) in model.state_tensors().items()}}


def test_bf16_state_moves_through_the_fused_bsr_as_float32():
    old = simple_plan(tp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2)
    new = simple_plan(dp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2)
    results = run_world(bf16_switch, 2, ({"old": old.to_json(), "new": new.to_json()},))
    for name in ("layers.1.attn.wq.weight", "layers.1.attn.wq.weight.exp_avg_sq",
                 "lm_head.weight.exp_avg", "layers.2.mlp.w_down.weight"):
        dim = 1 if "w_down" in name else 0
        full = torch.cat([results[0]["before"][name], results[1]["before"][name]], dim=dim)
        for r in results:  # DP2: each rank receives the whole tensor, bitwise
            assert r["received"][name].dtype == torch.float32
            assert torch.equal(r["received"][name], full), name
    for r in results:
        assert int(r["received"]["optim.step"]) == 2 and int(r["after"]["optim.step"]) == 4
        assert torch.equal(r["received"]["norm.weight"], results[0]["before"]["norm.weight"])
        assert all(t.dtype in (torch.float32, torch.int64) for t in r["after"].values())
        assert all(a > b for a, b in zip(r["losses"], r["losses"][1:])), r["losses"]
    assert results[0]["losses"] == results[1]["losses"]
