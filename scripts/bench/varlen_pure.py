"""The pure parts of ``scripts/bench_varlen``: its arguments, the synthetic corpus' document
lengths, the declared device memory, the measured plans' numbers, the ratios and the target,
the report and the docs section. No processes, no torch, no clock.

Promises:

* ``parse_args(argv)`` gives a ``Settings`` (``--quick``: a tiny model and a few steps; a flag
  given wins over ``--quick``); a count out of range, lengths ``parse_lengths`` refuses, or a
  global batch below the buckets or workers is a one-line ``SystemExit`` (status 2) naming the
  flag and its value;
* ``length_ranges(lengths)``: per bucket ``(lo, hi)`` document tokens drawn uniformly: bucket 0
  from 2 (one target) to its length + 1, bucket ``k`` from ``max(previous + 2, length // 2 + 1)``
  to its length + 1 (so ``32:0.9,256:0.1`` gives 2..33 and 129..257 tokens); ``doc_lengths``
  draws them with the shares as probabilities, every bucket at least twice;
* ``declared_memory(short_need, long_need, fraction)``: the bytes declared per device, ``MEMORY_
  SHARE`` of one replica at the longest length over the planner's memory fraction; ``ValueError``
  when that would not also hold one replica at the shortest length;
* ``summarize(name, layout, steps, real, padded)``: a plan's median step time (each step's
  slowest rank), tokens/s of real and of padded tokens, the in-step switch time and its share
  of the step (medians), switches and bytes per step;
* ``agreement(worst, tolerance)`` and ``verdict(result)``: the parameters-agree check (of the
  check step: every plan from the packed plan's state after the measured steps) and the
  ratios ours (bucketed) / the best baseline (packed or padded, against ``FLOOR``) and ours /
  packed (against ``TARGET``); a missing figure is
  ``None`` and misses the target; nothing here fails on a miss;
* ``report(result, command, header)`` is the markdown body; ``with_section(text, body)``
  replaces the ``SECTION`` of a markdown text (up to the next ``## ``) or appends it.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from bench import common
from bench.common import cell, ratio
from bench.common import fmt as _f
from bench.common import int_flag

SECTION = "## Variable-length data (length buckets), measured"
TARGET = 1.3  # bucketed tokens/s over the packed single plan's (the long bucket needs TP or PP)
# The check step (every plan from the packed plan's state after the measured steps, one more
# step on the next global batch), relative to each tensor's largest element. float32 measures
# ~2e-7 here, a skipped gradient transfer ~0.2. Without the common state, rounding amplified by
# training drifts far more over many steps (0.3 in float32, 1e-8 in float64, after 23 steps of
# the default run): reported, not checked.
TOLERANCES = {"float32": 1e-4, "float64": 1e-9}
TOLERANCE = TOLERANCES["float32"]
# The declared memory follows from the model, not from the result: ``cost.stage_memory`` of one
# replica (weights, gradients, AdamW's two moments: 4 x 4 bytes per parameter in float32, plus
# one row of activations) at the shortest and at the longest length; a device gets this share
# of the longest one's need (over the planner's memory fraction), so one replica at the full
# length does not fit one device (the long bucket needs TP or PP) while one at the shortest
# does. For the default model (1,115,264 parameters: 17.0 MiB of state) that is 18.3 MiB at 32
# tokens and 37.8 MiB at 256: 31.5 MiB declared. At 0.75 the planner's single plan is TP2; at
# 0.8 it is PP2, which ``graph.bucketed`` does not take as a home plan yet (it reads every
# parameter's dtype from the rank's own stage).
MEMORY_SHARE = 0.75
MODEL = dict(vocab_size=256, hidden_size=128, num_heads=4, num_layers=4, ffn_size=512,
             dtype="float32")
QUICK_MODEL = dict(vocab_size=64, hidden_size=32, num_heads=2, num_layers=2, ffn_size=64,
                   dtype="float32")
LENGTHS, QUICK_LENGTHS = "32:0.9,256:0.1", "8:0.9,64:0.1"
GLOBAL_BATCH, QUICK_GLOBAL_BATCH = 20, 10
DOCS = 2000
PLANS = ("packed", "padded", "bucketed")  # two baselines, then ours
BASELINES = ("packed", "padded")
FLOOR = 0.97  # ours / the best baseline, at least
# The memory limit per worker: the declared device memory plus what a worker's cgroup is charged
# before its model (a probe's peak: interpreter, torch, gloo, one tiny training step), plus this
# share of that baseline for what the kernel charges a worker and not the probe (page cache of
# the files a worker touches first, the gloo groups of a larger world: up to 22% measured here,
# 207.6 against 170 MiB); the declared memory itself is the workload's.
LIMIT_SLACK = 0.30
HOME_LAYOUT = "the single plan's layout"


@dataclass(frozen=True)
class Settings:
    steps: int
    warmup: int
    workers: int
    global_batch: int
    lengths: str
    docs: int
    seed: int
    dtype: str
    quick: bool
    timeout_s: float
    json_path: Optional[str]
    write_doc: Optional[str]
    memory_limit: bool = True  # enforce the declared memory with a cgroup per worker
    rounds: int = 2  # of the three worlds, the order reversed every other round

    @property
    def model(self) -> dict:
        base = QUICK_MODEL if self.quick else MODEL
        return dict(base, seq_len=self.buckets()[-1][0], dtype=self.dtype)

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.dtype]

    def buckets(self) -> tuple[tuple[int, float], ...]:
        from hspmd_elastic.planner.buckets import parse_lengths

        return tuple((b.max_len, b.share) for b in parse_lengths(self.lengths))



def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--timeout={text!r} is not a number") from None
    if not (math.isfinite(value) and 10 <= value <= 3600):
        raise argparse.ArgumentTypeError(f"--timeout={text} must be in [10, 3600] s")
    return value


def parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true",
                    help=f"a tiny model ({QUICK_LENGTHS}, global batch {QUICK_GLOBAL_BATCH}) "
                    "and 2 measured steps: for the test")
    ap.add_argument("--steps", type=int_flag("--steps", 1, 1000), default=None,
                    help="measured steps per plan (default 20; 2 with --quick)")
    ap.add_argument("--warmup", type=int_flag("--warmup", 0, 100), default=None,
                    help="steps before them, not timed (default 3; 1 with --quick)")
    ap.add_argument("--rounds", type=int_flag("--rounds", 1, 100), default=None,
                    help="runs of the three plans, one after another, the order reversed every "
                    "other round (default 2; 1 with --quick)")
    ap.add_argument("--workers", type=int_flag("--workers", 2, 16), default=2,
                    help="worker processes, one per declared device (default 2)")
    ap.add_argument("--global-batch", type=int_flag("--global-batch", 1, 4096), default=None,
                    help=f"rows per step (default {GLOBAL_BATCH}; {QUICK_GLOBAL_BATCH} with "
                    "--quick)")
    ap.add_argument("--lengths", default=None, metavar="LEN:SHARE,...",
                    help=f"length buckets of the corpus and the plans (default {LENGTHS}; "
                    f"{QUICK_LENGTHS} with --quick); the last length is the model's seq_len")
    ap.add_argument("--docs", type=int_flag("--docs", 10, 10**7), default=DOCS,
                    help=f"documents in the synthetic corpus (default {DOCS})")
    ap.add_argument("--seed", type=int_flag("--seed", 0, 2**31 - 1), default=0)
    ap.add_argument("--dtype", choices=sorted(TOLERANCES), default="float32",
                    help="parameters and compute (default float32; the check step's parameters "
                    "must agree within 1e-4 relative, 1e-9 in float64)")
    ap.add_argument("--timeout", dest="timeout_s", type=_seconds, default=600.0,
                    help="deadline of each world of workers (default 600 s)")
    ap.add_argument("--no-memory-limit", dest="memory_limit", action="store_false",
                    help="do not enforce the declared memory per worker with a cgroup memory "
                    "limit (by default it is, where the machine has a writable memory "
                    "controller; the report says which)")
    ap.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                    help="write the results here")
    ap.add_argument("--write-doc", default=None, metavar="PATH",
                    help=f"replace or add the '{SECTION[3:]}' section of this markdown file")
    return ap


def parse_args(argv: Sequence[str], description: str = "") -> Settings:
    ap = parser(description)
    a = ap.parse_args(list(argv))
    q = a.quick
    s = Settings(steps=a.steps or (2 if q else 20),
                 warmup=a.warmup if a.warmup is not None else (1 if q else 3),
                 workers=a.workers,
                 global_batch=a.global_batch or (QUICK_GLOBAL_BATCH if q else GLOBAL_BATCH),
                 lengths=a.lengths or (QUICK_LENGTHS if q else LENGTHS), docs=a.docs,
                 seed=a.seed, dtype=a.dtype, quick=q, timeout_s=a.timeout_s, json_path=a.json_path,
                 write_doc=a.write_doc, memory_limit=a.memory_limit,
                 rounds=a.rounds or (1 if q else 2))
    from hspmd_elastic.planner import PlannerError

    try:
        buckets = s.buckets()
    except PlannerError as exc:
        ap.error(f"--lengths={s.lengths!r}: {exc}")
    if len(buckets) < 2:
        ap.error(f"--lengths={s.lengths!r}: need at least two buckets to compare")
    if s.global_batch < max(len(buckets), s.workers) * 2:
        ap.error(f"--global-batch={s.global_batch} must be at least twice the buckets "
                 f"({len(buckets)}) and the workers ({s.workers})")
    return s


# ---- the corpus and the declared memory -----------------------------------------------------

def length_ranges(lengths: Sequence[tuple[int, float]]) -> list[tuple[int, int]]:
    """Per bucket, the inclusive range of document tokens (module promises)."""
    out, prev = [], 0
    for k, (n, _share) in enumerate(lengths):
        lo = 2 if k == 0 else max(prev + 2, n // 2 + 1)
        out.append((lo, n + 1))
        prev = n
    return out


def doc_lengths(lengths: Sequence[tuple[int, float]], count: int, seed: int) -> list[int]:
    """``count`` document lengths: a bucket by its share, a length uniform in its range; every
    bucket appears at least twice (its stream is never empty)."""
    gen = random.Random(seed)
    ranges = length_ranges(lengths)
    shares = [s for _n, s in lengths]
    picks = [k for k in range(len(ranges)) for _ in range(2)]
    picks += gen.choices(range(len(ranges)), weights=shares, k=max(0, count - len(picks)))
    gen.shuffle(picks)
    return [gen.randint(*ranges[k]) for k in picks]


def declared_memory(short_need: int, long_need: int, fraction: float) -> int:
    """Bytes per device: one replica (one row of activations) at the longest length does not
    fit, one at the shortest does."""
    mem = int(MEMORY_SHARE * long_need / fraction)
    if short_need >= mem * fraction:
        raise ValueError(f"one replica needs {short_need} bytes at the shortest length and "
                         f"{long_need} at the longest: no declared memory separates them")
    return mem


def round_order(round_: int, rounds: int) -> tuple[str, ...]:
    """The plans' order in round ``round_`` of ``rounds``: ``PLANS`` in the last round (packed
    first, for the check step), reversed in every other one before it."""
    return PLANS if (rounds - 1 - round_) % 2 == 0 else PLANS[::-1]


def limit_baseline(baseline: int) -> int:
    """Bytes a worker's memory limit holds on top of its declared device memory: the measured
    baseline and ``LIMIT_SLACK`` of it (the ``baseline`` of ``cgroup_memory.memory_limit``)."""
    return int(baseline * (1 + LIMIT_SLACK))


def rss_bytes(status_text: str) -> int:
    """``VmRSS`` of a ``/proc/<pid>/status`` text, in bytes (``ValueError`` without it)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no VmRSS line")


