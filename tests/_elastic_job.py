"""The elastic-job harness of the end-to-end tests, and the tiny model the elastic tests train.

``ElasticLaunchJob`` is one job of real ``hspmd-launch --hspmd-elastic`` agents, started as
separate nodes of this host (``--hspmd-node-id``) against a real etcd, each running
``tests/scripts/elastic_train.py`` workers over gloo. It holds the job's files (the model
config, the workers' results, the release file, the sample logs), the agents by node, and an
etcd client to watch the job: worker records, the journal, plans, switch acks. ``start`` builds
an agent's argv, in one place; the waits (``wait_paused``, ``wait_at_step``, ``finish``) fail
with the agents' stderr as soon as one exits early; ``assert_recovered`` and
``assert_replicas_match_reference`` (``JobFacts``) check the final parameters against the dense
reference trained on the same global batches (float64, 1e-9).

``worker_kill_run`` is the suite's one full "worker SIGKILL -> BSR switch into a new plan" run:
TLS and RBAC on etcd, two nodes, sharded plans, sample ids logged, switch acks watched. It runs
once per session (``shared_worker_kill_run``, from a module-scoped fixture) and keeps what its
readers returned as a ``WorkerKillRun`` (the same ``JobFacts`` checks), which the tests of
several modules read, each its own angle: recovery (test_elastic_e2e.py), TLS and auth
(test_security_tls.py), resharding into a differently specialized plan (test_elastic_hspmd.py).

Every job trains ``TINY`` for ``STEPS`` steps of ``BATCH`` rows (seeds ``SEED``, ``DATA_SEED``);
its workers pause after step ``PAUSE`` until the test creates ``job.release``, so a fault hits a
known state. What the tests of a file do differently is a parameter: the job-name prefix, the
``--hspmd-redundancy`` of every agent, launcher flags (``--hspmd-device-memory`` ...) and
training flags per agent.

``TINY``, ``write_tiny`` and ``elastic_argv`` serve the other elastic tests too (the netns and
security ones), which build their agents' argv around their own launcher. The one-node jobs
(``one_node_kill_run``; ``straggler_agent`` and ``throttled_job`` for the speed replans) and
``worker_results`` (what the workers saved) serve the tests of one node's job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
import traceback
import uuid
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import pytest

import _elastic
from _wait import Recorder, wait_for
from launch_harness import SCRIPTS, Launcher, assert_agents_running, base_env

from hspmd_elastic.coord import PrefixWatch, read_events
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import EventType
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.graph.config import ModelConfig
from launcher.cgroups import CpuQuota

# The tiny model of the elastic tests: two layers, float64 (exact comparisons at 1e-9).
TINY = ModelConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                   seq_len=8, dtype="float64")
TRAIN_SCRIPT = SCRIPTS / "elastic_train.py"
STEPS, BATCH, SEED, DATA_SEED, PAUSE = 6, 4, 3, 7, 3
REFERENCE = _elastic.reference_payload(TINY, steps=STEPS, global_batch=BATCH, seed=SEED,
                                       data_seed=DATA_SEED)


def write_tiny(path: Union[str, Path]) -> Path:
    """``TINY`` as the JSON file ``--hspmd-model`` and ``elastic_train.py --config`` read."""
    path = Path(path)
    path.write_text(TINY.to_json())
    return path


def elastic_argv(model: Union[str, Path], batch: int, *flags: str, steps: int,
                 out: Union[str, Path], seed: int = SEED, data_seed: int = DATA_SEED,
                 train: Sequence[str] = ()) -> list[str]:
    """The elastic part of an agent's argv, after its rendezvous flags: ``--hspmd-elastic`` on
    ``model`` (a JSON file) and global batch ``batch``, more launcher ``flags``, then
    ``elastic_train.py`` on the same model and batch, writing its results to ``out``; ``train``:
    its further arguments."""
    return ["--hspmd-elastic", "--hspmd-model", str(model), "--hspmd-global-batch", str(batch),
            *flags, str(TRAIN_SCRIPT), "--config", str(model), "--steps", str(steps),
            "--global-batch", str(batch), "--seed", str(seed), "--data-seed", str(data_seed),
            "--out", str(out), *train]


class JobFacts:
    """A job's outcome as its tests read it, and the checks on it. The readers: ``results()``
    (device -> what ``elastic_train.py`` saved), ``events()`` (the journal), ``plans()``
    (version -> (Plan, device ids)), ``sample_log()`` and ``ack_records()`` (the switch acks
    seen). A live ``ElasticLaunchJob`` reads them from etcd and its files; a ``WorkerKillRun``
    holds what they returned at the end of its run."""

    def results(self) -> dict[str, dict]:
        raise NotImplementedError

    def events(self) -> list:
        raise NotImplementedError

    def plans(self) -> dict[int, tuple]:
        raise NotImplementedError

    def sample_log(self) -> list[dict]:
        raise NotImplementedError

    def ack_records(self) -> list:
        raise NotImplementedError

    def ack_states(self, version: int, node: str) -> list[str]:
        """The states ``node`` wrote for plan ``version``, in order."""
        return [r.state for r in self.ack_records() if (r.plan_version, r.node) == (version, node)]

    def assert_recovered(self, survivors: dict[str, int]) -> dict[str, dict]:
        """Every worker finished every step, no switch read a checkpoint, each survivor
        (device -> pid) is the process it was, and the parameters equal the reference; the
        results."""
        results = self.results()
        _elastic.assert_recovered_in_memory(results, survivors, REFERENCE)
        froms = [s["plan_from"] for r in results.values() for s in r["switches"]]
        assert "relay" in froms, f"no worker read a plan its agent relayed: {froms}"
        return results

    @staticmethod
    def assert_replicas_match_reference(results: dict[str, dict]) -> float:
        """Every element of every parameter is held (no NaN), every DP replica holds the same
        values, and they equal the fault-free reference; the largest difference from it."""
        import torch

        from hspmd_elastic.graph.config import param_specs

        full = _elastic.assemble(list(results.values()), REFERENCE)
        ref = _elastic.reference_params(REFERENCE)
        assert set(full) == set(ref) == set(param_specs(TINY))
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
        assert all(d <= 1e-9 for d in diffs.values()), \
            f"{worst}: {diffs[worst]:g} from the reference"
        return diffs[worst]


class ElasticLaunchJob(JobFacts):
    """Agents of one elastic job, its files and an etcd client to watch it."""

    def __init__(self, etcd, tmp: Path, marker: str, *, prefix: str = "el",
                 redundancy: Optional[int] = None, name: Optional[str] = None,
                 security=None, etcd_env: Optional[dict[str, str]] = None):
        """``etcd``: the ``etcd_server`` fixture; ``marker``: the ``marker`` fixture (the
        leftover check finds what the agents leave); ``prefix``: of the job's name;
        ``redundancy``: every agent's ``--hspmd-redundancy`` (None: not passed); ``name``: the
        job's name instead (one an etcd role grants); ``security``: the test's client settings
        (an ``EtcdSecurity``: TLS, user) for an etcd that asks for them; ``etcd_env``: the
        agents' ``HSPMD_ETCD_*`` settings, instead of this process's."""
        self.etcd, self.tmp = etcd, Path(tmp)
        self.name = name or f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.config = write_tiny(self.tmp / "model.json")
        self.out, self.release = self.tmp / "out", self.tmp / "release"
        self.samples = self.tmp / "samples"
        self.redundancy = redundancy
        self.env = base_env(marker)
        if etcd_env is not None:
            self.env = {k: v for k, v in self.env.items() if not k.startswith("HSPMD_ETCD_")}
            self.env.update(etcd_env)
        self.agents: dict[str, Launcher] = {}
        self.client = EtcdClient(etcd.endpoints, timeout=5.0, security=security)
        self.acks = Recorder()  # every switch-ack write seen by watch_acks()
        self._ack_watch: Optional[PrefixWatch] = None

    def __enter__(self) -> "ElasticLaunchJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ agents
    def start(self, node: str, nproc: int = 2, *flags: str, nnodes: Union[int, str] = 2,
              batch: int = BATCH, redundancy: Optional[int] = None, log_samples: bool = False,
              train: Sequence[str] = ()) -> Launcher:
        """Start ``node``'s agent with ``nproc`` workers. ``flags``: more launcher flags;
        ``nnodes``: ``--nnodes`` ("2:3" allows a third node); ``batch``: the global batch;
        ``redundancy``: this agent's ``--hspmd-redundancy`` (default: the job's);
        ``log_samples``: the workers log the sample ids of every step (``sample_log``);
        ``train``: more ``elastic_train.py`` arguments."""
        redundancy = self.redundancy if redundancy is None else redundancy
        if redundancy is not None:
            flags = ("--hspmd-redundancy", str(redundancy), *flags)
        script = ["--pause-at", str(PAUSE), "--release", str(self.release), "--timeout", "30"]
        if log_samples:
            script += ["--sample-log", str(self.samples)]
        args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.etcd.endpoint_str, "--rdzv-id", self.name,
                "--hspmd-node-id", node, "--hspmd-lease-ttl", "2", "--shutdown-timeout", "5",
                "--rdzv-conf", "join_timeout=60",
                *elastic_argv(self.config, batch, *flags, steps=STEPS, out=self.out,
                              train=(*script, *train))]
        self.agents[node] = Launcher(args, self.env, self.tmp, node)
        return self.agents[node]

    def check_agents(self) -> None:
        """AssertionError, with its stderr, if an agent has exited."""
        assert_agents_running(self.agents)

    def finish(self, timeout: float = 60.0, code: int = 0) -> None:
        """Wait for every agent to exit (``timeout`` each); each must exit with ``code``."""
        codes = {node: agent.wait(timeout) for node, agent in self.agents.items()}
        assert codes == {node: code for node in self.agents}, (codes, {
            node: agent.stderr()[-6000:] for node, agent in self.agents.items()
            if codes[node] != code})

    # ------------------------------------------------------------------ waits
    def wait_at_step(self, devices: list[str], step: int,
                     timeout: float = 60.0) -> dict[str, int]:
        """Wait until the records of ``devices`` report step ``step`` or later; their pids."""
        def reached():
            self.check_agents()
            recs = self.workers()
            if all(d in recs and recs[d].step >= step for d in devices):
                return {d: recs[d].pid for d in devices}
            return None

        return wait_for(reached, timeout, f"{devices} at step {step}")

    def wait_paused(self, devices: list[str], timeout: float = 60.0) -> dict[str, int]:
        """Wait until ``devices`` report step PAUSE (where they wait); their pids."""
        return self.wait_at_step(devices, PAUSE, timeout)

    # ------------------------------------------------------------------ the job in etcd
    def workers(self) -> dict[str, schema.WorkerRecord]:
        """The worker records: ``node:local_rank`` -> record."""
        prefix = schema.workers_prefix(self.name)
        out = {}
        for kv in self.client.get_prefix(prefix):
            node, lr = kv.key[len(prefix):].split("/")
            out[f"{node}:{lr}"] = schema.decode(kv.key, kv.value)
        return out

    def events(self):
        return read_events(self.client, self.name)

    def leader(self) -> str:
        """The node of the current leader."""
        kv = self.client.get(schema.leader_key(self.name))
        return schema.decode(kv.key, kv.value).node

    def plans(self) -> dict[int, tuple]:
        """Every published plan: version -> (Plan, device ids)."""
        out = {}
        for kv in self.client.get_prefix(schema.plan_history_prefix(self.name)):
            rec = schema.decode(kv.key, kv.value)
            out[rec.version] = (plan_of(rec), list(rec.devices))
        return out

    def watch_acks(self) -> None:
        """Record every switch ack the agents write. A watch, not a read: an agent's acks are
        leased, so they vanish when it exits at the job's end, before the test could read them."""
        self._ack_watch = PrefixWatch(self.client, schema.switch_prefix(self.name), self.acks,
                                      decode=True, name="switch acks").start()

    def ack_records(self) -> list:
        """Every switch ack written since ``watch_acks``, in order."""
        return [e.record for e in self.acks.items
                if e.type is EventType.PUT and e.record is not None]

    # ------------------------------------------------------------------ the workers' files
    def results(self) -> dict[str, dict]:
        """Every worker's result: device -> what ``elastic_train.py`` saved."""
        return worker_results(self.out)

    def sample_log(self) -> list[dict]:
        """Every worker's per-step lines (``log_samples``); a line cut short by a kill is
        dropped (a line is written whole before the worker can be paused, so none should be)."""
        rows = []
        for path in sorted(self.samples.glob("*.jsonl")):
            lines = path.read_text().split("\n")
            rows += [dict(json.loads(ln), device=path.stem.replace("_", ":"))
                     for ln in lines[:-1] if ln]
        return rows

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait(timeout=10)
        if self._ack_watch is not None:
            self._ack_watch.stop()
        self.client.close()


