"""Verdicts to etcd, verdicts from etcd, and the choice of a health source.

* ``VerdictPublisher`` writes each device's verdict as a ``DeviceHealthRecord`` at
  ``devices/<node>/<index>`` (``contract.schema.device_key``) only when it changed; after a failed
  write, or after ``republish_all()`` (a new agent lease), it re-writes every device on the next
  call, so etcd converges to the source's current view whatever was missed;
* ``read_device_health`` / ``summarize_device_health`` give the leader its view: failed devices
  are lost, suspect ones are drained, degraded ones run at their ``slowdown`` (speed relative to
  nominal, 1.0 = nominal);
* ``EtcdFaultFeed`` feeds a ``ScriptedHealthSource`` from one etcd key per node;
* ``select_health_source(spec)`` turns ``--hspmd-health-source`` (``auto``, ``nvml``, ``none``,
  ``scripted:<path>``, ``scripted:etcd``) into a source; ``auto`` without a driver logs one line
  and returns a ``NullHealthSource``; a bad spec raises ``HealthConfigError``.

Record times (``at``) are wall-clock seconds (``time.time``) so that every host reads them alike;
verdict times are converted from the source's monotonic clock when written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.contract.schema import (
    DeviceHealthRecord,
    decode,
    devices_prefix,
    device_key,
    encode,
    fault_script_key as _schema_fault_script_key,
    match_key,
)
from launcher.health.api import (
    HEALTH_SOURCE_CHOICES,  # noqa: F401 (re-exported for the CLI's help)
    Clock,
    HealthConfigError,
    HealthSource,
    NullHealthSource,
    Verdict,
    parse_health_source,
)
from launcher.health.nvml import NvmlHealthSource, probe_nvml  # noqa: F401 (re-exported)
from launcher.health.scripted import FileFaultFeed, ScriptedHealthSource

log = logging.getLogger(__name__)

LeaseArg = Union[int, Callable[[], int]]


def fault_script_key(job: str, node: str) -> str:
    """Where an injector writes a node's fault script: ``/hspmd/v1/jobs/<job>/faults/<node>``."""
    return _schema_fault_script_key(job, node)


# ------------------------------------------------------------------------------------ publisher
class VerdictPublisher:
    """Writes a node's device verdicts to etcd, each only when it changed.

    ``client``: a ``coord`` ``EtcdClient`` (``put(key, value, lease=, timeout=)``). ``lease``: the
    agent's lease id, or a callable returning the current one (device keys vanish with the node).
    ``clock``/``wall_clock``: the sources' monotonic clock and the wall clock written in records.
    """

    def __init__(self, client: Any, job: str, node: str, *, lease: LeaseArg = 0,
                 clock: Clock = time.monotonic, wall_clock: Clock = time.time,
                 timeout: float = 2.0):
        device_key(job, node, 0)  # validate ids now, not on the first write
        self._client = client
        self._job = job
        self._node = node
        self._lease = lease
        self._clock = clock
        self._wall = wall_clock
        self._timeout = float(timeout)
        self._published: dict[int, Verdict] = {}
        self._failing = False

    def republish_all(self) -> None:
        """Forget what was written: the next ``publish`` writes every device (new lease)."""
        self._published.clear()

    def record(self, verdict: Verdict) -> DeviceHealthRecord:
        at = self._wall() - max(self._clock() - verdict.at, 0.0)
        return DeviceHealthRecord(state=verdict.state.value, reason=verdict.reason,
                                  xid=verdict.xid, slowdown=verdict.slowdown, at=round(at, 3),
                                  origin=verdict.origin)

    def publish(self, verdicts: Mapping[int, Verdict]) -> list[int]:
        """Write the verdicts that changed; returns the device indices written.

        A write that fails stops this round (etcd is likely down: no point waiting N timeouts)
        and is logged once per outage; everything is re-written once writes succeed again.
        """
        written = []
        lease = self._lease() if callable(self._lease) else self._lease
        for index, verdict in sorted(verdicts.items()):
            if verdict.same_as(self._published.get(index)):
                continue
            key = device_key(self._job, self._node, index)
            try:
                self._client.put(key, encode(self.record(verdict)), lease=lease,
                                 timeout=self._timeout)
            except CoordinationError as exc:
                if not self._failing:
                    log.warning("node %s: cannot publish device %d verdict (%s); will "
                                "re-publish all devices when etcd answers", self._node, index,
                                exc)
                self._failing = True
                self._published.clear()
                return written
            if self._failing:
                log.info("node %s: publishing device verdicts again", self._node)
                self._failing = False
            self._published[index] = verdict
            written.append(index)
            # "device": a GPU under NVML, a worker slot on a machine without one
            log.info("node %s device %d: %s", self._node, index, verdict.describe())
        return written


