"""``FakeNvml``: a scripted stand-in for the ``pynvml`` module, to drive ``NvmlHealthSource``
without a GPU (unit tests, and fault drills on machines with no NVIDIA driver).

It exposes the functions the NVML source calls with pynvml's names and signatures, and reuses
pynvml's own constants, error classes and structs, so the source sees exactly the types the real
binding raises and returns. Each ``FakeGpu`` holds the state a test mutates (counters, clocks,
``lost``); ``push_event`` queues what ``nvmlEventSetWait`` returns next. Thread-safe: the source's
event thread and the test's thread share it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

_CONSTANT_PREFIXES = ("NVML_", "nvmlEventType", "nvmlClocksEventReason", "nvmlClocksThrottleReason")


@dataclass
class FakeGpu:
    """The state of one scripted GPU. ``unsupported``: function names that raise NOT_SUPPORTED."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    pci_bus_id: str = ""
    memory_total: int = 80 * 1024**3
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_volatile: int = 0
    retired_pages_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    recovery_action: int = 0
    temperature_c: int = 45
    slowdown_threshold_c: int = 90
    clock_event_reasons: int = 0
    sm_clock_mhz: int = 1980
    max_sm_clock_mhz: int = 1980
    lost: bool = False
    supported_events: int = (_real.nvmlEventTypeXidCriticalError
                             | _real.nvmlEventTypeDoubleBitEccError
                             | _real.nvmlEventTypeSingleBitEccError)
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """A pynvml look-alike over ``gpus``; ``driver_missing`` makes ``nvmlInit`` fail as on a
    machine without the driver."""

    def __init__(self, gpus: list[FakeGpu], driver_missing: bool = False):
        for name in dir(_real):
            value = getattr(_real, name)
            if name.startswith(_CONSTANT_PREFIXES) and isinstance(value, int):
                setattr(self, name, value)
            elif name.startswith("NVMLError") and isinstance(value, type):
                setattr(self, name, value)
        self.gpus = gpus
        for i, gpu in enumerate(gpus):
            gpu.uuid = gpu.uuid or f"GPU-00000000-0000-0000-0000-{i:012d}"
            gpu.pci_bus_id = gpu.pci_bus_id or f"00000000:{0x18 + i:02X}:00.0"
        self.driver_missing = driver_missing
        self.initialized = 0
        self.event_sets_freed = 0
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []
        self._handles = [SimpleNamespace(index=i) for i in range(len(gpus))]
        self._events: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()

    # -------------------------------------------------------------------- scripting
    def push_event(self, index: int, event_type: int, data: int = 0) -> None:
        """Queue one event as if GPU ``index`` reported it (``data``: the Xid for Xid events)."""
        self._events.put(SimpleNamespace(device=self._handles[index], eventType=event_type,
                                         eventData=data, gpuInstanceId=0, computeInstanceId=0))

    def push_wait_error(self, code: int) -> None:
        """Make the next ``nvmlEventSetWait`` raise the NVML error ``code``."""
        self._events.put(_real.NVMLError(code))

    # -------------------------------------------------------------------- plumbing
    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        with self._lock:
            self.calls.append(fn)
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -------------------------------------------------------------------- pynvml API
    def nvmlInit(self) -> None:
        if self.driver_missing:
            raise _real.NVMLError(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._gpu(self._handles[index], "nvmlDeviceGetHandleByIndex")
        return self._handles[index]

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return handle.index

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        info = _real.nvmlPciInfo_t()
        info.busId = self._gpu(handle, "nvmlDeviceGetPciInfo").pci_bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        total = self._gpu(handle, "nvmlDeviceGetMemoryInfo").memory_total
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        assert counter_type == _real.NVML_VOLATILE_ECC
        if error_type == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected_volatile
        assert error_type == _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return gpu.ecc_uncorrected_volatile

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (_real.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            if fid == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                values[i].nvmlReturn = _real.NVML_SUCCESS
                values[i].valueType = _real.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = gpu.recovery_action
            else:
                values[i].nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold")
        assert threshold == _real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return gpu.slowdown_threshold_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_event_reasons

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        assert clock_type == _real.NVML_CLOCK_SM
        return gpu.sm_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMaxClockInfo")
        assert clock_type == _real.NVML_CLOCK_SM
        return gpu.max_sm_clock_mhz

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetSupportedEventTypes").supported_events

    def nvmlEventSetCreate(self) -> Any:
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        return SimpleNamespace(kind="event-set")

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if event_types & ~gpu.supported_events:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        self.registered[handle.index] = event_types

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        try:
            item = self._events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.event_sets_freed += 1


def fake_gpus(count: int, **overrides: Any) -> list[FakeGpu]:
    """``count`` identical healthy GPUs (``overrides`` set FakeGpu fields on all of them)."""
    return [FakeGpu(**overrides) for _ in range(count)]
