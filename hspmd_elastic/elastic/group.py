"""Forming the process group of a plan version, and leaving the previous one.

The plan names a TCPStore server (hosted by a surviving node agent) and each version uses its own
key prefix ``hspmd/v<version>/``, so generations never mix. Forming a group is: destroy whatever
group this process had (on gloo, destroy + a new init in the same process works even after an
abandoned collective, in milliseconds), meet the plan's other ranks at a barrier on the store that
this process polls (so a newer plan or a deadline interrupts it: no rank ever blocks inside
``init_process_group`` waiting for a peer that will not come), then ``init_process_group``.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, Optional

import torch.distributed as dist

from hspmd_elastic.elastic.api import ConfigurationError, ElasticError

log = logging.getLogger(__name__)

_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05


class RegroupAborted(ElasticError):
    """A newer plan appeared while meeting the peers of this one."""


class RegroupTimeout(ElasticError):
    """The plan's ranks did not all arrive before the deadline."""


class StoreUnreachable(ElasticError):
    """The plan's store cannot be reached (its host died): a newer plan will name another."""


def version_prefix(version: int) -> str:
    return f"hspmd/v{version}/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigurationError(f"store endpoint {endpoint!r} must be 'host:port'")
    return host, int(port)


class GroupFormer:
    """Owns this process's connection to the plan's store and its default process group."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._stores: dict[str, dist.Store] = {}
        self.store: Optional[dist.Store] = None  # the current version's PrefixStore

    def _client(self, endpoint: str) -> dist.Store:
        if endpoint not in self._stores:
            host, port = parse_endpoint(endpoint)
            try:
                self._stores[endpoint] = dist.TCPStore(
                    host, port, None, False,
                    timeout=datetime.timedelta(seconds=self.connect_timeout_s))
            except (RuntimeError, OSError) as exc:
                raise StoreUnreachable(f"cannot reach the plan's store at {endpoint}: "
                                       f"{exc}") from exc
        return self._stores[endpoint]

    def leave(self) -> float:
        """Destroy the current process group (and its sub-groups); returns the seconds spent."""
        start = time.monotonic()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as exc:  # a group broken by a dead peer still goes away
                log.warning("destroying the old process group raised (%s); continuing", exc)
        self.store = None
        return time.monotonic() - start

    def form(self, version: int, endpoint: str, rank: int, world: int,
             aborted: Callable[[], bool], deadline: float) -> None:
        """Leave the old group and form plan ``version``'s: ``rank`` of ``world``."""
        self.leave()
        store = dist.PrefixStore(version_prefix(version), self._client(endpoint))
        try:
            store.set(f"arrive/{rank}", "1")
        except RuntimeError as exc:
            self._stores.pop(endpoint, None)
            raise StoreUnreachable(f"plan v{version}: the store at {endpoint} failed: "
                                   f"{exc}") from exc
        wait_keys(store, [f"arrive/{r}" for r in range(world)], aborted, deadline,
                  f"plan v{version}: ranks arriving")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        self.store = store


def wait_keys(store: dist.Store, keys: list[str], aborted: Callable[[], bool], deadline: float,
              what: str) -> None:
    """Poll until every key exists on ``store``; ``RegroupAborted`` / ``RegroupTimeout``."""
    delay = _POLL_FIRST_S
    while True:
        try:
            if store.check(keys):
                return
        except RuntimeError as exc:
            raise StoreUnreachable(f"{what}: the store failed: {exc}") from exc
        if aborted():
            raise RegroupAborted(f"{what}: a newer plan was published")
        if time.monotonic() >= deadline:
            missing = [k for k in keys if not store.check([k])]
            raise RegroupTimeout(f"{what}: still missing {missing} at the deadline")
        time.sleep(delay)  # polling a remote store: there is nothing to wait on locally
        delay = min(delay * 2, _POLL_MAX_S)
