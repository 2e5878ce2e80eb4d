"""Cleaning up after a dead owner: the cgroups of ``launcher.cgroups`` (CPU) and
``launcher.cgroup_memory`` (memory) whose owner record names a process that is gone.

``sweep_stale`` restores what a dead (SIGKILLed) owner left: cap or limit lifted, processes
moved home, cgroups and records removed; ``release`` (never raises) is how the agent calls it at
its job's end, and ``inject`` before its first fault.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from hspmd_elastic.contract.ids import check_id
from launcher.cgroups import (OWNER_KIND, PREFIX, CgroupError, CgroupUnavailable, Hierarchy,
                              _owner_alive, _procs, _read_record, _rmdir, _set_cap, _State,
                              _subdirs, _unlink, detect, owners_root)

log = logging.getLogger(__name__)


def sweep_stale(job: Optional[str] = None, hierarchy: Optional[Hierarchy] = None,
                owners: Optional[str] = None, kind: str = OWNER_KIND, lift=None) -> list[str]:
    """In the ``hspmd-*`` parents (``hspmd-<job>`` with ``job``): restore and remove the worker
    cgroups of dead owners, remove the empty ones of no known owner, then empty parents; leave a
    live owner's, and one holding processes of no known owner. Returns the cgroups removed.
    ``kind``, ``lift(version, path)``: another controller's owner records and limit lifting."""
    hierarchy = hierarchy if hierarchy is not None else detect()
    owners = owners or owners_root()
    names = [PREFIX + check_id(job, "job id")] if job is not None else \
        [n for n in _subdirs(hierarchy.root) if n.startswith(PREFIX)]
    removed = []
    for name in names:
        parent, records = os.path.join(hierarchy.root, name), os.path.join(owners, name)
        if not os.path.isdir(parent):
            continue
        for child in _subdirs(parent):
            path, rec_path = os.path.join(parent, child), os.path.join(records, child + ".json")
            record = _read_record(rec_path, kind)
            if _owner_alive(record) or (record is None and _procs(path)):
                continue
            try:
                if record is not None:
                    _restore(hierarchy, parent, child, record, lift)
                _rmdir(path)
                _unlink(rec_path)
                removed.append(path)
            except CgroupError as exc:
                log.warning("stale cgroup %s not restored: %s", path, exc)
        try:
            if not _subdirs(parent):
                _rmdir(parent)
                _unlink(records, os.rmdir)
                removed.append(parent)
        except CgroupError as exc:
            log.warning("stale cgroup %s not removed: %s", parent, exc)
    return removed


def _restore(hierarchy: Hierarchy, parent: str, child: str, record: dict, lift=None) -> None:
    """A dead owner's worker cgroup: cap lifted first (then a process that cannot move is at
    least not throttled), every process moved home (the recorded cgroup, else the root)."""
    path, home = os.path.join(parent, child), record.get("home")
    lift(hierarchy.version, path) if lift else _set_cap(hierarchy.version, path, None)
    if not (isinstance(home, str) and os.path.isdir(home) and not home.startswith(parent)):
        home = hierarchy.root
    _State(hierarchy, parent, worker_home={child: home})._empty(child, path)
    log.warning("%s cgroup %s: its owner (pid %s) is gone; limit lifted, processes moved to %s",
                hierarchy.controller, path, record.get("owner_pid"), home)


def release(job: Optional[str] = None) -> list[str]:
    """``sweep_stale`` that never raises (a machine without a usable CPU cgroup has nothing to
    release): the agent calls it at its job's end, ``inject`` before its first fault."""
    try:
        return sweep_stale(job)
    except CgroupUnavailable:
        return []
    except (CgroupError, ValueError, OSError) as exc:
        log.warning("CPU cgroups%s: %s", f" of job {job}" if job else "", exc)
        return []
