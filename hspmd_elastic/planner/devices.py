"""Device types and inventories: the built-in spec table and the ways to build an inventory.

The table holds dense BF16 peak TFLOP/s, memory, and per-device bandwidth inside a node and
across nodes for H100, H200, H800, A100 (SXM), their PCIe and NVL cards (H100-PCIe, H100-NVL,
H200-NVL, H800-PCIe, A100-PCIe), H20, L40S and a CPU worker. Users extend it with
``register_device_type`` or by passing ``types=`` (a name -> ``DeviceSpec`` mapping) to the
builders, which never mutate the table they are given.

Names as the NVIDIA driver gives them (``"NVIDIA H100 80GB HBM3"``, or the agent's type
``"H100-80GB-HBM3"``, ``"A100-SXM4-80GB"``, ``"H200-NVL"``) map to a table entry by
``known_type``: the whole name, else, at the first dash- or blank-separated word where one
starts, the longest run of words that is an entry (``"H200 NVL"`` -> ``H200-NVL``), that word
with a later one (``"H100 80GB PCIe"`` -> ``H100-PCIe``), or that word alone (``"H200"``).
``spec_for_device`` (the leader's inventory of real devices) gives an unknown GPU the
conservative ``generic_gpu_spec`` under its own name and logs a warning naming it once; typed
inventories (``inventory_from_nodes``, ``hspmd-launch plan --devices``) accept the same names and
still refuse unknown ones.

An inventory comes from a node list such as ``"8xH800,8xH800,16xH20"`` (one item per node, ids
assigned in order) or from a JSON object (``inventory_from_dict``). Unknown type names and
malformed items raise ``PlannerError`` naming the bad value and the valid ones.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any, Mapping, Optional

from hspmd_elastic.planner.api import GiB, Device, DeviceSpec, Health, Inventory, PlannerError

# mfu: the share of peak a training step reaches. The H20 is compute-light and bandwidth-rich, so
# it reaches a larger share of its (small) peak than an H800 does.
BUILTIN_SPECS: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", 989.0, 80 * GiB, 450.0, 50.0, mfu=0.45),
    # H100's compute with 141 GB of HBM3e (NVML reports about 140 GiB).
    "H200": DeviceSpec("H200", 989.0, 141 * GiB, 450.0, 50.0, mfu=0.45),
    "H800": DeviceSpec("H800", 989.0, 80 * GiB, 200.0, 50.0, mfu=0.45),
    # PCIe cards: lower clocks and power than the SXM part. NVLink bridges join only pairs (H100
    # PCIe, H800 PCIe) or 2-4 cards (NVL), so the figure inside a node is PCIe Gen5 x16 (64 GB/s
    # each way), what any two of the node's GPUs get; bridged peers are faster.
    "H100-PCIe": DeviceSpec("H100-PCIe", 756.0, 80 * GiB, 64.0, 50.0, mfu=0.45),
    "H100-NVL": DeviceSpec("H100-NVL", 835.0, 94 * GiB, 64.0, 50.0, mfu=0.45),
    "H200-NVL": DeviceSpec("H200-NVL", 835.0, 141 * GiB, 64.0, 50.0, mfu=0.45),
    "H800-PCIe": DeviceSpec("H800-PCIe", 756.0, 80 * GiB, 64.0, 50.0, mfu=0.45),
    "H20": DeviceSpec("H20", 148.0, 96 * GiB, 450.0, 50.0, mfu=0.65),
    "A100": DeviceSpec("A100", 312.0, 80 * GiB, 300.0, 25.0, mfu=0.5),
    # The SXM A100's compute, PCIe Gen4 x16 (32 GB/s each way) between GPUs.
    "A100-PCIe": DeviceSpec("A100-PCIe", 312.0, 80 * GiB, 32.0, 25.0, mfu=0.5),
    "L40S": DeviceSpec("L40S", 362.0, 48 * GiB, 32.0, 12.5, mfu=0.4),
    # One CPU training process (one thread): about 10 GFLOP/s on small matmuls, gloo over
    # loopback or TCP, a large fixed cost per micro-batch (Python, autograd) and per collective.
    # The collectives run on the worker's own CPU share (``host_links``): a worker at a quarter
    # core moves bytes and starts collectives at a quarter of the rate. Round numbers, not a
    # fit: ``--hspmd-device-types`` gives a job the constants measured on its machines
    # (``calibrate.fit_steps``). No type has a built-in cost per parameter element per step
    # (``update_s_per_param``, the optimizer update of a device's whole shard whatever its
    # rows): calibration fits it.
    "CPU": DeviceSpec("CPU", 0.01, 8 * GiB, 2.0, 0.5, mfu=1.0, microbatch_overhead_s=0.004,
                      link_latency_s=0.002, host_links=True),
}

_registered: dict[str, DeviceSpec] = {}
_warned_unknown: set[str] = set()
log = logging.getLogger(__name__)


def generic_gpu_spec(name: str) -> DeviceSpec:
    """A conservative spec for a GPU missing from the table (named ``name``): an A100's fifth
    of compute at a low share of peak, PCIe between GPUs, a slow NIC; the caller gives the
    memory the device reports. Plans then load it lightly rather than overload it."""
    return DeviceSpec(name, 60.0, 16 * GiB, 16.0, 6.25, mfu=0.35)


def register_device_type(spec: DeviceSpec) -> None:
    """Add (or replace) a device type for every later lookup in this process."""
    _registered[spec.name.upper()] = spec


def spec_table(types: Optional[Mapping[str, DeviceSpec]] = None) -> dict[str, DeviceSpec]:
    """The built-in specs, then registered ones, then ``types``; names are case-insensitive."""
    table = {k.upper(): v for k, v in BUILTIN_SPECS.items()}
    table.update(_registered)
    table.update({k.upper(): v for k, v in (types or {}).items()})
    return table


def known_type(name: str, table: Mapping[str, DeviceSpec]) -> Optional[str]:
    """The table key a device name means (``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``), or None."""
    text = str(name).strip().upper()
    if text in table:
        return text
    words = [w for w in re.split(r"[\s_-]+", text) if w]
    if words and words[0] == "NVIDIA":
        words = words[1:]
    for i, word in enumerate(words):
        runs = ["-".join(words[i:j]) for j in range(len(words), i + 1, -1)]  # longest first
        pairs = [f"{word}-{later}" for later in words[i + 2:]]  # "H100 80GB PCIE": H100-PCIE
        key = next((k for k in (*runs, *pairs, word) if k in table), None)
        if key is not None:
            return key
    return None


def lookup_spec(name: str, types: Optional[Mapping[str, DeviceSpec]] = None) -> DeviceSpec:
    table = spec_table(types)
    key = known_type(name, table)
    if key is None:
        raise PlannerError(f"unknown device type {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def spec_for_device(type_name: str, memory_bytes: Optional[int] = None,
                    types: Optional[Mapping[str, DeviceSpec]] = None,
                    speed: float = 1.0) -> DeviceSpec:
    """The spec of a device as a health source names it (``"H100-80GB-HBM3"``, ``"H20"``):
    the table entry ``known_type`` finds; an unknown name gets ``generic_gpu_spec`` under that
    name, with a warning naming it (once per name). Memory is taken from the device when given
    (NVML's measured total). ``speed`` (declared by the node, relative to the type's nominal)
    scales the peak FLOP/s and divides the fixed cost per micro-batch and the cost per
    parameter element per step (``update_s_per_param``), and on host-bound links
    (``DeviceSpec.host_links``) scales the link bandwidths and divides the latency; the spec
    is then named
    ``<type>@<speed>`` (``CPU@0.5``) so layouts tell the two kinds apart."""
    if not (isinstance(speed, (int, float)) and 0 < speed < float("inf")):
        raise PlannerError(f"device speed={speed!r} must be a number > 0")
    table = spec_table(types)
    key = known_type(type_name, table)
    if key is not None:
        spec = table[key]
    else:
        spec = generic_gpu_spec(str(type_name))
        if spec.name not in _warned_unknown:
            _warned_unknown.add(spec.name)
            log.warning("device type %r is not in the planner's table (%s): planned with a "
                        "conservative profile (%.0f TFLOP/s peak, %.0f%% of it, its reported "
                        "memory); register_device_type gives it its real one", spec.name,
                        ", ".join(sorted(table)), spec.peak_tflops, 100 * spec.mfu)
    if memory_bytes:
        spec = replace(spec, memory_bytes=int(memory_bytes))
    if speed != 1.0:
        links = {}
        if spec.host_links:  # the device's host moves its bytes: its links slow down with it
            links = dict(intra_node_gbps=spec.intra_node_gbps * speed,
                         inter_node_gbps=spec.inter_node_gbps * speed,
                         link_latency_s=spec.link_latency_s / speed)
        spec = replace(spec, name=f"{spec.name}@{speed:g}", peak_tflops=spec.peak_tflops * speed,
                       microbatch_overhead_s=spec.microbatch_overhead_s / speed,
                       update_s_per_param=spec.update_s_per_param / speed, **links)
    return spec


_NODE_ITEM = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z][A-Za-z0-9_.-]*)\s*$")


def inventory_from_nodes(text: str, types: Optional[Mapping[str, DeviceSpec]] = None) -> Inventory:
    """``"8xH800,8xH800,16xH20"``: one comma-separated item per node, ``[count x]type``.

    Nodes are named ``node0``, ``node1``...; device ids run from 0 in the order given.
    """
    items = [s for s in str(text).split(",")]
    if not any(s.strip() for s in items):
        raise PlannerError(f"devices={text!r} lists no node; expected e.g. '8xH800,16xH20'")
    devices, next_id = [], 0
    for index, item in enumerate(items):
        match = _NODE_ITEM.match(item)
        if not match:
            raise PlannerError(f"node item {item.strip()!r} in devices={text!r}; expected "
                               "COUNTxTYPE such as 8xH800")
        count = int(match.group(1) or 1)
        if count < 1:
            raise PlannerError(f"node item {item.strip()!r}: count must be >= 1")
        spec = lookup_spec(match.group(2), types)
        for _ in range(count):
            devices.append(Device(next_id, f"node{index}", spec))
            next_id += 1
    return Inventory(tuple(devices))


# the fields of a device type in JSON (``spec_from_dict``, ``device_types_from_dict``)
_SPEC_FIELDS = {"peak_tflops": float, "memory_gib": float, "intra_node_gbps": float,
                "inter_node_gbps": float, "mfu": float, "microbatch_overhead_s": float,
                "link_latency_s": float, "update_s_per_param": float, "host_links": bool}


def spec_from_dict(name: str, data: Mapping[str, Any]) -> DeviceSpec:
    """A device type from JSON: peak_tflops, memory_gib, intra_node_gbps, inter_node_gbps[, mfu,
    microbatch_overhead_s, link_latency_s, update_s_per_param, host_links]."""
    if not isinstance(data, Mapping):
        raise PlannerError(f"device type {name!r} must be a JSON object, got {data!r}")
    known = set(_SPEC_FIELDS)
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlannerError(f"device type {name!r}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return DeviceSpec(name, float(data["peak_tflops"]), int(float(data["memory_gib"]) * GiB),
                          float(data["intra_node_gbps"]), float(data["inter_node_gbps"]),
                          mfu=float(data.get("mfu", 0.5)),
                          microbatch_overhead_s=float(data.get("microbatch_overhead_s", 0.0005)),
                          link_latency_s=float(data.get("link_latency_s", 1e-5)),
                          update_s_per_param=float(data.get("update_s_per_param", 0.0)),
                          host_links=_flag(name, data.get("host_links", False)))
    except KeyError as exc:
        raise PlannerError(f"device type {name!r}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise PlannerError(f"device type {name!r}: {exc}") from None


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlannerError(f"device type {name!r}: host_links={value!r} must be true or false")
    return value


def device_types_from_dict(data: Any, types: Optional[Mapping[str, DeviceSpec]] = None
                           ) -> dict[str, DeviceSpec]:
    """Device types measured on a job's machines (``--hspmd-device-types``): ``{NAME: {field:
    value}}``. A NAME the table knows (``"CPU"``, ``"H100"``) keeps its type's other fields
    (``{"CPU": {"peak_tflops": 0.075, "microbatch_overhead_s": 0.08}}``: the constants
    ``calibrate.fit_steps`` fitted); a new NAME needs ``spec_from_dict``'s fields. A bad name,
    field or value is a ``PlannerError`` naming it."""
    if not isinstance(data, Mapping) or not data:
        raise PlannerError(f"device types must be a non-empty JSON object of NAME: {{field: "
                           f"value}}, got {data!r}")
    table = spec_table(types)
    out: dict[str, DeviceSpec] = {}
    for name, fields in data.items():
        if not isinstance(fields, Mapping):
            raise PlannerError(f"device type {name!r} must be a JSON object, got {fields!r}")
        key = known_type(str(name), table)
        if key is None:
            out[str(name)] = spec_from_dict(str(name), fields)
            continue
        unknown = sorted(set(fields) - _SPEC_FIELDS.keys())
        if unknown:
            raise PlannerError(f"device type {name!r}: unknown keys {unknown}; known: "
                               f"{sorted(_SPEC_FIELDS)}")
        changes = {}
        for field_, value in fields.items():
            kind = _SPEC_FIELDS[field_]
            if kind is bool:
                changes[field_] = _flag(str(name), value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlannerError(f"device type {name!r}: {field_}={value!r} must be a number")
            elif field_ == "memory_gib":
                changes["memory_bytes"] = int(float(value) * GiB)
            else:
                changes[field_] = float(value)
        out[key] = replace(table[key], **changes)  # DeviceSpec names a bad value
    return out


def inventory_from_dict(data: Any, types: Optional[Mapping[str, DeviceSpec]] = None) -> Inventory:
    """An inventory from JSON.

    ``{"types": {NAME: spec}, "nodes": "8xH800,16xH20"}`` or
    ``{"types": ..., "devices": [{"id": 0, "node": "n0", "type": "H800",
    "health": "healthy", "slowdown": 1.0}, ...]}``; ``types`` is optional.
    """
    if not isinstance(data, dict):
        raise PlannerError(f"inventory must be a JSON object, got {type(data).__name__}")
    custom = dict(types or {})
    for name, spec in (data.get("types") or {}).items():
        custom[name] = spec_from_dict(name, spec)
    if "nodes" in data:
        return inventory_from_nodes(data["nodes"], custom)
    if not isinstance(data.get("devices"), list):
        raise PlannerError("inventory JSON needs 'nodes' (e.g. '8xH800,16xH20') or a "
                           "'devices' list")
    devices = []
    for i, item in enumerate(data["devices"]):
        if not isinstance(item, dict) or not {"id", "node", "type"} <= set(item):
            raise PlannerError(f"inventory device #{i}: {item!r} needs id, node and type")
        try:
            health = Health(item.get("health", "healthy"))
        except ValueError:
            raise PlannerError(f"device {item['id']}: health={item.get('health')!r}; valid: "
                               f"{[h.value for h in Health]}") from None
        try:
            slowdown = float(item.get("slowdown", 1.0))
        except (TypeError, ValueError):
            raise PlannerError(f"device {item['id']}: slowdown={item.get('slowdown')!r} must be "
                               "a number >= 1") from None
        devices.append(Device(item["id"], str(item["node"]), lookup_spec(item["type"], custom),
                              health, slowdown))
    return Inventory(tuple(devices))


def cpu_inventory(ranks_per_node: Mapping[str, list[int]],
                  spec: Optional[DeviceSpec] = None) -> Inventory:
    """CPU workers as devices: ``{"node0": [0, 1], "node1": [2, 3]}`` (ids are global ranks)."""
    spec = spec or BUILTIN_SPECS["CPU"]
    return Inventory(tuple(Device(r, node, spec) for node, ranks in ranks_per_node.items()
                           for r in ranks))


def uniform_inventory(inventory: Inventory) -> Inventory:
    """The inventory as uniform SPMD sees it: every device that is not failed the same device,
    the weakest of them (the least effective FLOP/s, memory and bandwidths of any, no slowdown),
    so the planner's answer over it is the best uniform plan: one TP and PP degree everywhere,
    even layers and even rows (``hspmd-launch plan --uniform``, ``--hspmd-planner uniform``).
    Failed devices stay failed. Pure."""
    live = [d for d in inventory.devices if d.health is not Health.FAILED]
    if not live:
        return inventory
    slowest = min(live, key=lambda d: d.spec.peak_tflops * d.spec.mfu / d.slowdown)
    spec = replace(
        slowest.spec, name="uniform",
        peak_tflops=slowest.spec.peak_tflops / slowest.slowdown,
        memory_bytes=min(d.spec.memory_bytes for d in live),
        intra_node_gbps=min(d.link_gbps(False) for d in live),
        inter_node_gbps=min(d.link_gbps(True) for d in live),
        microbatch_overhead_s=max(d.spec.microbatch_overhead_s * d.slowdown for d in live),
        update_s_per_param=max(d.spec.update_s_per_param * d.slowdown for d in live),
        link_latency_s=max(d.link_latency_s for d in live),
        host_links=any(d.spec.host_links for d in live))
    return Inventory(tuple(
        d if d.health is Health.FAILED else replace(d, spec=spec, health=Health.HEALTHY,
                                                    slowdown=1.0)
        for d in inventory.devices))

