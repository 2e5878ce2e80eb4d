"""Aborting a plan's communicators from a thread that cannot be stuck in them.

On NCCL (and any backend with its completion semantics: ``devices.completes_at_enqueue``) a rank
whose peer died is not told so: the collective's kernel spins on the GPU, and the worker's main
thread, if it reaches a host sync behind that kernel (reading the loss, a device-to-host copy) or
an enqueue that blocks (NCCL connecting a new pair of ranks), waits in C++ with no deadline.
Only an abort of the communicators ends the kernel, and it cannot come from the thread that is
stuck. ``AbortMonitor`` owns one daemon thread per worker that can:

* **abort on request** (``abort_now``): the watchdog abandons a wait (its deadline passed, or a
  newer plan was published) and asks for the abort; it runs on the monitor's thread and the
  caller waits for it, at most ``abort_timeout_s``;
* **abort on its own while armed** (``armed(what, limit_s, superseded)``, around every training
  step and every switch phase that waits on the device): when no wait has completed for
  ``limit_s`` seconds (``progress()`` restarts the clock; the watchdog calls it after every
  completed wait) or ``superseded()`` turns true (a newer plan), it aborts by itself, as
  torchft's per-operation timer does. The main thread is released, NCCL's operations fail or
  return, and the next wait, or the watchdog's next check, sees ``fired`` and raises.

The abort itself (``abort``: ``elastic.group.abort_communicators``) touches only the
communicators, never torch's registry of groups, which the main thread may be using; the main
thread forgets the aborted groups when it leaves the plan (``GroupFormer.leave``), also when an
abort raised. An abort that does not return within ``abort_timeout_s`` is ``CommAbortFailed``: the
process cannot leave the plan, so the worker exits naming why and its agent replans it like a
crash.

On gloo no monitor is armed (``GroupFormer`` makes one only for a backend that completes at
enqueue): gloo's futures complete when the work ends, a dead peer makes its operations fail
within the group's timeout, and its groups are destroyed, not aborted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Optional

from hspmd_elastic.elastic.api import ElasticError

log = logging.getLogger(__name__)

_POLL_S = 0.02


class CommAbortFailed(ElasticError):
    """Aborting the plan's communicators failed or did not return in time: this process cannot
    leave its plan, so the worker exits (its agent replans it like a crash)."""


class AbortMonitor:
    """A daemon thread that aborts the plan's communicators for a stuck main thread (see the
    module docstring). ``abort()`` must be callable from any thread; ``clock`` is monotonic."""

    def __init__(self, abort: Callable[[], None], abort_timeout_s: float = 30.0,
                 poll_s: float = _POLL_S, clock: Callable[[], float] = time.monotonic):
        self._abort, self.abort_timeout_s, self.poll_s, self._clock = (
            abort, abort_timeout_s, poll_s, clock)
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._armed: Optional[tuple[str, float, Callable[[], bool]]] = None
        self._deadline = 0.0
        self._request: Optional[str] = None  # an abort asked for by abort_now
        self._done = 0  # aborts finished (abort_now waits for this to move)
        self._error: Optional[BaseException] = None
        self.fired: Optional[str] = None  # why the communicators were aborted; None: intact
        # set before an abort begins: a work that completes from then on may have completed
        # only because its communicator was aborted (NCCL reports such a work as a success)
        self.aborting: Optional[str] = None
        self.abort_thread: Optional[str] = None  # the thread the last abort ran on

    # ---------------------------------------------------------------- main-thread side
    @contextlib.contextmanager
    def armed(self, what: str, limit_s: float,
              superseded: Callable[[], bool] = lambda: False) -> Iterator["AbortMonitor"]:
        """Watch the enclosed block: abort when no wait completes for ``limit_s`` seconds or
        when ``superseded()`` (called on the monitor's thread; it must not block)."""
        with self._cond:
            self._ensure_thread()
            self._armed = (what, float(limit_s), superseded)
            self._deadline = self._clock() + limit_s
            self._cond.notify_all()
        try:
            yield self
        finally:
            with self._cond:
                self._armed = None

    def progress(self) -> None:
        """A wait completed: the armed limit starts again."""
        with self._cond:
            if self._armed is not None:
                self._deadline = self._clock() + self._armed[1]

    def abort_now(self, reason: str) -> Optional[BaseException]:
        """Abort the communicators on the monitor's thread and wait for it (at most
        ``abort_timeout_s``; ``CommAbortFailed`` when it does not return). Returns what the
        abort raised, if anything: the communicators are then as good as gone, and the caller
        forgets the groups all the same."""
        with self._cond:
            if self.fired is not None:
                return self._error
            self._ensure_thread()
            ticket = self._done
            self._request = reason
            self._cond.notify_all()
            finished = self._cond.wait_for(lambda: self._done > ticket,
                                           self.abort_timeout_s)
            error = self._error
        if not finished:
            raise CommAbortFailed(f"aborting the plan's communicators did not return within "
                                  f"{self.abort_timeout_s:g}s ({reason})")
        return error

    @property
    def broken(self) -> Optional[str]:
        """Why this plan's communicators were, or are being, aborted; None while intact. Once
        set, no completed wait of this plan can be trusted: on NCCL an aborted work is
        completed and successful (``WorkNCCL::isCompleted`` sets no exception for an aborted
        communicator), with whatever partial data had arrived."""
        return self.fired or self.aborting

    def reset(self) -> None:
        """The aborted groups were forgotten (``GroupFormer.leave``): the next plan's are
        intact."""
        with self._cond:
            self.fired, self.aborting, self._error = None, None, None

    def close(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---------------------------------------------------------------- monitor thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="comm-abort-monitor",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                self._cond.wait(self.poll_s)
                if self._stop:
                    return
                reason, armed = self._request, self._armed
                self._request = None
                deadline = self._deadline
            if reason is None and armed is not None and self.fired is None:
                what, limit_s, superseded = armed
                if self._is_superseded(superseded):
                    reason = f"{what}: a newer plan was published"
                elif self._clock() >= deadline:
                    reason = f"{what}: no communication completed within {limit_s:g}s"
            if reason is not None:
                self._run_abort(reason)

    @staticmethod
    def _is_superseded(superseded: Callable[[], bool]) -> bool:
        try:
            return bool(superseded())
        except Exception:  # noqa: BLE001 - a failing check never aborts by itself
            log.exception("the newer-plan check of the abort monitor failed")
            return False

    def _run_abort(self, reason: str) -> None:
        error = None
        if self.fired is None:
            self.aborting = reason
            log.warning("aborting this plan's communicators: %s", reason)
            try:
                self._abort()
            except BaseException as exc:  # noqa: BLE001 - reported to abort_now's caller
                error = exc
                log.error("aborting the communicators failed: %s: %s", type(exc).__name__, exc)
        with self._cond:
            if self.fired is None:
                self.fired = reason
                self.abort_thread = threading.current_thread().name
                self._armed = None
            self._error = error
            self._done += 1
            self._cond.notify_all()
