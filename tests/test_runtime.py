"""The worker runtime's pure parts and single-process mechanics: lifecycle, environment,
progress reports, the resume-step agreement, id mapping, the one-step undo copy and checkpoints
read back under another plan."""

from __future__ import annotations

import json

import pytest
import torch

from hspmd_elastic.coord.contract import worker_record
from hspmd_elastic.elastic import agree
from hspmd_elastic.elastic.agree import Holding, decide
from hspmd_elastic.elastic.api import (ConfigurationError, FileReporter, IllegalTransition,
                                       Lifecycle, WorkerIdentity, WorkerProgress, WorkerState)
from hspmd_elastic.elastic.checkpoint import CheckpointWriter, latest_complete, load_shards
from hspmd_elastic.graph.comm import CommTimeoutError
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.init import full_params
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.graph.specialize import SpecializedModel
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from hspmd_elastic.reshard import fused_bsr_schedule
from hspmd_elastic.runtime import gather_full, global_batch_at, synthetic_sampler
from hspmd_elastic.switch import Held

CONFIG = ModelConfig(num_layers=2)


# ---------------------------------------------------------------------------- lifecycle
def test_lifecycle_allows_the_switch_path_and_rejects_shortcuts():
    life = Lifecycle()
    for s in (WorkerState.REGROUPING, WorkerState.EXCHANGING, WorkerState.WAITING_PLAN,
              WorkerState.REGROUPING, WorkerState.EXCHANGING, WorkerState.RESHARDING,
              WorkerState.BUILDING, WorkerState.TRAINING, WorkerState.FINISHING,
              WorkerState.DONE):
        life.to(s)
    assert life.history[-1].state is WorkerState.DONE
    with pytest.raises(IllegalTransition, match="done -> training"):
        life.to(WorkerState.TRAINING)
    with pytest.raises(IllegalTransition, match="waiting_plan -> training"):
        Lifecycle().to(WorkerState.TRAINING)


def test_identity_from_env_names_what_is_missing():
    env = {"HSPMD_ETCD_ENDPOINTS": "127.0.0.1:2379", "HSPMD_JOB_ID": "j", "HSPMD_NODE_ID": "n3",
           "LOCAL_RANK": "1"}
    assert WorkerIdentity.from_env(env).device == "n3:1"
    with pytest.raises(ConfigurationError, match="HSPMD_NODE_ID"):
        WorkerIdentity.from_env({k: v for k, v in env.items() if k != "HSPMD_NODE_ID"})
    with pytest.raises(ConfigurationError, match="LOCAL_RANK='x'"):
        WorkerIdentity.from_env(dict(env, LOCAL_RANK="x"))


def test_file_reporter_writes_a_worker_record_compatible_report(tmp_path):
    path = tmp_path / "progress.json"
    progress = WorkerProgress(pid=7, global_rank=2, local_rank=1, plan_version=3, step=11,
                              last_progress_at=1.5, steps_per_s=2.0)
    FileReporter(str(path)).report(progress)
    assert json.loads(path.read_text())["step"] == 11
    record = worker_record(progress)
    assert (record.plan_version, record.global_rank) == (3, 2)


# ---------------------------------------------------------------------------- agreement
def test_resume_at_the_smallest_step_and_roll_back_the_rank_ahead():
    holdings = [Holding(1, 5, 4), Holding(1, 4, 3), Holding()]  # rank 2 joins
    d = decide(holdings)
    assert (d.source_version, d.resume_step, d.owners, d.rollback) == (1, 4, (0, 1), (0,))


def test_unrollable_holders_are_not_owners_and_older_versions_are():
    # rank 1 holds the same step in the previous plan's layout; rank 2 is two steps ahead.
    holdings = [Holding(2, 6, 5), Holding(1, 6, 5), Holding(2, 8, 7)]
    d = decide(holdings)
    assert (d.source_version, d.resume_step, d.owners, d.rollback) == (2, 6, (0, 1), ())


def test_nobody_holds_state_is_a_fresh_start():
    d = decide([Holding(checkpoint_step=4), Holding(checkpoint_step=2)])
    assert d.fresh and agree.checkpoint_step([Holding(checkpoint_step=4),
                                              Holding(checkpoint_step=2)]) == 2


