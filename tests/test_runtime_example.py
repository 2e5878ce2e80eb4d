"""examples/elastic_llama.py runs as documented: two workers under a DP2 plan, to the end."""

from __future__ import annotations

import os

import pytest

from _elastic import ROOT
from hspmd_elastic.plan import simple_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]


def test_example_trains_to_the_end(elastic_job, tmp_path):
    job = elastic_job({})
    out = tmp_path / "final"
    script = [os.path.join(ROOT, "examples", "elastic_llama.py"), "--steps", "3",
              "--global-batch", "4", "--layers", "2", "--hidden", "16", "--heads", "2",
              "--seq-len", "8", "--vocab", "32", "--out", str(out)]
    devices = ["n0:0", "n0:1"]
    for d in devices:
        job.spawn(d, script=script)
    job.publish(simple_plan(dp=2, num_layers=2, global_batch=4), devices, reason="start")
    for d in devices:
        code = job.procs[d].wait(timeout=60)
        assert code == 0, job.log(d)
        assert "done after 3 steps (plan v1, 1 switches)" in job.log(d)
    assert sorted(os.listdir(out)) == ["n0_0.pt", "n0_1.pt"]
