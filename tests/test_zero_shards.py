"""Uneven (ZeRO-1 style) optimizer shards: the owner rule, training, switches and checkpoints.

The pure rule (``graph/zero.py``): every row of a split parameter has exactly one owner among
its holders, the shares follow the pipelines' rows, and the moments' boxes are what BSR, the
checkpoints and a Hugging Face start see; the owner's staged update is bitwise the replicated
one. Then one real gloo world of three ranks trains a heterogeneous plan (TP2 with 6 rows
against TP1 with 2) and moves its whole state by fused BSR through replicated -> uneven ->
uneven (another plan: PP2 against TP1, other rows) -> replicated; every parameter of every
pipeline equals the dense float64 reference to 1e-12, as do the losses. A checkpoint written
under the uneven plan reads back, under another uneven plan, the very tensors the BSR
delivered. The same run with one owner's update skipped must differ, or the checks could not
fail. Last, the elastic runtime (real etcd, real workers): an in-memory switch between uneven
plans, and the loss of a moment owner, which needs the checkpoint.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch

from _world import run_world
from hspmd_elastic.annotations import BoxAnnotation
from hspmd_elastic.graph import zero
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.gradsync import sync_ops
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.graph.state import EXP_AVG, EXP_AVG_SQ, local_shapes, state_specs
from hspmd_elastic.plan import Pipeline, Plan, PlanError, Stage
from hspmd_elastic.reshard import ReshardError, TensorSpec, fused_bsr_schedule

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=8)
SEED, BATCH_SEED, GLOBAL_BATCH = 7, 11, 8
TOL = 1e-12


def plan_of(pipelines, mode: str = "uneven") -> Plan:
    """[(num_microbatches, microbatch_size, [(devices, (start, stop)), ...]), ...] -> Plan."""
    return Plan(tuple(Pipeline(tuple(Stage(tuple(d), l) for d, l in stages), n, s)
                      for n, s, stages in pipelines), GLOBAL_BATCH, CONFIG.num_layers,
                optimizer_shards=mode)


# TP2 (6 rows) against TP1 (2 rows); the same layout replicated; PP2 (2 rows) against TP1 (6).
HETERO = [(3, 2, [((0, 1), (0, 2))]), (1, 2, [((2,), (0, 2))])]
OTHER = [(1, 2, [((0,), (0, 1)), ((1,), (1, 2))]), (3, 2, [((2,), (0, 2))])]
DP3 = [(1, 4, [((0,), (0, 2))]), (1, 2, [((1,), (0, 2))]), (1, 2, [((2,), (0, 2))])]
# (plan, steps under it): replicated -> uneven -> uneven (other plan) -> replicated
ROUTE = [(plan_of(HETERO, "replicated"), 2), (plan_of(HETERO), 2), (plan_of(OTHER), 2),
         (plan_of(DP3, "replicated"), 1)]


# ---- the pure rule ---------------------------------------------------------------------------

def test_every_row_has_one_owner_among_its_holders_with_shares_by_rows():
    plan = plan_of(HETERO)
    layouts = plan.param_layouts(CONFIG)
    cuts = zero.plan_cuts(plan, CONFIG)
    assert set(cuts) == {n for n, lay in layouts.items() if lay.split_dim is not None}
    anns = plan.param_annotations(CONFIG)
    for name, cut in cuts.items():
        dim, shape = layouts[name].split_dim, layouts[name].shape
        rows = [0] * shape[dim]
        for d, lo, hi in cut:
            held = anns[name].local_slices(d, shape)[dim]
            assert held[0] <= lo < hi <= held[1], (name, d, lo, hi, held)  # owner holds it
            for r in range(lo, hi):
                rows[r] += 1
        assert rows == [1] * shape[dim], name  # exactly one owner per row
        # pipeline 0 (6 of 8 rows) owns 3/4 of the rows, pipeline 1 (2 rows) 1/4
        share = {d: hi - lo for d, lo, hi in cut}
        assert share.get(0, 0) + share.get(1, 0) == shape[dim] * 3 // 4, (name, cut)
        assert share.get(2, 0) == shape[dim] // 4, (name, cut)


def test_the_rule_is_a_function_of_the_plan_and_gives_one_box_per_device():
    a, b = plan_of(HETERO), plan_of(HETERO)
    assert zero.plan_cuts(a, CONFIG) == zero.plan_cuts(b, CONFIG)
    for rank in a.devices:
        owned = zero.owned_ranges(a, CONFIG, rank)
        params = a.param_annotations(CONFIG)
        for name, box in owned.items():
            shape = param_specs(CONFIG)[name].shape
            held = params[name].local_slices(rank, shape)
            assert all(h0 <= lo <= hi <= h1 for (lo, hi), (h0, h1) in zip(box, held))
    # exact shares: TP rank 0 of the 6-row pipeline owns all its split rows, rank 1 half, the
    # 2-row TP1 device a quarter; norm scales (unsplit, 16 elements per norm) count whole
    fractions = [zero.update_fraction(a, CONFIG, d) for d in a.devices]
    held = [sum(math.prod(s) for n, s in local_shapes(CONFIG, a, d).items()
                if not n.endswith((EXP_AVG, EXP_AVG_SQ, "optim.step"))) for d in a.devices]
    moments = [sum(math.prod(s) for n, s in local_shapes(CONFIG, a, d).items()
                   if n.endswith(EXP_AVG)) for d in a.devices]
    assert fractions == [m / h for m, h in zip(moments, held)]
    assert fractions[0] == 1.0 and 0.5 < fractions[1] < 0.52 and 0.25 < fractions[2] < 0.27
    assert zero.update_fraction(plan_of(HETERO, "replicated"), CONFIG, 2) == 1.0


def test_a_member_may_own_no_row_and_replicated_mode_owns_the_whole_shard():
    # 7 rows against 1: a 16-row dim cuts at 14; device 2 (TP1) owns rows [14, 16) only, and
    # device 1 (rows [8, 16) of TP2) owns [8, 14); at 1:40 the TP2 pipeline owns no row
    plan = plan_of([(7, 1, [((0, 1), (0, 2))]), (1, 1, [((2,), (0, 2))])])
    cut = zero.plan_cuts(plan, CONFIG)["layers.0.attn.wq.weight"]
    assert cut == ((0, 0, 8), (1, 8, 14), (2, 14, 16))
    layout = plan.param_layouts(CONFIG)["layers.0.attn.wq.weight"]
    assert zero.owner_cuts(layout, (1, 40)) == ((2, 0, 16),)
    assert zero.owner_cuts(layout, (40, 1)) == ((0, 0, 8), (1, 8, 15), (2, 15, 16))  # floor
    replicated = plan_of(HETERO, "replicated")
    assert zero.plan_cuts(replicated, CONFIG) == {}
    anns = replicated.param_annotations(CONFIG)
    for name, box in zero.owned_ranges(replicated, CONFIG, 2).items():
        assert box == anns[name].local_slices(2, param_specs(CONFIG)[name].shape)


def test_unsplit_parameters_keep_replicated_moments_and_split_ones_get_boxes():
    plan = plan_of(HETERO)
    specs = state_specs(CONFIG, plan)
    assert specs["norm.weight" + EXP_AVG].annotation == specs["norm.weight"].annotation
    ann = specs["layers.0.mlp.w_gate.weight" + EXP_AVG_SQ].annotation
    assert isinstance(ann, BoxAnnotation)
    shapes = local_shapes(CONFIG, plan, 2)
    assert shapes["layers.0.mlp.w_gate.weight"] == (32, 16)  # the TP1 shard: whole
    assert shapes["layers.0.mlp.w_gate.weight" + EXP_AVG] == (8, 16)  # its quarter


def test_sync_ops_carry_the_owners_of_each_group():
    plan = plan_of(HETERO)
    ops = sync_ops(plan.param_layouts(CONFIG), 2, zero.plan_cuts(plan, CONFIG))
    wq = [op for op in ops if op.name == "layers.0.attn.wq.weight"]
    # device 2's whole shard [0, 16) meets device 0's half and device 1's half
    assert [(op.members, op.lo, op.hi, op.owners) for op in wq] == [
        ((0, 2), 0, 8, ((0, 0, 8),)), ((1, 2), 8, 16, ((1, 8, 12), (2, 12, 16)))]
    assert wq[0].rows_of(2) == (0, 0) and wq[1].rows_of(2) == (12, 16)
    norms = [op for op in ops if op.name == "norm.weight"]
    assert norms and all(not op.owners for op in norms)


def test_a_staged_update_of_owned_rows_is_the_in_place_update_of_those_rows():
    """Bitwise: the owner's staged update of rows [2, 8) equals the replicated in-place update
    of the same rows; rows it does not own and the state stay untouched until the commit."""
    from hspmd_elastic.graph.optim import ShardedAdamW

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, dtype=torch.float64, generator=gen)
    whole = {"w": torch.nn.Parameter(w.clone())}
    rows = {"w": torch.nn.Parameter(w.clone())}
    full, owner = ShardedAdamW(whole, AdamWConfig()), ShardedAdamW(rows, AdamWConfig(),
                                                                 {"w": (0, 2, 8)})
    assert owner.exp_avg["w"].shape == (6, 4)
    for _ in range(3):
        g = torch.randn(8, 4, dtype=torch.float64, generator=gen)
        whole["w"].grad, rows["w"].grad = g.clone(), g.clone()
        full.step()
        before = rows["w"].data.clone()
        staged = owner.staged_step()
        assert torch.equal(rows["w"].data, before)  # nothing changes before the commit
        owner.commit(staged)
    assert torch.equal(rows["w"].data[2:], whole["w"].data[2:])
    assert torch.equal(rows["w"].data[:2], w[:2])  # not owned: not updated here
    assert torch.equal(owner.exp_avg["w"], full.exp_avg["w"][2:])
    assert torch.equal(owner.exp_avg_sq["w"], full.exp_avg_sq["w"][2:])
    assert int(owner.step_count) == int(full.step_count) == 3


def test_a_plan_carries_its_optimizer_shards_in_json_only_when_uneven():
    uneven, replicated = plan_of(HETERO), plan_of(HETERO, "replicated")
    assert uneven != replicated
    assert "optimizer_shards" not in replicated.to_dict()
    assert Plan.from_json(uneven.to_json()) == uneven
    assert Plan.from_json(replicated.to_json()).optimizer_shards == "replicated"
    assert uneven.relabel({0: 5, 1: 6, 2: 7}).optimizer_shards == "uneven"
    assert replicated.with_optimizer_shards("uneven") == uneven
    assert uneven.with_optimizer_shards("uneven") is uneven
    with pytest.raises(PlanError, match="optimizer_shards='zero'; valid: 'replicated', 'uneven'"):
        plan_of(HETERO, "zero")
    with pytest.raises(PlanError, match="optimizer_shards='zero'"):
        replicated.with_optimizer_shards("zero")


def test_losing_a_moment_owner_is_a_reshard_error_even_when_the_parameters_survive():
    old, new = plan_of(HETERO), plan_of([(4, 2, [((0, 1), (0, 2))])], "replicated")
    old_specs, new_specs = state_specs(CONFIG, old), state_specs(CONFIG, new)
    specs = [TensorSpec(n, s.shape, s.dtype, old_specs[n].annotation, new_specs[n].annotation)
             for n, s in new_specs.items()]
    node = {d: "n0" for d in range(3)}
    fused_bsr_schedule(specs, {0, 1, 2}, node)  # everyone alive: plannable
    with pytest.raises(ReshardError) as err:
        fused_bsr_schedule(specs, {0, 1}, node)  # device 2 died: its rows' moments are gone
    lost = {name for name, _ in err.value.missing}
    assert lost and all(n.endswith((EXP_AVG, EXP_AVG_SQ)) for n in lost), lost
    assert "layers.0.attn.wq.weight" + EXP_AVG in lost


def test_a_switch_reads_uneven_moments_from_two_plan_versions():
    """b:0 committed the uneven v2 (alone, owning everything); a:0 still holds the uneven v1's
    TP half with its owned rows: the moments' old annotation is the union of their boxes."""
    from hspmd_elastic.elastic import agree

    v1 = plan_of(HETERO)
    v2 = Plan((Pipeline((Stage((0,), (0, 2)),), 1, GLOBAL_BATCH),), GLOBAL_BATCH,
              CONFIG.num_layers, optimizer_shards="uneven")
    sources = [agree.Source(1, v1, ("a:0", "a:1", "b:0")), agree.Source(2, v2, ("b:0",))]
    holdings = [agree.Holding(1, 3, 2), agree.Holding(2, 3, agree.NO_STEP), agree.Holding()]
    owners = agree.decide(holdings).owners
    specs, nodes = agree.reshard_request(CONFIG, sources, holdings, owners, ["a:0", "b:0", "c:0"],
                                         plan_of(DP3))
    m = next(s for s in specs if s.name == "layers.0.attn.wq.weight" + EXP_AVG)
    assert isinstance(m.old, BoxAnnotation)
    # v1: a:0 -> rank 0 owns rows [0, 8); a:1 and v1's b:0 are dead ids; v2: b:0 -> rank 1, all
    assert m.old.local_slices(0, m.shape) == ((0, 8), (0, 16))
    assert m.old.local_slices(1, m.shape) == ((0, 16), (0, 16))
    fused_bsr_schedule(specs, owners, nodes)  # every slice has a live owner


