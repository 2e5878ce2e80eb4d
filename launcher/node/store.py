"""The workers' store server a node agent hosts: a ``torch.distributed.TCPStore`` in the agent.

Restart mode hosts one per round on node 0 (``MASTER_ADDR``/``MASTER_PORT``); elastic mode hosts
one per agent, advertised in ``nodes/<node>``, and each plan names the live agent's store its
process groups use. Promises: port 0 binds a free port and ``endpoint`` names the bound one; a
failure to bind is a ``StoreHostError`` naming the address and the cause; torch is imported only
when a store is started.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from launcher.api import LaunchError

log = logging.getLogger(__name__)


class StoreHostError(LaunchError):
    """The agent could not host the workers' TCPStore (names the address and the cause)."""


class StoreServer:
    """A ``torch.distributed.TCPStore`` server hosted by this agent for the workers' groups."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._store: Any = None

    def start(self) -> "StoreServer":
        from torch.distributed import TCPStore  # torch: only a store's host needs it

        try:
            self._store = TCPStore(self.host, self.port, None, True,
                                   timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise StoreHostError(f"cannot host the workers' store on {self.host}:{self.port}: "
                                 f"{exc}") from exc
        self.port = int(self._store.port)
        log.info("hosting the workers' store at %s", self.endpoint)
        return self

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}" if self._store is not None else ""

    @property
    def store(self) -> Any:
        return self._store

    def close(self) -> None:
        self._store = None  # the server thread ends with the last reference
