"""A double with ProcessGroupNCCL's semantics, for CPUs: the part of a GPU this machine lacks.

It is a c10d backend (``dist.Backend.register_backend``, torch's own plug-in interface, the one
ProcessGroupNCCL sits behind) that real worker processes form groups with, through the
production ``GroupFormer``, and that the production ``Watchdog``, ``AbortMonitor``, ``Comm`` and
BSR drive unchanged. ``register()`` also declares it to ``hspmd_elastic.devices`` as a backend
that completes at enqueue, as NCCL is.

Each behaviour below is modelled on torch 2.13's source (``ProcessGroupNCCL.cpp``,
``NCCLUtils.cpp``/``.hpp``, ``distributed_c10d.py``); docs/gpu.md, "NCCL as it really is", gives
the source line of each, how the elastic runtime handles it and the test that holds it.

* **completion** (``WorkNCCL``): an operation runs on the group's "stream", a thread that takes
  the enqueued operations in order and ends one only when every peer has acted.
  ``get_future()`` is done at enqueue; ``wait()`` only orders streams and returns at once, unless
  ``is_completed()`` saw an NCCL error on this work: then it aborts the communicator and raises;
  ``is_completed()`` turns true when the operation ended, hit an NCCL error, or its communicator
  was aborted. (``WorkNCCL::wait``, torch 2.7 ``ProcessGroupNCCL.cpp:725-790``.)
* **an aborted work is a success**: after ``abort()`` every pending work is completed with no
  error, and its ``wait()`` returns normally (``isCompleted`` skips ``checkAndSetException`` once
  the communicator is aborted: ``WorkNCCL::isCompleted``, 2.7 ``:528-533``). Its outputs hold
  whatever had arrived: partial data.
* **a dead peer** (``NCCL_DOUBLE_TRANSPORT=p2p``, the default: NVLink or shared memory): the
  stream waits for the peer until the group is aborted, like a kernel that spins on the GPU;
  nothing reports it. With ``NCCL_DOUBLE_TRANSPORT=net`` (sockets) the peer's closed connection
  is an ``ncclRemoteError`` on the work.
* **host syncs**: ``synchronize()`` is ``torch.cuda.synchronize``: until every stream of the
  process is idle or aborted, with no deadline.
* **creation is lazy** (``NCCLComm``): making the group returns at once; the communicator is
  ready only when every member made its own, and that is waited for at the first operation,
  while the communicator's mutex is held: with ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` for
  ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` whole seconds (an integer; the check compares whole
  elapsed seconds with ``>``, so a bound of N fires after N+1 s), without it forever.
  ``creations_waiting()`` counts the communicators of this process waiting so right now.
  ``abort()`` takes the same mutex, so it blocks while a first operation waits for readiness.
  (2.13 ``NCCLUtils.hpp:87-98, :225, :289, :304``; ``NCCLComm::getNcclComm``, 2.7
  ``NCCLUtils.cpp:121-151``.)
* **abort** (``ProcessGroup.abort()``) runs the communicator's abort on another thread (torch:
  ``std::async``) and waits for it; NCCL's group calls are per thread, so nothing the caller
  wraps around it covers it. An abort returns only when no other communicator of the process
  still has a hung operation running (``ncclCommAbort`` can block behind another communicator's
  kernel: pytorch#119797); aborts that run concurrently release each other. The thread that
  asked for each abort is recorded (``abort_threads``). (``ProcessGroupNCCL::abort``, 2.7
  ``:1389-1397``; 2.13 ``ProcessGroupNCCL.hpp:1468``.)
* **a failed abort**: ``ncclCommAbort`` runs under ``C10D_NCCL_CHECK``, so an NCCL error there
  is a ``DistBackendError`` "NCCL error in: ..." on the abort's thread, which
  ``ProcessGroup.abort()`` raises in its caller once it has waited for that thread; the
  communicator is left as it was (not aborted). ``fail_aborts(reason, times)`` makes the next
  ``times`` aborts fail so, with NCCL's own words for ``reason`` (``ncclSystemError``:
  "unhandled system error"); every failure raised is recorded (``abort_errors``).
  (2.13 ``NCCLUtils.hpp:63-72``, ``C10D_NCCL_CHECK``; ``:304``, ``NCCLComm::abort``.)
* **torch's watchdog** (one thread per group) keeps its own copy of each work: one older than the
  group's ``timeout`` (from its enqueue) is reported there only (the caller's work goes on
  spinning); an NCCL error also reaches the caller's work. Either way the watchdog then writes
  the key ``exception_dump`` at the root of the group's store (under every ``PrefixStore``),
  whatever ``TORCH_NCCL_DUMP_ON_TIMEOUT`` says, and sleeps 4 x
  ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (default 15 s) holding the lock that every enqueue on
  the group takes. (2.13 ``ProcessGroupNCCL.hpp:120, :151, :1289``; upstream
  ``Watchdog::runLoop``.)
* **the heartbeat monitor**: the first group of a process, when ``TORCH_NCCL_DUMP_ON_TIMEOUT`` is
  not 0, polls ``exception_dump`` on its root store every ``TORCH_NCCL_COORD_CHECK_MILSEC`` (and
  its own process's dump signal); once it sees one it sleeps
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (default 480; nothing interrupts it) and then, unless the
  group was aborted or destroyed meanwhile, ends the process with ``abort()`` (SIGABRT), or with
  ``TORCH_NCCL_ENABLE_MONITORING=0`` only says it would have. (2.13 ``ProcessGroupNCCL.hpp:74,
  :101, :106, :125, :782-783``; ``heartbeatMonitor``, 2.7 ``:1593-1865``.)
* **the destructor** (dropping a group's last reference, on the dropping thread) aborts the group
  unless it was, then joins its watchdog and heartbeat threads through any sleep of theirs
  (``destructor_waits`` records the thread and the seconds). (``~ProcessGroupNCCL``, 2.7
  ``:1467-1525``.)
* **point to point**: sends and receives match by order within each pair of ranks; tags are
  ignored. A send is eager (it completes once posted); a receive of another size than the
  matched send fails. (``ProcessGroupNCCL::send``/``recv``, ``int /* unused */`` tag, 2.7
  ``:4977-4980``; 2.13 ``distributed_c10d.py:2613``.)

Only what the elastic paths use is implemented: all_reduce (sum, max), all_gather, barrier,
send and recv. Not a behaviour of NCCL but a probe for the tests: ``enqueue_hooks``, callables
told the kind of each operation this process enqueues (``"recv"``, ...), on the enqueuing thread
once the operation is in the stream's queue, so that a test acts after a given operation is
posted (an event, not a sleep).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

NAME = "enqueuedouble"
_HARD_CAP_S = 3600.0  # a blocking wait of the double still ends some day, should a test leak it
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.02
_WATCHDOG_POLL_S = 0.1  # torch: kWatchdogThreadSleepMillis
DUMP_KEY = "exception_dump"
# "p2p" (NVLink, shared memory: a dead peer leaves the kernel spinning, nothing reports it) or
# "net" (sockets: the dead peer's closed connection is an ncclRemoteError)
_NET = os.environ.get("NCCL_DOUBLE_TRANSPORT", "p2p") == "net"
_should_dump = [False]  # ProcessGroupNCCL::shouldDump_ (process-wide)

_live: "set[_Core]" = set()
_live_lock = threading.Lock()
_created = [0]  # groups made by this process (torch's process-wide uid counter)
abort_threads: list[str] = []  # the threads every abort was asked from, in order
abort_errors: list[str] = []  # every failed abort's error, in order
_abort_failures: list[str] = []  # the reasons the next aborts fail with (fail_aborts)
_waiting_ready = [0]  # communicators waiting for readiness at their first operation
destructor_waits: list[tuple[str, float]] = []  # (thread, seconds) of every destructor's join
watchdog_fired: list[str] = []  # why torch's watchdog failed a work, in order
enqueue_hooks: list = []  # called with each operation's kind once it is enqueued (a probe)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "y")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


class DoubleWork(dist.distributed_c10d.Work):
    def __init__(self, outputs):
        super().__init__()
        self._done = threading.Event()
        self._error: Optional[str] = None
        self.enqueued = time.monotonic()  # torch times a work from its construction
        self.started: Optional[float] = None  # when the stream began it
        self.watched = False  # torch's watchdog reported it (and dropped its copy)
        self.on_error = None  # WorkNCCL::wait aborts the communicator before it raises
        self._future = torch.futures.Future()
        self._future.set_result(outputs)  # NCCL: the future is done once the work is enqueued

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:  # NCCL: orders streams, never blocks the host
        if self._error is not None:  # an exception isCompleted() saw: abort, then raise
            if self.on_error is not None:
                self.on_error()
            raise RuntimeError(self._error)
        return True

    def _finish(self, error: Optional[str] = None) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()


def _pack(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().numpy().tobytes()


def _unpack(data: bytes, like: torch.Tensor) -> torch.Tensor:
    array = np.frombuffer(data, dtype=like.detach().numpy().dtype).copy()
    return torch.from_numpy(array).reshape(like.shape)


def _root(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Comm:
    """``NCCLComm``: readiness waited for at first use under the mutex that abort takes."""

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size
        self.mutex = threading.Lock()
        self.ready, self.aborted = False, False
        self.nonblocking = _env_flag("TORCH_NCCL_USE_COMM_NONBLOCKING", False)
        self.bound_s = _env_int("TORCH_NCCL_NONBLOCKING_TIMEOUT", 30 * 60)
        self.pids: dict[int, int] = {}

    def get(self) -> None:
        with self.mutex:
            if self.aborted:
                raise RuntimeError(f"NCCL communicator was aborted on rank {self.rank}.")
            if self.ready:
                return
            with _live_lock:
                _waiting_ready[0] += 1
            try:
                self._wait_ready()
            finally:
                with _live_lock:
                    _waiting_ready[0] -= 1
            self.pids = {r: int(self.store.get(f"init/{r}")) for r in range(self.size)}
            self.ready = True

    def _wait_ready(self) -> None:
        keys = [f"init/{r}" for r in range(self.size)]
        start, delay = time.monotonic(), _POLL_FIRST_S
        while not self.store.check(keys):
            elapsed = int(time.monotonic() - start)  # whole seconds, compared with '>'
            if self.nonblocking and elapsed > self.bound_s:
                # C10D_CHECK_TIMEOUT's message (torch 2.13 NCCLUtils.hpp:94)
                raise RuntimeError("NCCL timeout in: NCCLUtils.cpp (waitReady: the "
                                   "communicator initialization)")
            if elapsed > _HARD_CAP_S:
                raise RuntimeError("double: blocking communicator initialization hard cap")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def abort(self) -> None:
        with self.mutex:  # blocks while get() waits for readiness
            self.aborted = True


class _Core:
    """What a group's threads run on: never the group itself, so that dropping the group's last
    reference runs its destructor (which closes this and joins the watchdog)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float):
        self.store, self.rank, self.size = store, rank, size
        self.comm = _Comm(store, rank, size)
        self.timeout_s = timeout_s
        self.queue: deque = deque()
        self.cond = threading.Condition()
        self.aborted = False
        self.closing = False
        self.seq = 0
        self.pair_seq: dict[tuple[str, int], int] = {}
        self.stream = threading.Thread(target=self._run, name=f"{NAME}-stream", daemon=True)
        self.stream.start()
        self.watchdog = threading.Thread(target=self._watch, name=f"{NAME}-watchdog",
                                         daemon=True)
        self.watchdog.start()
        self.enqueue_lock = threading.Lock()
        with _live_lock:
            first = _created[0] == 0
            _created[0] += 1
            _live.add(self)
        self.monitor: Optional[threading.Thread] = None
        if first and _env_flag("TORCH_NCCL_DUMP_ON_TIMEOUT", True):  # checkDumpSignal
            self.monitor = threading.Thread(target=self._heartbeat_monitor,
                                            name=f"{NAME}-heartbeat", daemon=True)
            self.monitor.start()

    def next_pair(self, kind: str, peer: int) -> int:
        with self.cond:
            n = self.pair_seq.get((kind, peer), 0)
            self.pair_seq[(kind, peer)] = n + 1
        return n

    def abort(self) -> None:
        self.comm.abort()  # waits while a first operation holds the mutex for readiness
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
        _notify_syncs()
        with _sync_cond:  # ncclCommAbort can block behind another communicator's hung kernel
            _sync_cond.wait_for(lambda: not any(c.spinning for c in list(_live) if c is not self),
                                _HARD_CAP_S)

    def enqueue(self, kind: str, args, outputs) -> DoubleWork:
        self.comm.get()  # getNcclComm: raises once aborted; waits for readiness at first use
        with self.enqueue_lock, self.cond:
            if self.aborted:
                raise RuntimeError(f"NCCL communicator was aborted on rank {self.rank}.")
            work = DoubleWork(outputs)
            work.on_error = self.abort
            self.seq += 1
            self.queue.append((self.seq, kind, args, work))
            self.cond.notify_all()
        for hook in list(enqueue_hooks):
            hook(kind)
        return work

    # ------------------------------------------------------------------ the stream
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.aborted and not self.closing:
                    self.cond.wait()
                if self.aborted or self.closing:
                    break
                seq, kind, args, work = self.queue[0]
                work.started = time.monotonic()
            error = None
            try:
                self._execute(seq, kind, args, work)
            except _Aborted:
                if self.aborted or self.closing:
                    break  # the communicator is gone
                # else torch's watchdog failed this work: the stream goes on
            except Exception as exc:  # noqa: BLE001 - the work reports it
                error = f"{NAME}: {kind} failed: {exc}"
            with self.cond:
                self.queue.popleft()
                work._finish(error)
                self.cond.notify_all()
            _notify_syncs()
        with self.cond:  # aborted: what was pending completes, with no error
            while self.queue:
                self.queue.popleft()[3]._finish(None)
        _notify_syncs()

    def _execute(self, seq: int, kind: str, args, work: DoubleWork) -> None:
        gone = lambda: self.aborted or self.closing or work.is_completed()  # noqa: E731
        if kind == "allreduce":
            (tensors, op) = args
            values = self._exchange(seq, _pack(tensors[0]), gone)
            parts = [_unpack(v, tensors[0]) for v in values]
            total = parts[0]
            for p in parts[1:]:
                total = torch.maximum(total, p) if op == dist.ReduceOp.MAX else total + p
            tensors[0].copy_(total)
        elif kind == "allgather":
            output_lists, inputs = args
            values = self._exchange(seq, _pack(inputs[0]), gone)
            for out, v in zip(output_lists[0], values):
                out.copy_(_unpack(v, inputs[0]))
        elif kind == "send":
            tensor, n, dst = args
            self.store.set(f"p2p/{self.rank}-{dst}/{n}", _pack(tensor))
        elif kind == "recv":
            tensor, n, src = args
            key = f"p2p/{src}-{self.rank}/{n}"
            _poll(lambda: self.store.check([key]), gone)
            data = self.store.get(key)
            size = tensor.numel() * tensor.element_size()
            if len(data) != size:
                raise RuntimeError(f"message {n} from rank {src} has {len(data)} bytes, the "
                                   f"receive {size}")
            tensor.copy_(_unpack(data, tensor))
        else:
            self._exchange(seq, b"", gone)

    def _exchange(self, seq: int, mine: bytes, gone) -> list[bytes]:
        """Put this rank's part, then wait for every peer's (forever, like NCCL)."""
        self.store.set(f"op/{seq}/{self.rank}", mine)
        keys = [f"op/{seq}/{r}" for r in range(self.size)]
        _poll(lambda: self.store.check(keys), gone)
        return [self.store.get(k) for k in keys]

    @property
    def idle(self) -> bool:
        return self.aborted or self.closing or not self.queue

    @property
    def spinning(self) -> bool:
        """A hung operation runs on this communicator's stream (not aborted)."""
        queue = self.queue
        return not self.aborted and not self.closing and bool(queue) and \
            queue[0][3].started is not None and not queue[0][3].is_completed()

    # ------------------------------------------------------------------ torch's watchdog
    def _watch(self) -> None:
        """Torch's watchdog keeps its own copy of each work: a timeout it finds is not seen by
        the caller's work (which goes on spinning); an NCCL error is, through that work's own
        ``isCompleted`` (``checkAndSetException``). Either way it then writes the dump key and
        sleeps 4 x the dump wait, holding the lock every enqueue on this group takes."""
        while True:
            with self.cond:
                self.cond.wait(_WATCHDOG_POLL_S)
                if self.closing:
                    return
                if self.aborted:
                    continue
                head = self.queue[0][3] if self.queue else None
            if head is None or head.is_completed() or head.watched:
                continue
            why = None
            if time.monotonic() - head.enqueued >= self.timeout_s:
                why = (f"Watchdog caught collective operation timeout: ran for more than "
                       f"{self.timeout_s * 1000:.0f} milliseconds before timing out")
            elif _NET and head.started is not None and self.comm.pids and \
                    not all(_alive(p) for p in self.comm.pids.values()):
                why = "NCCL error: remote process exited or there was a network error " \
                      "(ncclRemoteError)"
                head._finish(why)  # the caller's work sees an async error: wait() raises
                _notify_syncs()
            if why is None:
                continue
            head.watched = True
            watchdog_fired.append(why)
            _should_dump[0] = True  # broadcastDumpSignal: this process's own monitor reacts
            try:
                _root(self.store).set(DUMP_KEY, str(self.rank))
            except RuntimeError:
                pass
            with self.enqueue_lock:  # torch sleeps holding workMetaListMutex_
                time.sleep(4 * _env_int("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", 15000) / 1000.0)

    def _heartbeat_monitor(self) -> None:
        """The first group's monitor: only with a dump configured does it look for the key."""
        every_s = _env_int("TORCH_NCCL_COORD_CHECK_MILSEC", 1000) / 1000.0
        root = _root(self.store)
        stopped = lambda: self.aborted or self.closing  # noqa: E731
        while True:
            with self.cond:
                if self.cond.wait_for(stopped, every_s):
                    return
            try:
                seen = _should_dump[0] or root.check([DUMP_KEY])
            except RuntimeError:
                seen = False
            if seen:
                break
        time.sleep(_env_int("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", 480))  # uninterruptible
        if stopped():  # terminateHeartbeatMonitorThread_: aborted or destroyed meanwhile
            return
        if _env_flag("TORCH_NCCL_ENABLE_MONITORING", True):
            print(f"{NAME}: heartbeat monitor: {DUMP_KEY} seen; terminating the process",
                  flush=True)
            os.abort()  # terminateProcess
        print(f"{NAME}: heartbeat monitor disabled, but would have terminated the process",
              flush=True)

    def close(self) -> None:
        """The destructor: abort unless aborted, then stop the threads and join the watchdog
        and the heartbeat monitor, through any sleep of theirs."""
        if not self.aborted:
            self.abort()
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        start = time.monotonic()
        for thread in (self.watchdog, self.monitor):
            if thread is not None and thread is not threading.current_thread():
                thread.join(_HARD_CAP_S)
        destructor_waits.append((threading.current_thread().name, time.monotonic() - start))
        with _live_lock:
            _live.discard(self)
        _notify_syncs()


