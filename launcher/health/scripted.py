"""``ScriptedHealthSource``: device verdicts from a script of timed faults (tests, fault drills).

A fault script is JSON: a list of fault objects, the same objects one per line (JSON lines; blank
lines and ``#`` comments are skipped), or an object ``{"schema": 2, "kind": "fault_script",
"faults": [...]}`` (the form written to etcd; a file may say ``"schema": 1``, the same format). A fault::

    {"at": 12.5, "device": 0, "kind": "xid", "xid": 79}

* ``at``: seconds after the source started; omitted means "as soon as the source sees it"
  (how an injector fails a device now through etcd);
* ``device``: the device index; ``kind``: ``xid`` (needs ``xid``; fatal Xids fail the device,
  others are informational, as with the driver), ``ecc`` (uncorrectable ECC error), ``lost``
  (GPU fell off the bus), ``thermal`` (degraded; needs ``slowdown``, the speed relative to
  nominal in (0, 1]), ``suspect`` (warning signs before a fatal fault, such as rising correctable
  ECC counts: the device still works and elastic mode drains it), ``recover`` (back to healthy,
  as after a GPU reset); ``reason``: optional text replacing the default reason.

Promises: ``poll(now)`` is a pure replay of the script up to ``now`` (level-triggered, the same
answer for the same time); failures are sticky until a ``recover``, and so is a suspect verdict
(a later ``thermal`` does not clear it; a failure replaces it); a script is validated as a
whole and a bad one is refused with a ``FaultScriptError`` naming the entry and the problem (at
construction), or logged once and ignored, keeping the previous script (on a later refresh). The
feed (file or etcd key) sits behind ``FaultFeed`` so the file mode needs no etcd.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

from hspmd_elastic.contract.records import SCHEMA_VERSION
from launcher.health.api import (
    DEFAULT_STOP_TIMEOUT_S,
    Clock,
    DeviceInfo,
    DeviceState,
    FaultScriptError,
    Verdict,
)
from launcher.health.rules import classify_xid

log = logging.getLogger(__name__)

FAULT_KINDS = ("xid", "ecc", "lost", "thermal", "suspect", "recover")
FAULT_SCRIPT_KIND = "fault_script"
_FIELDS = {"at", "device", "kind", "xid", "slowdown", "reason"}
_DEFAULT_MEMORY = 80 * 1024**3


@dataclass(frozen=True)
class Fault:
    """One scripted fault (see the module docstring for the meaning of each field)."""

    device: int
    kind: str
    at: Optional[float] = None
    xid: Optional[int] = None
    slowdown: Optional[float] = None
    reason: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# ------------------------------------------------------------------------------------ parsing
def _number(entry: dict, name: str, where: str, minimum: float) -> Optional[float]:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise FaultScriptError(where, f"{name} must be a number >= {minimum}, got {value!r}")
    return float(value)


def _integer(entry: dict, name: str, where: str) -> Optional[int]:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FaultScriptError(where, f"{name} must be a non-negative integer, got {value!r}")
    return value


def parse_fault(entry: Any, where: str) -> Fault:
    """One fault object -> ``Fault``; ``FaultScriptError`` names ``where`` and the problem."""
    if not isinstance(entry, dict):
        raise FaultScriptError(where, f"expected a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise FaultScriptError(where, f"unknown field(s) {', '.join(unknown)}; "
                                      f"valid: {', '.join(sorted(_FIELDS))}")
    kind = entry.get("kind")
    if kind not in FAULT_KINDS:
        raise FaultScriptError(where, f"kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
    device = _integer(entry, "device", where)
    if device is None:
        raise FaultScriptError(where, "missing field device (a device index)")
    xid = _integer(entry, "xid", where)
    slowdown = _number(entry, "slowdown", where, 0.0)
    if slowdown is not None and not 0.0 < slowdown <= 1.0:
        raise FaultScriptError(where, f"slowdown must be in (0, 1] (speed relative to nominal), "
                                      f"got {slowdown!r}")
    if kind == "xid" and xid is None:
        raise FaultScriptError(where, "kind xid needs an xid number")
    if kind == "thermal" and slowdown is None:
        raise FaultScriptError(where, "kind thermal needs a slowdown in (0, 1] (relative speed)")
    reason = entry.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise FaultScriptError(where, f"reason must be a string, got {reason!r}")
    return Fault(device, kind, _number(entry, "at", where, 0.0), xid, slowdown, reason)


def parse_faults(text: str, where: str = "<script>") -> list[Fault]:
    """A whole script (JSON list, JSON lines, or a ``fault_script`` object) -> faults."""
    stripped = text.strip()
    if not stripped:
        return []
    if stripped[0] in "[{":
        try:
            body = json.loads(stripped)
        except ValueError:
            body = None  # maybe JSON lines starting with an object
        if isinstance(body, list):
            return [parse_fault(e, f"{where} entry {i}") for i, e in enumerate(body)]
        if isinstance(body, dict) and "faults" in body:
            return _parse_object(body, where)
        if isinstance(body, dict):
            return [parse_fault(body, f"{where} line 1")]
    faults = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise FaultScriptError(f"{where} line {n}", f"not JSON ({exc})") from exc
        faults.append(parse_fault(entry, f"{where} line {n}"))
    return faults


def _parse_object(body: dict, where: str) -> list[Fault]:
    if body.get("kind", FAULT_SCRIPT_KIND) != FAULT_SCRIPT_KIND:
        raise FaultScriptError(where, f"kind {body.get('kind')!r} where {FAULT_SCRIPT_KIND!r} "
                                      "belongs")
    if body.get("schema", SCHEMA_VERSION) not in (1, SCHEMA_VERSION):
        raise FaultScriptError(where, f"unknown schema {body.get('schema')!r} (this reads 1 "
                                      f"and {SCHEMA_VERSION})")
    faults = body["faults"]
    if not isinstance(faults, list):
        raise FaultScriptError(where, "faults must be a list of fault objects")
    return [parse_fault(e, f"{where} fault {i}") for i, e in enumerate(faults)]


def encode_fault_script(faults: Iterable[Fault]) -> bytes:
    """The etcd value of a fault script: a versioned JSON object (no bare list in etcd)."""
    body = {"schema": SCHEMA_VERSION, "kind": FAULT_SCRIPT_KIND, "faults": [f.to_dict() for f in faults]}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


# ------------------------------------------------------------------------------------ replay
def _apply(current: Verdict, fault: Fault, at: float) -> Verdict:
    if fault.kind == "recover":
        return Verdict.healthy(at)
    if current.state is DeviceState.FAILED:
        return current  # sticky: the first failure is the root cause
    if fault.kind == "xid":
        cls = classify_xid(fault.xid or 0)
        if cls.drain:  # as the driver's: the device is suspect at once (sticky), never failed
            if current.state is DeviceState.SUSPECT:
                return current
            return Verdict(DeviceState.SUSPECT, fault.reason or f"{cls.reason()} (scripted)",
                           cls.xid, None, at)
        if not cls.fatal:
            return current
        return Verdict.failed(fault.reason or f"{cls.reason()} (scripted)", xid=cls.xid, at=at)
    if fault.kind == "ecc":
        return Verdict.failed(fault.reason or "uncorrectable ECC error (scripted)", at=at)
    if fault.kind == "lost":
        return Verdict.failed(fault.reason or "GPU is lost (scripted)", at=at)
    if fault.kind == "suspect":
        return Verdict.suspect(fault.reason or "warning signs before a fatal fault (scripted)",
                               at=at)
    if current.state is DeviceState.SUSPECT:
        return current  # sticky: a suspect device is drained, a slowdown changes nothing
    reason = fault.reason or "thermal slowdown (scripted)"
    return Verdict.degraded(reason, fault.slowdown, at=at)


def replay(timed: Sequence[tuple[float, Fault]], devices: Iterable[int], now: float,
           start: float = 0.0) -> dict[int, Verdict]:
    """Verdicts at ``now`` after the faults timed at or before it (stable order by time)."""
    out = {d: Verdict.healthy(start) for d in devices}
    for at, fault in sorted(timed, key=lambda item: item[0]):
        if at > now:
            break
        if fault.device in out:
            out[fault.device] = _apply(out[fault.device], fault, at)
    return out


# ------------------------------------------------------------------------------------ feeds
class FaultFeed(Protocol):
    """Where a script comes from. ``read`` returns its text, or None when there is none."""

    where: str

    def read(self, timeout: float) -> Optional[str]:
        ...


class FileFaultFeed:
    def __init__(self, path: str):
        self.path = path
        self.where = path

    def read(self, timeout: float) -> Optional[str]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                return fh.read()
        except FileNotFoundError:
            return None


class StaticFaultFeed:
    """A fixed script (tests that build faults in code)."""

    def __init__(self, faults: Sequence[Fault], where: str = "<static>"):
        self.where = where
        self._text = json.dumps([f.to_dict() for f in faults])

    def read(self, timeout: float) -> Optional[str]:
        return self._text


# ------------------------------------------------------------------------------------ source
def scripted_devices(count: int, node: str = "local", device_type: str = "scripted",
                     memory_bytes: int = _DEFAULT_MEMORY) -> list[DeviceInfo]:
    return [DeviceInfo(i, f"Scripted GPU {i}", f"SCRIPTED-{node}-{i}", memory_bytes, device_type)
            for i in range(count)]


class ScriptedHealthSource:
    """Verdicts replayed from a fault script that a ``FaultFeed`` supplies.

    ``devices``: a count or the inventory to report. ``refresh_s``: how often the background
    thread re-reads the feed (the feed may change during the run: an injector appends faults);
    ``refresh()`` does the same at once. ``read_timeout``: the bound of one feed read.
    """

    name = "scripted"

    def __init__(
        self,
        feed: FaultFeed,
        devices: int | Sequence[DeviceInfo],
        clock: Clock = time.monotonic,
        *,
        node: str = "local",
        refresh_s: float = 1.0,
        read_timeout: float = 2.0,
    ):
        self._feed = feed
        self._devices = (scripted_devices(devices, node) if isinstance(devices, int)
                         else list(devices))
        self._clock = clock
        self._refresh_s = float(refresh_s)
        self._read_timeout = float(read_timeout)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = clock()
        self._faults: list[Fault] = []
        self._first_seen: dict[tuple[int, Fault], float] = {}
        self._last_problem: Optional[str] = None
        self._load(strict=True)

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    def _load(self, strict: bool) -> None:
        try:
            text = self._feed.read(self._read_timeout)
            faults = parse_faults(text or "", self._feed.where)
            self._check_devices(faults)
        except FaultScriptError as exc:
            if strict:
                raise
            self._report(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - feed unreachable: keep the last script
            if strict:
                raise FaultScriptError(self._feed.where, f"cannot read it ({exc})") from exc
            self._report(f"cannot read fault script {self._feed.where} ({exc}); keeping the "
                         "previous one")
            return
        now = self._clock()
        with self._lock:
            if self._last_problem is not None:
                log.info("fault script %s is readable again", self._feed.where)
            self._last_problem = None
            self._faults = faults
            for i, fault in enumerate(faults):
                self._first_seen.setdefault((i, fault), now)

    def _check_devices(self, faults: list[Fault]) -> None:
        known = {d.index for d in self._devices}
        for i, fault in enumerate(faults):
            if fault.device not in known:
                raise FaultScriptError(
                    f"{self._feed.where} fault {i}",
                    f"device {fault.device} does not exist (devices: {sorted(known)})",
                )

    def _report(self, problem: str) -> None:
        with self._lock:
            repeat = problem == self._last_problem
            self._last_problem = problem
        if not repeat:
            log.warning("%s", problem)

    def refresh(self) -> None:
        """Re-read the feed now (a bad or unreadable script is logged and ignored)."""
        self._load(strict=False)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._start = self._clock()
            self._first_seen = {k: max(v, self._start) for k, v in self._first_seen.items()}
        self._thread = threading.Thread(target=self._run, name="scripted-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self.refresh()

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("scripted health refresh did not stop within %.1fs", timeout)

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def poll(self, now: float) -> dict[int, Verdict]:
        with self._lock:
            timed = [
                (self._start + f.at if f.at is not None else self._first_seen[(i, f)], f)
                for i, f in enumerate(self._faults)
            ]
        return replay(timed, [d.index for d in self._devices], now, self._start)
