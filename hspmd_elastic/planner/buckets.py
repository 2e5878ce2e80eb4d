"""Length buckets, each with its own plan: the planner's side of variable-length training.

A global batch of mixed-length sequences is grouped into length buckets; each bucket runs under
a plan made for its longest sequence (short buckets favour data parallelism, long ones the
TP/PP their activations need), and the estimate is compared with the best single plan that
fits the longest bucket. Promises:

* ``parse_lengths("512:0.9,8192:0.1")``: the buckets, shortest first, as ``LengthBucket``
  (each bucket's longest sequence in tokens, its share of the sequences). Lengths are integers in
  ``1..MAX_BUCKET_LEN``, strictly increasing; shares are finite, in ``(0, 1]`` and sum to 1
  within ``SHARE_TOLERANCE`` (they are not normalised: ``512:9,8192:1`` is refused); at most
  ``MAX_BUCKETS`` buckets. Anything else raises a one-line ``PlannerError`` naming the bad item
  (out of order, duplicate, zero share, not a number, a sum other than 1).
* ``bucket_rows(shares, global_batch)``: the rows of the global batch per bucket, by largest
  remainders: each bucket gets ``floor(share x global_batch)``, the rows left go one each to
  the largest fractional parts (ties to the shorter bucket); then a bucket left with no row
  takes one from the bucket with the most (ties to the shorter). The rows sum to
  ``global_batch``, every bucket gets at least one (``PlannerError`` when ``global_batch`` is
  below the number of buckets), and when every ``share x global_batch`` is at least 1 each
  bucket's rows are its floor or its ceiling.
* ``profile_at(profile, seq_len)``: the profile at another sequence length (rebuilt from its
  ``ModelConfig`` when it has one, so eager attention's score memory follows the length). The
  cost model's attention term (``ModelProfile.layer_flops_per_token``) makes a bucket's cost per
  sequence quadratic in its length.
* ``plan_buckets(inventory, profile, global_batch, buckets, options, switch_cost_s=0.0)`` ->
  ``BucketPlans``: per bucket, ``plan_for`` at the bucket's length with the bucket's rows
  (heterogeneous wherever the devices are, within their memory); the best single plan (below);
  the bucketed step time, the sum of the buckets' step times plus ``switch_cost_s`` per plan
  change (buckets run shortest first, cyclically: a bucket whose layout differs from the one
  before it, the last bucket's before the first's, is a change; one bucket: none).
  ``switch_cost_s`` is an estimate, 0 by default (no switch cost counted), to be replaced by
  measured switch times. ``gain`` is the single plan's step time over the bucketed one.
  A bucket nothing fits raises ``PlanInfeasibleError`` naming the bucket and the shortfall.
* The best single plan is one layout (pipelines, stages, layer splits) for every bucket: on each
  bucket the bucket's rows are split over its pipelines by speed (``solve.split_rows``; a
  pipeline may get none) with a micro-batch size per pipeline (``Solver.pick_batch``), and its
  step time is the sum of its estimates over the buckets. Candidates: ``plan_for`` at the
  longest length with the whole global batch (chosen and alternatives; none when nothing fits
  it), then the buckets' plans, longest first; a layout some bucket does not fit is out. The
  best preference class of the search (``use_all_devices``, ``cross_node_replicas``) wins, then
  the least step time; the earliest candidate within ``options.tie_tolerance`` of it is taken,
  so with one bucket the single plan is ``plan_for``'s and the gain is exactly 1.
* Pure: no I/O, torch-free, the same inputs give the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

from hspmd_elastic.plan import Pipeline, Plan, PlanError
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.api import (Candidate, Estimate, Inventory, ModelProfile,
                                       PlanInfeasibleError, PlannerError, PlannerOptions,
                                       PlanResult, fmt_bytes)
from hspmd_elastic.planner.explain import candidate_to_dict, compact_ids, layout_line
from hspmd_elastic.planner.passes import Solver
from hspmd_elastic.planner.profiles import profile_from_config
from hspmd_elastic.planner.search import plan_for
from hspmd_elastic.planner.solve import split_rows

MAX_BUCKETS = 16  # each bucket is one plan search
MAX_BUCKET_LEN = 2**24  # tokens per sequence, as the launcher's --hspmd-seq-len
SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class LengthBucket:
    """Sequences up to ``max_len`` tokens (longer than the previous bucket's), ``share`` of
    all sequences."""

    max_len: int
    share: float


# ---- parsing and rows -------------------------------------------------------------------------

def parse_lengths(text: str) -> tuple[LengthBucket, ...]:
    """``"512:0.9,8192:0.1"`` -> the buckets, shortest first (see the module's promises)."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise PlannerError(f"lengths {text!r} are empty: expected LEN:SHARE,... such as "
                           "512:0.9,8192:0.1")
    buckets = []
    for item in items:
        length, sep, share = item.partition(":")
        if not sep:
            raise PlannerError(f"length bucket {item!r}: expected LEN:SHARE such as 512:0.9")
        length = length.strip()
        if not length.isdigit():
            raise PlannerError(f"length bucket {item!r}: length {length!r} is not a positive "
                               "integer")
        try:
            value = float(share)
        except ValueError:
            raise PlannerError(f"length bucket {item!r}: share {share.strip()!r} is not a "
                               "number") from None
        buckets.append(LengthBucket(int(length), value))
    return check_buckets(buckets, text)


def check_buckets(buckets: Sequence[LengthBucket],
                  text: Optional[str] = None) -> tuple[LengthBucket, ...]:
    """``buckets`` as a tuple when valid (see ``parse_lengths``); else a one-line
    ``PlannerError`` naming the bad bucket (``text``: the spec they came from, for the message
    about their sum)."""
    buckets = tuple(buckets)
    if not buckets:
        raise PlannerError("no length bucket: expected LEN:SHARE,... such as 512:0.9,8192:0.1")
    if len(buckets) > MAX_BUCKETS:
        raise PlannerError(f"{len(buckets)} length buckets: at most {MAX_BUCKETS}")
    previous = None
    for b in buckets:
        item = f"{b.max_len}:{b.share:g}" if isinstance(b.share, (int, float)) else repr(b)
        n = b.max_len
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BUCKET_LEN:
            raise PlannerError(f"length bucket {item!r}: length {n!r} must be an integer in "
                               f"1..{MAX_BUCKET_LEN}")
        s = b.share
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1 \
                or not math.isfinite(s):
            raise PlannerError(f"length bucket {item!r}: share {s!r} must be in (0, 1]")
        if previous is not None and n == previous:
            raise PlannerError(f"length bucket {item!r}: length {n} appears twice")
        if previous is not None and n < previous:
            raise PlannerError(f"length bucket {item!r}: length {n} is below the previous "
                               f"bucket's {previous}; list buckets shortest first")
        previous = n
    total = math.fsum(b.share for b in buckets)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        spec = text if text is not None else ",".join(f"{b.max_len}:{b.share:g}"
                                                      for b in buckets)
        raise PlannerError(f"lengths {spec!r}: the shares sum to {total:.6g}, not 1")
    return buckets


def bucket_rows(shares: Sequence[float], global_batch: int) -> tuple[int, ...]:
    """Rows of ``global_batch`` per bucket (see the module's promises)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"global_batch={global_batch!r} must be a positive integer")
    if global_batch < len(shares):
        raise PlannerError(f"global_batch={global_batch} is below the {len(shares)} length "
                           "buckets: every bucket needs a row")
    total = math.fsum(shares)
    exact = [s / total * global_batch for s in shares]
    rows = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(rows)), key=lambda i: (-(exact[i] - rows[i]), i))
    for i in order[:global_batch - sum(rows)]:
        rows[i] += 1
    for i in range(len(rows)):
        if rows[i] == 0:
            donor = max(range(len(rows)), key=lambda j: (rows[j], -j))
            rows[donor] -= 1
            rows[i] = 1
    return tuple(rows)


def profile_at(profile: ModelProfile, seq_len: int) -> ModelProfile:
    """``profile`` at sequence length ``seq_len`` (rebuilt from its config when it has one)."""
    if profile.seq_len == seq_len:
        return profile
    if profile.config is not None:
        return profile_from_config(replace(profile.config, seq_len=seq_len), profile.name)
    return replace(profile, seq_len=seq_len)


# ---- results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BucketPlan:
    """One bucket: its rows of the global batch and ``plan_for``'s result at its length."""

    bucket: LengthBucket
    rows: int
    result: PlanResult = field(repr=False)

    @property
    def plan(self) -> Plan:
        return self.result.plan

    @property
    def estimate(self) -> Estimate:
        return self.result.estimate


@dataclass(frozen=True)
class SinglePlan:
    """One layout for every bucket: ``plans[k]`` runs bucket ``k``'s rows, ``estimates[k]``."""

    label: str
    plans: tuple[Plan, ...]
    estimates: tuple[Estimate, ...]

    @property
    def step_time_s(self) -> float:
        return math.fsum(e.step_time_s for e in self.estimates)


@dataclass(frozen=True)
class BucketPlans:
    buckets: tuple[BucketPlan, ...]
    single: SinglePlan
    global_batch: int
    switch_cost_s: float
    profile: ModelProfile = field(repr=False)
    inventory: Inventory = field(repr=False)

    @property
    def switches(self) -> int:
        """Plan changes per step: buckets whose layout differs from the previous bucket's
        (cyclically)."""
        keys = [_layout_key(b.plan) for b in self.buckets]
        return sum(1 for i, k in enumerate(keys) if k != keys[i - 1])

    @property
    def bucketed_step_time_s(self) -> float:
        return math.fsum(b.estimate.step_time_s for b in self.buckets) \
            + self.switches * self.switch_cost_s

    @property
    def single_step_time_s(self) -> float:
        return self.single.step_time_s

    @property
    def gain(self) -> float:
        """The single plan's step time over the bucketed step time (> 1: bucketing helps)."""
        return self.single_step_time_s / self.bucketed_step_time_s

    @property
    def tokens_per_step(self) -> int:
        """Tokens of a step, every sequence counted at its bucket's longest length."""
        return sum(b.rows * b.bucket.max_len for b in self.buckets)

    def explain(self) -> str:
        return explain_buckets(self)

    def to_dict(self) -> dict:
        return buckets_to_dict(self)


# ---- the entry point --------------------------------------------------------------------------

def plan_buckets(inventory: Inventory, profile: ModelProfile, global_batch: int,
                 buckets: Union[str, Sequence[LengthBucket]],
                 options: PlannerOptions = PlannerOptions(),
                 switch_cost_s: float = 0.0) -> BucketPlans:
    """One plan per length bucket, the best single plan, and the estimated gain (see the
    module's promises). ``buckets``: a ``parse_lengths`` spec or ``LengthBucket`` values."""
    buckets = parse_lengths(buckets) if isinstance(buckets, str) else check_buckets(buckets)
    if isinstance(switch_cost_s, bool) or not isinstance(switch_cost_s, (int, float)) \
            or not (switch_cost_s >= 0 and math.isfinite(switch_cost_s)):
        raise PlannerError(f"switch_cost_s={switch_cost_s!r} must be a finite number >= 0")
    rows = bucket_rows([b.share for b in buckets], global_batch)
    profiles = [profile_at(profile, b.max_len) for b in buckets]
    searched: dict[tuple[int, int], PlanResult] = {}

    def search(k: int, n: int) -> PlanResult:
        key = (buckets[k].max_len, n)
        if key not in searched:
            try:
                searched[key] = plan_for(inventory, profiles[k], n, options=options)
            except PlanInfeasibleError as exc:
                rows_text = f"{n} row{'s' if n != 1 else ''}"
                raise type(exc)(f"length bucket {buckets[k].max_len} ({rows_text}): {exc}",
                                needed_bytes=exc.needed_bytes,
                                available_bytes=exc.available_bytes) from None
        return searched[key]

    plans = tuple(BucketPlan(b, n, search(k, n)) for k, (b, n) in enumerate(zip(buckets, rows)))
    try:
        longest = search(len(buckets) - 1, global_batch)
        origins = [(c, (buckets[-1].max_len, global_batch))
                   for c in (longest.chosen,) + longest.alternatives]
    except PlanInfeasibleError:  # the whole batch at the longest length: the buckets' plans
        origins = []
    origins += [(bp.result.chosen, (bp.bucket.max_len, bp.rows)) for bp in reversed(plans)]
    single = _best_single(origins, plans, profiles, inventory, options)
    return BucketPlans(plans, single, global_batch, float(switch_cost_s), profile, inventory)


def _best_single(origins: list, plans: tuple[BucketPlan, ...], profiles: list,
                 inventory: Inventory, options: PlannerOptions) -> SinglePlan:
    """The best layout for every bucket among ``origins`` ((candidate, (length, rows) it was
    planned for)), as the module's promises say."""
    scored, seen = [], set()
    for cand, origin in origins:
        key = _layout_key(cand.plan)
        if key in seen:
            continue
        seen.add(key)
        single = _on_every_bucket(cand, origin, plans, profiles, inventory, options)
        if single is not None:
            scored.append((_preference(cand, options), single.step_time_s, len(scored), single))
    if not scored:  # not expected: the longest bucket's own plan runs every shorter bucket
        raise PlanInfeasibleError("no single plan runs every length bucket")
    best_class = min(s[0] for s in scored)
    fastest = min(s[1] for s in scored if s[0] == best_class)
    near = [s for s in scored
            if s[0] == best_class and s[1] <= fastest * (1.0 + options.tie_tolerance)]
    return min(near, key=lambda s: s[2])[3]


def _on_every_bucket(cand: Candidate, origin: tuple[int, int], plans: tuple[BucketPlan, ...],
                     profiles: list, inventory: Inventory,
                     options: PlannerOptions) -> Optional[SinglePlan]:
    """``cand``'s layout run on every bucket's rows, or None when some bucket does not fit."""
    out_plans, estimates = [], []
    for bp, prof in zip(plans, profiles):
        if (bp.bucket.max_len, bp.rows) == origin:
            plan, est = cand.plan, cand.estimate
        else:
            plan = with_rows(cand.plan, inventory, prof, bp.rows, options)
            try:
                if prof.config is not None:
                    plan.check_model(prof.config)
                est = cost.estimate_plan(plan, inventory, prof, options)
            except (PlanError, PlanInfeasibleError):
                return None
            if est.replica_nodes < options.redundancy:
                return None
        out_plans.append(plan)
        estimates.append(est)
    return SinglePlan(cand.label, tuple(out_plans), tuple(estimates))


def with_rows(plan: Plan, inventory: Inventory, profile: ModelProfile, rows: int,
              options: PlannerOptions = PlannerOptions()) -> Plan:
    """``plan``'s pipelines, stages and layers with ``rows`` rows: split over the pipelines by
    speed at ``profile``'s length (a pipeline given none is left out), each pipeline with its
    best micro-batch size. Memory is not checked here (``cost.estimate_plan`` does)."""
    devs = inventory.devices_by_id
    solver = Solver(profile, rows, options)
    shaped, classes = [], []
    for pipe in plan.pipelines:
        groups = [[devs[d] for d in s.devices] for s in pipe.stages]
        shapes = tuple(cost.group_shape(g, groups[i + 1] if i + 1 < len(groups) else None,
                                        options.memory_fraction)
                       for i, g in enumerate(groups))
        split = tuple(s.layers[1] - s.layers[0] for s in pipe.stages)
        times = solver.times(shapes, split, 1)
        shaped.append((pipe, shapes, split))
        classes.append((sum(times) - max(times), max(times), 1))
    pipes = []
    for (pipe, shapes, split), (r,) in zip(shaped, split_rows(classes, rows)):
        if r:
            b = solver.pick_batch(shapes, split, r)
            pipes.append(Pipeline(pipe.stages, r // b, b))
    return Plan(tuple(pipes), rows, plan.num_layers)


def _preference(cand: Candidate, options: PlannerOptions) -> tuple[int, int]:
    """The search's preference classes (0 preferred), from the candidate's own estimate."""
    idle = options.use_all_devices and bool(cand.estimate.unused_devices)
    redundant = options.cross_node_replicas and not cand.estimate.cross_node_replicas
    return (int(idle), int(redundant))


def _layout_key(plan: Plan) -> tuple:
    return tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines)


# ---- accounts ---------------------------------------------------------------------------------

def _memory(est: Estimate) -> str:
    """``"memory up to 28.2 GiB of 72.0 GiB per device"``: the fullest device against its limit."""
    dev = max(est.memory_bytes, key=lambda d: (est.memory_bytes[d] / est.memory_limit_bytes[d],
                                                -d))
    return (f"memory up to {fmt_bytes(est.memory_bytes[dev])} of "
            f"{fmt_bytes(est.memory_limit_bytes[dev])} per device")


def _share(share: float) -> str:
    return f"{share * 100:.4g}%"


def explain_buckets(result: BucketPlans) -> str:
    """What ``hspmd-launch plan --lengths`` prints: each bucket's plan (layout line, estimated
    step time, memory), the best single plan and the estimated gain."""
    inv, p = result.inventory, result.profile
    failed = [d.id for d in inv.devices if not d.usable]
    lines = [f"Length buckets for {p.name}, global batch {result.global_batch}, on "
             f"{len(inv.devices)} devices ({len(failed)} failed"
             f"{': ' + compact_ids(failed) if failed else ''})"]
    for bp in result.buckets:
        est = bp.estimate
        lines += [
            f"Bucket <= {bp.bucket.max_len} tokens ({_share(bp.bucket.share)} of sequences): "
            f"{bp.rows} row{'s' if bp.rows != 1 else ''}, {bp.result.chosen.label}",
            f"  {layout_line(bp.plan)}",
            f"  estimate: step {est.step_time_s:.4g} s, {_memory(est)}",
        ]
    single = result.single
    per_bucket = ", ".join(f"{e.step_time_s:.4g} s" for e in single.estimates)
    switch = (f"{result.switches} plan switch{'es' if result.switches != 1 else ''} per step"
              + (f" at {result.switch_cost_s:.4g} s each (an estimate)" if result.switch_cost_s
                 else ", switch cost not counted"))
    lines += [
        f"Bucketed: step {result.bucketed_step_time_s:.4g} s (the buckets' steps; {switch}), "
        f"{result.tokens_per_step / result.bucketed_step_time_s:,.0f} tokens/s",
        f"Best single plan that fits the longest bucket: {single.label}",
        f"  {layout_line(single.plans[-1])}",
        f"  estimate: step {single.step_time_s:.4g} s (per bucket: {per_bucket}), "
        f"{result.tokens_per_step / single.step_time_s:,.0f} tokens/s, "
        f"{_memory(single.estimates[-1])}",
        f"Estimated gain of the bucket plans: {result.gain:.3g}x over the best single plan",
    ]
    return "\n".join(lines)


def buckets_to_dict(result: BucketPlans) -> dict:
    """``explain_buckets``'s content as a JSON-ready dict (``"schema": 1``)."""
    return {
        "schema": 1,
        "model": result.profile.name,
        "global_batch": result.global_batch,
        "buckets": [{"max_len": bp.bucket.max_len, "share": bp.bucket.share, "rows": bp.rows,
                     "chosen": candidate_to_dict(bp.result.chosen),
                     "alternatives": [candidate_to_dict(c) for c in bp.result.alternatives]}
                    for bp in result.buckets],
        "single": {"label": result.single.label,
                   "plans": [plan.to_dict() for plan in result.single.plans],
                   "step_times_s": [e.step_time_s for e in result.single.estimates],
                   "step_time_s": result.single_step_time_s},
        "bucketed_step_time_s": result.bucketed_step_time_s,
        "single_step_time_s": result.single_step_time_s,
        "switches": result.switches,
        "switch_cost_s": result.switch_cost_s,
        "tokens_per_step": result.tokens_per_step,
        "gain": result.gain,
    }
