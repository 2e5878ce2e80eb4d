"""``NvmlHealthSource``: device health from the NVIDIA driver, through nvidia-ml-py (``pynvml``).

The ``pynvml`` module is a constructor argument (the real one by default), so tests drive this
source with a scripted stand-in (``fake_nvml.FakeNvml``) and nothing is patched globally.

What it watches, per device (docs/health.md has the rules and the reasons):

* an event thread blocked in ``nvmlEventSetWait`` with a bounded timeout: Xid critical errors
  (classified by ``rules.classify_xid``: fatal fails, drain (63, 92) makes suspect at once),
  double-bit ECC, fatal poison, GPU-unavailable and page-retirement-failure events;
* on every ``poll``: the volatile uncorrectable ECC count (a rise over the count seen at start
  fails the device), failed row remapping, the driver's recovery-action field where the driver
  has it, ``NVML_ERROR_GPU_IS_LOST`` / ``NVML_ERROR_RESET_REQUIRED`` from any call; then the
  warning signs of ``warning_signs.py`` (rising correctable ECC, a pending page retirement or
  row remap, a burst of non-fatal Xids: suspect); then temperature + clock-event reasons
  (degraded, with a slowdown estimate from the SM clock).

Promises: failed and suspect verdicts are sticky until this source is rebuilt (agent restart;
a failure replaces a suspect verdict); degraded is
level-triggered and clears when the GPU cools; a query the device does not support is dropped for
that device after its first ``NOT_SUPPORTED``; without a driver (``NVMLError_LibraryNotFound``,
``DriverNotLoaded``) ``start`` logs one line and the source reports no devices. Nothing here
raises into the agent: every driver error becomes a verdict or a log line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from launcher.health.api import (
    DEFAULT_STOP_TIMEOUT_S,
    Clock,
    DeviceInfo,
    DeviceState,
    HealthSourceUnavailable,
    Verdict,
    keep_at,
)
from launcher.health.nvml_driver import (  # noqa: F401 (probe_nvml, device_type re-exported)
    DeviceLost,
    EVENT_DEFAULTS,
    FATAL_EVENTS,
    FIELD_READERS,
    INFO_EVENTS,
    NO_DRIVER_ERRORS,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    UNSUPPORTED_ERRORS,
    Unsupported,
    handle_key,
    driver_text,
    pci_bus_id,
    device_type,
    probe_nvml,
)
from launcher.health.warning_signs import WarningSigns, WarningThresholds
from launcher.health.rules import (
    classify_xid,
    degrading_throttle_reasons,
    describe_reasons,
    recovery_action_reason,
    throttle_slowdown,
)

log = logging.getLogger(__name__)

FaultCallback = Callable[[int, Verdict], None]

class _Device:
    """What the source remembers about one GPU between polls."""

    def __init__(self, info: DeviceInfo, handle: Any):
        self.info = info
        self.handle = handle
        self.ecc_baseline: Optional[int] = None
        self.slowdown_temp_c: Optional[int] = None
        self.max_sm_mhz: Optional[int] = None
        self.unsupported: set[str] = set()
        self.logged: set[str] = set()


class NvmlHealthSource:
    """Health of the local NVIDIA GPUs.

    ``nvml``: the pynvml module (or a stand-in). ``clock``: monotonic seconds, stamped on
    verdicts raised by the event thread. ``event_timeout_ms``: the longest one
    ``nvmlEventSetWait`` blocks, so ``stop`` joins within about that long. ``fatal_xids``,
    ``drain_xids``: override ``rules.FATAL_XIDS``, ``rules.DRAIN_XIDS``. ``on_fault(index,
    verdict)``: called from the event thread as soon as an event fails a device (a drain Xid
    does not call it; the next ``poll`` reports either). ``event_thread``:
    False leaves the events to explicit ``wait_for_event`` calls (deterministic tests).
    ``node``: the node id, for log lines. ``warnings``: when warning signs make a device
    suspect (``warning_signs.WarningThresholds``).
    """

    name = "nvml"

    def __init__(
        self,
        nvml: Any = None,
        clock: Clock = time.monotonic,
        *,
        event_timeout_ms: int = 500,
        event_error_backoff_s: float = 1.0,
        event_thread: bool = True,
        fatal_xids: Optional[dict[int, str]] = None,
        drain_xids: Optional[dict[int, str]] = None,
        on_fault: Optional[FaultCallback] = None,
        node: str = "local",
        warnings: WarningThresholds = WarningThresholds(),
    ):
        if event_timeout_ms <= 0:
            raise ValueError(f"event_timeout_ms must be > 0, got {event_timeout_ms!r}")
        self._nvml = nvml
        self._clock = clock
        self._event_timeout_ms = int(event_timeout_ms)
        self._event_backoff_s = float(event_error_backoff_s)
        self._event_thread = bool(event_thread)
        self._xid_tables = (fatal_xids, drain_xids)
        self._on_fault = on_fault
        self._node = node
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._devices: list[_Device] = []
        self._by_handle: dict[Any, int] = {}
        self._sticky: dict[int, Verdict] = {}
        self._suspect: dict[int, Verdict] = {}
        self._signs = WarningSigns(warnings)
        self._verdicts: dict[int, Verdict] = {}
        self._event_set: Any = None
        self._thread: Optional[threading.Thread] = None
        self._initialized = False
        self._started = False
        self.unavailable: Optional[str] = None
        self._event_errors_logged: set[str] = set()

    def _gpu_name(self, index: int) -> str:
        return f"node {self._node} GPU {index}"

    # ------------------------------------------------------------------------ driver plumbing
    def _module(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml  # optional: nvidia-ml-py
            except ImportError as exc:
                raise HealthSourceUnavailable(
                    f"nvidia-ml-py is not installed ({exc}); install it to monitor GPUs"
                ) from exc
            self._nvml = pynvml
        return self._nvml

    def _is(self, exc: BaseException, *names: str) -> bool:
        for name in names:
            cls = getattr(self._nvml, name, None)
            if isinstance(cls, type) and isinstance(exc, cls):
                return True
        return False

    def _nvml_error(self) -> type:
        cls = getattr(self._nvml, "NVMLError", None)
        return cls if isinstance(cls, type) else Exception

    def _const(self, name: str, default: int) -> int:
        value = getattr(self._nvml, name, default)
        return value if isinstance(value, int) else default

    def _lost_reason(self, exc: BaseException) -> Optional[str]:
        if self._is(exc, "NVMLError_GpuIsLost"):
            return "GPU is lost (NVML_ERROR_GPU_IS_LOST): the GPU stopped answering the driver"
        if self._is(exc, "NVMLError_ResetRequired"):
            return "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)"
        return None

    def _call(self, fn_name: str, *args: Any) -> Any:
        """One driver call; a lost GPU becomes ``DeviceLost``, a query the driver or device
        cannot answer ``Unsupported``; other NVML errors propagate."""
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            raise Unsupported(f"nvidia-ml-py has no {fn_name}")
        try:
            return fn(*args)
        except self._nvml_error() as exc:
            reason = self._lost_reason(exc)
            if reason is not None:
                raise DeviceLost(reason) from exc
            if self._is(exc, *UNSUPPORTED_ERRORS):
                raise Unsupported(f"{fn_name}: {exc}") from exc
            raise

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Initialize NVML, take the inventory and baselines, start the event thread."""
        with self._lock:
            if self._started:
                return
            self._started = True
        try:
            nvml = self._module()
            nvml.nvmlInit()
        except HealthSourceUnavailable as exc:
            self._give_up(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any driver failure means "no GPUs seen"
            self._give_up(self._init_failure(exc))
            return
        self._initialized = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # noqa: BLE001
            self._give_up(f"NVML could not count the GPUs ({type(exc).__name__}: {exc})")
            return
        now = self._clock()
        for index in range(count):
            self._add_device(index, now)
        self._start_events()
        log.info("node %s: NVML health source: %d GPU(s): %s", self._node, len(self._devices),
                 ", ".join(f"{d.info.index}={d.info.type}" for d in self._devices) or "none")

    def _init_failure(self, exc: BaseException) -> str:
        if self._is(exc, *NO_DRIVER_ERRORS):
            return (f"no NVIDIA driver ({exc}): GPU health is not monitored, "
                    "only the worker processes")
        return f"NVML failed to initialize ({type(exc).__name__}: {exc}); GPUs are not monitored"

    def _give_up(self, why: str) -> None:
        self.unavailable = why
        log.warning("node %s: NVML health source: %s", self._node, why)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop the event thread (waiting at most ``timeout``), free the event set, shut NVML."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("NVML event thread did not stop within %.1fs; leaving it (daemon)",
                            timeout)
                return  # it may still be inside the driver: do not free what it uses
        if self._event_set is not None:
            self._quiet("nvmlEventSetFree", self._event_set)
            self._event_set = None
        if self._initialized:
            self._initialized = False
            self._quiet("nvmlShutdown")

    def _quiet(self, fn_name: str, *args: Any) -> None:
        try:
            getattr(self._nvml, fn_name)(*args)
        except Exception as exc:  # noqa: BLE001 - shutting down: report, never raise
            log.debug("NVML %s failed during stop: %s", fn_name, exc)

    # ------------------------------------------------------------------------ inventory
    def _add_device(self, index: int, now: float) -> None:
        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", index)
            name = driver_text(self._call("nvmlDeviceGetName", handle))
            uuid = driver_text(self._call("nvmlDeviceGetUUID", handle))
            memory = int(self._call("nvmlDeviceGetMemoryInfo", handle).total)
        except DeviceLost as exc:
            info = DeviceInfo(index, "unknown", "", 0, "unknown")
            self._devices.append(_Device(info, None))
            self._sticky[index] = Verdict.failed(str(exc), at=now)
            log.error("%s: %s (found at start)", self._gpu_name(index), exc)
            return
        except Exception as exc:  # noqa: BLE001 - a device we cannot read is not monitored
            log.warning("%s: cannot read its identity (%s); not monitored", self._gpu_name(index),
                        exc)
            return
        dev = _Device(DeviceInfo(index, name, uuid, memory, device_type(name),
                                 pci_bus_id(self._nvml, handle)), handle)
        self._devices.append(dev)
        self._by_handle[handle_key(handle)] = index
        self._guarded(dev, "ecc", self._read_ecc_baseline, now)

    def _read_ecc_baseline(self, dev: _Device) -> None:
        dev.ecc_baseline = self._ecc_count(dev)
        if dev.ecc_baseline:
            log.warning("%s: %d uncorrectable ECC error(s) since the last driver load",
                        self._gpu_name(dev.info.index), dev.ecc_baseline)

    def devices(self) -> list[DeviceInfo]:
        return [d.info for d in self._devices]

    @property
    def events_running(self) -> bool:
        """True while the Xid event thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def unsupported_queries(self) -> dict[int, list[str]]:
        """Per device, the queries dropped because the driver or GPU cannot answer them."""
        return {d.info.index: sorted(d.unsupported) for d in self._devices if d.unsupported}

    # ------------------------------------------------------------------------ event thread
    def _start_events(self) -> None:
        handles = [d for d in self._devices if d.handle is not None]
        if not handles:
            return
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001
            log.warning("NVML events unavailable (%s); Xids are not watched", exc)
            return
        wanted = 0
        for name in list(FATAL_EVENTS) + list(INFO_EVENTS) + ["nvmlEventTypeXidCriticalError"]:
            wanted |= self._const(name, EVENT_DEFAULTS[name])
        registered = 0
        for dev in handles:
            try:
                supported = int(self._call("nvmlDeviceGetSupportedEventTypes", dev.handle))
                mask = supported & wanted
                if mask:
                    self._call("nvmlDeviceRegisterEvents", dev.handle, mask, self._event_set)
                    registered += 1
            except DeviceLost as exc:
                self._fail(dev.info.index, Verdict.failed(str(exc), at=self._clock()))
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: cannot register for driver events (%s)",
                            self._gpu_name(dev.info.index), exc)
        if not registered:
            self._quiet("nvmlEventSetFree", self._event_set)
            self._event_set = None
            return
        if self._event_thread:
            self._thread = threading.Thread(target=self._event_loop, name="nvml-events",
                                            daemon=True)
            self._thread.start()

    def _event_loop(self) -> None:
        while not self._stop.is_set():
            self.wait_for_event()

    def wait_for_event(self) -> bool:
        """One bounded ``nvmlEventSetWait`` and the handling of what it returned.

        Returns True when an event was handled, False after a timeout, an error, or without an
        event set (no driver, no device takes events). The event thread calls this in a loop. It
        never raises: a driver error is logged once per kind and followed by a short back-off.
        """
        if self._event_set is None:
            return False
        try:
            data = self._nvml.nvmlEventSetWait(self._event_set, self._event_timeout_ms)
        except Exception as exc:  # noqa: BLE001
            if self._is(exc, "NVMLError_Timeout") or self._stop.is_set():
                return False
            kind = type(exc).__name__
            if kind not in self._event_errors_logged:
                self._event_errors_logged.add(kind)
                log.warning("NVML event wait failed (%s: %s); retrying every %.1fs", kind, exc,
                            self._event_backoff_s)
            self._stop.wait(self._event_backoff_s)
            return False
        try:
            self._handle_event(data)
        except Exception:  # noqa: BLE001 - a malformed event must not kill the thread
            log.exception("NVML event could not be handled")
        return True

    def _index_of(self, handle: Any) -> Optional[int]:
        index = self._by_handle.get(handle_key(handle))
        if index is None:
            try:
                index = int(self._nvml.nvmlDeviceGetIndex(handle))
            except Exception:  # noqa: BLE001
                return None
        return index

    def _handle_event(self, data: Any) -> None:
        etype = int(data.eventType)
        index = self._index_of(data.device)
        now = self._clock()
        where = f"node {self._node}: an unknown GPU" if index is None else self._gpu_name(index)
        if etype & self._const("nvmlEventTypeXidCriticalError", 0x8):
            xid = classify_xid(int(data.eventData), *self._xid_tables)
            if xid.fatal:
                log.error("%s: %s", where, xid.reason())
                if index is not None:
                    self._fail(index, Verdict.failed(xid.reason(), xid=xid.xid, at=now))
            elif xid.drain:
                if index is None:
                    log.warning("%s: %s", where, xid.reason())
                else:
                    self._mark_suspect(index, Verdict(DeviceState.SUSPECT, xid.reason(), xid.xid,
                                                      None, now))
            else:
                log.info("%s: %s", where, xid.reason())
                if index is not None:
                    self._signs.xid(index, xid.xid, now)
        for name, reason in FATAL_EVENTS.items():
            if etype & self._const(name, EVENT_DEFAULTS[name]):
                log.error("%s: %s", where, reason)
                if index is not None:
                    self._fail(index, Verdict.failed(reason, at=now))
        for name in INFO_EVENTS:
            if etype & self._const(name, EVENT_DEFAULTS[name]):
                log.info("%s: driver event %s (data %s)", where, name[len("nvmlEventType"):],
                         int(data.eventData))

    def _fail(self, index: int, verdict: Verdict) -> None:
        """Record a sticky failure (the first reason wins) and notify ``on_fault`` once."""
        with self._lock:
            if index in self._sticky:
                return
            self._sticky[index] = verdict
        if self._on_fault is not None:
            try:
                self._on_fault(index, verdict)
            except Exception:  # noqa: BLE001 - the callback's bug is not the GPU's fault
                log.exception("health on_fault callback failed for %s", self._gpu_name(index))

    # ------------------------------------------------------------------------ polling
    def poll(self, now: float) -> dict[int, Verdict]:
        out: dict[int, Verdict] = {}
        for dev in self._devices:
            index = dev.info.index
            with self._lock:
                sticky = self._sticky.get(index)
            if sticky is None and dev.handle is not None:
                sticky = self._check_faults(dev, now)
            if sticky is None and dev.handle is not None:
                sticky = self._check_suspect(dev, now)
            verdict = sticky if sticky is not None else self._check_thermal(dev, now)
            with self._lock:
                verdict = keep_at(verdict, self._verdicts.get(index))
                self._verdicts[index] = verdict
            out[index] = verdict
        return out

    def _guarded(self, dev: _Device, check: str, fn: Callable[[_Device], Any], now: float) -> Any:
        """Run one query of ``dev``: a lost GPU fails it, NOT_SUPPORTED drops the query for good,
        any other error is logged once and the query is skipped this time."""
        if check in dev.unsupported:
            return None
        try:
            return fn(dev)
        except DeviceLost as exc:
            self._fail(dev.info.index, Verdict.failed(str(exc), at=now))
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, Unsupported):
                dev.unsupported.add(check)
                log.debug("%s: %s not supported (%s)", self._gpu_name(dev.info.index), check, exc)
            elif check not in dev.logged:
                dev.logged.add(check)
                log.warning("%s: %s query failed (%s: %s); skipping it",
                            self._gpu_name(dev.info.index), check, type(exc).__name__, exc)
        return None

    def _check_faults(self, dev: _Device, now: float) -> Optional[Verdict]:
        for check, fn in (("ecc", self._ecc_fault), ("remapped-rows", self._remap_fault),
                          ("recovery-action", self._recovery_fault)):
            reason = self._guarded(dev, check, fn, now)
            if reason:
                self._fail(dev.info.index, Verdict.failed(reason, at=now))
            with self._lock:
                sticky = self._sticky.get(dev.info.index)
            if sticky is not None:
                return sticky
        return None

    def _ecc_count(self, dev: _Device, kind: str = "UNCORRECTED") -> int:
        return int(self._call(
            "nvmlDeviceGetTotalEccErrors", dev.handle,
            self._const(f"NVML_MEMORY_ERROR_TYPE_{kind}", 1 if kind == "UNCORRECTED" else 0),
            self._const("NVML_VOLATILE_ECC", 0),
        ))

    def _check_suspect(self, dev: _Device, now: float) -> Optional[Verdict]:
        """The sticky suspect verdict, or a new one when a warning sign shows (the first wins)."""
        index = dev.info.index
        with self._lock:
            if index in self._suspect:
                return self._suspect[index]
        for check, fn in (
                ("ecc-corrected", lambda d: self._signs.correctable_ecc(
                    index, self._ecc_count(d, "CORRECTED"))),
                ("retired-pages", lambda d: self._signs.pending_repair(self._retired_pending(d),
                                                                       False)),
                ("remap-pending", lambda d: self._signs.pending_repair(
                    False, bool(self._call("nvmlDeviceGetRemappedRows", d.handle)[2]))),
                ("xid-burst", lambda d: self._signs.xid_burst(index, now))):
            reason = self._guarded(dev, check, fn, now)
            with self._lock:
                if index in self._sticky:  # a query found the GPU lost
                    return self._sticky[index]
            if reason:
                return self._mark_suspect(index, Verdict.suspect(reason, at=now))
        return None

    def _mark_suspect(self, index: int, verdict: Verdict) -> Verdict:
        """Record a sticky suspect verdict (the first wins) and return the one recorded."""
        with self._lock:
            if index not in self._suspect:
                log.warning("%s: suspect: %s", self._gpu_name(index), verdict.reason)
                self._suspect[index] = verdict
            return self._suspect[index]

    def _ecc_fault(self, dev: _Device) -> Optional[str]:
        count = self._ecc_count(dev)
        base = dev.ecc_baseline
        if base is None or count < base:  # first successful read, or counters were reset
            dev.ecc_baseline = count
            return None
        if count > base:
            return (f"{count - base} new uncorrectable ECC error(s) "
                    f"(volatile count {base} -> {count})")
        return None

    def _retired_pending(self, dev: _Device) -> bool:
        pending = int(self._call("nvmlDeviceGetRetiredPagesPendingStatus", dev.handle))
        return pending == self._const("NVML_FEATURE_ENABLED", 1)

    def _remap_fault(self, dev: _Device) -> Optional[str]:
        _corr, _unc, _pending, failure = self._call("nvmlDeviceGetRemappedRows", dev.handle)
        if failure:
            return "row remapping failed: the bad memory rows cannot be repaired"
        return None

    def _recovery_fault(self, dev: _Device) -> Optional[str]:
        field_id = getattr(self._nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if not isinstance(field_id, int):
            raise Unsupported("nvidia-ml-py has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        value = self._call("nvmlDeviceGetFieldValues", dev.handle, [field_id])[0]
        status = int(value.nvmlReturn)
        if status == NVML_ERROR_NOT_SUPPORTED:
            raise Unsupported("the driver has no recovery-action field")
        if status != NVML_SUCCESS:
            return None
        action = int(getattr(value.value, FIELD_READERS.get(int(value.valueType), "uiVal")))
        return recovery_action_reason(action) if action else None

    def _check_thermal(self, dev: _Device, now: float) -> Verdict:
        if dev.handle is None:
            return Verdict.healthy(now)
        reasons = self._guarded(dev, "throttle-reasons", self._throttle_reasons, now) or []
        temp = self._guarded(dev, "temperature", self._temperature, now)
        limit = self._guarded(dev, "slowdown-threshold", self._slowdown_threshold, now)
        with self._lock:
            sticky = self._sticky.get(dev.info.index)
        if sticky is not None:  # a query found the GPU lost
            return sticky
        if temp is not None and limit is not None and temp >= limit:
            reasons.append(f"temperature {temp}C >= slowdown threshold {limit}C")
        if not reasons:
            return Verdict.healthy(now)
        current = self._guarded(dev, "sm-clock", self._sm_clock, now)
        peak = self._guarded(dev, "max-sm-clock", self._max_sm_clock, now)
        slowdown = throttle_slowdown(current, peak)
        return Verdict.degraded(describe_reasons(reasons), slowdown, at=now)

    def _throttle_reasons(self, dev: _Device) -> list[str]:
        fn = "nvmlDeviceGetCurrentClocksEventReasons"
        if not hasattr(self._nvml, fn):
            fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
        return degrading_throttle_reasons(int(self._call(fn, dev.handle)))

    def _temperature(self, dev: _Device) -> int:
        sensor = self._const("NVML_TEMPERATURE_GPU", 0)
        # nvmlDeviceGetTemperature is deprecated (CUDA 14 drops it); older drivers lack the V form.
        for fn in ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"):
            try:
                return int(self._call(fn, dev.handle, sensor))
            except Unsupported:
                continue
        raise Unsupported("no temperature query")

    def _slowdown_threshold(self, dev: _Device) -> int:
        if dev.slowdown_temp_c is None:
            dev.slowdown_temp_c = int(self._call(
                "nvmlDeviceGetTemperatureThreshold", dev.handle,
                self._const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)))
        return dev.slowdown_temp_c

    def _sm_clock(self, dev: _Device) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", dev.handle,
                              self._const("NVML_CLOCK_SM", 1)))

    def _max_sm_clock(self, dev: _Device) -> int:
        if dev.max_sm_mhz is None:
            dev.max_sm_mhz = int(self._call("nvmlDeviceGetMaxClockInfo", dev.handle,
                                            self._const("NVML_CLOCK_SM", 1)))
        return dev.max_sm_mhz
