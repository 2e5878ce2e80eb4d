"""Data-link reachability: the peers this node cannot reach, probed while its workers stall.

A node whose data link is cut while its control link (etcd) works keeps its lease, so nothing else
tells the leader it is gone: the collectives of every rank time out, and every worker waits for a
plan that nobody publishes. ``ReachProbe`` gives the leader the missing fact:

* it is armed when a local worker waits for a plan after it trained (it left a collective or a
  switch: ``ElasticNode`` decides); armed, a background thread TCP-connects to each peer's
  advertised store endpoint (the TCPStore every agent hosts on its data address), at most
  ``connect_timeout_s`` each, every ``interval_s``;
* ``unreachable()`` is the set of peers whose last probe failed; the agent writes it to
  ``reach/<node>`` (``ReachRecord``, under its lease) while it is not empty, and deletes it after;
* once a peer is unreachable it stays probed, armed or not, until it answers again, so a report
  lasts as long as the cut, and a heal clears it within one interval: the leader neither drops a
  healed node for good nor takes a cut one back while the cut lasts;
* in steady state (no stall, every peer reachable) it sends nothing; ``stop`` joins the thread
  within its timeout.

The leader (``leader.snapshot``) takes a node for cut off when a strict majority of the other
planned nodes cannot reach it, and no decision is made when that would drop half the nodes or
more (two nodes that lose each other cannot tell which one is cut).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Mapping, Optional

log = logging.getLogger(__name__)

Connect = Callable[[tuple[str, int], float], object]


def _connect(address: tuple[str, int], timeout: float) -> None:
    with socket.create_connection(address, timeout=timeout):
        pass


def split_endpoint(endpoint: str) -> Optional[tuple[str, int]]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class ReachProbe:
    """Probes peers' endpoints from one background thread (see the module docstring)."""

    def __init__(self, node: str, interval_s: float = 1.0, connect_timeout_s: float = 1.0,
                 connect: Connect = _connect):
        if interval_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"interval_s ({interval_s}) and connect_timeout_s "
                             f"({connect_timeout_s}) must be > 0")
        self.node = node
        self.interval_s, self.connect_timeout_s = interval_s, connect_timeout_s
        self._connect = connect
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._armed = False
        self._peers: dict[str, str] = {}
        self._unreachable: set[str] = set()
        self._thread: Optional[threading.Thread] = None
        self.rounds = 0  # probe rounds run (tests, logs)

    def update(self, armed: bool, peers: Mapping[str, str]) -> None:
        """Tell the probe whether a local worker stalls and who the peers are (node ->
        ``host:port``); starts the thread on first need."""
        with self._lock:
            self._armed = armed
            self._peers = {n: e for n, e in peers.items() if n != self.node and e}
            self._unreachable &= set(self._peers)
            active = armed or bool(self._unreachable)
        if active:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"reach-probe-{self.node}")
                self._thread.start()
            self._wake.set()

    def unreachable(self) -> frozenset:
        with self._lock:
            return frozenset(self._unreachable)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                targets = dict(self._peers) if self._armed else {
                    n: e for n, e in self._peers.items() if n in self._unreachable}
            if not targets:
                self._wake.wait(self.interval_s * 10)
                self._wake.clear()
                continue
            failed = {n for n, e in sorted(targets.items()) if not self._probe(e)}
            self.rounds += 1
            with self._lock:
                before = set(self._unreachable)
                self._unreachable = (self._unreachable - set(targets)) | failed
                after = set(self._unreachable)
            if after != before:
                log.warning("node %s: peers unreachable over the data network: %s", self.node,
                            ", ".join(sorted(after)) or "none (all answer again)")
            self._stop.wait(self.interval_s)

    def _probe(self, endpoint: str) -> bool:
        address = split_endpoint(endpoint)
        if address is None:
            return True  # nothing to probe: no evidence against the peer
        try:
            self._connect(address, self.connect_timeout_s)
            return True
        except OSError:
            return False
