"""The node agent's etcd-outage policy, the same in both modes: training does not need etcd.

Workers talk to each other through their own process group and the agent's TCPStore, never
through etcd; etcd only carries membership, plans and health. So while etcd cannot be reached
(a maintenance stall, a member election, a partitioned switch) the workers keep running and the
agent keeps ticking. Every etcd round trip of the agent reports to this policy: ``reachable()``
after one that succeeded, ``unreachable(exc)`` after one that failed. Promises:

* **the limit**: an outage longer than ``limit_s`` (``--hspmd-etcd-outage-limit``, default
  ``DEFAULT_LIMIT_S`` = 120 s, never under three lease TTLs) ends the agent with one line,
  ``etcd unreachable for more than <limit>s: <cause>``; the mode then stops its workers. 120 s
  rides out what a healthy etcd cluster goes through (leader elections take seconds; a member
  restart or a defragmentation tens of seconds), and is short enough that a node cut off from
  the cluster for good does not run on for long after the others replanned without it;
* **an outage is also a slow answer**: etcd work that succeeds but took more than half a lease
  TTL (``reachable(started_at)``) counts as an outage that just ended (etcd may have expired
  leases meanwhile, even though no call failed);
* **reconciling**: for ``reconcile_s`` (one lease TTL plus one second) after an outage ended,
  ``reconciling()`` is true. Leases that expired during the outage are being re-granted and
  their keys re-created (``coord.LeasedSession`` does it within a third of a TTL), so a node
  or device record that is missing now is not yet a node that left: restart mode does not
  start a new round for it and the leader does not replan for it until the window is over and
  the record is still missing. A node that really left is therefore seen at most
  ``reconcile_s`` later than without an outage.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from launcher.api import RendezvousConnectionError

log = logging.getLogger(__name__)

DEFAULT_LIMIT_S = 120.0


class EtcdOutagePolicy:
    """Tracks one agent's etcd outages (see the module docstring)."""

    def __init__(self, lease_ttl_s: float, limit_s: float = DEFAULT_LIMIT_S, label: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.lease_ttl_s = float(lease_ttl_s)
        self.limit_s = max(float(limit_s), 3 * self.lease_ttl_s)
        self.reconcile_s = self.lease_ttl_s + 1.0
        self.label = label
        self._clock = clock
        self.lost_since: Optional[float] = None  # monotonic time etcd was first missed
        self.recovered_at: Optional[float] = None  # when the last outage ended
        self.outages = 0

    @property
    def in_outage(self) -> bool:
        return self.lost_since is not None

    def reachable(self, started_at: Optional[float] = None) -> None:
        """etcd work begun at ``started_at`` (monotonic; None: just now) succeeded: an outage
        in progress, or a slow answer, ended."""
        now = self._clock()
        if self.lost_since is not None:
            log.info("%setcd reachable again after %.1fs; reconciling for %.1fs", self.label,
                     now - self.lost_since, self.reconcile_s)
            self._ended(now)
        elif started_at is not None and now - started_at > self.lease_ttl_s / 2:
            log.info("%setcd answered after %.1fs; reconciling for %.1fs", self.label,
                     now - started_at, self.reconcile_s)
            self._ended(now)
        self.lost_since = None

    def unreachable(self, exc: Exception) -> None:
        """An etcd round trip failed; raises ``RendezvousConnectionError`` past the limit."""
        now = self._clock()
        if self.lost_since is None:
            self.lost_since = now
            log.warning("%setcd unreachable, workers keep running (up to %.0fs): %s",
                        self.label, self.limit_s, exc)
        if now - self.lost_since > self.limit_s:
            raise RendezvousConnectionError(
                f"etcd unreachable for more than {self.limit_s:.0f}s "
                f"(--hspmd-etcd-outage-limit): {exc}") from exc

    def reconciling(self) -> bool:
        """True during an outage and for ``reconcile_s`` after it: missing records may still
        come back, so they are not membership changes yet."""
        if self.lost_since is not None:
            return True
        return self.recovered_at is not None and \
            self._clock() - self.recovered_at < self.reconcile_s

    def _ended(self, now: float) -> None:
        self.recovered_at = now
        self.outages += 1
