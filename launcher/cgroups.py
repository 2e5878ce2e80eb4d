"""CPU cgroups per worker: a CFS quota makes "a device at a quarter speed" really a quarter of a
core, for the tests, the benchmarks and the fault-injection harness (``throttle``).

The cgroups of a job live under one parent named after it, ``hspmd-<job>``, at the root of the
hierarchy that has the ``cpu`` controller, with one child per worker, ``<node>-<local_rank>``
(``worker_cgroup``)::

    /sys/fs/cgroup/cpu/hspmd-<job>/<node>-<local_rank>    cgroup v1: cpu.cfs_period_us,
                                                           cpu.cfs_quota_us (-1: no cap)
    <cgroup2 mount>/hspmd-<job>/<node>-<local_rank>        cgroup v2: cpu.max ("max 100000")

``detect`` finds the hierarchy from ``/proc/self/mounts``: a v1 ``cpu`` controller mounted and
writable (``cpu.cfs_quota_us``), else a writable cgroup2 mount that offers ``cpu`` in its
``cgroup.controllers`` and enables it in its ``cgroup.subtree_control``; ``available`` says which,
or why none, in one line.

Promises:

* ``CpuQuota(job)`` is the one place that makes CPU cgroups; its caller puts in only processes it
  proved are the job's (the inject harness proves workers: ``inject.targets.find_worker``);
* ``place`` validates first: a fraction of a core outside ``(0, cores]``, not finite, or below
  the kernel's 1 ms quota raises ``ValueError`` (one line naming it) and touches nothing; the
  period is ``PERIOD_US`` unless the ``CpuQuota`` names another; writing the pid to
  ``cgroup.procs`` moves its whole thread group, and the processes it forks later stay with it;
* ``close`` moves every process found in the job's cgroups back to the cgroup it came from (a
  forked child goes where its worker came from; the root when that is gone), then removes the
  children and the parent; it is idempotent, a process that already exited is no error, and a
  finalizer runs it when the object is collected or the interpreter exits;
* no cgroup without its owner on record: ``place`` first writes ``<owners_root()>/hspmd-<job>/
  <child>.json`` (the owner's pid and start time, the worker's home; a cgroup file system takes
  no file of ours), ``close`` removes it; ``cgroup_sweep.sweep_stale`` restores what a dead
  (SIGKILLed) owner left: cap lifted, processes home, cgroup removed;
  ``cgroup_sweep.release`` (never raises) is how the agent calls it at its job's end, and
  ``inject`` before its first fault;
* every error of the file system is a ``CgroupError`` with one line naming the file;
  ``ProcessGone`` when the process to move has exited; no call blocks for more than
  ``RMDIR_TIMEOUT_S``. Memory limits per worker (``launcher.cgroup_memory``) share all this.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

from hspmd_elastic.contract.ids import check_id
from hspmd_elastic.files import atomic_write

log = logging.getLogger(__name__)

PREFIX = "hspmd-"
PERIOD_US = 100_000  # 100 ms: the CFS period of every worker cgroup
MIN_QUOTA_US = 1_000  # the kernel refuses a quota below 1 ms
MOUNTS = "/proc/self/mounts"
RMDIR_TIMEOUT_S = 2.0  # a cgroup whose last process is leaving can be busy for a moment
OWNERS_DIR = "/run/hspmd-cgroups"  # a tmpfs, emptied at boot like the cgroups themselves
OWNER_KIND = "cpu_cgroup_owner"


class CgroupError(RuntimeError):
    """A cgroup file could not be read or written (one line naming it)."""


class CgroupUnavailable(CgroupError):
    """This machine has no usable cgroup of the controller asked for (one line saying why)."""


class ProcessGone(CgroupError):
    """The process to move into a cgroup has exited."""


@dataclass(frozen=True)
class Hierarchy:
    """The cgroup hierarchy with the ``controller`` (``cpu`` or ``memory``): ``version`` 1 or
    2, mounted at ``root`` (where the ``hspmd-<job>`` parents are made)."""

    version: int
    root: str
    controller: str = "cpu"

    def describe(self) -> str:
        return f"cgroup v{self.version} {self.controller} controller at {self.root}"


@dataclass(frozen=True)
class CpuStat:
    """A cgroup's ``cpu.stat``: CFS periods elapsed, periods it was throttled in, and for how
    long in all (seconds)."""

    nr_periods: int
    nr_throttled: int
    throttled_s: float


# ---------------------------------------------------------------------------------- pure parts
def mount_points(mounts_text: str, controller: str = "cpu") -> tuple[Optional[str], Optional[str]]:
    """Pure: ``(v1 mount with the controller, cgroup2 mount)`` of a ``/proc/mounts`` text
    (None where there is none)."""
    v1 = v2 = None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        path, fstype, options = parts[1].replace("\\040", " "), parts[2], parts[3].split(",")
        if fstype == "cgroup" and controller in options and v1 is None:
            v1 = path
        elif fstype == "cgroup2" and v2 is None:
            v2 = path
    return v1, v2


def check_fraction(fraction: object, cores: int, period_us: int = PERIOD_US) -> float:
    """``fraction`` (of one core) as a float, when it is finite, in ``(0, cores]`` and gives a
    quota of at least ``MIN_QUOTA_US``; ``ValueError`` naming it otherwise."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    value = float(fraction) if ok else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(value) and 0 < value <= cores):
        raise ValueError(f"cpu fraction {fraction!r} is not valid: use a number in (0, {cores}] "
                         f"(the share of one core; this machine has {cores})")
    if round(value * period_us) < MIN_QUOTA_US:
        raise ValueError(f"cpu fraction {fraction!r} is too small: the quota would be below the "
                         f"kernel's {MIN_QUOTA_US} us per {period_us} us period (use >= "
                         f"{MIN_QUOTA_US / period_us:g})")
    return value


