"""The verdict rules: which driver signals fail a device, which only slow it, which are noise.

Pure tables and functions, no driver calls, so the NVML source, the scripted source and the docs
(docs/health.md) share one definition. Promises:

* ``classify_xid(xid)`` is fatal exactly for ``FATAL_XIDS`` (or the set the caller passes);
  else *drain* for ``DRAIN_XIDS`` (or the caller's set): one occurrence makes the device
  ``suspect`` at once (the GPU still computes correctly, but needs a reset or is wearing out);
  every other Xid is informational: it is logged, it changes a verdict only as part of a burst
  (``warning_signs.py``);
* ``throttle_slowdown`` turns an SM clock pair into a speed relative to nominal in (0, 1]
  (docs/etcd-schema.md: ``slowdown``, 1.0 = nominal), rounded to ``SLOWDOWN_QUANTUM`` so that
  clock jitter does not rewrite the verdict on every poll;
* ``degrading_throttle_reasons`` names the clock-event bits that mean "the GPU is slower than it
  should be" (hardware slowdown, thermal slowdown, power brake); the software power cap and idle
  clocks are normal operation and never degrade a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

# Xid -> why a device that reports it must leave the plan. Each of these either destroyed the state
# of the processes on the GPU, or leaves the GPU unusable/unsafe until it is reset.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error: uncorrectable device-memory error, data in use may be corrupt",
    64: "ECC page retirement / row remapping failed: the bad memory cannot be repaired",
    74: "NVLink error: a link to a peer GPU failed, collectives over it hang or fail",
    79: "GPU has fallen off the bus: the device is gone from PCIe",
    94: "contained ECC error: the processes using the bad memory were terminated",
    95: "uncontained ECC error: every process on the GPU is affected, a reset is required",
    119: "GSP RPC timeout: the GPU System Processor stopped answering the driver",
    120: "GSP error: the GPU System Processor firmware faulted, a reset is required",
}

# Xid -> what the driver asks for, for Xids that drain the device (suspect) at the first one: the
# GPU keeps computing correctly, so it hands its state over by network before it leaves. The
# uncorrectable error behind a repair, if any, has its own fatal Xid (48, 94, 95) or ECC count.
DRAIN_XIDS: dict[int, str] = {
    63: "row remap pending: reset when convenient",
    92: "high single-bit ECC error rate: data still correct, the memory is wearing out",
}

# Xids worth a readable log line; alone they do not change a verdict (an application fault shows
# up as a worker exit, a silent freeze as a stalled progress heartbeat; a burst makes a suspect).
INFO_XIDS: dict[int, str] = {
    13: "graphics engine exception (usually an application fault)",
    31: "GPU memory page fault (usually an application fault)",
    43: "GPU stopped processing (the faulting application was stopped)",
    45: "preemptive cleanup after an earlier error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    68: "video processor exception",
    154: "GPU recovery action changed (the driver's recovery-action field says what to do)",
}

# Driver recovery actions (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION); anything but NONE fails the GPU.
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain peer-to-peer traffic",
    4: "drain peer-to-peer traffic and reset the GPU",
    5: "recover the IMEX domain",
    6: "PCIe bus reset",
    7: "system reboot",
}

# Clock-event (throttle) reason bits, as nvmlDeviceGetCurrentClocksEventReasons reports them.
THROTTLE_HW_SLOWDOWN = 0x08
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
DEGRADING_THROTTLE_BITS: dict[int, str] = {
    THROTTLE_HW_SLOWDOWN: "hardware slowdown",
    THROTTLE_SW_THERMAL: "software thermal slowdown",
    THROTTLE_HW_THERMAL: "hardware thermal slowdown",
    THROTTLE_HW_POWER_BRAKE: "hardware power brake",
}

SLOWDOWN_QUANTUM = 0.05


@dataclass(frozen=True)
class XidClass:
    xid: int
    fatal: bool
    meaning: str
    drain: bool = False  # not fatal, but the device is suspect at once

    def reason(self) -> str:
        """``Xid 79: GPU has fallen off ...``; a drain Xid ``Xid 63 (row remap pending: ...)``."""
        if self.drain:
            return f"Xid {self.xid} ({self.meaning})"
        return f"Xid {self.xid}: {self.meaning}"


def classify_xid(xid: int, fatal: Optional[dict[int, str]] = None,
                 drain: Optional[dict[int, str]] = None) -> XidClass:
    """Fatal, drain or informational, with a one-line meaning (``fatal``/``drain`` replace
    ``FATAL_XIDS``/``DRAIN_XIDS``; an Xid in both is fatal)."""
    table = FATAL_XIDS if fatal is None else fatal
    if xid in table:
        return XidClass(xid, True, table[xid])
    drains = DRAIN_XIDS if drain is None else drain
    if xid in drains:
        return XidClass(xid, False, drains[xid], drain=True)
    return XidClass(xid, False, INFO_XIDS.get(xid, "informational (not in the fatal list)"))


def recovery_action_reason(action: int) -> str:
    what = RECOVERY_ACTIONS.get(action, f"unknown action {action}")
    return f"driver requests recovery action: {what}"


def degrading_throttle_reasons(bits: int) -> list[str]:
    """Names of the set bits that degrade a device, in bit order (empty: not degraded)."""
    return [name for bit, name in sorted(DEGRADING_THROTTLE_BITS.items()) if bits & bit]


def quantize_slowdown(speed: float) -> float:
    """Round a relative speed to ``SLOWDOWN_QUANTUM``, within [SLOWDOWN_QUANTUM, 1.0]."""
    speed = min(max(speed, SLOWDOWN_QUANTUM), 1.0)
    return round(max(round(speed / SLOWDOWN_QUANTUM), 1) * SLOWDOWN_QUANTUM, 4)


def throttle_slowdown(current_sm_mhz: Optional[int], max_sm_mhz: Optional[int]) -> Optional[float]:
    """Estimated speed relative to nominal from the SM clock: current / max (None when
    unreadable).

    Compute-bound steps scale with the SM clock, so a GPU at half its maximum clock runs about
    half as fast; communication-bound steps lose less, so this is the pessimistic estimate.
    """
    if not current_sm_mhz or not max_sm_mhz or current_sm_mhz <= 0 or max_sm_mhz <= 0:
        return None
    return quantize_slowdown(current_sm_mhz / max_sm_mhz)


def describe_reasons(parts: Iterable[str]) -> str:
    return ", ".join(parts)
