"""Forming the process group of a plan version, and leaving the previous one.

The plan names a TCPStore server (hosted by a surviving node agent) and each version uses its own
key prefix ``hspmd/v<version>/``, so generations never mix. Forming a group is: destroy whatever
group this process had (on gloo, destroy + a new init in the same process works even after an
abandoned collective, in milliseconds), meet the plan's other ranks at a barrier on the store that
this process polls (so a newer plan or a deadline interrupts it: no rank ever blocks inside
``init_process_group`` waiting for a peer that will not come), then ``init_process_group``.

One gloo fact shapes leaving: the last reference to a process group with a collective still in
flight (posted, then abandoned because a newer plan came or a peer never joined it) blocks in the
group's destructor until gloo times that collective out, the whole communication timeout, on
whichever thread drops it. ``GroupReaper`` keeps such groups (the default group at ``leave`` and
the previous plan's sub-groups, through ``retire``) on a daemon thread until every abandoned
collective has ended, then drops them there; groups still held when the process exits are never
destroyed, so neither training nor exit waits for them. A process that ends calls
``GroupReaper.close`` first: it waits (bounded) for held groups whose collectives have ended to be
dropped, and from then on no held group is dropped at all. A group destructor still running on
the reaper's thread while the interpreter exits aborts the process ("terminate called without an
active exception": C++ tears down under that thread), which turned a finished worker into a
failed one.

On CUDA (``hspmd_elastic.devices``: the backend is ``cpu:gloo,cuda:nccl``; in general any backend
that ``devices.completes_at_enqueue``) a collective whose peer died never ends by itself: its
kernel spins on the GPU until the communicators are aborted. Leaving is therefore an abort:

* ``abort_communicators`` aborts every communicator of the process (newest first, in one NCCL
  group call, so two hung communicators cannot block each other's abort) and touches nothing
  else, so it is safe from the ``AbortMonitor``'s thread (``elastic/monitor.py``) while the main
  thread is stuck in a host sync or an enqueue; ``GroupFormer.abandoned`` (the watchdog's
  ``on_abandon``) and ``GroupFormer.leave`` run it there, with a bound (``CommAbortFailed``);
* ``forget_process_groups`` then clears torch's registry of groups on the main thread, as
  ``_abort_process_group`` does after its aborts; ``end_process_groups`` (torch's
  ``_abort_process_group`` on the main thread, or destroying on gloo) forgets them too when an
  abort or a destroy raised, so a failed abort never leaves the default group registered and the
  next plan's ``init_process_group`` always starts afresh.

Creating a plan's communicators is bounded too: ``devices.nccl_environment`` puts NCCL in its
non-blocking mode (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) with the regroup deadline as
``TORCH_NCCL_NONBLOCKING_TIMEOUT``, so a peer that dies between the store barrier and its
``ncclCommInitRank`` (or a split for ``new_group``) costs the survivors that deadline, then
``RegroupTimeout``, instead of a wait in C++ that never ends. On NCCL the default group is
created with ``device_id`` (eager communicator creation; sub-groups split from it), then warmed
by one ``all_reduce`` polled against the regroup deadline and newer plans, so every rank's
communicator exists before the BSR's ``batch_isend_irecv`` (which needs every rank when it is a
group's first operation).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hspmd_elastic.devices import (backend_for, completes_at_enqueue, nccl_environment, use_device,
                                   uses_nccl)
from hspmd_elastic.elastic.monitor import AbortMonitor, CommAbortFailed
from hspmd_elastic.elastic.api import ConfigurationError, ElasticError

log = logging.getLogger(__name__)

_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05
_SETTLE_S = 0.5  # after the last abandoned collective ends, before dropping its groups
# The abort monitor's limit over a block's own deadlines (GroupFormer.armed)
ARMED_GRACE_S = 2.0


class RegroupAborted(ElasticError):
    """A newer plan appeared while meeting the peers of this one."""


class RegroupTimeout(ElasticError):
    """The plan's ranks did not all arrive before the deadline."""


