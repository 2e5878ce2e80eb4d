"""Rows that pack several documents (``hspmd_elastic.graph.model.document_masks``): attention
never crosses a document boundary, the loss counts only the targets that continue a real
document, and every plan (DP, TP, PP, uneven DP) trains exactly what the dense reference trains
on the same packed batches (float64, 1e-9)."""

from __future__ import annotations

import pytest
import torch

from _graph import train_each_plan
from _world import run_world
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.init import full_params
from hspmd_elastic.graph.model import document_masks
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_loss, reference_train
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

pytestmark = pytest.mark.timeout(180)

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=12)
SEED, GLOBAL_BATCH, STEPS, TOL = 5, 8, 3, 1e-9


def packed_batch(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``seq_len + 1`` tokens packing documents of random lengths (1..), then padding
    (segment 0) at the end of some rows."""
    width = CONFIG.seq_len + 1
    tokens = torch.randint(0, CONFIG.vocab_size, (rows, width), generator=gen)
    segments = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        pos, doc = 0, 1
        end = width - int(torch.randint(0, 4, (1,), generator=gen))
        while pos < end:
            n = min(int(torch.randint(2, 7, (1,), generator=gen)), end - pos)
            segments[r, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return tokens, segments


def batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(17)
    return [packed_batch(gen, GLOBAL_BATCH) for _ in range(steps)]


def real_tokens(segments: torch.Tensor) -> int:
    return int(document_masks(segments)[1].sum())


# ------------------------------------------------------------------------------ pure parts
def test_masks_keep_attention_and_loss_inside_each_document():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0]])
    mask, weights = document_masks(seg)
    assert mask.shape == (1, 1, 6, 6) and weights.shape == (1, 6)
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False]
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[0, 0].diagonal().all()  # no empty softmax row, padding included
    assert mask[0, 0, 5].tolist() == [False] * 5 + [True]  # padding sees itself only
    # a target counts when it continues its input's document: not across the 1|2 boundary,
    # not the padding
    assert weights[0].tolist() == [True, True, False, True, False, False]


def test_a_packed_row_computes_what_its_documents_compute_one_at_a_time():
    params = full_params(CONFIG.__class__(**{**CONFIG.__dict__, "dtype": "float64"}), SEED)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(3))
    seg = torch.tensor([[1] * 5 + [2] * 6 + [0] * 2])
    packed = reference_loss(params, tokens, CONFIG, seg) * real_tokens(seg)
    alone = 0.0
    for lo, hi in ((0, 5), (5, 11)):  # each document by itself, plain causal attention
        doc = tokens[:, lo:hi]
        alone = alone + reference_loss(params, doc, CONFIG) * (hi - lo - 1)
    assert abs(float(packed) - float(alone)) <= 1e-12, (float(packed), float(alone))
    # without the segments the same row is one long sequence: a different loss
    assert abs(float(reference_loss(params, tokens, CONFIG)) * 12 - float(alone)) > 1e-6


# ------------------------------------------------------------------------------ every plan
def train_packed(rank: int, world: int, payload: dict) -> list:
    return train_each_plan(rank, payload, lambda model: [
        model.step(tokens, segments=seg, real_tokens=real_tokens(seg))
        for tokens, seg in batches()])


def test_every_plan_trains_packed_documents_as_the_reference_does():
    plans = [
        simple_plan(dp=2, num_layers=2, global_batch=GLOBAL_BATCH, num_microbatches=2),
        simple_plan(tp=2, num_layers=2, global_batch=GLOBAL_BATCH, num_microbatches=2),
        simple_plan(pp=2, num_layers=2, global_batch=GLOBAL_BATCH, num_microbatches=4),
        Plan((Pipeline((Stage((0,), (0, 2)),), 3, 2), Pipeline((Stage((1,), (0, 2)),), 1, 2)),
             GLOBAL_BATCH, 2),  # uneven DP 3:1
    ]
    results = run_world(train_packed, 2, ({"config": CONFIG.to_json(), "seed": SEED,
                                           "plans": [p.to_json() for p in plans]},))
    data = batches()
    ref_params, ref_losses = reference_train(CONFIG, SEED, [t for t, _ in data], AdamWConfig(),
                                             [s for _, s in data])
    for i, plan in enumerate(plans):
        for rank in plan.devices:
            got = results[rank][i]["losses"]
            assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, (plan, got)
        anns = plan.param_annotations(CONFIG)
        for name, ref in ref_params.items():
            held = torch.zeros(ref.shape, dtype=torch.bool)
            for d in plan.devices:
                ranges = anns[name].local_slices(d, ref.shape)
                if ranges is None:  # a stage without this parameter
                    continue
                slices = tuple(slice(lo, hi) for lo, hi in ranges)
                shard = results[d][i]["params"][name]
                assert not torch.isnan(shard).any(), (name, d)
                err = (shard - ref[slices]).abs().max().item()
                assert err <= TOL, f"{name} on rank {d} under plan {i}: {err:.3g}"
                held[slices] = True
            assert held.all(), f"{name}: elements no rank holds under plan {i}"
