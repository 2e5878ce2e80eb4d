"""Every file the data plane writes is replaced atomically (hspmd_elastic/files.py): a write that
fails half-way leaves the old bytes and no temporary file, and a successful one is fsynced
before its rename and the rename made durable by an fsync of the directory. Checked on the
helper itself and on each writer that uses it: token files and shard directories
(``data``), document datasets (``documents``), checkpoint shards and entries
(``elastic.checkpoint``) and Hugging Face exports (``hf.export``)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from hspmd_elastic import files
from hspmd_elastic.data import DataError, TokenShards, write_token_file, write_token_shards
from hspmd_elastic.documents import open_documents, write_documents, write_indexed
from hspmd_elastic.files import (atomic_group, atomic_open, atomic_path, atomic_write,
                                 stale_temporaries)

pytestmark = pytest.mark.timeout(120)


def _snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), temporary ones included."""
    out = {}
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


class Boom(RuntimeError):
    pass


# ---------------------------------------------------------------------------- the helper
@pytest.mark.parametrize("fail", [Boom, KeyboardInterrupt])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, fail):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old bytes")

    def half_then_fail(f):
        f.write(b"new by")
        raise fail("half-way")

    with pytest.raises(fail):
        atomic_write(str(target), half_then_fail)
    assert _snapshot(tmp_path) == {"f.bin": b"old bytes"}
    with pytest.raises(Boom):
        with atomic_open(str(tmp_path / "new.json"), "w") as f:
            f.write("{")
            raise Boom()
    assert _snapshot(tmp_path) == {"f.bin": b"old bytes"}  # a new file is not created either


def test_a_group_replaces_all_its_files_or_none(tmp_path):
    (tmp_path / "a").write_bytes(b"A0")
    (tmp_path / "b").write_bytes(b"B0")
    with pytest.raises(Boom):
        with atomic_group() as group:
            group.open(str(tmp_path / "a")).write(b"A1")
            group.open(str(tmp_path / "b")).write(b"B1")
            raise Boom()
    assert _snapshot(tmp_path) == {"a": b"A0", "b": b"B0"}
    with atomic_group() as group:
        group.open(str(tmp_path / "a")).write(b"A1")
        with open(group.path(str(tmp_path / "b")), "wb") as f:
            f.write(b"B1")
    assert _snapshot(tmp_path) == {"a": b"A1", "b": b"B1"}


def test_a_write_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(str(tmp_path / "x"), "text")
    assert events[-2:] == ["rename", "fsync dir"] and "fsync file" in events[:-2], events
    assert (tmp_path / "x").read_text() == "text"


def test_new_files_get_the_usual_permissions(tmp_path):
    atomic_write(str(tmp_path / "x"), b"1")
    with open(tmp_path / "y", "wb") as f:
        f.write(b"1")
    assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == \
        stat.S_IMODE(os.stat(tmp_path / "y").st_mode)


