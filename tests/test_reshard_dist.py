"""Fused BSR over real gloo processes: every rank checks its new shards against the reference.

One world of 6 processes runs all scenarios in sequence (process start-up dominates on a small
machine); each test then asserts on its own scenario's per-rank report.
"""

from __future__ import annotations

import dataclasses
import random
import traceback

import pytest

from _world import run_world
from hspmd_elastic.annotations import DistState, TensorAnnotation
from hspmd_elastic.reshard import ReshardError, TensorSpec, fused_bsr_schedule
from hspmd_elastic.reshard.api import SOLO_MESSAGE_BYTES

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

WORLD = 6
T = TensorAnnotation


def _with_adam(name, shape, old, new):
    """A parameter with its Adam states, all on the same annotation."""
    return [
        TensorSpec(n, shape, "float32", old, new)
        for n in (name, f"{name}.exp_avg", f"{name}.exp_avg_sq")
    ]


def _scenarios():
    """name -> (specs, alive, solo_bytes) for the data-moving scenarios, identical on every rank.

    A tiny ``solo_bytes`` sends boxes as their own messages (in place where contiguous)."""
    out = {}
    tp4 = T.single_group([0, 1, 2, 3], {1: 4})
    tp2dp2 = T.single_group([0, 1, 2, 3], {-1: 2, 1: 2})
    tp2dp2_bias = T.single_group([0, 1, 2, 3], {-1: 2, 0: 2})
    out["tp4_to_tp2xdp2"] = (
        _with_adam("w", (8, 12), tp4, tp2dp2)
        + _with_adam("b", (12,), T.single_group([0, 1, 2, 3], {0: 4}), tp2dp2_bias)
        + [TensorSpec("step", (), "int64", T.single_group([0, 1, 2, 3], {-1: 4}),
                      T.single_group([0, 1, 2, 3], {-1: 4}))],
        {0, 1, 2, 3},
        SOLO_MESSAGE_BYTES,
    )
    dp4 = T.single_group([0, 1, 2, 3], {-1: 4})
    dp3 = T.single_group([0, 1, 4], {-1: 3})
    out["dp4_dead_to_dp3"] = (
        _with_adam("w", (30, 4), dp4, dp3) + [TensorSpec("step", (), "int64", dp4, dp3)],
        {0, 1, 2},  # rank 3 died; rank 4 joins
        16,
    )
    hetero_w = T.replicated([[0, 1], [2], [3]], [{1: 2}, {}, {}])
    uniform_w = T.single_group(range(6), {-1: 3, 1: 2})
    hetero_rows = T.heterogeneous([[0, 1], [2], [3]], [{0: 2}, {}, {}], hdim=0, hweights=(2, 1, 1))
    uniform_rows = T.single_group(range(6), {-1: 3, 0: 2})
    out["hetero_to_uniform"] = (
        _with_adam("w", (6, 8), hetero_w, uniform_w)
        + _with_adam("emb", (8, 4), hetero_rows, uniform_rows),
        {0, 1, 2, 3},
        16,
    )
    for seed in range(3):
        specs, alive = _random_mix(seed)
        out[f"random_mix_{seed}"] = (specs, alive, 16 * seed)  # seed 0: every box solo
    return out


def _random_annotation(rng, ndim):
    """A random union over ranks 0..5: 1-3 sub-groups, uneven weights, any device order."""
    devices = list(range(WORLD))
    rng.shuffle(devices)
    states, used = [], 0
    for _ in range(rng.randint(1, 3)):
        s = {}
        for key in [-1] + list(range(ndim)):
            c = rng.choice([1, 1, 2, 3])
            if c > 1 and used + _prod(s.values()) * c <= WORLD:
                s[key] = c
        if used + _prod(s.values()) > WORLD:
            break
        order = list(s)
        rng.shuffle(order)
        states.append(DistState(s, order or None))
        used += states[-1].device_num
    hdim = rng.choice([-1] + list(range(ndim))) if len(states) > 1 else -1
    weights = tuple(rng.randint(1, 3) for _ in states) if hdim >= 0 and rng.random() < 0.5 else None
    groups, at = [], 0
    for st in states:
        groups.append(devices[at : at + st.device_num])
        at += st.device_num
    return T.heterogeneous(groups, states, hdim, weights)