def test_a_hugging_face_start_gives_each_rank_its_owned_moments(tmp_path):
    from safetensors.torch import save_file

    from hspmd_elastic.graph.init import full_params
    from hspmd_elastic.hf import hf_names, initial_state_from_hf

    names = hf_names(CONFIG)
    save_file({names[n]: t.contiguous() for n, t in full_params(CONFIG, SEED).items()},
              str(tmp_path / "model.safetensors"))
    plan = plan_of(HETERO)
    for rank in plan.devices:
        state = initial_state_from_hf(str(tmp_path), CONFIG, plan, rank)
        assert {n: tuple(t.shape) for n, t in state.items()} == local_shapes(CONFIG, plan, rank)
        assert state["layers.0.attn.wq.weight" + EXP_AVG].shape[0] == (8, 4, 4)[rank]


# ---- real gloo worlds ------------------------------------------------------------------------

def make_batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(BATCH_SEED)
    return [torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1),
                          generator=gen) for _ in range(count)]


def _barrier(timeout_s: float = 60.0) -> None:
    import torch.distributed as dist

    dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))


def _skip_update(model) -> None:
    """Test hook: this rank's staged updates leave its owned rows of split parameters as they
    were (what an owner that forgot its share would do)."""
    optimizer = model.optimizer
    staged_step = optimizer.staged_step

    def skipped():
        staged = staged_step()
        for name in optimizer.owned:
            staged.params[name] = optimizer.own(name, optimizer.params[name].data).clone()
        return staged

    optimizer.staged_step = skipped


