"""Timestamps for ``scripts/bench_recovery``: one JSON line per event, appended and flushed.

A worker writes ``<dir>/<node>_<local_rank>.jsonl`` (both modes); each line has ``ev`` (the
event), ``t`` (wall clock, ``time.time()``), ``pid`` and, in restart mode, ``restart``
(``TORCHELASTIC_RESTART_COUNT``). Stdlib only, so it can be imported before ``torch``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Optional


class Timeline:
    def __init__(self, directory: str) -> None:
        node = os.environ.get("HSPMD_NODE_ID", "node")
        self.path = os.path.join(directory, f"{node}_{os.environ.get('LOCAL_RANK', '0')}.jsonl")
        self.base = {"pid": os.getpid(),
                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the process

    def mark(self, ev: str, t: float | None = None, **fields) -> None:
        rec = dict(self.base, ev=ev, t=time.time() if t is None else t, **fields)
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()


def process_started_at() -> float | None:
    """When this process was created (the agent's spawn; the pid survives the exec shim)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - optional detail
        return None


def training_start(doc: str, t0: float,
                   more: Optional[Callable[[argparse.ArgumentParser], None]] = None
                   ) -> tuple[argparse.Namespace, Timeline]:
    """The command line every training script of ``bench_recovery`` shares (``--config``,
    ``--steps``, ``--global-batch``, ``--seed``, ``--data-seed``, ``--timeline``; ``more`` adds
    a script's own), parsed, and its timeline with ``spawned`` and ``start`` (``t0``: when the
    script began) marked."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--timeline", required=True)
    if more is not None:
        more(ap)
    args = ap.parse_args()
    tl = Timeline(args.timeline)
    tl.mark("spawned", process_started_at())
    tl.mark("start", t0)
    return args, tl


def read_config(path: str):
    """The ``ModelConfig`` in ``path`` (imports the library: mark ``imported`` before)."""
    from hspmd_elastic.graph.config import ModelConfig

    with open(path, encoding="utf-8") as f:
        return ModelConfig.from_json(f.read())


def read(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    except OSError:
        pass
    return out
