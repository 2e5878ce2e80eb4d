"""Leaving process groups that still run an abandoned collective (``GroupReaper``).

gloo's process-group destructor waits for the collectives in flight on the group; one that was
posted and then abandoned (a newer plan came, or the peer never joined it) ends only at the
group's timeout. Real gloo ranks and a real etcd: rank 0 posts an all_reduce on a sub-group that
rank 1 does not join, the ``Watchdog`` abandons it when a newer plan is published, and rank 0
then leaves its groups as a switch does. The group timeout is 600 s and every run here has a deadline of a fraction
of that, so a drop that waits for the collective fails the test (the world is reported hung).
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from _world import run_world
from hspmd_elastic.elastic.reaper import GroupReaper

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

JOB = "reaper-test"
GROUP_TIMEOUT_S = 600.0  # far beyond every deadline below: waiting for it fails the test


def _record(version: int):
    from hspmd_elastic.contract import schema
    from hspmd_elastic.plan import simple_plan

    return schema.PlanRecord(version=version, reason="test", devices=["n0:0", "n0:1"],
                             strategy=simple_plan(dp=2, num_layers=2, global_batch=2).to_dict(),
                             store_endpoint="127.0.0.1:1", created_at=time.time())


def _abandoned_then_dropped(rank: int, world: int, endpoints: list[str], store_path: str,
                            peer_leaves: bool):
    import torch
    import torch.distributed as dist

    from hspmd_elastic.coord import EtcdClient
    from hspmd_elastic.coord.plans import plan_puts
    from hspmd_elastic.elastic.api import SwitchRequested
    from hspmd_elastic.elastic.group import GroupFormer
    from hspmd_elastic.elastic.watchdog import PlanWatcher, Watchdog

    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    side = dist.FileStore(store_path, world)  # outlives the process groups
    side.set_timeout(datetime.timedelta(seconds=60))
    out = {}
    if rank == 0:
        client = EtcdClient(endpoints, timeout=10.0)
        plans = PlanWatcher(client, JOB).start(10.0)
        reaper = GroupReaper()
        former = GroupFormer(30.0, reaper=reaper)
        watchdog = Watchdog(plans, lambda: 1, GROUP_TIMEOUT_S, on_abandon=reaper.abandoned)
        work = dist.all_reduce(torch.ones(4), group=sub, async_op=True)  # rank 1 never joins
        client.txn([], plan_puts(JOB, _record(2)))  # as a leader publishes it
        try:
            watchdog(work, "all_reduce on the sub-group")
            out["raised"] = None
        except SwitchRequested as exc:
            out["raised"] = exc.version
        out["pending"] = reaper.pending()
        out["held"] = reaper.retire(sub, what="the sub-group")
        del sub
        # Destroying the default group drops torch's own reference to the sub-group: without
        # the reaper, this is where rank 0 waits for gloo to time the all_reduce out.
        former.leave()
        out["holding"] = reaper.holding()
        side.set("checked", "1")
        if peer_leaves:  # rank 1 destroys its side: the all_reduce fails, the group goes
            side.wait(["left"])
            out["released"] = reaper.wait_idle(60.0)
            out["holding_after"] = reaper.holding()
            out["pending_after"] = reaper.pending()
        side.set("done", "1")
        plans.stop()
        client.close()
    else:
        side.wait(["checked"])
        if peer_leaves:
            dist.destroy_process_group()
            del sub  # closes rank 1's end of the sub-group's connections
            side.set("left", "1")
        side.wait(["done"])  # until then rank 1 keeps its end open
    return out


def test_dropping_a_group_with_an_abandoned_collective_does_not_wait(etcd_server, tmp_path):
    res = run_world(_abandoned_then_dropped, 2,
                    (etcd_server.endpoints, str(tmp_path / "side"), False),
                    tmp_dir=tmp_path / "world", timeout_s=90, group_timeout_s=30)
    assert res[0] == {"raised": 2, "pending": 1, "held": True, "holding": 2}  # sub + default


def test_retired_groups_are_dropped_once_the_collective_ends(etcd_server, tmp_path):
    res = run_world(_abandoned_then_dropped, 2,
                    (etcd_server.endpoints, str(tmp_path / "side"), True),
                    tmp_dir=tmp_path / "world", timeout_s=90, group_timeout_s=30)
    assert res[0]["holding"] == 2
    assert res[0]["released"] is True
    assert (res[0]["holding_after"], res[0]["pending_after"]) == (0, 0)


def test_nothing_is_held_without_a_collective_in_flight():
    reaper = GroupReaper()
    assert reaper.retire(object()) is False  # nothing abandoned
    done = threading.Event()
    reaper.abandoned(done)
    assert reaper.retire(None) is False  # nothing to hold
    done.set()
    assert reaper.pending() == 0
    assert reaper.retire(object()) is False and reaper.holding() == 0 and reaper.retired == 0


class _Group:
    """Stands in for a retired process group: only its lifetime is observed."""


def _retired_behind_a_collective(monkeypatch):
    """A reaper holding one retired group behind an abandoned collective still in flight:
    (reaper, the collective's end, a weak reference to the group)."""
    import weakref

    from hspmd_elastic.elastic import reaper as reaper_mod

    monkeypatch.setattr(reaper_mod, "_SETTLE_S", 0.0)
    reaper = GroupReaper()
    done = threading.Event()
    reaper.abandoned(done)
    held = _Group()
    alive = weakref.ref(held)
    assert reaper.retire(held) is True
    del held
    return reaper, done, alive


def test_close_drops_groups_whose_collectives_ended(monkeypatch):
    reaper, done, alive = _retired_behind_a_collective(monkeypatch)
    assert alive() is not None
    done.set()
    assert reaper.close(10.0) is True
    assert alive() is None and reaper.holding() == 0


def test_after_close_a_held_group_is_never_destroyed(monkeypatch):
    """A process that exits while a destructor runs on the reaper's thread aborts; so once
    ``close`` has returned, groups still held stay held even when their collective ends."""
    reaper, done, alive = _retired_behind_a_collective(monkeypatch)
    assert reaper.close(0.2) is False  # the collective is still in flight
    done.set()
    assert reaper.wait_idle(1.0) is False  # the holder parks instead of dropping
    assert alive() is not None
