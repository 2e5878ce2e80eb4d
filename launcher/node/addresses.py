"""This machine's addresses: whether a name or address is this machine's (both modes, and
``inject``), and the address a node advertises to the others when ``--local-addr`` is not given.

Promises: ``advertised_address`` keeps the host name unless the job may span hosts (at most
``max_nodes`` > 1, not standalone) and the name resolves to loopback only, as a stock
``/etc/hosts`` makes ``$(hostname)`` do; then it returns the address of the interface that
reaches etcd (a UDP ``connect()``: a routing lookup, no packet is sent), logged in one line, or,
when that is loopback too (etcd on this host's loopback: every node is on this host) or no route
exists, the name, with one warning line in the last case. Nothing here sends a packet.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Callable, Optional

import psutil

log = logging.getLogger(__name__)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (like torchrun's c10d ``is_host`` guess)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
             for addr in addrs}
    for ip in wanted:
        try:
            if ipaddress.ip_address(ip).is_loopback or ip in local:
                return True
        except ValueError:
            continue
    return False


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolves_to_loopback(name: str) -> bool:
    """Whether every address ``name`` resolves to is a loopback address (False when it does
    not resolve: nothing is known)."""
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(ips) and all(_is_loopback(ip) for ip in ips)


def address_toward(host: str, port: int) -> Optional[str]:
    """The address of this machine's interface that reaches ``host:port`` (None: no route).
    A UDP socket's ``connect()`` only looks the route up; nothing is sent."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0]).split("%")[0]
        except OSError:
            continue
    return None


def advertised_address(local_addr: Optional[str], hostname: str, max_nodes: int,
                       standalone: bool, etcd: tuple[str, int],
                       toward: Callable[[str, int], Optional[str]] = address_toward,
                       loopback: Callable[[str], bool] = resolves_to_loopback) -> Optional[str]:
    """What this node advertises (its records, stores, ``MASTER_ADDR``, gloo's interface):
    ``local_addr`` when given; else None (the host name, as before) unless the job may span
    hosts and ``hostname`` resolves to loopback only, where the address of the interface that
    reaches ``etcd`` (host, port) is picked (see the module docstring)."""
    if local_addr or standalone or max_nodes <= 1 or not loopback(hostname):
        return local_addr or None
    picked = toward(*etcd)
    where = f"etcd at {etcd[0]}:{etcd[1]}"
    if picked and not _is_loopback(picked):
        log.info("host name %s resolves to loopback: advertising %s to the other nodes (the "
                 "address of the interface that reaches %s; --local-addr chooses another)",
                 hostname, picked, where)
        return picked
    if picked is None:
        log.warning("host name %s resolves to loopback and no interface reaches %s: other "
                    "nodes cannot reach this one; give --local-addr ADDRESS", hostname, where)
    return None
