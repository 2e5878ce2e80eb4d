"""The pure parts of ``scripts/bench_hetero`` (``scripts/bench/hetero_pure.py`` and
``hetero_mixes.py``, the baselines of part (d)): its arguments,
tokens/s from the workers' timelines, the cost model's predictions of measured plans with the
constants fitted to them, the targets' ratios and the report. No processes, no timing: the
benchmark itself measures.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

from bench import hetero_mixes as mixes  # noqa: E402
from bench import hetero_pure as bench  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# ---- arguments ------------------------------------------------------------------------------

def test_defaults_and_quick():
    full, quick = bench.parse_args([]), bench.parse_args(["--quick", "--json", "/tmp/x.json"])
    assert (full.measure, full.skip, full.dwell_s, full.global_batch) == (16, 3, 10.0, 64)
    assert quick.quick and quick.measure < full.measure and quick.flips < full.flips
    assert quick.json_path == "/tmp/x.json" and quick.write_doc is None
    assert full.tokens_per_step == 64 * bench.MODEL["seq_len"]
    given_ = bench.parse_args(["--quick", "--measure-steps", "9", "--dwell", "2.5"])
    assert (given_.measure, given_.dwell_s) == (9, 2.5)  # a flag wins over --quick


@pytest.mark.parametrize("argv, named", [
    (["--measure-steps", "2"], "--measure-steps=2"),
    (["--measure-steps", "x"], "--measure-steps='x'"),
    (["--dwell", "0"], "--dwell=0"),
    (["--dwell", "nan"], "--dwell=nan"),
    (["--global-batch", "3"], "--global-batch=3"),
    (["--phase-timeout", "1e9"], "--phase-timeout=1e9"),
])
def test_a_bad_value_is_one_line_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1], err


# ---- tokens/s from timelines ----------------------------------------------------------------

def _marks(times, version=1, pid=1):
    return [{"ev": "start", "t": 0.0, "pid": pid}] + [
        {"ev": "step", "step": i, "t": t, "v": version, "pid": pid} for i, t in enumerate(times)]


def test_a_step_ends_when_its_last_worker_completes_it():
    ends = bench.step_ends({"sn:0": _marks([1.0, 2.0, 3.0]),
                            "sn:1": _marks([1.5, 2.1, 2.9], version=2)})
    assert [(e.step, e.t) for e in ends] == [(0, 1.5), (1, 2.1), (2, 3.0)]
    assert [e.version for e in ends] == [2, 2, 1]


def test_window_skips_then_counts_and_rate_leaves_the_first_duration_out():
    ends = bench.step_ends({"sn:0": _marks([1, 2, 3, 5, 7, 9, 11])})
    w = bench.window(ends, after=2.5, skip=1, count=3)
    assert [e.t for e in w] == [5, 7, 9]
    r = bench.rate(w, tokens_per_step=100)
    assert (r.steps, r.step_s, r.tokens_per_s, r.versions) == (2, 2.0, 50.0, (1,))
    stalled = bench.rate(bench.step_ends({"sn:0": _marks([0, 1, 2, 8, 9])}), 100)
    assert (stalled.step_s, stalled.tokens_per_s) == (1.0, 100.0)  # the median step time
    assert math.isclose(stalled.mean_tokens_per_s, 400 / 9)  # 4 steps in 9 s
    assert bench.window(ends, after=2.5, skip=0, count=9, before=7) == ends[2:4]
    assert bench.rate(w[:1], 100) is None  # one completion measures no step time
    assert bench.rate([], 100) is None


@settings(max_examples=50, deadline=None)
@given(start=st.floats(0, 1e6), step=st.floats(1e-3, 10), n=st.integers(2, 50),
       tokens=st.integers(1, 10_000))
def test_rate_of_evenly_spaced_steps(start, step, n, tokens):
    ends = bench.step_ends({"sn:0": _marks([start + i * step for i in range(n)])})
    r = bench.rate(ends, tokens)
    assert r.steps == n - 1
    assert math.isclose(r.step_s, step, rel_tol=1e-6)
    assert math.isclose(r.tokens_per_s, tokens / step, rel_tol=1e-6)
    assert math.isclose(r.mean_tokens_per_s, r.tokens_per_s, rel_tol=1e-6)


def test_min_gap():
    assert bench.min_gap([5.0, 1.0, 3.5]) == 1.5
    assert bench.min_gap([2.0]) is None


# ---- the cost model against measured plans ---------------------------------------------------

def test_measurements_the_model_made_with_other_constants_are_fitted_back():
    """Step times the cost model itself predicts under known CPU constants: the calibrated
    predictions match them, the built-in ones do not."""
    from dataclasses import replace

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner import (Device, Health, Inventory, PlannerOptions, estimate_plan,
                                       plan_for, profile_from_dict, spec_for_device)

    profile = profile_from_dict(json.loads(ModelConfig(**bench.MODEL).to_json()))

    def inventory(shares):
        return Inventory(tuple(Device(i, "sn", spec_for_device("CPU", None, speed=s),
                                      Health.HEALTHY, 1.0) for i, s in enumerate(shares)))

    def truth(plan, inv):  # "this machine": 3x the compute rate, 5x the fixed costs
        fast = Inventory(tuple(replace(d, spec=replace(
            d.spec, peak_tflops=d.spec.peak_tflops * 3,
            microbatch_overhead_s=d.spec.microbatch_overhead_s * 5,
            link_latency_s=d.spec.link_latency_s * 5)) for d in inv.devices))
        return estimate_plan(plan, fast, profile, PlannerOptions(use_all_devices=True)).step_time_s

    records = []
    for name, shares, batch in (("even", (0.5,) * 4, 64), ("mix", bench.MIX, 64),
                                ("one slow", (0.5, 0.5, 0.5, 0.125), 32),
                                ("pair", (0.5, 0.25), 16)):
        inv = inventory(shares)
        plan = plan_for(inv, profile, batch, None, PlannerOptions(use_all_devices=True)).plan
        records.append((name, "-", plan, inv, truth(plan, inv)))
    rows, fit = bench.predictions(records, profile)
    assert "error" not in fit and fit["plans"] == 4, fit
    errors = []
    for row in rows:
        d = row.as_dict()
        assert abs(d["calibrated_error"]) < 0.01, d
        assert abs(d["error"]) > 0.05, d  # the built-in constants are not this machine's
        errors.append(abs(d["error"]))
    # far off where compute and fixed costs pace the step; least on the plan a worker at 0.125
    # of a core paces through its all-reduce, whose bytes both constants move at one rate
    assert sum(e > 0.2 for e in errors) >= 3, errors


def test_an_undetermined_fit_is_reported_not_raised():
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner import (Device, Health, Inventory, PlannerOptions, plan_for,
                                       profile_from_dict, spec_for_device)

    profile = profile_from_dict(json.loads(ModelConfig(**bench.MODEL).to_json()))
    inv = Inventory(tuple(Device(i, "sn", spec_for_device("CPU", None, speed=0.5),
                                 Health.HEALTHY, 1.0) for i in range(2)))
    plan = plan_for(inv, profile, 8, None, PlannerOptions(use_all_devices=True)).plan
    rows, fit = bench.predictions([("only", "-", plan, inv, 0.2)], profile)
    assert "do not determine" in fit["error"]
    assert rows[0].calibrated_s is None and rows[0].predicted_s > 0


# ---- targets and the report ------------------------------------------------------------------

def _result(uniform=1000.0, measured=1400.0, optimum=2000.0, at_target=1800.0, done=5.0,
            errors=(0.05, -0.1), gaps=(0.0, 12.0), dwell=10.0):
    plans = [{"plan": f"p{i}", "layout": "DP2: sn:0 L0-1 (4 rows) | sn:1 L0-1 (4 rows)",
              "measured_s": 0.1, "predicted_s": 0.3, "calibrated_s": 0.1 * (1 + e),
              "held_out_s": None, "error": 2.0, "calibrated_error": e, "held_out_error": None}
             for i, e in enumerate(errors)]
    return {"a": {"uniform": {"tokens_per_s": uniform}, "measured": {"tokens_per_s": measured},
                  "optimum_b": {"tokens_per_s": optimum}},
            "b": {"at_target": {"tokens_per_s": at_target}, "switch_done_s": done,
                  "before": {"tokens_per_s": 2100.0, "rows": {"sn:3": 16}},
                  "after": {"tokens_per_s": 1700.0, "rows": {"sn:3": 4}}},
            "c": {"after": {"rows": {"sn:3": 16}}},
            "model": {"plans": plans, "fit": {"plans": len(plans), "types": {}}},
            "switches": {"dwell_s": dwell, "count": len(gaps), "at_s": list(gaps),
                         "min_gap_s": bench.min_gap(gaps)},
            "settings": {"measure": 16}}


def _verdicts(result):
    return [t.verdict for t in bench.targets(result)]


def test_every_target_passes_at_its_threshold():
    assert _verdicts(_result(measured=1300.0, at_target=1700.0, done=30.0, errors=(0.2, -0.2),
                             gaps=(0.0, 10.0))) == ["PASS"] * 4


def test_each_target_misses_on_its_own_ratio():
    assert _verdicts(_result(measured=1290.0)) == ["MISS", "PASS", "PASS", "PASS"]
    assert _verdicts(_result(at_target=1690.0)) == ["PASS", "MISS", "PASS", "PASS"]
    assert _verdicts(_result(done=30.5)) == ["PASS", "MISS", "PASS", "PASS"]
    assert _verdicts(_result(errors=(0.05, -0.21))) == ["PASS", "PASS", "MISS", "PASS"]
    assert _verdicts(_result(gaps=(0.0, 9.4, 30.0))) == ["PASS", "PASS", "PASS", "MISS"]
    assert _verdicts(_result(gaps=(0.0, 9.6, 30.0)))[3] == "PASS"  # within the journal slack


def test_a_missing_figure_is_a_miss_not_an_error():
    assert _verdicts({}) == ["MISS", "MISS", "MISS", "MISS"]
    r = _result()
    r["model"]["plans"][0]["calibrated_error"] = None  # a plan the fit could not predict
    assert _verdicts(r)[2] == "MISS"
    r = _result()
    r["a"]["uniform"] = None
    assert bench.targets(r)[0].value == "n/a"


def test_the_report_has_the_command_the_tables_and_every_verdict():
    text = bench.report(_result(measured=1290.0), "scripts/bench_hetero --quick", "Header.")
    assert text.startswith("Header.\n") and "`scripts/bench_hetero --quick`" in text
    assert "| measured hetero / uniform (4:1 mix) | 1.29x | >= 1.3x | MISS |" in text
    assert "Rows per step of the straggler: 16 -> 4 -> 16." in text
    for line in text.splitlines():  # a layout's own "|" never splits a table cell
        if line.startswith("| p0 |"):
            assert line.count("|") == 10, line
    assert bench.report({}, "c", "h")  # an empty run still renders


# ---- (d): ours against the best baseline on each mix ------------------------------------------


def test_the_default_mixes_and_their_parsing():
    assert mixes.MIXES == ((0.5, 0.5, 0.125, 0.125), (0.5, 0.5, 0.25, 0.25),
                           (1.0, 0.5, 0.25, 0.25))
    assert mixes.parse_mixes("0.5,0.5,0.25,0.25;1,0.5,0.25,0.25", 2) == (
        (0.5, 0.5, 0.25, 0.25), (1.0, 0.5, 0.25, 0.25))
    for bad, why in (("1,1,1", "adds up to 3"), ("0.5", "2 to 8"), ("0.5,x", "not a comma"),
                     ("0.5,0", "share 0.0"), ("0.5,nan", "share nan"), ("0.5,3", "share 3.0")):
        with pytest.raises(ValueError, match=why):
            mixes.parse_mixes(bad, 2)
    s = bench.parse_args(["--parts", "mixes", "--mixes", "0.5,0.25", "--rounds", "3"])
    assert (s.parts, s.mixes, s.rounds) == (("mixes",), ((0.5, 0.25),), 3)
    assert bench.parse_args(["--quick"]).rounds == 1 and bench.parse_args([]).rounds == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "steady,nope"])


def test_the_candidates_are_uniform_over_all_the_fastest_k_and_ours():
    got = mixes.candidates((0.25, 1.0, 0.5, 0.25))
    assert [(c.name, c.fractions, c.planner) for c in got] == [
        ("uniform-all", (0.25, 1.0, 0.5, 0.25), "uniform"),
        ("fastest-1", (1.0,), "uniform"), ("fastest-2", (1.0, 0.5), "uniform"),
        ("fastest-3", (1.0, 0.5, 0.25), "uniform"),
        ("ours", (0.25, 1.0, 0.5, 0.25), "hetero")]
    assert [c.nproc for c in got] == [4, 1, 2, 3, 4]
    assert mixes.order(got, 0) == got and mixes.order(got, 1) == got[::-1]


def test_ours_is_set_against_the_best_measured_baseline():
    runs = {"uniform-all": [{"tokens_per_s": 100.0, "layout": "DP4", "devices_used": 4},
                            {"tokens_per_s": 120.0, "layout": "DP4", "devices_used": 4}],
            "fastest-2": [{"tokens_per_s": 200.0, "layout": "DP2", "devices_used": 2},
                          {"error": "timed out"}],
            "ours": [{"tokens_per_s": 260.0, "layout": "DP4 hetero", "devices_used": 3},
                     {"tokens_per_s": 280.0, "layout": "DP4 hetero", "devices_used": 3}]}
    s = mixes.summarize(runs)
    assert s["candidates"]["uniform-all"]["tokens_per_s"] == 110.0
    assert s["candidates"]["fastest-2"]["errors"] == ["timed out"]
    assert (s["best_baseline"], s["best_baseline_tokens_per_s"]) == ("fastest-2", 200.0)
    assert s["ours_tokens_per_s"] == 270.0 and math.isclose(s["ours_vs_best"], 1.35)
    name = mixes.mix_name(mixes.GAIN_MIX)
    t = mixes.targets({name: s, "1,0.5": dict(s, ours_vs_best=0.96)})
    assert [(x.name, x.ok) for x in t] == [
        (f"ours / best baseline on {name}", True), ("ours / best baseline on 1,0.5", False),
        (f"ours / best uniform-or-subset plan on {name}", True)]
    lost = mixes.summarize({"uniform-all": [{"tokens_per_s": 100.0}], "ours": [{"error": "x"}]})
    assert lost["ours_vs_best"] is None
    assert not mixes.targets({"a": lost})[0].ok  # a missing figure is a miss, never a pass
    text = "\n".join(mixes.report({name: s}, {name: {"ours_vs_uniform": 1.5}}, 2))
    assert "| 0.5,0.5,0.25,0.25 | 110 | fastest-2: 200 | 270 | **1.35x** | 1.50x |" in text
    assert "| ours | DP4 hetero | 3 | 270 | 260, 280 | 1.35x |" in text
    assert "| PASS |" in text


def test_the_constants_ours_plans_with_are_fitted_to_the_baselines_step_times():
    """Step times the cost model predicts under known CPU constants, for the baselines' kinds
    of plan (data parallel over the fastest k workers, at their shares of a core): the fit
    gives back the compute rate and the fixed cost per micro-batch that made them, as
    ``--hspmd-device-types`` reads them, and leaves the collective start-up to the built-in
    value; with no baseline measured there is no fit."""
    from dataclasses import replace

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.planner import (BUILTIN_SPECS, Device, Inventory, PlannerOptions,
                                       device_types_from_dict, estimate_plan, plan_for,
                                       profile_from_dict, spec_for_device)

    profile = profile_from_dict(json.loads(ModelConfig(**bench.MODEL).to_json()))
    truth = replace(BUILTIN_SPECS["CPU"], peak_tflops=0.08, microbatch_overhead_s=0.07)
    records = []
    for shares in ((0.5,), (0.5, 0.5), (0.5, 0.5, 0.125), (0.5, 0.5, 0.125, 0.125)):
        def inv(spec):
            return Inventory(tuple(Device(i, "sn", spec_for_device("CPU", None,
                                                                   types={"CPU": spec}, speed=s))
                                   for i, s in enumerate(shares)))
        opts = PlannerOptions(use_all_devices=True, tp_degrees=(1,), pp_degrees=(1,))
        plan = plan_for(inv(BUILTIN_SPECS["CPU"]), profile, 64, None, opts).plan
        seconds = estimate_plan(plan, inv(truth), profile, opts).step_time_s
        records.append((f"fastest-{len(shares)}", "-", plan, inv(BUILTIN_SPECS["CPU"]),
                        seconds))
    fit = mixes.fitted_types(records)
    cpu = fit["types"]["CPU"]
    assert fit["plans"] == 4 and fit["rms_rel_error"] < 1e-9, fit
    assert "link_latency_s" not in cpu  # data-parallel plans barely see it
    assert cpu["peak_tflops"] * cpu["mfu"] == pytest.approx(0.08, rel=1e-9)
    assert cpu["microbatch_overhead_s"] == pytest.approx(0.07, rel=1e-9)
    (spec,) = device_types_from_dict(fit["types"]).values()  # what the job reads
    assert spec.host_links and spec.link_latency_s == BUILTIN_SPECS["CPU"].link_latency_s
    assert mixes.fitted_types([]) is None