# ---- the numbers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord:
    """One step of one plan: per rank its seconds, switch seconds, switches and bytes sent."""

    seconds: Sequence[float]
    switch_s: Sequence[float] = ()
    switches: Sequence[int] = ()
    bytes_sent: Sequence[int] = ()


def summarize(name: str, layout: str, steps: Sequence[StepRecord], real_tokens: float,
              padded_tokens: float) -> dict:
    """A plan's numbers from its measured steps (module promises). ``real_tokens``: the
    targets counted in the loss per step; ``padded_tokens``: the positions computed per step."""
    if not steps:
        raise ValueError(f"{name}: no measured step")
    step_s = [max(s.seconds) for s in steps]
    switch_s = [max(s.switch_s, default=0.0) for s in steps]
    median = statistics.median(step_s)
    return {"plan": name, "layout": layout, "steps": len(steps), "step_s": median,
            "step_s_all": step_s, "real_tokens": real_tokens, "padded_tokens": padded_tokens,
            "tokens_per_s": real_tokens / median if median > 0 else None,
            "padded_tokens_per_s": padded_tokens / median if median > 0 else None,
            "switch_s": statistics.median(switch_s),
            "switch_share": statistics.median(w / t for w, t in zip(switch_s, step_s)
                                              if t > 0) if median > 0 else None,
            "switches": max((max(s.switches, default=0) for s in steps), default=0),
            "bytes_per_step": statistics.median(sum(s.bytes_sent) for s in steps)}



