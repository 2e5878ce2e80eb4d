"""The job's journal read for operators: switches paired from events, counters, summaries.

Promises (pure functions of ``EventRecord`` lists, no I/O):

* a switch starts with a ``switch-start`` event or with a ``replan`` that replaces a plan
  (``previous_version`` > 0), and ends with ``switch-done``/``switch-failed`` of the same target
  version (``detail.to_version``/``version``/``plan_version`` or ``timings.to_version``, as the
  runtime's switch timings carry it); a switch overtaken by a newer plan is ``superseded``;
* a switch's duration is ``timings.total_s``, else the sum of its ``*_s`` timings, else the time
  from its start event; bytes moved are ``detail.bytes_moved`` or ``timings.bsr_bytes_total``;
* counters (switches, failures, seconds, bytes, events by type) cover the whole journal;
* ``event_summary`` says in one line what an event means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hspmd_elastic.contract import schema

SWITCH_TYPES = ("switch-start", "switch-done", "switch-failed")


@dataclass
class SwitchView:
    to_version: Optional[int]
    from_version: Optional[int]
    state: str  # running | done | failed | superseded (a newer plan came first)
    started_at: Optional[float]
    finished_at: Optional[float]
    duration_s: Optional[float]
    bytes_moved: int
    timings: dict[str, float]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)




# -------------------------------------------------------------------------------- switches
def _int(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def switch_version(event: schema.EventRecord) -> Optional[int]:
    """The target plan version of a switch event: ``detail.to_version``/``version``/
    ``plan_version``, else ``timings.to_version`` (the runtime's switch timings)."""
    for name in ("to_version", "version", "plan_version"):
        value = _int(event.detail.get(name))
        if value is not None:
            return value
    return _int(event.timings.get("to_version"))


def switch_from(event: schema.EventRecord) -> Optional[int]:
    for value in (event.detail.get("from_version"), event.detail.get("previous_version"),
                  event.timings.get("from_version")):
        if _int(value) is not None:
            return _int(value)
    return None


def switch_duration(done: schema.EventRecord, start: Optional[schema.EventRecord]
                    ) -> Optional[float]:
    """``timings.total_s``, else the sum of the ``*_s`` timings, else done.at - start.at."""
    t = done.timings
    if "total_s" in t:
        return float(t["total_s"])
    phases = [v for k, v in t.items() if k.endswith("_s")]
    if phases:
        return float(sum(phases))
    if start is not None:
        return max(0.0, done.at - start.at)
    return None


def _bytes(event: schema.EventRecord) -> int:
    """Bytes a switch moved: ``detail.bytes_moved``, else ``timings.bsr_bytes_total``."""
    for value in (event.detail.get("bytes_moved"), event.detail.get("bytes"),
                  event.timings.get("bsr_bytes_total")):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return 0


def _is_start(ev: schema.EventRecord) -> bool:
    """A switch starts with ``switch-start``, or with a ``replan`` that replaces a plan."""
    if ev.type == "switch-start":
        return True
    return ev.type == "replan" and (switch_from(ev) or 0) > 0


def switches_of(events: list[schema.EventRecord]) -> list[SwitchView]:
    out: list[SwitchView] = []
    open_by_version: dict[Optional[int], tuple[SwitchView, schema.EventRecord]] = {}
    for ev in events:
        if ev.type not in SWITCH_TYPES and not _is_start(ev):
            continue
        version = switch_version(ev)
        if _is_start(ev):
            if version in open_by_version:
                continue  # a replan and a switch-start of the same switch
            for sw, _ in open_by_version.values():  # a newer plan overtook them
                sw.state = "superseded"
            open_by_version.clear()
            sw = SwitchView(version, switch_from(ev), "running", ev.at, None, None, 0, {},
                            str(ev.detail.get("reason", "")))
            out.append(sw)
            open_by_version[version] = (sw, ev)
            continue
        sw, start = open_by_version.pop(version, (None, None))
        if sw is None:  # a done/failed without a start we know of
            sw = SwitchView(version, None, "running", None, None, None, 0, {}, "")
            out.append(sw)
        sw.state = "done" if ev.type == "switch-done" else "failed"
        sw.finished_at = ev.at
        sw.from_version = switch_from(ev) if switch_from(ev) is not None else sw.from_version
        sw.timings = dict(ev.timings)
        sw.bytes_moved = _bytes(ev)
        sw.duration_s = switch_duration(ev, start)
        if sw.state == "failed":
            sw.reason = str(ev.detail.get("error", ev.detail.get("reason", ""))) or sw.reason
    return out


def counters_of(events, switches: list[SwitchView], leader_changes: int) -> dict[str, Any]:
    done = [s for s in switches if s.state == "done"]
    by_type: dict[str, int] = {}
    for ev in events:
        by_type[ev.type] = by_type.get(ev.type, 0) + 1
    return {
        "total": len(done),
        "failed": sum(1 for s in switches if s.state == "failed"),
        "seconds_total": round(sum(s.duration_s or 0.0 for s in done), 6),
        "bytes_moved_total": sum(s.bytes_moved for s in switches),
        "last_seconds": done[-1].duration_s if done else None,
        "events_by_type": by_type,
        "leader_changes": leader_changes,
    }


# ---------------------------------------------------------------------------------- events
def event_dict(ev: schema.EventRecord) -> dict[str, Any]:
    return {"seq": ev.seq, "type": ev.type, "node": ev.node, "at": ev.at,
            "summary": event_summary(ev), "duration_s": event_duration(ev), "detail": ev.detail,
            "timings": ev.timings}


def event_duration(ev: schema.EventRecord) -> Optional[float]:
    """How long an event took: a switch's duration; else ``timings.total_s``, else the
    largest ``*_s`` timing (phases end at the total); None without timings."""
    if ev.type in ("switch-done", "switch-failed"):
        return switch_duration(ev, None)
    if "total_s" in ev.timings:
        return float(ev.timings["total_s"])
    phases = [v for k, v in ev.timings.items() if k.endswith("_s")]
    return float(max(phases)) if phases else None


def event_summary(ev: schema.EventRecord) -> str:
    """One line saying what an event means."""
    d = ev.detail
    if ev.type in SWITCH_TYPES:
        return _switch_summary(ev)
    if ev.type == "replan":
        text = f"plan v{switch_version(ev)}"
        n = d.get("devices")
        text += f" over {n} device{'' if n == 1 else 's'}" if isinstance(n, int) else ""
        return text + (f": {d['reason']}" if d.get("reason") else "")
    if ev.type == "failure" and isinstance(d.get("failures"), list) and d["failures"]:
        parts = [f"rank {f.get('global_rank', '?')} exitcode {f.get('exitcode', '?')}"
                 for f in d["failures"][:4] if isinstance(f, dict)]
        return "worker failure: " + ", ".join(parts)
    if ev.type == "stall" and "device" in d:
        return f"device {d['device']} stalled at step {d.get('step', '?')}" + (
            f" for {d['stalled_s']}s" if "stalled_s" in d else "")
    devices = d.get("devices") if isinstance(d.get("devices"), list) else []
    for name in ("reason", "message", "error", "detail"):
        if isinstance(d.get(name), str) and d[name]:
            where = d["device"] if "device" in d else ", ".join(map(str, devices))
            return d[name] + (f" (device {where})" if where else "")
    if devices:
        return "devices " + ", ".join(map(str, devices))
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items()) if not isinstance(v, (dict, list)))


def _switch_summary(ev: schema.EventRecord) -> str:
    frm, to = switch_from(ev), switch_version(ev)
    text = f"plan v{frm} -> v{to}" if frm is not None else f"to plan v{to}"
    if ev.type == "switch-done":
        dur = switch_duration(ev, None)
        text += "" if dur is None else f" in {dur:.2f}s"
        moved = _bytes(ev)
        text += f", {format_bytes(moved)} moved" if moved else ""
        source = ev.detail.get("source")
        text += f" (from {source})" if source in ("checkpoint", "init") else ""
    if ev.type == "switch-failed" and ev.detail.get("error"):
        text += f": {ev.detail['error']}"
    return text


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
