"""NvmlHealthSource on a scripted driver (FakeNvml); the no-driver case on the real pynvml."""

from __future__ import annotations

import logging
import threading

import pynvml
import pytest

from launcher.health.api import DeviceState, Verdict
from launcher.health.fake_nvml import FakeGpu, FakeNvml, fake_gpus
from launcher.health.nvml import NvmlHealthSource, device_type
from launcher.health.rules import (
    DRAIN_XIDS,
    FATAL_XIDS,
    THROTTLE_HW_POWER_BRAKE,
    THROTTLE_HW_THERMAL,
    classify_xid,
)
from launcher.health.verdicts import probe_nvml, select_health_source
from _clock import FakeClock

XID = pynvml.nvmlEventTypeXidCriticalError


def make(gpus, **kwargs):
    fake = FakeNvml(gpus)
    clock = FakeClock(100.0)
    kwargs.setdefault("event_thread", False)
    kwargs.setdefault("event_timeout_ms", 20)
    source = NvmlHealthSource(fake, clock, **kwargs)
    source.start()
    return fake, clock, source


# ----------------------------------------------------------------------------- inventory
def test_inventory_and_healthy_start():
    fake, clock, source = make(fake_gpus(2))
    devs = source.devices()
    assert [d.index for d in devs] == [0, 1]
    assert devs[0].name == "NVIDIA H100 80GB HBM3"
    assert devs[0].type == "H100-80GB-HBM3"
    assert devs[1].uuid == fake.gpus[1].uuid
    assert devs[0].memory_bytes == 80 * 1024**3
    verdicts = source.poll(clock())
    assert {i: v.state for i, v in verdicts.items()} == {0: DeviceState.HEALTHY,
                                                         1: DeviceState.HEALTHY}
    source.stop()
    assert fake.initialized == 0


def test_device_type_strips_vendor():
    assert device_type("NVIDIA A100-SXM4-80GB") == "A100-SXM4-80GB"
    assert device_type(" Tesla V100 ") == "Tesla-V100"
    assert device_type("") == "unknown"


def test_verdict_start_time_is_kept_while_unchanged():
    fake, clock, source = make(fake_gpus(1))
    first = source.poll(clock())[0]
    clock.t += 30
    assert source.poll(clock())[0].at == first.at


# ----------------------------------------------------------------------------- Xid events
@pytest.mark.parametrize("xid", sorted(FATAL_XIDS))
def test_fatal_xids_are_fatal(xid):
    assert classify_xid(xid).fatal


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 999])
def test_other_xids_are_informational(xid):
    assert not classify_xid(xid).fatal and not classify_xid(xid).drain


@pytest.mark.parametrize("xid", [63, 92])
def test_repair_pending_and_high_sbe_rate_xids_drain(xid):
    cls = classify_xid(xid)
    assert xid in DRAIN_XIDS and xid not in FATAL_XIDS
    assert cls.drain and not cls.fatal


def test_an_xid_in_both_tables_is_fatal():
    assert classify_xid(63, fatal={63: "site policy"}).fatal
    assert classify_xid(13, drain={13: "site policy"}).reason() == "Xid 13 (site policy)"


def test_fatal_xid_event_fails_device_and_sticks():
    fake, clock, source = make(fake_gpus(2))
    fake.push_event(1, XID, 79)
    assert source.wait_for_event()
    v = source.poll(clock())
    assert v[0].state is DeviceState.HEALTHY
    assert v[1].state is DeviceState.FAILED and v[1].xid == 79
    assert "fallen off the bus" in v[1].reason
    clock.t += 100  # nothing clears it
    assert source.poll(clock())[1].is_failed


@pytest.mark.parametrize("xid,words", [(48, "double-bit ECC"), (79, "fallen off the bus"),
                                        (95, "uncontained ECC")])