def _prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def _random_mix(seed):
    """Random tensors of mixed dtypes and random old/new annotations, identical on every rank."""
    rng = random.Random(seed)
    specs = []
    for i in range(8):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        dtype = rng.choice(["float32", "int64", "float16", "bfloat16"])
        old, new = _random_annotation(rng, ndim), _random_annotation(rng, ndim)
        specs.append(TensorSpec(f"r{i}", shape, dtype, old, new))
    candidates = list(range(WORLD))
    rng.shuffle(candidates)
    for dead in candidates:  # the first rank whose loss loses no data
        alive = set(range(WORLD)) - {dead}
        try:
            fused_bsr_schedule(specs, alive, {})
            return specs, alive
        except ReshardError:
            continue
    return specs, set(range(WORLD))


def _reference(spec, index):
    import torch

    n = 1
    for s in spec.shape:
        n *= s
    return (torch.arange(n, dtype=torch.int64) + 1000 * index).reshape(spec.shape).to(
        getattr(torch, spec.dtype)
    )


def _run_scenario(rank, specs, alive, solo_bytes):
    from hspmd_elastic.reshard.executor import execute_fused

    refs = {s.name: _reference(s, i) for i, s in enumerate(specs)}
    schedule = fused_bsr_schedule(specs, alive, {d: "node0" for d in range(WORLD)})
    schedule = dataclasses.replace(schedule, solo_bytes=solo_bytes)
    local = {}
    if rank in alive:
        for s in specs:
            box = s.old.local_slices(rank, s.shape)
            if box is not None:
                local[s.name] = refs[s.name][tuple(slice(lo, hi) for lo, hi in box)].clone()
    got, stats = execute_fused(schedule, rank, local, "cpu", timeout_s=30)
    checked = []
    for s in specs:
        box = s.new.local_slices(rank, s.shape)
        if box is None:
            assert s.name not in got
            continue
        want = refs[s.name][tuple(slice(lo, hi) for lo, hi in box)]
        assert got[s.name].dtype == want.dtype and got[s.name].equal(want), s.name
        checked.append(s.name)
    planned = schedule.link_stats()
    assert stats.total_sent == planned.bytes_sent.get(rank, 0)
    assert stats.total_received == planned.bytes_received.get(rank, 0)
    return {
        "checked": checked,
        "senders": sorted(stats.bytes_received),
        "sent": stats.total_sent,
        "received": stats.total_received,
        "messages": stats.messages,
    }


def world_main(rank, world_size):
    """Every scenario in order; a failure is recorded and the next scenario still runs."""
    import torch.distributed as dist

    report = {}
    for name, (specs, alive, solo_bytes) in _scenarios().items():
        try:
            report[name] = _run_scenario(rank, specs, alive, solo_bytes)
        except Exception:  # noqa: BLE001 - reported per scenario
            report[name] = {"error": traceback.format_exc()}
        dist.barrier()
    report["missing"] = _missing_scenario()
    report["abort"] = _abort_scenario(rank)
    report["timeout"] = _timeout_scenario(rank)  # last: it leaves the pair 0-1 closed
    return report


def _missing_scenario():
    dp4 = T.single_group([0, 1, 2, 3], {-1: 4})
    zero = T.single_group([0, 1, 2, 3], {0: 4})
    dp3 = T.single_group([0, 1, 2], {-1: 3})
    specs = [TensorSpec("w", (8,), "float32", dp4, dp3), TensorSpec("w.exp_avg", (8,), "float32", zero, dp3)]
    try:
        fused_bsr_schedule(specs, {0, 1, 2}, {})
    except ReshardError as exc:
        return {"missing": [[n, [list(r) for r in box]] for n, box in exc.missing]}
    return {"missing": None}


def _timeout_scenario(rank):
    import datetime

    import torch
    import torch.distributed as dist

    from hspmd_elastic.reshard import ReshardTimeoutError
    from hspmd_elastic.reshard.executor import execute_fused

    spec = TensorSpec("w", (4,), "float32", T.single_group([1], {}), T.single_group([0], {}))
    schedule = fused_bsr_schedule([spec], {1}, {})
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        # Rank 1 never sends but stays up (an exit would reset the connection instead).
        store.wait(["timeout_done"], datetime.timedelta(seconds=60))
        return {"skipped": True}
    try:
        execute_fused(schedule, 0, {"w": torch.zeros(4)}, "cpu", timeout_s=1.0)
    except ReshardTimeoutError as exc:
        return {"error_type": type(exc).__name__}
    finally:
        store.set("timeout_done", "1")
    return {"error_type": None}


