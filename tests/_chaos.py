"""The chaos soak: one elastic job on the multi-host topology (``tests/_netns.py``: every node in
a network namespace of its own, a 3-member etcd in namespaces) driven through a scenario of many
fault kinds by the fault-injection harness (``launcher.inject``), then judged. Shared by
``tests/test_chaos_soak.py`` (one cycle of faults) and ``scripts/soak`` (many cycles).

The job: ``hspmd-launch --hspmd-elastic`` agents ``node-a`` (1 worker), ``node-b`` (2) and
``node-c`` (3), each advertising its data address (``--local-addr``), reading device faults
from etcd (``--hspmd-health-source scripted:etcd``), training
``tests/scripts/elastic_train.py`` (a 2-layer float64 model, a global batch of 4). ``node-a``
is started first and leads; the scenario's node faults hit ``node-b`` and ``node-c``. Node-c
has three workers because two of its slots are lost for good in a cycle (a killed worker, a
hung one: an agent never restarts a slot whose worker failed) and the kill of its agent must
still take a device away; the ``join`` that follows starts a fresh agent in node-c's namespace
(the harness reads the namespace from the topology file), which brings all three back.

The verdict (``judge``): every fault handled (``recovered`` or ``survived`` in the report), at
most one step trained again per fault (a rank one step ahead rolls back; more means the state
came from elsewhere than the survivors' memory), no sample lost (the progress log's lineage:
no plan resumed past a step its predecessor did not complete), every agent still running at the
end exited 0, every worker that finished ran every step and switched only by BSR (no
checkpoint), and the final parameters, assembled from every finished worker's shards, equal the
fault-free reference within 1e-9. A problem is a line in ``problems``; none means the soak
passed.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import _elastic
from _elastic_job import TINY
from _netns import NetnsJob, Topology
from _wait import wait_for
from launch_harness import SCRIPTS, base_env

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient
from launcher.inject.api import Report
from launcher.inject.detect import FileProgress, JobObserver
from launcher.inject.faults import InjectContext, make_fault
from launcher.inject.harness import Harness
from launcher.inject.report import all_handled
from launcher.inject.scenario import Scenario, parse_fault, parse_scenario
from launcher.inject.topology import load_topology

NODES = {"node-a": 1, "node-b": 1, "node-c": 3}  # workers per node
CONFIG = TINY
BATCH, SEED, DATA_SEED = 4, 3, 7
# AdamW's eps, for the workers and the reference: with the default (1e-8) the rounding
# differences of another reduction order (a plan splitting the batch otherwise than the
# reference) grow about tenfold every ten steps, so a run of hundreds of steps cannot equal the
# fault-free one within 1e-9, whatever the faults; with 1.0 (close to momentum SGD) they stay
# at machine precision over thousands of steps.
ADAM_EPS = 1.0
SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


TAIL_STEPS = 100  # trained past the scenario's last trigger step


def steps_for(path: Path) -> int:
    """How many steps the job trains for the scenario at ``path``: its last trigger step plus
    ``TAIL_STEPS`` (the last fault needs a job still training after it)."""
    faults = json.loads(path.read_text())["faults"]
    return max(f["at"]["step"] for f in faults if isinstance(f.get("at"), dict)) + TAIL_STEPS


@dataclass(frozen=True)
class Pace:
    """How fast the job goes and how soon it gives up: ``steps`` to train, ``step_time``
    seconds of pacing per step, the lease TTL, the workers' collective timeout (``comm_s``),
    the agents' hang limit (``hang_s``, above ``comm_s``: the peers of a hung worker wait for
    a plan, they are not hung), every other wait of a worker (``timeout_s``; also the grace a
    new worker has before its first step: on a busy machine starting one takes long)."""

    steps: int
    step_time: float = 0.1
    ttl: float = 2.0
    comm_s: float = 8.0
    hang_s: float = 20.0
    timeout_s: float = 120.0


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    max_param_diff: Optional[float] = None
    results: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": not self.problems, "problems": self.problems,
                "max_param_diff": self.max_param_diff, "finished_workers": sorted(self.results)}


class ChaosJob:
    """The job on ``topo`` (nodes ``NODES``), its scenario, its run and its verdict."""

    def __init__(self, topo: Topology, marker: str, pace: Pace):
        self.topo, self.pace = topo, pace
        self.env = base_env(marker, HSPMD_HANG_TIMEOUT_S=f"{pace.hang_s:g}",
                            HSPMD_HANG_STARTUP_S=f"{pace.timeout_s:g}")
        self.job = NetnsJob(topo, self.env, ttl=pace.ttl)
        self.model, self.out = topo.tmp / "model.json", topo.tmp / "out"
        self.progress, self.samples = topo.tmp / "progress", topo.tmp / "samples"
        self.model.write_text(CONFIG.to_json())
        self.reference = _elastic.reference_payload(CONFIG, steps=pace.steps,
                                                    global_batch=BATCH, seed=SEED,
                                                    data_seed=DATA_SEED)
        self.first_pids: dict[str, int] = {}
        self.spawned: dict[str, Any] = {}
        self.overlap: Optional[KillDuringSwitch] = None
        self.events: list = []  # the journal and the device verdicts the harness saw
        self.verdicts: list = []

    @property
    def name(self) -> str:
        return self.job.name

    def agent_args(self, node: str) -> list[str]:
        p = self.pace
        return self.job.args(
            node, str(len(NODES)), NODES[node], "--hspmd-elastic", "--hspmd-model",
            str(self.model), "--hspmd-global-batch", str(BATCH),
            "--hspmd-health-source", "scripted:etcd",
            str(SCRIPTS / "elastic_train.py"), "--config", str(self.model),
            "--steps", str(p.steps), "--global-batch", str(BATCH), "--seed", str(SEED),
            "--data-seed", str(DATA_SEED), "--adam-eps", f"{ADAM_EPS:g}", "--out", str(self.out),
            "--progress-dir", str(self.progress), "--sample-log", str(self.samples),
            "--step-time", f"{p.step_time:g}",
            "--timeout", f"{p.timeout_s:g}", "--comm-timeout", f"{p.comm_s:g}")

    def _leader(self) -> Optional[str]:
        try:
            kv = self.job.client.get(schema.leader_key(self.name))
        except CoordinationError:
            return None
        return schema.decode(kv.key, kv.value).node if kv is not None else None

    def start(self, timeout: float = 240.0) -> dict[str, int]:
        """node-a first (it leads), then the others; returns the first plan's worker pids once
        every worker trained a step."""
        self.job.start("node-a", self.agent_args("node-a"))
        wait_for(lambda: self.job.check_agents() or self._leader() == "node-a", timeout,
                 "node-a leading", interval=0.1)
        for node in list(NODES)[1:]:
            self.job.start(node, self.agent_args(node))
        want = {f"{n}:{i}" for n, k in NODES.items() for i in range(k)}

        def all_up():
            self.job.check_agents()
            w = self.job.workers()
            return {d: r.pid for d, r in w.items()} if want <= set(w) and all(
                w[d].step >= 1 for d in want) else None

        self.first_pids = wait_for(all_up, timeout, f"the first plan's {len(want)} workers",
                                   interval=0.1)
        return self.first_pids

    def scenario(self, path: Path) -> Scenario:
        """The scenario file, its ``join`` entries given this job's flags for their node."""
        body = json.loads(path.read_text())
        for entry in body["faults"]:
            if entry["fault"] == "join":
                entry["args"] = self.agent_args(entry["target"]["node"])
        return parse_scenario(body, str(path))

    def run(self, scenario: Scenario, wait_end_s: float = 120.0, on_row=None) -> Report:
        """The harness over the job: faults one at a time, then the job's end."""
        client = EtcdClient(self.topo.etcd.endpoints, timeout=5.0)
        observer = JobObserver(client, self.name,
                               FileProgress(str(self.progress / "*.jsonl"))).start()
        ctx = InjectContext(client, self.name, etcd_members=self.topo.etcd.members,
                            log_dir=str(self.topo.tmp / "inject"), env=self.env,
                            topology=load_topology(str(self.topo.topology_file())))
        self.harness = Harness(scenario, ctx, observer, wait_end_s=wait_end_s, on_row=on_row)
        self.overlap = KillDuringSwitch(observer, ctx, OVERLAP_NODE).start() \
            if any(f.fault == "join" and f.target.get("node") == OVERLAP_NODE
                   for f in scenario.faults) else None
        try:
            return self.harness.run()
        finally:
            if self.overlap is not None:
                self.overlap.stop()
            self.events, self.verdicts = observer.events(), observer.verdicts()
            self.spawned = dict(ctx.spawned)
            observer.stop()
            client.close()

    def results(self) -> dict[str, dict]:
        import torch

        return {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
                for p in sorted(self.out.glob("*.pt"))}

    def judge(self, report: Report, agent_timeout: float = 60.0) -> Verdict:
        """Wait for the test's own agents (the harness waited for those it started), then
        every check of the module docstring."""
        v = Verdict()
        if not all_handled(report):
            v.problems += [f"fault #{r.index} {r.fault}: {r.outcome}"
                           + (f" ({r.note})" if r.note else "")
                           for r in report.rows if r.outcome not in ("recovered", "survived")]
        for r in report.rows:  # a rank one step ahead rolls back; more is work redone
            if r.steps_lost is not None and r.steps_lost > 1:
                v.problems.append(f"fault #{r.index} {r.fault}: {r.steps_lost} steps trained "
                                  f"again (recovered by {r.recovered_by})")
        if report.samples_lost != 0 or report.steps_skipped != 0:
            v.problems.append(f"samples lost: {report.samples_lost}, steps skipped: "
                              f"{report.steps_skipped}")
        killed, gone = set(), set()  # nodes whose agent was ever killed / is killed at the end
        for r in report.rows:
            if r.injected_at is not None and r.fault == "kill-agent":
                killed.add(r.target["node"])
                gone.add(r.target["node"])
            elif r.injected_at is not None and r.fault == "join":
                gone.discard(r.target["node"])
        for node, agent in self.job.agents.items():
            if node in killed:
                continue
            try:
                code = agent.proc.wait(timeout=agent_timeout)
            except Exception:  # noqa: BLE001 - reported, then killed by close()
                code = None
            if code != 0:
                v.problems.append(f"agent {node} exited {code}: {agent.stderr()[-400:]}")
        if self.overlap is not None:
            v.problems += self.overlap.problems(self.events)
        for node, proc in self.spawned.items():
            if node not in gone and proc.poll() != 0:
                v.problems.append(f"joined agent {node} exited {proc.returncode}")
        v.results = self.results()
        for dev, res in v.results.items():
            if res["state"] != "done" or res["steps_done"] != self.pace.steps:
                v.problems.append(f"{dev}: {res['state']} after {res['steps_done']} steps")
            sources = {s["source"] for s in res["switches"]}
            if not sources <= {"init", "bsr"}:
                v.problems.append(f"{dev} switched from {sorted(sources)} (a checkpoint?)")
        if not v.results:
            v.problems.append("no worker finished")
            return v
        ref_params, ref_losses = reference(self.pace.steps)
        try:
            got = _elastic.assemble(list(v.results.values()), self.reference)
        except Exception as exc:  # noqa: BLE001 - e.g. a slice nobody holds
            v.problems.append(f"parameters could not be assembled: {exc}")
            return v
        v.max_param_diff = max((got[n] - ref.to(got[n].dtype)).abs().max().item()
                               for n, ref in ref_params.items())
        if not v.max_param_diff <= 1e-9:
            v.problems.append(f"max |elastic - reference| = {v.max_param_diff:g} > 1e-9; "
                              + first_divergence(self.samples, ref_losses))
        return v

    def close(self) -> None:
        self.job.close()