def _move(model, old: Plan, new: Plan, rank: int) -> dict:
    from hspmd_elastic.reshard.executor import execute_fused

    old_specs, new_specs = state_specs(CONFIG, old), state_specs(CONFIG, new)
    specs = [TensorSpec(n, s.shape, s.dtype, old_specs[n].annotation, new_specs[n].annotation)
             for n, s in new_specs.items()]
    schedule = fused_bsr_schedule(specs, old.devices, {d: "n0" for d in old.devices})
    local = {n: t for n, (t, _ann) in model.state_tensors().items()}
    received, _stats = execute_fused(schedule, rank, local, timeout_s=60)
    return received


def train_route(rank: int, world: int, payload: dict) -> dict:
    from hspmd_elastic.elastic.checkpoint import CheckpointWriter, load_shards
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel

    route = [(Plan.from_json(text), steps) for text, steps in payload["route"]]
    batches = make_batches(sum(steps for _plan, steps in route))
    losses, done, model, prev, checked = [], 0, None, None, None
    writer = CheckpointWriter(payload["ckpt"], every=1, keep=0)
    for plan, steps in route:
        state = None if model is None else _move(model, prev, plan, rank)
        if state is not None and checked is None and prev.optimizer_shards == "uneven" \
                and plan.optimizer_shards == "uneven":
            # the checkpoint written under ``prev`` reads back as what the BSR delivered
            got = load_shards(payload["ckpt"], done, CONFIG, plan, rank)
            checked = sorted(got) == sorted(state) and all(
                torch.equal(got[n], state[n]) for n in state)
        comm = Comm.create(plan, CONFIG, rank, timeout_s=60)
        model = SpecializedModel.build(CONFIG, plan, rank, seed=SEED, state=state, comm=comm)
        if rank == payload.get("skip_rank") and plan.optimizer_shards == "uneven":
            _skip_update(model)
        for batch in batches[done:done + steps]:
            losses.append(model.step(batch))
        done += steps
        if plan.optimizer_shards == "uneven" and checked is None:
            local = {n: t for n, (t, _ann) in model.state_tensors().items()}
            writer.submit(done, CONFIG, plan, rank, local)
            assert writer.flush(60) and not writer.errors, writer.errors
        _barrier()
        prev = plan
    moments = {n: t.numel() for n, (t, _a) in model.state_tensors().items()
               if n.endswith(EXP_AVG)}
    return {"params": model.local_params(), "losses": losses, "checked": checked,
            "step": int(model.optimizer.step_count), "moments": moments}


