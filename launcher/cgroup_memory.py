"""Memory cgroups per worker: a declared device memory (``--hspmd-device-memory``) made real on a
CPU, where the kernel's OOM killer ends a worker that goes over it (``--hspmd-enforce-memory``).

A worker's cgroup is ``hspmd-<job>/<node>-<local_rank>`` (``cgroups.worker_cgroup``) at the root
of the hierarchy with the ``memory`` controller, which may be mounted apart from ``cpu``::

    /sys/fs/cgroup/memory/hspmd-<job>/<node>-<local_rank>   cgroup v1: memory.limit_in_bytes
                                                            (and memory.memsw.limit_in_bytes)
    <cgroup2 mount>/hspmd-<job>/<node>-<local_rank>         cgroup v2: memory.max (swap.max 0)

Promises:

* the limit is the declared device memory plus the worker's resident baseline (``MemoryLimit``:
  the interpreter, ``import torch``, ``hspmd_elastic`` and a gloo process group, which are not
  device memory), rounded up to a page; ``measure_baseline`` measures that baseline once per
  agent (per Python executable) as the peak RSS of a probe process that does exactly that, so
  the limit never kills a worker for the wrong reason;
* with swap, the swap limit is the same (v1 ``memsw``) or zero (v2), so going over it is an OOM
  kill, not swapping; the kill is counted in the group (``oom_kill`` in v1
  ``memory.oom_control``, v2 ``memory.events``): ``oom_kills`` reads it;
* ``MemoryLimits(job)`` is the one place that makes memory cgroups, with ``cgroups``' design:
  an owner record (kind ``memory_cgroup_owner``, under ``owners_root()/memory``) before the
  cgroup, ``close`` moves what is left back and removes every cgroup, a finalizer closes what
  was not closed, ``sweep_stale_memory`` restores what a dead owner left and ``release_memory``
  (never raises) is how the agent calls it at its job's end;
* bad input (a limit that is not a positive number of bytes) is a ``ValueError`` naming it; a
  machine without a writable memory controller is ``CgroupUnavailable`` saying why, one line.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from launcher.cgroups import (
    MOUNTS,
    CgroupError,
    CgroupUnavailable,
    Hierarchy,
    JobCgroups,
    ProcessGone,
    _read,
    _write,
    home_of,
    make_dir,
    mount_points,
    owners_root,
)
from launcher.cgroup_sweep import sweep_stale

log = logging.getLogger(__name__)

OWNER_KIND = "memory_cgroup_owner"
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
BASELINE_TIMEOUT_S = 120.0  # the probe imports torch: slow on a busy machine, never forever
# What a worker holds before it builds a model: interpreter, torch, hspmd_elastic, gloo.
_PROBE = (
    "import resource, torch, torch.distributed as dist, hspmd_elastic.runtime\n"
    "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
    "t = torch.ones(1 << 10); dist.all_reduce(t); dist.destroy_process_group()\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"  # KiB on Linux
)


def mib(size: int) -> str:
    """``size`` bytes as MiB for messages (``256 MiB``, ``1.5 MiB``)."""
    return f"{size / MIB:.4g} MiB"


@dataclass(frozen=True)
class MemoryLimit:
    """A worker's memory limit: its declared device memory plus its resident baseline."""

    declared: int  # bytes: --hspmd-device-memory
    baseline: int  # bytes: the worker's resident baseline (measure_baseline)

    @property
    def limit(self) -> int:
        """The bytes written to the cgroup: the sum, rounded up to a page."""
        return -(-(self.declared + self.baseline) // PAGE) * PAGE

    def describe(self) -> str:
        return f"{mib(self.limit)} (declared {mib(self.declared)} + {mib(self.baseline)} baseline)"


def memory_limit(declared: object, baseline: object) -> MemoryLimit:
    """``MemoryLimit`` of ``declared`` (> 0) and ``baseline`` (>= 0) bytes; ``ValueError``
    naming a bad one."""
    for name, value, low in (("declared device memory", declared, 1),
                             ("memory baseline", baseline, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} {value!r} is not valid: use an integer number of bytes "
                             f">= {low}")
    return MemoryLimit(declared, baseline)  # type: ignore[arg-type]


def parse_oom_kills(text: str) -> int:
    """Pure: the ``oom_kill`` count of a v1 ``memory.oom_control`` or v2 ``memory.events``."""
    for line in text.splitlines():
        name, _, number = line.partition(" ")
        if name == "oom_kill" and number.strip().isdigit():
            return int(number)
    return 0


# ----------------------------------------------------------------------------------- detection
def _why_not(version: int, root: str) -> str:
    if version == 1:
        missing = [f for f in ("memory.limit_in_bytes", "memory.oom_control", "cgroup.procs")
                   if not os.path.exists(os.path.join(root, f))]
        if missing:
            return f"cgroup v1 memory at {root} has no {missing[0]}"
    else:
        try:
            controllers = _read(os.path.join(root, "cgroup.controllers")).split()
            enabled = _read(os.path.join(root, "cgroup.subtree_control")).split()
        except CgroupError as exc:
            return f"cgroup v2 at {root}: {exc}"
        for have, where in ((controllers, "offer"), (enabled, "enable for its children")):
            if "memory" not in have:
                return f"cgroup v2 at {root} does not {where} the memory controller"
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "cgroup.procs"),
                                                     os.W_OK):
        return f"cgroup v{version} memory at {root} is not writable by this user " \
               f"(uid {os.getuid()})"
    return ""


