"""In-step switching by length bucket (``hspmd_elastic.graph.bucketed``) on real gloo ranks.

A home plan (TP2) holds the parameters and the optimizer; the short bucket runs under DP2, the
middle one under PP2, the long one under the home plan: four layout switches per step
(parameters out and gradients back, twice). The parameters after every step equal the
single-device reference on the same global batches (float64, 1e-9), and so does the home plan
run alone. The comparison is shown to catch a skipped gradient transfer, and rows handed over
in the wrong bucket order are refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _world import run_world
from hspmd_elastic.bucket_data import BucketedDocuments
from hspmd_elastic.data import DataError
from hspmd_elastic.documents import DocumentSampler, open_documents, write_indexed
from hspmd_elastic.graph.bucketed import BucketedModel
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.model import document_masks
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan

pytestmark = pytest.mark.timeout(240)

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=12, dtype="float64")
SEED, STEPS, TOL = 5, 3, 1e-9
WINDOWS, ROWS = (4, 8, 12), (4, 2, 2)
GLOBAL_BATCH = sum(ROWS)


def corpus(prefix: str) -> None:
    """Documents of every length 2..20 (some truncated to 13 tokens), a few of each."""
    gen = np.random.default_rng(3)
    docs = [gen.integers(0, CONFIG.vocab_size, n) for n in list(range(2, 21)) * 3]
    write_indexed(prefix, docs)


def sampler(prefix: str, windows=WINDOWS, rows=ROWS, mode="truncate") -> BucketedDocuments:
    base = DocumentSampler(open_documents(prefix), CONFIG.seq_len, mode, seed=1,
                           vocab_size=CONFIG.vocab_size)
    return BucketedDocuments(base, windows, rows, seed=1)


def batches(sample: BucketedDocuments, steps: int = STEPS):
    out = []
    for s in range(steps):
        pairs = [sample.sample(s * GLOBAL_BATCH + j) for j in range(GLOBAL_BATCH)]
        out.append((torch.stack([t for t, _ in pairs]), torch.stack([g for _, g in pairs]).long()))
    return out


def counted(segments: torch.Tensor) -> int:
    return int(document_masks(segments)[1].sum())


def home_plan(pipelined: bool = False):
    """TP2 (or, ``pipelined``, PP2: each rank holds one stage's parameters only)."""
    if pipelined:
        return simple_plan(pp=2, num_layers=2, global_batch=GLOBAL_BATCH, num_microbatches=4)
    return simple_plan(tp=2, num_layers=2, global_batch=GLOBAL_BATCH, num_microbatches=2)


def bucket_plans(pipelined: bool = False, subset: bool = False):
    """Short: DP2 (rank 0 alone with ``subset``); middle: PP2 (TP2 under a pipelined home);
    long: the home plan's layout."""
    if subset:
        return [Plan((Pipeline((Stage((0,), (0, 2)),), 2, 2),), ROWS[0], 2),
                simple_plan(pp=2, num_layers=2, global_batch=ROWS[1], num_microbatches=2),
                simple_plan(tp=2, num_layers=2, global_batch=ROWS[2], num_microbatches=1)]
    if pipelined:
        return [simple_plan(dp=2, num_layers=2, global_batch=ROWS[0], num_microbatches=2),
                simple_plan(tp=2, num_layers=2, global_batch=ROWS[1], num_microbatches=1),
                simple_plan(pp=2, num_layers=2, global_batch=ROWS[2], num_microbatches=2)]
    return [simple_plan(dp=2, num_layers=2, global_batch=ROWS[0], num_microbatches=2),
            simple_plan(pp=2, num_layers=2, global_batch=ROWS[1], num_microbatches=2),
            simple_plan(tp=2, num_layers=2, global_batch=ROWS[2], num_microbatches=1)]


# ------------------------------------------------------------------------------ workers
def train(rank: int, world: int, payload: dict) -> dict:
    from hspmd_elastic.graph.bucketed import Bucket, create_comms
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel

    pipelined = payload["mode"] == "pipelined-home"
    config, home = CONFIG, home_plan(pipelined)
    starts = np.cumsum((0,) + ROWS[:-1])
    buckets = [Bucket(w, int(s), p) for w, s, p in zip(
        WINDOWS, starts, bucket_plans(pipelined, subset=payload["mode"] == "subset"))]
    comm = Comm.create(home, config, rank, timeout_s=30)
    comms = create_comms(home, buckets, config, rank,
                         lambda plan, cfg: Comm.create(plan, cfg, rank, timeout_s=30))
    model = SpecializedModel.build(config, home, rank, seed=SEED, comm=comm)
    kind = BucketedModel if payload["mode"] != "skip-grads" else SkipsGradients
    bucketed = kind(model, buckets, comms, timeout_s=30)
    packed = payload["mode"] == "packed"
    data = batches(sampler(payload["prefix"], mode="pack" if packed else "truncate"))
    if payload["mode"] == "wrong-order":  # the long rows first: the short bucket gets them
        data = [(t.flip(0), g.flip(0)) for t, g in data]
    losses, switches = [], []
    try:
        for tokens, seg in data:
            if payload["mode"] == "home":
                losses.append(model.step(tokens, segments=seg, real_tokens=counted(seg)))
            else:
                lo, hi = bucketed.rows_needed()
                losses.append(bucketed.step(tokens[lo:hi], seg[lo:hi], counted(seg)))
                switches.append(bucketed.stats.switches)
    except Exception as exc:  # noqa: BLE001 - the test reads the line
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"params": model.local_params(), "losses": losses, "switches": switches}