_REFERENCE: dict = {}


def reference(steps: int):
    if steps not in _REFERENCE:
        _REFERENCE[steps] = reference_train(CONFIG, SEED, make_batches(steps), AdamWConfig())
    return _REFERENCE[steps]


def assert_matches_reference(plan: Plan, results: list, steps: int) -> None:
    """Every parameter of every pipeline, assembled from its shards, equals the reference; a
    missing shard or a NaN fails."""
    ref_losses = reference(steps)[1]
    for rank in plan.devices:
        got = results[rank]["losses"]
        assert len(got) == steps and max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL
    assert_params_match(plan, results, steps)


def assert_params_match(plan: Plan, results: list, steps: int) -> None:
    ref_params = reference(steps)[0]
    anns = plan.param_annotations(CONFIG)
    for name, ref in ref_params.items():
        for group in anns[name].groups.groups:
            full = torch.full_like(ref, float("nan"))
            for d in group:
                cut = tuple(slice(lo, hi) for lo, hi in anns[name].local_slices(d, ref.shape))
                full[cut] = results[d]["params"][name]
            err = (full - ref).abs().max().item()
            assert not math.isnan(err) and err <= TOL, f"{name} on {group.devices}: {err:.3g}"


def _route_payload(tmp_path, skip_rank=None) -> dict:
    return {"route": [(p.to_json(), s) for p, s in ROUTE], "ckpt": str(tmp_path / "ckpt"),
            "skip_rank": skip_rank}


