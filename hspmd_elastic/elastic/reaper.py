"""Keeping process groups alive until the collectives abandoned on them have ended.

One gloo fact shapes leaving a plan: the last reference to a process group with a collective
still in flight (posted, then abandoned because a newer plan came or a peer never joined it)
blocks in the group's destructor until gloo times that collective out, the whole communication
timeout, on whichever thread drops it. ``GroupReaper`` keeps such groups (the default group at
``GroupFormer.leave`` and the previous plan's sub-groups, through ``retire``) on a daemon thread
until every abandoned collective has ended, then drops them there; groups still held when the
process exits are never destroyed, so neither training nor exit waits for them. A process that
ends calls ``GroupReaper.close`` first: it waits (bounded) for held groups whose collectives have
ended to be dropped, and from then on no held group is dropped at all. A group destructor still
running on the reaper's thread while the interpreter exits aborts the process ("terminate called
without an active exception": C++ tears down under that thread), which turned a finished worker
into a failed one.

On NCCL (``off_thread``) every retired set is dropped on a daemon thread, whether or not a
collective is in flight: ``~ProcessGroupNCCL`` joins torch's watchdog thread, which may be asleep
for a dump, and the main thread must never wait for that.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

log = logging.getLogger(__name__)

_SETTLE_S = 0.5  # after the last abandoned collective ends, before dropping its groups

_REAPERS: "weakref.WeakSet[GroupReaper]" = weakref.WeakSet()


def live_reapers() -> list["GroupReaper"]:
    """Every ``GroupReaper`` of this process still alive (a resource count that must not see
    a retired set about to be dropped waits for them: ``GroupReaper.wait_idle``)."""
    return list(_REAPERS)


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
        # NCCL: every retired set is dropped on a daemon thread, in-flight or not (a group's
        # destructor joins torch's watchdog thread, which may sleep for a dump: never on the
        # main thread); GroupFormer sets it for a backend that completes at enqueue
        self.off_thread = False

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
        if not objs or not (self.off_thread or self.pending()):
            return False
        with self._lock:
            inflight = [] if self.off_thread else list(self._inflight)
            holder = threading.Thread(target=self._hold, args=(list(objs), inflight, what),
                                      name=f"retired {what}", daemon=True)
            self._holders.append(holder)
            self.retired += 1
        holder.start()
        if inflight:
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
        if inflight:
            time.sleep(_SETTLE_S)
        with self._dropping:
            if not self._closed:
                objs.clear()  # every collective has ended: the destructors do not wait
                return
        while True:  # closed: park on this daemon thread, keeping ``objs``, until the exit
            time.sleep(3600.0)
