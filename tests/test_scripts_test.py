"""``scripts/test`` runs the suite in parallel on a machine with two CPUs or more, whatever
``OMP_NUM_THREADS`` says (GNU ``nproc`` follows it, and the scripts set it to 1)."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jobs(**env) -> str:
    run_env = {k: v for k, v in os.environ.items() if k != "HSPMD_TEST_JOBS"}
    run_env.update(env)
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "test"), "--print-jobs"],
                         env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(240)
def test_the_degree_follows_the_machines_cpus_not_omp_num_threads():
    cpus = len(os.sched_getaffinity(0))
    want = "2" if cpus >= 2 else "0"
    assert _jobs(OMP_NUM_THREADS="1") == want
    assert _jobs(OMP_NUM_THREADS="16") == want
    assert _jobs(HSPMD_TEST_JOBS="0") == "0"
