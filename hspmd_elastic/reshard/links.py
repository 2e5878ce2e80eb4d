"""The link model of an exchange: three classes of links, each host's NIC shared, a time estimate.

Link classes and the resources they use (each direction counted on its own):
* **same device**: a local copy, at ``same_device`` bytes/s on the device (``copy``);
* **same host**: device to device on one host (NVLink, PCIe, shared memory), at ``same_host``
  bytes/s out of the sender's port (``send``) and into the receiver's (``recv``);
* **cross host**: through the sending host's NIC (``out``) and the receiving host's (``in``), each
  ``nic`` bytes/s (``nic_of`` overrides it per host) and shared by every device of the host. A
  device may drive its host's whole NIC.

A device missing from the node map is a host of its own. The estimate of an exchange is fluid: all
transfers run at once and each resource is busy for its bytes over its bandwidth; the exchange
finishes when the busiest resource does (``exchange_time``). Message start-up (the
``*_latency`` fields) is left out of the estimate; the sender choice uses it only to not split
off shares that would take less than one start-up to move. Defaults come from the planner's
device profiles (``DeviceSpec.intra_node_gbps`` and ``inter_node_gbps``, in GB/s per device; the
NIC of a host of ``devices_per_host`` devices is their sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from hspmd_elastic.planner.devices import BUILTIN_SPECS
from hspmd_elastic.reshard.api import ReshardPlanError, Transfer

GB = 1e9
# A local copy reads and writes device memory; HBM3 moves about 3 TB/s, so a copy about half.
SAME_DEVICE_GBPS = 1500.0
DEVICES_PER_HOST = 8


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths in bytes/s: ``same_device`` (a local copy), ``same_host`` (per device, each
    direction), ``nic`` (per host, each direction, shared by its devices); ``nic_of`` overrides
    the NIC of named hosts, as ``((host, bytes_per_s), ...)``; ``cross_host_latency`` and
    ``same_host_latency``: the start-up cost of one message on each class, below which splitting
    a demand over one more sender of that class cannot finish sooner. Inside a host the default
    is 0 (NVLink or shared memory start in about a microsecond, far below any real share)."""

    same_device: float
    same_host: float
    nic: float
    nic_of: tuple[tuple[str, float], ...] = ()
    cross_host_latency: float = 1e-5  # start-up of one message between hosts (seconds)
    same_host_latency: float = 0.0  # start-up of one message inside a host (seconds)
    _nic_map: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nic_of", tuple(sorted((str(h), float(b))
                                                        for h, b in dict(self.nic_of).items())))
        for name in ("same_device", "same_host", "nic"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                raise ReshardPlanError(f"link model: {name}={value!r} must be a positive number "
                                       "of bytes/s")
        for name in ("cross_host_latency", "same_host_latency"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ReshardPlanError(f"link model: {name}={getattr(self, name)!r} must be >= 0 "
                                       "seconds")
        for host, value in self.nic_of:
            if not 0 < value < float("inf"):
                raise ReshardPlanError(f"link model: NIC of host {host!r} = {value!r} must be a "
                                       "positive number of bytes/s")
        object.__setattr__(self, "_nic_map", dict(self.nic_of))

    @classmethod
    def from_device_spec(cls, spec, devices_per_host: int = DEVICES_PER_HOST,
                         same_device_gbps: float = SAME_DEVICE_GBPS) -> "LinkModel":
        """From a planner ``DeviceSpec``: NVLink per device, the NIC as the host's devices' sum."""
        return cls(same_device_gbps * GB, spec.intra_node_gbps * GB,
                   spec.inter_node_gbps * GB * devices_per_host,
                   cross_host_latency=spec.link_latency_s)

    def host_nic(self, host: object) -> float:
        return self._nic_map.get(host, self.nic) if isinstance(host, str) else self.nic

    def capacity(self, resource: tuple) -> float:
        kind = resource[0]
        if kind == "copy":
            return self.same_device
        if kind in ("send", "recv"):
            return self.same_host
        return self.host_nic(resource[1])


DEFAULT_LINKS = LinkModel.from_device_spec(BUILTIN_SPECS["H100"])


def host_of(node_of: Mapping[int, str], device: int) -> object:
    """The host of ``device``: its node name, or a host of its own when the node is unknown."""
    node = node_of.get(device)
    return node if node is not None else ("device", device)


def route(src: int, dst: int, node_of: Mapping[int, str]) -> tuple[tuple, ...]:
    """The resources a transfer from ``src`` to ``dst`` uses."""
    if src == dst:
        return (("copy", dst),)
    hs, hd = host_of(node_of, src), host_of(node_of, dst)
    if hs == hd:
        return (("send", src), ("recv", dst))
    return (("out", hs), ("in", hd))


def resource_seconds(transfers: Iterable[Transfer], node_of: Mapping[int, str],
                     links: LinkModel) -> dict[tuple, float]:
    """Seconds each resource is busy for ``transfers`` (local copies included)."""
    load: dict[tuple, int] = {}
    for t in transfers:
        for r in route(t.src, t.dst, node_of):
            load[r] = load.get(r, 0) + t.nbytes
    return {r: b / links.capacity(r) for r, b in load.items()}


def exchange_time(schedule, node_of: Mapping[int, str], links: LinkModel = DEFAULT_LINKS) -> float:
    """The estimated seconds of ``schedule`` (a ``FusedSchedule``): its busiest resource's."""
    busy = resource_seconds(list(schedule.local) + list(schedule.transfers), node_of, links)
    return max(busy.values(), default=0.0)
