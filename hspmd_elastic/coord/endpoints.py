"""etcd endpoint lists: ``host:port[,host:port...]``, an IPv6 host in brackets.

Promises: ``parse_endpoints`` reads ``"h1:2379,[::1]:2379"`` into ``[("h1", 2379), ("::1",
2379)]`` (an optional ``http://``/``https://`` scheme dropped, an IPv6 host without its
brackets) and raises a one-line ``ValueError`` naming a bad entry (an empty list, a port out of
1..65535, an IPv6 address without brackets); ``format_endpoint`` writes one back, brackets
included, the form gRPC takes as a target. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``"h1:2379,[::1]:2379"`` -> ``[("h1", 2379), ("::1", 2379)]`` (an IPv6 host without its
    brackets; ``format_endpoint`` puts them back); ValueError names a bad entry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"etcd endpoints {spec!r} are empty: expected host:port[,host:port...]")
    out = []
    for entry in spec.split(","):
        out.append(_parse_one(entry.strip()))
    return out


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:2379``): what ``parse_endpoints``
    reads back, and the form gRPC takes as a target."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_one(entry: str) -> tuple[str, int]:
    text = entry
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    if text.startswith("["):  # [v6-address]:port
        host, sep, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if not sep or ":" not in host:
            raise ValueError(f"bad etcd endpoint {entry!r}: expected [ipv6-address]:port, "
                             "as in [::1]:2379")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"bad etcd endpoint {entry!r}: an IPv6 address needs brackets, as "
                             "in [::1]:2379")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"bad etcd endpoint {entry!r}: expected host:port with a port in 1..65535"
        )
    return host, int(port)


def _normalize_endpoints(endpoints: str | Iterable) -> list[tuple[str, int]]:
    if isinstance(endpoints, str):
        return parse_endpoints(endpoints)
    out = []
    for ep in endpoints:
        if isinstance(ep, str):
            out.extend(parse_endpoints(ep))
        else:
            host, port = ep
            out.append((str(host).strip("[]"), int(port)))
    if not out:
        raise ValueError("no etcd endpoints given: expected host:port[,host:port...]")
    return out