def test_fatal_xid_events_fail_the_device(xid, words):
    faults = []
    fake, clock, source = make(fake_gpus(2), on_fault=lambda i, v: faults.append((i, v.xid)))
    fake.push_event(0, XID, xid)
    assert source.wait_for_event()
    v = source.poll(clock())
    assert v[0].is_failed and v[0].xid == xid and v[0].reason.startswith(f"Xid {xid}: ")
    assert words in v[0].reason
    assert v[1].state is DeviceState.HEALTHY
    assert faults == [(0, xid)]


@pytest.mark.parametrize("xid,reason", [
    (63, "Xid 63 (row remap pending: reset when convenient)"),
    (92, "Xid 92 (high single-bit ECC error rate: data still correct, the memory is wearing out)"),
])
def test_one_drain_xid_makes_the_device_suspect_not_failed(xid, reason):
    faults = []
    fake, clock, source = make(fake_gpus(2), on_fault=lambda i, v: faults.append((i, v)))
    assert source.poll(clock())[1].state is DeviceState.HEALTHY
    fake.push_event(1, XID, xid)  # a single one: no burst needed
    assert source.wait_for_event()
    clock.advance(5.0)
    v = source.poll(clock())
    assert v[1].state is DeviceState.SUSPECT, v[1]
    assert (v[1].reason, v[1].xid, v[1].at) == (reason, xid, 100.0)
    assert v[0].state is DeviceState.HEALTHY
    assert faults == []  # not a failure: on_fault is for failures
    clock.advance(3600.0)  # sticky, and an informational Xid does not replace it
    fake.push_event(1, XID, 13)
    assert source.wait_for_event()
    assert source.poll(clock())[1] == v[1]
    fake.push_event(1, XID, 95)  # the fault it warned of: failed replaces suspect
    assert source.wait_for_event()
    assert source.poll(clock())[1].is_failed and faults[0][1].xid == 95


def test_drain_xid_after_a_failure_keeps_the_failure():
    fake, clock, source = make(fake_gpus(1))
    fake.push_event(0, XID, 79)
    fake.push_event(0, XID, 63)
    assert source.wait_for_event() and source.wait_for_event()
    assert source.poll(clock())[0].xid == 79 and source.poll(clock())[0].is_failed


def test_drain_xids_can_be_overridden():
    fake, clock, source = make(fake_gpus(2), fatal_xids={**FATAL_XIDS, 63: "site: fail it"},
                               drain_xids={})
    fake.push_event(0, XID, 63)
    fake.push_event(1, XID, 92)
    assert source.wait_for_event() and source.wait_for_event()
    v = source.poll(clock())
    assert v[0].is_failed and v[0].reason == "Xid 63: site: fail it"
    assert v[1].state is DeviceState.HEALTHY


def test_informational_xid_does_not_change_verdict():
    fake, clock, source = make(fake_gpus(1))
    fake.push_event(0, XID, 13)
    assert source.wait_for_event()
    assert source.poll(clock())[0].state is DeviceState.HEALTHY


def test_first_fatal_reason_wins():
    fake, clock, source = make(fake_gpus(1))
    fake.push_event(0, XID, 48)
    fake.push_event(0, XID, 79)
    assert source.wait_for_event() and source.wait_for_event()
    assert source.poll(clock())[0].xid == 48


def test_custom_fatal_list():
    fake, clock, source = make(fake_gpus(1), fatal_xids={13: "test says fatal"})
    fake.push_event(0, XID, 79)
    fake.push_event(0, XID, 13)
    source.wait_for_event()
    source.wait_for_event()
    assert source.poll(clock())[0].xid == 13


def test_double_bit_and_unavailable_events_fail():
    gpus = fake_gpus(2, supported_events=pynvml.nvmlEventTypeAll)
    fake, clock, source = make(gpus)
    fake.push_event(0, pynvml.nvmlEventTypeDoubleBitEccError)
    fake.push_event(1, pynvml.nvmlEventTypeGpuUnavailableError)
    fake.push_event(1, pynvml.nvmlEventTypeSingleBitEccError)
    for _ in range(3):
        assert source.wait_for_event()
    v = source.poll(clock())
    assert "double-bit" in v[0].reason and v[1].is_failed


