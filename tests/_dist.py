"""Multi-process gloo harness for tests: real processes, a FileStore rendezvous, bounded joins.

``run_world(fn, world_size, tmp_dir)`` spawns ``world_size`` fresh interpreters, forms a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns every rank's JSON result
in rank order. Every join has a deadline; stragglers are terminated, then killed, and reported.
``fn`` must be a module-level function (spawn pickles it by reference).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable


class WorldError(AssertionError):
    """A rank crashed, hung or wrote no result."""


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir) / f"{rank}.json"
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=30),
        )
        result: Any = {"ok": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        result = {"error": traceback.format_exc()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    # A test may leave the group broken on purpose (timeouts): exit without a teardown handshake.
    os._exit(0)


def run_world(
    fn: Callable, world_size: int, tmp_dir: Path, args: tuple = (), timeout_s: float = 90.0
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; return the results, or raise ``WorldError``."""
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, str(tmp_dir / "store"), str(tmp_dir), args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    hung = []
    for rank, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            hung.append(rank)
    for rank in hung:
        procs[rank].terminate()
    for rank in hung:
        procs[rank].join(5)
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join(5)
    results, errors = [], []
    for rank in range(world_size):
        path = tmp_dir / f"{rank}.json"
        if not path.exists():
            errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode}, hung={rank in hung})")
            results.append(None)
            continue
        data = json.loads(path.read_text())
        if "error" in data:
            errors.append(f"rank {rank} raised:\n{data['error']}")
        results.append(data.get("ok"))
    if errors:
        raise WorldError("\n".join(errors))
    return results
