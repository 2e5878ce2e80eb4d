"""The pure parts of specialization, and the model on one process against the dense reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _graph import annotated_module
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.gradsync import sync_group_members, sync_ops
from hspmd_elastic.graph.init import full_params
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.pipeline import BACKWARD, FORWARD, StageLinks, one_f_one_b
from hspmd_elastic.graph.reference import reference_loss, reference_train
from hspmd_elastic.graph.specialize import SpecializedModel, StateError
from hspmd_elastic.graph.state import EXP_AVG, STEP, local_shapes, state_specs
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

CONFIG = ModelConfig()


def plan_of(pipelines, global_batch=8) -> Plan:
    return Plan(tuple(Pipeline(tuple(Stage(tuple(d), l) for d, l in stages), n, s)
                      for n, s, stages in pipelines), global_batch, CONFIG.num_layers)


HETERO = plan_of([(3, 2, [((0, 1), (0, 3)), ((2, 3), (3, 4))]), (1, 2, [((4,), (0, 4))])])


@settings(deadline=None)  # timing depends on a shared machine's load, not on the code
@given(st.integers(1, 6), st.integers(1, 9))
def test_one_f_one_b_runs_each_pass_once_and_bounds_in_flight(stages, microbatches):
    for stage in range(stages):
        ops = one_f_one_b(stages, stage, microbatches)
        assert sorted(m for d, m in ops if d == FORWARD) == list(range(microbatches))
        assert [m for d, m in ops if d == BACKWARD] == list(range(microbatches))
        in_flight = 0
        for i, (d, m) in enumerate(ops):
            in_flight += 1 if d == FORWARD else -1
            assert 0 <= in_flight <= stages - stage  # 1F1B keeps at most (stages - stage) alive
            if d == BACKWARD:
                assert (FORWARD, m) in ops[:i]


def test_one_f_one_b_first_stage_of_two():
    assert one_f_one_b(2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_stage_links_between_tp_degrees():
    stages = [(0,), (2, 1), (3,)]
    first, mid0, mid1, last = (StageLinks.of(stages, 0, 0), StageLinks.of(stages, 1, 0),
                               StageLinks.of(stages, 1, 1), StageLinks.of(stages, 2, 0))
    assert first.send_activation == (2, 1) and first.recv_gradient == 2
    assert mid0.recv_activation == 0 and mid1.recv_activation == 0
    assert mid0.send_gradient == (0,) and mid1.send_gradient == ()
    assert mid0.send_activation == (3,) and mid1.send_activation == ()
    assert mid0.recv_gradient == mid1.recv_gradient == 3
    assert last.recv_activation == 2 and last.send_gradient == (2, 1)  # both TP ranks need it


def _coverage(plan: Plan) -> None:
    """Every element of every parameter is summed over exactly one holder per pipeline."""
    layouts = plan.param_layouts(CONFIG)
    ops = {d: sync_ops(layouts, d) for d in plan.devices}
    for name, layout in layouts.items():
        count = torch.zeros(layout.shape)
        groups = {}
        for d in plan.devices:
            for op in (o for o in ops[d] if o.name == name):
                groups.setdefault(op.members, set()).add(d)
        # Every member of each group issues an operation on that group.
        assert all(set(members) == seen for members, seen in groups.items())
        for group in layout.groups:
            for i, d in enumerate(group):
                for op in (o for o in ops[d] if o.name == name):
                    if layout.split_dim is None:  # contributes its flat share of the whole
                        count.view(-1)[op.lo:op.hi].add_(1)
                    else:
                        rows = layout.shape[layout.split_dim] // len(group)
                        count.narrow(layout.split_dim, i * rows + op.lo, op.hi - op.lo).add_(1)
        expected = len(layout.groups) if len(layout.groups) > 1 else 0  # one replica: no sync
        assert torch.all(count == expected), name


@pytest.mark.parametrize("plan", [
    HETERO,
    plan_of([(2, 2, [((0, 1), (0, 4))]), (2, 2, [((2,), (0, 4))])]),
    plan_of([(2, 2, [((0,), (0, 1)), ((2, 1), (1, 4))]), (2, 2, [((3, 4), (0, 2)), ((5,), (2, 4))])]),
    simple_plan(dp=3, num_layers=4, global_batch=6),
])
def test_split_all_reduce_covers_each_slice_once_per_pipeline(plan):
    _coverage(plan)


@st.composite
def random_plans(draw):
    """Up to 3 pipelines with 1-4 stages each, TP 1 or 2 (device order shuffled), any layer cut."""
    pipelines, device = [], 0
    for _ in range(draw(st.integers(1, 3))):
        stages = draw(st.integers(1, 4))
        cuts = sorted(draw(st.sets(st.integers(1, 3), min_size=stages - 1, max_size=stages - 1)))
        bounds = [0, *cuts, CONFIG.num_layers]
        spec = []
        for lo, hi in zip(bounds, bounds[1:]):
            tp = draw(st.sampled_from([1, 2]))
            devices = list(range(device, device + tp))
            device += tp
            spec.append((devices[::-1] if draw(st.booleans()) else devices, (lo, hi)))
        pipelines.append((draw(st.integers(1, 3)), draw(st.integers(1, 2)), spec))
    return plan_of(pipelines, global_batch=sum(n * s for n, s, _ in pipelines))


@settings(deadline=None, max_examples=60)
@given(random_plans())
def test_random_plans_sync_layouts_and_json(plan):
    from hspmd_elastic.graph.comm import group_members

    assert Plan.from_json(plan.to_json()) == plan
    _coverage(plan)
    created = set(group_members(plan, CONFIG))
    layouts = plan.param_layouts(CONFIG)
    for d in plan.devices:
        assert all(op.members in created for op in sync_ops(layouts, d))
    _modules_match_annotations(plan)


def _modules_match_annotations(plan: Plan) -> None:
    """The shards each rank's StageModule allocates are the ones its annotations name."""
    for d in plan.devices:
        annotated_module(CONFIG, plan, d)