@pytest.mark.multiproc
def test_uneven_shards_through_switches_equal_the_dense_reference(tmp_path):
    results = run_world(train_route, 3, (_route_payload(tmp_path),), timeout_s=240)
    steps = sum(s for _p, s in ROUTE)
    assert [r["step"] for r in results] == [steps] * 3
    assert_matches_reference(ROUTE[-1][0], results, steps)
    assert [r["checked"] for r in results] == [True] * 3


@pytest.mark.multiproc
def test_a_skipped_owner_update_is_seen(tmp_path):
    """Rank 2 skips its owned rows' updates under the uneven plans: the run must differ."""
    results = run_world(train_route, 3, (_route_payload(tmp_path, skip_rank=2),), timeout_s=240)
    steps = sum(s for _p, s in ROUTE)
    assert [r["checked"] for r in results] == [True] * 3  # the checkpoint still reads back
    with pytest.raises(AssertionError, match="on \\("):  # a parameter, not only the losses
        assert_params_match(ROUTE[-1][0], results, steps)
    with pytest.raises(AssertionError):
        assert_matches_reference(ROUTE[-1][0], results, steps)


# ---- the elastic runtime: real etcd, real workers, real SIGKILL ------------------------------

def _uneven(plan: Plan) -> Plan:
    return Plan(plan.pipelines, plan.global_batch, plan.num_layers, plan.seq_len, "uneven")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_elastic_switch_from_uneven_to_uneven_moves_the_moments_in_memory(elastic_job):
    """A replan of the same devices (rows 2:2 -> 3:1, other owners): the runtime's switch moves
    the moments by BSR, no checkpoint, and the run equals the reference."""
    from _elastic import assert_matches_reference as job_matches_reference
    from _elastic import hetero_plan, payload

    pl = payload()
    job = elastic_job(pl)
    devices = ["n0:0", "n0:1", "n1:0"]
    for d in devices:
        job.spawn(d)
    first = _uneven(hetero_plan())
    job.publish(first, devices, reason="start")
    job.wait_step(devices, 2)
    second = Plan((Pipeline(first.pipelines[0].stages, 1, 3),
                   Pipeline(first.pipelines[1].stages, 1, 1)), 4, 2, optimizer_shards="uneven")
    job.publish(second, devices, reason="speeds")
    job.release()
    results = job.join_ok(devices, timeout=60)
    for d in devices:
        r = results[d]
        assert r["steps_done"] == 5 and r["plan_version"] == 2
        assert r["switches"][-1]["source"] == "bsr"
    # replicated, a change of rows alone moves nothing; uneven, the owners change
    assert sum(results[d]["switches"][-1]["bsr_bytes_received"] for d in devices) > 0
    job_matches_reference(results.values(), pl, tol=TOL)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_elastic_loss_of_a_moment_owner_reads_the_checkpoint(elastic_job, tmp_path):
    """The TP1 device dies: every parameter survives on the TP2 pipeline, but the moments of the
    rows it owned had one copy, so the switch reads the checkpoint (which every device wrote
    its own boxes of), says why, and the run still equals the reference."""
    from _elastic import JOB, hetero_plan, payload
    from _elastic import assert_matches_reference as job_matches_reference
    from _wait import wait_for
    from hspmd_elastic.coord import read_events
    from hspmd_elastic.elastic.checkpoint import latest_complete

    ckpt = str(tmp_path / "ckpt")
    pl = payload(checkpoint_dir=ckpt, checkpoint_every=1)
    job = elastic_job(pl)
    devices = ["n0:0", "n0:1", "n1:0"]
    for d in devices:
        job.spawn(d)
    job.publish(_uneven(hetero_plan()), devices, reason="start")
    job.wait_step(devices, 2)
    wait_for(lambda: latest_complete(ckpt) >= 2, 30, "the checkpoint of step 2")
    job.kill("n1:0")
    survivors = ["n0:0", "n0:1"]
    tp2 = Plan((Pipeline((Stage((0, 1), (0, 2)),), 1, 4),), 4, 2, optimizer_shards="uneven")
    job.publish(tp2, survivors, reason="failure")
    job.release()
    results = job.join_ok(survivors, timeout=60)
    for d in survivors:
        r = results[d]
        assert r["switches"][-1]["source"] == "checkpoint" and r["steps_done"] == 5
    events = [e for e in read_events(job.client, JOB) if e.type == "fallback"]
    assert events and "no live owner" in events[0].detail["error"]
    assert EXP_AVG in events[0].detail["error"]
    job_matches_reference(results.values(), pl, tol=TOL)
