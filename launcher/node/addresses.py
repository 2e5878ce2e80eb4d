"""Whether a host name or address is this machine's (both modes, and ``inject``)."""

from __future__ import annotations

import ipaddress
import socket

import psutil


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