MODES = ("bucketed", "pipelined-home", "packed", "subset", "home", "skip-grads",
         "wrong-order")


def train_all(rank: int, world: int, prefix: str) -> dict:
    """Every mode of ``train`` in one world, one after the other (fresh groups and models)."""
    return {mode: train(rank, world, {"prefix": prefix, "mode": mode}) for mode in MODES}


class SkipsGradients(BucketedModel):
    """Drops the gradients of the middle bucket on their way home (a broken switcher)."""

    def _move(self, schedule, tensors, stats):
        out = super()._move(schedule, tensors, stats)
        if schedule is self._schedules[1][1]:
            return {n: torch.zeros_like(v) for n, v in out.items()}
        return out


# ------------------------------------------------------------------------------ checks
def worst_error(results: list, ref_params: dict, pipelined: bool = False) -> float:
    """The largest element error of the home shards against the reference; NaN or an element
    no rank holds fails at once."""
    anns = home_plan(pipelined).param_annotations(CONFIG)
    worst = 0.0
    for name, ref in ref_params.items():
        held = torch.zeros(ref.shape, dtype=torch.bool)
        for d in home_plan(pipelined).devices:
            ranges = anns[name].local_slices(d, ref.shape)
            if ranges is None:
                continue
            slices = tuple(slice(lo, hi) for lo, hi in ranges)
            shard = results[d]["params"][name]
            assert not torch.isnan(shard).any(), (name, d)
            worst = max(worst, (shard - ref[slices]).abs().max().item())
            held[slices] = True
        assert held.all(), f"{name}: elements no rank holds"
    return worst


def assert_trained_as(results: list, reference: tuple, pipelined: bool = False) -> None:
    """Every rank ran every step with four layout moves (two buckets out and back), its losses
    and the home shards equal the reference's (1e-9)."""
    ref_params, ref_losses = reference
    for r in results:
        assert "error" not in r, r
        assert r["switches"] == [4] * STEPS
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= TOL
    assert worst_error(results, ref_params, pipelined) <= TOL


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("docs") / "corpus")
    corpus(p)
    return p


@pytest.fixture(scope="module")
def runs(prefix) -> dict:
    """mode -> the ranks' results (one world runs every mode)."""
    results = run_world(train_all, 2, (prefix,))
    return {mode: [r[mode] for r in results] for mode in MODES}


@pytest.fixture(scope="module")
def reference(prefix):
    data = batches(sampler(prefix))
    return reference_train(CONFIG, SEED, [t for t, _ in data], AdamWConfig(),
                           [g for _, g in data])


def test_rows_are_grouped_by_bucket_and_keyed_by_the_sample_index(prefix):
    sample = sampler(prefix)
    for s in range(4):
        for j in range(GLOBAL_BATCH):
            (n,) = sample.lengths(s * GLOBAL_BATCH + j)
            b = sample.bucket_of(j)
            assert n <= WINDOWS[b] + 1 and (b == 0 or n > WINDOWS[b - 1] + 1), (s, j, n)
    again = sampler(prefix)
    assert torch.equal(again.sample(37)[0], sample.sample(37)[0])