# ---------------------------------------------------------------------- the shared worker-kill run
KILL_NODES = {"node-a": 3, "node-b": 2}  # workers per node
KILL_VICTIM = "node-b:1"
# Per device; one replica needs about 235 KiB (weights, gradients, AdamW, activations), so every
# plan shards the model, and the 4 survivors (two pipelines) are specialized unlike the 5.
KILL_MEMORY = "200KiB"


@dataclasses.dataclass
class WorkerKillRun(JobFacts):
    """What the shared worker-kill run left for its tests to read (``shared_worker_kill_run``):
    the job as its readers returned it at the end, what was seen at the pause, and how the run
    itself ended. ``error`` (a traceback) is set when the run did not get to its end."""

    name: str
    password_file: str = ""
    pids: dict[str, int] = dataclasses.field(default_factory=dict)  # every worker, at the pause
    cmdlines: list[list[str]] = dataclasses.field(default_factory=list)  # the job's, at the pause
    worker_etcd_env: dict[str, str] = dataclasses.field(default_factory=dict)  # node-a:0's
    killed_at: float = 0.0  # wall clock of the SIGKILL
    codes: dict[str, int] = dataclasses.field(default_factory=dict)  # each agent's exit code
    stderr: dict[str, str] = dataclasses.field(default_factory=dict)  # each agent's
    journal: list = dataclasses.field(default_factory=list)
    plan_history: dict[int, tuple] = dataclasses.field(default_factory=dict)
    worker_results: dict[str, dict] = dataclasses.field(default_factory=dict)
    samples: list[dict] = dataclasses.field(default_factory=list)
    acks: list = dataclasses.field(default_factory=list)
    leftovers: Optional[str] = None  # the leftover check's failure
    error: Optional[str] = None

    # The readers of ``ElasticLaunchJob``, on what the run kept.
    def results(self) -> dict[str, dict]:
        return self.worker_results

    def events(self) -> list:
        return self.journal

    def plans(self) -> dict[int, tuple]:
        return self.plan_history

    def sample_log(self) -> list[dict]:
        return self.samples

    def ack_records(self) -> list:
        return self.acks

    def survivors(self) -> dict[str, int]:
        """Every worker but the victim: device -> its pid before the kill."""
        return {d: p for d, p in self.pids.items() if d != KILL_VICTIM}

    def checked(self) -> "WorkerKillRun":
        """This run, known to have reached its end: the test fails with the run's own error,
        with the stderr of an agent that did not exit 0, or with the processes left behind."""
        if self.error:
            pytest.fail(f"the shared worker-kill run failed:\n{self.error}", pytrace=False)
        assert self.codes == {node: 0 for node in KILL_NODES}, (self.codes, {
            node: err[-6000:] for node, err in self.stderr.items() if self.codes.get(node)})
        assert self.leftovers is None, self.leftovers
        return self


