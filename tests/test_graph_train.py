"""Specialized training equals single-device training, plan by plan, in real gloo worlds.

Each world runs several plans in turn; after 3 AdamW steps every parameter, gathered from its
shards through the plan's annotations, equals the dense reference trained on the same global
batches, to 1e-9 in float64, in every pipeline. The losses match too.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from _graph import train_each_plan
from _world import run_world
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

pytestmark = pytest.mark.multiproc

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=4, ffn_size=32,
                     seq_len=8)
SEED, BATCH_SEED, GLOBAL_BATCH, STEPS = 7, 11, 8, 3
TOL = 1e-9


def make_batches(config: ModelConfig, count: int, seed: int = BATCH_SEED) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (GLOBAL_BATCH, config.seq_len + 1), generator=gen)
            for _ in range(count)]


def plan_of(pipelines) -> Plan:
    """[(num_microbatches, microbatch_size, [(devices, (start, stop)), ...]), ...] -> Plan."""
    return Plan(tuple(Pipeline(tuple(Stage(tuple(d), l) for d, l in stages), n, s)
                      for n, s, stages in pipelines), GLOBAL_BATCH, CONFIG.num_layers)


# ---- workers (run inside the spawned processes) ----------------------------------------------

def train_plans(rank: int, world: int, payload: dict) -> list:
    batches = make_batches(ModelConfig.from_json(payload["config"]), payload["steps"])
    return train_each_plan(rank, payload, lambda model: [model.step(b) for b in batches])


def _barrier(timeout_s: float = 30.0) -> None:
    import torch.distributed as dist

    dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))


def train_then_switch(rank: int, world: int, payload: dict) -> dict:
    """Train plan A, move every state tensor to plan B through files and annotations only, go on."""
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel

    config = ModelConfig.from_json(payload["config"])
    batches = make_batches(config, payload["steps_a"] + payload["steps_b"])
    old, new = Plan.from_json(payload["plan_a"]), Plan.from_json(payload["plan_b"])
    comm = Comm.create(old, config, rank, timeout_s=30)
    losses = []
    if rank in old.devices:
        model = SpecializedModel.build(config, old, rank, seed=payload["seed"], comm=comm)
        losses = [model.step(b) for b in batches[:payload["steps_a"]]]
        state = {n: (t.clone(), a.to_json()) for n, (t, a) in model.state_tensors().items()}
        torch.save(state, os.path.join(payload["tmp"], f"state{rank}.pt"))
    _barrier()
    full = _gather_files(payload["tmp"], old)
    comm = Comm.create(new, config, rank, timeout_s=30)
    if rank not in new.devices:
        return {"losses": losses}
    mine = _slice_for(new, rank, full)
    model = SpecializedModel.build(config, new, rank, state=mine, comm=comm)
    losses += [model.step(b) for b in batches[payload["steps_a"]:]]
    return {"losses": losses, "params": model.local_params(),
            "step": int(model.optimizer.step_count)}


def _gather_files(tmp: str, plan: Plan) -> dict:
    """Full state tensors assembled from every device's shards, placed by their annotations."""
    from hspmd_elastic.annotations import TensorAnnotation
    from hspmd_elastic.graph.state import state_specs

    specs = state_specs(CONFIG, plan)
    full: dict[str, torch.Tensor] = {}
    for d in plan.devices:
        for name, (t, ann_json) in torch.load(os.path.join(tmp, f"state{d}.pt")).items():
            ann, shape = TensorAnnotation.from_json(ann_json), specs[name].shape
            assert ann == specs[name].annotation
            dest = full.setdefault(name, torch.zeros(shape, dtype=t.dtype))
            dest[tuple(slice(lo, hi) for lo, hi in ann.local_slices(d, shape))] = t
    return full


def _slice_for(plan: Plan, rank: int, full: dict) -> dict:
    """``rank``'s shards of the full state under ``plan``, cut by the plan's annotations."""
    from hspmd_elastic.graph.state import state_specs

    out = {}
    for name, spec in state_specs(CONFIG, plan).items():
        slices = spec.annotation.local_slices(rank, spec.shape)
        if slices is not None:
            out[name] = full[name][tuple(slice(lo, hi) for lo, hi in slices)].clone()
    return out


def silent_peer(rank: int, world: int, payload: dict) -> dict:
    """Rank 0 waits for a message rank 1 never sends; a custom waiter sees every wait."""
    import torch.distributed as dist

    from hspmd_elastic.graph.comm import Comm, CommTimeoutError, deadline_waiter

    plan = simple_plan(dp=2, num_layers=4, global_batch=GLOBAL_BATCH)
    seen = []
    inner = deadline_waiter(1.0)

    def waiter(work, what):
        seen.append(what)
        inner(work, what)

    comm = Comm.create(plan, CONFIG, rank, waiter=waiter)
    outcome = "none"
    if rank == 0:
        try:
            comm.recv(torch.empty(2), 1, tag=99)
        except CommTimeoutError as exc:
            outcome = "timeout" if "recv from rank 1 tag 99" in str(exc) else str(exc)
    # Rank 1 stays alive until rank 0 gave up (gloo closes the timed-out pair, so meet on a
    # separate group of the plan).
    work = dist.all_reduce(torch.ones(1), group=comm.group((0, 1)), async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=30))
    return {"outcome": outcome, "seen": seen}


