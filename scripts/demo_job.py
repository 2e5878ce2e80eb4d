#!/usr/bin/env python3
"""The main job, run by ``scripts/demo``: a CPU training job survives an injected fault.

Elastic mode (the default, ``--mode elastic``):

1. starts an embedded etcd (one member, loopback, free ports);
2. runs two ``hspmd-launch --hspmd-elastic`` agents against it as two nodes of this host, three
   gloo workers each, training the project's decoder with ``hspmd_elastic.runtime`` (float64).
   The agents declare their devices small (``--hspmd-device-memory 1.1MiB``, where one replica
   of the model needs about 1.7 MiB) and ask for every parameter slice on both nodes
   (``--hspmd-redundancy 2``), so plan v1 shards the model: one pipeline per node (PP, DP 2);
3. prints the job's journal (``events/``) live from an etcd watch: plans with their layouts,
   failures, switches with the bytes BSR moved;
4. SIGKILLs one worker mid-run (a real signal to a real process);
5. the leader replans: five devices cannot repeat v1's layout, so plan v2 is specialized
   differently (other TP degrees, layer splits and rows per pipeline); the survivors reshard
   weights and AdamW state into it by fused BSR, in memory (no restart, no checkpoint), and the
   job finishes every step;
6. trains the same global batches fault-free in this process (the dense reference) and compares
   every parameter (an element no rank holds counts as missing, never as equal).

``--device-memory none`` declares nothing (the CPU type's 8 GiB): the planner then picks pure
data parallelism and the switch moves no bytes, the way a tiny model on big devices should run.

Restart mode (``--mode restart``): one agent, three workers of ``examples/ddp_train.py`` (an
unmodified torchrun-style DDP script with snapshots), ``--max-restarts 1``; the fault makes the
agent restart every worker, which resume from their snapshot.

The last line is ``RESULT {json}`` with what was measured (nothing in it is asserted here).

Its files (the embedded etcd's data directory, whose write-ahead log alone preallocates about
60 MB, the model, the workers' results, the agents' ``--log-dir``) live in one
``hspmd-demo-*`` temporary directory that is removed when the demo ends, however it ends
(``launcher.node.reaper``: a guard removes it even when the demo is SIGKILLed, and the next
run sweeps what a dead guard left). ``--keep-work`` keeps it, logs included, and says where.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import ddp_train  # noqa: E402

from hspmd_elastic.coord import EtcdClient  # noqa: E402
from hspmd_elastic.contract import schema  # noqa: E402
from hspmd_elastic.files import atomic_write  # noqa: E402
from launcher.node import reaper  # noqa: E402
from launcher.standalone import EtcdCluster  # noqa: E402

JOB = "demo"
WORK_PREFIX = "hspmd-demo-"


@contextlib.contextmanager
def work_dir(keep: bool):
    """The demo's temporary directory: removed at the end unless ``keep`` (module doc)."""
    reaper.sweep_stale_dirs(WORK_PREFIX)
    path = Path(reaper.owned_tmpdir(WORK_PREFIX))
    try:
        yield path
    finally:
        if keep:
            reaper.release_dir(str(path))
            say(f"kept the demo's files in {path}")
        else:
            reaper.remove_owned(str(path))


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def agent_env(work: Path) -> dict:
    """The agents' environment: their temporary files (progress files, compile caches) go
    under ``work`` too, so that nothing outlives the demo."""
    (work / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=str(work / "tmp"))


def relay(stream, seen: dict) -> None:
    """Echo the launcher's output, counting the workers' snapshot loads."""
    for line in stream:
        if "resumed from snapshot" in line:
            seen["snapshot_loads"] += 1
        print("    | " + line.rstrip(), flush=True)


def read_progress(d: Path) -> dict[int, dict]:
    out = {}
    for f in d.glob("rank*"):
        try:
            out[int(f.name[4:])] = json.loads(f.read_text())
        except (ValueError, OSError):
            pass  # mid-write: next poll
    return out


def show_etcd_state(client: EtcdClient) -> None:
    result = client.get_prefix(schema.job_prefix(JOB))
    say(f"etcd state under {schema.job_prefix(JOB)} ({len(result.kvs)} keys):")
    for kv in result.kvs:
        value = kv.value.decode(errors="replace")
        print(f"    {kv.key.decode() if isinstance(kv.key, bytes) else kv.key}  {value[:110]}")


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    """The same global batches, fault-free, one process: what the job must end with."""
    model = ddp_train.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        ddp_train.train_step(model, opt, step, rank=0, world=1)
    return model.state_dict()