def test_event_wait_errors_are_survived():
    fake, clock, source = make(fake_gpus(1), event_error_backoff_s=0.001)
    fake.push_wait_error(pynvml.NVML_ERROR_UNKNOWN)
    assert source.wait_for_event() is False
    assert source.wait_for_event() is False  # timeout: nothing queued
    fake.push_event(0, XID, 95)
    assert source.wait_for_event()
    assert source.poll(clock())[0].xid == 95


def test_event_thread_reports_fault_and_stops_promptly():
    faults = []
    seen = threading.Event()

    def on_fault(index, verdict):
        faults.append((index, verdict))
        seen.set()

    fake, clock, source = make(fake_gpus(2), event_thread=True, event_timeout_ms=20,
                               on_fault=on_fault)
    fake.push_event(0, XID, 31)  # informational, handled first
    fake.push_event(1, XID, 94)
    assert seen.wait(10), "the event thread did not report the fatal Xid"
    assert [(i, v.xid) for i, v in faults] == [(1, 94)]
    assert source.poll(clock())[0].state is DeviceState.HEALTHY
    source.stop(timeout=10)
    assert not source.events_running
    assert fake.event_sets_freed == 1 and fake.initialized == 0
    assert fake.registered == {0: fake.gpus[0].supported_events, 1: fake.gpus[1].supported_events}


# ----------------------------------------------------------------------------- ECC, memory
def test_new_uncorrectable_ecc_errors_fail_the_device():
    gpus = fake_gpus(2)
    gpus[0].ecc_uncorrected_volatile = 2  # before the agent started: the baseline
    fake, clock, source = make(gpus)
    assert source.poll(clock())[0].state is DeviceState.HEALTHY
    gpus[0].ecc_uncorrected_volatile = 3
    v = source.poll(clock())
    assert v[0].is_failed and "1 new uncorrectable ECC error(s)" in v[0].reason
    assert "2 -> 3" in v[0].reason
    assert v[1].state is DeviceState.HEALTHY
    gpus[0].ecc_uncorrected_volatile = 0  # counters reset: still failed (sticky)
    assert source.poll(clock())[0].is_failed


def test_pending_memory_repairs_make_the_device_suspect():
    gpus = fake_gpus(3)
    gpus[1].retired_pages_pending = pynvml.NVML_FEATURE_ENABLED
    gpus[2].remapped_rows = (1, 0, 1, 0)
    fake, clock, source = make(gpus)
    v = source.poll(clock())
    assert v[0].state is DeviceState.HEALTHY
    assert v[1].is_suspect and "retired pages pending" in v[1].reason
    assert v[2].is_suspect and "row remapping pending" in v[2].reason


def test_rising_correctable_ecc_makes_the_device_suspect_then_a_failure_replaces_it():
    gpus = fake_gpus(2)
    gpus[0].ecc_corrected_volatile = 40  # from an earlier job: the base
    fake, clock, source = make(gpus)
    assert source.poll(clock())[0].state is DeviceState.HEALTHY
    gpus[0].ecc_corrected_volatile = 139  # 99 new: not yet
    assert source.poll(clock())[0].state is DeviceState.HEALTHY
    gpus[0].ecc_corrected_volatile = 140
    v = source.poll(clock())
    assert v[0].is_suspect and "100 new correctable ECC error(s) (volatile count 40 -> 140)" \
        in v[0].reason
    assert v[1].state is DeviceState.HEALTHY
    gpus[0].ecc_corrected_volatile = 0  # counters reset: still suspect (sticky)
    assert source.poll(clock())[0].is_suspect
    gpus[0].ecc_uncorrected_volatile = 1  # the fault it warned of: failed replaces suspect
    assert source.poll(clock())[0].is_failed


