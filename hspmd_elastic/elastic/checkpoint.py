"""Periodic, asynchronous checkpoints of the sharded training state, and reading them back under
any plan: the fallback when a switch finds a slice with no live owner.

Layout: ``<dir>/step-<8 digits>/shard-<rank>.pt`` holds one rank's local state tensors with their
global index ranges; ``manifest.json`` lists the shards the step needs; ``shard-<rank>.json``,
written by the shard's own writer right after the shard, is the shard's entry in the manifest:
its size in bytes and its SHA-256, taken at save time. The devices of the plan's first
pipeline write (together they hold one full replica of every state tensor); with uneven optimizer
shards (``Plan.optimizer_shards``) every other device writes its own boxes of the moments too
(each row's moments live on one owner only). Files are written
atomically (``files``: a temporary name, fsync, rename, fsync of the directory), so a reader
never sees half a file, and a failed write leaves no temporary file behind. Writing happens on a
background thread from a copy taken at the step boundary; ``flush`` waits for it with a deadline.

A checkpoint is complete when its manifest, every listed shard and every shard's entry exist
and every shard *verifies*: its size and SHA-256 are the ones its entry recorded (a manifest
of a release before the entries, without ``"format": 2``, is checked as then: every listed
shard exists and is not empty). ``latest_complete`` is the newest complete checkpoint: a newer
one that does not verify (truncated, overwritten, bit rot) is skipped, and the skip is logged
in one line saying which step and why (once per process). A shard's digest is computed once
per process and file identity (device, inode, size, mtime), so a rank that asks again at every
switch hashes each shard once. ``load_shards`` reads a step chosen that way (the agreed one).

A shard holds only tensors, dicts, tuples, ints and strings (``{"step": int, "tensors": {name:
(((lo, hi), ...), tensor)}}``), and is read with ``torch.load(weights_only=True)``: a file
planted in the checkpoint directory cannot run code when read, whatever its age or origin; a
manifest may only name ``shard-<rank>.pt`` files of its own directory, and a shard whose
contents do not fit the plan's tensors is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
from collections import OrderedDict
from typing import Mapping, Optional

import torch

from hspmd_elastic.annotations import BoxAnnotation
from hspmd_elastic.elastic.api import ElasticError
from hspmd_elastic.elastic.agree import NO_STEP
from hspmd_elastic.files import atomic_open, atomic_path
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.graph.zero import is_uneven
from hspmd_elastic.plan import Plan

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{8})$")
_SHARD_RE = re.compile(r"^shard-\d+\.pt$")
MANIFEST_FORMAT = 2  # manifests whose shards have size and digest entries (shard-<rank>.json)
_CHUNK = 1 << 20
_MEMO_KEEP = 4096  # digests remembered per process (file identities), and skip lines logged


class CheckpointError(ElasticError):
    """A checkpoint could not be written or read (names the path)."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def entry_name(shard: str) -> str:
    """The name of a shard's size and digest entry: ``shard-<rank>.json``."""
    return shard[:-len(".pt")] + ".json"


def _atomic_json(obj, path: str) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f)


class _Digests:
    """SHA-256 of files, computed once per file identity (device, inode, size, mtime) in this
    process: shards never change in place (they are replaced by rename, a new inode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: "OrderedDict[tuple, str]" = OrderedDict()

    @staticmethod
    def _key(st: os.stat_result) -> tuple:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def note(self, path: str, digest: str) -> None:
        """Remember ``digest`` for ``path`` as it is now (its writer computed it)."""
        self._put(self._key(os.stat(path)), digest)

    def of(self, path: str, st: os.stat_result) -> str:
        key = self._key(st)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
        self._put(key, h.hexdigest())
        return h.hexdigest()

    def _put(self, key: tuple, digest: str) -> None:
        with self._lock:
            self._memo[key] = digest
            while len(self._memo) > _MEMO_KEEP:
                self._memo.popitem(last=False)


_DIGESTS = _Digests()
_SKIPS_LOGGED: "OrderedDict[str, None]" = OrderedDict()


def latest_complete(root: Optional[str]) -> int:
    """The newest complete checkpoint step under ``root`` (``NO_STEP`` if none): newer ones that
    are incomplete or do not verify are skipped, and said in one line (once per process)."""
    if not root or not os.path.isdir(root):
        return NO_STEP
    steps = sorted((int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(root)) if m),
                   reverse=True)
    skipped: list[tuple[int, str, bool]] = []
    found = NO_STEP
    for step in steps:
        why, corrupt = check_step(step_dir(root, step))
        if not why:
            found = step
            break
        skipped.append((step, why, corrupt))
    if skipped:
        _log_skips(root, skipped, found)
    return found


def _log_skips(root: str, skipped: list[tuple[int, str, bool]], found: int) -> None:
    line = (f"checkpoint {root}: skipped "
            + ", ".join(f"step {step} ({why})" for step, why, _ in skipped)
            + (f"; using step {found}" if found != NO_STEP else "; no checkpoint verifies"))
    if line in _SKIPS_LOGGED:
        return
    _SKIPS_LOGGED[line] = None
    while len(_SKIPS_LOGGED) > _MEMO_KEEP:
        _SKIPS_LOGGED.popitem(last=False)
    # An incomplete newest checkpoint is routine (being written, or a writer died first); one
    # that does not verify is damage an operator should hear about.
    log.log(logging.WARNING if any(c for _, _, c in skipped) else logging.INFO, "%s", line)


def _manifest(path: str) -> tuple[Optional[list[str]], int, str]:
    """``(shards, format, why)``: the shard files ``path``'s manifest lists (None, with why: no
    manifest, an unreadable one, or one naming anything but ``shard-<rank>.pt`` files of its
    own directory) and its format (1: written before shards had entries)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, 0, "no manifest yet"
    except (OSError, ValueError) as exc:
        return None, 0, f"unreadable manifest: {type(exc).__name__}"
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, str) and _SHARD_RE.match(s)
                                               for s in shards):
        return None, 0, "the manifest lists no valid shard names"
    fmt = data.get("format", 1)
    return shards, fmt if isinstance(fmt, int) and not isinstance(fmt, bool) else 0, ""