def worker_kill_run(base: Path) -> WorkerKillRun:
    """The one full run of "worker SIGKILL -> BSR switch into a new plan" that several test
    modules read (each its own angle), under ``base``: a real etcd serving TLS only, with
    client-certificate auth and RBAC (``tests/_security.py``); two agents (``KILL_NODES``) as
    the job user, the password in a file, devices declared at ``KILL_MEMORY`` (so plans shard),
    the workers logging their sample ids, the switch acks watched. Once every worker waits at
    step PAUSE and both nodes acked plan v1 done, ``KILL_VICTIM`` is SIGKILLed and the workers
    released; the run waits for the agents to exit and keeps what the tests read. It asserts
    nothing about the outcome: a wait that fails is its ``error``."""
    import psutil

    from _security import PASSWORDS, Pki, SecureEtcd
    from launch_harness import assert_no_leftovers, marked_processes, new_marker

    run = WorkerKillRun(name=f"kill-{uuid.uuid4().hex[:8]}")
    marker = new_marker()
    etcd = job = None
    try:
        pki = Pki(base / "pki")
        etcd = SecureEtcd(base, pki, run.name)  # the job user may write the job's prefix only
        password = base / "etcd-password"
        password.write_text(PASSWORDS["job"] + "\n")
        password.chmod(0o600)
        run.password_file = str(password)
        job = ElasticLaunchJob(etcd.cluster, base, marker, name=run.name,
                               security=pki.security("job"),
                               etcd_env=dict(etcd.env(None), HSPMD_ETCD_USER="job",
                                             HSPMD_ETCD_PASSWORD_FILE=str(password)))
        job.watch_acks()
        for node, nproc in KILL_NODES.items():
            job.start(node, nproc, "--hspmd-device-memory", KILL_MEMORY, log_samples=True)
        run.pids = job.wait_paused([f"{n}:{lr}" for n, k in KILL_NODES.items()
                                    for lr in range(k)], timeout=90)  # 5 workers start
        for proc in marked_processes(marker):
            try:
                run.cmdlines.append(proc.cmdline())
            except psutil.Error:
                continue
        env = psutil.Process(run.pids["node-a:0"]).environ()
        run.worker_etcd_env = {k: v for k, v in env.items() if k.startswith("HSPMD_ETCD_")}
        # Paused workers train plan v1: each agent acks it done (before the kill, which would
        # otherwise race the ack and make the victim's node's v1 ack failed).
        wait_for(lambda: job.check_agents() or all(
            job.ack_states(1, n)[-1:] == ["done"] for n in KILL_NODES), 30,
            "every node's v1 ack done")
        run.killed_at = time.time()
        os.kill(run.pids[KILL_VICTIM], signal.SIGKILL)
        job.release.touch()
        run.codes = {node: agent.wait(60) for node, agent in job.agents.items()}
        run.journal, run.plan_history = job.events(), job.plans()
        run.worker_results, run.samples = job.results(), job.sample_log()
        run.acks = job.ack_records()
    except Exception:  # noqa: BLE001 - reported by every test that reads the run
        run.error = traceback.format_exc()
    finally:
        if job is not None:
            run.stderr = {node: agent.stderr() for node, agent in job.agents.items()}
            job.close()
        if etcd is not None:
            etcd.stop()
        try:
            assert_no_leftovers(marker)
        except AssertionError as exc:
            run.leftovers = str(exc)
    return run


