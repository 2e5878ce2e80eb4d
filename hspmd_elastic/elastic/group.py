"""Forming the process group of a plan version, and leaving the previous one.

The plan names a TCPStore server (hosted by a surviving node agent) and each version uses its own
key prefix ``hspmd/v<version>/``, so generations never mix. Forming a group is: destroy whatever
group this process had (on gloo, destroy + a new init in the same process works even after an
abandoned collective, in milliseconds), meet the plan's other ranks at a barrier on the store that
this process polls (so a newer plan or a deadline interrupts it: no rank ever blocks inside
``init_process_group`` waiting for a peer that will not come), then ``init_process_group``.

Leaving a plan on gloo destroys its groups; one that still runs an abandoned collective is kept
by the ``GroupReaper`` (``elastic/reaper.py``) until gloo has timed that collective out, and
dropped off the main thread.

On CUDA (``hspmd_elastic.devices``: the backend is ``cpu:gloo,cuda:nccl``; in general any backend
that ``devices.completes_at_enqueue``) a collective whose peer died never ends by itself: its
kernel spins on the GPU until the communicators are aborted. Leaving is therefore an abort
(docs/gpu.md, "NCCL as it really is", has torch's source line for each fact used here):

* ``abort_communicators`` aborts the communicators of every group of the process, each on its
  own thread at once (an NCCL group call cannot cover them: torch runs each abort on a thread of
  its own), and touches nothing else, so it is safe from the ``AbortMonitor``'s thread
  (``elastic/monitor.py``) while the main thread is stuck in a host sync or an enqueue;
  ``GroupFormer.abandoned`` (the watchdog's ``on_abandon``) and ``GroupFormer.leave`` run it
  there, with a bound (``CommAbortFailed``) above the creation bound, since an abort waits while
  a communicator is being created;
* ``forget_process_groups`` then clears torch's registry of groups on the main thread, as
  ``_abort_process_group`` does after its aborts; ``end_process_groups`` forgets them too when an
  abort or a destroy raised, so a failed abort never leaves the default group registered and the
  next plan's ``init_process_group`` always starts afresh; the groups are dropped on a daemon
  thread (``~ProcessGroupNCCL`` joins torch's watchdog thread);
* torch's own watchdog never acts first: groups get a timeout above ours plus the abort's bound
  (``devices.backend_timeout_s``), and ``devices.nccl_environment`` turns off its dump and its
  heartbeat monitor unless the user set them (a dump's ``exception_dump`` key on the plan's
  store would get a worker that joins later terminated).

Creating a plan's communicators is bounded too: ``devices.nccl_environment`` puts NCCL in its
non-blocking mode (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) with a ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
that fires by the regroup deadline. NCCL makes a communicator ready only at its first operation
(``getNcclComm`` waits for it, holding the mutex an abort needs), so ``GroupFormer.ready`` posts
that first operation (one small ``all_reduce`` per group: the default group at ``form``, a plan's
sub-groups after ``Comm.create``) from a helper thread and polls it against the deadline and newer
plans, never under the armed monitor; every rank's communicator then exists before the BSR's
``batch_isend_irecv`` (which needs every rank when it is a group's first operation). A group still
being created when the plan is left is aborted once its creation ends, off the main thread.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hspmd_elastic.devices import (backend_for, backend_timeout_s, completes_at_enqueue,
                                   nccl_environment, nonblocking_timeout_s, use_device, uses_nccl)
from hspmd_elastic.elastic.monitor import AbortMonitor, CommAbortFailed
from hspmd_elastic.elastic.reaper import GroupReaper
from hspmd_elastic.elastic.api import ConfigurationError, ElasticError

log = logging.getLogger(__name__)

_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05
# The abort monitor's limit over a block's own deadlines (GroupFormer.armed)
ARMED_GRACE_S = 2.0
# An abort's bound: at least this, and above the creation bound plus ABORT_MARGIN_S (an abort
# waits while a communicator is being created: NCCLComm::abort takes the mutex that
# getNcclComm holds while it waits for readiness)
ABORT_TIMEOUT_S = 30.0
ABORT_MARGIN_S = 10.0


class RegroupAborted(ElasticError):
    """A newer plan appeared while meeting the peers of this one."""


class RegroupTimeout(ElasticError):
    """The plan's ranks did not all arrive before the deadline."""


class StoreUnreachable(ElasticError):
    """The plan's store cannot be reached (its host died): a newer plan will name another."""