def _abort_scenario(rank):
    """Rank 2 waits for a receive that rank 3 never sends; ``should_abort`` turns true after
    0.3 s and the exchange must end then, not at its 30 s deadline."""
    import datetime
    import time

    import torch.distributed as dist

    from hspmd_elastic.reshard.executor import ReshardAborted, execute_fused

    spec = TensorSpec("w", (4,), "float32", T.single_group([3], {}), T.single_group([2], {}))
    schedule = fused_bsr_schedule([spec], {3}, {})
    store = dist.distributed_c10d._get_default_store()
    if rank == 3:
        store.wait(["abort_done"], datetime.timedelta(seconds=60))
        return {"skipped": True}
    if rank != 2:
        return {"skipped": True}
    start = time.monotonic()
    try:
        execute_fused(schedule, 2, {}, "cpu", timeout_s=30.0,
                      should_abort=lambda: time.monotonic() - start > 0.3)
    except ReshardAborted as exc:
        return {"error_type": type(exc).__name__, "elapsed": time.monotonic() - start}
    finally:
        store.set("abort_done", "1")
    return {"error_type": None}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_world(world_main, WORLD, tmp_dir=tmp_path_factory.mktemp("bsr_world"),
                     timeout_s=120, group_timeout_s=30)


def _scenario(reports, name):
    per_rank = [r[name] for r in reports]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if "error" in r]
    assert not errors, "\n".join(errors)
    return per_rank


def test_tp4_to_tp2xdp2_with_optimizer_state(reports):
    per_rank = _scenario(reports, "tp4_to_tp2xdp2")
    for rank in range(4):
        assert set(per_rank[rank]["checked"]) >= {"w", "w.exp_avg", "w.exp_avg_sq", "b", "step"}
        assert per_rank[rank]["messages"] > 0
    assert per_rank[4]["checked"] == [] and per_rank[4]["sent"] == 0


def test_dp4_with_one_dead_rank_to_dp3_spreads_the_joiner(reports):
    per_rank = _scenario(reports, "dp4_dead_to_dp3")
    assert per_rank[4]["senders"] == [0, 1, 2]
    assert per_rank[4]["messages"] > 3  # solo boxes: several messages per sender
    assert set(per_rank[4]["checked"]) == {"w", "w.exp_avg", "w.exp_avg_sq", "step"}
    assert per_rank[0]["received"] == 0 and per_rank[1]["received"] == 0
    assert per_rank[3]["sent"] == 0


def test_hetero_union_to_uniform(reports):
    per_rank = _scenario(reports, "hetero_to_uniform")
    for rank in range(WORLD):
        assert set(per_rank[rank]["checked"]) == {
            "w", "w.exp_avg", "w.exp_avg_sq", "emb", "emb.exp_avg", "emb.exp_avg_sq"
        }
    assert per_rank[4]["received"] > 0 and per_rank[5]["received"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_mixed_dtype_unions(reports, seed):
    per_rank = _scenario(reports, f"random_mix_{seed}")
    specs, _ = _random_mix(seed)
    holders = {s.name: set(s.new.devices()) for s in specs}
    for rank, report in enumerate(per_rank):
        assert set(report["checked"]) == {n for n, devs in holders.items() if rank in devs}


def test_lost_zero_shard_is_named_on_every_rank(reports):
    for r in reports:
        assert r["missing"]["missing"] == [["w.exp_avg", [[6, 8]]]]


def test_pending_exchange_is_abandoned_when_should_abort_turns_true(reports):
    got = reports[2]["abort"]
    assert got["error_type"] == "ReshardAborted"
    assert 0.3 <= got["elapsed"] < 15.0, got  # not the 30 s deadline


def test_receive_from_a_silent_peer_times_out(reports):
    assert reports[0]["timeout"]["error_type"] == "ReshardTimeoutError"
