"""Restart mode's watch over its devices and its workers' heartbeats.

Restart mode runs any torchrun script, so it cannot move state off a failing GPU; what it can
do is restart the job without that GPU. Promises:

* a node has ``--nproc-per-node`` **slots**; slot ``i`` is the ``i``-th entry of the agent's
  ``CUDA_VISIBLE_DEVICES`` (or GPU ``i`` when unset), watched as the health source's device
  of the same number (or the same UUID); ``node_slots`` is pure;
* ``DeviceWatch.refresh`` polls the health source (level-triggered) and publishes its verdicts
  to ``devices/<node>/<index>``; a **fatal** verdict (state ``failed``) takes the slot out for
  the rest of the run (sticky, like the verdict itself); degraded and suspect devices stay
  in (a suspect GPU still computes correctly, and restart mode has no live state to drain);
* once a slot is out, workers get ``CUDA_VISIBLE_DEVICES`` naming only the usable slots
  (``visible``), so local rank ``i`` runs on the ``i``-th usable device and ``LOCAL_WORLD_SIZE``
  and ``WORLD_SIZE`` follow from the smaller count the node joins the next round with;
* ``after_device_loss`` (pure) decides what a loss allows: ``restart`` (at least one usable
  slot), ``leave`` (none, and the other nodes still meet ``--nnodes`` MIN), or ``fail``;
* ``HeartbeatWatch`` feeds the hang detector from the progress files that
  ``hspmd_elastic.heartbeat`` writes; a worker that never wrote one has no hang rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from hspmd_elastic.contract.progress import read_progress
from hspmd_elastic.coord.contract import worker_record
from launcher.health.api import DeviceInfo, HealthSource, Verdict
from launcher.health.progress import Hang
from launcher.node.hangs import ProgressMonitor

log = logging.getLogger(__name__)

RESTART, LEAVE, FAIL = "restart", "leave", "fail"


@dataclass(frozen=True)
class Slot:
    """One worker slot: ``token`` names it in ``CUDA_VISIBLE_DEVICES``; ``index`` is the health
    source's device index."""

    position: int
    token: str
    index: int


def node_slots(count: int, visible: Optional[str],
               devices: Sequence[DeviceInfo] = ()) -> list[Slot]:
    """The node's ``count`` slots (see the module docstring)."""
    tokens = [t.strip() for t in (visible or "").split(",") if t.strip()]
    tokens += [str(i) for i in range(len(tokens), count)]
    known = {d.index for d in devices}
    by_uuid = {d.uuid: d.index for d in devices}
    out = []
    for pos, tok in enumerate(tokens[:count]):
        if tok.isdigit() and int(tok) in known:
            index = int(tok)
        else:
            index = by_uuid.get(tok, pos)
        out.append(Slot(pos, tok, index))
    return out


def after_device_loss(usable: int, participants: int, min_nodes: int) -> str:
    """``restart`` with the usable slots, ``leave`` the job to the other nodes, or ``fail``."""
    if usable >= 1:
        return RESTART
    if participants - 1 >= min_nodes and participants > 1:
        return LEAVE
    return FAIL


class DeviceWatch:
    """The slots' health in restart mode (see the module docstring). ``publish``: called with
    the source's verdicts on every refresh (the ``VerdictPublisher``); None: not published."""

    def __init__(self, source: HealthSource, slots: Sequence[Slot],
                 publish: Optional[Callable[[Mapping[int, Verdict]], object]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.source, self.slots = source, list(slots)
        self._publish, self._clock = publish, clock
        self.failed: dict[int, Verdict] = {}  # slot position -> the fatal verdict

    def refresh(self) -> list[Slot]:
        """Poll the source; the slots that failed since the last refresh."""
        verdicts = self.source.poll(self._clock())
        if self._publish is not None and verdicts:
            self._publish(verdicts)
        new = []
        for slot in self.slots:
            v = verdicts.get(slot.index)
            if v is not None and v.is_failed and slot.position not in self.failed:
                self.failed[slot.position] = v
                new.append(slot)
        return new

    def usable(self) -> list[Slot]:
        return [s for s in self.slots if s.position not in self.failed]

    def out(self) -> list[Slot]:
        return [s for s in self.slots if s.position in self.failed]

    def visible(self) -> Optional[list[str]]:
        """``CUDA_VISIBLE_DEVICES`` for the workers: None while every slot is usable."""
        return [s.token for s in self.usable()] if self.failed else None

    def running(self, count: int) -> list[Slot]:
        """The slots ``count`` workers run on: the usable ones first (a slot that failed after
        the node joined its round is still listed, so the next check sees it)."""
        return (self.usable() + self.out())[:count]

    def root_cause(self, slots: Sequence[Slot]) -> str:
        """One line naming the failed devices and their verdicts."""
        parts = [f"GPU {s.token} {self.failed[s.position].describe()}" for s in slots
                 if s.position in self.failed]
        return "; ".join(parts) or "no failed device"


class HeartbeatWatch:
    """Restart mode's hang rule: the workers' progress files (``HSPMD_PROGRESS_FILE``) fed to
    a ``ProgressMonitor``. Only workers that called ``hspmd_elastic.heartbeat`` are watched."""

    def __init__(self, monitor: ProgressMonitor):
        self.monitor = monitor
        self.paths: dict[int, str] = {}

    def watch(self, paths: Mapping[int, str]) -> None:
        """New workers (a new round): their progress files by local rank."""
        self.paths = dict(paths)
        self.monitor.observe({})

    def check(self, pids: Mapping[int, int]) -> list[Hang]:
        """Read the files of the live workers (``pids``: local rank -> pid); new hangs."""
        records = {}
        for lr, pid in pids.items():
            report = read_progress(self.paths[lr], lr) if lr in self.paths else None
            if report is not None and report.pid == pid:
                records[lr] = worker_record(report)
        self.monitor.observe(records)
        return self.monitor.new_hangs()