def agreement(worst: Optional[float], tolerance: float = TOLERANCE) -> dict:
    """The parameters-agree check: ``worst`` is the largest relative difference of any tensor
    of any rank between a plan and the packed plan after the check step (None or NaN: not
    measured, a failure)."""
    ok = worst is not None and math.isfinite(worst) and worst <= tolerance
    return {"worst_rel": worst, "tolerance": tolerance, "ok": ok}


def verdict(result: Mapping) -> dict:
    """Ours (bucketed) against the best baseline (the faster of packed and padded) and against
    packed; the targets: at least ``FLOOR`` x the best, at least ``TARGET`` x packed."""
    plans = result.get("plans", {})

    def tps(name: str) -> Optional[float]:
        v = (plans.get(name) or {}).get("tokens_per_s")
        return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None

    base = {n: tps(n) for n in BASELINES}
    present = {n: v for n, v in base.items() if v is not None}
    best_name = max(present, key=present.get) if len(present) == len(BASELINES) else None
    vs_best = ratio(tps("bucketed"), present.get(best_name)) if best_name else None
    vs_packed = ratio(tps("bucketed"), tps("packed"))
    return {"best_baseline": best_name, "bucketed_vs_best": vs_best,
            "bucketed_vs_packed": vs_packed, "bucketed_vs_padded": ratio(tps("bucketed"),
                                                                          tps("padded")),
            "packed_vs_padded": ratio(tps("packed"), tps("padded")),
            "target": TARGET, "floor": FLOOR,
            "met": vs_packed is not None and vs_packed >= TARGET,
            "floor_met": vs_best is not None and vs_best >= FLOOR}