class StoreUnreachable(ElasticError):
    """The plan's store cannot be reached (its host died): a newer plan will name another."""


def abort_communicators() -> None:
    """Abort the communicators of every process group of this process, newest first, without
    waiting for what runs in them and without touching torch's registry of groups (the main
    thread may be using it): safe from the ``AbortMonitor``'s thread. On NCCL the aborts run
    inside one NCCL group call, so two hung communicators cannot block each other's abort
    (what torch's ``_abort_process_group`` does). Raises what an abort raised."""
    from torch.distributed import distributed_c10d as c10d

    names = dict(c10d._world.pg_names)  # a copy: the main thread may add groups meanwhile
    groups = sorted(names, key=lambda pg: names[pg], reverse=True)
    nccl = None
    if groups and c10d.is_nccl_available():
        try:
            nccl = dist.group.WORLD._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):
            nccl = None
        if not isinstance(nccl, getattr(dist, "ProcessGroupNCCL", ())):
            nccl = None
    if nccl is not None:
        nccl._group_start()
    try:
        for pg in groups:
            pg.abort()
    finally:
        if nccl is not None:
            nccl._group_end()


def forget_process_groups() -> None:
    """Clear torch's registry of process groups as ``_abort_process_group`` does after its
    aborts, without aborting anything: the default group and every sub-group are gone
    (``dist.is_initialized()`` is False) and the next ``init_process_group`` starts afresh.
    For groups already aborted, or whose abort failed."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    c10d._update_default_pg(None)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
                  "tags_to_pg", "pg_coalesce_state"):
        getattr(world, table, {}).clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    world.group_count = 0


def abort_process_groups() -> None:
    """Abort every process group of this process without waiting for what runs in them, and
    forget them (``dist.is_initialized()`` is False afterwards, also when an abort raised:
    that is re-raised after the registry is cleared)."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    try:
        if abort is not None:  # torch >= 2.5
            abort()
        else:  # torch 2.4
            abort_communicators()
    finally:
        if dist.is_initialized() or c10d._world.pg_map:
            forget_process_groups()