def shared_worker_kill_run(tmp_path_factory) -> WorkerKillRun:
    """``worker_kill_run`` once per pytest session (``_hf_worlds.once_per_session``): the test
    modules that read it call this from a module-scoped fixture."""
    from _hf_worlds import once_per_session

    return once_per_session(tmp_path_factory, "worker-kill", worker_kill_run)


def one_node_kill_run(tmp_path: Path, marker: str, etcd_server, model: Path, *, nproc: int,
                      batch: int, steps: int, pause: int, victim: int, node: str,
                      flags: Sequence[str] = (), train: Sequence[str] = (), prefix: str = "kj"):
    """A one-node elastic job of ``nproc`` workers of ``elastic_train.py`` on ``model``: once
    every worker reached step ``pause`` (it waits there for ``tmp_path/release``), local rank
    ``victim`` is SIGKILLed and the others released; the agent must exit 0. Returns the job's
    journal, the results by device (``node:local_rank``) and the workers' pids by local rank."""
    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    out, release = tmp_path / "out", tmp_path / "release"
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", node, "--shutdown-timeout", "5",
                      *elastic_argv(model, batch, *flags, steps=steps, out=out,
                                    train=(*train, "--pause-at", str(pause), "--release",
                                           str(release), "--timeout", "30"))],
                     base_env(marker), tmp_path, node)
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    try:
        def workers() -> dict:
            return job_workers(client, job)

        wait_for(lambda: len(workers()) == nproc and all(w.step >= pause
                                                         for w in workers().values()),
                 60, f"{nproc} workers at step {pause}", proc=agent.proc)
        pids = {lr: w.pid for lr, w in workers().items()}
        os.kill(pids[victim], signal.SIGKILL)
        release.touch()
        assert agent.wait(120) == 0, agent.stderr()[-4000:]
        events = read_events(client, job)
        plans = {}
        for kv in client.get_prefix(schema.plan_history_prefix(job)):
            record = schema.decode(kv.key, kv.value)
            plans[record.version] = record
        return events, worker_results(out), pids, plans
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        client.close()


