"""The pure parts of ``scripts/bench_hetero``'s baselines (part (d)): the mixes of CPU quotas,
the candidate plans a practitioner would try on each, their interleaved order, the medians, the
ratio ours / best baseline, the targets and the tables. No processes, no etcd, no clock.

On each mix (one share of a core per device, the devices in rank order) the candidates are (each
with its optimizer state sharded over its data-parallel replicas, ``--hspmd-optimizer-shards
uneven``: even shares under the uniform planner, the rows' shares under ours):

* ``uniform-all``: ``--hspmd-planner uniform`` over every device (one TP/PP degree, even
  layers and rows);
* ``fastest-k`` for ``k = 1 .. n - 1``: the same uniform planner over only the ``k`` fastest
  devices (a job of ``k`` workers at the ``k`` largest shares): the best uniform plan over a
  subset is the best of these, measured, not predicted;
* ``ours``: ``--hspmd-planner hetero`` with speed-driven replans on, measured after its
  speed-driven switch (the planner's plan from the measured speeds; when the planner leaves a
  slow device idle, that is part of the plan).

Promises:

* ``parse_mixes(text, cores)``: ``"0.5,0.5,0.25,0.25;1,0.5,0.25,0.25"`` -> tuples of shares;
  a share out of ``(0, cores]``, a mix of fewer than 2 or more than ``MAX_DEVICES`` devices, or
  a mix whose shares add up to more than ``cores`` is a one-line ``ValueError`` naming it;
* ``candidates(mix)``: the candidates above, baselines first; ``order(cands, round)``: the
  order of one round, reversed every other round (interleaved, so a drift of the machine's load
  falls on every candidate alike);
* ``summarize(runs)``: per candidate the median tokens/s over its rounds, the best baseline
  (the largest median of the non-``ours`` candidates) and ours / best baseline (None when a
  figure is missing: a miss, never a pass);
* ``targets(summary)``: ours >= ``FLOOR`` x the best baseline on every mix, and >= ``GAIN`` x on
  ``GAIN_MIX``; ``report(summary)``: the Markdown of part (d);
* ``fitted_types(records)``: the CPU constants ``planner.calibrate.fit_steps`` fits to the
  baselines' measured step times (``(name, layout, plan, inventory, step_s)``, the inventory
  at the workers' shares of a core), as ``--hspmd-device-types`` reads them: the compute rate,
  the fixed cost per micro-batch and the cost per parameter element (not a collective's
  start-up, which data-parallel plans barely see), with the number of plans and the fit's rms
  error; None when they do not determine a fit.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from bench.common import best, cell, fmt, md_table, ratio

MIXES = ((0.5, 0.5, 0.125, 0.125), (0.5, 0.5, 0.25, 0.25), (1.0, 0.5, 0.25, 0.25))
MAX_DEVICES = 8
FLOOR = 0.97  # ours / best baseline, every mix
GAIN = 1.3  # ours / best baseline on GAIN_MIX
GAIN_MIX = (0.5, 0.5, 0.25, 0.25)
OURS = "ours"


def fitted_types(records: Sequence[tuple]) -> Optional[dict]:
    import json

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner import BUILTIN_SPECS, profile_from_dict
    from hspmd_elastic.planner.calibrate import apply, fit_steps

    from bench.hetero_pure import MODEL

    if not records:
        return None
    profile = profile_from_dict(json.loads(ModelConfig(**MODEL).to_json()))
    try:
        cal = fit_steps(profile, [(plan, inv, step_s) for _n, _l, plan, inv, step_s in records])
    except ValueError:
        return None
    spec = apply(cal, BUILTIN_SPECS["CPU"])
    # the baselines are data-parallel plans: their step times tell the compute rate and the
    # fixed costs apart, but a collective's start-up only through one all-reduce a step, too
    # little to fit it (it comes out 0, and TP would then look free): the built-in one stays
    fields = {"peak_tflops": spec.peak_tflops, "mfu": spec.mfu,
              "microbatch_overhead_s": spec.microbatch_overhead_s,
              "update_s_per_param": spec.update_s_per_param}
    return {"types": {"CPU": fields}, "plans": len(records),
            "rms_rel_error": cal.rms_rel_error}


def mix_name(mix: Sequence[float]) -> str:
    return ",".join(f"{f:g}" for f in mix)


def parse_mixes(text: str, cores: int) -> tuple[tuple[float, ...], ...]:
    out = []
    for part in text.split(";"):
        try:
            mix = tuple(float(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"--mixes: {part!r} is not a comma-separated list of numbers") \
                from None
        if not 2 <= len(mix) <= MAX_DEVICES:
            raise ValueError(f"--mixes: {part!r} must name 2 to {MAX_DEVICES} devices")
        bad = [f for f in mix if not (math.isfinite(f) and 0 < f <= cores)]
        if bad:
            raise ValueError(f"--mixes: share {bad[0]!r} in {part!r} is not in (0, {cores}]")
        if sum(mix) > cores + 1e-9:
            raise ValueError(f"--mixes: {part!r} adds up to {sum(mix):g} cores, more than the "
                             f"machine's {cores}")
        out.append(mix)
    return tuple(out)


@dataclass(frozen=True)
class Candidate:
    name: str
    fractions: tuple[float, ...]  # the shares of the job's workers, in local-rank order
    planner: str  # "uniform" | "hetero"

    @property
    def nproc(self) -> int:
        return len(self.fractions)


def candidates(mix: Sequence[float]) -> list[Candidate]:
    fastest = sorted(mix, reverse=True)
    out = [Candidate("uniform-all", tuple(mix), "uniform")]
    out += [Candidate(f"fastest-{k}", tuple(fastest[:k]), "uniform")
            for k in range(1, len(mix))]
    out.append(Candidate(OURS, tuple(mix), "hetero"))
    return out


def order(cands: Sequence[Candidate], round_: int) -> list[Candidate]:
    return list(cands) if round_ % 2 == 0 else list(reversed(cands))


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(present) if present else None


def summarize(runs: Mapping[str, Sequence[Mapping]]) -> dict:
    """``runs``: per candidate name, one dict per round (``tokens_per_s``, ``layout``,
    ``devices_used``, ...; ``error`` when the round failed)."""
    per = {}
    for name, rounds in runs.items():
        ok = [r for r in rounds if r.get("tokens_per_s") is not None]
        per[name] = {"tokens_per_s": _median([r["tokens_per_s"] for r in ok]),
                     "runs": [r.get("tokens_per_s") for r in rounds],
                     "layout": ok[-1].get("layout") if ok else None,
                     "devices_used": ok[-1].get("devices_used") if ok else None,
                     "errors": [r["error"] for r in rounds if r.get("error")]}
    baselines = {n: p["tokens_per_s"] for n, p in per.items() if n != OURS}
    top = best(baselines.values())
    best_name = next((n for n, v in baselines.items() if v == top), None) if top else None
    ours = per.get(OURS, {}).get("tokens_per_s")
    return {"candidates": per, "best_baseline": best_name, "best_baseline_tokens_per_s": top,
            "ours_tokens_per_s": ours, "ours_vs_best": ratio(ours, top)}


@dataclass(frozen=True)
class MixTarget:
    name: str
    value: Optional[float]
    goal: float

    @property
    def ok(self) -> bool:
        return self.value is not None and self.value >= self.goal

    def as_dict(self) -> dict:
        return {"target": self.name, "value": self.value, "goal": self.goal,
                "verdict": "PASS" if self.ok else "MISS"}


def targets(summaries: Mapping[str, Mapping]) -> list[MixTarget]:
    out = [MixTarget(f"ours / best baseline on {name}", s.get("ours_vs_best"), FLOOR)
           for name, s in summaries.items()]
    gain = summaries.get(mix_name(GAIN_MIX))
    if gain is not None:
        out.append(MixTarget(f"ours / best uniform-or-subset plan on {mix_name(GAIN_MIX)}",
                             gain.get("ours_vs_best"), GAIN))
    return out


def _row(name: str, p: Mapping, top: Optional[float]) -> list[str]:
    runs = ", ".join(fmt(v) for v in p.get("runs", [])) or "-"
    used = p.get("devices_used")
    return [name, cell(p.get("layout")), "-" if used is None else str(used),
            fmt(p.get("tokens_per_s")), runs, fmt(ratio(p.get("tokens_per_s"), top), "{:.2f}x")]


def mix_table(summary: Mapping) -> list[str]:
    top = summary.get("best_baseline_tokens_per_s")
    rows = [_row(n, p, top) for n, p in summary.get("candidates", {}).items()]
    return md_table(("plan", "layout", "devices used", "tokens/s (median)", "runs",
                     "vs best baseline"), rows)


def summary_table(summaries: Mapping[str, Mapping], predicted: Mapping[str, Mapping]) -> list[str]:
    rows = []
    for name, s in summaries.items():
        c = s.get("candidates", {})
        pred = predicted.get(name, {})
        rows.append([name, fmt(c.get("uniform-all", {}).get("tokens_per_s")),
                     f"{s.get('best_baseline') or '-'}: "
                     f"{fmt(s.get('best_baseline_tokens_per_s'))}",
                     fmt(s.get("ours_tokens_per_s")),
                     f"**{fmt(s.get('ours_vs_best'), '{:.2f}x')}**",
                     fmt(pred.get("ours_vs_uniform"), "{:.2f}x")])
    return md_table(("mix (shares of a core)", "uniform over all: tokens/s",
                     "best baseline (uniform over all or the fastest k): tokens/s",
                     "ours: tokens/s", "ours / best baseline",
                     "planner's estimate: ours / best uniform"), rows)


def report(summaries: Mapping[str, Mapping], predicted: Mapping[str, Mapping],
           rounds: int, fits: Optional[Mapping[str, Optional[Mapping]]] = None) -> list[str]:
    lines = ["### (d) Ours against the best baseline on three mixes", "",
             "Each mix: `uniform-all` (`--hspmd-planner uniform` over every device), "
             "`fastest-k` (the same planner over the k fastest devices only, a job of k "
             "workers: the best uniform plan over a subset is the best of them, measured) and "
             f"`ours` (hetero, replans on, after its speed-driven switch); {rounds} round(s), "
             "the candidates in turn, the order reversed every other round.", ""]
    lines += summary_table(summaries, predicted)
    for label, fit in (fits or {}).items():
        lines += ["", f"`{label}` planned with " + (
            "the built-in CPU constants (no fit yet)" if not fit else
            f"the CPU constants fitted to {fit['plans']} baseline plans (rms error "
            f"{fit['rms_rel_error']:.1%}): `{fit['types']['CPU']}`")]
    for name, s in summaries.items():
        lines += ["", f"Mix {name}:", ""] + mix_table(s)
    lines += ["", "| target | measured | goal | |", "|---|---|---|---|"]
    for t in targets(summaries):
        lines.append(f"| {t.name} | {fmt(t.value, '{:.2f}x')} | >= {t.goal:g}x | "
                     f"{'PASS' if t.ok else 'MISS'} |")
    return lines