def test_a_burst_of_non_fatal_xids_makes_the_device_suspect():
    fake, clock, source = make(fake_gpus(2))
    for xid in (13, 31):
        fake.push_event(1, XID, xid)
        assert source.wait_for_event()
    assert source.poll(clock())[1].state is DeviceState.HEALTHY  # two: noise
    clock.advance(601.0)  # out of the window: forgotten
    fake.push_event(1, XID, 43)
    assert source.wait_for_event()
    assert source.poll(clock())[1].state is DeviceState.HEALTHY
    for xid in (13, 13):
        fake.push_event(1, XID, xid)
        assert source.wait_for_event()
    v = source.poll(clock())[1]
    assert v.is_suspect and v.reason == "3 non-fatal Xids within 600s (Xid 13, 43)"
    assert source.poll(clock())[0].state is DeviceState.HEALTHY


def test_row_remap_failure_fails():
    fake, clock, source = make([FakeGpu(remapped_rows=(0, 0, 0, 1))])
    assert "row remapping failed" in source.poll(clock())[0].reason


def test_recovery_action_field_fails_device():
    gpus = fake_gpus(2)
    fake, clock, source = make(gpus)
    gpus[1].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    v = source.poll(clock())
    assert v[0].state is DeviceState.HEALTHY
    assert v[1].reason == "driver requests recovery action: GPU reset"


def test_unsupported_queries_are_dropped_after_the_first_try():
    gpus = fake_gpus(1, unsupported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                                     "nvmlDeviceGetRetiredPagesPendingStatus",
                                     "nvmlDeviceGetFieldValues", "nvmlDeviceGetTemperature"})
    fake, clock, source = make(gpus)
    source.poll(clock())
    before = len(fake.calls)
    source.poll(clock())
    assert source.poll(clock())[0].state is DeviceState.HEALTHY
    after = fake.calls[before:]
    assert "nvmlDeviceGetTotalEccErrors" not in after
    assert "nvmlDeviceGetRemappedRows" not in after
    assert "nvmlDeviceGetCurrentClocksEventReasons" in after


# ----------------------------------------------------------------------------- lost GPU
def test_lost_gpu_fails_and_stays_failed():
    gpus = fake_gpus(2)
    fake, clock, source = make(gpus)
    gpus[0].lost = True
    v = source.poll(clock())
    assert v[0].is_failed and "GPU is lost" in v[0].reason and "GPU_IS_LOST" in v[0].reason
    assert v[1].state is DeviceState.HEALTHY
    gpus[0].lost = False
    assert source.poll(clock())[0].is_failed


def test_gpu_lost_before_start_is_inventoried_as_failed():
    gpus = fake_gpus(2)
    gpus[1].lost = True
    fake, clock, source = make(gpus)
    assert [d.index for d in source.devices()] == [0, 1]
    v = source.poll(clock())
    assert v[0].state is DeviceState.HEALTHY and v[1].is_failed


# ----------------------------------------------------------------------------- thermal
def test_thermal_throttle_degrades_with_clock_slowdown_and_recovers():
    gpus = fake_gpus(1)
    fake, clock, source = make(gpus)
    gpus[0].clock_event_reasons = THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
    gpus[0].sm_clock_mhz = 990
    v = source.poll(clock())[0]
    assert v.state is DeviceState.DEGRADED and v.slowdown == 0.5
    assert "hardware thermal slowdown" in v.reason and "power brake" in v.reason
    gpus[0].clock_event_reasons = 0
    gpus[0].sm_clock_mhz = 1980
    assert source.poll(clock())[0].state is DeviceState.HEALTHY


def test_temperature_at_slowdown_threshold_degrades():
    fake, clock, source = make([FakeGpu(temperature_c=91, slowdown_threshold_c=90,
                                        sm_clock_mhz=1500, max_sm_clock_mhz=1980)])
    v = source.poll(clock())[0]
    assert v.is_degraded and "91C >= slowdown threshold 90C" in v.reason
    assert v.slowdown == pytest.approx(0.75)  # 1500 / 1980 = 0.758, in steps of 0.05