def assert_switched_once_in_memory(events: list) -> None:
    """The journal (``events``) of a ``one_node_kill_run``: a failure, two replans (the start
    and the one after the kill), and one switch, into plan 2, from the survivors' memory."""
    types = [e.type for e in events]
    assert "failure" in types and types.count("replan") == 2, types
    done = [schema.event_detail(e) for e in events if e.type == "switch-done"]
    assert [(d.plan_version, d.source) for d in done] == [(2, "bsr")], done


def job_workers(client: EtcdClient, job: str) -> dict:
    """The job's worker records in etcd, by local rank."""
    return {rec.local_rank: rec for kv in client.get_prefix(schema.workers_prefix(job))
            for rec in [schema.decode(kv.key, kv.value)]}


def measuring_pids(client: EtcdClient, job: str, agent, timeout: float) -> dict[int, int]:
    """Wait (``timeout``; fails at once if ``agent`` exits) until both workers of a
    ``straggler_agent`` job measure their busy time; their pids, by local rank."""
    def measuring():
        workers = job_workers(client, job)
        return len(workers) == 2 and all(w.busy_s > 0 for w in workers.values()) and workers

    workers = wait_for(measuring, timeout, "both workers measuring their busy time",
                       proc=agent.proc)
    return {lr: w.pid for lr, w in workers.items()}


