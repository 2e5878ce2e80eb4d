"""The HSPMD path end to end: real etcd, ``hspmd-launch --hspmd-elastic`` agents as nodes of this
host, real gloo workers, real SIGKILLs.

The agents declare their devices small (``--hspmd-device-memory``), so the leader's planner
shards the model (TP and/or PP) as it would on GPUs that cannot hold a replica. A worker
SIGKILLed mid-run forces a differently specialized plan: the survivors reshard weights and
AdamW state by fused BSR into it (bytes moved, read from the journal's ``switch-done`` timings),
every DP replica ends equal, and the parameters equal the fault-free dense reference (float64; a
slice nobody holds stays NaN and fails the check).
A GPU that shows warning signs (a scripted ``suspect`` verdict) is drained: the next plan leaves
it out while it still works, it serves as a BSR source in that switch (the bytes its state sent
are in its ``drained`` event), then its worker leaves and the device stays out. With
``--hspmd-redundancy 2`` ("every parameter slice on both nodes", a hard constraint) and no plan
that can keep it, nothing is published and the job fails on every agent with one line naming
the shortfall (the same judge ends a job whose fault leaves no such plan, and the planner never
returns a plan that breaks it: ``tests/test_planner_capacity.py``).
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

import _elastic

from launch_harness import SCRIPTS, Launcher, base_env, wait_for

from hspmd_elastic.coord import read_events, schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.graph.config import ModelConfig

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(90)]

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=8, dtype="float64")
STEPS, BATCH, SEED, DATA_SEED, PAUSE = 6, 4, 3, 7, 3
REFERENCE = _elastic.reference_payload(CONFIG, steps=STEPS, global_batch=BATCH, seed=SEED,
                                       data_seed=DATA_SEED)
MEMORY = "150KiB"  # one replica needs about 235 KiB (weights, gradients, AdamW, activations)
NODES = ("node-a", "node-b")


class Job:
    def __init__(self, etcd, tmp: Path, marker: str):
        self.etcd, self.tmp, self.name = etcd, tmp, f"hs-{uuid.uuid4().hex[:8]}"
        self.config = tmp / "model.json"
        self.config.write_text(CONFIG.to_json())
        self.out, self.release = tmp / "out", tmp / "release"
        self.env = base_env(marker)
        self.agents: dict[str, Launcher] = {}
        self.client = EtcdClient(etcd.endpoints, timeout=5.0)

    def start(self, node: str, nproc: int, *flags: str, nnodes: int = 2,
              redundancy: int = 2) -> Launcher:
        args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.etcd.endpoint_str, "--rdzv-id", self.name,
                "--hspmd-node-id", node, "--hspmd-lease-ttl", "2", "--shutdown-timeout", "5",
                "--rdzv-conf", "join_timeout=60", "--hspmd-elastic",
                "--hspmd-model", str(self.config), "--hspmd-global-batch", str(BATCH),
                "--hspmd-redundancy", str(redundancy), *flags,
                str(SCRIPTS / "elastic_train.py"), "--config", str(self.config),
                "--steps", str(STEPS), "--global-batch", str(BATCH), "--seed", str(SEED),
                "--data-seed", str(DATA_SEED), "--out", str(self.out),
                "--pause-at", str(PAUSE), "--release", str(self.release), "--timeout", "30"]
        self.agents[node] = Launcher(args, self.env, self.tmp, node)
        return self.agents[node]

    def paused(self, devices: list[str], timeout: float = 60.0) -> dict[str, int]:
        """Wait until ``devices`` report step PAUSE (where they wait); their pids."""
        prefix = schema.workers_prefix(self.name)

        def ready():
            for node, agent in self.agents.items():
                assert agent.proc.poll() is None, f"{node} exited early:\n{agent.stderr()}"
            recs = {kv.key[len(prefix):].replace("/", ":"): schema.decode(kv.key, kv.value)
                    for kv in self.client.get_prefix(prefix)}
            if all(d in recs and recs[d].step >= PAUSE for d in devices):
                return {d: recs[d].pid for d in devices}
            return None

        return wait_for(ready, timeout, f"{devices} at step {PAUSE}")

    def plans(self) -> dict[int, tuple]:
        """Every published plan: version -> (Plan, device ids)."""
        out = {}
        for kv in self.client.get_prefix(schema.plan_history_prefix(self.name)):
            rec = schema.decode(kv.key, kv.value)
            out[rec.version] = (plan_of(rec), list(rec.devices))
        return out

    def results(self) -> dict[str, dict]:
        import torch

        return {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
                for p in sorted(self.out.glob("*.pt"))}

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait(timeout=10)
        self.client.close()


@pytest.fixture
def job(etcd_server, tmp_path, marker):
    j = Job(etcd_server, tmp_path, marker)
    yield j
    j.close()


def specialization(plan) -> list:
    """Per pipeline, per stage: (TP degree, layer range)."""
    return sorted(tuple((s.tp, s.layers) for s in p.stages) for p in plan.pipelines)


def roles(plan, devices: list[str]) -> dict[str, tuple]:
    """device -> (TP degree, TP rank, layer range) in ``plan``."""
    return {devices[d]: (s.tp, r, s.layers) for p in plan.pipelines for s in p.stages
            for r, d in enumerate(s.devices)}


def check_replicas_and_reference(results: dict[str, dict]) -> float:
    """Every element of every parameter is held (no NaN), every DP replica holds the same
    values, and they equal the fault-free reference; the largest difference from it."""
    import torch

    from hspmd_elastic.graph.config import param_specs

    full = _elastic.assemble(list(results.values()), REFERENCE)
    ref = _elastic.reference_params(REFERENCE)
    assert set(full) == set(ref) == set(param_specs(CONFIG))
    for name, tensor in full.items():
        missing = int(torch.isnan(tensor).sum())
        assert not missing, f"{name}: {missing} element(s) held by no rank"
        for dev, res in results.items():
            if name in res["final_state"]:
                ranges, part = res["final_state"][name]
                mine = part.to(torch.float64)
                held = tensor[tuple(slice(lo, hi) for lo, hi in ranges)]
                gap = float((mine - held).abs().max())
                assert gap <= 1e-12, f"{name}: {dev}'s replica differs by {gap:g}"
    diffs = {n: float((full[n] - ref[n].to(torch.float64)).abs().max()) for n in ref}
    worst = max(diffs, key=diffs.get)
    assert all(d <= 1e-9 for d in diffs.values()), f"{worst}: {diffs[worst]:g} from the reference"
    return diffs[worst]


def test_a_worker_kill_reshards_into_a_differently_specialized_plan(job):
    """One node, 5 workers declared at 200 KiB (one replica needs about 235 KiB): plan v1 shards
    the model (TP and/or PP) over two replicas; SIGKILLing node-a:4 forces a plan with another
    TP degree, layer split or pipeline count; the survivors move real bytes by BSR, every DP
    replica ends equal, and the result equals the fault-free reference."""
    job.start("node-a", 5, "--hspmd-device-memory", "200KiB", nnodes=1, redundancy=1)
    devices = [f"node-a:{i}" for i in range(5)]
    pids = job.paused(devices)
    v1, names1 = job.plans()[1]
    assert any(s.tp > 1 for p in v1.pipelines for s in p.stages) or \
        any(len(p.stages) > 1 for p in v1.pipelines), v1
    victim = "node-a:4"
    os.kill(pids[victim], signal.SIGKILL)
    job.release.touch()
    code = job.agents["node-a"].wait(60)
    assert code == 0, job.agents["node-a"].stderr()[-6000:]
    plans = job.plans()
    last = max(plans)
    v2, names2 = plans[last]
    assert last >= 2 and victim not in names2
    assert specialization(v2) != specialization(v1), (v1, v2)
    before, after = roles(v1, names1), roles(v2, names2)
    assert any(before[d] != after[d] for d in after), (before, after)
    events = read_events(job.client, job.name)
    done = [e for e in events if e.type == "switch-done"
            and e.detail.get("plan_version") == last]
    assert done and done[0].timings["bsr_bytes_total"] > 0, [(e.type, e.detail) for e in events]
    assert not {"fallback", "switch-failed", "restart"} & {e.type for e in events}
    results = job.results()
    assert set(results) == set(devices) - {victim}
    for dev, res in results.items():
        assert res["state"] == "done" and res["steps_done"] == STEPS, (dev, res["state"])
        assert res["pid"] == pids[dev], f"{dev} was restarted"
        assert all(s["source"] in ("init", "bsr") for s in res["switches"]), res["switches"]
    assert len(v2.pipelines) >= 2, v2  # replicas to compare
    diff = check_replicas_and_reference(results)
    print(f"v1 {specialization(v1)} -> v{last} {specialization(v2)}: "
          f"{int(done[0].timings['bsr_bytes_total'])} B moved, max diff {diff:.1e}")


def test_no_plan_keeps_the_redundancy_the_job_fails_naming_the_shortfall(job):
    """One worker per node declared at 200 KiB: a pipeline over both nodes fits, two replicas
    do not, so no plan keeps every slice on both nodes. Nothing is published, no worker starts,
    and both agents exit 1 with one line naming the shortfall."""
    for node in NODES:
        job.start(node, 1, "--hspmd-device-memory", "200KiB")
    codes = {n: a.wait(60) for n, a in job.agents.items()}
    assert codes == {"node-a": 1, "node-b": 1}, {n: a.stderr()[-3000:]
                                                for n, a in job.agents.items()}
    for node, agent in job.agents.items():
        lines = [ln for ln in agent.stderr().splitlines()
                 if ln.startswith("hspmd-launch: error:")]
        assert lines, agent.stderr()[-3000:]
        assert "no plan keeps the redundancy guarantee: redundancy 2" in lines[-1] and \
            "counting at most one replica per node: short by 109.0 KiB" in lines[-1], lines[-1]
        assert "started pid" not in agent.stderr()
    assert job.plans() == {}  # no plan breaking the guarantee was published


def test_a_suspect_gpu_is_drained_its_state_leaves_by_network_then_it_is_released(job):
    """One node, 3 workers declared at 150 KiB (no device holds a replica, so each holds a
    shard nobody else has); node-a:2 turns suspect mid-run: plan v2 shards over the other two
    and drains it; its shard reaches them by fused BSR (no checkpoint exists), then its worker
    leaves, no failure is counted, and the result equals the fault-free reference."""
    from launcher.health.scripted import Fault, encode_fault_script

    job.start("node-a", 3, "--hspmd-device-memory", MEMORY, "--hspmd-health-source",
              "scripted:etcd", nnodes=1, redundancy=1)
    devices = [f"node-a:{i}" for i in range(3)]
    pids = job.paused(devices)
    assert sorted(job.plans()[1][1]) == devices
    suspect = "node-a:2"
    job.client.put(schema.fault_script_key(job.name, "node-a"), encode_fault_script(
        [Fault(2, "suspect", reason="240 new correctable ECC error(s)")]))

    def drain_plan():
        for version, (_plan, names) in job.plans().items():
            if version > 1:
                return version, names
        return None

    version, names = wait_for(drain_plan, 30, "the plan that drains node-a:2")
    rec = schema.decode(schema.plan_history_key(job.name, version), job.client.get(
        schema.plan_history_key(job.name, version)).value)
    assert suspect not in names and rec.drain == [suspect], rec
    job.release.touch()
    code = job.agents["node-a"].wait(60)
    assert code == 0, job.agents["node-a"].stderr()[-6000:]
    events = read_events(job.client, job.name)
    drained = [e for e in events if e.type == "drained"]
    assert [e.detail["device"] for e in drained] == [suspect], [(e.type, e.detail)
                                                                for e in events]
    sent = drained[0].timings["bsr_bytes_sent"]
    assert sent > 0 and drained[0].detail["plan_version"] == version
    changes = [(e.type, e.detail["devices"]) for e in events if e.type == "drain"]
    assert changes == [("drain", [suspect])], changes
    assert not {"failure", "fallback", "switch-failed"} & {e.type for e in events}
    assert all(suspect not in names for v, (_p, names) in job.plans().items() if v >= version)
    results = job.results()
    assert set(results) == set(devices) - {suspect}  # the drained worker left, holding nothing
    for dev, res in results.items():
        assert res["pid"] == pids[dev] and res["state"] == "done", (dev, res["state"])
        assert res["switches"][-1]["source"] == "bsr"
    received = sum(r["switches"][-1]["bsr_bytes_received"] for r in results.values())
    assert received >= sent
    diff = check_replicas_and_reference(results)
    print(f"drained {suspect}: sent {int(sent)} B by BSR; max diff {diff:.1e}")

