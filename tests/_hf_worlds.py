"""One world, many runs: the shared multi-process runs of the Hugging Face layout tests.

A test module starts one ``run_world`` for all its runs (each a variant under one plan) from a
module-scoped fixture (``shared_world``); its tests then read their runs' results
(``run_results``). Starting worker processes dominates on a small machine, so the runs share the
processes, and each test still fails alone:

* worker side, ``each_run``: every rank runs the runs in the same order. A run that raises on a
  rank is recorded as that rank's traceback for that run, and the next run starts anyway: the
  ranks first meet on a fresh group of all ranks, so groups a failed run left broken (a peer
  timed out in a collective) are never used again; the fresh group is also the run's group for
  point-to-point messages. A run that hangs without a timeout still ends the world at its
  deadline (``WorldError``: every test of the module fails with it).
* test side, ``run_results``: a run's per-rank results, or the test fails with the tracebacks of
  the ranks where that run raised.

``checkpoints_world`` is ``shared_world`` for the modules whose workers load saved checkpoints.
``once_per_session`` is the sharing itself (a file lock, the value saved once): the elastic
tests' one worker-kill run (``tests/_elastic_job.py``) is shared the same way.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytest

from _world import run_world

# The timeout of a run's own group, as of the plans' groups (``Comm.create(timeout_s=60)``).
RUN_TIMEOUT_S = 60.0
# A failed run's peers wait out their own operations' timeouts before they reach the next run's
# meeting: the meeting waits longer than that.
MEET_TIMEOUT_S = 180.0


def each_run(rank: int, world: int, runs: Iterable, body: Callable[[Any, Any], Any]) -> dict:
    """``body(run, group)`` for each run in turn, on every rank; per run ``{"value": ...}`` or
    ``{"error": traceback}``. Before each run every rank meets the others on a fresh group;
    ``group`` is another fresh group of all ranks (global rank = its rank; RUN_TIMEOUT_S), for
    the run's point-to-point messages and barriers."""
    import torch.distributed as dist

    out: dict = {}
    ranks = list(range(world))
    for run in runs:
        try:
            meet = dist.new_group(ranks, timeout=datetime.timedelta(seconds=MEET_TIMEOUT_S))
            dist.barrier(group=meet)
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
        except Exception as exc:  # the ranks no longer meet: the rest cannot run
            raise RuntimeError(f"rank {rank}: the ranks did not meet before run {run!r}") from exc
        try:
            out[run] = {"value": body(run, group)}
        except Exception:  # noqa: BLE001 - reported by that run's tests
            out[run] = {"error": traceback.format_exc()}
    return out


def run_results(results: list, run, ranks: Optional[Iterable[int]] = None) -> dict:
    """``run``'s result on each of ``ranks`` (default: every rank), by rank; the test fails with
    the traceback of each rank where the run raised (on any rank: a peer's error is the cause)."""
    failed = [f"rank {r}:\n{per_rank[run]['error']}" for r, per_rank in enumerate(results)
              if "error" in per_rank[run]]
    if failed:
        pytest.fail(f"run {run!r} failed in the shared world:\n" + "\n".join(failed),
                    pytrace=False)
    ranks = range(len(results)) if ranks is None else ranks
    return {r: results[r][run]["value"] for r in ranks}


def once_per_session(tmp_path_factory, name: str, produce: Callable[[Path], Any]) -> Any:
    """``produce(dir)`` once per pytest session (``dir``: a fresh temporary directory named
    after ``name``), its value kept with ``torch.save``: pytest-xdist workers that need it too
    (a module's tests may be split between workers, and modules share a value) wait for the
    first one's on a file lock and read it, instead of producing it again."""
    import torch

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = shared / f"{name}-results.pt"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on a failure
        if done.exists():
            return torch.load(done, weights_only=False)
        value = produce(tmp_path_factory.mktemp(name))
        torch.save(value, f"{done}.tmp")
        os.replace(f"{done}.tmp", done)
        return value


def shared_world(tmp_path_factory, name: str, fn: Callable, world: int, args: tuple,
                 **kwargs) -> list:
    """``run_world(fn, world, args, **kwargs)`` once per pytest session
    (``once_per_session``). The workers' logs stay in the session's temporary directory
    (``<name>-world*``)."""
    return once_per_session(tmp_path_factory, f"{name}-world",
                            lambda tmp: run_world(fn, world, args, tmp_dir=tmp, **kwargs))


def checkpoints_world(tmp_path_factory, name: str, fn: Callable, world: int, saved: dict,
                      **kwargs) -> list:
    """``shared_world`` on saved checkpoints: ``saved`` maps a variant to its checkpoint (with
    its directory ``path`` and its ``ModelConfig`` ``config``), and the workers run
    ``fn(rank, world, paths, config_jsons)``, both by variant."""
    return shared_world(tmp_path_factory, name, fn, world,
                        ({v: s.path for v, s in saved.items()},
                         {v: s.config.to_json() for v, s in saved.items()}), **kwargs)
