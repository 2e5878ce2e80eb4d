"""Recovery after a fault, end to end with the real product: in-memory switch vs restart + reload.

    .venv/bin/python scripts/bench_recovery [--repeats 3] [--kill-at 4] [--state-moves]
                                            [--no-write]

One embedded etcd (``launcher.standalone.EtcdCluster``); every run is a fresh job of two
``hspmd-launch`` agents (``node0``, ``node1``, two workers each, gloo on loopback,
OMP_NUM_THREADS=1) training the same float32 Llama on the same synthetic global batches (AdamW):
by default a small one that fits every device (the planner picks data parallelism, a switch
moves no state); with ``--state-moves`` one whose state does not fit a device as the elastic
agents declare it (``--hspmd-device-memory``), so plans shard it (TP/PP), a worker's loss
changes the layout and the switch moves tens of MB by fused BSR, against restart + a checkpoint
reload of the same state (``scripts/bench/recovery_setup.py``). The fault is a SIGKILL sent by this
process when the victim's own timeline says it completed ``--kill-at`` steps (no sleeps).
Workers write timelines (``scripts/bench/timeline.py``); the agents' journal in etcd
(``events/``) gives the control plane's timestamps. All clocks are this machine's wall clock.

(A) elastic: ``hspmd-launch --hspmd-elastic --hspmd-model <config.json> --hspmd-global-batch B``
    (default debounce) running ``scripts/bench/elastic_train.py`` (``hspmd_elastic.runtime``).
    SIGKILL worker ``<non-leader>:1``. Fault -> ``failure`` event (detection: the agent saw the
    exit) -> plan published (the plan record's creation + the leader's publish time) ->
    ``switch-done`` event (one per switch, from the new plan's rank 0) -> every survivor
    switched (their timelines) -> every survivor completed a step under the new plan (training
    resumed); the survivors' pids must not change. Breakdown: the leader's timings (debounce,
    plan, publish) and the survivors' switch timings (slowest rank: plan seen, regroup,
    resume-step agreement, fused BSR, rebuild).
(B) restart (torchrun-style): the same agents without ``--hspmd-elastic``, ``--max-restarts 1``,
    running ``scripts/bench/restart_train.py`` (DDP over a dense copy of the same model,
    ``torch.save`` of parameters + optimizer after every step, reload on start). SIGKILL worker
    ``node1:1``. Fault -> ``failure`` event -> every worker restarted (process created) ->
    imports -> process group -> model + optimizer built -> checkpoint loaded -> every rank
    completed a step (resumed). ``--node-rank`` keeps node0 the store host in every round.
(D) with ``--state-moves``, the sharded restart a practitioner would tune: one agent of 2
    workers on the 2 cores (one core per restarting worker), each declared with the same device
    memory as (A), so the planner's plan for them shards the model too
    (``scripts/bench/sharded_restart_train.py``); every rank saves its own shard after every
    step and reads only its own shard on restart. SIGKILL worker ``node0:1``; the same phases
    as (B). The report sets (A) against the faster of (B) and (D): ours / the best baseline.
(C) node loss, elastic: SIGKILL the non-leader agent (its workers die with it); detection =
    the moment the leader first saw the change (plan creation - plan time - debounce) - fault,
    against the lease TTL (``--hspmd-lease-ttl``) + 1 s.

Modes alternate within one invocation; the report (``scripts/bench/recovery_report.py``) gives
medians over ``--repeats`` and, with ``--state-moves``, the fused BSR's share of the recovery
against the checkpoint reload's; unless ``--no-write`` it replaces the ``## Recovery`` section
(``## Recovery when state moves`` with ``--state-moves``) of docs/benchmarks.md (re-read just before
writing; other sections are left as they are). Every wait has a deadline; agents run in their own
process groups and every process a run started is killed in ``finally``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import timeline
from bench.common import ROOT, SCRIPTS, write_section
from bench.recovery_report import report
from bench.recovery_setup import (AFTER_KILL_STEPS, DATA_SEED, DP, LEASE_TTL_S,
                                   MOVING, NODES, NPROC, SEED, WORKER_TIMEOUT_S,
                                   Setup)


class BenchError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------ one job
class Job:
    """Two agents of one job, their logs and the workers' timelines."""

    def __init__(self, etcd, tmp: str, name: str, mode: str, kill_at: int, setup: Setup,
                 nodes: tuple[str, ...] = NODES):
        from hspmd_elastic.coord import EtcdClient

        self.etcd, self.tmp, self.name, self.mode = etcd, tmp, name, mode
        self.nodes = nodes
        self.setup = setup
        self.kill_at, self.steps = kill_at, kill_at + AFTER_KILL_STEPS
        self.config = os.path.join(tmp, "model.json")
        from hspmd_elastic.files import atomic_write
        from hspmd_elastic.graph.config import ModelConfig

        atomic_write(self.config, ModelConfig(**setup.model).to_json())
        self.tl_dir = os.path.join(tmp, "timeline")
        os.makedirs(self.tl_dir)
        self.agents: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.client = EtcdClient(etcd.endpoint_str, timeout=5.0)
        self.deadline = time.monotonic() + setup.run_timeout_s

    def command(self, node: str) -> list[str]:
        common = ["--nnodes", str(len(self.nodes)), "--nproc-per-node", str(NPROC),
                  "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoint_str,
                  "--rdzv-id", self.name, "--rdzv-conf", "join_timeout=60",
                  "--hspmd-node-id", node, "--hspmd-lease-ttl", f"{LEASE_TTL_S:g}",
                  "--shutdown-timeout", "5"]
        data = ["--config", self.config, "--steps", str(self.steps),
                "--global-batch", str(self.setup.global_batch), "--seed", str(SEED),
                "--data-seed", str(DATA_SEED), "--timeline", self.tl_dir]
        if self.mode == "sharded":  # one agent, one core per worker, shards as (A) does
            return common + ["--max-restarts", "1", "--node-rank", "0",
                             os.path.join(SCRIPTS, "bench", "sharded_restart_train.py"), *data,
                             "--device-memory", self.setup.device_memory,
                             "--checkpoint", os.path.join(self.tmp, "shard")]
        if self.mode == "restart":
            # A fixed node order keeps node0 (group rank 0) the host of the workers' store in
            # every round, as with torchrun's static ranks.
            return common + ["--max-restarts", "1", "--node-rank", str(NODES.index(node)),
                             os.path.join(SCRIPTS, "bench", "restart_train.py"), *data,
                             "--checkpoint", os.path.join(self.tmp, "ckpt.pt")]
        memory = self.setup.device_memory
        return common + ["--hspmd-elastic", "--hspmd-model", self.config,
                         "--hspmd-global-batch", str(self.setup.global_batch),
                         *(["--hspmd-device-memory", memory] if memory else []),
                         os.path.join(SCRIPTS, "bench", "elastic_train.py"), *data,
                         "--timeout", f"{WORKER_TIMEOUT_S:g}"]

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        for node in self.nodes:
            log = open(os.path.join(self.tmp, f"{node}.log"), "w")  # noqa: SIM115
            self.logs[node] = log
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", *self.command(node)], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def wait_for(self, pred, what: str, poll: float = 0.005):
        while True:
            value = pred()
            if value:
                return value
            for node, a in self.agents.items():
                if a.poll() is not None:
                    raise BenchError(f"agent {node} exited with {a.returncode} while waiting "
                                     f"for {what}\n{self.log_tail(node)}")
            if not self.left():
                raise BenchError(f"timed out waiting for {what}")
            time.sleep(poll)

    def timeline(self, device: str) -> list[dict]:
        return timeline.read(os.path.join(self.tl_dir, device.replace(":", "_") + ".jsonl"))

    def devices(self) -> list[str]:
        return [f"{n}:{i}" for n in self.nodes for i in range(NPROC)]

    def steps_done(self, device: str, restart: int = 0) -> tuple[int, int]:
        """(steps completed by the device's current process, its pid)."""
        recs = [r for r in self.timeline(device) if r.get("restart", 0) == restart]
        steps = [r["step"] for r in recs if r["ev"] == "step"]
        pid = recs[-1]["pid"] if recs else 0
        return (max(steps) + 1 if steps else 0), pid

    def step_time(self, before: float) -> float:
        """Median time between consecutive completed steps of one process, before ``before``
        (steps 1..; step 0 includes the start)."""
        gaps = []
        for d in self.devices():
            recs = [r for r in self.timeline(d) if r["ev"] == "step" and r["t"] < before]
            gaps += [b["t"] - a["t"] for a, b in zip(recs, recs[1:]) if b["pid"] == a["pid"]]
        return statistics.median(gaps) if gaps else float("nan")

    def leader(self) -> str:
        from hspmd_elastic.contract import schema

        kv = self.client.get(schema.leader_key(self.name))
        return schema.decode(kv.key, kv.value).node if kv is not None else ""

    def wait_exit(self) -> dict[str, int]:
        codes = {}
        for node, a in self.agents.items():
            try:
                codes[node] = a.wait(timeout=max(0.1, self.left()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"agent {node} still running after "
                                 f"{self.setup.run_timeout_s:g}s\n{self.log_tail(node)}") from None
        return codes

    def log_tail(self, node: str, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.tmp, f"{node}.log"), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "(no log)"

    def events(self):
        from hspmd_elastic.coord import read_events

        return read_events(self.client, self.name)

    def plan(self, version: int):
        from hspmd_elastic.contract import schema

        kv = self.client.get(schema.plan_history_key(self.name, version))
        return schema.decode(kv.key, kv.value) if kv is not None else None

    def close(self) -> None:
        """Kill whatever this job started (agents' process groups; workers by their pids)."""
        import psutil

        for a in self.agents.values():
            if a.poll() is None:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    a.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for d in self.devices():
            for pid in {r["pid"] for r in self.timeline(d)}:
                try:
                    p = psutil.Process(pid)
                    if any(self.tl_dir in part for part in p.cmdline()):
                        p.kill()
                        p.wait(timeout=5)
                except (psutil.Error, OSError):
                    pass
        for log in self.logs.values():
            log.close()
        self.client.close()


def first(recs, pred):
    return next((r for r in recs if pred(r)), None)


def describe_plan(record) -> str:
    """A plan record's specialization on one line (``planner.layout_line``), in backquotes."""
    from hspmd_elastic.coord.contract import plan_of
    from hspmd_elastic.planner import layout_line

    return f"`{layout_line(plan_of(record), record.devices)}`"


# ------------------------------------------------------------------------------ modes
def elastic_once(etcd, tmp: str, name: str, kill_at: int, node_loss: bool,
                 setup: Setup) -> dict:
    from hspmd_elastic.contract import schema
    from hspmd_elastic.coord import read_plan

    job = Job(etcd, tmp, name, "elastic", kill_at, setup)
    try:
        job.start()
        leader = job.wait_for(job.leader, "a leader")
        other = next(n for n in NODES if n != leader)
        victim = f"{other}:{NPROC - 1}"
        job.wait_for(lambda: all(job.steps_done(d)[0] >= 1 for d in job.devices())
                     and job.steps_done(victim)[0] >= kill_at, f"{victim} to reach step {kill_at}")
        before, _ = read_plan(job.client, name)
        pids = {d: job.steps_done(d)[1] for d in job.devices()}
        if node_loss:
            killed = time.time()
            os.kill(job.agents[other].pid, signal.SIGKILL)
            lost = [d for d in job.devices() if d.startswith(other + ":")]
        else:
            killed = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            lost = [victim]
        codes = job.wait_exit()
        survivors = [d for d in job.devices() if d not in lost]
        if any(codes[n] != 0 for n in NODES if not (node_loss and n == other)):
            raise BenchError(f"agents exited {codes}\n{job.log_tail(leader)}")
        events = job.events()
        replan = first(events, lambda e: e.type == "replan" and e.at >= killed
                       and schema.event_detail(e).version > before.version)
        if replan is None:
            raise BenchError(f"no replan after the fault: {[e.type for e in events]}")
        version = schema.event_detail(replan).version
        record = job.plan(version)
        lt = replan.timings
        published = record.created_at + lt.get("publish_s", 0.0)
        seen_at = record.created_at - lt.get("plan_s", 0.0) - lt.get("debounce_s", 0.0)
        done = [e for e in events if e.type == "switch-done"
                and schema.event_detail(e).plan_version == version]
        if not done:  # one per switch, written by the new plan's rank 0
            raise BenchError(f"no switch-done event for plan v{version}")
        resumed, switches, switched = [], [], []
        for d in survivors:
            recs = job.timeline(d)
            if {r["pid"] for r in recs} != {pids[d]}:
                raise BenchError(f"survivor {d} was restarted: pids "
                                 f"{sorted({r['pid'] for r in recs})}")
            if d not in record.devices:
                continue  # the new plan leaves it idle: it steps no more
            # the first plan at or after the fault's (a later replan, e.g. one driven by measured
            # speeds on a loaded machine, may follow before this survivor stepped)
            step = first(recs, lambda r: r["ev"] == "step" and r["v"] >= version)
            sw = first(recs, lambda r: r["ev"] == "switch"
                       and r["timings"].get("to_version", 0) >= version)
            if step is None or sw is None:
                raise BenchError(f"{d}: no switch/step under plan v{version}")
            resumed.append(step["t"])
            switches.append(sw["timings"])
            switched.append(sw["t"])
        out = {
            "total": max(resumed) - killed,
            "published": published - killed,
            "switch_event": done[0].at - killed,
            "switched": max(switched) - killed,
            "leader_saw": seen_at - killed,
            "debounce": lt.get("debounce_s", 0.0), "plan": lt.get("plan_s", 0.0),
            "publish": lt.get("publish_s", 0.0),
            "resume_step": switches[0].get("resume_step"),
            "lost_steps": 0,
            "plan_before": describe_plan(before), "plan_after": describe_plan(record),
            "sources": sorted({s.get("source") for s in switches}),
            "step_time": job.step_time(killed),
        }
        for key in ("detect_s", "stall_s", "regroup_s", "exchange_s", "bsr_s", "rebuild_s",
                    "total_s", "bsr_bytes_total"):
            out[key] = max(float(s.get(key, 0.0)) for s in switches)
        out["lost_steps"] = max(0, kill_at - int(out["resume_step"] or 0)) if not node_loss \
            else None
        if node_loss:
            leave = first(events, lambda e: e.type in ("leave", "failure") and e.at >= killed)
            out["detect"] = out["leader_saw"]
            out["leave_event"] = (leave.at - killed) if leave else None
        else:
            failure = first(events, lambda e: e.type == "failure" and e.at >= killed)
            if failure is None:
                raise BenchError("no failure event after the worker kill")
            out["detect"] = failure.at - killed
        out["victim"] = f"agent {other}" if node_loss else victim
        return out
    finally:
        job.close()


def restart_once(etcd, tmp: str, name: str, kill_at: int, setup: Setup,
                 mode: str = "restart") -> dict:
    """(B) restart of 2 x 2 workers with rank 0's whole checkpoint, or (D, ``mode="sharded"``)
    one agent of 2 workers, each reloading its own shard."""
    nodes = NODES[:1] if mode == "sharded" else NODES
    job = Job(etcd, tmp, name, mode, kill_at, setup, nodes)
    try:
        job.start()
        victim = f"{nodes[-1]}:{NPROC - 1}"
        job.wait_for(lambda: all(job.steps_done(d)[0] >= 1 for d in job.devices())
                     and job.steps_done(victim)[0] >= kill_at, f"{victim} to reach step {kill_at}")
        pid = job.steps_done(victim)[1]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        codes = job.wait_exit()
        if any(codes.values()):
            raise BenchError(f"agents exited {codes}\n{job.log_tail(nodes[0])}")
        events = job.events()
        failure = first(events, lambda e: e.type == "failure" and e.at >= killed)
        if failure is None:
            raise BenchError(f"no failure event: {[e.type for e in events]}")
        marks: dict[str, list[float]] = {k: [] for k in
                                         ("spawned", "start", "imported", "pg", "built",
                                          "loaded", "step")}
        loaded_step, load_s = None, 0.0
        for d in job.devices():
            recs = [r for r in job.timeline(d) if r.get("restart") == 1]
            for k in marks:
                r = first(recs, lambda r, k=k: r["ev"] == k)
                if r is None:
                    raise BenchError(f"{d}: no '{k}' after the restart\n{job.log_tail(nodes[0])}")
                marks[k].append(r["t"])
                if k == "loaded":
                    loaded_step, ckpt_bytes = r["step"], r["bytes"]
                    load_s = max(load_s, r["t"] - marks["built"][-1])  # this rank's read
        at = {k: max(v) - killed for k, v in marks.items()}
        return {"total": at["step"], "detect": failure.at - killed, "spawned": at["spawned"],
                "started": at["start"], "imported": at["imported"], "pg": at["pg"],
                "built": at["built"], "loaded": at["loaded"], "lost_steps": kill_at - loaded_step,
                "ckpt_bytes": ckpt_bytes, "load_s": load_s, "step_time": job.step_time(killed),
                "victim": victim}
    finally:
        job.close()


def main(argv=None) -> int:
    from launcher.api import ElasticSettings
    from launcher.standalone import EtcdCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (default 3)")
    ap.add_argument("--kill-at", type=int, default=4,
                    help="SIGKILL once the victim completed this many steps (>= 2)")
    ap.add_argument("--no-node-loss", action="store_true", help="skip mode (C)")
    ap.add_argument("--state-moves", action="store_true",
                    help="the model whose state does not fit a device as declared: TP/PP plans, "
                         "a switch that moves tens of MB (its own section of the doc)")
    ap.add_argument("--no-write", action="store_true",
                    help="print the section instead of writing docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.kill_at < 2:
        ap.error(f"--repeats={args.repeats} must be >= 1 and --kill-at={args.kill_at} >= 2")
    def _terminate(signum, _frame):  # run every ``finally``: no agent or worker outlives us
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    debounce = ElasticSettings(None, 1).debounce_s
    setup = MOVING if args.state_moves else DP
    el, rs, nl, sh = [], [], [], []
    modes = (("elastic", "restart") + (("sharded",) if setup.device_memory else ())
             + (() if args.no_node_loss else ("node-loss",)))
    say(f"load average {load:.2f}; {args.repeats} x {modes}")
    with tempfile.TemporaryDirectory(prefix="hspmd-bench-recovery-") as tmp:
        etcd = EtcdCluster(size=1, base_dir=os.path.join(tmp, "etcd"))
        etcd.start()
        try:
            for i in range(args.repeats):
                for mode in modes:
                    d = os.path.join(tmp, f"{mode}-{i}")
                    os.makedirs(d)
                    name = f"bench-{mode}-{i}-{os.getpid()}"
                    if mode == "elastic":
                        r = elastic_once(etcd, d, name, args.kill_at, False, setup)
                        el.append(r)
                    elif mode in ("restart", "sharded"):
                        r = restart_once(etcd, d, name, args.kill_at, setup, mode)
                        (rs if mode == "restart" else sh).append(r)
                    else:
                        r = elastic_once(etcd, d, name, args.kill_at, True, setup)
                        nl.append(r)
                    say(f"[{i}] {mode}: " + ", ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in r.items()))
        finally:
            etcd.stop()
    elapsed = time.monotonic() - t0
    body = report(el, rs, nl, args, load, elapsed, debounce, setup, sh)
    print(body, flush=True)
    if not args.no_write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), setup.section, body)
        say(f"wrote the {setup.section[3:]} section of docs/benchmarks.md")
    return 0
