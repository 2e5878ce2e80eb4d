"""Who may talk to the dashboard: the Host header it answers to and the bearer token it needs.

Promises:

* ``HostCheck`` accepts a request whose ``Host`` names the address the dashboard is bound to:
  that address itself, ``localhost`` when it is a loopback address, any address of this
  machine's interfaces when it is the wildcard (``0.0.0.0``), and every ``--allow-host`` name;
  the port in the header is not compared (a reverse proxy may use another). Anything else,
  including no ``Host`` at all, is refused: a page of another site that resolves its own name
  to this address (DNS rebinding) cannot read the dashboard through the visitor's browser;
* ``token_matches`` compares an ``Authorization: Bearer <token>`` header with the configured
  token in constant time (``hmac.compare_digest``);
* ``read_token(path)`` reads the token from a file (never from the command line, where every
  user of the machine sees it in the process list); ``TokenError`` names the file and what is
  wrong (unreadable, empty, shorter than ``MIN_TOKEN_CHARS``);
* ``is_loopback(host)``: True only when every address ``host`` resolves to is a loopback one.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from typing import Iterable, Optional

import psutil

MIN_TOKEN_CHARS = 16
WILDCARDS = ("", "0.0.0.0", "::")


class TokenError(ValueError):
    """The token file cannot serve as a bearer token (the message is one line)."""


def _addresses(host: str) -> list[str]:
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(host, None)]
    except (OSError, UnicodeError):
        return []


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address only."""
    if host in WILDCARDS:
        return False
    addrs = _addresses(host)
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addrs)
    except ValueError:
        return False


def host_name(header: Optional[str]) -> Optional[str]:
    """The name or address of a ``Host`` header, lowercased, without port or brackets."""
    if not header:
        return None
    value = header.strip().lower()
    if value.startswith("["):
        name, sep, _ = value[1:].partition("]")
        return name if sep else None
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".") or None


class HostCheck:
    """The ``Host`` values a dashboard bound to ``bind`` answers to."""

    def __init__(self, bind: str, allow: Iterable[str] = ()):
        names = {bind.lower()} if bind not in WILDCARDS else set()
        names.update(a.split("%")[0] for a in _addresses(bind) if bind not in WILDCARDS)
        if bind not in WILDCARDS and is_loopback(bind):
            names.update(("localhost", "127.0.0.1", "::1"))
        if bind in WILDCARDS:
            names.update(a.address.split("%")[0].lower()
                         for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family in (socket.AF_INET, socket.AF_INET6))
        names.update(h for h in (host_name(a) for a in allow) if h)
        self.names = frozenset(names)

    def allows(self, header: Optional[str]) -> bool:
        return host_name(header) in self.names


def token_matches(header: Optional[str], token: str) -> bool:
    """Whether ``header`` is ``Bearer <token>`` (constant-time comparison of the token)."""
    scheme, _, given = (header or "").strip().partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                               token.encode("utf-8")) and ok_scheme


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read token file {path}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise TokenError(f"token file {path} is empty")
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(f"token file {path} must hold one token of at least "
                         f"{MIN_TOKEN_CHARS} characters without spaces "
                         "(e.g. from: openssl rand -hex 32)")
    return token
