"""The GPU check behind ``scripts/gpu_check``: one prepared command for a machine with NVIDIA GPUs.

Steps, each printed as ``gpu_check:`` lines, each ``PASS``, ``SKIP`` (with the reason) or a
failure:

1. ``nvml``: the driver loads, ``NvmlHealthSource`` lists the GPUs (index, name, memory, UUID,
   PCI bus id, and the planner profile each name maps to), polls every check (ECC, pending
   repairs, recovery action, thermal) into one verdict per GPU, and starts and stops its Xid
   event thread (the driver's event registration) within bounds; a failed GPU fails the check.
2. ``comm``: worker processes, one per GPU, form an NCCL group and run ``all_reduce``; with two
   GPUs or more, two of them also run a ``batch_isend_irecv`` ring and a fused BSR reshard from
   row shards to column shards on CUDA buffers, every element checked (one GPU: skipped).
3. ``unit``: the ``gpu``-marked tests (``tests/test_gpu.py``: the specialized model and the BSR
   on CUDA, an NCCL group formed, aborted and formed again in one process), when ``tests/``
   and pytest are there.
4. ``switches``: an elastic job (etcd, agent, one worker on ``cuda:0``) that switches in memory
   twice (a scripted slowdown, then its recovery, make the leader replan): same pid, every step,
   GPU memory after each switch no larger than after the first (``gpu_check_job.py``).
5. ``kill``: with two GPUs, a worker SIGKILLed while its peer waits in an NCCL collective: the
   peer aborts the communicator and switches in memory well inside its timeout.
6. ``mfu``: training throughput and MFU of a bf16 step (``scripts/bench_step --mfu``: a
   0.75 B-parameter model on ``cuda:0``, bf16 compute with float32 master weights, against the
   dense reference; ``--device cpu`` rehearses it with a tiny model, whose MFU means nothing),
   within 40% of what is left of the budget, at most 160 s; ``--mfu-report FILE`` keeps its
   Markdown table (and ``FILE.json``). A loss that is not finite fails it.

Without CUDA (or without a driver) the GPU steps report ``SKIP ...: skipped: no CUDA`` and the
check exits 0, so it can be rehearsed anywhere; ``--strict`` makes any skip a failure.
``--device cpu`` runs the elastic steps 4 and 5 on CPU workers over gloo (how they are
rehearsed and tested), ``--only STEP,...`` runs some steps, ``--comm-only --backend gloo`` runs
step 2 on CPUs. Promises: the whole check ends within ``--budget`` seconds (processes are killed
at the deadline); a failure is one ``gpu_check: FAIL: ...`` line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from launcher.health.gpu_check_job import CheckFailed, switches_in_process, worker_kill_switch

EXIT_OK = 0
EXIT_FAILED = 1
DEFAULT_BUDGET_S = 300.0
STEPS = ("nvml", "comm", "unit", "switches", "kill", "mfu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Skipped(Exception):
    """A step that cannot run here; the message says why."""


def say(text: str) -> None:
    print(f"gpu_check: {text}", flush=True)


# ------------------------------------------------------------------------------------ NVML step
def check_nvml(budget_s: float, nvml: Any = None) -> int:
    """Exercise the NVML health source; returns the number of GPUs. ``nvml``: the pynvml
    module (a stand-in in tests)."""
    from launcher.health.nvml import NvmlHealthSource, probe_nvml

    if nvml is None:
        import pynvml as nvml
    from hspmd_elastic.planner import spec_for_device

    why = probe_nvml(nvml)
    if why is not None:
        raise Skipped(f"no usable NVIDIA GPU: {why}")
    source = NvmlHealthSource(nvml, event_timeout_ms=200)
    source.start()
    try:
        devices = source.devices()
        if not devices:
            raise CheckFailed(f"NVML loaded but lists no GPU ({source.unavailable or 'count 0'})")
        for dev in devices:
            profile = spec_for_device(dev.type, dev.memory_bytes or None).name
            say(f"GPU {dev.index}: {dev.name} ({dev.type}), {dev.memory_bytes / 2**30:.1f} GiB, "
                f"{dev.uuid}, PCI {dev.pci_bus_id or 'unknown'}, planner profile {profile}")
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


# ------------------------------------------------------------------------------------ unit step
def check_unit(budget_s: float) -> str:
    """The ``gpu``-marked tests, in a subprocess bounded by ``budget_s``."""
    tests = os.path.join(ROOT, "tests", "test_gpu.py")
    if not os.path.exists(tests):
        raise Skipped(f"{tests} is not here")
    if importlib.util.find_spec("pytest") is None:
        raise Skipped("pytest is not installed")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
                              env=dict(os.environ, PYTHONPATH=_pythonpath()))
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"the gpu tests did not finish within {budget_s:.0f}s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    if proc.returncode != 0:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        raise CheckFailed(f"gpu tests: {summary}" + (f" ({failed[0]})" if failed else ""))
    return summary.strip("= ")


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


# ------------------------------------------------------------------------------------ main
def _run_step(name: str, fn: Callable[[], Optional[str]], strict: bool,
              outcome: dict[str, str]) -> None:
    try:
        text = fn()
    except Skipped as exc:
        if strict:
            raise CheckFailed(f"{name} cannot run here: {exc}") from None
        outcome[name] = "skipped"
        say(f"SKIP {name}: {exc}")
        return
    except CheckFailed as exc:
        raise CheckFailed(f"{name}: {exc}") from None
    outcome[name] = "passed"
    say(f"PASS {name}" + (f": {text}" if text else ""))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds the whole check may take (default %(default)s)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--comm-only", action="store_true", help="only the communication step")
    parser.add_argument("--only", default=",".join(STEPS),
                        help="comma-separated steps to run (default: all): " + ", ".join(STEPS))
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the elastic steps' workers compute: auto (CUDA, else the "
                             "steps are skipped), cuda, or cpu to rehearse them on CPUs")
    parser.add_argument("--mfu-report", default=None, metavar="FILE",
                        help="the mfu step's Markdown table (and FILE.json with its numbers)")
    parser.add_argument("--keep", default=None, help=argparse.SUPPRESS)
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
    only = ["comm"] if args.comm_only else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        parser.error(f"--only {args.only!r}: unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
    deadline = time.monotonic() + args.budget
    outcome: dict[str, str] = {}

    def left(share: float = 1.0) -> float:
        return max(10.0, (deadline - time.monotonic()) * share)

    cuda: dict[str, Any] = {}

    def cuda_why() -> Optional[str]:  # asked once, when a step needs it (imports torch)
        if "why" not in cuda:
            cuda["why"] = cuda_unavailable_reason()
            cuda["gpus"] = 0 if cuda["why"] else _gpu_count()
        return cuda["why"]

    def gpus() -> int:
        cuda_why()
        return cuda["gpus"]

    try:
        steps: dict[str, Callable[[], Optional[str]]] = {
            "nvml": lambda: f"{check_nvml(left(0.1))} GPU(s) healthy",
            "comm": lambda: _comm(args.backend, cuda_why, gpus, left(0.2)),
            "unit": lambda: _needs_cuda(cuda_why()) or check_unit(left(0.25)),
            "switches": lambda: switches_in_process(_job_device(args.device, cuda_why),
                                                    left(0.5), keep=args.keep),
            "kill": lambda: worker_kill_switch(_job_device(args.device, cuda_why, gpus, 2),
                                               left(0.9), comm_timeout_s=60.0, keep=args.keep),
            "mfu": lambda: _mfu(args.device, cuda_why, min(160.0, left(0.4)),
                                args.mfu_report),
        }
        for name in STEPS:
            if name in only:
                _run_step(name, steps[name], args.strict, outcome)
    except CheckFailed as exc:
        print(f"gpu_check: FAIL: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    passed = sum(v == "passed" for v in outcome.values())
    skipped = [k for k, v in outcome.items() if v == "skipped"]
    if skipped:
        say(f"PASS ({passed} passed, {len(skipped)} skipped: {', '.join(skipped)})")
    else:
        say("PASS")
    return EXIT_OK


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _needs_cuda(why: Optional[str]) -> None:
    if why is not None:
        raise Skipped(f"skipped: no CUDA ({why})")


def _comm(backend: str, cuda_why: Callable[[], Optional[str]], gpus: Callable[[], int],
          budget_s: float) -> str:
    if backend == "gloo":
        check_comm("gloo", 2, budget_s)
        return "gloo, 2 processes"
    _needs_cuda(cuda_why())
    world = 2 if gpus() >= 2 else 1
    check_comm("nccl", world, budget_s)
    if world == 1:
        say("SKIP 2-rank NCCL ring and fused BSR: skipped: one GPU")
    return f"nccl, {world} process(es)"


def _job_device(setting: str, cuda_why: Callable[[], Optional[str]],
                gpus: Callable[[], int] = lambda: 1, need: int = 1) -> str:
    """The elastic steps' ``--hspmd-device``: cpu to rehearse, else cuda (or a skip)."""
    if setting == "cpu":
        return "cpu"
    _needs_cuda(cuda_why())
    count = gpus()
    if count < need:
        raise Skipped("skipped: one GPU" if count == 1 else f"skipped: {count} GPU(s), needs {need}")
    return "cuda"