@pytest.mark.parametrize("windows, rows, bad", [
    ((4, 12), (4,), "row count"),
    ((8, 4, 12), (1, 1, 1), "not strictly increasing"),
    ((4, 8), (4, 4), "max_len 12"),
    ((1, 12), (4, 4), "bucket 0 (documents of 1..2 tokens)"),
])
def test_bad_buckets_are_one_line(prefix, windows, rows, bad):
    if bad.startswith("bucket 0"):  # no document of 1..2 tokens: rebuild without length 2
        gen = np.random.default_rng(3)
        write_indexed(prefix + "-long", [gen.integers(0, 32, n) for n in range(3, 20)])
        with pytest.raises(DataError, match="holds no document") as err:
            sampler(prefix + "-long", windows, rows)
    else:
        with pytest.raises(DataError) as err:
            sampler(prefix, windows, rows)
    assert bad in str(err.value) and "\n" not in str(err.value)


def test_bucketed_steps_equal_the_single_plan_run(runs, reference):
    assert_trained_as(runs["bucketed"], reference)
    ref_params = reference[0]
    assert worst_error(runs["home"], ref_params) <= TOL


def test_documents_packed_within_each_bucket_train_as_the_reference(prefix, runs):
    sample = sampler(prefix, mode="pack")
    shared = 0
    for j in range(GLOBAL_BATCH):  # rows hold whole documents of their bucket only
        (tokens, seg), n = sample.sample(5 * GLOBAL_BATCH + j), sample.lengths(5 * GLOBAL_BATCH + j)
        b = sample.bucket_of(j)
        assert int((seg != 0).sum()) == sum(n) <= WINDOWS[b] + 1
        assert all(m <= WINDOWS[b] + 1 and (b == 0 or m > WINDOWS[b - 1] + 1) for m in n)
        shared += len(n) > 1
    assert shared, "no row packs two documents"
    data = batches(sample)
    assert_trained_as(runs["packed"], reference_train(
        CONFIG, SEED, [t for t, _ in data], AdamWConfig(), [g for _, g in data]))


def test_a_bucket_plan_may_leave_a_device_idle(runs, reference):
    """The short bucket on rank 0 alone: rank 1 sends its parameters, computes nothing for the
    bucket, gets its gradients back and the step's loss by one more all-reduce."""
    assert_trained_as(runs["subset"], reference)


def test_a_pipelined_home_plan_holds_each_stage_on_its_rank_only(runs, reference):
    assert_trained_as(runs["pipelined-home"], reference, pipelined=True)


def test_the_check_catches_a_skipped_gradient_transfer(runs, reference):
    assert worst_error(runs["skip-grads"], reference[0]) > 1e-6


def test_rows_in_the_wrong_bucket_order_are_refused(runs):
    for r in runs["wrong-order"]:
        assert "beyond bucket 0's window of 4" in r.get("error", ""), r


def test_a_script_grouping_other_buckets_and_a_bad_bucket_record_are_one_line(prefix):
    from hspmd_elastic.graph.bucketed import Bucket, buckets_from, check_sampler
    from hspmd_elastic.graph.comm import GraphError
    from hspmd_elastic.plan import PlanError

    starts = np.cumsum((0,) + ROWS[:-1])
    buckets = [Bucket(w, int(s), p) for w, s, p in zip(WINDOWS, starts, bucket_plans())]
    check_sampler(buckets, sampler(prefix))  # the same windows and rows: accepted
    with pytest.raises(GraphError) as err:
        check_sampler(buckets, sampler(prefix, (4, 12), (6, 2)))
    assert "windows [4, 8, 12] and rows [4, 2, 2], the script's data [4, 12] and [6, 2]" in \
        str(err.value) and "\n" not in str(err.value)
    entries = [{"window": b.window, "start": b.start, "strategy": b.plan.to_dict()}
               for b in buckets]
    assert [b.window for b in buckets_from(entries, 2)] == list(WINDOWS)
    for bad, named in (([{"window": 4}], "length bucket 0: KeyError"),
                       ([dict(entries[0], window="4")], "window='4'"),
                       (entries, "have ids 0..0")):
        with pytest.raises(PlanError) as err:
            buckets_from(bad, 1 if named.startswith("have") else 2)
        assert named in str(err.value) and "\n" not in str(err.value)
