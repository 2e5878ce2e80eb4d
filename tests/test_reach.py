"""``launcher.node.elastic.reach.ReachProbe`` against real sockets on loopback: a peer that listens, one
whose port refuses, a heal (the port listens again), and silence in steady state."""

from __future__ import annotations

import socket
import threading

import pytest

from _wait import never, wait_for
from launcher.node.elastic.reach import ReachProbe, split_endpoint

pytestmark = pytest.mark.timeout(30)


def listener(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def test_unreachable_peers_are_reported_while_armed_and_until_they_answer_again():
    live = listener()
    dead = listener()
    dead_port = dead.getsockname()[1]
    dead.close()  # nobody listens there: connections are refused
    peers = {"b": f"127.0.0.1:{live.getsockname()[1]}", "c": f"127.0.0.1:{dead_port}",
             "self": "127.0.0.1:1"}
    probe = ReachProbe("self", interval_s=0.05, connect_timeout_s=0.5)
    try:
        probe.update(False, peers)
        assert probe.rounds == 0 and probe.unreachable() == frozenset()  # not armed: silent
        probe.update(True, peers)
        wait_for(lambda: probe.unreachable() == {"c"}, 10, "c unreachable")
        probe.update(False, peers)  # the worker got a plan: only c is still probed
        rounds = probe.rounds
        wait_for(lambda: probe.rounds >= rounds + 3, 10, "three more probe rounds")
        assert probe.unreachable() == {"c"}
        healed = listener(dead_port)  # the link is back
        try:
            wait_for(lambda: probe.unreachable() == frozenset(), 10, "every peer reachable")
            rounds = probe.rounds
            never(lambda: probe.rounds > rounds + 1, 0.5, "more probe rounds")  # steady: no probing
        finally:
            healed.close()
    finally:
        probe.stop(5.0)
        live.close()
    assert not any(t.name == "reach-probe-self" for t in threading.enumerate())


def test_endpoints_and_arguments_are_checked():
    assert split_endpoint("10.78.3.12:29500") == ("10.78.3.12", 29500)
    assert split_endpoint("[::1]:80") == ("::1", 80)
    assert split_endpoint("no-port") is None
    with pytest.raises(ValueError, match="interval_s"):
        ReachProbe("n", interval_s=0)