def quota_us(fraction: float, period_us: int = PERIOD_US) -> int:
    """The CFS quota (microseconds per period) that caps a process at ``fraction`` of a core."""
    return int(round(fraction * period_us))


def parse_cpu_stat(text: str) -> CpuStat:
    """Pure: a ``cpu.stat`` text (v1: ``throttled_time`` in ns; v2: ``throttled_usec``)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, number = line.partition(" ")
        if number.strip().lstrip("-").isdigit():
            values[name] = int(number)
    throttled = values["throttled_usec"] / 1e6 if "throttled_usec" in values else \
        values.get("throttled_time", 0) / 1e9
    return CpuStat(values.get("nr_periods", 0), values.get("nr_throttled", 0), throttled)


def parse_quota(text: str, version: int) -> tuple[Optional[int], int]:
    """Pure: ``(quota_us or None for no cap, period_us)`` of a v2 ``cpu.max`` text, or (v1) of
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` joined by a space."""
    quota, period = text.split()
    if version == 1:
        return (None if int(quota) < 0 else int(quota)), int(period)
    return (None if quota == "max" else int(quota)), int(period)


def worker_cgroup(node: str, local_rank: int) -> str:
    """The name of a worker's cgroup under its job's parent: ``<node>-<local_rank>``."""
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local rank {local_rank!r} is not valid: use an integer >= 0")
    return f"{check_id(node, 'node id')}-{local_rank}"


def cgroup_of(proc_cgroup_text: str, version: int, controller: str = "cpu") -> Optional[str]:
    """Pure: the path (relative to the hierarchy's root) of the cgroup a ``/proc/<pid>/cgroup``
    text puts the process in, in the v1 hierarchy of ``controller`` or the v2 one."""
    for line in proc_cgroup_text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == 2 and hid == "0" and controllers == "":
            return path
        if version == 1 and controller in controllers.split(","):
            return path
    return None


# ----------------------------------------------------------------------------------- detection
def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise CgroupError(f"cannot read {path}: {exc.strerror or exc}") from None


def _write(path: str, value: str) -> None:
    """One ``write(2)`` (a cgroup file takes one value per write; errors come from it)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        raise CgroupError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        os.write(fd, value.encode("ascii"))
    except ProcessLookupError:
        raise ProcessGone(f"process {value} is gone (writing {path})") from None
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _why_not_v1(root: str) -> str:
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
        if not os.path.exists(os.path.join(root, name)):
            return f"cgroup v1 cpu at {root} has no {name}"
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "cgroup.procs"),
                                                     os.W_OK):
        return f"cgroup v1 cpu at {root} is not writable by this user (uid {os.getuid()})"
    return ""


def _why_not_v2(root: str) -> str:
    try:
        controllers = _read(os.path.join(root, "cgroup.controllers")).split()
        enabled = _read(os.path.join(root, "cgroup.subtree_control")).split()
    except CgroupError as exc:
        return f"cgroup v2 at {root}: {exc}"
    if "cpu" not in controllers:
        return f"cgroup v2 at {root} does not offer the cpu controller (cgroup.controllers: " \
               f"{' '.join(controllers) or 'none'})"
    if "cpu" not in enabled:
        return f"cgroup v2 at {root} does not enable cpu for its children (cgroup." \
               f"subtree_control: {' '.join(enabled) or 'none'})"
    if not os.access(root, os.W_OK):
        return f"cgroup v2 at {root} is not writable by this user (uid {os.getuid()})"
    return ""


def detect(mounts_text: Optional[str] = None) -> Hierarchy:
    """The usable CPU cgroup hierarchy of this machine (v1 first); ``CgroupUnavailable`` saying
    why there is none. ``mounts_text``: a ``/proc/mounts`` text (default: this process's)."""
    text = _read(MOUNTS) if mounts_text is None else mounts_text
    v1, v2 = mount_points(text)
    why = []
    for version, root, check in ((1, v1, _why_not_v1), (2, v2, _why_not_v2)):
        if root is None:
            why.append(f"no cgroup v{version} {'cpu controller ' if version == 1 else ''}"
                       f"mounted")
            continue
        problem = check(root)
        if not problem:
            return Hierarchy(version, root)
        why.append(problem)
    raise CgroupUnavailable("no usable CPU cgroup on this machine: " + "; ".join(why))


def available(mounts_text: Optional[str] = None) -> tuple[Optional[Hierarchy], str]:
    """``(hierarchy, one line saying which)`` or ``(None, one line saying why none)``."""
    try:
        found = detect(mounts_text)
    except CgroupError as exc:
        return None, str(exc)
    return found, found.describe()


# ------------------------------------------------------------------------------- owner records
def owners_root() -> str:
    """Where the owner records of every job's cgroups live on this machine."""
    return OWNERS_DIR


def process_start(pid: int) -> Optional[int]:
    """The start time of ``pid`` (clock ticks since boot: field 22 of ``/proc/<pid>/stat``), so
    that a reused pid is not taken for its owner; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()  # fields[0] is field 3, the state
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else int(fields[19])


def _owner_alive(record: Optional[dict]) -> bool:
    pid = record.get("owner_pid") if record is not None else None
    return isinstance(pid, int) and pid > 0 and process_start(pid) == record.get("owner_start")


def _read_record(path: str, kind: str = OWNER_KIND) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        record = None
    return record if isinstance(record, dict) and record.get("kind") == kind else None


def _unlink(path: str, remove=os.unlink) -> None:
    try:
        remove(path)
    except OSError:
        pass  # gone already, or (a directory) still holding another owner's records


def _set_cap(version: int, child: str, fraction: Optional[float],
             period_us: int = PERIOD_US) -> None:
    if version == 1:
        _write(os.path.join(child, "cpu.cfs_period_us"), str(period_us))
        _write(os.path.join(child, "cpu.cfs_quota_us"),
               "-1" if fraction is None else str(quota_us(fraction, period_us)))
    else:
        _write(os.path.join(child, "cpu.max"),
               f"{'max' if fraction is None else quota_us(fraction, period_us)} {period_us}")


# ------------------------------------------------------------------------------------ the quota
def _subdirs(path: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CgroupError(f"cannot list {path}: {exc.strerror or exc}") from None


def _procs(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), encoding="ascii") as fh:
            return [int(x) for x in fh.read().split()]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CgroupError(f"cannot read {cgroup}/cgroup.procs: {exc.strerror or exc}") from None


def _rmdir(path: str, timeout: float = RMDIR_TIMEOUT_S) -> None:
    """Remove an (empty of processes) cgroup; gone already is fine; busy is retried a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise CgroupError(f"cannot remove {path}: {exc.strerror or exc}") from None
        threading.Event().wait(0.01)


@dataclass
class _State:
    """What ``CpuQuota`` (or ``MemoryLimits``) made (apart, so that a finalizer can clean up)."""

    hierarchy: Hierarchy
    parent: str
    owners: str = "/nonexistent"  # the directory of this parent's owner records
    kind: str = OWNER_KIND  # of the owner records
    homes: dict[int, str] = field(default_factory=dict)  # pid -> the cgroup it came from
    worker_home: dict[str, str] = field(default_factory=dict)  # child name -> its worker's
    lock: threading.RLock = field(default_factory=threading.RLock)

    def move(self, pid: int, cgroup: str) -> None:
        _write(os.path.join(cgroup, "cgroup.procs"), str(pid))

    def record(self, name: str, job: str) -> None:
        """Write the owner record of child ``name`` (this process), atomically."""
        path = os.path.join(self.owners, name + ".json")
        body = {"schema": 1, "kind": self.kind, "job": job, "cgroup": name,
                "owner_pid": os.getpid(), "owner_start": process_start(os.getpid()),
                "home": self.worker_home.get(name, self.hierarchy.root)}
        try:
            os.makedirs(self.owners, exist_ok=True)
            atomic_write(path, json.dumps(body))  # temporary file, fsync, rename
        except OSError as exc:
            raise CgroupError(f"cannot write the owner record {path}: "
                              f"{exc.strerror or exc}") from None

    def close(self) -> None:
        """Every process back where it came from; children, then the parent, removed."""
        with self.lock:
            problems = []
            for name in _subdirs(self.parent):
                child = os.path.join(self.parent, name)
                try:
                    self._empty(name, child)
                    _rmdir(child)
                    _unlink(os.path.join(self.owners, name + ".json"))
                except CgroupError as exc:
                    problems.append(str(exc))
            try:
                _rmdir(self.parent)
                _unlink(self.owners, os.rmdir)
            except CgroupError as exc:
                problems.append(str(exc))
            if problems:
                raise CgroupError(f"cleaning up {self.parent}: " + "; ".join(problems))
            self.homes.clear()
            self.worker_home.clear()

    def _empty(self, name: str, child: str) -> None:
        deadline = time.monotonic() + RMDIR_TIMEOUT_S
        while True:
            pids = _procs(child)
            if not pids:
                return
            for pid in pids:  # a process forked there goes where its worker came from
                home = self.homes.get(pid, self.worker_home.get(name, self.hierarchy.root))
                try:
                    try:
                        self.move(pid, home)
                    except CgroupError as exc:
                        if isinstance(exc, ProcessGone) or home == self.hierarchy.root:
                            raise
                        self.move(pid, self.hierarchy.root)  # its old cgroup is gone
                except ProcessGone:
                    pass  # exited meanwhile
                self.homes.pop(pid, None)
            if time.monotonic() >= deadline:
                raise CgroupError(f"processes {pids} keep reappearing in {child}")


class JobCgroups:
    """The cgroups of one job under one controller's hierarchy, ``<root>/hspmd-<job>/<child>``,
    with their owner records (``kind``) under ``owners``: what ``CpuQuota`` and
    ``cgroup_memory.MemoryLimits`` share. ``close`` (also a context manager; a finalizer closes
    what was not closed) moves every process back and removes every cgroup of the job."""

    WHAT = "CPU"  # for the finalizer's warning

    def __init__(self, job: str, hierarchy: Hierarchy, owners: str, kind: str = OWNER_KIND):
        self.job = check_id(job, "job id")
        self.hierarchy = hierarchy
        self.parent = os.path.join(hierarchy.root, PREFIX + self.job)
        self._state = _State(hierarchy, self.parent, os.path.join(owners, PREFIX + self.job),
                             kind=kind)
        self._finalizer = weakref.finalize(self, _finalize, self._state, self.WHAT)

    def _armed(self) -> None:
        """A finalizer for what is made next (placed again after a ``close``)."""
        if not self._finalizer.alive:
            self._finalizer = weakref.finalize(self, _finalize, self._state, self.WHAT)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, name: str) -> str:
        """The directory of the worker cgroup ``name`` (``worker_cgroup(node, local_rank)``)."""
        return os.path.join(self.parent, check_id(name, "worker cgroup name"))

    def placed(self) -> list[str]:
        """The worker cgroups there are now."""
        return _subdirs(self.parent)

    def close(self) -> None:
        """Move every process back, remove every cgroup of the job (idempotent)."""
        self._state.close()
        self._finalizer.detach()  # nothing left for it (and never another object's cgroups)


class CpuQuota(JobCgroups):
    """The CPU cgroups of one job on this machine (one ``CpuQuota`` per job and machine):
    ``place`` a proven process of the job under a quota, ``set`` or lift it, read ``stat``, and
    ``close`` (``JobCgroups``). ``period_us``: the CFS period (``PERIOD_US`` unless given); a
    shorter one makes a capped process wait less at a time between its runs, closer to a device
    that is slow all along than to a fast one that stops (its messages then wait up to
    ``(1 - fraction) x period`` for it)."""

    def __init__(self, job: str, hierarchy: Optional[Hierarchy] = None,
                 cores: Optional[int] = None, owners: Optional[str] = None,
                 period_us: int = PERIOD_US):
        super().__init__(job, hierarchy if hierarchy is not None else detect(),
                         owners or owners_root())
        self.cores = cores if cores is not None else (os.cpu_count() or 1)
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"period_us={period_us!r} must be in [1000, 1000000]")
        self.period_us = period_us

    def place(self, name: str, pid: int, fraction: float) -> str:
        """Cap process ``pid`` (one the caller proved is the job's) at ``fraction`` of a core in
        the worker cgroup ``name``; returns its directory. ``ProcessGone`` when it exited."""
        fraction = check_fraction(fraction, self.cores, self.period_us)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise ValueError(f"pid {pid!r} is not a process a job can own")
        child = self.path(name)
        with self._state.lock:
            self._armed()
            self._mkdir(self.parent)
            if self.hierarchy.version == 2:
                enabled = _read(os.path.join(self.parent, "cgroup.subtree_control")).split()
                if "cpu" not in enabled:
                    _write(os.path.join(self.parent, "cgroup.subtree_control"), "+cpu")
            if pid not in self._state.homes:
                self._state.homes[pid] = home_of(self.hierarchy, self.parent, pid)
            self._state.worker_home.setdefault(name, self._state.homes[pid])
            self._state.record(name, self.job)  # before the cgroup: a SIGKILL leaves its owner
            self._mkdir(child)
            self._limit(child, fraction)
            try:
                self._state.move(pid, child)
            except ProcessGone:
                self._state.homes.pop(pid, None)
                raise
        log.info("[%s] pid %d capped at %g of a core in %s", self.job, pid, fraction, child)
        return child

    def set(self, name: str, fraction: Optional[float]) -> None:
        """Change the cap of the worker cgroup ``name`` (a fraction of a core), or lift it
        (None)."""
        if fraction is not None:
            fraction = check_fraction(fraction, self.cores, self.period_us)
        child = self.path(name)
        with self._state.lock:
            if not os.path.isdir(child):
                raise CgroupError(f"no worker cgroup {name} in {self.parent} (place it first)")
            self._limit(child, fraction)
        log.info("[%s] %s: %s", self.job, child,
                 "cap lifted" if fraction is None else f"capped at {fraction:g} of a core")

    def quota(self, name: str) -> Optional[float]:
        """The cap of the worker cgroup ``name`` as a fraction of a core (None: no cap)."""
        child = self.path(name)
        if self.hierarchy.version == 1:
            text = " ".join(_read(os.path.join(child, f)).strip()
                            for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        else:
            text = _read(os.path.join(child, "cpu.max"))
        quota, period = parse_quota(text, self.hierarchy.version)
        return None if quota is None else quota / period

    def stat(self, name: str) -> CpuStat:
        """The worker cgroup's ``cpu.stat``: how often its cap bit."""
        return parse_cpu_stat(_read(os.path.join(self.path(name), "cpu.stat")))

    def pids(self, name: str) -> list[int]:
        """The processes in the worker cgroup ``name``."""
        return _procs(self.path(name))

    # ------------------------------------------------------------------------------ helpers
    def _mkdir(self, path: str) -> None:
        make_dir(path)

    def _limit(self, child: str, fraction: Optional[float]) -> None:
        _set_cap(self.hierarchy.version, child, fraction, self.period_us)


def home_of(hierarchy: Hierarchy, parent: str, pid: int) -> str:
    """The cgroup ``pid`` is in (the root when unknown, or in ``parent``: not cleaned up)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            rel = cgroup_of(fh.read(), hierarchy.version, hierarchy.controller)
    except FileNotFoundError:
        raise ProcessGone(f"process {pid} is gone") from None
    except OSError as exc:
        raise CgroupError(f"cannot read /proc/{pid}/cgroup: {exc.strerror or exc}") from None
    home = os.path.normpath(os.path.join(hierarchy.root, (rel or "/").lstrip("/")))
    return hierarchy.root if home == parent or home.startswith(parent + os.sep) else home


def make_dir(path: str) -> None:
    """``mkdir`` that leaves an existing directory be; any other failure is a ``CgroupError``."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CgroupError(f"cannot create {path}: {exc.strerror or exc}") from None


def _finalize(state: _State, what: str = "CPU") -> None:
    try:
        state.close()
    except CgroupError as exc:
        log.warning("%s cgroups left behind: %s", what, exc)
