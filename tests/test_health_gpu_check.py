"""scripts/gpu_check: one clear line without a GPU, the NVML step on a scripted driver, and the
communication step over gloo on CPUs."""

from __future__ import annotations

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


def test_without_gpus_exits_nonzero_with_one_line():
    if probe_nvml(pynvml) is None:
        pytest.skip("this machine has an NVIDIA driver")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: FAIL: no usable NVIDIA GPU: no NVIDIA driver")


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
