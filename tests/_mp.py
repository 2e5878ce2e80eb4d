"""Multi-process harness: real worker processes over gloo, for the graph tests.

``run_world(target, world, payload)`` starts ``world`` Python processes (own session each,
OMP_NUM_THREADS=1), joined to one gloo process group through a TCPStore this process hosts on a
free port (port 0). Each worker imports ``target`` ("module:function" from the tests folder),
calls ``function(rank, world, payload)`` and writes what it returns with ``torch.save``. Every
wait has a deadline; on timeout or failure every worker still running is terminated, then killed,
and the error names the rank and carries its traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class WorldError(RuntimeError):
    """A worker failed, or the world did not finish in time."""


def run_world(target: str, world: int, payload: dict, *, timeout_s: float = 120.0,
              group_timeout_s: float = 60.0) -> list:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=group_timeout_s))
    with tempfile.TemporaryDirectory(prefix="hspmd-mp-") as tmp:
        payload = dict(payload, tmp=tmp)
        with open(os.path.join(tmp, "payload.json"), "w") as f:
            json.dump(payload, f)
        procs = [_spawn(target, rank, world, store.port, tmp, group_timeout_s)
                 for rank in range(world)]
        try:
            _join(procs, timeout_s, tmp)
        finally:
            _reap(procs)
        return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False)["result"]
                for r in range(world)]


def _spawn(target, rank, world, port, tmp, group_timeout_s):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    log = open(os.path.join(tmp, f"log{rank}.txt"), "w")
    cmd = [sys.executable, os.path.abspath(__file__), target, str(rank), str(world), str(port),
           tmp, str(group_timeout_s)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def _join(procs, timeout_s, tmp):
    import torch

    deadline = time.monotonic() + timeout_s
    pending = dict(enumerate(procs))
    while pending:
        for rank, proc in list(pending.items()):
            try:
                proc.wait(timeout=max(0.05, min(0.2, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                continue
            del pending[rank]
            out = os.path.join(tmp, f"out{rank}.pt")
            if not os.path.exists(out):
                raise WorldError(f"rank {rank} exited with {proc.returncode}:\n{_log(tmp, rank)}")
            result = torch.load(out, weights_only=False)
            if not result["ok"] or proc.returncode != 0:
                raise WorldError(f"rank {rank} failed (exit {proc.returncode}):\n"
                                 f"{result.get('error', '')}")
        if pending and time.monotonic() > deadline:
            raise WorldError(f"ranks {sorted(pending)} still running after {timeout_s:g}s:\n"
                             + "\n".join(_log(tmp, r) for r in sorted(pending)))


def _reap(procs, grace_s: float = 5.0):
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def _log(tmp, rank) -> str:
    try:
        with open(os.path.join(tmp, f"log{rank}.txt")) as f:
            return f.read()[-4000:]
    except OSError:
        return "(no log)"


def _worker_main(argv) -> int:
    target, rank, world, port, tmp, group_timeout_s = argv
    rank, world, group_timeout_s = int(rank), int(world), float(group_timeout_s)
    import importlib

    import torch
    import torch.distributed as dist

    out = os.path.join(tmp, f"out{rank}.pt")
    try:
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore("127.0.0.1", int(port), None, False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank,
                                world_size=world, timeout=timeout)
        module_name, fn_name = target.split(":")
        with open(os.path.join(tmp, "payload.json")) as f:
            payload = json.load(f)
        result = getattr(importlib.import_module(module_name), fn_name)(rank, world, payload)
        dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, out)
        return 0
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        return 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
