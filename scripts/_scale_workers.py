"""Simulated workers for the scale runs (``scripts/_scale_agents.py --workers K``): K per
simulated agent, each following the plans as a real worker does, and counting what etcd sends.

A node's workers start once its agent saw the first plan that uses it (and, on the ``stamp``
path, relayed it), as a real agent starts its workers after it applied the plan. Two ways to
follow, as ``--worker-path`` says:

* ``stamp`` (now): each worker is a real ``hspmd_elastic.elastic.plan_watch.PlanWatcher`` (its
  watch on ``plan/stamp``, its recheck thread, its reads), with its agent's relay file; its
  agent relays each plan's layout with the real ``launcher.plan_relay.relay_plan`` as it sees
  the plan's head. A process-wide pool resolves each announced plan with ``wait_newer``, as the
  runtime does before it switches, once the worker's agent relayed that plan (or 5 s after the
  announcement): a real worker polls the relay file meanwhile, which a few hundred threads of
  one process sharing a GIL cannot afford;
* ``current`` (before stamps): each worker watches ``plan/current`` and has the plan on
  arrival, as the worker's plan watch did; the JSON of one revision is parsed once per process
  (the bytes etcd sends do not depend on it).

The workers' watches of one process share one etcd watch stream (``MuxWatch``, passed to each
``PlanWatcher`` as its ``watch``), as etcd's Go client carries a process's watches: etcd sends
each watcher its own ``WatchResponse`` whatever stream it is on, so the bytes are those of
separate streams, while a gRPC stream per simulated worker (a Python thread polling it ten
times a second) would take more CPU than this 2-core machine has at 8,000 workers.

What etcd sent is counted by the clients (``PrefixWatch.event_bytes``,
``EtcdClient.kv_bytes_received``: protobuf message sizes): the agents' head watches, the agents'
relay reads (their own client), the workers' watches and the workers' reads (one client per
process). ``WorkerFleet.counters()`` sums them; a resolved plan is reported per worker as
``[node, local_rank, version, wall time]``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.relay import relay_file
from hspmd_elastic.coord.api import (CoordinationError, EtcdUnavailableError, EventType,
                                    WatchEvent)
from hspmd_elastic.coord.client import EtcdClient, _b, prefix_range_end
from hspmd_elastic.coord.watch import _event, _with_record
from etcd3 import etcdrpc
from hspmd_elastic.elastic.plan_watch import RELAY_WAIT_S, PlanWatcher
from launcher.plan_relay import relay_plan

log = logging.getLogger(__name__)

RESOLVE_S = 120.0  # each wait_newer's timeout
START_S = 60.0
START_TRIES = 5
PATHS = ("stamp", "current")


class _Versions:
    """One parse of ``plan/current``'s JSON per revision per process (``current`` path)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[int, int] = {}

    def of(self, ev: WatchEvent) -> int:
        with self._lock:
            if ev.revision not in self._seen:
                self._seen[ev.revision] = int(json.loads(ev.value)["version"])
                for old in sorted(self._seen)[:-4]:
                    del self._seen[old]
            return self._seen[ev.revision]


class _Handle:
    """One watch on a ``MuxWatch`` (``start``, ``stop``, ``event_bytes``, as ``PrefixWatch``)."""

    def __init__(self, mux: "MuxWatch", key: str, callback, decode: bool, initial: bool):
        self.mux, self.key, self.callback = mux, key, callback
        self.decode, self.initial = decode, initial
        self.event_bytes = 0
        self.created = threading.Event()
        self.watch_id: Optional[int] = None

    def start(self, timeout: Optional[float] = None) -> "_Handle":
        start = 0
        if self.initial:  # list, then watch from right after the read (as PrefixWatch does)
            snap = self.mux.client.get_prefix(self.key)
            for kv in snap:
                self.deliver(WatchEvent(EventType.PUT, kv.key, kv.value, kv.mod_revision,
                                        kv.create_revision, synthetic=True))
            start = snap.revision + 1
        self.mux.add(self, start)
        if not self.created.wait(START_S if timeout is None else timeout):
            raise EtcdUnavailableError(f"watch on {self.key} not created")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.mux.cancel(self)

    def deliver(self, event: WatchEvent) -> None:
        try:
            if self.decode and event.type is EventType.PUT:
                event = _with_record(event)
            self.callback(event)
        except Exception:  # noqa: BLE001 - as PrefixWatch: logged, the watch goes on
            log.exception("watch on %s: callback failed", self.key)


