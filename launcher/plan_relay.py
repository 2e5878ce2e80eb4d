"""A node agent relays each plan's layout to its workers: one etcd read per node instead of one
per worker (``hspmd_elastic.contract.relay``; the workers' side is
``hspmd_elastic.elastic.plan_watch``).

Promise: ``relay_plan`` reads ``plan/layout`` once and, when it holds the plan of ``head`` (same
version and digest) or a newer one, writes its bytes to the node's relay file atomically. It
never raises for etcd, a bad value or the file: its workers then read ``plan/layout`` from etcd
themselves (it logs why), so it may run in the agent's loop. The read has the client's deadline.
"""

from __future__ import annotations

import logging

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.errors import CoordinationError
from hspmd_elastic.contract.relay import relay_file, write_relay
from hspmd_elastic.coord.client import EtcdClient

log = logging.getLogger(__name__)


def relay_plan(client: EtcdClient, job: str, head: schema.PlanHeadRecord,
               progress_dir: str) -> bool:
    """Write the layout of ``head``'s plan (or of a newer one) to the relay file of the workers
    whose progress files are in ``progress_dir``; True when it did."""
    key = schema.plan_layout_key(job)
    try:
        kv = client.get(key)
        layout = schema.decode(key, kv.value) if kv is not None else None
    except CoordinationError as exc:
        log.warning("[%s] plan v%d not relayed to the workers (they read etcd): %s", job,
                    head.version, exc)
        return False
    if layout is None or layout.version < head.version or (
            layout.version == head.version and layout.digest != head.digest):
        # A leader without layouts published this plan: the workers read plan/current.
        log.info("[%s] plan v%d not relayed: plan/layout holds %s", job, head.version,
                 f"v{layout.version}" if layout is not None else "nothing")
        return False
    try:
        write_relay(relay_file(progress_dir), kv.value)
    except OSError as exc:
        log.warning("[%s] plan v%d not relayed to the workers (they read etcd): %s", job,
                    layout.version, exc)
        return False
    return True
