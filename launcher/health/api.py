"""GPU health monitoring: the vocabulary of ``launcher.health``.

A reader learns the subsystem from this file. Promises:

* a ``HealthSource`` describes the accelerators of one node (``devices()``) and gives, on every
  ``poll(now)``, the *current* verdict of every device it knows (level-triggered: a verdict that
  was missed is repaired by the next poll, nothing is an edge that can be lost);
* a verdict is ``healthy``, ``degraded`` (usable but slower; ``slowdown`` is the estimated speed
  relative to nominal, in (0, 1], 0.5 = half speed, or None when unknown; the meaning
  docs/etcd-schema.md gives the field), ``suspect`` (still working, but showing the warning signs
  that come before most fatal faults: elastic mode drains it, its state leaves by network while
  it still can) or ``failed`` (the device must leave the plan; ``reason`` names the root cause in
  one line, ``xid`` carries the driver's Xid when one caused it);
* ``start()`` and ``stop(timeout)`` bound every background thread; ``stop`` returns within its
  timeout and never raises;
* every error of the subsystem is a ``HealthError`` with a one-line message.

Implementations: ``nvml.NvmlHealthSource`` (the NVIDIA driver through nvidia-ml-py),
``scripted.ScriptedHealthSource`` (timed faults from a file or an etcd key, for tests and fault
injection) and ``NullHealthSource`` (no devices: process monitoring only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, runtime_checkable

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic`` in production, a fake in unit tests)."""

DEFAULT_STOP_TIMEOUT_S = 5.0


# --------------------------------------------------------------------------------------- errors
class HealthError(Exception):
    """Root of every error raised by ``launcher.health``; ``str(err)`` is one line."""


class HealthConfigError(HealthError, ValueError):
    """A health-source setting is invalid (names the bad value and what would be valid)."""


class HealthSourceUnavailable(HealthError):
    """The source cannot observe any device (no driver, no library); names why."""


class FaultScriptError(HealthError, ValueError):
    """A scripted fault is malformed: names where (file and entry) and what is wrong."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"bad fault script {where}: {problem}")


# ---------------------------------------------------------------------------------- values
class DeviceState(str, enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    SUSPECT = "suspect"
    FAILED = "failed"


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator of a node as the health source sees it.

    ``type`` is the model the planner groups devices by (``"H100-80GB-HBM3"``); ``name`` is the
    driver's full marketing name; ``pci_bus_id`` the driver's PCI address (``""`` when unknown).
    """

    index: int
    name: str
    uuid: str
    memory_bytes: int
    type: str
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Verdict:
    """The health of one device. ``at``: when this verdict began, on the source's clock."""

    state: DeviceState
    reason: str = ""
    xid: Optional[int] = None
    slowdown: Optional[float] = None
    at: float = 0.0
    # who made it (``contract.records.VerdictOrigin``): the health source, or the node agent
    # for a slot whose worker died (``exit``) or hung (``stall``) and which it journaled already
    origin: str = "health"

    @classmethod
    def healthy(cls, at: float = 0.0) -> "Verdict":
        return cls(DeviceState.HEALTHY, "", None, None, at)

    @classmethod
    def degraded(cls, reason: str, slowdown: Optional[float], at: float = 0.0) -> "Verdict":
        if slowdown is not None and not 0.0 < slowdown <= 1.0:
            raise HealthError(
                f"slowdown must be in (0, 1] (speed relative to nominal), got {slowdown!r}")
        return cls(DeviceState.DEGRADED, reason, None, slowdown, at)

    @classmethod
    def suspect(cls, reason: str, at: float = 0.0) -> "Verdict":
        return cls(DeviceState.SUSPECT, reason, None, None, at)

    @classmethod
    def failed(cls, reason: str, xid: Optional[int] = None, at: float = 0.0,
               origin: str = "health") -> "Verdict":
        return cls(DeviceState.FAILED, reason, xid, None, at, origin)

    @property
    def is_failed(self) -> bool:
        return self.state is DeviceState.FAILED

    @property
    def is_degraded(self) -> bool:
        return self.state is DeviceState.DEGRADED

    @property
    def is_suspect(self) -> bool:
        return self.state is DeviceState.SUSPECT

    def same_as(self, other: Optional["Verdict"]) -> bool:
        """Equal in everything but ``at`` (the publisher writes only on such a change)."""
        return other is not None and (self.state, self.reason, self.xid, self.slowdown,
                                      self.origin) == (
            other.state, other.reason, other.xid, other.slowdown, other.origin)

    def describe(self) -> str:
        if self.state is DeviceState.HEALTHY:
            return "healthy"
        if self.state is DeviceState.DEGRADED:
            speed = "unknown" if self.slowdown is None else f"{self.slowdown:.0%} of nominal"
            return f"degraded ({self.reason}; speed {speed})"
        if self.state is DeviceState.SUSPECT:
            return f"suspect ({self.reason})"
        return f"failed ({self.reason})"


def keep_at(new: Verdict, old: Optional[Verdict]) -> Verdict:
    """``new``, but with ``old.at`` when nothing but the time changed (a verdict's start time)."""
    if old is not None and new.same_as(old):
        return old
    return new


# ---------------------------------------------------------------------------------- selection
HEALTH_SOURCE_CHOICES = ("auto", "nvml", "none", "scripted:<path>", "scripted:etcd")


def parse_health_source(spec: str) -> tuple[str, str]:
    """``--hspmd-health-source`` -> (kind, argument): ``("auto", "")``, ``("nvml", "")``,
    ``("none", "")``, ``("scripted", "<path>")`` or ``("scripted", "etcd")``.

    Pure (no files, no driver): the CLI validates with it; ``select_health_source`` builds the
    source. A bad value raises ``HealthConfigError`` naming it and the valid values.
    """
    text = (spec or "").strip()
    if text in ("auto", "nvml", "none"):
        return text, ""
    if text.startswith("scripted:") and text[len("scripted:"):].strip():
        return "scripted", text[len("scripted:"):].strip()
    raise HealthConfigError(
        f"unknown health source {spec!r}: use one of {', '.join(HEALTH_SOURCE_CHOICES)}")


# ---------------------------------------------------------------------------------- protocol
@runtime_checkable
class HealthSource(Protocol):
    """Where device verdicts come from. Every method returns within a bounded time."""

    name: str

    def start(self) -> None:
        """Start background work (event threads, feed refresh). Never raises for a missing
        driver: the source then reports no devices and says so once in the log."""

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop background work, waiting at most ``timeout`` seconds. Never raises."""

    def devices(self) -> list[DeviceInfo]:
        """The node's devices, by index (empty when the source sees none)."""

    def poll(self, now: float) -> dict[int, Verdict]:
        """The current verdict of every known device, keyed by device index."""


class NullHealthSource:
    """No devices, no verdicts: the agent monitors its worker processes only."""

    name = "none"

    def __init__(self, why: str = "health monitoring disabled"):
        self.why = why

    def start(self) -> None:
        return None

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        return None

    def devices(self) -> list[DeviceInfo]:
        return []

    def poll(self, now: float) -> dict[int, Verdict]:
        return {}
