"""VerdictPublisher against a real etcd, the leader's summary, and select_health_source."""

from __future__ import annotations

import pynvml
import pytest

from hspmd_elastic.coord.api import EtcdUnavailableError
from hspmd_elastic.contract.schema import DeviceHealthRecord, decode, device_key
from launcher.health.api import HealthConfigError, Verdict
from launcher.health.fake_nvml import FakeNvml, fake_gpus
from launcher.health.nvml import NvmlHealthSource
from launcher.health.scripted import ScriptedHealthSource
from launcher.health.verdicts import (
    VerdictPublisher,
    read_device_health,
    select_health_source,
    summarize_device_health,
)
from _clock import FakeClock


@pytest.fixture
def client_timeout():
    return 5.0  # per call of the ``client`` fixture (conftest), instead of 1 s


def test_publishes_only_changes_as_schema_records(client):
    mono, wall = FakeClock(100.0), FakeClock(1_700_000_000.0)
    pub = VerdictPublisher(client, "job1", "node-a", clock=mono, wall_clock=wall)
    healthy = {0: Verdict.healthy(at=90.0), 1: Verdict.healthy(at=90.0)}
    assert pub.publish(healthy) == [0, 1]
    rec = decode(device_key("job1", "node-a", 0), client.get(device_key("job1", "node-a", 0)).value)
    assert rec == DeviceHealthRecord(state="healthy", reason="", xid=None, slowdown=None,
                                     at=1_700_000_000.0 - 10.0)
    mono.t += 5
    assert pub.publish({0: Verdict.healthy(at=95.0), 1: Verdict.healthy(at=90.0)}) == []
    failed = Verdict.failed("Xid 79: gone", xid=79, at=104.0)
    assert pub.publish({0: healthy[0], 1: failed}) == [1]
    raw = client.get(device_key("job1", "node-a", 1)).value
    assert b'"schema":2' in raw and b'"state":"failed"' in raw and b'"xid":79' in raw


def test_republishes_under_a_new_lease(client):
    lease = client.grant(5)
    pub = VerdictPublisher(client, "job1", "node-a", lease=lambda: lease)
    assert pub.publish({0: Verdict.healthy()}) == [0]
    assert client.get(device_key("job1", "node-a", 0)).lease == lease
    client.revoke(lease)
    assert client.get(device_key("job1", "node-a", 0)) is None
    lease = client.grant(5)
    assert pub.publish({0: Verdict.healthy()}) == []  # nothing changed ...
    pub.republish_all()  # ... until the agent says its lease was re-granted
    assert pub.publish({0: Verdict.healthy()}) == [0]
    assert client.get(device_key("job1", "node-a", 0)).lease == lease


class FlakyClient:
    """Stands in for EtcdClient.put: fails while ``down``."""

    def __init__(self):
        self.down = False
        self.puts: list[str] = []

    def put(self, key, value, lease=0, timeout=None):
        if self.down:
            raise EtcdUnavailableError("put: no etcd member reachable")
        self.puts.append(key)
        return 1


def test_outage_stops_the_round_and_everything_is_rewritten_after(caplog):
    flaky = FlakyClient()
    pub = VerdictPublisher(flaky, "job1", "n", clock=FakeClock(0), wall_clock=FakeClock(0))
    verdicts = {i: Verdict.healthy() for i in range(4)}
    assert pub.publish(verdicts) == [0, 1, 2, 3]
    flaky.down = True
    verdicts[2] = Verdict.failed("lost")
    assert pub.publish(verdicts) == []
    assert pub.publish(verdicts) == []
    warnings = [r for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(warnings) == 1
    flaky.down = False
    assert pub.publish(verdicts) == [0, 1, 2, 3]


def test_leader_view_failed_is_lost_degraded_is_slower(client):
    for node, verdicts in (("a", {0: Verdict.failed("Xid 48: dbe", xid=48),
                                  1: Verdict.degraded("thermal", 0.6)}),
                           ("b", {0: Verdict.degraded("thermal", None),
                                  1: Verdict.healthy()})):
        VerdictPublisher(client, "job2", node).publish(verdicts)
    records = read_device_health(client, "job2")
    assert set(records) == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}
    summary = summarize_device_health(records, default_slowdown=0.8)
    assert summary.failed == {("a", 0): "Xid 48: dbe"}
    assert summary.slowdown == {("a", 1): 0.6, ("b", 0): 0.8}
    assert summary.unknown_slowdown == {("b", 0)}


def test_nvml_xids_reach_the_leader_as_drain_or_failure(client):
    """Driver Xids through FakeNvml, NvmlHealthSource and etcd to the leader's summary: 63 and 92
    drain the device (suspect), 48, 79 and 95 fail it, 13 alone changes nothing."""
    xids = [63, 92, 48, 79, 95, 13]
    fake = FakeNvml(fake_gpus(len(xids)))
    mono = FakeClock(100.0)
    source = NvmlHealthSource(fake, mono, event_thread=False, event_timeout_ms=20)
    source.start()
    for index, xid in enumerate(xids):
        fake.push_event(index, pynvml.nvmlEventTypeXidCriticalError, xid)
        assert source.wait_for_event()
    VerdictPublisher(client, "job3", "a", clock=mono).publish(source.poll(mono()))
    records = read_device_health(client, "job3")
    summary = summarize_device_health(records)
    assert summary.suspect == {("a", 0): "Xid 63 (row remap pending: reset when convenient)",
                               ("a", 1): "Xid 92 (high single-bit ECC error rate: data still "
                                         "correct, the memory is wearing out)"}
    assert sorted(summary.failed) == [("a", 2), ("a", 3), ("a", 4)]
    assert [records["a", i].xid for i in range(5)] == xids[:5]
    assert records["a", 5].state == "healthy"
    source.stop()


# ----------------------------------------------------------------------------- selection
def test_select_sources(tmp_path):
    assert select_health_source("none").name == "none"
    fake = FakeNvml(fake_gpus(1))
    assert isinstance(select_health_source("auto", nvml=fake), NvmlHealthSource)
    assert fake.initialized == 0  # the probe shut NVML down again
    assert isinstance(select_health_source("nvml", nvml=fake), NvmlHealthSource)
    missing = FakeNvml(fake_gpus(1), driver_missing=True)
    assert select_health_source("auto", nvml=missing).name == "none"
    script = tmp_path / "faults.json"
    script.write_text('[{"at": 0, "device": 1, "kind": "lost"}]')
    src = select_health_source(f"scripted:{script}", devices=2, node="n0")
    assert isinstance(src, ScriptedHealthSource) and len(src.devices()) == 2


@pytest.mark.parametrize("spec,message", [
    ("gpu", "unknown health source 'gpu': use one of auto, nvml, none, scripted:<path>"),
    ("scripted:", "unknown health source 'scripted:'"),
    ("scripted:/no/such/file", "fault script '/no/such/file' is not a readable file"),
    ("scripted:etcd", "needs the job's etcd endpoints and job id"),
])
def test_bad_source_specs_are_named(spec, message):
    with pytest.raises(HealthConfigError) as err:
        select_health_source(spec)
    assert message in str(err.value)


def test_parse_health_source_is_pure():
    from launcher.health import parse_health_source

    assert parse_health_source("auto") == ("auto", "")
    assert parse_health_source(" scripted:/tmp/f.jsonl ") == ("scripted", "/tmp/f.jsonl")
    assert parse_health_source("scripted:etcd") == ("scripted", "etcd")
    with pytest.raises(HealthConfigError, match="unknown health source 'NVML'"):
        parse_health_source("NVML")
