"""``hspmd-launch --hspmd-optimizer-shards uneven`` end to end: real etcd, two real agents as
separate nodes of this host (one CPU worker each, the second declared half as fast, every
device given a role), ``elastic_train.py`` over gloo on the tiny float64 model. Every plan the
leader publishes carries ``optimizer_shards == "uneven"`` (read back from etcd's plan history),
the workers train every step under it, and the final parameters equal the fault-free dense
reference (``JobFacts.assert_replicas_match_reference``: every element held, no NaN, 1e-9)."""

from __future__ import annotations

import pytest

from _elastic_job import STEPS, TINY, ElasticLaunchJob

from hspmd_elastic.graph.zero import update_fraction

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def test_uneven_optimizer_shards_train_to_the_reference(etcd_server, tmp_path, marker):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="zero") as job:
        job.release.write_text("go")  # no pause: this run has no fault to place
        shared = ("--hspmd-optimizer-shards", "uneven", "--hspmd-all-devices", "on")
        job.start("node-a", 1, *shared)
        job.start("node-b", 1, *shared, "--hspmd-device-speed", "0.5")
        job.finish(timeout=90)
        plans = job.plans()
        assert plans, "no plan was published"
        modes = {v: plan.optimizer_shards for v, (plan, _) in plans.items()}
        assert set(modes.values()) == {"uneven"}, modes
        plan, _ = plans[max(plans)]
        # both devices hold the whole model (DP): the moments are cut between them, each
        # updating part of it, the slower one (fewer rows) the smaller part
        assert [p.rows for p in plan.pipelines] == [3, 1], plan
        shares = [update_fraction(plan, TINY, p.stages[0].devices[0]) for p in plan.pipelines]
        assert 0 < shares[1] < shares[0] < 1, shares
        results = job.results()
        assert set(results) == {"node-a:0", "node-b:0"}, sorted(results)
        assert all(r["steps_done"] == STEPS for r in results.values()), \
            {d: r.get("steps_done") for d, r in results.items()}
        job.assert_replicas_match_reference(results)