def test_split_all_reduce_groups_of_tp_4_2_2():
    wide = ModelConfig(num_heads=4)
    plan = plan_of([(2, 1, [((0, 1, 2, 3), (0, 4))]), (2, 1, [((4, 5), (0, 4))]),
                    (2, 1, [((6, 7), (0, 4))])], global_batch=6)
    members = sync_group_members(plan.param_layouts(wide))
    assert {(0, 4, 6), (1, 4, 6), (2, 5, 7), (3, 5, 7)} <= members
    assert tuple(range(8)) in members  # norm scales: all holders at once


def test_no_sync_within_one_pipeline():
    plan = simple_plan(tp=2, pp=2, num_layers=4, global_batch=8)
    assert all(not sync_ops(plan.param_layouts(CONFIG), d) for d in plan.devices)


def test_local_shapes_match_annotations():
    _modules_match_annotations(HETERO)
    shapes = local_shapes(CONFIG, HETERO, 3)
    assert shapes["layers.3.attn.wq.weight"] == shapes["layers.3.attn.wq.weight" + EXP_AVG] == (8, 16)
    assert shapes["lm_head.weight"] == (16, 16) and shapes[STEP] == ()
    assert "embed.weight" not in shapes and "layers.0.attn.wq.weight" not in shapes
    specs = state_specs(CONFIG, HETERO)
    assert specs[STEP].dtype == "int64" and specs["norm.weight"].dtype == "float64"


def test_initialisation_depends_on_seed_and_name_only():
    a, b, c = full_params(CONFIG, 3), full_params(CONFIG, 3), full_params(CONFIG, 4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert not torch.equal(a["layers.0.attn.wq.weight"], a["layers.0.attn.wk.weight"])


def _batches(count, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=gen)
            for _ in range(count)]


@pytest.mark.parametrize("microbatches", [1, 4])
def test_one_device_plan_matches_dense_reference(microbatches):
    batches = _batches(3)
    ref, ref_losses = reference_train(CONFIG, 1, batches, AdamWConfig())
    plan = simple_plan(num_layers=4, global_batch=8, num_microbatches=microbatches)
    model = SpecializedModel.build(CONFIG, plan, 0, seed=1)
    losses = [model.step(b) for b in batches]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-12
    for name, p in model.local_params().items():
        assert (p - ref[name]).abs().max().item() <= 1e-12, name


def test_reference_is_causal():
    params = full_params(CONFIG, 0)
    batch = _batches(1)[0]
    changed = batch.clone()
    changed[:, -1] = (changed[:, -1] + 1) % CONFIG.vocab_size  # only the last target changes

    def per_position(b):
        from hspmd_elastic.graph import reference as r
        x = params["embed.weight"][b[:, :-1]]
        for i in range(CONFIG.num_layers):
            x = r._layer(x, params, i, CONFIG)
        return x

    assert torch.equal(per_position(batch)[:, :-1], per_position(changed)[:, :-1])
    assert reference_loss(params, batch, CONFIG) != reference_loss(params, changed, CONFIG)


def test_state_tensors_round_trip_without_reinitialising():
    plan = simple_plan(num_layers=4, global_batch=8, num_microbatches=2)
    batches = _batches(4)
    model = SpecializedModel.build(CONFIG, plan, 0, seed=2)
    for b in batches[:2]:
        model.step(b)
    state = {n: t.clone() for n, (t, _a) in model.state_tensors().items()}
    anns = {n: a for n, (_t, a) in model.state_tensors().items()}
    assert anns == {n: s.annotation for n, s in state_specs(CONFIG, plan).items()}
    assert int(state[STEP]) == 2
    clone = SpecializedModel.build(CONFIG, plan, 0, seed=999, state=state)
    assert [model.step(b) for b in batches[2:]] == [clone.step(b) for b in batches[2:]]
    with pytest.raises(StateError, match="missing state tensors"):
        SpecializedModel.build(CONFIG, plan, 0, state={})
    bad = dict(state, **{"norm.weight": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(StateError, match=r"norm.weight has shape \(3,\); expected \(16,\)"):
        SpecializedModel.build(CONFIG, plan, 0, state=bad)
