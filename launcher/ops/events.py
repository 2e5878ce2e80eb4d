"""The job's journal read for operators: switches paired from events, counters, summaries.

Promises (pure functions of ``EventRecord`` lists, no I/O):

* switches are paired by the contract's one reader (``contract.events.switch_of``): the
  ``replan`` that replaces a plan starts one, the ``switch-done``/``switch-failed`` of the same
  ``plan_version`` ends it; a switch overtaken by a newer plan is ``superseded``;
* a switch's duration is ``timings.total_s``, else the sum of its ``*_s`` timings, else the time
  from its start event; bytes moved are the ``switch-done`` detail's ``bytes_moved``;
* counters (switches, failures, seconds, bytes, events by type) cover the whole journal;
* ``event_summary`` says in one line what an event means (a ``speeds`` event: the devices whose
  measured speed differs from the plan's, the predicted gain and cost of the decision, and the
  devices its plan leaves idle with why: ``idle_summary``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.errors import RecordError

SWITCH_TYPES = ("switch-done", "switch-failed")


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


def switches_of(events: list[schema.EventRecord]) -> list[SwitchView]:
    """The journal's switches, paired by ``contract.events.switch_of``."""
    out: list[SwitchView] = []
    open_by_version: dict[int, tuple[SwitchView, schema.EventRecord]] = {}
    for ev in events:
        mark = schema.switch_of(ev)
        if mark is None:
            continue
        if mark.phase == "start":
            if mark.to_version in open_by_version:
                continue
            for sw, _ in open_by_version.values():  # a newer plan overtook them
                sw.state = "superseded"
            open_by_version.clear()
            sw = SwitchView(mark.to_version, mark.from_version, "running", ev.at, None, None, 0,
                            {}, mark.reason)
            out.append(sw)
            open_by_version[mark.to_version] = (sw, ev)
            continue
        sw, start = open_by_version.pop(mark.to_version, (None, None))
        if sw is None:  # a done/failed without a start we know of
            sw = SwitchView(mark.to_version, None, "running", None, None, None, 0, {}, "")
            out.append(sw)
        sw.state = mark.phase
        sw.finished_at = ev.at
        sw.from_version = mark.from_version or sw.from_version
        sw.timings = dict(ev.timings)
        sw.bytes_moved = mark.bytes_moved
        sw.duration_s = switch_duration(ev, start)
        if sw.state == "failed":
            sw.reason = mark.reason or sw.reason
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
    """One line saying what an event means (from its typed detail)."""
    try:
        d = schema.event_detail(ev)
    except RecordError:
        return "(a detail this version does not read)"
    mark = schema.switch_of(ev, d)
    if ev.type in ("switch-done", "switch-failed") and mark is not None:
        return _switch_summary(ev, mark, d)
    if isinstance(d, schema.ReplanDetail):
        n = d.device_count
        return f"plan v{d.version} over {n} device{'' if n == 1 else 's'}" + (
            f": {d.reason}" if d.reason else "")
    if isinstance(d, schema.FailureDetail) and d.exits and d.round is not None:
        parts = [f"rank {'?' if e.global_rank is None else e.global_rank} exitcode "
                 f"{e.exitcode if e.exitcode is not None else -(e.signal or 0)}"
                 for e in d.exits[:4]]
        return "worker failure: " + ", ".join(parts)
    if isinstance(d, schema.StallDetail) and d.step is not None:
        return f"device {', '.join(d.devices)} stalled at step {d.step}" + (
            f" for {d.stalled_s}s" if d.stalled_s is not None else "")
    if isinstance(d, schema.ChangeDetail):
        where = ", ".join(d.devices or d.nodes)
        if d.reason:
            return d.reason + (f" (device {where})" if d.devices else "")
        return ("devices " if d.devices else "nodes ") + where if where else ev.type
    if isinstance(d, schema.FallbackDetail):
        return (f"plan v{d.plan_version} from the checkpoint of step {d.checkpoint_step} "
                f"({d.steps_redone} step(s) redone): {d.error}")
    if isinstance(d, schema.DrainedDetail):
        return f"device {d.device} drained into plan v{d.plan_version}"
    if isinstance(d, schema.RestartDetail):
        return f"restart {d.restart_count} (round {d.round}): {d.reason}"
    if isinstance(d, schema.SpeedsDetail):
        return _speeds_summary(d)
    return ev.type


SPEEDS_SHOWN = 4  # devices a ``speeds`` summary names (the detail has them all)


def _speeds_summary(d: Any) -> str:
    """The measured speeds that differ from the assumed ones, and the decision's numbers."""
    moved = [dev for dev in sorted(d.measured)
             if abs(d.measured[dev] - d.assumed.get(dev, 1.0)) > 1e-9]
    shown = ", ".join(f"{dev} {d.measured[dev]:.2f} (plan {d.assumed.get(dev, 1.0):.2f})"
                      for dev in moved[:SPEEDS_SHOWN])
    more = f" and {len(moved) - SPEEDS_SHOWN} more" if len(moved) > SPEEDS_SHOWN else ""
    verdict = "replan" if d.replan else "keep the plan"
    return (f"plan v{d.plan_version} measured {shown or 'as assumed'}{more}; step "
            f"{d.step_now_s:.3f}s -> {d.step_new_s:.3f}s, gain {d.gain_s:.1f}s vs cost "
            f"{d.cost_s:.1f}s{copies_summary(d)}: {verdict}"
            + (f" ({d.reason})" if d.reason else "") + idle_summary(d))


def idle_summary(d: Any) -> str:
    """``; idle: n:2 (speed 0.25: step 0.31 s with it, 0.28 s without)`` ("" when the
    decision's plan leaves no device idle)."""
    idle = getattr(d, "idle", None) or {}
    shown = ", ".join(f"{dev} ({idle[dev].reason})" for dev in sorted(idle)[:SPEEDS_SHOWN])
    more = f" and {len(idle) - SPEEDS_SHOWN} more" if len(idle) > SPEEDS_SHOWN else ""
    return f"; idle: {shown}{more}" if idle else ""


def copies_summary(d: Any) -> str:
    """``; copies 2 -> 2 device(s), 1 -> 1 node(s) kept`` ("" when not predicted)."""
    if not getattr(d, "redundancy", ""):
        return ""
    return (f"; copies {d.copies_before} -> {d.copies_after} device(s), "
            f"{d.copy_nodes_before} -> {d.copy_nodes_after} node(s) {d.redundancy}")


def _switch_summary(ev: schema.EventRecord, mark: schema.SwitchMark, d: Any) -> str:
    frm, to = mark.from_version, mark.to_version
    text = f"plan v{frm} -> v{to}" if frm else f"to plan v{to}"
    if ev.type == "switch-done":
        dur = switch_duration(ev, None)
        text += "" if dur is None else f" in {dur:.2f}s"
        text += f", {format_bytes(mark.bytes_moved)} moved" if mark.bytes_moved else ""
        text += f" (from {d.source})" if d.source in ("checkpoint", "init") else ""
    if ev.type == "switch-failed" and mark.reason:
        text += f": {mark.reason}"
    return text


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
