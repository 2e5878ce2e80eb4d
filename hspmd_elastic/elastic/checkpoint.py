"""Periodic, asynchronous checkpoints of the sharded training state, and reading them back under
any plan: the fallback when a switch finds a slice with no live owner.

Layout: ``<dir>/step-<8 digits>/shard-<rank>.pt`` holds one rank's local state tensors with their
global index ranges; ``manifest.json`` lists the shards the step needs. Only the devices of the
plan's first pipeline write (together they hold one full replica of every state tensor). A
checkpoint is complete when its manifest and every listed shard exist; files are written to a
temporary name and renamed, so a reader never sees half a file. Writing happens on a background
thread from a copy taken at the step boundary; ``flush`` waits for it with a deadline.

A shard holds only tensors, dicts, tuples, ints and strings (``{"step": int, "tensors": {name:
(((lo, hi), ...), tensor)}}``), and is read with ``torch.load(weights_only=True)``: a file
planted in the checkpoint directory cannot run code when read, whatever its age or origin; a
manifest may only name ``shard-<rank>.pt`` files of its own directory, and a shard whose
contents do not fit the plan's tensors is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
from typing import Mapping, Optional

import torch

from hspmd_elastic.elastic.api import ElasticError
from hspmd_elastic.elastic.agree import NO_STEP
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.plan import Plan

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{8})$")
_SHARD_RE = re.compile(r"^shard-\d+\.pt$")


class CheckpointError(ElasticError):
    """A checkpoint could not be written or read (names the path)."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _atomic_save(obj, path: str, as_json: bool = False) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    if as_json:
        with open(tmp, "w") as f:
            json.dump(obj, f)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_complete(root: Optional[str]) -> int:
    """The newest complete checkpoint step under ``root`` (``NO_STEP`` if none)."""
    if not root or not os.path.isdir(root):
        return NO_STEP
    steps = sorted((int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(root)) if m),
                   reverse=True)
    for step in steps:
        if _complete(step_dir(root, step)):
            return step
    return NO_STEP


def _shards(path: str) -> Optional[list[str]]:
    """The shard files ``path``'s manifest lists (None: no manifest, or one naming anything
    but ``shard-<rank>.pt`` files of its own directory)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            shards = json.load(f)["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(shards, list) or not all(isinstance(s, str) and _SHARD_RE.match(s)
                                               for s in shards):
        return None
    return shards


def _complete(path: str) -> bool:
    shards = _shards(path)
    return shards is not None and all(os.path.exists(os.path.join(path, s)) for s in shards)


class CheckpointWriter:
    """Writes this rank's shards every ``every`` steps on a background thread."""

    def __init__(self, root: str, every: int, keep: int = 3):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.root, self.every, self.keep = root, every, keep
        os.makedirs(root, exist_ok=True)
        self._queue: "queue.Queue" = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def submit(self, step: int, config: ModelConfig, plan: Plan, rank: int,
               tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue a checkpoint of this rank's local state ``tensors`` at ``step`` (copied now)."""
        if plan.locate(rank).pipeline != 0:
            return
        specs = {name: (_plain(spec.annotation.local_slices(rank, spec.shape)),
                        tensors[name].detach().clone())
                 for name, spec in state_specs(config, plan).items() if name in tensors}
        writers = sorted(d for s in plan.pipelines[0].stages for d in s.devices)
        with self._idle:
            self._pending += 1
        self._queue.put((step, rank, writers, specs))

    def _run(self) -> None:
        while True:
            step, rank, writers, specs = self._queue.get()
            try:
                path = step_dir(self.root, step)
                os.makedirs(path, exist_ok=True)
                _atomic_save({"step": step, "tensors": specs},
                             os.path.join(path, f"shard-{rank}.pt"))
                if rank == writers[0]:
                    _atomic_save({"step": step, "shards": [f"shard-{w}.pt" for w in writers]},
                                 os.path.join(path, "manifest.json"), as_json=True)
                    self._prune(step)
            except Exception as exc:  # noqa: BLE001 - reported, never kills training
                self.errors.append(f"checkpoint step {step}: {exc}")
                log.warning("checkpoint of step %d failed: %s", step, exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _prune(self, newest: int) -> None:
        steps = sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(self.root)) if m)
        for step in steps[:-self.keep] if self.keep > 0 else []:
            if step < newest:
                shutil.rmtree(step_dir(self.root, step), ignore_errors=True)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued checkpoint is written; False at the deadline."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)


