"""Ids that cross processes: job and node ids, and device ids.

Promises:

* **job and node ids** are 1-128 characters from ``[A-Za-z0-9._-]``, starting with a letter or
  digit (``ID_RULE``): no ``/`` and no ``:``, so an id is one etcd key segment and the node part
  of a device id. ``ID_PATTERN`` is the rule as an unanchored regex (for key patterns),
  ``ID_RE`` the whole-string match (a trailing newline is refused too); ``is_id`` tests a
  value, ``check_id`` returns it or raises ``IdError`` naming ``what`` and the value. Every
  reader and writer of ids (etcd keys, the CLI, scenario files) uses these.
* **device ids**: a device (a worker slot) is ``"<node_id>:<index>"``; ``device_id`` makes one,
  ``parse_device_id`` reads one back or raises ``ValueError`` naming it, ``node_of`` is its
  node, ``device_sort_key`` orders devices by node, then index (``n0:2`` before ``n0:10``). In a
  published plan the ints of ``strategy`` index ``PlanRecord.devices``.
"""

from __future__ import annotations

import re
from typing import Any

from hspmd_elastic.contract.text import bounded

ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ID_RE = re.compile(rf"^{ID_PATTERN}\Z")
ID_RULE = "1-128 characters from [A-Za-z0-9._-], starting with a letter or digit"


class IdError(ValueError):
    """A value is not a valid id (one line naming what it is and the value)."""


def is_id(value: Any) -> bool:
    """True when ``value`` is a string that follows ``ID_RULE``."""
    return isinstance(value, str) and ID_RE.match(value) is not None


def check_id(value: Any, what: str) -> str:
    """``value`` when it is a valid id; ``IdError`` naming ``what`` and the value otherwise."""
    if not is_id(value):
        raise IdError(f"{what} {bounded(repr(value), 140)} is not valid: use {ID_RULE}")
    return value


# ----------------------------------------------------------------------------------- devices
def device_id(node: str, index: int) -> str:
    """The id of slot ``index`` of ``node``."""
    return f"{node}:{index}"


def parse_device_id(dev: str) -> tuple[str, int]:
    """``"<node_id>:<index>"`` -> ``(node_id, index)``; ValueError naming ``dev`` otherwise."""
    node, sep, index = str(dev).rpartition(":")
    if not sep or not node or not index.isdigit():
        raise ValueError(f"device id {bounded(repr(dev), 140)} is not <node_id>:<index>")
    return node, int(index)


def node_of(dev: str) -> str:
    """The node of device ``dev``."""
    return parse_device_id(dev)[0]


def device_sort_key(dev: str) -> tuple[str, int]:
    """Devices in node order, then index order (``n0:2`` before ``n0:10``)."""
    return parse_device_id(dev)
