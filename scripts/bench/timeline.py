"""Timestamps for ``scripts/bench_recovery``: one JSON line per event, appended and flushed.

A worker writes ``<dir>/<node>_<local_rank>.jsonl`` (both modes); each line has ``ev`` (the
event), ``t`` (wall clock, ``time.time()``), ``pid`` and, in restart mode, ``restart``
(``TORCHELASTIC_RESTART_COUNT``). Stdlib only, so it can be imported before ``torch``.
"""

from __future__ import annotations

import json
import os
import time


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