def absent_peer(rank: int, world: int, payload: dict) -> dict:
    """Rank 1 never creates the plan's groups (it left for a newer plan); rank 0's creation is
    abandoned when ``aborted()`` turns true after 0.3 s, long before its 30 s timeout."""
    import time

    import torch.distributed as dist

    from hspmd_elastic.graph.comm import Comm, CommAborted

    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["absent_done"], datetime.timedelta(seconds=60))
        return {}
    plan = simple_plan(dp=2, num_layers=4, global_batch=GLOBAL_BATCH)
    start = time.monotonic()
    try:
        Comm.create(plan, CONFIG, rank, timeout_s=30.0, store=dist.PrefixStore("v9/", store),
                    aborted=lambda: time.monotonic() - start > 0.3)
        outcome = "created"
    except CommAborted:
        outcome = "aborted"
    finally:
        store.set("absent_done", "1")
    return {"outcome": outcome, "elapsed": time.monotonic() - start}


# ---- checks in the test process ---------------------------------------------------------------

_REFERENCE: dict = {}


def reference(steps: int):
    if steps not in _REFERENCE:
        _REFERENCE[steps] = reference_train(CONFIG, SEED, make_batches(CONFIG, steps), AdamWConfig())
    return _REFERENCE[steps]


def assert_matches_reference(plan: Plan, results: list, steps: int = STEPS) -> None:
    ref_params, ref_losses = reference(steps)
    for rank in plan.devices:
        got = results[rank]["losses"]
        assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, (rank, got, ref_losses)
    anns = plan.param_annotations(CONFIG)
    for name, ref in ref_params.items():
        ann = anns[name]
        for group in ann.groups.groups:  # one full replica per pipeline
            full = torch.full_like(ref, float("nan"))
            for d in group:
                slices = tuple(slice(lo, hi) for lo, hi in ann.local_slices(d, ref.shape))
                shard = results[d]["params"][name]
                assert shard.shape == full[slices].shape, (name, d)
                if not torch.isnan(full[slices]).all():  # a duplicate: must agree exactly
                    assert torch.equal(full[slices], shard), (name, d)
                full[slices] = shard
            err = (full - ref).abs().max().item()
            assert err <= TOL, f"{name} on pipeline {group.devices}: max error {err:.3g}"


def _run(world: int, plans: list[Plan]) -> None:
    results = run_world(train_plans, world,
                        ({"config": CONFIG.to_json(), "seed": SEED, "steps": STEPS,
                          "plans": [p.to_json() for p in plans]},))
    for i, plan in enumerate(plans):
        assert_matches_reference(plan, [r[i] for r in results])


def test_two_ranks_dp_tp_pp_and_uneven_dp():
    _run(2, [
        simple_plan(dp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2),
        simple_plan(tp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2),
        simple_plan(pp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=4),
        simple_plan(pp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=1),
        plan_of([(3, 2, [((0,), (0, 4))]), (1, 2, [((1,), (0, 4))])]),  # uneven DP 3:1
    ])


def test_four_ranks_tp2xpp2_and_pipelines_with_different_splits():
    _run(4, [
        simple_plan(tp=2, pp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=4),
        # Two pipelines split the layers differently: 1+3 against 3+1.
        plan_of([(2, 2, [((0,), (0, 1)), ((1,), (1, 4))]),
                 (2, 2, [((2,), (0, 3)), ((3,), (3, 4))])]),
        # TP2 in one pipeline against PP2 in the other.
        plan_of([(1, 4, [((0, 1), (0, 4))]), (2, 2, [((2,), (0, 2)), ((3,), (2, 4))])]),
    ])


def test_five_ranks_heterogeneous_tp2pp2_layers_3_1_against_tp1_microbatches_3_1():
    _run(5, [plan_of([(3, 2, [((0, 1), (0, 3)), ((2, 3), (3, 4))]),
                      (1, 2, [((4,), (0, 4))])])])


def test_six_ranks_activation_reshard_between_tp_degrees_and_device_order():
    _run(6, [plan_of([(2, 2, [((0,), (0, 1)), ((2, 1), (1, 4))]),  # TP1 -> TP2, unsorted group
                      (2, 2, [((3, 4), (0, 2)), ((5,), (2, 4))])])])  # TP2 -> TP1


def test_a_silent_peer_times_out_through_the_waiter():
    results = run_world(silent_peer, 2, ({},))
    assert results[0]["outcome"] == "timeout"
    assert results[0]["seen"] == ["recv from rank 1 tag 99"]


def test_creating_groups_is_abandoned_when_a_peer_never_comes():
    results = run_world(absent_peer, 2, ({},))
    assert results[0]["outcome"] == "aborted"
    assert 0.3 <= results[0]["elapsed"] < 15.0, results[0]  # not the 30 s group timeout


def test_switch_plans_through_annotations_continues_the_same_training(tmp_path):
    a = simple_plan(tp=2, pp=2, num_layers=4, global_batch=GLOBAL_BATCH, num_microbatches=2)
    # Device 2 leaves; the survivors regroup as one pipeline, TP2 (reordered) then TP1.
    b = plan_of([(4, 2, [((1, 0), (0, 3)), ((3,), (3, 4))])])
    results = run_world(train_then_switch, 4,
                        ({"config": CONFIG.to_json(), "seed": SEED, "steps_a": 3, "steps_b": 2,
                          "plan_a": a.to_json(), "plan_b": b.to_json(), "tmp": str(tmp_path)},))
    assert [r.get("step") for r in results] == [5, 5, None, 5]
    assert_matches_reference(b, results, steps=5)


def test_an_error_when_posting_is_a_comm_failure():
    """gloo can refuse to post an operation to a peer it already knows is gone; that must read
    as the same failure a wait reports (the runtime then waits for the next plan)."""
    from hspmd_elastic.graph.comm import Comm, CommTimeoutError

    def refuse():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore detail")

    with pytest.raises(CommTimeoutError, match="recv from rank 1 tag 7 failed: Connection closed"):
        Comm.post(refuse, "recv from rank 1 tag 7")
    assert Comm.post(lambda: "work", "send") == "work"