def load_shards(root: str, step: int, config: ModelConfig, plan: Plan, rank: int,
                stats: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """This rank's local state tensors under ``plan``, read from checkpoint ``step``.

    Lean: shard files are memory-mapped and only the parts that overlap this rank's own slices
    are copied out, so a rank reads about its share of the checkpoint, not whole files or the
    whole model. ``stats["bytes_read"]`` (when given) counts the bytes copied out of the files.
    A slice that no shard covers is a ``CheckpointError`` naming the tensor."""
    path = step_dir(root, step)
    if not _complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete or missing")
    specs = state_specs(config, plan)
    wanted = {name: spec.annotation.local_slices(rank, spec.shape) for name, spec in specs.items()}
    out = {name: torch.empty(tuple(hi - lo for lo, hi in ranges),
                             dtype=getattr(torch, specs[name].dtype))
           for name, ranges in wanted.items() if ranges is not None}
    filled = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in out.items()}
    read = 0
    for shard in _shards(path) or []:
        for name, box, tensor in _read_shard(os.path.join(path, shard), specs, mmap=True):
            if name not in out:
                continue
            mine = wanted[name]
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, mine)]
            if any(lo >= hi for lo, hi in cut):
                continue
            dst = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _d) in zip(cut, mine))
            if bool(filled[name][dst].all()):
                continue  # a replica of what another shard gave already: not read again
            src = tensor[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _b) in zip(cut, box))]
            out[name][dst] = src.to(out[name].dtype)
            filled[name][dst] = True
            read += src.numel() * src.element_size()
    for name, mask in filled.items():
        if not bool(mask.all()):
            raise CheckpointError(f"checkpoint {path} lacks part of tensor {name} "
                                  f"({int((~mask).sum())} element(s) of rank {rank}'s slice)")
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + read
    return out


def _plain(ranges):
    """Index ranges as plain ints (what ``weights_only`` loading accepts)."""
    return None if ranges is None else tuple((int(lo), int(hi)) for lo, hi in ranges)


def _read_shard(file: str, specs: Mapping,
                mmap: bool = False) -> list[tuple[str, tuple, torch.Tensor]]:
    """(name, box, tensor) of every piece in one shard file, each checked against ``specs``
    (the plan's state tensors); loaded with ``weights_only=True``, so it runs no code;
    ``mmap``: the tensors map the file, and only what is copied out of them is read."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
        raise CheckpointError(f"checkpoint shard {file} is not readable as tensors only: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else exc!r}") \
            from None
    tensors = data.get("tensors") if isinstance(data, dict) else None
    if not isinstance(tensors, dict):
        raise CheckpointError(f"checkpoint shard {file} has no tensors table")
    out = []
    for name, piece in tensors.items():
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            continue  # a tensor this plan's model does not have
        ok = isinstance(piece, (tuple, list)) and len(piece) == 2 \
            and isinstance(piece[1], torch.Tensor) and isinstance(piece[0], (tuple, list)) \
            and len(piece[0]) == len(spec.shape)
        box = tuple(tuple(r) for r in piece[0]) if ok else ()
        ok = ok and all(len(r) == 2 and all(type(v) is int for v in r)
                        and 0 <= r[0] <= r[1] <= n for r, n in zip(box, spec.shape))
        if not ok or tuple(piece[1].shape) != tuple(hi - lo for lo, hi in box):
            raise CheckpointError(f"checkpoint shard {file}: tensor {name!r} does not fit the "
                                  f"model's shape {tuple(spec.shape)}")
        out.append((name, box, piece[1]))
    return out
