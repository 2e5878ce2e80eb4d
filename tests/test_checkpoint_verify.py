"""Checkpoints verify before they are used: each shard's size and SHA-256, recorded at save time
in its entry beside it (``shard-<rank>.json``), are checked by ``latest_complete``, which falls
back to the newest checkpoint that verifies and says in one line what it skipped and why.

The unit tests write real checkpoints with ``CheckpointWriter`` and damage them as an operator
or a full disk would (``truncate -s 100``, a flipped byte, a lost entry); the end-to-end test
damages the newest checkpoint of a live job (real etcd, real workers over gloo) before the switch
that needs it, and the job resumes from the previous one with the reference's parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch

from hspmd_elastic.elastic import checkpoint
from hspmd_elastic.elastic.checkpoint import (CheckpointWriter, latest_complete, load_shards,
                                              step_dir)
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.plan import simple_plan

CONFIG = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=2, ffn_size=16,
                     seq_len=4, dtype="float64")
LOG = "hspmd_elastic.elastic.checkpoint"


def _write(root: str, steps: tuple[int, ...], tp: int = 2) -> dict[int, dict]:
    """Checkpoints of ``steps`` under a TP ``tp`` plan (every rank writes a shard); per step,
    the state each rank saved (its values are the step number)."""
    plan = simple_plan(tp=tp, num_layers=2, global_batch=2)
    writer = CheckpointWriter(root, every=1, keep=10)
    saved = {}
    for step in steps:
        for rank in plan.devices:
            state = {name: torch.full(tuple(hi - lo for lo, hi in ranges), float(step),
                                      dtype=getattr(torch, spec.dtype))
                     for name, spec in state_specs(CONFIG, plan).items()
                     if (ranges := spec.annotation.local_slices(rank, spec.shape)) is not None}
            writer.submit(step, CONFIG, plan, rank, state)
            saved.setdefault(step, {})[rank] = state
    assert writer.flush(10.0) and not writer.errors, writer.errors
    return saved


def _skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and "skipped" in r.message]


def test_each_shard_has_a_size_and_digest_entry_written_at_save_time(tmp_path):
    root = str(tmp_path)
    _write(root, (2,))
    path = step_dir(root, 2)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert manifest["format"] == 2 and manifest["shards"] == ["shard-0.pt", "shard-1.pt"]
    for shard in manifest["shards"]:
        entry = json.loads(open(os.path.join(path, checkpoint.entry_name(shard))).read())
        data = open(os.path.join(path, shard), "rb").read()
        assert entry == {"file": shard, "step": 2, "size": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.check_step(path) == ("", False) and latest_complete(root) == 2


def test_a_truncated_newest_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    """The issue's reproduction: ``truncate -s 100 ck/step-00000004/shard-0.pt``."""
    root = str(tmp_path)
    saved = _write(root, (2, 4))
    shard = os.path.join(step_dir(root, 4), "shard-0.pt")
    size = os.path.getsize(shard)
    os.truncate(shard, 100)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert latest_complete(root) == 2
        assert latest_complete(root) == 2  # asked again (every switch): not logged again
    assert _skip_lines(caplog) == [
        f"checkpoint {root}: skipped step 4 (shard-0.pt is 100 B, its entry says {size} B); "
        "using step 2"]
    assert [r.levelno for r in caplog.records if r.name == LOG] == [logging.WARNING]
    plan = simple_plan(tp=2, num_layers=2, global_batch=2)
    got = load_shards(root, 2, CONFIG, plan, 1)  # the fallback reads back what was saved
    assert all(torch.equal(got[n], t) for n, t in saved[2][1].items())


