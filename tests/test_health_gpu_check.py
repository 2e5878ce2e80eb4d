"""scripts/gpu_check: every GPU step skipped without a GPU (one line with --strict), the NVML step
on a scripted driver, the communication step over gloo on CPUs, and the elastic in-memory switch
step rehearsed on a CPU worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pynvml
import pytest

from launcher.health import gpu_check
from launcher.health.fake_nvml import FakeNvml, fake_gpus
from launcher.health.nvml import probe_nvml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check")


def test_without_gpus_every_gpu_step_is_skipped_and_strict_fails_with_one_line():
    if probe_nvml(pynvml) is None:
        pytest.skip("this machine has an NVIDIA driver")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run([SCRIPT, "--only", "nvml,comm,unit,kill,mfu"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("gpu_check: SKIP nvml: no usable NVIDIA GPU: no NVIDIA driver")
    for step in ("comm", "unit", "kill", "mfu"):
        assert f"gpu_check: SKIP {step}: skipped: no CUDA (torch " in proc.stdout, step
    assert lines[-1] == "gpu_check: PASS (0 passed, 5 skipped: nvml, comm, unit, kill, mfu)"
    strict = subprocess.run([SCRIPT, "--strict"], capture_output=True, text=True, timeout=60,
                            env=env)
    assert strict.returncode == 1 and strict.stdout == ""
    assert strict.stderr.strip().splitlines() == [
        "gpu_check: FAIL: nvml cannot run here: no usable NVIDIA GPU: no NVIDIA driver "
        "(NVMLError_LibraryNotFound: NVML Shared Library Not Found)"]


def test_nvml_step_on_a_scripted_driver(capsys):
    fake = FakeNvml(fake_gpus(2))
    assert gpu_check.check_nvml(10, nvml=fake) == 2
    out = capsys.readouterr().out
    assert "GPU 1: NVIDIA H100 80GB HBM3 (H100-80GB-HBM3), 80.0 GiB" in out
    assert "Xid event thread: running" in out
    assert fake.initialized == 0


def test_nvml_step_fails_on_a_lost_gpu():
    gpus = fake_gpus(2)
    gpus[1].lost = True
    with pytest.raises(gpu_check.CheckFailed, match=r"GPU\(s\) \[1\] failed"):
        gpu_check.check_nvml(10, nvml=FakeNvml(gpus))


@pytest.mark.multiproc
def test_comm_step_over_gloo():
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([SCRIPT, "--comm-only", "--backend", "gloo", "--budget", "90"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gloo rank 1/2: all_reduce, batch_isend_irecv ring" in proc.stdout
    assert proc.stdout.strip().endswith("gpu_check: PASS")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_switch_step_rehearsed_on_a_cpu_worker(tmp_path):
    """The elastic step of the GPU check on a CPU worker: a real etcd, agent and worker; two
    scripted health changes make two in-memory switches of the same process."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([SCRIPT, "--only", "switches", "--device", "cpu", "--budget", "120",
                           "--keep", str(tmp_path)], capture_output=True, text=True,
                          timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.splitlines()[0]
    assert line.startswith("gpu_check: PASS switches: 1 worker on cpu, pid "), line
    assert "v1->v2" in line and "v2->v3" in line and "6 steps done" in line, line


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_mfu_step_rehearsed_on_the_cpu(tmp_path):
    """The MFU step runs ``scripts/bench_step --mfu`` (a tiny model on the CPU here): one PASS
    line with its numbers, and the report files."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    report = tmp_path / "mfu.md"
    proc = subprocess.run([SCRIPT, "--only", "mfu", "--device", "cpu", "--budget", "100",
                           "--mfu-report", str(report)], capture_output=True, text=True,
                          timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("gpu_check: PASS mfu")]
    assert line and " tokens/s, " in line[0] and "MFU " in line[0], proc.stdout
    assert "| specialized" in report.read_text()
    assert json.loads((tmp_path / "mfu.md.json").read_text())