def test_old_ids_map_through_device_strings_and_dead_devices_get_unused_ids():
    old = ["a:0", "a:1", "b:0"]
    new = ["b:0", "a:0", "c:0"]  # a:1 died, c:0 joins, b:0 and a:0 are renumbered
    mapping = agree.old_to_new_ids(old, new, owners=[0, 1])
    assert mapping == {0: 1, 1: 4, 2: 0}
    relabelled = HETERO.relabel(mapping)
    assert [s.devices for p in relabelled.pipelines for s in p.stages] == [(1, 4), (0,)]


HETERO = Plan((Pipeline((Stage((0, 1), (0, 2)),), 1, 2), Pipeline((Stage((2,), (0, 2)),), 1, 2)),
              global_batch=4, num_layers=2)


def test_reshard_request_reads_owners_of_two_plan_versions():
    """b:0 committed v2 (one device, everything); a:0 still holds v1's TP half of pipeline 0."""
    new = ["a:0", "b:0", "c:0"]
    sources = [agree.Source(1, HETERO, ("a:0", "a:1", "b:0")),
               agree.Source(2, simple_plan(num_layers=2, global_batch=4), ("b:0",))]
    holdings = [Holding(1, 3, 2), Holding(2, 3, agree.NO_STEP), Holding()]
    owners = decide(holdings).owners
    assert owners == (0, 1)
    specs, nodes = agree.reshard_request(CONFIG, sources, holdings, owners, new,
                                         simple_plan(dp=3, num_layers=2, global_batch=6))
    wq = next(s for s in specs if s.name == "layers.0.attn.wq.weight")
    # v1: a:0 -> rank 0 (TP half), a:1 dead (3 + 1), b:0 holds v2 so its v1 slot is dead (3 + 2);
    # v2: b:0 -> rank 1 (full replica).
    assert [tuple(g) for g in wq.old.groups.groups] == [(0, 4), (5,), (1,)]
    assert wq.old.local_slices(0, wq.shape) == ((0, 8), (0, 16))
    assert wq.old.local_slices(1, wq.shape) == ((0, 16), (0, 16))
    assert nodes == {0: "a", 1: "b", 2: "c", 4: "a", 5: "b"}
    fused_bsr_schedule(specs, owners, nodes)  # every slice has a live owner


# ---------------------------------------------------------------------------- undo copy
def test_undo_copy_restores_the_state_before_the_last_step():
    sample = synthetic_sampler(CONFIG, 1)
    plan = simple_plan(num_layers=2, global_batch=2)
    model = SpecializedModel.build(CONFIG, plan, 0, seed=5)
    held = Held(1, plan, ["n:0"], model)
    batches = [global_batch_at(sample, s, 2) for s in range(2)]
    for batch in batches:
        before = held.snapshot()
        model.step(batch)
        held.commit(before)
    assert held.step == 2 and held.undo[0] == 1
    at_one = held.tensors_at(1)
    want, _ = reference_train(CONFIG, 5, batches[:1], AdamWConfig())
    for name, ref in want.items():
        assert torch.allclose(at_one[name], ref, atol=1e-12, rtol=0)
    assert int(at_one["optim.step"]) == 1
    with pytest.raises(Exception, match="not 0"):
        held.tensors_at(0)


def test_train_step_keeps_the_undo_copy_in_reused_buffers_and_only_for_completed_steps():
    sample = synthetic_sampler(CONFIG, 1)
    plan = simple_plan(num_layers=2, global_batch=2)
    held = Held(1, plan, ["n:0"], SpecializedModel.build(CONFIG, plan, 0, seed=5))
    batches = [global_batch_at(sample, s, 2) for s in range(3)]
    held.train_step(batches[0])
    buffer = held.undo[1]["layers.0.attn.wq.weight"]
    held.train_step(batches[1])
    assert held.step == 2 and held.undo[0] == 1
    assert held.undo[1]["layers.0.attn.wq.weight"] is buffer  # copied into, not reallocated
    want, _ = reference_train(CONFIG, 5, batches[:1], AdamWConfig())
    for name, ref in want.items():
        assert torch.allclose(held.tensors_at(1)[name], ref, atol=1e-12, rtol=0)
    assert int(held.tensors_at(1)["optim.step"]) == 1
    def lost_peer(*_args):
        raise CommTimeoutError("injected: the step's last all-reduce failed")

    held.model.comm.all_reduce = lost_peer  # the step fails in its last communication
    with pytest.raises(CommTimeoutError, match="injected"):
        held.train_step(batches[2])
    assert held.step == 2 and held.undo[0] == 1 and int(held.undo[1]["optim.step"]) == 1


