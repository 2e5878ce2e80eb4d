"""A double with NCCL's semantics, for CPUs: the part of a GPU this machine lacks.

It is a c10d backend (``dist.Backend.register_backend``, torch's own plug-in interface, the one
ProcessGroupNCCL sits behind) that real worker processes form groups with, through the
production ``GroupFormer``, and that the production ``Watchdog``, ``AbortMonitor`` and ``Comm``
drive unchanged. ``register()`` also declares it to ``hspmd_elastic.devices`` as a backend that
completes at enqueue, as NCCL is. What it copies from NCCL (and gloo does not do):

* **completion**: an operation runs on the group's "stream", a thread that takes the enqueued
  operations in order and ends one only when every peer has acted (its contribution is on the
  group's store). ``Work.get_future()`` is done at enqueue; ``Work.wait()`` only orders streams
  and returns at once; ``Work.is_completed()`` turns true when the operation ended (or failed).
* **a dead peer**: nothing times out. The stream waits for the peer forever, like a kernel that
  spins on the GPU, until the group is aborted.
* **host syncs**: ``synchronize()`` is ``torch.cuda.synchronize``: it blocks until every stream
  of the process is idle, with no deadline, or until the groups are aborted.
* **abort**: ``ProcessGroup.abort()`` ends the stream, fails what it had pending (``wait()``
  then raises) and releases every host sync; the thread that called it is recorded
  (``abort_threads``).
* **creation**: making a communicator (the default group, or a split for ``new_group``) waits
  for every member to make its own. In NCCL's blocking mode that wait has no bound; with
  ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` it is bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
  seconds and then raises, as torch's ``DistBackendError`` does.

Only what the elastic control path uses is implemented: all_reduce (sum, max), all_gather and
barrier. Point-to-point raises.
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

_live: "set[DoubleGroup]" = set()
_live_lock = threading.Lock()
abort_threads: list[str] = []  # the threads every abort ran on, in order


class DoubleWork(dist.distributed_c10d.Work):
    def __init__(self, outputs):
        super().__init__()
        self._done = threading.Event()
        self._error: Optional[str] = None
        self._future = torch.futures.Future()
        self._future.set_result(outputs)  # NCCL: the future is done once the work is enqueued

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:  # NCCL: orders streams, never blocks the host
        if self._error is not None:
            raise RuntimeError(self._error)
        return True

    def _finish(self, error: Optional[str] = None) -> None:
        self._error = error
        self._done.set()


def _pack(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().numpy().tobytes()


def _unpack(data: bytes, like: torch.Tensor) -> torch.Tensor:
    array = np.frombuffer(data, dtype=like.detach().numpy().dtype).copy()
    return torch.from_numpy(array).reshape(like.shape)


class DoubleGroup(dist.ProcessGroup):
    """One communicator of the double: its own store namespace and stream thread."""

    def __init__(self, store, rank: int, size: int):
        super().__init__(rank, size)
        self._store, self._rank, self._size = store, rank, size
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._aborted = False
        self._seq = 0
        self._stream = threading.Thread(target=self._run, name=f"{NAME}-stream", daemon=True)
        self._stream.start()
        with _live_lock:
            _live.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ------------------------------------------------------------------ operations
    def allreduce(self, tensors, opts=None):
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        return self._enqueue("allreduce", (tensors, op), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        return self._enqueue("allgather", (output_lists, inputs), output_lists)

    def barrier(self, opts=None):
        return self._enqueue("barrier", None, [])

    def send(self, *args, **kwargs):
        raise RuntimeError(f"{NAME}: point-to-point is not implemented")

    recv = send

    def abort(self) -> None:
        with self._cond:
            if not self._aborted:
                abort_threads.append(threading.current_thread().name)
            self._aborted = True
            self._cond.notify_all()
        _notify_syncs()

    def shutdown(self) -> None:
        self.abort()

    def _enqueue(self, kind: str, args, outputs) -> DoubleWork:
        with self._cond:
            if self._aborted:
                raise RuntimeError(f"{NAME}: the communicator was aborted")
            work = DoubleWork(outputs)
            self._seq += 1
            self._queue.append((self._seq, kind, args, work))
            self._cond.notify_all()
        return work

    # ------------------------------------------------------------------ the stream
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._aborted:
                    self._cond.wait()
                if self._aborted:
                    break
                seq, kind, args, work = self._queue[0]
            error = None
            try:
                self._execute(seq, kind, args)
            except _Aborted:
                break
            except Exception as exc:  # noqa: BLE001 - the work reports it
                error = f"{NAME}: {kind} failed: {exc}"
            with self._cond:
                self._queue.popleft()
                work._finish(error)
                self._cond.notify_all()
            _notify_syncs()
        with self._cond:  # aborted: what was pending fails
            while self._queue:
                self._queue.popleft()[3]._finish(f"{NAME}: the communicator was aborted")
        _notify_syncs()

    def _execute(self, seq: int, kind: str, args) -> None:
        if kind == "allreduce":
            (tensors, op) = args
            values = self._exchange(seq, _pack(tensors[0]))
            parts = [_unpack(v, tensors[0]) for v in values]
            total = parts[0]
            for p in parts[1:]:
                total = torch.maximum(total, p) if op == dist.ReduceOp.MAX else total + p
            tensors[0].copy_(total)
        elif kind == "allgather":
            output_lists, inputs = args
            values = self._exchange(seq, _pack(inputs[0]))
            for out, v in zip(output_lists[0], values):
                out.copy_(_unpack(v, inputs[0]))
        else:
            self._exchange(seq, b"")

    def _exchange(self, seq: int, mine: bytes) -> list[bytes]:
        """Put this rank's part, then wait for every peer's (forever, like NCCL)."""
        self._store.set(f"op/{seq}/{self._rank}", mine)
        keys = [f"op/{seq}/{r}" for r in range(self._size)]
        _poll(lambda: self._store.check(keys), lambda: self._aborted, None)
        return [self._store.get(k) for k in keys]

    @property
    def idle(self) -> bool:
        return self._aborted or not self._queue


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
        _sync_cond.wait_for(lambda: all(g.idle for g in list(_live)), _HARD_CAP_S)


def _poll(ready, aborted, bound_s: Optional[float]) -> None:
    start, delay = time.monotonic(), _POLL_FIRST_S
    limit = _HARD_CAP_S if bound_s is None else bound_s
    while not ready():
        if aborted():
            raise _Aborted()
        if time.monotonic() - start >= limit:
            raise RuntimeError(f"NCCL error: timeout after {limit:g}s in communicator "
                               "initialization (TORCH_NCCL_NONBLOCKING_TIMEOUT)")
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _create(store, rank: int, size: int, timeout) -> DoubleGroup:
    """Make this rank's communicator: every member must make its own (see the docstring)."""
    nonblocking = os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "0").strip().lower() in (
        "1", "true", "yes", "y")
    bound = float(os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "1800")) if nonblocking \
        else None
    store.set(f"init/{rank}", "1")
    keys = [f"init/{r}" for r in range(size)]
    _poll(lambda: store.check(keys), lambda: False, bound)
    return DoubleGroup(store, rank, size)


def register() -> None:
    """Make ``enqueuedouble`` a c10d backend and declare its NCCL semantics (idempotent)."""
    from hspmd_elastic.devices import register_enqueue_backend

    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    register_enqueue_backend(NAME)