def abort_communicators(groups: Optional[list] = None, skip: Iterable = ()) -> None:
    """Abort the communicators of ``groups`` (default: every process group of this process,
    newest first) but those in ``skip``, without waiting for what runs in them and without
    touching torch's registry of groups (the main thread may be using it): safe from the
    ``AbortMonitor``'s thread. Several groups are aborted at once, each on its own thread:
    torch's ``ProcessGroupNCCL::abort`` runs the communicator's abort on a ``std::async``
    thread and NCCL's group calls are per thread, so the ``ncclGroupStart``/``End`` that
    ``_abort_process_group`` wraps around its aborts covers nothing, and two hung
    communicators can still block each other's abort (pytorch#119797); aborts that run
    concurrently release each other. Raises what an abort raised, once all have returned."""
    if groups is None:
        names = dict(c10d._world.pg_names)  # a copy: the main thread may add groups meanwhile
        groups = sorted(names, key=lambda pg: names[pg], reverse=True)
    skipped = {id(g) for g in skip}
    groups = [g for g in groups if id(g) not in skipped]
    errors: list[BaseException] = []

    def abort(pg) -> None:
        try:
            pg.abort()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    if len(groups) == 1:
        abort(groups[0])
    else:
        caller = threading.current_thread().name
        threads = [threading.Thread(target=abort, args=(pg,), name=f"{caller}/abort-{i}",
                                    daemon=True) for i, pg in enumerate(groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # the caller bounds the whole (AbortMonitor.abort_now)
    if errors:
        raise errors[0]


def forget_process_groups() -> None:
    """Clear torch's registry of process groups as ``_abort_process_group`` does after its
    aborts, without aborting anything: the default group and every sub-group are gone
    (``dist.is_initialized()`` is False) and the next ``init_process_group`` starts afresh.
    For groups already aborted, or whose abort failed."""
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
    """Abort every process group of this process without waiting for what runs in them, all
    at once (``abort_communicators``), and forget them (``dist.is_initialized()`` is False
    afterwards, also when an abort raised: that is re-raised after the registry is
    cleared)."""
    try:
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


def version_prefix(version: int) -> str:
    return f"hspmd/v{version}/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigurationError(f"store endpoint {endpoint!r} must be 'host:port'")
    return host, int(port)


class GroupFormer:
    """Owns this process's connection to the plan's store and its default process group, on
    ``device`` with the backend ``devices.backend_for`` gives it (``backend`` overrides it: a
    registered c10d backend, such as a double with NCCL's semantics).

    On a backend that completes at enqueue (``devices.completes_at_enqueue``: NCCL) it owns an
    ``AbortMonitor`` (``monitor``) whose thread aborts the plan's communicators; on gloo
    ``monitor`` is None. There its groups are made with ``devices.backend_timeout_s`` (torch's
    own watchdog never times a work out before ours), every group it leaves is dropped on a
    daemon thread (``GroupReaper.off_thread``), and a communicator still being created when the
    plan is left is aborted once its creation ends, off the main thread."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 30.0,
                 reaper: Optional[GroupReaper] = None,
                 device: torch.device | str = "cpu", backend: Optional[str] = None,
                 init_timeout_s: Optional[float] = None,
                 abort_timeout_s: Optional[float] = None):
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # bound of a communicator's creation or split (TORCH_NCCL_NONBLOCKING_TIMEOUT)
        self.init_timeout_s = connect_timeout_s if init_timeout_s is None else init_timeout_s
        if abort_timeout_s is None:
            abort_timeout_s = max(ABORT_TIMEOUT_S, nonblocking_timeout_s(self.init_timeout_s)
                                  + 1.0 + ABORT_MARGIN_S)
        self.abort_timeout_s = abort_timeout_s
        self.reaper = reaper or GroupReaper()
        self.device = torch.device(device)
        self.backend = backend or backend_for(self.device)
        self.enqueue = completes_at_enqueue(self.backend)
        # the timeout torch's own watchdog gets: above ours plus the abort's bound on NCCL
        self.group_timeout_s = backend_timeout_s(self.backend, timeout_s, abort_timeout_s)
        self.reaper.off_thread = self.enqueue
        self.monitor: Optional[AbortMonitor] = (
            AbortMonitor(self._abort_live, abort_timeout_s) if self.enqueue else None)
        self._stores: dict[str, dist.Store] = {}
        self.store: Optional[dist.Store] = None  # the current version's PrefixStore
        self._lock = threading.Lock()
        # (thread making the first operation, its groups): a communicator being created
        self._creating: list[tuple[threading.Thread, list]] = []
        self._skipped: list = []  # groups an abort left alone because they were being created
        self._hook_before: Optional[Callable] = None  # sys.excepthook before torch wrapped it
        self._hook_torch: Optional[Callable] = None  # the wrapper torch installed

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

    def comms_aborted(self) -> Optional[str]:
        """Why this plan's communicators were, or are being, aborted (None: intact, or gloo).
        A wait that completed since then proves nothing (``AbortMonitor.broken``)."""
        return self.monitor.broken if self.monitor is not None else None

    def _abort_live(self) -> None:
        """The monitor's abort: every communicator but those still being created (their abort
        would wait on the mutex their creation holds); ``leave`` aborts those once their
        creation ends."""
        with self._lock:
            self._creating = [(t, gs) for t, gs in self._creating if t.is_alive()]
            skip = [g for _t, gs in self._creating for g in gs]
            self._skipped = skip
        abort_communicators(skip=skip)

    def _abort_after_creation(self) -> None:
        """Abort the groups the last abort skipped, on a daemon thread, once the threads
        creating them return (each within the creation bound); the groups are dropped
        there."""
        with self._lock:
            groups, self._skipped = self._skipped, []
            ids = {id(g) for g in groups}
            threads = [t for t, gs in self._creating if any(id(g) in ids for g in gs)]
            self._creating = [(t, gs) for t, gs in self._creating
                              if not any(id(g) in ids for g in gs)]
        if not groups:
            return
        bound = self.abort_timeout_s

        def later() -> None:
            for t in threads:
                t.join(bound)
            try:
                abort_communicators(groups)
            except Exception as exc:  # noqa: BLE001 - the groups are gone either way
                log.warning("aborting communicators after their creation ended raised "
                            "(%s: %s)", type(exc).__name__, exc)
            groups.clear()

        threading.Thread(target=later, name="abort-after-creation", daemon=True).start()
        log.info("%d communicator(s) still being created: aborted once their creation ends",
                 len(groups))

    def leave(self) -> float:
        """Leave the current process group and its sub-groups; returns the seconds spent.

        gloo: ``end_process_groups`` destroys them. A backend that completes at enqueue: the
        communicators are aborted on the monitor's thread (unless it already did), then the
        groups are forgotten, also when the abort raised, and dropped on a daemon thread; an
        abort that does not return is ``CommAbortFailed``."""
        start = time.monotonic()
        aborted = False
        if self.monitor is not None and dist.is_initialized():
            error = self.monitor.abort_now("leaving the plan")
            if error is not None:
                log.warning("aborting the old communicators raised (%s: %s); forgetting them",
                            type(error).__name__, error)
            self._abort_after_creation()
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
        later. A no-op on gloo. Never arm it across the creation of communicators (``ready``
        bounds that): an abort then waits for the creation."""
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
            self._init(store, rank, world, nccl)
            self.ready([dist.group.WORLD], f"plan v{version}", aborted, deadline)
        except (RuntimeError, ValueError) as exc:
            # a peer died while the communicators were created (non-blocking creation timed
            # out), or the warm-up was abandoned: nothing of this plan's group may stay behind
            self.leave()
            if isinstance(exc, ElasticError):
                raise
            raise RegroupTimeout(f"plan v{version}: creating the process group failed: "
                                 f"{str(exc).splitlines()[0][:200]}") from exc
        self.store = store

    def _init(self, store: dist.Store, rank: int, world: int, nccl: bool) -> None:
        """``init_process_group``, which wraps ``sys.excepthook`` to prefix "[rankN]" each
        time: the hook it wrapped last time is put back first, so prefixes never pile up."""
        if self._hook_torch is not None and sys.excepthook is self._hook_torch:
            sys.excepthook = self._hook_before
        before = sys.excepthook
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=self.group_timeout_s),
                                **({"device_id": self.device} if nccl else {}))
        self._hook_before, self._hook_torch = before, sys.excepthook

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

    def ready(self, groups: list, what: str, aborted: Callable[[], bool],
              deadline: float) -> None:
        """On a backend that completes at enqueue, make every communicator of ``groups`` exist
        and work: one small ``all_reduce`` each, in the order given (every member must give
        its groups in one global order), polled against ``deadline`` (``RegroupTimeout``) and
        ``aborted`` (``RegroupAborted``). NCCL creates a communicator lazily, or eagerly but
        non-blocking: its first operation is where torch waits for it to be ready
        (``getNcclComm``, up to ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, holding the mutex an abort
        needs), so that operation is posted from a helper thread and this thread keeps
        looking at the deadline and for newer plans. A no-op on gloo."""
        if not self.enqueue:
            return
        for group in groups:
            self._ready_one(group, what, aborted, deadline)

    def _ready_one(self, group, what: str, aborted: Callable[[], bool],
                   deadline: float) -> None:
        probe = torch.zeros(1, device=self.device)
        posted: list = []

        def post() -> None:
            try:
                use_device(self.device)  # the current CUDA device is per thread
                posted.append(dist.all_reduce(probe, group=group, async_op=True))
            except BaseException as exc:  # noqa: BLE001 - reported on the calling thread
                posted.append(exc)

        thread = threading.Thread(target=post, name=f"creating communicators ({what})",
                                  daemon=True)
        with self._lock:
            self._creating.append((thread, [group]))
        thread.start()
        delay = _POLL_FIRST_S
        while True:
            work = posted[0] if posted else None
            if isinstance(work, BaseException):
                raise RegroupTimeout(f"{what}: creating the communicators failed: "
                                     f"{str(work).splitlines()[0][:200]}") from work
            if work is not None and work.is_completed():
                break
            if aborted():
                raise RegroupAborted(f"{what}: a newer plan was published while the "
                                     "communicators were being created")
            if time.monotonic() >= deadline:
                raise RegroupTimeout(f"{what}: the communicators were not ready by the "
                                     "deadline")
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