def end_process_groups(aborted: bool = False) -> Optional[object]:
    """Leave every process group of this process: destroyed on gloo, aborted on a backend that
    completes at enqueue (NCCL: see the module docstring), only forgotten when ``aborted``
    (the ``AbortMonitor`` already aborted them). Returns the default group's object, for
    ``GroupReaper.retire``; None when there was none. Never raises, and never leaves a group
    registered: a group broken by a dead peer, or whose abort failed, still goes away, so the
    next plan's ``init_process_group`` finds none."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    enqueue = completes_at_enqueue(dist.get_backend())
    try:
        if aborted:
            forget_process_groups()
        elif enqueue:
            abort_process_groups()
        else:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a group broken by a dead peer still goes away
        log.warning("%s the old process group raised (%s: %s); forgetting it",
                    "aborting" if enqueue else "destroying", type(exc).__name__, exc)
    if dist.is_initialized():
        forget_process_groups()
    return world


def process_resources() -> dict[str, int]:
    """What this process holds that a switch could leak: live process groups (torch's own
    registry), threads, open file descriptors (gloo's sockets among them), and on CUDA the bytes
    the caching allocator has handed out and reserved. Counters that cannot be read here
    (no ``/proc``, no CUDA) are absent, never guessed."""
    from torch.distributed import distributed_c10d as c10d

    out = {"process_groups": len(getattr(c10d._world, "pg_map", {}) or {}),
           "threads": threading.active_count()}
    try:
        out["fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated"] = int(torch.cuda.memory_allocated())
        out["cuda_reserved"] = int(torch.cuda.memory_reserved())
    return out


_REAPERS: "weakref.WeakSet[GroupReaper]" = weakref.WeakSet()


def live_reapers() -> list["GroupReaper"]:
    """Every ``GroupReaper`` of this process still alive (a resource count that must not see
    a retired set about to be dropped waits for them: ``GroupReaper.wait_idle``)."""
    return list(_REAPERS)


def version_prefix(version: int) -> str:
    return f"hspmd/v{version}/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigurationError(f"store endpoint {endpoint!r} must be 'host:port'")
    return host, int(port)


class GroupReaper:
    """Keeps process groups alive until the collectives abandoned on them have ended.

    ``abandoned(done)`` records a collective left in flight (``done`` is set when it completes
    or fails; gloo fails it at its group's timeout). ``retire(*objs)`` takes references to
    process groups (or objects that own them, such as a ``Comm``) that the caller is about to
    drop: while any recorded collective is still in flight, a daemon thread holds them until all
    of those have ended and drops them there, where destruction is quick; otherwise it holds
    nothing and the caller's drop destroys them at once. Point-to-point works are not recorded:
    gloo runs them on the waiting thread, not on the group's workers, so they never hold up a
    group's destructor.
    """

    def __init__(self, warn_after_s: float = 600.0):
        _REAPERS.add(self)
        self.warn_after_s = warn_after_s
        self._lock = threading.Lock()
        self._inflight: list[threading.Event] = []
        self._holders: list[threading.Thread] = []
        self._dropping = threading.Lock()  # held while a retired set is dropped
        self._closed = False  # set by close(): held groups are never dropped from then on
        self.retired = 0  # how many retire() calls had to hold their groups

    def abandoned(self, done: threading.Event) -> None:
        with self._lock:
            self._inflight.append(done)

    def pending(self) -> int:
        """Abandoned collectives still in flight."""
        with self._lock:
            self._inflight = [e for e in self._inflight if not e.is_set()]
            return len(self._inflight)

    def holding(self) -> int:
        """Retired sets of groups still held (their collectives have not all ended)."""
        with self._lock:
            self._holders = [t for t in self._holders if t.is_alive()]
            return len(self._holders)

    def retire(self, *objs, what: str = "process groups") -> bool:
        """Hold ``objs`` until every collective abandoned so far has ended; False if none is in
        flight (nothing is held)."""
        objs = tuple(o for o in objs if o is not None)
        if not objs or not self.pending():
            return False
        with self._lock:
            inflight = list(self._inflight)
            holder = threading.Thread(target=self._hold, args=(list(objs), inflight, what),
                                      name=f"retired {what}", daemon=True)
            self._holders.append(holder)
            self.retired += 1
        holder.start()
        log.info("%s: %d abandoned collective(s) still in flight; dropping them once those "
                 "end", what, len(inflight))
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no retired group is held (True), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            holders = list(self._holders)
        for t in holders:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.holding() == 0

    def close(self, timeout: float) -> bool:
        """Before the process exits: wait at most ``timeout`` seconds for the held groups to be
        dropped, then stop dropping any (True if none was left held). A group still held then
        stays held by its parked daemon thread, so no destructor runs while the process exits."""
        deadline = time.monotonic() + timeout
        idle = self.wait_idle(timeout)
        if self._dropping.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._closed = True
            self._dropping.release()
        else:  # a destructor ran past the deadline: nothing more can be done before exit
            self._closed = True
            log.warning("retired process groups are still being destroyed at exit")
        if not idle:
            log.warning("%d set(s) of process groups still wait for an abandoned collective at "
                        "exit; they are left undestroyed", self.holding())
        return idle

    def _hold(self, objs: list, inflight: list[threading.Event], what: str) -> None:
        for done in inflight:
            # gloo ends every collective at its group's timeout, so this returns; a warning
            # (never a release) if it takes far longer. At exit this daemon thread is frozen
            # with ``objs`` still referenced: their destructors never run.
            while not done.wait(self.warn_after_s):
                log.warning("%s: an abandoned collective is still in flight after %.0fs; "
                            "keeping its groups", what, self.warn_after_s)
        # ``done`` is set from the completion callback, on the group's worker thread, which
        # then takes the GIL once more to free that callback. The destructor joins that thread
        # while this thread holds the GIL, so give it time to get out first (torch offers no
        # event for it); nothing waits on this thread.
        time.sleep(_SETTLE_S)
        with self._dropping:
            if not self._closed:
                objs.clear()  # every collective has ended: the destructors do not wait
                return
        while True:  # closed: park on this daemon thread, keeping ``objs``, until the exit
            time.sleep(3600.0)


class GroupFormer:
    """Owns this process's connection to the plan's store and its default process group, on
    ``device`` with the backend ``devices.backend_for`` gives it (``backend`` overrides it: a
    registered c10d backend, such as a double with NCCL's semantics).

    On a backend that completes at enqueue (``devices.completes_at_enqueue``: NCCL) it owns an
    ``AbortMonitor`` (``monitor``) whose thread aborts the plan's communicators; on gloo
    ``monitor`` is None."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 30.0,
                 reaper: Optional[GroupReaper] = None,
                 device: torch.device | str = "cpu", backend: Optional[str] = None,
                 init_timeout_s: Optional[float] = None, abort_timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # bound of a communicator's creation or split (TORCH_NCCL_NONBLOCKING_TIMEOUT)
        self.init_timeout_s = connect_timeout_s if init_timeout_s is None else init_timeout_s
        self.reaper = reaper or GroupReaper()
        self.device = torch.device(device)
        self.backend = backend or backend_for(self.device)
        self.enqueue = completes_at_enqueue(self.backend)
        self.monitor: Optional[AbortMonitor] = (
            AbortMonitor(abort_communicators, abort_timeout_s) if self.enqueue else None)
        self._stores: dict[str, dist.Store] = {}
        self.store: Optional[dist.Store] = None  # the current version's PrefixStore

    def _client(self, endpoint: str) -> dist.Store:
        if endpoint not in self._stores:
            host, port = parse_endpoint(endpoint)
            try:
                self._stores[endpoint] = dist.TCPStore(
                    host, port, None, False,
                    timeout=datetime.timedelta(seconds=self.connect_timeout_s))
            except (RuntimeError, OSError) as exc:
                raise StoreUnreachable(f"cannot reach the plan's store at {endpoint}: "
                                       f"{exc}") from exc
        return self._stores[endpoint]

    def leave(self) -> float:
        """Leave the current process group and its sub-groups; returns the seconds spent.

        gloo: ``end_process_groups`` destroys them. A backend that completes at enqueue: the
        communicators are aborted on the monitor's thread (unless it already did), then the
        groups are forgotten, also when the abort raised; an abort that does not return is
        ``CommAbortFailed``."""
        start = time.monotonic()
        aborted = False
        if self.monitor is not None and dist.is_initialized():
            error = self.monitor.abort_now("leaving the plan")
            if error is not None:
                log.warning("aborting the old communicators raised (%s: %s); forgetting them",
                            type(error).__name__, error)
            aborted = True
        world = end_process_groups(aborted=aborted)
        if self.monitor is not None:
            self.monitor.reset()
        if world is not None:
            self.reaper.retire(world, what="the previous default group")
            del world
        self.store = None
        return time.monotonic() - start

    def abandoned(self, done: threading.Event) -> None:
        """A collective was left in flight (the watchdog's ``on_abandon``): the reaper keeps
        its groups alive until it ends; on a backend that completes at enqueue the monitor's
        thread aborts the plan's communicators now, which ends it (``CommAbortFailed`` when
        the abort does not return)."""
        self.reaper.abandoned(done)
        if self.monitor is not None and dist.is_initialized():
            log.info("a collective was abandoned on %s: aborting this plan's communicators",
                     self.backend)
            error = self.monitor.abort_now("a collective was abandoned")
            if error is not None:
                log.warning("aborting the communicators raised (%s: %s); the groups are "
                            "forgotten when the plan is left", type(error).__name__, error)

    def armed(self, what: str, limit_s: float, superseded: Callable[[], bool]):
        """The abort monitor's watch over a block whose waits each have ``limit_s`` (a step,
        a switch): it aborts by itself only for a thread stuck outside them, ``ARMED_GRACE_S``
        later. A no-op on gloo."""
        if self.monitor is None:
            return contextlib.nullcontext()
        return self.monitor.armed(what, limit_s + ARMED_GRACE_S, superseded)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def form(self, version: int, endpoint: str, rank: int, world: int,
             aborted: Callable[[], bool], deadline: float) -> None:
        """Leave the old group and form plan ``version``'s: ``rank`` of ``world``.

        Every rank announces its backend on arrival; one that differs from rank 0's (workers of
        one job on different ``--hspmd-device`` settings) is a ``ConfigurationError``."""
        self.leave()
        store = dist.PrefixStore(version_prefix(version), self._client(endpoint))
        try:
            store.set(f"arrive/{rank}", self.backend)
        except RuntimeError as exc:
            self._stores.pop(endpoint, None)
            raise StoreUnreachable(f"plan v{version}: the store at {endpoint} failed: "
                                   f"{exc}") from exc
        wait_keys(store, [f"arrive/{r}" for r in range(world)], aborted, deadline,
                  f"plan v{version}: ranks arriving")
        self._check_backend(store, rank, version)
        nccl = uses_nccl(self.backend) and self.device.type == "cuda"
        if self.enqueue:
            nccl_environment(self.init_timeout_s)
        if nccl:
            use_device(self.device)
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=self.timeout_s),
                                    **({"device_id": self.device} if nccl else {}))
            if self.enqueue:
                self._warm(version, aborted, deadline)
        except (RuntimeError, ValueError) as exc:
            # a peer died while the communicators were created (non-blocking creation timed
            # out), or the warm-up was abandoned: nothing of this plan's group may stay behind
            self.leave()
            if isinstance(exc, ElasticError):
                raise
            raise RegroupTimeout(f"plan v{version}: creating the process group failed: "
                                 f"{str(exc).splitlines()[0][:200]}") from exc
        self.store = store

    def _check_backend(self, store: dist.Store, rank: int, version: int) -> None:
        if rank == 0:
            return
        try:
            first = store.get("arrive/0").decode("utf-8", "replace")
        except RuntimeError as exc:
            raise StoreUnreachable(f"plan v{version}: the store failed: {exc}") from exc
        if first != self.backend:
            raise ConfigurationError(
                f"plan v{version}: rank 0 communicates over {first!r}, this rank over "
                f"{self.backend!r} (device {self.device}): every worker of a job must run on "
                "the same kind of device (--hspmd-device)")

    def _warm(self, version: int, aborted: Callable[[], bool], deadline: float) -> None:
        """One small ``all_reduce`` on the device, polled against ``aborted`` and ``deadline``
        (NCCL's ``wait`` only orders streams): every rank's communicator is up afterwards."""
        probe = torch.zeros(1, device=self.device)
        work = dist.all_reduce(probe, async_op=True)
        delay = _POLL_FIRST_S
        while not work.is_completed():
            if aborted():
                raise RegroupAborted(f"plan v{version}: NCCL warm-up: a newer plan was "
                                     "published")
            if time.monotonic() >= deadline:
                raise RegroupTimeout(f"plan v{version}: the NCCL warm-up all_reduce did not "
                                     "complete by the deadline")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        work.wait()


def wait_keys(store: dist.Store, keys: list[str], aborted: Callable[[], bool], deadline: float,
              what: str) -> None:
    """Poll until every key exists on ``store``; ``RegroupAborted`` / ``RegroupTimeout``."""
    delay = _POLL_FIRST_S
    while True:
        try:
            if store.check(keys):
                return
        except RuntimeError as exc:
            raise StoreUnreachable(f"{what}: the store failed: {exc}") from exc
        if aborted():
            raise RegroupAborted(f"{what}: a newer plan was published")
        if time.monotonic() >= deadline:
            missing = [k for k in keys if not store.check([k])]
            raise RegroupTimeout(f"{what}: still missing {missing} at the deadline")
        time.sleep(delay)  # polling a remote store: there is nothing to wait on locally
        delay = min(delay * 2, _POLL_MAX_S)
