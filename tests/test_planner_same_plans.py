"""The planner"s fast paths give the plans the plain computation gives.

* a golden of small clusters: the digests of the plans (chosen and alternatives, with their
  scores and estimates) that the leader path (``decide`` -> ``make_layout`` -> ``plan_record``)
  and ``plan_for`` made before the search was made faster (one lost node, eight, a degraded
  device, heterogeneous types, failed devices with a current plan, redundancy, CPU jobs). A
  change to any plan fails here;
* ``estimate_plan`` (memoised per distinct stage) against the per-stage, per-device
  computation it replaced, kept here as the reference, on every candidate of several searches
  and on plans that do not fit;
* ``switch_bytes``, the pipeline signatures of chunked layouts, the ranking without JSON
  encoding, against their plain versions; ``paused_gc`` leaves the collector as it was.
"""

from __future__ import annotations

import gc
import hashlib
import json
import threading
from dataclasses import replace

import pytest

from hspmd_elastic.contract import schema
from hspmd_elastic.plan import Plan
from hspmd_elastic.planner import (Inventory, ModelProfile, PlanInfeasibleError,
                                   PlannerOptions, cost, cpu_inventory, inventory_from_nodes,
                                   plan_for, preset)
from hspmd_elastic.planner import search
from hspmd_elastic.planner.api import Estimate
from hspmd_elastic.planner.passes import Solver, signature
from launcher.leader import build_snapshot, decide, make_layout, plan_record

TINY = ModelProfile("tiny", num_layers=4, hidden_size=64, ffn_size=128, num_heads=4,
                    vocab_size=256, seq_len=32)


# ---- canonical forms ------------------------------------------------------------------------

def _plan_form(plan: Plan) -> list:
    return [plan.global_batch, plan.num_layers,
            [[p.num_microbatches, p.microbatch_size,
              [[list(s.devices), list(s.layers)] for s in p.stages]] for p in plan.pipelines]]


def _estimate_form(e: Estimate) -> list:
    return [repr(e.step_time_s), repr(e.grad_sync_s), repr(e.bubble_fraction),
            [repr(t) for t in e.pipeline_times_s], sorted(e.memory_bytes.items()),
            sorted(e.memory_limit_bytes.items()), list(e.unused_devices),
            e.cross_node_replicas, e.switch_bytes, e.replica_nodes]


def _digest(form) -> str:
    return hashlib.sha256(json.dumps(form, sort_keys=True).encode()).hexdigest()[:16]


def _result_digest(result) -> str:
    return _digest([[_plan_form(c.plan), _estimate_form(c.estimate), c.label, repr(c.score)]
                    for c in (result.chosen, *result.alternatives)])


# ---- the scenarios --------------------------------------------------------------------------

def _nodes(n: int, devices: int = 8, short: tuple = ()) -> dict:
    return {f"agent-{i:05d}": schema.NodeRecord(
        host="127.0.0.1", agent_pid=1, state="ready", started_at=0.0,
        devices=[schema.DeviceInfo(index=j, type="H100", memory_bytes=80 << 30,
                                   uuid=f"GPU-{i}-{j}")
                 for j in range(4 if i in short else devices)],
        store_endpoint=f"127.0.0.1:{20000 + i}") for i in range(n)}


def _healthy() -> schema.DeviceHealthRecord:
    return schema.DeviceHealthRecord(state="healthy", reason="", xid=None, slowdown=None,
                                     at=0.0)


def _lose(*indices):
    def step(nodes, verdicts):
        for i in indices:
            nodes.pop(f"agent-{i:05d}", None)
    return step


def _slow(*where):
    def step(nodes, verdicts):
        for node, index, speed in where:
            verdicts[node, index] = schema.DeviceHealthRecord(
                state="degraded", reason="slow", xid=None, slowdown=speed, at=0.0)
    return step


def _start(nodes, verdicts):
    pass


def _leader_path(nodes: dict, model: str, global_batch: int, steps) -> list[str]:
    """Digests of the records the leader publishes as the steps change the cluster."""
    verdicts = {(node, d.index): _healthy() for node, rec in nodes.items() for d in rec.devices}
    record, out = None, []
    for step in steps:
        step(nodes, verdicts)
        decision = decide(build_snapshot(nodes, verdicts, "leader"), record)
        assert decision is not None
        layout = make_layout(decision, record, plan_for, preset(model), global_batch)
        record = plan_record(decision, layout, 0.0)
        out.append(_digest([record.devices, record.drain, record.inventory,
                            _plan_form(layout.plan), layout.planner]))
    return out


