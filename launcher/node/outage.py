"""The node agent's etcd-outage policy: training does not need etcd, so workers run on.

Both modes follow it. While etcd cannot be reached, the workers keep running and the agent keeps
ticking; every failed etcd round calls ``unreachable(exc)`` and every good one ``reachable()``.
An outage longer than ``tolerance_s`` (``max(OUTAGE_MIN_S, 3 x lease TTL)``: long enough for a
member election or a short maintenance stall, short enough that a node cut off from the cluster
does not run on for long after the others replanned without it) ends the agent with a one-line
``RendezvousConnectionError`` naming the outage and its cause.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from launcher.api import RendezvousConnectionError

log = logging.getLogger(__name__)

OUTAGE_MIN_S = 30.0  # the shortest outage the workers are kept running through


class EtcdOutagePolicy:
    """Tracks one agent's etcd outage (see the module docstring)."""

    def __init__(self, lease_ttl_s: float, label: str = "",
                 clock: Callable[[], float] = time.monotonic, min_s: float = OUTAGE_MIN_S):
        self.tolerance_s = max(min_s, 3 * lease_ttl_s)
        self.label = label
        self._clock = clock
        self.lost_since: Optional[float] = None  # monotonic time etcd was first missed

    @property
    def in_outage(self) -> bool:
        return self.lost_since is not None

    def reachable(self) -> None:
        """An etcd round trip succeeded: the outage (if any) is over."""
        if self.lost_since is not None:
            log.info("%setcd reachable again after %.1fs", self.label,
                     self._clock() - self.lost_since)
        self.lost_since = None

    def unreachable(self, exc: Exception) -> None:
        """An etcd round trip failed; raises ``RendezvousConnectionError`` past the tolerance."""
        now = self._clock()
        if self.lost_since is None:
            self.lost_since = now
            log.warning("%setcd unreachable, workers keep running: %s", self.label, exc)
        if now - self.lost_since > self.tolerance_s:
            raise RendezvousConnectionError(
                f"etcd unreachable for more than {self.tolerance_s:.0f}s: {exc}") from exc
