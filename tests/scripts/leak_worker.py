"""The worker of tests/test_switch_leak.py: ``tests/_elastic.py``'s worker (``main``, on the job
payload), whose reading after every switch waits for the reaper first.

A switch that left a collective in flight hands the old plan's groups to ``GroupReaper``, whose
daemon thread ("retired ...") holds them (their gloo sockets, pipe and epoll among the open files)
until that collective has ended, then ``_SETTLE_S`` longer, and drops them. The switch returns
before that, so a count read at once may include a set still held (M16 item 8: a thread and four
files, dropped half a second later). Here each reading is therefore taken twice:

``raw``      ``process_resources()`` as the switch returns, with the reaper's ``holding()``;
``settled``  the same after ``GroupReaper.wait_idle`` (the holder threads' own end, bounded by
             ``IDLE_TIMEOUT_S``; after one reading reached that bound the later ones do not
             wait); ``idle`` says whether they all ended, ``waited_s`` how long.

Both carry the thread names and the open files' link targets, so a count that grows can be
traced to what holds it. ``process_resources`` is replaced in this process only (``main`` looks it
up at each switch); the runtime's reaper is ``reaper.live_reapers()``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: _elastic

import _elastic  # noqa: E402
from hspmd_elastic.elastic import group, reaper  # noqa: E402

# Far above the reaper's own delay (its collective ends as the peer leaves the old groups during
# the same switch, then _SETTLE_S = 0.5 s) and below the groups' gloo timeout (comm_s, 30 s in
# _elastic.TIMEOUTS): a set held until gloo times its collective out is reported, not waited out.
IDLE_TIMEOUT_S = 20.0

_counts = group.process_resources
_reapers: list = []


def _find_reapers() -> list:
    """The runtime's ``GroupReaper`` (its ``GroupFormer`` makes it)."""
    if not _reapers:
        _reapers.extend(reaper.live_reapers())
    return _reapers


def _files() -> list[str]:
    out = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            out.append(f"{fd} {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own descriptor, closed since
            out.append(f"{fd} ?")
    return out


def _look(reapers) -> dict:
    return {"counts": _counts(), "holding": sum(r.holding() for r in reapers),
            "threads": sorted(t.name for t in threading.enumerate()), "files": _files()}


_stuck: list[bool] = []  # a reading found the reaper still holding at its bound


def reading() -> dict:
    reapers = _find_reapers()
    raw = _look(reapers)
    start = time.monotonic()
    # once the reaper has been found stuck, later readings do not wait for it again: the test
    # fails on the first one, and the run goes on to the end instead of waiting at every switch
    deadline = start + (0.0 if _stuck else IDLE_TIMEOUT_S)
    idle = all([r.wait_idle(max(0.0, deadline - time.monotonic())) for r in reapers])
    waited = time.monotonic() - start
    if not idle:
        _stuck.append(True)
    return {"raw": raw, "settled": _look(reapers), "idle": idle, "waited_s": waited,
            "reapers": len(reapers)}


group.process_resources = reading

if __name__ == "__main__":
    sys.exit(_elastic.main(sys.argv[1]))