OVERLAP_NODE = "node-c"


class KillDuringSwitch:
    """Overlapping faults: while the job switches into the plan that takes ``node`` back (the
    scenario's ``join``: a ``replan`` with a ``join <node>`` change, journaled after the
    scenario started), the first worker that plan starts on ``node`` is SIGKILLed through the
    harness's own ``kill-worker`` fault, as soon as its agent records it (``workers/<node>/<i>``
    with that plan's version): that worker must take part in the switch's process group, so
    the switch cannot have ended. Timed on the journal and the worker records the harness's
    observer watches, never on sleeps. ``problems`` says what went wrong: no such switch, no
    kill, or a kill after the switch had ended (its ``switch-done`` journaled first)."""

    def __init__(self, observer: JobObserver, ctx: InjectContext, node: str,
                 timeout: float = 900.0):
        self.observer, self.ctx, self.node, self.timeout = observer, ctx, node, timeout
        self.after_seq = observer.baseline().last_seq
        self.version: Optional[int] = None
        self.killed: Optional[dict[str, Any]] = None
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kill during a switch",
                                         daemon=True)

    def start(self) -> "KillDuringSwitch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _switch_version(self) -> Optional[int]:
        for ev in self.observer.view.events_after(self.after_seq):
            if ev.type == "replan" and any(
                    c.kind == "join" and c.node == self.node
                    for c in schema.event_detail(ev).changes):
                return schema.event_detail(ev).version
        return None

    def _started(self) -> Optional[int]:
        """The local rank of a worker of ``node`` started for the switch's plan, if any."""
        for (node, rank), rec in sorted(self.observer.view.workers().items()):
            if node == self.node and rec.plan_version == self.version:
                return rank
        return None

    def _wait_exec(self, rank: int) -> None:
        """Until the recorded process carries the job in its environment: the agent records a
        worker as it spawns it, and between fork and exec the child still has the agent's
        environment, which ``inject`` rightly refuses to signal (bounded)."""
        from launcher.inject.api import TargetNotFound  # Refused is one
        from launcher.inject.targets import check_worker

        def proven() -> bool:
            rec = self.observer.view.workers().get((self.node, rank))
            if rec is None:
                return False
            try:
                check_worker(rec.pid, self.ctx.job, self.node, rank)
            except TargetNotFound:
                return False
            return True

        wait_for(proven, 10.0, f"worker {self.node}/{rank} to carry job {self.ctx.job}",
                 interval=0.005)

    def _run(self) -> None:
        deadline, gen = time.monotonic() + self.timeout, -1
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                gen = self.observer.wait_change(gen, 1.0)
                if self.version is None:
                    self.version = self._switch_version()
                if self.version is None:
                    continue
                rank = self._started()
                if rank is None:
                    continue
                self._wait_exec(rank)
                spec = parse_fault({"fault": "kill-worker",
                                    "target": {"node": self.node, "local_rank": rank}},
                                   0, {"detect_timeout_s": 30.0, "recover_timeout_s": 90.0},
                                   "kill during a switch")
                inj = make_fault(spec).inject(self.ctx)
                self.killed = dict(inj.detail, local_rank=rank, at=time.time())
                return
        except Exception as exc:  # noqa: BLE001 - reported by problems()
            self.error = f"{type(exc).__name__}: {exc}"

    def problems(self, events: list) -> list[str]:
        if self.error is not None:
            return [f"kill during a switch: {self.error}"]
        if self.version is None:
            return [f"kill during a switch: no plan took {self.node} back"]
        if self.killed is None:
            return [f"kill during a switch: no worker of {self.node} started for plan "
                    f"v{self.version}"]
        done = [ev for ev in events if ev.type == "switch-done" and ev.at <= self.killed["at"]
                and schema.switch_of(ev).to_version == self.version]
        if done:
            return [f"kill during a switch: the switch into v{self.version} had ended "
                    f"(event #{done[0].seq}) before the kill"]
        return []

    def summary(self, events: list) -> str:
        """One line: what was killed, during which switch, and how that switch ended."""
        end = "no end journaled"
        for ev in events:
            mark = schema.switch_of(ev)
            if ev.type == "replan" and mark is not None and mark.from_version == self.version:
                end = f"superseded by v{mark.to_version} (event #{ev.seq})"
                break
            if mark is not None and mark.to_version == self.version and ev.type != "replan":
                end = f"{ev.type} (event #{ev.seq})"
                break
        return (f"killed {self.node}:{(self.killed or {}).get('local_rank')} during the switch "
                f"into v{self.version}: {end}")