# ---------------------------------------------------------------------------- checkpoints
def _local_state(plan, rank, params):
    out = {}
    for name, spec in state_specs(CONFIG, plan).items():
        ranges = spec.annotation.local_slices(rank, spec.shape)
        if ranges is None:
            continue
        base = name.removesuffix(".exp_avg").removesuffix(".exp_avg_sq")
        full = params[base] * (2 if name.endswith("_sq") else 1) if base in params \
            else torch.tensor(3, dtype=torch.int64)
        out[name] = full[tuple(slice(lo, hi) for lo, hi in ranges)].clone()
    return out


def test_checkpoint_written_under_tp2_pp2_reads_back_under_one_device(tmp_path):
    params = full_params(CONFIG, 0)
    old = simple_plan(tp=2, pp=2, dp=2, num_layers=2, global_batch=4)  # 8 devices
    writer = CheckpointWriter(str(tmp_path), every=3)
    assert writer.due(3) and not writer.due(4)
    for rank in old.devices:  # only pipeline 0 (devices 0-3) writes
        writer.submit(3, CONFIG, old, rank, _local_state(old, rank, params))
    assert writer.flush(10.0) and not writer.errors
    assert latest_complete(str(tmp_path)) == 3
    assert sorted(p.name for p in (tmp_path / "step-00000003").iterdir()) == [
        "manifest.json", *(f"shard-{r}.{ext}" for r in range(4) for ext in ("json", "pt"))]
    new = simple_plan(num_layers=2, global_batch=4)
    stats: dict = {}
    loaded = load_shards(str(tmp_path), 3, CONFIG, new, 0, stats)
    assert torch.equal(loaded["layers.1.attn.wq.weight"], params["layers.1.attn.wq.weight"])
    assert torch.equal(loaded["embed.weight.exp_avg_sq"], 2 * params["embed.weight"])
    assert int(loaded["optim.step"]) == 3
    everything = sum(t.numel() * t.element_size() for t in loaded.values())
    assert stats["bytes_read"] == everything  # one device holds it all: it reads it all
    # Under TP 2 over two devices, each rank reads its own half of the TP-sharded tensors
    # (and the replicated ones whole), never another rank's share.
    tp2 = simple_plan(tp=2, num_layers=2, global_batch=4)
    reads = []
    for rank in (0, 1):
        st: dict = {}
        mine = load_shards(str(tmp_path), 3, CONFIG, tp2, rank, st)
        assert st["bytes_read"] == sum(t.numel() * t.element_size() for t in mine.values())
        reads.append(st["bytes_read"])
        ranges = state_specs(CONFIG, tp2)["layers.1.attn.wq.weight"].annotation.local_slices(
            rank, params["layers.1.attn.wq.weight"].shape)
        assert torch.equal(mine["layers.1.attn.wq.weight"],
                           params["layers.1.attn.wq.weight"][tuple(slice(*r) for r in ranges)])
    assert all(everything / 2 <= r < everything for r in reads), (reads, everything)
    (tmp_path / "step-00000003" / "shard-2.pt").unlink()  # an incomplete checkpoint is skipped
    assert latest_complete(str(tmp_path)) == -1


def test_gather_full_assembles_shards():
    w = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    parts = [{"w": (((0, 3), (0, 2)), w[:, :2])}, {"w": (((0, 3), (2, 4)), w[:, 2:])}]
    assert torch.equal(gather_full(parts, {"w": (3, 4)})["w"], w)