def _mfu(setting: str, cuda_why: Callable[[], Optional[str]], budget_s: float,
         report: Optional[str]) -> str:
    """``scripts/bench_step --mfu`` on cuda:0 (or, with ``--device cpu``, a tiny rehearsal)."""
    bench = os.path.join(ROOT, "scripts", "bench_step")
    if not os.path.isfile(bench):
        raise Skipped(f"skipped: {bench} is not here (run the check from a checkout)")
    if setting == "cpu":
        size = ["--device", "cpu", "--size", "tiny", "--steps", "3", "--warmup", "1"]
    else:
        _needs_cuda(cuda_why())
        size = ["--device", "cuda", "--size", "0.7b", "--steps", "5", "--warmup", "2"]
    cmd = [sys.executable, bench, "--mfu", *size]
    if report:
        cmd += ["--out", report, "--json", report + ".json"]
    say("mfu: " + " ".join(["scripts/bench_step", *cmd[2:]]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"scripts/bench_step --mfu ran past its {budget_s:.0f}s budget") from None
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise CheckFailed(f"scripts/bench_step --mfu: {last}")
    rows = {}
    for line in proc.stdout.splitlines():  # | step | ms | tokens/s | TFLOP/s | MFU | GiB |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].split(" ")[0] in ("specialized", "dense"):
            rows[cells[0].split(" ")[0]] = cells
    if "specialized" not in rows:
        raise CheckFailed("scripts/bench_step --mfu printed no result row")
    _, ms, tokens, tflops, mfu, gib = rows["specialized"]
    text = f"{tokens} tokens/s, {tflops} TFLOP/s, MFU {mfu}, step {ms} ms, peak {gib} GiB"
    if "dense" in rows:
        text += f" (dense reference: MFU {rows['dense'][4]})"
    return text


if __name__ == "__main__":
    sys.exit(main())
