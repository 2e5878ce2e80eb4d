"""The multi-process harness of the tests: real worker processes in one gloo world.

``run_world(fn, world, args)`` starts ``world`` fresh Python processes (own session each,
OMP_NUM_THREADS=1, one torch thread), joined to one gloo process group through a TCPStore this
process hosts on a free port (port 0). Rank ``r`` calls ``fn(r, world, *args)``: ``fn`` is a
module-level function of a module the workers can import from the tests folder (the test module
itself), and ``args`` must pickle. What each rank returns comes back through ``torch.save``
(tensors allowed), in rank order. The default process group's store is reachable from ``fn`` as
``dist.distributed_c10d._get_default_store()``.

Every wait has a deadline. The call fails with ``WorldError`` as soon as a rank fails (raises,
or exits without a result), or when ``timeout_s`` passes; ranks still running are then
terminated, then killed (their whole session), and the error names each failed or hung rank
with its traceback or the tail of its output.

A worker exits as soon as its result is written, without tearing its process groups down: a
test may leave a group broken on purpose (a timed-out pair), and a teardown could wait on it.

The worker side is ``_worker`` below: this file is the workers' entry point.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class WorldError(AssertionError):
    """A rank raised, hung or exited without a result."""


def run_world(fn: Callable, world: int, args: tuple = (), *, tmp_dir: Optional[Path] = None,
              timeout_s: float = 120.0, group_timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; their results, in rank order.

    ``tmp_dir`` keeps the call, the results and each rank's output (``log<rank>.txt``); by
    default a temporary directory that is removed afterwards. ``group_timeout_s`` is the
    timeout of the store and of the default process group.
    """
    if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(f"run_world needs a module-level function, not {fn.__qualname__}")
    if tmp_dir is None:
        with tempfile.TemporaryDirectory(prefix="hspmd-world-") as tmp:
            return _run(fn, world, tuple(args), Path(tmp), timeout_s, group_timeout_s)
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    return _run(fn, world, tuple(args), tmp_dir, timeout_s, group_timeout_s)


def _run(fn, world, args, tmp: Path, timeout_s, group_timeout_s) -> list:
    import torch
    import torch.distributed as dist

    with open(tmp / "call.pkl", "wb") as f:
        pickle.dump((fn.__module__, fn.__qualname__, args), f)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=group_timeout_s))
    procs = [_spawn(rank, world, store.port, tmp, group_timeout_s) for rank in range(world)]
    try:
        running, timed_out = _join(procs, timeout_s)
    finally:
        _reap(procs)
    results, errors = [], []
    for rank, proc in enumerate(procs):
        out = tmp / f"out{rank}.pt"
        record = torch.load(out, weights_only=False) if out.exists() else None
        results.append(record["result"] if record is not None and record["ok"] else None)
        if record is not None and not record["ok"]:
            errors.append(f"rank {rank} raised:\n{record['error']}")
        elif record is None and rank not in running:
            errors.append(f"rank {rank} exited with {proc.returncode} without a result:\n"
                          f"{_log(tmp, rank)}")
        elif record is None and timed_out:
            errors.append(f"rank {rank} still running after {timeout_s:g}s:\n{_log(tmp, rank)}")
    if errors:
        if running and not timed_out:
            errors.append(f"ranks {sorted(running)} were stopped after that failure")
        raise WorldError("\n".join(errors))
    return results


def _spawn(rank, world, port, tmp: Path, group_timeout_s) -> subprocess.Popen:
    # the checkout first, then what this process was given (wheels installed into a folder)
    path = [ROOT, HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    with open(tmp / f"log{rank}.txt", "w") as log:
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(rank), str(world), str(port),
             str(tmp), str(group_timeout_s)],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=ROOT)


def _join(procs: list[subprocess.Popen], timeout_s: float) -> tuple[set[int], bool]:
    """Wait until every rank has exited, one has failed (a non-zero exit) or the deadline has
    passed; the ranks still running then, and whether the deadline passed."""
    deadline = time.monotonic() + timeout_s
    running = set(range(len(procs)))
    while running:
        if time.monotonic() >= deadline:
            return running, True
        for rank in sorted(running):
            try:
                code = procs[rank].wait(timeout=max(0.01, min(0.2, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                continue
            running.discard(rank)
            if code != 0:
                return running, False
    return running, False


def _reap(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminate, then kill, the sessions of the ranks still running."""
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def _log(tmp: Path, rank: int) -> str:
    try:
        return (tmp / f"log{rank}.txt").read_text(errors="replace")[-4000:]
    except OSError:
        return "(no log)"


def _worker(rank: int, world: int, port: int, tmp: str, group_timeout_s: float) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank,
                                world_size=world, timeout=timeout)
        with open(os.path.join(tmp, "call.pkl"), "rb") as f:
            module, qualname, args = pickle.load(f)
        fn = importlib.import_module(module)
        for name in qualname.split("."):
            fn = getattr(fn, name)
        record = {"ok": True, "result": fn(rank, world, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        record = {"ok": False, "error": traceback.format_exc()}
    out = os.path.join(tmp, f"out{rank}.pt")
    torch.save(record, out + ".tmp")
    os.replace(out + ".tmp", out)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    code = _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                   float(sys.argv[5]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a group may be broken on purpose