def straggler_agent(tmp_path: Path, marker: str, etcd_server, config, job: str, node: str, *,
                    batch: int, steps: int, adam_eps: float, flags: Sequence[str] = ()) -> tuple:
    """A one-node agent of two ``elastic_train.py`` workers on ``config`` for the speed-replan
    tests: replans driven by measured speeds at most every second, AdamW's ``adam_eps``, more
    launcher ``flags``. Returns the agent and the folder its workers write their results to."""
    model, out = tmp_path / "model.json", tmp_path / "out"
    model.write_text(config.to_json())
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", node, "--shutdown-timeout", "5",
                      *elastic_argv(model, batch, "--hspmd-straggler-dwell", "1", *flags,
                                    steps=steps, out=out,
                                    train=("--timeout", "60", "--adam-eps", f"{adam_eps:g}"))],
                     base_env(marker), tmp_path, node)
    return agent, out


@contextlib.contextmanager
def throttled_job(tmp_path: Path, marker: str, etcd_server, config, job: str, node: str, *,
                  batch: int, steps: int, adam_eps: float,
                  flags: Sequence[str] = ()) -> Iterator[tuple]:
    """``straggler_agent`` with what the speed tests throttle and watch it by: yields the agent,
    its results folder, an etcd client and the job's ``CpuQuota`` (``launcher.cgroups``). On the
    way out the quota is closed, the agent killed if it still runs and the client closed."""
    agent, out = straggler_agent(tmp_path, marker, etcd_server, config, job, node, batch=batch,
                                 steps=steps, adam_eps=adam_eps, flags=flags)
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    quota = CpuQuota(job)
    try:
        yield agent, out, client, quota
    finally:
        quota.close()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        client.close()


def worker_results(out: Path) -> dict[str, dict]:
    """What each ``elastic_train.py`` worker saved in ``out``, by device (``node:local_rank``)."""
    import torch

    return {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
            for p in sorted(out.glob("*.pt"))}


def write_corpus(prefix: Path, longest: int, count: int = 120, seed: int = 11) -> str:
    """A Megatron-LM indexed dataset at ``prefix`` of ``count`` random documents of 2 to
    ``longest`` tokens (ids below ``TINY``'s vocabulary); returns the prefix."""
    import torch

    from hspmd_elastic.documents import write_indexed

    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, TINY.vocab_size,
                          (int(torch.randint(2, longest + 1, (1,), generator=gen)),),
                          generator=gen).numpy() for _ in range(count)]
    write_indexed(str(prefix), docs)
    return str(prefix)


def documents_job_files(tmp_path: Path, longest: int, *, steps: int, batch: int,
                        **reference) -> tuple[Path, str, dict]:
    """The files of a job training ``TINY`` on documents: its model config, a corpus of
    documents of 2 to ``longest`` tokens (``write_corpus``) and the fault-free reference payload
    on that corpus (``steps`` steps of ``batch`` rows; ``reference``: more of
    ``_elastic.reference_payload``'s arguments)."""
    model, docs = write_tiny(tmp_path / "model.json"), write_corpus(tmp_path / "docs", longest)
    payload = _elastic.reference_payload(TINY, steps=steps, global_batch=batch, seed=SEED,
                                         data_seed=DATA_SEED, documents=docs, **reference)
    return model, docs, payload
