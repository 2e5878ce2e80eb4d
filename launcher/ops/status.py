"""The terminal view of a job (``hspmd-launch status``), rendered with rich from a ``JobView``.

Promises: ``render(view)`` is a pure function of the view (plus the display clock) returning one
rich renderable: a header (leader, plan, throughput, device counts), the cluster (nodes -> GPUs
coloured by health, with the reason of every non-healthy one), a "Speeds" table once any
device speed or worker busy time is known (per device: its worker's busy time per step, the
speed the plan assumed and the speed measured under it), the plan (pipelines x stages x TP
groups with layer ranges), progress bars for the waits in progress (rendezvous, switch) and the
recent events. What the job has not published is said in words ("no plan published"), never an
empty table. Every string that comes from etcd is shown as text (``safe.text``): never parsed as
rich markup, control characters escaped, cut to a bounded length. ``status --json`` does not come
from here: it is ``JobView.document()``.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Optional

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from launcher.ops.events import event_dict, format_bytes
from launcher.ops.safe import clean, text
from launcher.ops.view import JobView, newest_speeds

HEALTH_STYLE = {"healthy": "green", "degraded": "yellow", "suspect": "dark_orange", "failed": "bold red",
                "unknown": "grey62", "lost": "magenta"}
NODE_STYLE = {"running": "green", "ready": "green", "joining": "cyan", "leaving": "grey62",
              "failed": "bold red", "lost": "magenta"}
EVENT_STYLE = {"failure": "bold red", "leave": "magenta", "degrade": "yellow", "stall": "yellow",
               "switch-done": "green", "switch-failed": "bold red",
               "restart": "yellow", "fallback": "bold red", "join": "green", "recover": "green",
               "replan": "cyan", "retry": "yellow"}
GLYPH = "\u25a0"  # a filled square per GPU
RECENT_SHOWN = 12
BAD_SHOWN = 20  # undecodable keys listed (the JSON document has them all)


def clock(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")
    except (OverflowError, ValueError, OSError):  # a time no clock shows (a forged record)
        return "?"


def age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.1f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render(view: JobView, endpoints: str = "") -> RenderableType:
    parts = [_header(view, endpoints), _cluster(view)]
    speeds = _speeds(view)
    if speeds is not None:
        parts.append(speeds)
    parts.append(_plan(view))
    waits = _waits(view)
    if waits is not None:
        parts.append(waits)
    parts.append(_events(view))
    if view.bad_records:
        bad = Table(title="Undecodable keys", title_justify="left", show_edge=False)
        bad.add_column("key")
        bad.add_column("problem", style="red")
        for key, problem in view.bad_records[:BAD_SHOWN]:
            bad.add_row(text(key), text(problem, "red", limit=300))
        if len(view.bad_records) > BAD_SHOWN:
            bad.add_row(Text(f"... and {len(view.bad_records) - BAD_SHOWN} more "
                             "(status --json lists them all)"), Text(""))
        parts.append(bad)
    return Group(*parts)


# ----------------------------------------------------------------------------------- header
def _header(view: JobView, endpoints: str) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    leader = view.leader
    grid.add_row("leader", text(f"{leader['node']} (term {leader['term']}, since "
                                f"{clock(leader['since'])})") if leader else
                 Text("no leader elected", style="grey62"))
    plan = view.plan
    grid.add_row("plan", text(f"v{plan.version}: {plan.reason} ({len(plan.devices)} devices, "
                              f"{clock(plan.created_at)})") if plan else
                 Text("no plan published", style="grey62"))
    tp = view.throughput
    if tp["workers"]:
        rate = "-" if tp["steps_per_s"] is None else f"{tp['steps_per_s']:.3f} steps/s"
        grid.add_row("progress", Text(f"step {tp['step']}, {rate}, {tp['workers']} workers"))
    else:
        grid.add_row("progress", Text("no workers running", style="grey62"))
    counts = view.device_counts()
    line = Text()
    for state, n in counts.items():
        if n:
            line.append(f"{n} {state}  ", style=HEALTH_STYLE[state])
    grid.add_row("devices", line if line else Text("no devices reported", style="grey62"))
    c = view.counters
    grid.add_row("switches", Text(f"{c['total']} done, {c['failed']} failed, "
                                  f"{c['seconds_total']:.2f}s, "
                                  f"{format_bytes(c['bytes_moved_total'])} moved"))
    rd = view.rendezvous
    if rd is not None:
        grid.add_row("rendezvous", Text(f"round {rd['round']} {rd['state']}, restarts "
                                        f"{rd['restart_count']}, {len(rd['participants'])} nodes"))
    where = f" @ {clean(endpoints)}" if endpoints else ""
    return Panel(grid, title=Text.assemble((f"job {clean(view.job)}", "bold"), where),
                 subtitle=Text(f"etcd revision {view.revision} at {clock(view.generated_at)}"),
                 expand=False)


# ---------------------------------------------------------------------------------- cluster
def _cluster(view: JobView) -> RenderableType:
    if not view.nodes:
        return Text("no nodes registered", style="grey62")
    table = Table(title="Cluster", title_justify="left", expand=False)
    for col in ("node", "host", "state", "GPUs", "workers", "step", "steps/s"):
        table.add_column(col, justify="right" if col in ("workers", "step", "steps/s") else "left")
    for node in view.nodes:
        gpus = Text()
        for d in node.devices:
            gpus.append(GLYPH, style=HEALTH_STYLE[d.health])
            gpus.append(f"{d.index} ")
        if not node.devices:
            gpus.append("none reported", style="grey62")
        steps = [w.step for w in node.workers]
        rates = [w.steps_per_s for w in node.workers]
        table.add_row(text(node.id), text(node.host or "-"),
                      text(node.state, NODE_STYLE.get(node.state, "")), gpus,
                      str(len(node.workers)), str(max(steps)) if steps else "-",
                      f"{sum(rates) / len(rates):.3f}" if rates else "-")
    problems = [d for d in view.devices if d.health not in ("healthy", "unknown")]
    if not problems:
        return table
    detail = Table(title="Devices needing attention", title_justify="left", expand=False)
    for col in ("device", "health", "reason", "xid", "since", "in plan", "replaced by"):
        detail.add_column(col)
    for d in problems:
        detail.add_row(text(d.id), text(d.health, HEALTH_STYLE[d.health]),
                       text(d.reason or "-"),
                       "-" if d.xid is None else str(d.xid), clock(d.health_at),
                       "yes" if d.plan_rank is not None else "no",
                       "-" if d.replaced_by_plan is None else f"plan v{d.replaced_by_plan}")
    return Group(table, detail)


# ----------------------------------------------------------------------------------- speeds
def speed_rows(view: JobView) -> list[tuple[str, Optional[int], float, Optional[float],
                                            Optional[float], Optional[str]]]:
    """(device, global rank, busy_s, planned, measured, idle) of every device or worker with
    any of them known, sorted by device; a worker's device is ``<node>:<local_rank>``;
    ``idle``: why the current plan leaves the device idle (None: it does not)."""
    rows: dict[str, list] = {}
    for node in view.nodes:
        for d in node.devices:
            if d.planned_speed is not None or d.measured_speed is not None or d.idle:
                rows[d.id] = [d.id, None, 0.0, d.planned_speed, d.measured_speed, d.idle]
        for w in node.workers:
            if w.busy_s > 0:
                row = rows.setdefault(f"{node.id}:{w.local_rank}",
                                      [f"{node.id}:{w.local_rank}", None, 0.0, None, None,
                                       None])
                row[1], row[2] = w.global_rank, w.busy_s
    return [tuple(rows[k]) for k in sorted(rows)]


def redundancy_line(view: JobView) -> Optional[str]:
    """What the newest speed decision did to the copies of the parameters (None: no decision
    weighed them): ``redundancy kept: copies 2 -> 2 device(s), ...; <why>``."""
    detail = newest_speeds(view.events)
    if detail is None or not detail.redundancy:
        return None
    return (f"redundancy {detail.redundancy} (plan v{detail.plan_version}): copies "
            f"{detail.copies_before} -> {detail.copies_after} device(s), "
            f"{detail.copy_nodes_before} -> {detail.copy_nodes_after} node(s); "
            f"{detail.redundancy_reason}")


def _speeds(view: JobView) -> Optional[RenderableType]:
    rows = speed_rows(view)
    if not rows:
        return None
    line = redundancy_line(view)
    table = Table(title="Speeds", title_justify="left", expand=False,
                  caption=None if line is None else text(line, limit=400),
                  caption_justify="left")
    idle = any(r[5] for r in rows)
    for col in ("device", "rank", "busy/step", "planned", "measured (fastest 1.00)",
                *(("idle: why",) if idle else ())):
        table.add_column(col, justify="left" if col in ("device", "idle: why") else "right")
    for dev, rank, busy, planned, measured, why in rows:
        slow = measured is not None and planned is not None and measured < planned
        table.add_row(text(dev), "-" if rank is None else str(rank),
                      f"{busy:.4f}s" if busy > 0 else "-",
                      "-" if planned is None else f"{planned:.2f}",
                      Text("-" if measured is None else f"{measured:.2f}",
                           style="yellow" if slow else ""),
                      *((text(why or "-", limit=200),) if idle else ()))
    return table


# ------------------------------------------------------------------------------------- plan
def _plan(view: JobView) -> RenderableType:
    plan = view.plan
    if plan is None:
        return Text("Plan: no plan published", style="grey62")
    health = {d.id: d.health for d in view.devices}
    tree = Tree(text(f"Plan v{plan.version} ({plan.reason}), store {plan.store_endpoint}",
                     "bold"))
    if plan.layout_error:
        tree.add(text(plan.layout_error, "yellow", limit=300))
        tree.add(text(json.dumps(plan.strategy, sort_keys=True), limit=500))
        tree.add(text("devices: " + ", ".join(plan.devices), limit=500))
        return tree
    for pipe in plan.pipelines:
        branch = tree.add(Text(f"pipeline {pipe['index']}: {pipe['num_microbatches']} x "
                               f"{pipe['microbatch_size']} rows"))
        for st in pipe["stages"]:
            line = Text(f"stage {st['index']}  layers {st['layers'][0]}-{st['layers'][1] - 1}"
                        f"  TP{st['tp']} ")
            for dev in st["devices"]:
                line.append(f" {clean(dev)}", style=HEALTH_STYLE.get(health.get(dev, "unknown")))
            branch.add(line)
    if plan.buckets:
        branch = tree.add(Text("length buckets (one optimizer step over all):"))
        for b in plan.buckets:
            if "error" in b:
                branch.add(text(f"bucket {b['index']}: {b['error']}", "yellow", limit=300))
                continue
            how = "own plan, switched in the step" if b["switches"] else "home layout"
            branch.add(text(f"{b['window']} tokens, rows {b['start']}+{b['rows']}: "
                            f"{b['layout']} ({how})", limit=300))
    if view.plan_history:
        tree.add(text("history: " + ", ".join(
            f"v{p['version']} {clean(p['reason'], 60)}" for p in view.plan_history[-5:]),
            "grey62", limit=500))
    return tree


# ------------------------------------------------------------------------------------ waits
def _waits(view: JobView) -> Optional[RenderableType]:
    if not view.waits:
        return None
    table = Table.grid(padding=(0, 2))
    for w in view.waits:
        bar = ProgressBar(total=w.total, completed=w.done, width=30, pulse=w.total is None)
        count = f"{w.done}/{w.total}" if w.total is not None else f"{w.done}"
        table.add_row(text(w.label), bar, Text(count), Text(age(w.elapsed_s)))
    return Panel(table, title="waiting", expand=False)


# ----------------------------------------------------------------------------------- events
def _events(view: JobView) -> RenderableType:
    if not view.events:
        return Text("Events: none recorded", style="grey62")
    table = Table(title=f"Recent events ({len(view.events)} in all)", title_justify="left",
                  expand=False)
    for col in ("time", "seq", "type", "node", "what", "took"):
        table.add_column(col, justify="right" if col in ("seq", "took") else "left")
    for ev in view.events[-RECENT_SHOWN:]:
        d = event_dict(ev)
        took = "-" if d["duration_s"] is None else f"{d['duration_s']:.2f}s"
        table.add_row(Text(clock(ev.at)), Text(str(ev.seq)),
                      text(ev.type, EVENT_STYLE.get(ev.type, "")), text(ev.node or "-"),
                      text(d["summary"], limit=300), Text(took))
    return table
