"""The harness's report: one row per fault (injected at, detected at, switch/recovery done at,
steps lost, outcome), plus what the progress log says about the whole run (samples lost).

Promises: ``finalize`` fills steps lost and samples lost from the progress points alone (pure);
``render_table`` is plain text, one line per fault, times in seconds since the scenario
started (``-`` = did not happen), every value with control characters escaped (a value read
from etcd or a process cannot write to the terminal); ``render_json`` is the versioned JSON form
(``Report.to_dict``); ``all_handled`` says whether every fault was detected and recovered (or,
for a fault the job should ride through, survived) and the job did not fail; the table's
``job:`` line says how the job stood at the end (succeeded, failed with the reason, running).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from launcher.inject.api import JOB_FAILED, RECOVERED, SURVIVED, FaultRow, ProgressPoint, \
    Report
from launcher.inject.detect import Baseline, lineage_gaps, steps_lost
from launcher.ops.safe import clean


def finalize(report: Report, points: Sequence[ProgressPoint],
             bases: dict[int, tuple[Baseline, Optional[int]]]) -> Report:
    """Fill ``steps_lost`` of every recovered row and the run's samples lost.

    ``bases``: row index -> (the job just before that injection, the round it recovered in).
    """
    for row in report.rows:
        if row.index in bases and row.recovered_at is not None:
            base, rnd = bases[row.index]
            row.steps_lost = steps_lost(points, rnd, base)
    lineage = lineage_gaps(points)
    report.steps_skipped = lineage.steps_skipped if points else None
    report.samples_lost = lineage.samples_lost if points else None
    report.final_step = lineage.final_step
    return report


def all_handled(report: Report) -> bool:
    failed = report.job_end is not None and report.job_end.state == JOB_FAILED
    return not failed and all(r.outcome in (RECOVERED, SURVIVED) for r in report.rows)


def _t(value: Optional[float]) -> str:
    return "-" if value is None else f"+{value:.2f}s"


def _target(row: FaultRow) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(row.target.items())) or "-"


COLUMNS = ("#", "fault", "target", "injected", "detected", "detected by", "switched/recovered",
           "by", "steps lost", "outcome")


def render_table(report: Report) -> str:
    lines = [[clean(c, 120) for c in (
        str(r.index), r.fault, _target(r), _t(r.injected_at), _t(r.detected_at),
        r.detected_by or "-", _t(r.recovered_at), r.recovered_by or "-",
        "-" if r.steps_lost is None else str(r.steps_lost),
        r.outcome + (" (escalated)" if r.escalated else ""))] for r in report.rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(COLUMNS)]
    out = [f"fault report: scenario {clean(report.scenario or '-')}, job {clean(report.job)}"]
    out.append("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip())
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    for r in report.rows:
        if r.note:
            out.append(f"  #{r.index} {r.fault}: {clean(r.note, 2000)}")
    end = report.job_end
    if end is not None:
        out.append(f"job: {end.state}" + ("" if end.at is None else f" at {_t(end.at)}") +
                   (f": {clean(end.reason, 2000)}" if end.reason else "") +
                   (f" (harness stopped: {clean(report.stopped)})" if report.stopped else ""))
    samples = "unknown (no progress seen)" if report.samples_lost is None and \
        report.steps_skipped is None else (
            "unknown (batch size not reported)" if report.samples_lost is None
            else str(report.samples_lost))
    out.append(f"samples lost: {samples}; steps skipped: "
               f"{'-' if report.steps_skipped is None else report.steps_skipped}; "
               f"last step seen: {'-' if report.final_step is None else report.final_step}")
    return "\n".join(out)


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=True)