# ------------------------------------------------------------------------------------ leader view
@dataclass(frozen=True)
class DeviceHealthSummary:
    """What the planner needs: devices to drop, and the relative speed of the slow ones."""

    failed: dict[tuple[str, int], str] = field(default_factory=dict)
    slowdown: dict[tuple[str, int], float] = field(default_factory=dict)
    unknown_slowdown: frozenset = frozenset()
    suspect: dict[tuple[str, int], str] = field(default_factory=dict)  # -> the warning sign


def read_device_health(client: Any, job: str,
                       timeout: Optional[float] = None) -> dict[tuple[str, int], Any]:
    """Every device record of a job, keyed by (node, index); bad records are logged, skipped."""
    out: dict[tuple[str, int], Any] = {}
    for kv in client.get_prefix(devices_prefix(job), timeout=timeout):
        try:
            _, _, params = match_key(kv.key)
            out[(params["node_id"], int(params["index"]))] = decode(kv.key, kv.value)
        except CoordinationError as exc:
            log.warning("ignoring device record: %s", exc)
    return out


def summarize_device_health(records: Mapping[tuple[str, int], Any],
                            default_slowdown: float = 0.5) -> DeviceHealthSummary:
    """Failed -> lost (with the reason); suspect -> to drain (with the warning sign); degraded
    -> runs at ``slowdown`` of nominal speed (``default_slowdown`` when the source could not
    estimate it; such devices are also listed in ``unknown_slowdown``)."""
    failed, slow, unknown, suspect = {}, {}, set(), {}
    for where, rec in records.items():
        if rec.state == "failed":
            failed[where] = rec.reason
        elif rec.state == "suspect":
            suspect[where] = rec.reason
        elif rec.state == "degraded":
            if rec.slowdown is None:
                unknown.add(where)
            slow[where] = rec.slowdown if rec.slowdown is not None else default_slowdown
    return DeviceHealthSummary(failed, slow, frozenset(unknown), suspect)


# ------------------------------------------------------------------------------------ etcd feed
class EtcdFaultFeed:
    """The fault script stored at one etcd key (``fault_script_key(job, node)`` by default)."""

    def __init__(self, client: Any, key: str):
        self._client = client
        self.key = key
        self.where = f"etcd key {key}"

    def read(self, timeout: float) -> Optional[str]:
        kv = self._client.get(self.key, timeout=timeout)
        return None if kv is None else kv.value.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------ factory
def select_health_source(
    spec: str,
    *,
    node: str = "local",
    devices: int = 0,
    job: Optional[str] = None,
    etcd: Any = None,
    nvml: Any = None,
    clock: Clock = time.monotonic,
) -> HealthSource:
    """The health source ``spec`` names (``--hspmd-health-source``).

    ``devices``: how many devices a scripted source reports. ``job``/``etcd``: needed by
    ``scripted:etcd``. ``nvml``: the pynvml module to use (a stand-in in tests).
    """
    kind, target = parse_health_source(spec)
    if kind == "none":
        return NullHealthSource("health monitoring disabled (--hspmd-health-source none)")
    if kind == "nvml":
        return NvmlHealthSource(nvml, clock, node=node)
    if kind == "auto":
        why = probe_nvml(nvml)
        if why is None:
            return NvmlHealthSource(nvml, clock, node=node)
        log.warning("node %s: GPU health: %s; monitoring worker processes only (its devices "
                    "are worker slots)", node, why)
        return NullHealthSource(why)
    if target == "etcd":
        if etcd is None or job is None:
            raise HealthConfigError(
                "health source 'scripted:etcd' needs the job's etcd endpoints and job id")
        feed: Any = EtcdFaultFeed(etcd, fault_script_key(job, node))
    else:
        if not os.path.isfile(target):
            raise HealthConfigError(
                f"health source {spec!r}: fault script {target!r} is not a readable file")
        feed = FileFaultFeed(target)
    return ScriptedHealthSource(feed, devices, clock, node=node)
