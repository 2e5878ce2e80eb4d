"""Prometheus metrics of a job, derived from its etcd state (prometheus-client).

Promises:

* ``JobCollector`` is a custom ``Collector`` over a view source (a ``JobStateCache``'s ``view``):
  every scrape reads the current view; there is no global registry state and no background
  thread; ``exposition(make_registry(...))`` renders the text format served at ``/metrics``;
* counters come from the job's event journal (which only grows), so they move when a switch is
  recorded and survive a dashboard restart; gauges are the current state;
* every sample carries a ``job`` label; metric names are listed in docs/operations.md;
* per-worker and per-device gauges (busy time, speeds) have one sample per worker or device of
  the view and only for values it knows (a busy time > 0, a speed not None): their label values
  are node ids and device ids the view took from validated keys and plan devices, never free
  text from a record, so they stay bounded in number and length.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from launcher.ops.view import JobView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class JobCollector(Collector):
    """Metrics of one job, read from ``view_source()`` at every scrape."""

    def __init__(self, view_source: Callable[[], JobView]):
        self._view_source = view_source

    def collect(self):
        view = self._view_source()
        job = view.job
        c = view.counters
        yield _counter("hspmd_switches", "Graph switches completed (switch-done events).",
                       job, c["total"])
        yield _counter("hspmd_switch_failures", "Graph switches that failed.", job, c["failed"])
        yield _counter("hspmd_switch_seconds", "Seconds spent in completed graph switches.",
                       job, c["seconds_total"])
        yield _counter("hspmd_switch_bytes_moved", "Bytes resharded by graph switches.",
                       job, c["bytes_moved_total"])
        yield _counter("hspmd_leader_changes",
                       "Leader terms seen by this reader (each new leader counts once).",
                       job, c["leader_changes"])
        events = CounterMetricFamily("hspmd_events", "Events in the job's journal, by type.",
                                     labels=["job", "type"])
        for etype, count in sorted(c["events_by_type"].items()):
            events.add_metric([job, etype], count)
        yield events
        tp = view.throughput
        yield _gauge("hspmd_steps_per_second",
                     "Training steps per second (mean over the workers at the highest step).", job,
                     tp["steps_per_s"] or 0.0)
        yield _gauge("hspmd_step", "Highest training step any worker completed.", job,
                     tp["step"] or 0)
        yield _gauge("hspmd_workers", "Worker processes with a live heartbeat record.", job,
                     tp["workers"])
        devices = GaugeMetricFamily("hspmd_devices", "Devices by health.",
                                    labels=["job", "health"])
        for health, count in view.device_counts().items():
            devices.add_metric([job, health], count)
        yield devices
        nodes = GaugeMetricFamily("hspmd_nodes", "Nodes by state (lost: record gone).",
                                  labels=["job", "state"])
        states: dict[str, int] = {}
        for node in view.nodes:
            states[node.state] = states.get(node.state, 0) + 1
        for state, count in sorted(states.items()):
            nodes.add_metric([job, state], count)
        yield nodes
        busy = GaugeMetricFamily(
            "hspmd_worker_busy_seconds",
            "A worker's own compute per step (median of its plan's recent steps, waits on peers "
            "left out); absent until measured.", labels=["job", "node", "local_rank"])
        speeds = GaugeMetricFamily(
            "hspmd_device_speed", "A device's speed: planned (the current plan's inventory, "
            "1.0 nominal) or measured (the newest speeds event of the plan, 1.0 the fastest).",
            labels=["job", "device", "source"])
        for node in view.nodes:
            for w in node.workers:
                if w.busy_s > 0:
                    busy.add_metric([job, node.id, str(w.local_rank)], w.busy_s)
            for d in node.devices:
                for source, value in (("planned", d.planned_speed),
                                      ("measured", d.measured_speed)):
                    if value is not None:
                        speeds.add_metric([job, d.id, source], value)
        yield busy
        yield speeds
        yield _gauge("hspmd_plan_version", "Version of plan/current (0: no plan published).",
                     job, view.plan.version if view.plan else 0)
        yield _gauge("hspmd_last_switch_seconds", "Duration of the last completed switch.", job,
                     c["last_seconds"] or 0.0)
        yield _gauge("hspmd_leader_present", "1 while a leader key exists.", job,
                     1 if view.leader else 0)
        yield _gauge("hspmd_etcd_revision", "etcd revision the state reflects.", job,
                     view.revision)


def _counter(name: str, doc: str, job: str, value: float) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=["job"])
    fam.add_metric([job], value)
    return fam


def _gauge(name: str, doc: str, job: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=["job"])
    fam.add_metric([job], value)
    return fam


def make_registry(view_source: Callable[[], JobView]) -> CollectorRegistry:
    """A private registry holding only the job's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(view_source))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
