"""``scripts/demo`` leaves nothing behind: its etcd data directory (about 60 MB of preallocated
write-ahead log), the agents' logs and the workers' results live in one temporary directory
that is removed when the demo ends, unless ``--keep-work`` asks to keep it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiproc
@pytest.mark.timeout(300)  # it may start the session's demo run (``demo_run``, conftest.py)
def test_a_demo_run_leaves_no_files_in_the_temporary_directory(demo_run):
    """The session's one demo run (the default elastic mode, whose embedded etcd preallocates
    its write-ahead log), with ``TMPDIR`` an empty folder: after it exited, nothing of it is
    left there."""
    out = demo_run
    assert out["code"] == 0, out["stdout"][-3000:] + out["stderr"][-3000:]
    assert out["stdout"].strip().splitlines()[-1].startswith("RESULT {")
    left, size = out["left"], out["left_bytes"]  # demo, logs, progress
    assert left == [] and size < 1 << 20, (left, size)


def _du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _s, names in os.walk(folder)
               for n in names if not os.path.islink(os.path.join(d, n)))


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_the_restart_mode_demo_recovers_by_a_restart_and_leaves_no_files(tmp_path):
    """``scripts/demo --mode restart`` (the README's torchrun-style comparison): the kill is
    answered by a restart, and nothing of the run is left in ``TMPDIR``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "scripts/demo_job.py", "--mode", "restart",
                           "--steps", "6", "--kill-at", "3", "--nproc", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT {"), last
    result = json.loads(last[len("RESULT "):])
    assert result["restarts"] >= 1 and result["faults"] == 1, result
    left = sorted(n for n in os.listdir(tmp) if n.startswith("hspmd"))  # demo, logs, progress
    assert left == [] and _du(str(tmp)) < 1 << 20, (left, _du(str(tmp)))


def _demo_job():
    spec = importlib.util.spec_from_file_location("demo_job", os.path.join(ROOT, "scripts",
                                                                           "demo_job.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_the_work_directory_is_removed_unless_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    demo = _demo_job()
    with demo.work_dir(keep=False) as work:
        (work / "etcd").mkdir()
        (work / "etcd" / "wal").write_bytes(b"\0" * 1000)
    assert not work.exists()
    with pytest.raises(RuntimeError):
        with demo.work_dir(keep=False) as work:
            raise RuntimeError("the job failed")
    assert not work.exists()
    with demo.work_dir(keep=True) as work:
        (work / "logs").mkdir()
    assert (work / "logs").is_dir() and f"kept the demo's files in {work}" in capsys.readouterr().out
