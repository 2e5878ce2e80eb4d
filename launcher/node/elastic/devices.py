"""A node's devices as the agent advertises them in ``nodes/<node>``.

In elastic mode a worker slot is a device: slot ``<index>`` of node ``<node_id>`` is device
``contract.device_id(node_id, index)`` (a GPU slot uses the CUDA ordinal of the same number).
``device_table`` is the node's stable table (index, type, memory, uuid, speed), from the health
source's accelerators when it sees some, else ``CPU`` slots; the memory and speed the node
declares (``--hspmd-device-memory``, ``--hspmd-device-speed``) replace what the devices report,
so the leader's planner sees the devices as declared. ``node_record`` is the record.

The accelerators come from NVML (``launcher.health.nvml``): index, name, UUID, total memory
and PCI bus id. The record's ``type`` is the driver's name as a type (``"H100-80GB-HBM3"``),
which the leader's planner maps to its device profile (``planner.spec_for_device``: a GPU it does
not know gets a conservative profile, with a warning naming it); ``device_table`` logs each GPU
with the profile it maps to, so that warning shows in this node's log when the agent starts.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.planner import spec_for_device

CPU_TYPE = "CPU"
log = logging.getLogger(__name__)


def inventory_lines(accelerators: Sequence[Any]) -> list[str]:
    """One line per GPU: index, name, memory, UUID, PCI bus id and the planner's profile."""
    lines = []
    for a in sorted(accelerators, key=lambda a: a.index):
        profile = spec_for_device(a.type, a.memory_bytes or None).name
        pci = getattr(a, "pci_bus_id", "") or "unknown"
        lines.append(f"GPU {a.index}: {a.name}, {a.memory_bytes / 2**30:.1f} GiB, {a.uuid}, "
                     f"PCI {pci}, planner profile {profile}")
    return lines


def device_table(node: str, count: int, device_type: str = CPU_TYPE,
                 accelerators: Optional[Sequence[Any]] = None, memory_bytes: int = 0,
                 speed: float = 1.0) -> list[schema.DeviceInfo]:
    """The node's worker slots as devices: from the health source's ``accelerators`` (their
    index, type, memory and uuid) when it sees some, else ``count`` slots of ``device_type``;
    ``memory_bytes`` (when > 0) and ``speed`` are what the node declares for each of them."""
    if not speed > 0:
        raise ValueError(f"node {node}: declared device speed {speed!r} must be > 0")
    if accelerators:
        for line in inventory_lines(accelerators):
            log.info("node %s: %s", node, line)
        return [schema.DeviceInfo(index=a.index, type=a.type,
                                  memory_bytes=memory_bytes or a.memory_bytes, uuid=a.uuid,
                                  speed=speed)
                for a in sorted(accelerators, key=lambda a: a.index)]
    if count < 1:
        raise ValueError(f"node {node}: need at least one worker slot, got {count}")
    return [schema.DeviceInfo(index=i, type=device_type, memory_bytes=memory_bytes,
                              uuid=device_id(node, i), speed=speed) for i in range(count)]


def node_record(host: str, devices: list[schema.DeviceInfo], state: str, started_at: float,
                store_endpoint: str = "", pid: Optional[int] = None) -> schema.NodeRecord:
    return schema.NodeRecord(host=host, agent_pid=os.getpid() if pid is None else pid,
                             devices=devices, state=state, started_at=started_at,
                             store_endpoint=store_endpoint)
