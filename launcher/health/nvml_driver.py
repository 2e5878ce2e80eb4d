"""The NVIDIA driver's vocabulary for ``nvml.NvmlHealthSource``: event bits, which events fail a
device and which are only logged, the error names that mean "no driver" or "not supported",
device names as planner types, a GPU's PCI address, and ``probe_nvml`` (does the driver load?).
No state, no threads.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

# Event bits (values as in pynvml; read from the module when it has them).
EVENT_DEFAULTS = {
    "nvmlEventTypeSingleBitEccError": 0x0001,
    "nvmlEventTypeDoubleBitEccError": 0x0002,
    "nvmlEventTypeXidCriticalError": 0x0008,
    "nvmlEventTypeDramRetirementEvent": 0x0400,
    "nvmlEventTypeDramRetirementFailure": 0x0800,
    "nvmlEventTypeNonFatalPoisonError": 0x1000,
    "nvmlEventTypeFatalPoisonError": 0x2000,
    "nvmlEventTypeGpuUnavailableError": 0x4000,
    "nvmlEventTypeGpuRecoveryAction": 0x8000,
}
FATAL_EVENTS = {
    "nvmlEventTypeDoubleBitEccError": "double-bit ECC error reported by the driver",
    "nvmlEventTypeFatalPoisonError": "fatal poison error: corrupted data reached the GPU",
    "nvmlEventTypeGpuUnavailableError": "GPU unavailable (driver event): the GPU is lost",
    "nvmlEventTypeDramRetirementFailure": "DRAM page retirement failed",
}
INFO_EVENTS = (
    "nvmlEventTypeSingleBitEccError",
    "nvmlEventTypeNonFatalPoisonError",
    "nvmlEventTypeDramRetirementEvent",
    "nvmlEventTypeGpuRecoveryAction",
)
NO_DRIVER_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                     "NVMLError_FunctionNotFound", "NVMLError_NoPermission")
UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
FIELD_READERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                  6: "usVal"}


class DeviceLost(Exception):
    """Internal: a driver call said the GPU is gone or needs a reset (carries the reason)."""


class Unsupported(Exception):
    """Internal: this driver, device or nvidia-ml-py version cannot answer a query."""


def device_type(name: str) -> str:
    """The model the planner groups by: ``"NVIDIA H100 80GB HBM3"`` -> ``"H100-80GB-HBM3"``."""
    text = name.strip()
    if text.upper().startswith("NVIDIA "):
        text = text[len("NVIDIA "):]
    return "-".join(text.split()) or "unknown"


def driver_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def pci_bus_id(nvml: Any, handle: Any) -> str:
    """The GPU's PCI address as the driver writes it (``"00000000:18:00.0"``); ``""`` when the
    driver or nvidia-ml-py cannot say (the inventory does not need it)."""
    try:
        return driver_text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except Exception:  # noqa: BLE001 - an address we cannot read is only not shown
        return ""


def handle_key(handle: Any) -> Any:
    """A hashable identity of a device handle: the pointer value for ctypes handles."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return id(handle)


def probe_nvml(nvml: Any = None) -> Optional[str]:
    """None when the NVIDIA driver loads, else one line saying why not."""
    try:
        if nvml is None:
            import pynvml as nvml  # optional: nvidia-ml-py
        nvml.nvmlInit()
    except ImportError as exc:
        return f"nvidia-ml-py is not installed ({exc})"
    except Exception as exc:  # noqa: BLE001 - any failure to load means "no driver"
        return f"no NVIDIA driver ({type(exc).__name__}: {exc})"
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass
    return None