class MuxWatch:
    """Many watches on one etcd watch stream (see the module docstring): no progress requests,
    no resume after a broken stream (a bench run fails instead, by its deadlines)."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self._requests: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._pending: list[_Handle] = []  # created in this order
        self._by_id: dict[int, _Handle] = {}
        self._stop = threading.Event()
        self._call = self.client.call("mux watch: open", lambda ch, t: etcdrpc.WatchStub(
            ch).Watch(self._outgoing()))
        self._thread = threading.Thread(target=self._run, name="mux watch", daemon=True)
        self._thread.start()

    def watch(self, client, key: str, callback, decode: bool = False, initial: bool = False,
              name: str = "") -> _Handle:
        """The ``watch`` of a ``PlanWatcher`` (``client`` and ``name`` are this mux's)."""
        return _Handle(self, key, callback, decode, initial)

    def add(self, handle: _Handle, start_revision: int) -> None:
        create = etcdrpc.WatchCreateRequest(key=_b(handle.key),
                                            range_end=prefix_range_end(_b(handle.key)),
                                            start_revision=start_revision)
        with self._lock:  # creates are answered in the order they were sent
            self._pending.append(handle)
            self._requests.put(etcdrpc.WatchRequest(create_request=create))

    def cancel(self, handle: _Handle) -> None:
        with self._lock:
            self._by_id.pop(handle.watch_id, None)
        if handle.watch_id is not None and not self._stop.is_set():
            self._requests.put(etcdrpc.WatchRequest(
                cancel_request=etcdrpc.WatchCancelRequest(watch_id=handle.watch_id)))

    def close(self) -> None:
        self._stop.set()
        self._requests.put(None)
        self._call.cancel()
        self._thread.join(5.0)

    def _outgoing(self):
        while not self._stop.is_set():
            try:
                req = self._requests.get(timeout=1.0)
            except queue.Empty:
                continue
            if req is None:
                return
            yield req

    def _run(self) -> None:
        try:
            for resp in self._call:
                if resp.created:
                    with self._lock:
                        handle = self._pending.pop(0)
                        handle.watch_id = resp.watch_id
                        self._by_id[resp.watch_id] = handle
                    handle.created.set()
                if not resp.events:
                    continue
                with self._lock:
                    handle = self._by_id.get(resp.watch_id)
                if handle is None:
                    continue
                handle.event_bytes += resp.ByteSize()
                for ev in resp.events:
                    handle.deliver(_event(ev))
        except Exception as exc:  # noqa: BLE001 - the stream ended: say so
            if not self._stop.is_set():
                log.error("mux watch stream ended: %s", exc)


class _Worker:
    def __init__(self, node: str, local_rank: int):
        self.node, self.local_rank = node, local_rank
        self.version = 0  # the newest plan resolved
        self.busy = False
        self.announced: tuple[int, float] = (0, 0.0)  # (version, when tick first saw it)
        self.plans: Optional[PlanWatcher] = None
        self.watch: Optional[_Handle] = None

    def watch_bytes(self) -> int:
        if self.plans is not None:
            return self.plans.watch_bytes
        return self.watch.event_bytes if self.watch is not None else 0


class WorkerFleet:
    """The simulated workers of one agents process (see the module docstring)."""

    def __init__(self, endpoints: str, job: str, nodes: list[str], per_node: int, path: str,
                 etcd_timeout: float = 5.0, resolvers: int = 16):
        if path not in PATHS:
            raise ValueError(f"worker path {path!r}; valid: {', '.join(PATHS)}")
        self.job, self.path = job, path
        self.client = EtcdClient(endpoints, timeout=etcd_timeout)  # the workers'
        self.relay_client = EtcdClient(endpoints, timeout=etcd_timeout)  # the agents' relays
        self.mux = MuxWatch(self.client)
        self.dir = tempfile.mkdtemp(prefix="hspmd-scale-relay-")
        self.dirs = {n: os.path.join(self.dir, n) for n in nodes}
        for d in self.dirs.values():
            os.mkdir(d)
        self.workers = [_Worker(n, lr) for n in nodes for lr in range(per_node)]
        self._by_node = {n: [w for w in self.workers if w.node == n] for n in nodes}
        self._started: set[str] = set()
        self._relayed: dict[str, int] = {}  # node -> the newest version its agent relayed
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="start")
        self._versions = _Versions()
        self._lock = threading.Lock()
        self._resolved: list = []
        self._pool = ThreadPoolExecutor(max_workers=resolvers, thread_name_prefix="resolve")
        self.relays = self.relay_failures = 0

    # ------------------------------------------------------------------ lifecycle
    def _start_one(self, w: _Worker) -> None:
        """Start ``w``'s plan watch, trying again while etcd does not answer (a loaded
        machine); a worker that cannot start is logged and never resolves (the run's deadline
        names it)."""
        for attempt in range(START_TRIES):
            try:
                if self.path == "stamp":
                    w.plans = PlanWatcher(self.client, self.job,
                                          relay_file=relay_file(self.dirs[w.node]),
                                          watch=self.mux.watch).start(START_S)
                else:
                    w.watch = self.mux.watch(self.client, schema.plan_current_key(self.job),
                                             lambda ev, w=w: self._on_current(w, ev),
                                             initial=True)
                    w.watch.start(START_S)
                return
            except CoordinationError as exc:
                log.warning("%s:%d: starting the worker's plan watch failed (%s)%s", w.node,
                            w.local_rank, exc, "; trying again" if attempt + 1 < START_TRIES
                            else "")

    def stop(self) -> None:
        self._starter.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for w in self.workers:
            if w.plans is not None:
                w.plans.stop(2.0)
            if w.watch is not None:
                w.watch.stop(2.0)
        self.mux.close()
        self.client.close()
        self.relay_client.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ following
    def on_head(self, node: str, head: schema.PlanHeadRecord) -> None:
        """The agent ``node`` saw ``head``: it relays the plan to its workers (stamp path) and,
        the first time, starts them."""
        if node not in self.dirs:
            return
        if self.path == "stamp":
            ok = relay_plan(self.relay_client, self.job, head, self.dirs[node])
            with self._lock:
                self.relays += 1
                self.relay_failures += 0 if ok else 1
                self._relayed[node] = max(head.version, self._relayed.get(node, 0))
        with self._lock:
            if node in self._started:
                return
            self._started.add(node)
        for w in self._by_node[node]:
            self._starter.submit(self._start_one, w)

    def _on_current(self, w: _Worker, ev: WatchEvent) -> None:
        if ev.type is not EventType.PUT:
            return
        version = self._versions.of(ev)
        if version > w.version:
            w.version = version
            with self._lock:
                self._resolved.append([w.node, w.local_rank, version, time.time()])

    def tick(self) -> list:
        """Start resolving every newly announced plan (stamp path); returns what resolved since
        the last tick."""
        if self.path == "stamp":
            now = time.monotonic()
            with self._lock:
                relayed = dict(self._relayed)
            for w in self.workers:
                stamp = w.plans.newer_than(w.version) if w.plans is not None else None
                if stamp is None or w.busy:
                    continue
                if w.announced[0] != stamp.version:
                    w.announced = (stamp.version, now)
                if (relayed.get(w.node, 0) >= stamp.version
                        or now - w.announced[1] >= RELAY_WAIT_S):
                    w.busy = True
                    self._pool.submit(self._resolve, w)
        with self._lock:
            out, self._resolved = self._resolved, []
        return out

    def _resolve(self, w: _Worker) -> None:
        try:
            record = w.plans.wait_newer(w.version, RESOLVE_S)
            if record is not None:
                w.version = record.version
                with self._lock:
                    self._resolved.append([w.node, w.local_rank, record.version, time.time()])
        except Exception:  # noqa: BLE001 - a bench: say it and go on
            log.exception("%s:%d: resolving a plan failed", w.node, w.local_rank)
        finally:
            w.busy = False

    def counters(self) -> dict:
        sources: dict[str, int] = {}
        for w in self.workers:
            if w.plans is not None:
                for k, v in w.plans.sources.items():
                    sources[k] = sources.get(k, 0) + v
        with self._lock:
            relays, failures = self.relays, self.relay_failures
        return {"worker_watch": sum(w.watch_bytes() for w in self.workers),
                "worker_kv": self.client.kv_bytes_received,
                "relay_kv": self.relay_client.kv_bytes_received,
                "relays": relays, "relay_failures": failures, "sources": sources}