def reference(steps: int) -> tuple[dict, list[float]]:
    """The fault-free run: final parameters and the global loss of every step."""
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.graph.reference import reference_train
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler

    sample = synthetic_sampler(CONFIG, DATA_SEED)
    return reference_train(CONFIG, SEED, [global_batch_at(sample, s, BATCH)
                                          for s in range(steps)], AdamWConfig(eps=ADAM_EPS))


def first_divergence(samples: Path, ref_losses: list[float], tol: float = 1e-9) -> str:
    """Where the run left the fault-free trajectory: the first step whose global loss (the
    workers' ``--sample-log`` lines; the newest plan's where a step ran twice) differs from the
    reference's, i.e. the first step trained from a different state."""
    seen: dict[int, tuple[int, float]] = {}  # step -> (plan version, loss)
    for path in sorted(samples.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                step, version, loss = int(rec["step"]), int(rec["plan_version"]), rec["loss"]
            except (ValueError, KeyError, TypeError):
                continue
            if step not in seen or version > seen[step][0]:
                seen[step] = (version, float(loss))
    for step in sorted(seen):
        version, loss = seen[step]
        if step < len(ref_losses) and abs(loss - ref_losses[step]) > tol:
            return (f"the loss first differs from the reference at step {step} (plan v{version}: "
                    f"{loss!r} vs {ref_losses[step]!r})")
    missing = sorted(set(range(len(ref_losses))) - set(seen))
    return (f"every logged loss equals the reference; steps without a log line: "
            f"{missing[:10]}" if missing else "every step's loss equals the reference")
