"""The pure parts of ``scripts/bench_hetero``: its arguments, throughput from the workers'
timelines, the cost model's predictions (uncalibrated and calibrated) of the measured plans, the
targets and the report. No processes, no etcd, no clock.

Promises:

* ``parse_args(argv)`` gives a ``Settings`` (``--quick`` shrinks every count; a count or time
  out of range is a one-line ``SystemExit`` naming the flag and its value);
* ``step_ends(timelines)`` is, per step index, when the last worker completed it and under which
  plan version; ``window(ends, after, skip, count)`` the ``count`` steps that ended after
  ``after`` once ``skip`` were left out; ``rate(ends, steps, tokens_per_step)`` the step time
  (the median time between consecutive completions: the machine is shared, and a stall of
  another process should not count as the plan's), tokens/s from it, and the mean tokens/s
  over the span (None with fewer than two): the first step's own duration is never counted,
  so a window of ``n`` steps measures ``n - 1`` step times;
* ``predictions(records, profile)`` fits the cost model's CPU constants to the measured plans
  (``planner.calibrate.fit_steps``) and gives each plan's uncalibrated and calibrated step time
  and the errors; a fit the measurements do not determine is reported, not raised;
* ``targets(result)`` checks the issue's four ratios, each PASS or MISS (a missing figure is a
  MISS with its reason); nothing here fails on a miss;
* ``report(result)`` is the markdown of the tables, with the command that made them.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from bench.common import cell, int_flag, ratio, seconds_flag
from bench.hetero_mixes import MIXES, mix_name, parse_mixes
from bench.common import fmt as _f
from bench.common import ms as _ms

NODE = "sn"
NPROC = 4
MIX = (0.5, 0.5, 0.125, 0.125)  # of a core, per local rank: the 4:1 mix of (a)
EVEN, SLOW = 0.5, 0.125  # (b): every worker at EVEN, then the straggler at SLOW
STRAGGLER = NPROC - 1  # the local rank that slows down in (b)
MODEL = dict(vocab_size=64, hidden_size=256, num_heads=4, num_layers=2, ffn_size=1024,
             seq_len=32, dtype="float32")
SEED, DATA_SEED = 3, 7
ONSET_TARGET_S = 30.0  # (b): within this long of the onset ...
OPTIMUM_FRACTION = 0.85  # ... at least this share of the optimum's tokens/s
HETERO_GAIN = 1.3  # measured hetero / uniform
MODEL_ERROR = 0.20  # calibrated model vs measured, per plan
JOURNAL_SLACK_S = 0.5  # two switches' journal times may be closer than the leader's decisions
SECTION = "## Heterogeneous devices, measured"
PARTS = ("steady", "straggler", "mixes")


@dataclass(frozen=True)
class Settings:
    measure: int  # steps per throughput window
    skip: int  # steps left out after a start, a quota change or a switch
    dwell_s: float  # --hspmd-straggler-dwell of the replans-on jobs
    flips: int  # (c): quota flips of the noisy device
    flip_steps: int  # steps between two flips
    global_batch: int
    phase_timeout_s: float  # every job's deadline
    quick: bool
    json_path: Optional[str]
    write_doc: Optional[str]
    parts: tuple[str, ...] = PARTS  # which parts run: steady (a), straggler (b, c), mixes (d)
    mixes: tuple[tuple[float, ...], ...] = MIXES
    rounds: int = 2  # (d): rounds of every candidate on every mix
    period_ms: int = 100  # the CFS period of the workers' CPU quotas

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * MODEL["seq_len"]




def parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true",
                    help="a short run (fewer steps per window, fewer flips): for development")
    ap.add_argument("--measure-steps", type=int_flag("--measure-steps", 3), default=None,
                    help="steps per throughput window (default 16; 6 with --quick)")
    ap.add_argument("--skip-steps", type=int_flag("--skip-steps", 0), default=None,
                    help="steps left out after a start, quota change or switch (default 3; 2)")
    ap.add_argument("--dwell", type=seconds_flag("--dwell", 1.0, 600.0), default=None,
                    help="--hspmd-straggler-dwell of the replans-on jobs (default 10 s; 5)")
    ap.add_argument("--flips", type=int_flag("--flips", 0), default=None,
                    help="quota flips of the noisy device (default 6; 4)")
    ap.add_argument("--flip-steps", type=int_flag("--flip-steps", 1), default=None,
                    help="steps between two flips (default 16; 10)")
    ap.add_argument("--global-batch", type=int_flag("--global-batch", NPROC), default=64,
                    help=f"rows per step (default 64, at least {NPROC})")
    ap.add_argument("--phase-timeout", type=seconds_flag("--phase-timeout", 10.0, 3600.0),
                    default=300.0, help="deadline of each job (default 300 s)")
    ap.add_argument("--parts", default=",".join(PARTS), metavar="PART,...",
                    help="which parts run: steady ((a) and the cost model), straggler ((b), "
                    "(c)), mixes ((d): ours against the best baseline on each mix); default all")
    ap.add_argument("--mixes", default=";".join(mix_name(m) for m in MIXES),
                    metavar="S,S,...;...", help="(d): the mixes, each a share of a core per "
                    "device; default " + "; ".join(mix_name(m) for m in MIXES))
    ap.add_argument("--rounds", type=int_flag("--rounds", 1, 100), default=None,
                    help="(d): rounds of every candidate on every mix (default 2; 1 with --quick)")
    ap.add_argument("--cfs-period-ms", type=int_flag("--cfs-period-ms", 2, 1000), default=100,
                    help="CFS period of the workers' CPU quotas (default 100 ms); a shorter one "
                    "keeps a capped worker from stopping for long: each of its messages waits up "
                    "to (1 - share) x period for it to run again")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--write-doc", default=None, metavar="PATH",
                    help=f"replace the '{SECTION[3:]}' section of this markdown file")
    return ap


def parse_args(argv: Sequence[str], description: str = "") -> Settings:
    ap = parser(description)
    a = ap.parse_args(list(argv))
    q = a.quick
    parts = tuple(p for p in a.parts.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts={a.parts!r}: use some of {','.join(PARTS)}")
    try:
        mixes = parse_mixes(a.mixes, os.cpu_count() or 1)
    except ValueError as exc:
        ap.error(str(exc))
    return Settings(measure=a.measure_steps or (6 if q else 16),
                    skip=a.skip_steps if a.skip_steps is not None else (2 if q else 3),
                    dwell_s=a.dwell or (5.0 if q else 10.0),
                    flips=a.flips if a.flips is not None else (4 if q else 6),
                    flip_steps=a.flip_steps or (10 if q else 16), global_batch=a.global_batch,
                    phase_timeout_s=a.phase_timeout, quick=q, json_path=a.json_path,
                    write_doc=a.write_doc, parts=parts, mixes=mixes,
                    rounds=a.rounds or (1 if q else 2), period_ms=a.cfs_period_ms)


# ---- throughput from timelines ------------------------------------------------------------

@dataclass(frozen=True)
class StepEnd:
    step: int
    t: float  # when the last worker completed it (wall clock)
    version: int  # the plan version it ran under


def step_ends(timelines: Mapping[str, Sequence[Mapping]]) -> list[StepEnd]:
    """Per step index, the latest ``step`` mark of any worker (a synchronous step is done when
    its last rank is), in step order. A step redone after a rollback keeps its latest mark."""
    last: dict[int, tuple[float, int]] = {}
    for recs in timelines.values():
        for r in recs:
            if r.get("ev") != "step":
                continue
            step, t, v = int(r["step"]), float(r["t"]), int(r.get("v", 0))
            if step not in last or t > last[step][0]:
                last[step] = (t, v)
    return [StepEnd(s, *last[s]) for s in sorted(last)]


def window(ends: Sequence[StepEnd], after: float, skip: int, count: int,
           before: float = math.inf) -> list[StepEnd]:
    """The ``count`` steps that ended in ``(after, before)`` once the first ``skip`` of them are
    left out (fewer when the timeline has fewer)."""
    inside = [e for e in ends if after < e.t < before]
    return inside[skip:skip + count]


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float  # tokens per step / step_s
    step_s: float  # the median time between consecutive completions
    mean_tokens_per_s: float  # over the whole span (a stall of the shared machine included)
    steps: int  # step times measured (completions - 1)
    versions: tuple[int, ...]  # plan versions of the steps

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "step_s": self.step_s,
                "mean_tokens_per_s": self.mean_tokens_per_s, "steps": self.steps,
                "versions": list(self.versions)}


def rows_of(plan) -> list[int]:
    """Rows per step of each rank of ``plan`` (a ``hspmd_elastic.plan.Plan``)."""
    return [sum(p.rows for p in plan.pipelines if any(r in s.devices for s in p.stages))
            for r in sorted(plan.devices)]


def rate(steps: Sequence[StepEnd], tokens_per_step: int) -> Optional[Rate]:
    """Tokens/s over consecutive completions (the first one's duration is not counted): from
    the median step time, and the mean over the span."""
    if len(steps) < 2:
        return None
    span = steps[-1].t - steps[0].t
    gaps = [b.t - a.t for a, b in zip(steps, steps[1:])]
    step = statistics.median(gaps)
    if not (span > 0 and step > 0):
        return None
    return Rate(tokens_per_step / step, step, len(gaps) * tokens_per_step / span, len(gaps),
                tuple(sorted({s.version for s in steps})))


# ---- the cost model against the measurements ----------------------------------------------

@dataclass(frozen=True)
class PlanRow:
    name: str
    layout: str
    measured_s: float
    predicted_s: float  # the built-in CPU constants
    calibrated_s: Optional[float]  # the constants fitted to this run's plans
    held_out_s: Optional[float]  # fitted to the other plans only

    @staticmethod
    def error(predicted: Optional[float], measured: float) -> Optional[float]:
        return None if predicted is None else (predicted - measured) / measured

    def as_dict(self) -> dict:
        return {"plan": self.name, "layout": self.layout, "measured_s": self.measured_s,
                "predicted_s": self.predicted_s, "calibrated_s": self.calibrated_s,
                "held_out_s": self.held_out_s,
                "error": self.error(self.predicted_s, self.measured_s),
                "calibrated_error": self.error(self.calibrated_s, self.measured_s),
                "held_out_error": self.error(self.held_out_s, self.measured_s)}


def _estimate(plan, inventory, profile, calibration=None) -> float:
    from dataclasses import replace

    from hspmd_elastic.planner import Inventory, PlannerOptions, estimate_plan
    from hspmd_elastic.planner.calibrate import apply

    if calibration is not None:
        inventory = Inventory(tuple(replace(d, spec=apply(calibration, d.spec))
                                    for d in inventory.devices))
    return estimate_plan(plan, inventory, profile,
                         PlannerOptions(use_all_devices=True)).step_time_s


def predictions(records: Sequence[tuple[str, str, object, object, float]], profile
                ) -> tuple[list[PlanRow], dict]:
    """``records``: (name, layout, plan, inventory at the true speeds, measured step s). Each
    plan's predicted step time with the built-in constants, with the constants fitted to every
    record, and with those fitted to the others (held out); the fit's summary."""
    from hspmd_elastic.planner.calibrate import fit_steps

    data = [(plan, inv, secs) for _n, _l, plan, inv, secs in records]
    fit: dict = {"plans": len(data)}
    try:
        cal = fit_steps(profile, data)
        fit.update(types={k: asdict(v) for k, v in cal.types.items()},
                   rms_rel_error=cal.rms_rel_error, max_rel_error=cal.max_rel_error)
    except ValueError as exc:
        cal = None
        fit["error"] = str(exc)
    rows = []
    for i, (name, layout, plan, inv, secs) in enumerate(records):
        held = None
        others = data[:i] + data[i + 1:]
        try:
            held = _estimate(plan, inv, profile, fit_steps(profile, others)) if others else None
        except ValueError:
            held = None
        rows.append(PlanRow(name, layout, secs, _estimate(plan, inv, profile),
                            None if cal is None else _estimate(plan, inv, profile, cal), held))
    return rows, fit


# ---- targets --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    name: str
    value: str
    goal: str
    ok: bool

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else "MISS"

    def as_dict(self) -> dict:
        return {"target": self.name, "value": self.value, "goal": self.goal,
                "verdict": self.verdict}


def _tps(result: Mapping, *path: str) -> Optional[float]:
    node = result
    for key in path:
        if not isinstance(node, Mapping) or node.get(key) is None:
            return None
        node = node[key]
    return node if isinstance(node, (int, float)) else None



def min_gap(times: Sequence[float]) -> Optional[float]:
    """The shortest time between two consecutive events (None with fewer than two)."""
    ts = sorted(times)
    return min((b - a for a, b in zip(ts, ts[1:])), default=None)


def targets(result: Mapping) -> list[Target]:
    """The issue's targets on one run's ``result`` (the shape ``bench_hetero`` builds)."""
    out = []
    uni = _tps(result, "a", "uniform", "tokens_per_s")
    het = _tps(result, "a", "measured", "tokens_per_s")
    r = ratio(het, uni)
    out.append(Target("measured hetero / uniform (4:1 mix)",
                      "n/a" if r is None else f"{r:.2f}x", f">= {HETERO_GAIN:g}x",
                      r is not None and r >= HETERO_GAIN))
    b = result.get("b", {})
    opt = _tps(result, "a", "optimum_b", "tokens_per_s")
    after = _tps(b, "at_target", "tokens_per_s")
    done = b.get("switch_done_s")
    r = ratio(after, opt)
    value = ("n/a" if r is None or done is None
             else f"{100 * r:.0f}% of optimum at {ONSET_TARGET_S:g} s, switch done {done:.1f} s "
             "after onset")
    out.append(Target("after a straggler: tokens/s vs the optimum for the new speeds", value,
                      f">= {100 * OPTIMUM_FRACTION:.0f}% within {ONSET_TARGET_S:g} s",
                      r is not None and done is not None and r >= OPTIMUM_FRACTION
                      and done <= ONSET_TARGET_S))
    rows = result.get("model", {}).get("plans", [])
    errs = [abs(p["calibrated_error"]) for p in rows if p.get("calibrated_error") is not None]
    complete = bool(rows) and len(errs) == len(rows)
    worst = max(errs) if errs else None
    out.append(Target("calibrated cost model vs measured step time, every plan",
                      "n/a" if not complete else f"worst {100 * worst:.0f}% over {len(rows)}",
                      f"within {100 * MODEL_ERROR:.0f}%",
                      complete and worst <= MODEL_ERROR))
    sw = result.get("switches", {})
    dwell, count, gap = sw.get("dwell_s"), sw.get("count"), sw.get("min_gap_s")
    ok = dwell is not None and count is not None and (gap is None
                                                      or gap >= dwell - JOURNAL_SLACK_S)
    out.append(Target("speed-driven switches per dwell period (noisy device)",
                      "n/a" if count is None else
                      f"{count} switches, shortest gap "
                      f"{'-' if gap is None else f'{gap:.1f} s'} (dwell {dwell:g} s)",
                      f"<= 1 (gaps >= dwell - {JOURNAL_SLACK_S:g} s of journal time)", ok))
    return out


# ---- the report -------------------------------------------------------------------------------



def straggler_rows(result: Mapping) -> str:
    """``8 -> 2 -> 8``: the straggler's rows before the onset, after the degrade switch, after
    the recovery."""
    dev = f"{NODE}:{STRAGGLER}"
    got = [((result.get(k) or {}).get(w) or {}).get("rows", {}).get(dev)
           for k, w in (("b", "before"), ("b", "after"), ("c", "after"))]
    return " -> ".join("-" if n is None else str(n) for n in got)



def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


def _update(seconds) -> str:
    """The fitted cost per parameter element per step (``TypeFit.update_s``; None: the fit left
    the term out, the data did not determine it)."""
    return "not fitted" if seconds is None else f"{seconds * 1e9:.2f} ns"


def report(result: Mapping, command: str, header: str) -> str:
    """The markdown section body: setup line, the tables of the parts that ran, the targets.
    (d), the mixes, is ``hetero_mixes.report``'s, appended by the bench."""
    lines = [header, "", f"Command: `{command}`"]
    if result.get("a"):
        lines += [""] + steady_lines(result.get("a", {})) + [""] + model_lines(result)
    if result.get("b") or result.get("b_off"):
        lines += [""] + straggler_lines(result) + [""] + recovery_lines(result)
    load = result.get("phase_load") or {}
    if load:
        lines += ["", "1-minute load average when each job started (the machine is shared; "
                  "the workers' quotas cap them, they do not reserve the cores): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in load.items()) + "."]
    if result.get("a") or result.get("b"):
        lines += ["", "### Targets (ratios within this run)", "", "| target | measured | goal | |",
                  "|---|---|---|---|"]
        lines += [f"| {t.name} | {t.value} | {t.goal} | {t.verdict} |" for t in targets(result)]
    return "\n".join(lines) + "\n"


def steady_lines(a: Mapping) -> list[str]:
    lines = ["### (a) Steady state on the 4:1 mix (0.5, 0.5, 0.125, 0.125 of a core)", "",
             "| plan | how it was chosen | layout | tokens/s | step (ms) |",
             "|---|---|---|---|---|"]
    for key, how in (("uniform", "`--hspmd-planner uniform`, replans off"),
                     ("nominal", "hetero, replans off (equal nominal speeds)"),
                     ("measured", "hetero, replans on, after its speed-driven switch"),
                     ("optimum_b", "hetero, replans on, at (b)'s speeds (0.5, 0.5, 0.5, 0.125)")):
        ph = a.get(key) or {}
        lines.append(f"| {key} | {how} | {cell(ph.get('layout'))} | "
                     f"{_f(ph.get('tokens_per_s'))} | {_ms(ph.get('step_s'))} |")
    return lines


def model_lines(result: Mapping) -> list[str]:
    m = result.get("model", {})
    fit = m.get("fit", {})
    lines = ["### The cost model against the measured step times", "",
             "| plan | layout | measured (ms) | built-in constants (ms) | error | calibrated (ms) "
             "| error | fitted to the others (ms) | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in m.get("plans", []):
        lines.append(f"| {p['plan']} | {cell(p['layout'])} | {_ms(p['measured_s'])} | "
                     f"{_ms(p['predicted_s'])} | {_pct(p['error'])} | {_ms(p['calibrated_s'])} | "
                     f"{_pct(p['calibrated_error'])} | {_ms(p['held_out_s'])} | "
                     f"{_pct(p['held_out_error'])} |")
    if "error" in fit:
        return lines + ["", f"Calibration: not determined ({fit['error']})."]
    cpu = fit.get("types", {}).get("CPU", {})
    return lines + [
        "", f"Calibration (`calibrate.fit_steps` over {fit.get('plans')} plans): CPU "
        f"{_f(cpu.get('rate_flops') and cpu['rate_flops'] / 1e9, '{:.2f}')} GFLOP/s per "
        f"core, {_f(cpu.get('overhead_s') and 1000 * cpu['overhead_s'], '{:.2f}')} ms "
        f"per micro-batch, "
        f"{_f(cpu.get('latency_s') and 1000 * cpu['latency_s'], '{:.2f}')}"
        f" ms per collective, {_update(cpu.get('update_s'))} per parameter element "
        f"per step; rms error {100 * fit.get('rms_rel_error', 0):.1f}%."]


def straggler_lines(result: Mapping) -> list[str]:
    b = result.get("b", {})
    off = result.get("b_off", {})
    lines = ["### (b) A straggler mid-run: one worker from 0.5 to 0.125 of a core", "",
             "| | replans on | replans off |", "|---|---|---|"]
    for label, key in (("detected (speeds event, replan true)", "detect_s"),
                       ("new plan published (replan event)", "replan_s"),
                       ("switch done (switch-done event)", "switch_done_s")):
        lines.append(f"| {label}, s after onset | {_f(b.get(key), '{:.1f}')} | - |")
    for label, key in (("tokens/s before", "before"), ("tokens/s during (onset to switch done)",
                                                        "during"),
                       ("tokens/s after (the first switch)", "after"),
                       (f"tokens/s at {ONSET_TARGET_S:g} s (the last {{m}} steps before)",
                        "at_target")):
        label = label.format(m=result.get("settings", {}).get("measure", ""))
        lines.append(f"| {label} | {_f(_tps(b, key, 'tokens_per_s'))} | "
                     f"{_f(_tps(off, key, 'tokens_per_s'))} |")
    versions = [", ".join(f"v{v}" for v in ((x or {}).get("at_target") or {}).get("versions", []))
                or "-" for x in (b, off)]
    lines.append(f"| plan versions of the steps at {ONSET_TARGET_S:g} s | {versions[0]} | "
                 f"{versions[1]} |")
    lines.append(f"| layout after | {cell(b.get('layout_after'))} | "
                 f"{cell(off.get('layout_after'))} |")
    return lines


def recovery_lines(result: Mapping) -> list[str]:
    b, c = result.get("b", {}), result.get("c", {})
    sw = result.get("switches", {})
    return [
        "### (c) Recovery: the worker back at 0.5 of a core", "",
        f"`recover` switch done {_f(c.get('switch_done_s'), '{:.1f}')} s after the quota "
        f"was lifted (never sooner than one dwell, {_f(sw.get('dwell_s'), '{:g}')} s, after the "
        f"last speed-driven switch); tokens/s after: "
        f"{_f(_tps(c, 'after', 'tokens_per_s'))} (before the straggler: "
        f"{_f(_tps(b, 'before', 'tokens_per_s'))}); layout {cell(c.get('layout_after'))}. "
        f"Rows per step of the straggler: {straggler_rows(result)}.", "",
        f"Noisy device: {sw.get('flips', 0)} quota flips of the straggler every "
        f"{sw.get('flip_steps', '-')} steps after the recovery; speed-driven switches in "
        f"the whole replans-on run: {sw.get('count', '-')} at "
        f"{', '.join(f'{t:.1f}' for t in sw.get('at_s', [])) or '-'} s; shortest gap "
        f"{_f(sw.get('min_gap_s'), '{:.1f}')} s (dwell {_f(sw.get('dwell_s'), '{:g}')} s)."]
