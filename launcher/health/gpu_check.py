"""The GPU check behind ``scripts/gpu_check``: NVML health source, then a 2-process NCCL exchange.

For a machine with NVIDIA GPUs. Steps, each printed as one ``gpu_check:`` line:

1. NVML: the driver loads, ``NvmlHealthSource`` lists the GPUs, polls every check (ECC, pending
   repairs, recovery action, thermal) and starts and stops its Xid event thread within bounds;
   a GPU whose verdict is failed fails the check.
2. Communication: two worker processes, one per GPU, form an NCCL group and run ``all_reduce``
   and a ``batch_isend_irecv`` ring; when ``hspmd_elastic.reshard`` has its executor they also
   reshard a tensor from row shards to column shards with a fused BSR schedule and check every
   element. With a single GPU one process runs (NCCL refuses two ranks on one GPU).

Promises: the whole check ends within ``--budget`` seconds (workers are killed at the deadline);
on a machine without a usable GPU it exits 1 after one line naming why; a step that cannot run
here (a CPU-only torch build) is reported as ``SKIP`` with the reason, and ``--strict`` makes
that a failure. ``--comm-only --backend gloo`` runs step 2 on CPUs (how the step is tested).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

EXIT_OK = 0
EXIT_FAILED = 1
DEFAULT_BUDGET_S = 150.0


class CheckFailed(Exception):
    """One line saying which step failed and why."""


def say(text: str) -> None:
    print(f"gpu_check: {text}", flush=True)


# ------------------------------------------------------------------------------------ NVML step
def check_nvml(budget_s: float, nvml: Any = None) -> int:
    """Exercise the NVML health source; returns the number of GPUs. ``nvml``: the pynvml
    module (a stand-in in tests)."""
    from launcher.health.nvml import NvmlHealthSource, probe_nvml

    if nvml is None:
        import pynvml as nvml
    why = probe_nvml(nvml)
    if why is not None:
        raise CheckFailed(f"no usable NVIDIA GPU: {why}")
    source = NvmlHealthSource(nvml, event_timeout_ms=200)
    source.start()
    try:
        devices = source.devices()
        if not devices:
            raise CheckFailed(f"NVML loaded but lists no GPU ({source.unavailable or 'count 0'})")
        for dev in devices:
            say(f"GPU {dev.index}: {dev.name} ({dev.type}), {dev.memory_bytes / 2**30:.1f} GiB, "
                f"{dev.uuid}")
        verdicts = source.poll(time.monotonic())
        for index, verdict in sorted(verdicts.items()):
            say(f"GPU {index}: {verdict.describe()}")
        unsupported = source.unsupported_queries()
        if unsupported:
            say(f"queries this driver/GPU does not support: {unsupported}")
        say(f"Xid event thread: {'running' if source.events_running else 'off'}")
    finally:
        t0 = time.monotonic()
        source.stop(timeout=min(5.0, budget_s))
        stopped = not source.events_running
        say(f"NVML source stopped in {time.monotonic() - t0:.2f}s" + ("" if stopped else
                                                                     " (event thread stuck)"))
    failed = [i for i, v in verdicts.items() if v.is_failed]
    if failed:
        raise CheckFailed(f"GPU(s) {failed} failed the health check (see above)")
    if not stopped:
        raise CheckFailed("the NVML event thread did not stop within 5 s")
    return len(devices)


# ------------------------------------------------------------------------------------ comm step
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_unavailable_reason() -> Optional[str]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (a CPU-only build, or no GPU)"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    return None


def check_comm(backend: str, world: int, budget_s: float) -> None:
    """Run ``world`` worker processes and wait for them, killing them at the deadline."""
    port = _free_port()
    deadline = time.monotonic() + budget_s
    procs = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "launcher.health.gpu_check", "--_worker", str(rank),
               "--world", str(world), "--port", str(port), "--backend", backend,
               "--budget", str(max(budget_s - 5, 10))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs: list[str] = []
    try:
        for proc in procs:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                out, _ = proc.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise CheckFailed(
                    f"{backend} check did not finish within {budget_s:.0f}s") from None
            outputs.append(out)
    finally:
        for proc in procs:
            _kill(proc)
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = out.strip().splitlines()[-1:] or ["no output"]
            raise CheckFailed(f"{backend} rank {rank} failed (exit {proc.returncode}): {tail[0]}")
        results.append(json.loads(lines[-1]))
    for r in results:
        say(f"{backend} rank {r['rank']}/{world}: " + ", ".join(r["passed"]))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=3)


# ------------------------------------------------------------------------------------ worker
def _reshard_available() -> bool:
    try:
        from hspmd_elastic.reshard import executor, planner  # noqa: F401
    except ImportError:
        return False
    return hasattr(executor, "execute_fused") and hasattr(planner, "fused_bsr_schedule")


def _reshard(rank: int, device, timeout_s: float) -> str:
    import torch

    from hspmd_elastic.annotations import TensorAnnotation
    from hspmd_elastic.reshard.api import TensorSpec
    from hspmd_elastic.reshard.executor import execute_fused
    from hspmd_elastic.reshard.planner import fused_bsr_schedule

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
    import datetime

    import torch
    import torch.distributed as dist

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
    return EXIT_OK


def _wait(work, timeout_s: float, what: str) -> None:
    """Wait for one async op with a deadline (NCCL's wait() only orders streams: poll it)."""
    import datetime

    import torch.distributed as dist

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


# ------------------------------------------------------------------------------------ main
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds the whole check may take (default %(default)s)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--comm-only", action="store_true", help="skip the NVML step")
    parser.add_argument("--strict", action="store_true", help="a skipped step fails the check")
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="gpu_check: %(levelname)s %(message)s")
    if args._worker is not None:
        try:
            return run_worker(args._worker, args.world, args.port, args.backend, args.budget)
        except Exception as exc:  # noqa: BLE001 - one line for the parent, not a traceback
            print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
            return EXIT_FAILED
    deadline = time.monotonic() + args.budget
    try:
        gpus = 0 if args.comm_only else check_nvml(args.budget)
        world = 2
        if args.backend == "nccl":
            why = cuda_unavailable_reason()
            if why is not None:
                if args.strict:
                    raise CheckFailed(f"NCCL step cannot run: {why}")
                say(f"SKIP nccl: {why}")
                say("PASS (NVML); NCCL skipped")
                return EXIT_OK
            import torch

            gpus = torch.cuda.device_count()
            world = 2 if gpus >= 2 else 1
            if world == 1:
                say("one GPU: NCCL runs 1 process (2 processes need 2 GPUs)")
        check_comm(args.backend, world, max(deadline - time.monotonic(), 10.0))
    except CheckFailed as exc:
        print(f"gpu_check: FAIL: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    say("PASS")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