def test_power_cap_alone_is_normal_operation():
    fake, clock, source = make([FakeGpu(clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap,
                                        sm_clock_mhz=1200)])
    assert source.poll(clock())[0].state is DeviceState.HEALTHY


def test_degraded_verdict_refuses_a_speedup():
    with pytest.raises(Exception, match=r"slowdown must be in \(0, 1\]"):
        Verdict.degraded("x", 1.5)


# ----------------------------------------------------------------------------- no driver
def test_missing_driver_with_scripted_module_logs_once(caplog):
    fake = FakeNvml(fake_gpus(1), driver_missing=True)
    source = NvmlHealthSource(fake, FakeClock(100.0))
    with caplog.at_level(logging.INFO, logger="launcher.health"):
        source.start()
        assert source.devices() == [] and source.poll(0.0) == {}
        source.stop()
    lines = [r for r in caplog.records if r.name.startswith("launcher.health")]
    assert len(lines) == 1 and "no NVIDIA driver" in lines[0].getMessage()


def _skip_if_driver_present():
    if probe_nvml(pynvml) is None:
        pytest.skip("this machine has an NVIDIA driver; the no-driver path cannot be exercised")


def test_real_pynvml_without_driver_monitors_nothing_and_never_raises(caplog):
    _skip_if_driver_present()
    source = NvmlHealthSource(pynvml, FakeClock(100.0))
    with caplog.at_level(logging.INFO, logger="launcher.health"):
        source.start()
        assert source.devices() == []
        assert source.poll(1.0) == {}
        assert source.wait_for_event() is False
        source.stop(timeout=1)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("launcher.health")]
    assert len(lines) == 1, lines
    assert "NVML Shared Library Not Found" in lines[0]
    assert "\n" not in lines[0]


def test_auto_selection_without_driver_is_process_monitoring_only(caplog):
    _skip_if_driver_present()
    with caplog.at_level(logging.INFO, logger="launcher.health"):
        source = select_health_source("auto", nvml=pynvml)
    assert source.name == "none" and source.devices() == []
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("launcher.health")]
    assert len(lines) == 1 and "LibraryNotFound" in lines[0]


# ----------------------------------------------------------------------------- robustness
def test_event_from_an_unknown_handle_is_logged_not_fatal():
    fake, clock, source = make(fake_gpus(1))
    fake.push_event(0, XID, 79)
    fake._handles[0].index = 5  # the driver names a device the source never saw

    def no_index(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    fake.nvmlDeviceGetIndex = no_index
    source._by_handle.clear()
    assert source.wait_for_event()
    fake._handles[0].index = 0
    assert source.poll(clock())[0].state is DeviceState.HEALTHY


def test_ctypes_handles_are_matched_by_address():
    import ctypes

    from launcher.health.nvml_driver import handle_key as _handle_key

    target = pynvml.struct_c_nvmlDevice_t()
    a = ctypes.pointer(target)
    b = ctypes.cast(ctypes.addressof(target), pynvml.c_nvmlDevice_t)
    assert _handle_key(a) == _handle_key(b) == ctypes.addressof(target)


class StuckWaitNvml(FakeNvml):
    """nvmlEventSetWait ignores its timeout (a wedged driver call)."""

    def __init__(self, gpus):
        super().__init__(gpus)
        self.entered = threading.Event()
        self.release = threading.Event()

    def nvmlEventSetWait(self, event_set, timeout_ms):
        self.entered.set()
        self.release.wait(30)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)


def test_stop_is_bounded_even_if_the_driver_wedges():
    fake = StuckWaitNvml(fake_gpus(1))
    source = NvmlHealthSource(fake, FakeClock(100.0), event_timeout_ms=20)
    source.start()
    try:
        assert fake.entered.wait(10)
        source.stop(timeout=0.05)
        assert source.events_running  # left behind as a daemon thread ...
        assert fake.event_sets_freed == 0 and fake.initialized == 1  # ... with what it uses
    finally:
        fake.release.set()
