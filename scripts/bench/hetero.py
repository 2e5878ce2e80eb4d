"""HSPMD's gain on devices that really differ, measured in one run on cgroup-throttled CPU workers.

    .venv/bin/python scripts/bench_hetero [--quick] [--json PATH] [--write-doc docs/benchmarks.md]
                                          [--measure-steps 16] [--skip-steps 3] [--dwell 10]
                                          [--flips 6] [--flip-steps 16] [--global-batch 64]
                                          [--parts steady,straggler,mixes] [--rounds 2]
                                          [--mixes 0.5,0.5,0.125,0.125;0.5,0.5,0.25,0.25;...]

One embedded etcd (``launcher.standalone.EtcdCluster``); every phase is a fresh job of one
``hspmd-launch --hspmd-elastic`` agent (node ``sn``, ``--nproc-per-node 4``, OMP_NUM_THREADS=1,
gloo on loopback) training a float32 decoder where compute dominates
(``hetero_pure.MODEL``) with ``scripts/bench/elastic_train.py``, which writes a timeline
of every completed step. Once every worker completed a step, each goes into its own CPU cgroup
(``launcher.cgroups.CpuQuota``: a CFS quota of a share of one core). Throughput is measured from
the timelines: the step completions after a start, a quota change or a switch, ``--skip-steps``
left out, then ``--measure-steps`` of them; their median step time gives tokens/s
(``hetero_pure.rate``; the mean over the same steps is in the JSON).

(a) the 4:1 mix, 0.5, 0.5, 0.125, 0.125 of a core (1.25 cores in all, on 2):
    uniform   ``--hspmd-planner uniform --hspmd-straggler-replans off``;
    nominal   hetero, replans off: the planner sees four equal devices;
    measured  hetero, replans on (``--hspmd-straggler-dwell``): measured after the ``degrade``
              replan of the slow devices and its ``switch-done``;
    optimum_b the same at (b)'s speeds (0.5, 0.5, 0.5, 0.125): the reference for (b).
    Every measured plan's step time is set next to the cost model's prediction for it on
    devices declared at their shares of a core, with the built-in CPU constants, with constants
    fitted to all the plans of this run (``planner.calibrate.fit_steps``) and fitted to the
    other plans only.
(b) hetero, replans on, every worker at 0.5; then worker ``sn:3`` is cut to 0.125 (the onset):
    the time to the ``speeds`` decision that replans, to the ``replan`` event, to its
    ``switch-done``; tokens/s before, during (onset to switch done), after, and at 30 s (the
    last steps before the onset + 30 s). The same with replans off (during: the same span after
    the onset; after: the steps that follow).
(c) in (b)'s job: the worker back at 0.5: the time to the ``recover`` switch-done and tokens/s
    after; then the worker's quota flips between 0.125 and 0.5 every ``--flip-steps`` steps
    ``--flips`` times (a noisy device): speed-driven switches of the whole job are counted, with
    the shortest gap between two, against the dwell. The workers' pids must not change.
(d) ours against the baselines a practitioner runs first, on each of ``--mixes`` (default
    0.5,0.5,0.125,0.125; 0.5,0.5,0.25,0.25; 1,0.5,0.25,0.25: shares of a core per device):
    ``uniform-all`` (the uniform planner over every device), ``fastest-k`` for k = 1 .. n - 1
    (the uniform planner over only the k fastest devices: a job of k workers; the best uniform
    plan over a subset is the best of these, measured) and ``ours`` (hetero, replans on,
    measured after its speed-driven switch, or as started when the leader makes none within
    two dwells + ``SETTLE_S``), ``--rounds`` times, the candidates in turn, the order reversed
    every other round; per mix the median tokens/s of each, ours / the best baseline, and the
    planner's own estimate of the mix (``plan_for`` with ``PlannerOptions()``, against the same
    on ``uniform_inventory``). Targets: ours >= 0.97x the best baseline on every mix, >= 1.3x
    on 0.5,0.5,0.25,0.25 (``hetero_mixes``). ``--parts`` picks the parts that run.

Targets (ratios within the run, PASS or MISS; a miss never fails the script): measured hetero /
uniform >= 1.3x; after the straggler, >= 85% of ``optimum_b``'s tokens/s with the switch done
within 30 s of the onset; the calibrated model within 20% for every plan; at most one
speed-driven switch per dwell period. The report (tables and the exact command) is printed;
``--json`` writes every figure, ``--write-doc`` replaces the "Heterogeneous devices, measured"
section of a markdown file. A phase that fails is reported and the others still run (exit 1).
Every wait has a deadline (``--phase-timeout``); every job's agent, workers and cgroups are
removed in ``finally`` (and by finalizers).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from typing import Optional

from bench import common
from bench.common import dump, write_section
from bench.hetero_job import BenchError, HeteroJob, device
from bench.hetero_mixes import Candidate, candidates, fitted_types, mix_name, order, summarize
from bench.hetero_mixes import report as mixes_report
from bench.hetero_mixes import targets as mix_targets
from bench.hetero_pure import (EVEN, MIX, MODEL, NODE, NPROC, ONSET_TARGET_S,
                                SECTION, SLOW, STRAGGLER, min_gap, parse_args, predictions,
                                rate, report, rows_of, targets, window)


def say(msg: str) -> None:
    common.say("bench", msg)


REPLANS_OFF = ["--hspmd-straggler-replans", "off"]
# (d): every candidate shards the optimizer state over its DP replicas (ZeRO-1, as a practitioner
# would): even shares for the uniform baselines, each pipeline's rows' share for ours, so a slow
# device updates only its part and can pay for its place in the plan
SHARDED = ["--hspmd-optimizer-shards", "uneven"]
SETTLE_S = 20.0  # (d): beyond two dwells, how long ours may take to make its speed-driven switch


def predicted(mix, global_batch: int) -> dict:
    """The planner's own view of a mix, through its public API: ``plan_for`` on devices declared
    at the mix's shares (``PlannerOptions()``: it may leave a slow device idle) against the same
    on ``uniform_inventory`` (every device taken for the weakest), estimated tokens/s each."""
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner import (Device, Health, Inventory, PlannerError, PlannerOptions,
                                       layout_line, plan_for, profile_from_dict,
                                       spec_for_device, uniform_inventory)

    profile = profile_from_dict(json.loads(ModelConfig(**MODEL).to_json()))
    inv = Inventory(tuple(Device(i, NODE, spec_for_device("CPU", None, speed=f), Health.HEALTHY,
                                 1.0) for i, f in enumerate(mix)))
    tokens = global_batch * MODEL["seq_len"]
    out: dict = {}
    try:
        ours = plan_for(inv, profile, global_batch, options=PlannerOptions())
        uni = plan_for(uniform_inventory(inv), profile, global_batch, options=PlannerOptions())
    except PlannerError as exc:
        return {"error": str(exc)}
    for key, res in (("ours", ours), ("uniform", uni)):
        out[key] = {"layout": layout_line(res.plan), "step_s": res.estimate.step_time_s,
                    "tokens_per_s": tokens / res.estimate.step_time_s}
    out["ours_vs_uniform"] = out["ours"]["tokens_per_s"] / out["uniform"]["tokens_per_s"]
    return out


def replans_on(s) -> list[str]:
    return ["--hspmd-straggler-replans", "on", "--hspmd-straggler-dwell", f"{s.dwell_s:g}"]


class Run:
    """The phases of one run, sharing one etcd; ``records`` feed the calibration."""

    def __init__(self, etcd, tmp: str, settings):
        self.etcd, self.tmp, self.s = etcd, tmp, settings
        self.records: list[tuple] = []  # (name, layout, plan, inventory, step_s)
        self.baselines: list[tuple] = []  # the same, of (d)'s baselines: ours' device types
        self.fits: dict = {}  # (d): ours' label -> the CPU constants it planned with
        self.result: dict = {"a": {}, "b": {}, "b_off": {}, "c": {}, "switches": {},
                             "errors": {}}

    def job(self, label: str, flags, nproc: int = NPROC) -> HeteroJob:
        d = os.path.join(self.tmp, label)
        os.makedirs(d)
        return HeteroJob(self.etcd, d, f"het-{label.replace('_', '-')}-{os.getpid()}",
                         self.s, flags, nproc)

    def measure(self, job: HeteroJob, after: float, name: str,
                records: Optional[list] = None) -> dict:
        """Steady state after ``after``: tokens/s of one plan (measured again after a later
        switch, at most twice), its layout; the plan joins ``records`` (default: the
        calibration of (a) to (c)) as ``name`` unless the leader switched within every window
        tried (``mixed``: the last plan's layout)."""
        for _ in range(3):
            r = rate(job.steps_after(after, self.s.measure + 1), self.s.tokens_per_step)
            if r is None:
                raise BenchError(f"{job.name}: no step time after {after:.1f}")
            if len(r.versions) == 1:
                break
            after = min(e.t for e in job.ends() if e.version == r.versions[-1]) - 1e-6
        v = r.versions[-1]
        plan, inv = job.plan_at_true_speeds(v, job.fractions)
        devices = job.plan_record(v).devices
        mixed = len(r.versions) > 1
        out = dict(r.as_dict(), layout=job.layout(v), version=v, mixed=mixed,
                   rows=dict(zip(devices, rows_of(plan))))
        if mixed:
            out["layout"] += (" (switched within the window: plans "
                              + ", ".join(f"v{x}" for x in r.versions) + ")")
        else:
            (self.records if records is None else records).append(
                (name, out["layout"], plan, inv, r.step_s))
        return out

    # ------------------------------------------------------------------ (a)
    def steady(self, key: str, flags, fractions, slow_lr=None) -> dict:
        job = self.job(key, flags)
        try:
            job.start()
            placed = job.place(fractions)
            out: dict = {"fractions": list(fractions)}
            after = placed
            if slow_lr is not None:  # replans on: after the switch the measured speeds drove
                sw = job.wait_switch("degrade", device(slow_lr), placed)
                out["switch_done_s"] = sw["done_at"] - placed
                out["speeds"] = sw["speeds"]
                after = sw["done_at"]
            out.update(self.measure(job, after, key))
            return out
        finally:
            job.close()

    # ------------------------------------------------------------------ (b), (c)
    def straggler(self, on: bool) -> None:
        s = self.s
        key = "b" if on else "b_off"
        job = self.job(key, replans_on(s) if on else REPLANS_OFF)
        res = self.result[key]
        dev = device(STRAGGLER)
        try:
            job.start()
            placed = job.place([EVEN] * NPROC)
            pids = job.pids()
            res["before"] = self.measure(job, placed, f"{key}: before")
            onset = job.set(STRAGGLER, SLOW)
            if on:
                sw = job.wait_switch("degrade", dev, onset)
                res.update(detect_s=None if sw["speeds_at"] is None else sw["speeds_at"] - onset,
                           replan_s=sw["replan_at"] - onset, switch_done_s=sw["done_at"] - onset,
                           speeds=sw["speeds"])
                until = sw["done_at"]
            else:
                until = onset + self.result["b"].get("switch_done_s", 10.0)
            job.steps_after(until, 1, skip=0)  # every step of the span has ended
            span = window(job.ends(), onset, 0, 10 ** 9, before=until)
            during = rate(span, s.tokens_per_step)
            res["during"] = None if during is None else during.as_dict()
            res["after"] = self.measure(job, until, f"{key}: after")
            res["layout_after"] = res["after"]["layout"]
            mark = onset + ONSET_TARGET_S  # the steady state at the target's deadline
            job.steps_after(mark, 1, skip=0)
            last = [e for e in job.ends() if onset < e.t <= mark][-(s.measure + 1):]
            at = rate(last, s.tokens_per_step)
            res["at_target"] = None if at is None else at.as_dict()
            if on:
                self.recovery(job, dev, placed, pids)
            res["same_pids"] = job.pids() == pids
        finally:
            job.close()

    def recovery(self, job: HeteroJob, dev: str, placed: float, pids: dict) -> None:
        s, c = self.s, self.result["c"]
        up = job.set(STRAGGLER, EVEN)
        sw = job.wait_switch("recover", dev, up)
        c.update(switch_done_s=sw["done_at"] - up, replan_s=sw["replan_at"] - up,
                 speeds=sw["speeds"])
        c["after"] = self.measure(job, sw["done_at"], "c: after")
        c["layout_after"] = c["after"]["layout"]
        noisy_from = time.time()
        for i in range(s.flips):
            target = job.steps_done() + s.flip_steps
            job.wait_for(lambda t=target: job.steps_done() >= t, f"step {target}")
            job.set(STRAGGLER, SLOW if i % 2 == 0 else EVEN)
        job.set(STRAGGLER, EVEN)
        target = job.steps_done() + s.flip_steps
        job.wait_for(lambda: job.steps_done() >= target, f"step {target}")
        switches = job.speed_switches(placed)
        at = [ev.at - placed for ev, _d in switches]
        self.result["switches"] = {
            "dwell_s": s.dwell_s, "flips": s.flips, "flip_steps": s.flip_steps,
            "count": len(switches), "at_s": at, "min_gap_s": min_gap(at),
            "noisy_count": sum(1 for ev, _d in switches if ev.at > noisy_from),
            "kinds": [sorted({c.kind for c in d.changes}) for _ev, d in switches]}

    # ------------------------------------------------------------------ (d)
    def candidate(self, label: str, cand: Candidate) -> dict:
        """One job of one candidate of (d): its steady tokens/s (ours: after its speed-driven
        switch, or as started when the leader made none within the settle window)."""
        s = self.s
        flags = (["--hspmd-planner", "uniform", *REPLANS_OFF] if cand.planner == "uniform"
                 else ["--hspmd-planner", "hetero", *replans_on(s)]) + SHARDED
        if cand.planner == "hetero":
            flags += self.device_types(label)
        job = self.job(label, flags, cand.nproc)
        try:
            job.start()
            after = job.place(cand.fractions)
            out: dict = {"fractions": list(cand.fractions)}
            if cand.planner == "hetero":
                sw = job.wait_speed_switch(after, 2 * s.dwell_s + SETTLE_S)
                out["switch_done_s"] = None if sw is None else sw["done_at"] - after
                after = after if sw is None else sw["done_at"]
            out.update(self.measure(job, after, label, [] if cand.planner == "hetero"
                                    else self.baselines))
            out["devices_used"] = sum(1 for n in out["rows"].values() if n > 0)
            return out
        finally:
            job.close()

    def device_types(self, label: str) -> list[str]:
        """``--hspmd-device-types`` for ours: the CPU constants fitted to the baselines'
        step times measured so far in this run (``hetero_mixes.fitted_types``), as a practitioner
        gives a job the constants measured on their machines; none while they do not determine
        a fit (ours then plans with the built-in ones)."""
        fit = fitted_types(self.baselines)
        self.fits[label] = fit
        if fit is None:
            say(f"(d) {label}: no fit of the CPU constants yet: the built-in ones")
            return []
        path = os.path.join(self.tmp, f"{label}-types.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(fit["types"], f)
        say(f"(d) {label}: CPU constants fitted to {fit['plans']} baseline plans: "
            f"{fit['types']['CPU']} (rms error {fit['rms_rel_error']:.1%})")
        return ["--hspmd-device-types", path]

    def mixes(self) -> None:
        """(d): every candidate of every mix, ``rounds`` times, interleaved."""
        s = self.s
        runs: dict = {mix_name(m): {c.name: [] for c in candidates(m)} for m in s.mixes}
        for r in range(s.rounds):
            for m in s.mixes:
                for cand in order(candidates(m), r):
                    label = f"d{r}-{mix_name(m).replace(',', '-').replace('.', 'p')}-{cand.name}"
                    try:
                        got = self.candidate(label, cand)
                    except BenchError as exc:
                        got = {"error": str(exc).splitlines()[0]}
                        say(f"(d) {label}: FAILED: {got['error']}")
                    runs[mix_name(m)][cand.name].append(got)
                    if "tokens_per_s" in got:
                        say(f"(d) {label}: {got['tokens_per_s']:,.0f} tokens/s, {got['layout']}")
        self.result["mixes"] = {"runs": runs, "rounds": s.rounds, "fits": self.fits,
                                "summary": {k: summarize(v) for k, v in runs.items()},
                                "predicted": {mix_name(m): predicted(m, s.global_batch)
                                              for m in s.mixes}}

    # ------------------------------------------------------------------ all of it
    def phase(self, name: str, fn) -> None:
        t0 = time.monotonic()
        self.result.setdefault("phase_load", {})[name] = os.getloadavg()[0]
        try:
            fn()
            say(f"{name}: done in {time.monotonic() - t0:.0f} s")
        except BenchError as exc:
            self.result["errors"][name] = str(exc)
            say(f"{name}: FAILED: {exc}")
        except Exception as exc:  # noqa: BLE001 - report it, run the other phases
            self.result["errors"][name] = f"{type(exc).__name__}: {exc}"
            say(f"{name}: FAILED:\n{traceback.format_exc()}")

    def all(self) -> None:
        a, s = self.result["a"], self.s

        def steady(key, flags, fractions, slow_lr=None):
            a[key] = self.steady(key, flags, fractions, slow_lr)
            say(f"(a) {key}: {a[key]['tokens_per_s']:,.0f} tokens/s, {a[key]['layout']}")

        if "mixes" in s.parts:
            self.phase("d-mixes", self.mixes)
        if "steady" in s.parts:
            self.steady_parts(steady)
        if "straggler" in s.parts:
            self.phase("b-on", lambda: self.straggler(True))
            self.phase("b-off", lambda: self.straggler(False))
        self.model()

    def steady_parts(self, steady) -> None:
        s = self.s
        self.phase("a-uniform", lambda: steady(
            "uniform", ["--hspmd-planner", "uniform", *REPLANS_OFF], MIX))
        self.phase("a-nominal", lambda: steady(
            "nominal", ["--hspmd-planner", "hetero", *REPLANS_OFF], MIX))
        self.phase("a-measured", lambda: steady(
            "measured", ["--hspmd-planner", "hetero", *replans_on(s)], MIX, slow_lr=NPROC - 2))
        b_speeds = [EVEN] * NPROC
        b_speeds[STRAGGLER] = SLOW
        self.phase("a-optimum_b", lambda: steady(
            "optimum_b", ["--hspmd-planner", "hetero", *replans_on(s)], b_speeds,
            slow_lr=STRAGGLER))

    def model(self) -> None:
        from hspmd_elastic.graph.config import ModelConfig
        from hspmd_elastic.planner import profile_from_dict

        if not self.records:
            return
        profile = profile_from_dict(json.loads(ModelConfig(**MODEL).to_json()))
        rows, fit = predictions(self.records, profile)
        self.result["model"] = {"plans": [r.as_dict() for r in rows], "fit": fit}


def main(argv=None) -> int:
    from launcher.standalone import EtcdCluster

    s = parse_args(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])

    def _terminate(signum, _frame):  # run every ``finally``: no agent, worker or cgroup left
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    command = ".venv/bin/python scripts/bench_hetero " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    say(f"load average {load:.2f}; {s}")
    with tempfile.TemporaryDirectory(prefix="hspmd-bench-hetero-") as tmp:
        etcd = EtcdCluster(size=1, base_dir=os.path.join(tmp, "etcd"))
        etcd.start()
        try:
            run = Run(etcd, tmp, s)
            run.all()
        finally:
            etcd.stop()
    result = run.result
    ran = [p for p in ("steady", "straggler") if p in s.parts]
    result["targets"] = [t.as_dict() for t in targets(result)] if ran else []
    mixes = result.get("mixes")
    if mixes:
        result["targets"] += [t.as_dict() for t in mix_targets(mixes["summary"])]
    result.update(settings=vars(s), load_average=load, elapsed_s=time.monotonic() - t0,
                  model_config=MODEL, command=command)
    header = (f"`scripts/bench_hetero`: one run, {time.strftime('%Y-%m-%d')}, "
              f"{os.cpu_count()} CPU cores, 1-minute load average {load:.1f} before it, "
              f"{result['elapsed_s'] / 60:.1f} min in all. Model {json.dumps(MODEL)}, "
              f"global batch {s.global_batch}, AdamW; 1 node x {NPROC} workers, each in its own "
              "CPU cgroup (CFS quota, a share of one core), gloo on loopback, "
              "OMP_NUM_THREADS=1. Every number below is measured in this run; the cost model's "
              "are its predictions for the measured plans. A step time is the median time "
              f"between consecutive step completions over {s.measure} steps after "
              f"{s.skip} left out (after a start, a quota change or a switch), tokens/s is "
              f"{s.tokens_per_step} tokens per step over it (the mean over the same steps is "
              "in the JSON).")
    body = report(result, command, header)
    if mixes:
        body += "\n" + "\n".join(mixes_report(mixes["summary"], mixes["predicted"],
                                                mixes["rounds"], mixes.get("fits"))) + "\n"
    print(body, flush=True)
    for t in result["targets"]:
        say(f"{t['verdict']}: {t['target']}: {t['value']} (goal {t['goal']})")
    if s.json_path:
        dump(s.json_path, result)
        say(f"wrote {s.json_path}")
    if s.write_doc:
        write_section(s.write_doc, SECTION, body)
        say(f"wrote the {SECTION[3:]} section of {s.write_doc}")
    for name, err in result["errors"].items():
        say(f"phase {name} failed: {err.splitlines()[0]}")
    return 1 if result["errors"] else 0