def _entry(path: str, shard: str) -> Optional[tuple[int, str]]:
    """A shard's (size, sha256) entry; None when missing or malformed."""
    try:
        with open(os.path.join(path, entry_name(shard))) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    size = data.get("size") if isinstance(data, dict) else None
    digest = data.get("sha256") if isinstance(data, dict) else None
    if type(size) is not int or size < 0 or not isinstance(digest, str) \
            or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    return size, digest


def check_step(path: str) -> tuple[str, bool]:
    """Why the checkpoint directory ``path`` cannot be used ("" when it verifies), and whether
    that is damage (True) rather than a checkpoint still being written (False)."""
    shards, fmt, why = _manifest(path)
    if shards is None:
        return why, why != "no manifest yet"
    if fmt not in (1, MANIFEST_FORMAT):
        return f"manifest format {fmt} is not one this release reads", True
    for shard in shards:
        file = os.path.join(path, shard)
        try:
            st = os.stat(file)
        except OSError:
            return f"{shard} is missing", False
        if fmt == 1:  # no entries: as before, a listed shard only has to be there
            if st.st_size == 0:
                return f"{shard} is empty", True
            continue
        entry = _entry(path, shard)
        if entry is None:
            name = entry_name(shard)
            present = os.path.exists(os.path.join(path, name))
            return (f"{name} is unreadable", True) if present else (f"{name} is missing", False)
        size, digest = entry
        if st.st_size != size:
            return f"{shard} is {st.st_size} B, its entry says {size} B", True
        try:
            if _DIGESTS.of(file, st) != digest:
                return f"{shard}'s SHA-256 differs from its entry's", True
        except OSError as exc:
            return f"{shard} is unreadable: {type(exc).__name__}", True
    return "", False


def _shards(path: str) -> Optional[list[str]]:
    return _manifest(path)[0]


def _complete(path: str) -> bool:
    """Every shard the manifest lists exists (what ``load_shards`` needs to start; whether the
    shards verify is ``latest_complete``'s question, asked before the step is chosen)."""
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
        writers = _writers(plan)
        if rank not in writers:
            return
        first = plan.locate(rank).pipeline == 0
        specs = {name: (_plain(spec.annotation.local_slices(rank, spec.shape)),
                        tensors[name].detach().clone())
                 for name, spec in state_specs(config, plan).items()
                 if name in tensors and (first or isinstance(spec.annotation, BoxAnnotation))}
        with self._idle:
            self._pending += 1
        self._queue.put((step, rank, writers, specs))

    def _run(self) -> None:
        while True:
            step, rank, writers, specs = self._queue.get()
            try:
                path = step_dir(self.root, step)
                os.makedirs(path, exist_ok=True)
                shard = f"shard-{rank}.pt"
                size, digest = _save_shard({"step": step, "tensors": specs},
                                           os.path.join(path, shard))
                _atomic_json({"file": shard, "step": step, "size": size, "sha256": digest},
                             os.path.join(path, entry_name(shard)))
                if rank == writers[0]:
                    _atomic_json({"format": MANIFEST_FORMAT, "step": step,
                                  "shards": [f"shard-{w}.pt" for w in writers]},
                                 os.path.join(path, "manifest.json"))
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


def _writers(plan: Plan) -> list[int]:
    """The devices that write a checkpoint of ``plan``: its first pipeline's, and with uneven
    optimizer shards every device (the others' moments have no other copy)."""
    if is_uneven(plan):
        return list(plan.devices)
    return sorted(d for s in plan.pipelines[0].stages for d in s.devices)


def _save_shard(obj, path: str) -> tuple[int, str]:
    """Write one shard (``files.atomic_path``: temporary name, fsync, rename); its size and
    SHA-256, hashed from the temporary file before the rename (so a reader never sees a shard
    without its bytes)."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
        st = os.stat(tmp)
        digest = _DIGESTS.of(tmp, st)
    _DIGESTS.note(path, digest)
    return st.st_size, digest


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