LEADER = {
    "60 nodes": (lambda: _nodes(60), "llama-32b", 8192,
                 [_start, _lose(3), _lose(*range(10, 18)), _slow(("agent-00020", 2, 0.5))]),
    "60 nodes, two of 4 devices": (
        lambda: _nodes(60, short=(5, 7)), "llama-32b", 8192,
        [_start, _lose(5), _slow(("agent-00001", 0, 0.5), ("agent-00002", 3, 0.25))]),
    "40 nodes, llama-7b": (lambda: _nodes(40), "llama-7b", 1024,
                           [_start, _lose(0), _slow(("agent-00004", 1, 0.5))]),
    "16 nodes of 4, llama-13b": (lambda: _nodes(16, devices=4), "llama-13b", 256,
                                 [_start, _lose(2), _lose(3)]),
}

# made by the search before its fast paths; the last step of the two 60-node paths is a degrade
# (speed only), whose plan now keeps the job's copies (planner/copies.py): 17 and 15 nodes hold
# every slice, where the former plans cut them to 6 and 2 for 1.0 % and 0.6 % of step time.
# The search then laid out subsets of the devices too (planner/subsets.py): on the 60-node
# degrade a plan over 406 devices joined, within the tie tolerance of the former one (44.997 s
# against 44.958 s) and moving less (6.019e12 bytes against 6.038e12), so it is chosen.
# Then a speed replan kept only the copies owed (Copies.owed: up to two): the 60-node degrade
# holds every slice on 6 nodes (was 17) in 44.50 s per step (was 44.997 s), the other one on
# 2 nodes (was 15) in 39.153 s (was 39.157 s).
GOLDEN_LEADER = {
    "16 nodes of 4, llama-13b": ["fc7174669634bb3d", "a156e29cb5fecc1f", "8086f8cb4fc478b8"],
    "40 nodes, llama-7b": ["02152f345ed282df", "4e1ff6239a14deb4", "385667fbba9716e6"],
    "60 nodes": ["bf84bd685e05dc03", "240d9b2f4488aff9", "8f5d6ee78350012e", "c355471679592cd7"],
    "60 nodes, two of 4 devices": ["c2e8f13856e3201b", "233a9d62b5363658", "0e0a97b622eb2f53"],
}


def _planner_results() -> dict:
    """Name -> the ``plan_for`` result of each planner-level scenario (or its error line)."""
    out: dict = {}

    def run(name, inventory, profile, batch, current=None, **options):
        try:
            out[name] = plan_for(inventory, profile, batch, current_plan=current,
                                 options=PlannerOptions(**options))
        except PlanInfeasibleError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        return out[name]

    het = inventory_from_nodes("8xH800,8xH800,16xH20")
    first = run("het", het, preset("llama-7b"), 512)
    run("het, redundancy 2", het, preset("llama-7b"), 512, redundancy=2)
    run("het, cross-node replicas", het, preset("llama-7b"), 512, cross_node_replicas=True)
    broken = het.with_health(failed=(3, 17), slowdown={20: 2.0, 21: 1.5})
    run("het, failed and slow", broken, preset("llama-7b"), 512, current=first.plan)
    run("het, failed and slow, switch weight", broken, preset("llama-7b"), 512,
        current=first.plan, switch_weight=0.5)
    mix = inventory_from_nodes(",".join(["8xH100"] * 12 + ["8xA100"] * 6 + ["4xL40S"] * 4))
    base = run("mix", mix, preset("llama-32b"), 512)
    run("mix, failed and slow", mix.with_health(failed=tuple(range(12)), slowdown={100: 3.0}),
        preset("llama-32b"), 512, current=base.plan)
    run("mix, redundancy 3", mix, preset("llama-32b"), 512, redundancy=3)
    run("mix, TP 4, PP 2 or 4", mix, preset("llama-32b"), 512, tp_degrees=(4,),
        pp_degrees=(2, 4))
    cpu = cpu_inventory({"n0": [0, 1, 2], "n1": [3, 4, 5]})
    job = run("cpu", cpu, TINY, 12, use_all_devices=True)
    run("cpu, one failed", cpu.with_health(failed=(4,)), TINY, 12, current=job.plan,
        use_all_devices=True, cross_node_replicas=True)
    return out


# made by the search before its fast paths; the two mix scenarios changed when the search laid
# out subsets of the devices (planner/subsets.py): the same chosen plans, new alternatives from
# the subsets
GOLDEN_PLANNER = {
    "cpu": "d7be4de77a698f59",
    "cpu, one failed": "6dbd20aa42a55f50",
    "het": "d78322645bb0fe2e",
    "het, cross-node replicas": "90a0a044e4b1a6bb",
    "het, failed and slow": "df6bee3cbcd1e0c7",
    "het, failed and slow, switch weight": "8230b72dc84b67c2",
    "het, redundancy 2": "90a0a044e4b1a6bb",
    "mix": "60adabdaf7f1e76b",
    "mix, TP 4, PP 2 or 4": "b92a19a222207b5d",
    "mix, failed and slow": "9efe276215df515d",
    "mix, redundancy 3": "fa343b544dce1fa7",
}