def detect_memory(mounts_text: Optional[str] = None) -> Hierarchy:
    """The usable memory cgroup hierarchy of this machine (v1 first); ``CgroupUnavailable``
    saying why there is none. ``mounts_text``: a ``/proc/mounts`` text (default: this
    process's)."""
    v1, v2 = mount_points(_read(MOUNTS) if mounts_text is None else mounts_text, "memory")
    why = []
    for version, root in ((1, v1), (2, v2)):
        if root is None:
            why.append(f"no cgroup v{version} {'memory controller ' if version == 1 else ''}"
                       "mounted")
            continue
        problem = _why_not(version, root)
        if not problem:
            return Hierarchy(version, root, "memory")
        why.append(problem)
    raise CgroupUnavailable("no writable memory cgroup on this machine: " + "; ".join(why))


# ------------------------------------------------------------------------------------ baseline
@functools.lru_cache(maxsize=None)
def measure_baseline(python: str = sys.executable, timeout: float = BASELINE_TIMEOUT_S) -> int:
    """A worker's resident baseline in bytes on this machine: the peak RSS of ``python`` after
    it imports torch and ``hspmd_elastic.runtime`` and runs a one-rank gloo process group
    (measured once per ``python``; ``CgroupError`` in one line when the probe fails)."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                             timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CgroupError(f"cannot measure the worker memory baseline with {python}: {exc}") \
            from None
    lines = out.stdout.split()
    if out.returncode != 0 or not lines or not lines[-1].isdigit():
        why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise CgroupError(f"cannot measure the worker memory baseline with {python}: {why}")
    return int(lines[-1])


# ---------------------------------------------------------------------------------- the limits
def _set_limit(version: int, child: str, limit: Optional[int]) -> None:
    """Write (or lift: None) the limit; the swap limit follows it (v1 ``memsw`` >= limit)."""
    value = "-1" if limit is None and version == 1 else "max" if limit is None else str(limit)
    if version == 1:
        memsw = os.path.join(child, "memory.memsw.limit_in_bytes")
        if limit is None and os.path.exists(memsw):
            _write(memsw, value)  # first: memsw may not go below the limit
        _write(os.path.join(child, "memory.limit_in_bytes"), value)
        if limit is not None and os.path.exists(memsw):
            _write(memsw, value)
        return
    _write(os.path.join(child, "memory.max"), value)
    if os.path.exists(os.path.join(child, "memory.swap.max")):
        _write(os.path.join(child, "memory.swap.max"), "max" if limit is None else "0")


def _lift(version: int, child: str) -> None:
    _set_limit(version, child, None)


class MemoryLimits(JobCgroups):
    """The memory cgroups of one job on this machine: ``place`` a proven process of the job
    under a ``MemoryLimit``, read ``oom_kills``, ``close`` (also a context manager)."""

    WHAT = "memory"

    def __init__(self, job: str, hierarchy: Optional[Hierarchy] = None,
                 owners: Optional[str] = None):
        super().__init__(job, hierarchy if hierarchy is not None else detect_memory(),
                         owners or memory_owners(), kind=OWNER_KIND)

    def prepare(self, name: str, limit: MemoryLimit, home: Optional[str] = None) -> str:
        """Make the worker cgroup ``name`` with ``limit`` before its worker exists (``home``:
        where its processes go back to, default this process's cgroup); returns the path of
        its ``cgroup.procs``, which the worker writes its pid to before its own code runs."""
        child = self.path(name)
        with self._state.lock:
            self._armed()
            make_dir(self.parent)
            if self.hierarchy.version == 2:
                enabled = _read(os.path.join(self.parent, "cgroup.subtree_control")).split()
                if "memory" not in enabled:
                    _write(os.path.join(self.parent, "cgroup.subtree_control"), "+memory")
            self._state.worker_home.setdefault(
                name, home or home_of(self.hierarchy, self.parent, os.getpid()))
            self._state.record(name, self.job)  # before the cgroup: a SIGKILL leaves its owner
            make_dir(child)
            _set_limit(self.hierarchy.version, child, limit.limit)
        return os.path.join(child, "cgroup.procs")

    def place(self, name: str, pid: int, limit: MemoryLimit) -> str:
        """Limit process ``pid`` (one the caller started for the job) to ``limit`` in the worker
        cgroup ``name`` (made by ``prepare`` when it was not); returns its directory.
        ``ProcessGone`` when it exited."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise ValueError(f"pid {pid!r} is not a process a job can own")
        child = self.path(name)
        with self._state.lock:
            self.prepare(name, limit, home_of(self.hierarchy, self.parent, pid))
            self._state.homes.setdefault(pid, self._state.worker_home[name])
            try:
                self._state.move(pid, child)
            except ProcessGone:
                self._state.homes.pop(pid, None)
                raise
        log.info("[%s] pid %d limited to %s in %s", self.job, pid, limit.describe(), child)
        return child

    def limit(self, name: str) -> Optional[int]:
        """The limit of the worker cgroup ``name`` in bytes (None: no limit)."""
        if self.hierarchy.version == 1:
            value = int(_read(os.path.join(self.path(name), "memory.limit_in_bytes")))
            return None if value >= (1 << 62) else value
        text = _read(os.path.join(self.path(name), "memory.max")).strip()
        return None if text == "max" else int(text)

    def oom_kills(self, name: str) -> int:
        """How many processes the OOM killer ended in the worker cgroup ``name`` (0 when it is
        gone)."""
        stat = "memory.oom_control" if self.hierarchy.version == 1 else "memory.events"
        path = os.path.join(self.path(name), stat)
        return parse_oom_kills(_read(path)) if os.path.exists(path) else 0

    def pids(self, name: str) -> list[int]:
        return [int(x) for x in _read(os.path.join(self.path(name), "cgroup.procs")).split()]

def memory_owners() -> str:
    """Where the owner records of every job's memory cgroups live on this machine."""
    return os.path.join(owners_root(), "memory")


def sweep_stale_memory(job: Optional[str] = None, hierarchy: Optional[Hierarchy] = None,
                       owners: Optional[str] = None) -> list[str]:
    """``cgroup_sweep.sweep_stale`` for the memory cgroups: a dead owner's limit lifted, processes
    home, cgroups removed; returns the cgroups removed."""
    return sweep_stale(job, hierarchy if hierarchy is not None else detect_memory(),
                       owners or memory_owners(), OWNER_KIND, _lift)


def release_memory(job: Optional[str] = None) -> list[str]:
    """``sweep_stale_memory`` that never raises (nothing to release without a memory cgroup)."""
    try:
        return sweep_stale_memory(job)
    except CgroupUnavailable:
        return []
    except (CgroupError, ValueError, OSError) as exc:
        log.warning("memory cgroups%s: %s", f" of job {job}" if job else "", exc)
        return []