class DoubleGroup(dist.ProcessGroup):
    """One communicator of the double (its state and threads are a ``_Core``)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float):
        super().__init__(rank, size)
        self._core = _Core(store, rank, size, timeout_s)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def allreduce(self, tensors, opts=None):
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        return self._core.enqueue("allreduce", (tensors, op), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        return self._core.enqueue("allgather", (output_lists, inputs), output_lists)

    def barrier(self, opts=None):
        return self._core.enqueue("barrier", None, [])

    def send(self, tensors, dst: int, tag: int):  # NCCL ignores the tag
        core = self._core
        return core.enqueue("send", (tensors[0], core.next_pair("send", dst), dst), tensors)

    def recv(self, tensors, src: int, tag: int):  # NCCL ignores the tag
        core = self._core
        return core.enqueue("recv", (tensors[0], core.next_pair("recv", src), src), tensors)

    def abort(self) -> None:
        abort_threads.append(threading.current_thread().name)
        failed: list[BaseException] = []

        def abort_comms() -> None:  # ncclCommAbort under C10D_NCCL_CHECK
            with _live_lock:
                reason = _abort_failures.pop(0) if _abort_failures else None
            if reason is not None:
                error = dist.DistBackendError(f"NCCL error in: NCCLUtils.cpp, {reason} (double: "
                                              "ncclCommAbort failed)")
                abort_errors.append(str(error))
                failed.append(error)
                return
            self._core.abort()

        runner = threading.Thread(target=abort_comms, name=f"{NAME}-abort", daemon=True)
        runner.start()  # torch: abortComms on a std::async thread, waited for ...
        runner.join(_HARD_CAP_S)
        if failed:  # ... and its exception raised here
            raise failed[0]

    def shutdown(self) -> None:
        self.abort()

    def __del__(self):
        self._core.close()  # ~ProcessGroupNCCL, on whichever thread drops the last reference


class _Aborted(Exception):
    pass


_sync_cond = threading.Condition()


def _notify_syncs() -> None:
    with _sync_cond:
        _sync_cond.notify_all()


def synchronize() -> None:
    """The host sync (``torch.cuda.synchronize``): until every stream of this process is idle
    or aborted. No deadline, as on a GPU."""
    with _sync_cond:
        _sync_cond.wait_for(lambda: all(c.idle for c in list(_live)), _HARD_CAP_S)


def _poll(ready, gone) -> None:
    start, delay = time.monotonic(), _POLL_FIRST_S
    while not ready():
        if gone():
            raise _Aborted()
        if time.monotonic() - start >= _HARD_CAP_S:
            raise RuntimeError("double: hard cap")
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _create(store, rank: int, size: int, timeout) -> DoubleGroup:
    """Make this rank's communicator: lazily, as the docstring says."""
    store.set(f"init/{rank}", str(os.getpid()))
    return DoubleGroup(store, rank, size, timeout.total_seconds())


def fail_aborts(reason: str = "unhandled system error", times: int = 1) -> None:
    """The next ``times`` aborts fail as an NCCL error in ``ncclCommAbort`` (see the module
    docstring); ``reset_aborts`` forgets what is still pending."""
    with _live_lock:
        _abort_failures.extend([reason] * times)


def reset_aborts() -> None:
    """Forget pending abort failures and the records of past aborts."""
    with _live_lock:
        _abort_failures.clear()
    abort_threads.clear()
    abort_errors.clear()


def creations_waiting() -> int:
    """How many communicators of this process wait for readiness at their first operation."""
    with _live_lock:
        return _waiting_ready[0]


def register() -> None:
    """Make ``enqueuedouble`` a c10d backend and declare its NCCL semantics (idempotent)."""
    from hspmd_elastic.devices import register_enqueue_backend

    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    register_enqueue_backend(NAME)