@pytest.mark.parametrize("name", sorted(LEADER))
def test_the_leader_publishes_the_plans_it_published_before(name):
    nodes, model, batch, steps = LEADER[name]
    assert _leader_path(nodes(), model, batch, steps) == GOLDEN_LEADER[name]


def test_the_planner_returns_the_results_it_returned_before():
    got = {name: r if isinstance(r, str) else _result_digest(r)
           for name, r in _planner_results().items()}
    assert got == GOLDEN_PLANNER


# ---- estimate_plan against the plain computation --------------------------------------------

def _reference_estimate(plan, inventory, profile, options, current_plan=None) -> Estimate:
    """``estimate_plan`` as it was: every stage and device through the per-stage functions."""
    if plan.num_layers != profile.num_layers:
        raise PlanInfeasibleError("num_layers")
    devs = inventory.by_id()
    for d in plan.devices:
        if d not in devs:
            raise PlanInfeasibleError(f"plan uses device {d}, which is not in the inventory")
        if not devs[d].usable:
            raise PlanInfeasibleError(f"plan uses device {d}, which has failed")
    memory, limits, stage_times, pipe_times = {}, {}, [], []
    for pi, pipe in enumerate(plan.pipelines):
        times = cost._pipeline_stage_times(plan, pi, devs, profile, options, memory, limits)
        stage_times.append(tuple(times))
        pipe_times.append(cost.pipeline_time(times, pipe.num_microbatches))
    sync = cost._grad_sync(plan, devs, profile)
    slowest = max(range(len(pipe_times)), key=lambda i: pipe_times[i])
    busy = plan.pipelines[slowest].num_microbatches * max(stage_times[slowest])
    step = max(pipe_times) + sync
    used = set(plan.devices)
    replicas = cost.replica_nodes(plan, devs)
    return Estimate(
        step_time_s=step, samples_per_s=plan.global_batch / step,
        tokens_per_s=plan.global_batch * profile.seq_len / step,
        pipeline_times_s=tuple(pipe_times), stage_times_s=tuple(stage_times),
        grad_sync_s=sync, bubble_fraction=max(0.0, 1.0 - busy / pipe_times[slowest]),
        memory_bytes=memory, memory_limit_bytes=limits,
        unused_devices=tuple(d.id for d in inventory.usable if d.id not in used),
        cross_node_replicas=replicas >= 2,
        switch_bytes=None if current_plan is None else _reference_switch(current_plan, plan,
                                                                         profile),
        replica_nodes=replicas, replica_devices=len(plan.pipelines))


def _reference_switch(old: Plan, new: Plan, profile) -> int:
    """``switch_bytes`` as it was: one pass over every device"s holdings."""
    per_param = profile.param_bytes + profile.optimizer_bytes
    before = cost._holdings(old) if old.num_layers == new.num_layers else {}
    total = 0.0
    for d, (a, b, tp, rank, emb, head) in cost._holdings(new).items():
        params = cost.stage_params(profile, b - a, emb, head) / tp
        kept = 0.0
        if d in before:
            c, e, tp0, rank0, emb0, head0 = before[d]
            frac = cost._shard_overlap(tp, rank, tp0, rank0)
            layers = max(0, min(b, e) - max(a, c))
            kept = frac * (layers * profile.layer_params
                           + (profile.embed_params if emb and emb0 else 0)
                           + (profile.head_params if head and head0 else 0))
        total += max(0.0, params - kept)
    return int(round(total * per_param))


def _same_outcome(fn_a, fn_b):
    """Both return equal values, or both raise the same error line."""
    outcomes = []
    for fn in (fn_a, fn_b):
        try:
            outcomes.append(("ok", fn()))
        except PlanInfeasibleError as exc:
            outcomes.append(("error", str(exc)))
    assert outcomes[0] == outcomes[1]
    return outcomes[0]


def _every_candidate(results: dict) -> list:
    return [(r, c) for r in results.values() if not isinstance(r, str)
            for c in (r.chosen, *r.alternatives)]


@pytest.fixture(scope="module")
def results():
    return _planner_results()


