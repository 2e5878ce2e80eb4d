#!/usr/bin/env python3
"""The main job, run by ``scripts/demo``: a CPU training job survives an injected fault.

1. starts an embedded etcd (one member, loopback, free ports);
2. runs ``hspmd-launch`` with 3 gloo workers of ``examples/ddp_train.py`` (an unmodified
   torchrun-style DDP script with snapshots) against it, ``--max-restarts 1``;
3. shows the job's state in etcd (node, workers, rendezvous) and the training progress live;
4. SIGKILLs one worker mid-run (a real signal to a real process);
5. waits for the launcher to detect it, restart the workers and finish the job;
6. recomputes the same steps fault-free in this process and compares every parameter.

The last line is ``RESULT {json}`` with what was measured (nothing in it is asserted here).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import ddp_train  # noqa: E402

from hspmd_elastic.coord import EtcdClient, schema  # noqa: E402
from launcher.standalone import EtcdCluster  # noqa: E402

JOB = "demo"


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=17, help="SIGKILL a worker after this step")
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hspmd-demo-"))
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
            str(ROOT / "examples" / "ddp_train.py"),
            "--steps", str(args.steps), "--snapshot", str(work / "snap.pt"),
            "--out", str(work / "final.pt"), "--progress-dir", str(progress),
            "--step-seconds", "0.05",
        ]
        say("launching: hspmd-launch " + " ".join(cmd[3:]))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
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


if __name__ == "__main__":
    sys.exit(main())