def test_same_size_damage_and_a_lost_entry_are_skipped_each_with_its_reason(tmp_path, caplog):
    root = str(tmp_path)
    _write(root, (1, 2, 3))
    flipped = os.path.join(step_dir(root, 3), "shard-1.pt")
    data = bytearray(open(flipped, "rb").read())
    data[len(data) // 2] ^= 0xFF
    os.unlink(flipped)  # a new file (as a copy or a restore makes), same size
    open(flipped, "wb").write(bytes(data))
    os.unlink(os.path.join(step_dir(root, 2), checkpoint.entry_name("shard-0.pt")))
    with caplog.at_level(logging.INFO, logger=LOG):
        assert latest_complete(root) == 1
    assert _skip_lines(caplog) == [
        f"checkpoint {root}: skipped step 3 (shard-1.pt's SHA-256 differs from its entry's), "
        "step 2 (shard-0.json is missing); using step 1"]
    # An unreadable entry is damage; a missing one may be a checkpoint still being written.
    assert checkpoint.check_step(step_dir(root, 2)) == ("shard-0.json is missing", False)
    with open(os.path.join(step_dir(root, 1), checkpoint.entry_name("shard-0.pt")), "w") as f:
        f.write("{oops")
    assert checkpoint.check_step(step_dir(root, 1)) == ("shard-0.json is unreadable", True)
    assert latest_complete(root) == -1


def test_an_incomplete_newest_checkpoint_is_routine_not_a_warning(tmp_path, caplog):
    root = str(tmp_path)
    _write(root, (1, 2))
    os.unlink(os.path.join(step_dir(root, 2), "shard-1.pt"))  # its writer has not got there
    with caplog.at_level(logging.INFO, logger=LOG):
        assert latest_complete(root) == 1
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG] == [
        (logging.INFO, f"checkpoint {root}: skipped step 2 (shard-1.pt is missing); "
                       "using step 1")]


def test_a_manifest_from_before_the_entries_is_read_as_before(tmp_path):
    """A checkpoint written before shards had entries (no ``format`` in its manifest): its
    listed shards must exist and not be empty, as then; it loads."""
    root = str(tmp_path)
    saved = _write(root, (5,), tp=1)
    path = step_dir(root, 5)
    os.unlink(os.path.join(path, checkpoint.entry_name("shard-0.pt")))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({"step": 5, "shards": ["shard-0.pt"]}, f)
    assert latest_complete(root) == 5
    got = load_shards(root, 5, CONFIG, simple_plan(num_layers=2, global_batch=2), 0)
    assert all(torch.equal(got[n], t) for n, t in saved[5][0].items())
    os.truncate(os.path.join(path, "shard-0.pt"), 0)
    assert checkpoint.check_step(path) == ("shard-0.pt is empty", True) and latest_complete(root) == -1
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({"format": 9, "step": 5, "shards": ["shard-0.pt"]}, f)
    assert checkpoint.check_step(path) == ("manifest format 9 is not one this release reads", True)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_live_job_skips_its_damaged_newest_checkpoint(elastic_job, tmp_path):
    """Two stages on two devices, a checkpoint after every step; paused at step 2, the newest
    checkpoint (step 2) has a shard truncated, then the second stage's only holder is
    SIGKILLed. The survivor's switch finds no live owner of layer 1 and goes back to the
    checkpoint of step 1 (step 2 is redone), and the result equals the fault-free run."""
    from _elastic import JOB, assert_matches_reference, payload
    from _wait import wait_for
    from hspmd_elastic.coord import read_events
    from hspmd_elastic.plan import Pipeline, Plan, Stage

    ckpt = str(tmp_path / "ckpt")
    pl = payload(checkpoint_dir=ckpt, checkpoint_every=1)
    job = elastic_job(pl)
    devices = ["n0:0", "n1:0"]
    for d in devices:
        job.spawn(d)
    pp2 = Plan((Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, 2))), 2, 2),),
               global_batch=4, num_layers=2)
    job.publish(pp2, devices, reason="start")
    job.wait_step(devices, 2)
    wait_for(lambda: latest_complete(ckpt) >= 2, 30, "the checkpoint of step 2")
    os.truncate(os.path.join(step_dir(ckpt, 2), "shard-1.pt"), 100)
    job.kill("n1:0")
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n0:0"], reason="failure")
    job.release()
    r = job.join(["n0:0"], timeout=60)["n0:0"]
    assert r["ok"], f"{r.get('traceback')}\n{job.log('n0:0')}"
    last = r["switches"][-1]
    assert last["source"] == "checkpoint" and last["resume_step"] == 1, last
    assert r["steps_done"] == 5
    fallback = [e for e in read_events(job.client, JOB) if e.type == "fallback"]
    assert fallback and fallback[0].detail["checkpoint_step"] == 1
    assert "skipped step 2 (shard-1.pt is 100 B" in job.log("n0:0")
    assert_matches_reference([r], pl)