def test_estimates_equal_the_per_stage_computation(results):
    plans = [(r, c.plan) for r, c in _every_candidate(results)]
    assert len(plans) > 20
    for r, plan in plans:
        options = PlannerOptions(memory_fraction=0.9)
        current = plans[0][1] if plans[0][1].num_layers == plan.num_layers else None
        for inventory in (r.inventory, Inventory(r.inventory.devices)):
            kind, value = _same_outcome(
                lambda: cost.estimate_plan(plan, inventory, r.profile, options, current),
                lambda: _reference_estimate(plan, inventory, r.profile, options, current))
            assert kind == "ok" and value.memory_bytes and list(value.memory_bytes) == \
                list(_reference_estimate(plan, inventory, r.profile, options).memory_bytes)


def test_estimates_fail_as_the_per_stage_computation_does(results):
    r = results["mix"]
    plan = r.plan
    first = plan.pipelines[0].stages[0].devices[0]
    cases = [
        (plan, r.inventory.with_health(failed=(first,))),  # a failed device
        (plan, Inventory(tuple(d for d in r.inventory.devices if d.id != first))),  # unknown
    ]
    for fraction in (0.5, 0.2, 0.05):  # short of memory somewhere
        cases.append((plan, r.inventory, fraction))
    for case in cases:
        plan_, inventory = case[0], case[1]
        options = PlannerOptions(memory_fraction=case[2] if len(case) > 2 else 0.9)
        kind, value = _same_outcome(
            lambda: cost.estimate_plan(plan_, inventory, r.profile, options),
            lambda: _reference_estimate(plan_, inventory, r.profile, options))
        assert kind == "error", value


def test_switch_bytes_equal_the_per_device_sum(results):
    plans = [c.plan for _, c in _every_candidate(results) if c.plan.num_layers == 60]
    for old in plans[:6]:
        for new in plans:
            assert cost.switch_bytes(old, new, preset("llama-32b")) == \
                _reference_switch(old, new, preset("llama-32b"))


# ---- signatures, ranking, the collector ------------------------------------------------------

def test_chunk_signatures_are_the_pipelines_signatures():
    inventory = inventory_from_nodes("8xH100,8xH100,4xH20,8xA100,2xL40S,8xH100,1xH20")
    inventory = inventory.with_health(slowdown={3: 2.0, 17: 1.5})
    solver = Solver(preset("llama-7b"), 256, PlannerOptions())
    for _, groups in search._group_sets(inventory.usable, solver.profile, solver.options,
                                        solver.interned):
        sids = [g.sid for g in groups]
        same = [a.node == b.node for a, b in zip(groups, groups[1:])]
        for depth in range(1, len(groups) + 2):
            pipes = search._pipelines(groups, depth, False)
            assert search._chunk_signatures(sids, same, depth) == [signature(p) for p in pipes]


def _reference_rank(candidates, options):
    def key(c):
        redundant = options.cross_node_replicas and not c.estimate.cross_node_replicas
        idle = options.use_all_devices and bool(c.estimate.unused_devices)
        return ((int(idle), int(redundant)), c.score, c.plan.to_json())

    ranked = sorted(candidates, key=key)
    head = key(ranked[0])
    near = [c for c in ranked
            if key(c)[0] == head[0] and c.score <= head[1] * (1.0 + options.tie_tolerance)]
    near.sort(key=lambda c: (c.estimate.switch_bytes or 0,
                             max(len(p.stages) for p in c.plan.pipelines), c.score,
                             c.plan.to_json()))
    return near + [c for c in ranked if c not in near]


def test_ranking_equals_the_plain_sort_with_json_tie_breaks(results):
    for r in results.values():
        if isinstance(r, str):
            continue
        cands = [r.chosen, *r.alternatives]
        tied = [replace(c, score=1.0) for c in cands]  # every score tied: JSON decides
        half = [replace(c, score=float(i // 2)) for i, c in enumerate(cands)]
        for options in (PlannerOptions(), PlannerOptions(cross_node_replicas=True),
                        PlannerOptions(use_all_devices=True, tie_tolerance=0.5)):
            for group in (cands, cands[::-1], tied, tied[::-1], half):
                assert [id(c) for c in search._rank(list(group), options)] == \
                    [id(c) for c in _reference_rank(list(group), options)]


def test_paused_gc_restores_the_collector_as_it_found_it():
    was = gc.isenabled()
    try:
        gc.enable()
        with search.paused_gc():
            assert not gc.isenabled()
            with search.paused_gc():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with search.paused_gc():
            pass
        assert not gc.isenabled()
        gc.enable()
        inside = threading.Barrier(2)
        leave = threading.Event()

        def hold():
            with search.paused_gc():
                inside.wait()
                leave.wait()

        other = threading.Thread(target=hold)
        other.start()
        inside.wait()
        with search.paused_gc():
            pass
        assert not gc.isenabled()  # the other thread still plans
        leave.set()
        other.join()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