# ---- the report -----------------------------------------------------------------------------



def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else 1000 * seconds


def _ms_or_unfit(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return "does not fit" if math.isinf(seconds) else f"{1000 * seconds:.0f}"


def table(result: Mapping) -> list[str]:
    plans = result.get("plans", {})
    v = verdict(result)
    base = (plans.get(v["best_baseline"]) or {}).get("tokens_per_s")
    lines = ["| plan | layout | step (ms) | planner's estimate (ms) | tokens/s (real) "
             "| tokens/s (padded) | vs best baseline | switches | switch (ms) | switch share "
             "| moved per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in PLANS:
        p = plans.get(name)
        if p is None:
            lines.append(f"| {name} |" + " - |" * 10)
            continue
        moved = p.get("bytes_per_step")
        cells = [name, cell(p.get("layout")), _f(_ms(p.get("step_s")), "{:.0f}"),
                 _ms_or_unfit(p.get("estimated_s")),
                 _f(p.get("tokens_per_s"), "{:,.0f}"), _f(p.get("padded_tokens_per_s"), "{:,.0f}"),
                 _f(ratio(p.get("tokens_per_s"), base), "{:.2f}x"), str(p.get("switches", 0)),
                 _f(_ms(p.get("switch_s")), "{:.1f}"), _f(p.get("switch_share"), "{:.1%}"),
                 f"{moved / 2**20:.1f} MiB" if moved else "0"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def positions(result: Mapping) -> str:
    """`` Positions computed per step: ...`` (empty without both figures)."""
    plans = result.get("plans", {})
    a = (plans.get("padded") or {}).get("padded_tokens")
    b = (plans.get("bucketed") or {}).get("padded_tokens")
    real = (plans.get("padded") or {}).get("real_tokens")
    if not a or not b:
        return ""
    return (f" Positions computed per step: {a:,.0f} at the full length, {b:,.0f} in the "
            f"buckets ({a / b:.1f}x fewer), for {_f(real, '{:,.0f}')} real tokens.")


def memory_line(memory: Optional[Mapping]) -> str:
    """How the declared memory was enforced (or why not)."""
    if not memory:
        return "- Memory: not recorded."
    if not memory.get("enforced"):
        return f"- Memory: declared to the planner only, NOT enforced ({memory.get('why')})."
    peaks = "; ".join(f"{name} " + ", ".join("-" if not p else f"{p / 2**20:.1f}" for p in ps)
                      for name, ps in (memory.get("peak_bytes") or {}).items()) or "-"
    return (f"- Memory: enforced, a cgroup per worker limited to "
            f"{memory['limit_bytes'] / 2**20:.1f} MiB (the declared memory plus the worker's "
            f"{memory['baseline_bytes'] / 2**20:.0f} MiB charged before its model, plus "
            f"{100 * LIMIT_SLACK:.0f}% of that); peak use per worker (MiB): {peaks}; no worker "
            "was OOM-killed.")


def report(result: Mapping, command: str, header: str) -> str:
    """The markdown section body: the setup, the plans, the table, the ratios and the check."""
    v = verdict(result)
    check = result.get("agreement", {})
    lines = [header, "", f"Command: `{command}`", ""]
    buckets = result.get("buckets", [])
    if buckets:
        lines += ["| bucket | window | rows per step | plan chosen for it | planner's estimate "
                  "(ms): its plan / the single plan's layout / the switch |",
                  "|---|---|---|---|---|"]
        for k, b in enumerate(buckets):
            est = " / ".join(_ms_or_unfit(b.get(key))
                             for key in ("step_s", "home_s", "switch_s"))
            lines.append(f"| {k} | {b.get('window')} | {b.get('rows')} | "
                         f"{'its own' if b.get('own') else HOME_LAYOUT}: "
                         f"{cell(b.get('layout'))} | {est} |")
        lines.append("")
    lines += table(result)
    lines += ["", f"- ours (bucketed) / best baseline ({v['best_baseline'] or '-'}): "
              f"**{_f(v['bucketed_vs_best'], '{:.2f}x')}** (target >= {FLOOR:g}x: "
              f"{'met' if v['floor_met'] else 'missed'}); ours / packed: "
              f"**{_f(v['bucketed_vs_packed'], '{:.2f}x')}** (target >= {TARGET:g}x: "
              f"{'met' if v['met'] else 'missed'}); ours / padded: "
              f"{_f(v['bucketed_vs_padded'], '{:.2f}x')}; packed / padded: "
              f"{_f(v['packed_vs_padded'], '{:.2f}x')}.{positions(result)}",
              memory_line(result.get("memory")),
              f"- Check step: after the measured steps the other plans take the packed plan's "
              f"state and each runs one more step on the next global batch; worst relative "
              f"difference of the parameters {_f(check.get('worst_rel'), '{:.1e}')} "
              f"({check.get('where', '-')}; {check.get('dtype', 'float32')}, tolerance "
              f"{check.get('tolerance', TOLERANCE):g}): "
              f"{'agree' if check.get('ok') else 'DISAGREE'}."]
    if check.get("drift_rel") is not None:
        lines.append(f"- Drift before it: each plan's own parameters after "
                     f"{check.get('drift_steps', '-')} steps from the same initial values, "
                     f"worst relative difference {check['drift_rel']:.1e} "
                     f"({check.get('drift_where', '-')}): rounding, amplified by training over "
                     "the steps (with `--dtype float64` it shrinks with the precision); not "
                     "checked. The tests prove the plans equal in float64.")
    return "\n".join(lines) + "\n"


def with_section(text: str, body: str) -> str:
    """``text`` with ``SECTION`` replaced by ``body`` (or appended when it has none)."""
    return common.with_section(text, SECTION, body)
