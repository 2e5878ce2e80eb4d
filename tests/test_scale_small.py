"""Fifty simulated node agents on one real etcd, planned over by one real leader.

The small version of ``scripts/bench_scale`` (``scripts/_scale_fleet.py``): two processes of 25
agents (8 devices each, real leases with a 3 s TTL, node and device records, one watch per agent
on the plan's head ``plan/head``, switch acks), two simulated workers per agent (real
``PlanWatcher``s on ``plan/stamp``, their agent relaying each plan's layout:
``scripts/_scale_workers.py``) and a leader process running the real planner.
Checked: every agent sees every plan, no lease is lost in steady state, and the agents of a
SIGKILLed process are planned away (and the survivors ack the new plan, whose head and stamp
match the full record, and every surviving worker resolved it, none from the full record). No
timing is asserted: timing lives in the benchmark.
Every wait is a poll with a deadline; the fleet kills and reaps every process it started.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

from _scale_fleet import JOB, Fleet  # noqa: E402
from launch_harness import MARKER  # noqa: E402

from hspmd_elastic.contract import schema  # noqa: E402
from hspmd_elastic.coord.plans import plan_digest  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

TTL = 3.0
PER_PROCESS = 25
WORKERS = 2  # simulated workers per agent


def _node_keys(fleet: Fleet) -> set[str]:
    return {kv.key.rsplit("/", 1)[1] for kv in fleet.client.get_prefix(schema.nodes_prefix(JOB))}


def test_fifty_agents_see_every_plan_and_lose_a_killed_process(tmp_path, marker):
    # ``marker`` tags every process the fleet starts: none may be left after the test.
    with Fleet([PER_PROCESS, PER_PROCESS], ttl=TTL, model="llama-7b", global_batch=512,
               base_dir=str(tmp_path), max_s=120, env={MARKER: marker},
               workers=WORKERS) as fleet:
        everyone = fleet.live_nodes()
        assert len(everyone) == 2 * PER_PROCESS
        fleet.wait_for(lambda: 1 in fleet.seen and fleet.all_seen(1, everyone), 30,
                       "every agent saw plan v1")
        assert fleet.plans[1].nodes == set(everyone)
        assert fleet.plans[1].devices > 0

        # Steady state: two keep-alives per agent at least, no lease lost, nothing replanned.
        base = fleet.metrics().get("grpc_server_msg_received_total{LeaseKeepAlive}", 0.0)

        def kept_alive() -> bool:
            got = fleet.metrics().get("grpc_server_msg_received_total{LeaseKeepAlive}", 0.0)
            return got - base >= 2 * len(everyone)

        fleet.wait_for(lambda: kept_alive() and all(c.status for c in fleet.agent_children()),
                       6 * TTL, "two keep-alive rounds")
        assert fleet.losses() == 0
        assert max(fleet.plans) == 1
        assert _node_keys(fleet) == set(everyone)

        # SIGKILL one process: its leases expire and the leader plans its agents away.
        victim = fleet.agent_children()[1]
        gone, before = set(victim.nodes), max(fleet.plans)
        fleet.kill(victim)
        survivors = fleet.live_nodes()
        fleet.wait_for(lambda: gone <= set(fleet.deleted) and fleet.plans[max(fleet.plans)]
                       .nodes == set(survivors), 3 * TTL + 20, "a plan without the killed agents")
        final = max(fleet.plans)
        assert final > before
        fleet.wait_for(lambda: all(fleet.all_seen(v, survivors) for v in range(1, final + 1)),
                       20, "every survivor saw every plan")
        assert _node_keys(fleet) == set(survivors)
        assert fleet.losses() == 0

        key = schema.plan_current_key(JOB)
        raw = fleet.client.get(key).value
        plan = schema.decode(key, raw)
        head_kv = fleet.client.get(schema.plan_head_key(JOB))  # what the agents followed
        head = schema.decode(head_kv.key, head_kv.value)
        assert (head.version, head.digest) == (final, plan_digest(raw))
        used = {d.rpartition(":")[0] for d in plan.devices}
        assert plan.version == final and used and used <= set(survivors)
        def acked() -> set[str]:
            acks = fleet.client.get_prefix(schema.switch_prefix(JOB, final))
            return {schema.decode(kv.key, kv.value).node for kv in acks}
        fleet.wait_for(lambda: acked() >= used, 20, "every used survivor acked the final plan")
        assert acked() == used

        # The workers followed plan/stamp and resolved the final plan, none from plan/current.
        stamp_kv = fleet.client.get(schema.plan_stamp_key(JOB))
        stamp = schema.decode(stamp_kv.key, stamp_kv.value)
        assert (stamp.version, stamp.digest) == (final, plan_digest(raw))
        fleet.wait_for(lambda: fleet.all_resolved(final, survivors), 30,
                       "every surviving worker resolved the final plan")
        counted = list(fleet.counters().values())
        sources = [c["sources"] for c in counted]
        assert sum(s.get("relay", 0) for s in sources) > 0
        assert all(s.get("current", 0) == 0 for s in sources), sources
        assert all(c["worker_watch"] > 0 and c["relay_kv"] > 0 for c in counted), counted