def test_a_path_writer_that_writes_nothing_replaces_nothing(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(FileNotFoundError):
        with atomic_path(str(tmp_path / "f")):
            pass
    assert _snapshot(tmp_path) == {"f": b"old"}


def test_stale_temporaries_are_found_and_ordinary_dot_files_are_not(tmp_path):
    tmp = files.temporary_name(str(tmp_path / "shard-0.pt"))
    open(tmp, "wb").close()
    (tmp_path / ".hidden").write_text("")
    (tmp_path / "x.tmp").write_text("")
    assert stale_temporaries(str(tmp_path)) == [tmp]


# ---------------------------------------------------------------------------- data, documents
def test_a_token_file_with_a_bad_id_half_way_keeps_the_old_file_and_sidecar(tmp_path):
    path = str(tmp_path / "t.bin")
    write_token_file(path, [np.arange(10)], vocab_size=10)
    before = _snapshot(tmp_path)
    with pytest.raises(DataError, match="token id 70000 does not fit uint16"):
        write_token_file(path, [np.arange(50), np.array([1, 70000])], vocab_size=100)
    assert _snapshot(tmp_path) == before
    assert TokenShards(path).num_tokens == 10


def test_a_shard_directory_is_replaced_whole_and_smaller(tmp_path):
    folder = str(tmp_path / "shards")
    write_token_shards(folder, np.arange(100), 4)
    before = _snapshot(folder)
    with pytest.raises(DataError):
        write_token_shards(folder, np.array([1, 2, 3, -1]), 2)
    assert _snapshot(folder) == before
    write_token_shards(folder, np.arange(30), 2)  # fewer shards than before: the rest go
    assert sorted(os.listdir(folder)) == ["dataset.json", "shard-00000.bin", "shard-00001.bin"]
    assert TokenShards(folder).num_tokens == 30


def test_an_indexed_dataset_with_a_bad_document_half_way_keeps_the_old_files(tmp_path):
    prefix = str(tmp_path / "c")
    write_indexed(prefix, [np.arange(5), np.arange(7)])
    before = _snapshot(tmp_path)
    docs = [np.arange(100), np.arange(3), np.array([1, 66532])]
    with pytest.raises(DataError, match="document 2: token id 66532 does not fit uint16"):
        write_indexed(prefix, docs)
    assert _snapshot(tmp_path) == before
    assert open_documents(prefix).num_docs == 2


def test_documents_with_offsets_are_written_together(tmp_path):
    path = str(tmp_path / "d.bin")
    write_documents(path, [np.arange(4), np.arange(6)], vocab_size=10)
    before = _snapshot(tmp_path)
    with pytest.raises(DataError):
        write_documents(path, [np.arange(40), np.array([-3])])
    assert _snapshot(tmp_path) == before
    assert open_documents(path).num_docs == 2


# ---------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_shard_that_fails_half_way_leaves_the_old_shard_and_no_temporary(
        tmp_path, monkeypatch):
    from hspmd_elastic.elastic.checkpoint import CheckpointWriter, latest_complete, step_dir
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.state import state_specs
    from hspmd_elastic.plan import simple_plan

    config = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=2, ffn_size=16,
                         seq_len=4, dtype="float64")
    plan = simple_plan(tp=1, num_layers=2, global_batch=2)
    state = {name: torch.ones(spec.shape, dtype=torch.float64)
             for name, spec in state_specs(config, plan).items()}
    writer = CheckpointWriter(str(tmp_path), every=1, keep=10)
    writer.submit(1, config, plan, 0, state)
    assert writer.flush(10.0) and not writer.errors
    before = _snapshot(step_dir(str(tmp_path), 1))
    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    writer.submit(1, config, plan, 0, {n: t * 2 for n, t in state.items()})
    assert writer.flush(10.0) and "No space left on device" in writer.errors[0]
    monkeypatch.setattr(torch, "save", real_save)
    assert _snapshot(step_dir(str(tmp_path), 1)) == before
    assert latest_complete(str(tmp_path)) == 1


# ---------------------------------------------------------------------------- HF export
def test_an_export_that_fails_half_way_leaves_no_temporary(tmp_path, monkeypatch):
    from hspmd_elastic.graph.config import ModelConfig, param_specs
    from hspmd_elastic.hf import HFCheckpointError, export_hf

    config = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=2, ffn_size=16,
                         seq_len=4, dtype="float64")
    params = {n: torch.zeros(s.shape, dtype=torch.float64) for n, s in param_specs(config).items()}

    def torn_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as out:
            out.write(b"half a safetensors file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hspmd_elastic.hf.export.save_file", torn_save_file)
    out = tmp_path / "hf"
    with pytest.raises(HFCheckpointError, match="No space left on device"):
        export_hf(str(out), config, params)
    assert _snapshot(out) == {}
    monkeypatch.undo()
    written = export_hf(str(out), config, params)
    assert sorted(_snapshot(out)) == sorted(os.path.basename(p) for p in written)