def wait_for(pred, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def run_restart(args, work: Path) -> int:
    progress = work / "progress"
    progress.mkdir()
    say("starting embedded etcd")
    with EtcdCluster(size=1, base_dir=str(work / "etcd")) as etcd:
        say(f"etcd healthy at {etcd.endpoint_str}")
        cmd = [
            sys.executable, "-m", "launcher.cli",
            "--nnodes", "1", "--nproc-per-node", str(args.nproc),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", JOB,
            "--rdzv-conf", "last_call_timeout=0.5",
            "--max-restarts", "1", "--hspmd-node-id", "node0", "--hspmd-lease-ttl", "2",
            "--log-dir", str(work / "logs"),
            str(ROOT / "examples" / "ddp_train.py"),
            "--steps", str(args.steps), "--snapshot", str(work / "snap.pt"),
            "--out", str(work / "final.pt"), "--progress-dir", str(progress),
            "--step-seconds", "0.05",
        ]
        say("launching: hspmd-launch " + " ".join(cmd[3:]))
        env = agent_env(work)
        launcher = subprocess.Popen(cmd, cwd=str(ROOT), env=env, start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = {"snapshot_loads": 0}
        echo = threading.Thread(target=relay, args=(launcher.stdout, seen), daemon=True)
        echo.start()
        client = EtcdClient(etcd.endpoint_str, timeout=2.0)
        try:
            victim = wait_for(
                lambda: next((p for r, p in read_progress(progress).items()
                              if r == 1 and p["step"] >= args.kill_at), None),
                args.timeout, f"rank 1 to reach step {args.kill_at}")
            show_etcd_state(client)
            say(f"FAULT: SIGKILL worker rank 1 (pid {victim['pid']}) after step {victim['step']}")
            killed_at = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)

            before = victim.get("restart", 0)

            def resumed():  # every rank has finished a step in the restarted generation
                p = read_progress(progress)
                return len(p) == args.nproc and all(v.get("restart", 0) > before for v in p.values())
            wait_for(resumed, args.timeout, "the workers to resume after the fault")
            recovered_at = time.monotonic()
            say(f"RECOVERED: training resumed {recovered_at - killed_at:.2f}s after the fault")
            show_etcd_state(client)
            rc = launcher.wait(timeout=args.timeout)
            echo.join(timeout=10)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGTERM)
                launcher.wait(timeout=30)
            client.close()
    say(f"launcher exited with code {rc}")

    final = torch.load(work / "final.pt", weights_only=True) if (work / "final.pt").exists() else None
    ref = reference_params(args.steps)
    diff = None
    if final is not None:
        diff = max(float((final["model"][k] - ref[k]).abs().max()) for k in ref)
        say(f"max |param - fault-free reference| = {diff:.3e} over {len(ref)} tensors")
    result = {
        "faults": 1,
        "recovered": int(rc == 0 and final is not None),
        "exit_code": rc,
        "restarts": max((p.get("restart", 0) for p in read_progress(progress).values()), default=0),
        "checkpoint_loads": seen["snapshot_loads"],
        "samples_lost": 0 if final is not None and final["steps"] == args.steps else None,
        "max_param_diff": diff,
        "recovery_seconds": round(recovered_at - killed_at, 3),
        "mode": "restart",
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["recovered"] else 1


# ------------------------------------------------------------------------------ elastic mode
ELASTIC_CONFIG = dict(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, ffn_size=64,
                      seq_len=16, dtype="float64")
ELASTIC_BATCH, ELASTIC_SEED, ELASTIC_DATA_SEED = 8, 3, 7
NODES = ("node0", "node1")
DEVICE_MEMORY = "1.1MiB"  # per device, as declared; one replica needs about 1.7 MiB
REDUNDANCY = 2


def plan_layout(client: EtcdClient, version: int) -> str:
    """Plan ``version``'s specialization on one line (from ``plan/history``), or ""."""
    from hspmd_elastic.coord.contract import plan_of
    from hspmd_elastic.planner import layout_line

    kv = client.get(schema.plan_history_key(JOB, version))
    if kv is None:
        return ""
    rec = schema.decode(kv.key, kv.value)
    return layout_line(plan_of(rec), rec.devices)


def show_event(ev, client: EtcdClient) -> None:
    """One journal entry, as it arrives from the etcd watch."""
    from hspmd_elastic.planner import fmt_bytes

    d, t = schema.event_detail(ev), ev.timings
    if isinstance(d, schema.ReplanDetail):
        text = (f"plan v{d.version} over {d.device_count} device(s) ({d.reason}); "
                f"detect->publish {t.get('detect_to_publish_s', 0):.3f}s")
        layout = plan_layout(client, d.version)
        if layout:
            text += f"\n        layout {layout}"
    elif isinstance(d, schema.FailureDetail):
        text = f"{','.join(d.devices)}: {d.reason}"
    elif isinstance(d, schema.SwitchDoneDetail):
        text = (f"plan v{d.plan_version} source={d.source} "
                + " ".join(f"{k}={t[k]:.3f}s" for k in ("stall_s", "regroup_s", "bsr_s",
                                                         "rebuild_s", "total_s") if k in t))
        text += f" moved={fmt_bytes(d.bytes_moved)}" if d.bytes_moved else ""
    elif isinstance(d, schema.SwitchFailedDetail):
        text = f"plan v{d.plan_version} error={d.error[:200]}"
    else:
        text = json.dumps(d.to_dict())[:200]
    say(f"EVENT #{ev.seq} {ev.type} [{ev.node}] {text}")


def worker_records(client: EtcdClient) -> dict[str, schema.WorkerRecord]:
    prefix = schema.workers_prefix(JOB)
    return {kv.key[len(prefix):].replace("/", ":"): schema.decode(kv.key, kv.value)
            for kv in client.get_prefix(prefix)}


def elastic_reference(steps: int) -> dict[str, torch.Tensor]:
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.graph.reference import reference_train
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler

    config = ModelConfig(**ELASTIC_CONFIG)
    sample = synthetic_sampler(config, ELASTIC_DATA_SEED)
    batches = [global_batch_at(sample, s, ELASTIC_BATCH) for s in range(steps)]
    return reference_train(config, ELASTIC_SEED, batches, AdamWConfig())[0]


def run_elastic(args, work: Path) -> int:
    from hspmd_elastic.coord import PrefixWatch, read_events
    from hspmd_elastic.graph.config import ModelConfig, param_specs
    from hspmd_elastic.runtime import gather_full

    config = ModelConfig(**ELASTIC_CONFIG)
    model = work / "model.json"
    atomic_write(str(model), config.to_json())
    out = work / "final"
    say("starting embedded etcd")
    with EtcdCluster(size=1, base_dir=str(work / "etcd")) as etcd:
        say(f"etcd healthy at {etcd.endpoint_str}")
        client = EtcdClient(etcd.endpoint_str, timeout=2.0)
        watch = PrefixWatch(client, schema.events_prefix(JOB),
                            lambda ev: ev.record is not None and show_event(ev.record, client),
                            decode=True, initial=True, name="demo events")
        watch.start(10.0)
        agents, echoes = {}, []
        capacity = [] if args.device_memory == "none" else [
            "--hspmd-device-memory", args.device_memory]
        if args.redundancy:
            capacity += ["--hspmd-redundancy", str(args.redundancy)]
        env = agent_env(work)
        seen = {"snapshot_loads": 0}
        try:
            for node in NODES:
                cmd = [sys.executable, "-m", "launcher.cli",
                       "--nnodes", str(len(NODES)), "--nproc-per-node", str(args.nproc),
                       "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_str,
                       "--rdzv-id", JOB, "--hspmd-node-id", node, "--hspmd-lease-ttl", "2",
                       "--log-dir", str(work / "logs" / node),
                       "--shutdown-timeout", "5", "--hspmd-elastic", "--hspmd-model", str(model),
                       "--hspmd-global-batch", str(ELASTIC_BATCH), *capacity,
                       str(ROOT / "tests" / "scripts" / "elastic_train.py"),
                       "--config", str(model), "--steps", str(args.steps),
                       "--global-batch", str(ELASTIC_BATCH), "--seed", str(ELASTIC_SEED),
                       "--data-seed", str(ELASTIC_DATA_SEED), "--out", str(out),
                       "--step-time", "0.05", "--timeout", "60"]
                say(f"launching {node}: hspmd-launch " + " ".join(cmd[3:]))
                agents[node] = subprocess.Popen(cmd, cwd=str(ROOT), env=env,
                                                start_new_session=True, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)
                echo = threading.Thread(target=relay, args=(agents[node].stdout, seen),
                                        daemon=True)
                echo.start()
                echoes.append(echo)
            victim = f"{NODES[-1]}:{args.nproc - 1}"
            devices = [f"{n}:{i}" for n in NODES for i in range(args.nproc)]

            def all_at_kill_step():
                recs = worker_records(client)
                if all(d in recs for d in devices) and recs[victim].step >= args.kill_at:
                    return recs
                return None
            before = wait_for(all_at_kill_step, args.timeout,
                              f"{victim} to reach step {args.kill_at}")
            show_etcd_state(client)
            say(f"FAULT: SIGKILL worker {victim} (pid {before[victim].pid}) at step "
                f"{before[victim].step}")
            killed_at = time.time()
            os.kill(before[victim].pid, signal.SIGKILL)
            codes = {n: a.wait(timeout=args.timeout) for n, a in agents.items()}
            for echo in echoes:
                echo.join(timeout=10)
            events = read_events(client, JOB)
            versions = sorted(schema.event_detail(e).version for e in events
                              if e.type == "replan")
            plan_before = plan_layout(client, versions[0]) if versions else ""
            plan_after = plan_layout(client, versions[-1]) if versions else ""
        finally:
            for a in agents.values():
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGTERM)
                    a.wait(timeout=30)
            watch.stop(5.0)
            client.close()
    say(f"agents exited with codes {codes}")

    results = {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
               for p in sorted(out.glob("*.pt"))}
    survivors = [d for d in devices if d != victim]
    restarts = sum(1 for d in survivors
                   if d not in results or results[d]["pid"] != before[d].pid)
    switches = [s for r in results.values() for s in r["switches"]]
    diff = None
    if results:
        shapes = {n: s.shape for n, s in param_specs(config).items()}
        got = gather_full([r["final_state"] for r in results.values()], shapes)
        ref = elastic_reference(args.steps)
        missing = sum(int(torch.isnan(got[n]).sum()) for n in ref)  # held by no rank
        if missing:
            say(f"{missing} parameter element(s) are held by no rank: no comparison")
        else:
            diff = max(float((got[n] - ref[n].to(got[n].dtype)).abs().max()) for n in ref)
            say(f"max |param - fault-free reference| = {diff:.3e} over {len(ref)} tensors")
    failures = [e for e in events if e.type == "failure"]
    recovered = sum(1 for f in failures if any(
        e.type == "switch-done" and e.seq > f.seq
        and schema.event_detail(e).plan_version > schema.event_detail(f).plan_version
        for e in events)) if all(c == 0 for c in codes.values()) else 0
    done_after = [e for e in events if e.type == "switch-done" and e.at > killed_at]
    moved = int(sum(schema.event_detail(e).bytes_moved for e in done_after))
    say(f"plan before the fault: {plan_before}")
    say(f"plan after the fault:  {plan_after}")
    say(f"the recovery switch moved {moved} B of weights and AdamW state by fused BSR")
    steps_done = min((r["steps_done"] for r in results.values()), default=0)
    result = {
        "faults": len(failures),
        "recovered": recovered,
        "restarts": restarts,
        "checkpoint_loads": sum(s["source"] == "checkpoint" for s in switches)
        + sum(e.type == "fallback" for e in events),
        "samples_lost": (args.steps - steps_done) * ELASTIC_BATCH if results else None,
        "max_param_diff": diff,
        "switch_seconds": round(done_after[0].at - killed_at, 3) if done_after else None,
        "bytes_moved": moved,
        "plan_before": plan_before,
        "plan_after": plan_after,
        "exit_codes": codes,
        "mode": "elastic",
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["recovered"] == result["faults"] and result["faults"] else 1



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("elastic", "restart"), default="elastic",
                    help="elastic: survivors switch in memory; restart: torchrun's restart")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=17, help="SIGKILL a worker after this step")
    ap.add_argument("--nproc", type=int, default=None,
                    help="workers per node (default: 3, on 2 nodes, elastic; 3 restart)")
    ap.add_argument("--device-memory", default=DEVICE_MEMORY,
                    help="elastic: memory each agent declares per device "
                         f"(default {DEVICE_MEMORY}; 'none': the CPU type's 8 GiB)")
    ap.add_argument("--redundancy", type=int, default=REDUNDANCY,
                    help=f"elastic: --hspmd-redundancy of the agents (default {REDUNDANCY}; "
                         "0: none)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the temporary directory (etcd data, model, results) and print "
                         "its path; by default it is removed at the end")
    args = ap.parse_args()
    args.nproc = args.nproc or 3
    with work_dir(args.keep_work) as work:
        return (run_restart if args.mode == "restart" else run_elastic)(args, work)


if __name__ == "__main__":
    sys.exit(main())
