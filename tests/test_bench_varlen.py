"""``scripts/bench_varlen`` (variable-length data: bucketed in-step switching with packed rows
against the best single plan, packed and padded): its pure parts
(``scripts/bench/varlen_pure.py``: arguments, the corpus' lengths, the declared memory and its
limit, the numbers, ours against the best baseline and the targets, the report and the section)
and one quick end-to-end run on real gloo workers. No timing assertions: the benchmark measures,
the test checks that it produced finite numbers for the three plans and that their parameters
agree.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench import varlen_pure as bench  # noqa: E402
from launcher.cgroup_memory import detect_memory, memory_limit  # noqa: E402
from launcher.cgroups import CgroupUnavailable  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---- arguments ------------------------------------------------------------------------------

def test_defaults_quick_and_a_flag_winning_over_quick():
    full = bench.parse_args([])
    assert (full.steps, full.warmup, full.workers, full.global_batch) == (20, 3, 2, 20)
    assert full.lengths == bench.LENGTHS and full.model["seq_len"] == 256
    assert full.model["dtype"] == "float32" and full.tolerance == bench.TOLERANCES["float32"]
    quick = bench.parse_args(["--quick", "--json", "/tmp/x.json"])
    assert quick.quick and quick.steps < full.steps and quick.model["hidden_size"] < 128
    assert quick.json_path == "/tmp/x.json" and quick.write_doc is None
    assert quick.buckets() == ((8, 0.9), (64, 0.1)) and quick.model["seq_len"] == 64
    given_ = bench.parse_args(["--quick", "--steps", "5", "--dtype", "float64"])
    assert (given_.steps, given_.model["dtype"], given_.tolerance) == (5, "float64", 1e-9)


@pytest.mark.parametrize("argv, named", [
    (["--steps", "0"], "--steps=0"),
    (["--steps", "x"], "--steps='x'"),
    (["--workers", "1"], "--workers=1"),
    (["--timeout", "nan"], "--timeout=nan"),
    (["--lengths", "256:0.5,32:0.5"], "--lengths='256:0.5,32:0.5'"),
    (["--lengths", "256:1"], "at least two buckets"),
    (["--global-batch", "3"], "--global-batch=3"),
    (["--dtype", "float16"], "float16"),
])
def test_a_bad_value_is_one_line_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1] and err[-1].startswith("usage") is False, err


# ---- the corpus and the declared memory -----------------------------------------------------

def test_length_ranges_of_the_default_mix():
    assert bench.length_ranges([(32, 0.9), (256, 0.1)]) == [(2, 33), (129, 257)]
    assert bench.length_ranges([(8, 0.5), (12, 0.3), (64, 0.2)]) == [(2, 9), (10, 13), (33, 65)]


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=2, max_size=4, unique=True).map(sorted),
       count=st.integers(1, 300), seed=st.integers(0, 99))
def test_doc_lengths_fall_in_their_ranges_and_every_bucket_is_present(lengths, count, seed):
    buckets = [(n, 1 / len(lengths)) for n in lengths]
    got = bench.doc_lengths(buckets, count, seed)
    ranges = bench.length_ranges(buckets)
    which = [[k for k, (lo, hi) in enumerate(ranges) if lo <= n <= hi] for n in got]
    assert all(len(w) == 1 for w in which), (got, ranges)
    assert all(sum(w == [k] for w in which) >= 2 for k in range(len(ranges)))
    assert len(got) == max(count, 2 * len(ranges))
    assert bench.doc_lengths(buckets, count, seed) == got


def test_the_shares_decide_the_mix():
    got = bench.doc_lengths([(32, 0.9), (256, 0.1)], 5000, 1)
    short = sum(n <= 33 for n in got) / len(got)
    assert 0.87 < short < 0.93


def test_declared_memory_holds_the_short_replica_not_the_long_one():
    mem = bench.declared_memory(18 << 20, 38 << 20, 0.9)
    assert 18 << 20 < mem * 0.9 < 38 << 20
    with pytest.raises(ValueError, match="no declared memory separates them"):
        bench.declared_memory(30 << 20, 38 << 20, 0.9)


# ---- the numbers, the ratios, the target ----------------------------------------------------

def _record(*seconds, switch=(0.0, 0.0), switches=(0, 0), sent=(0, 0)):
    return bench.StepRecord(seconds, switch, switches, sent)


def test_summarize_takes_the_slowest_rank_and_the_median():
    steps = [_record(1.0, 2.0, switch=(0.1, 0.2), switches=(2, 2), sent=(100, 300)),
             _record(1.0, 1.0, switch=(0.3, 0.1), switches=(2, 2), sent=(100, 100)),
             _record(9.0, 4.0, switch=(0.4, 0.4), switches=(2, 2), sent=(100, 300))]
    got = bench.summarize("bucketed", "x", steps, real_tokens=400.0, padded_tokens=800.0)
    assert got["step_s_all"] == [2.0, 1.0, 9.0] and got["step_s"] == 2.0
    assert (got["tokens_per_s"], got["padded_tokens_per_s"]) == (200.0, 400.0)
    assert math.isclose(got["switch_s"], 0.3) and got["switches"] == 2
    assert math.isclose(got["switch_share"], 0.1)  # shares 0.1, 0.3, 0.044: the median
    assert got["bytes_per_step"] == 400
    with pytest.raises(ValueError, match="packed: no measured step"):
        bench.summarize("packed", "x", [], 1.0, 1.0)


def _result(packed, padded, bucketed):
    plans = {}
    for name, tps in (("packed", packed), ("padded", padded), ("bucketed", bucketed)):
        if tps is not None:
            plans[name] = {"plan": name, "layout": "DP2: 0 L0-3 (9 rows) | 1 L0-3 (9 rows)",
                           "step_s": 1.0, "tokens_per_s": tps, "padded_tokens_per_s": 2 * tps,
                           "switches": 2 if name == "bucketed" else 0, "switch_s": 0.01,
                           "switch_share": 0.01, "bytes_per_step": 3 << 20}
    return {"plans": plans, "agreement": bench.agreement(1e-5)}


@pytest.mark.parametrize("packed, padded, bucketed, best, vs_best, vs_packed, met, floor", [
    (1000.0, 500.0, 1300.0, "packed", 1.3, 1.3, True, True),
    (1000.0, 1500.0, 1300.0, "padded", 1300 / 1500, 1.3, True, False),
    (1000.0, 500.0, 1299.0, "packed", 1.299, 1.299, False, True),
    (1000.0, 500.0, 960.0, "packed", 0.96, 0.96, False, False),
    (None, 1100.0, 1299.0, None, None, None, False, False),  # a missing baseline: no verdict
    (1000.0, 900.0, None, "packed", None, None, False, False),
    (0.0, 10.0, 10.0, None, None, None, False, False),
])
def test_ours_against_the_best_baseline_and_against_packed(packed, padded, bucketed, best,
                                                            vs_best, vs_packed, met, floor):
    v = bench.verdict(_result(packed, padded, bucketed))
    assert v["best_baseline"] == best
    for got, want in ((v["bucketed_vs_best"], vs_best), (v["bucketed_vs_packed"], vs_packed)):
        assert (got is None) == (want is None) and (want is None or math.isclose(got, want))
    assert v["met"] is met and v["floor_met"] is floor
    assert (v["target"], v["floor"]) == (1.3, 0.97)


def test_the_memory_limit_is_the_declared_memory_over_the_baseline():
    assert bench.limit_baseline(100 << 20) == int((100 << 20) * 1.3)
    limit = memory_limit(30 << 20, bench.limit_baseline(100 << 20))  # what the bench writes
    assert limit.limit == (30 << 20) + int((100 << 20) * 1.3)
    assert bench.rss_bytes("Name:\tpython\nVmRSS:\t  2048 kB\n") == 2 << 20
    with pytest.raises(ValueError):
        bench.rss_bytes("Name: python\n")
    assert "NOT enforced (no controller)" in bench.memory_line({"enforced": False,
                                                                 "why": "no controller"})
    line = bench.memory_line({"enforced": True, "limit_bytes": 200 << 20,
                              "baseline_bytes": 150 << 20,
                              "peak_bytes": {"packed": [190 << 20, None]}})
    assert "limited to 200.0 MiB" in line and "(MiB): packed 190.0, -;" in line


@pytest.mark.parametrize("worst, ok", [(0.0, True), (1e-4, True), (2e-4, False),
                                       (None, False), (math.nan, False), (math.inf, False)])
def test_the_parameters_agree_check(worst, ok):
    assert bench.agreement(worst)["ok"] is ok
    assert bench.agreement(worst, 1e-9)["ok"] is (ok and worst is not None and worst <= 1e-9)


def test_the_report_has_every_plan_the_ratios_and_the_check():
    result = _result(1000.0, 1500.0, 2600.0)
    result["buckets"] = [{"window": 32, "rows": 18, "own": True, "layout": "DP2: 0 (9) | 1 (9)",
                          "step_s": 0.2, "home_s": 0.8, "switch_s": 0.004},
                         {"window": 256, "rows": 2, "own": False, "layout": "DP1: 0-1 tp2",
                          "step_s": 0.3, "home_s": math.inf, "switch_s": 0.0}]
    text = bench.report(result, "scripts/bench_varlen --quick", "Setup line.")
    lines = text.splitlines()
    assert lines[0] == "Setup line." and "Command: `scripts/bench_varlen --quick`" in text
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| plan")]
    for name in bench.PLANS:
        row = next(ln for ln in rows if ln.startswith(f"| {name} |"))
        assert row.count("|") == 12, row  # eleven cells: the layout's " | " became "; "
    assert "| bucketed |" in text and "2.60x" in text and "target >= 1.3x: met" in text
    assert "best baseline (padded): **1.73x** (target >= 0.97x: met)" in text
    assert "| 0 | 32 | 18 | its own: DP2: 0 (9); 1 (9) | 200 / 800 / 4 |" in text
    assert "does not fit" in text and "agree." in text and "Drift" not in text
    assert "Positions computed" not in text  # the figures are missing
    for name, padded in (("padded", 5120), ("bucketed", 1088)):
        result["plans"][name].update(padded_tokens=padded, real_tokens=900.0)
    assert "5,120 at the full length, 1,088 in the buckets (4.7x fewer), for 900 real" in \
        bench.report(result, "c", "h")
    result["agreement"] = dict(result["agreement"], drift_rel=0.3, drift_steps=23)
    assert "after 23 steps from the same initial values, worst relative difference 3.0e-01" in \
        bench.report(result, "c", "h")
    missed = bench.report(_result(1000.0, 1100.0, 1200.0), "c", "h")
    assert "target >= 1.3x: missed" in missed
    broken = dict(_result(1000.0, 1100.0, 1200.0), agreement=bench.agreement(0.5))
    assert "DISAGREE" in bench.report(broken, "c", "h")


def test_the_section_is_appended_then_replaced_in_place():
    doc = "# Benchmarks\n\n## Planner\n\nplanner text\n"
    once = bench.with_section(doc, "first body\n\n### (a) sub\n\nmore\n")
    assert once.startswith(doc.rstrip("\n")) and once.endswith("more\n")
    assert once.count(bench.SECTION) == 1
    later = once + "\n## Later section\n\nkept\n"
    twice = bench.with_section(later, "second body\n")
    assert "first body" not in twice and "second body" in twice and "### (a)" not in twice
    assert twice.count(bench.SECTION) == 1 and twice.endswith("## Later section\n\nkept\n")
    assert twice.startswith("# Benchmarks\n\n## Planner\n\nplanner text\n")
    assert bench.with_section(twice, "second body\n") == twice


# ---- the memory cgroups of a run ------------------------------------------------------------

def _memory_cgroup(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as fh:
        return next((ln for ln in fh.read().splitlines() if ":memory:" in ln), "")


def test_a_killed_runs_memory_cgroups_are_swept_by_the_next_run():
    """A run SIGKILLed after it placed a worker leaves its cgroups (job ``bench-varlen-<its
    pid>``, a live run's are left alone); the next run's sweep moves the worker back where it
    came from and removes them. A machine without a memory cgroup FAILS here, with why."""
    from bench import varlen

    try:
        hierarchy = detect_memory()
    except CgroupUnavailable as exc:
        pytest.fail(str(exc))
    waiter = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    home = _memory_cgroup(waiter.pid)
    code = (f"import sys\nsys.path[:0] = {sys.path!r}\nfrom bench import varlen\n"
            f"m = varlen.open_limits()\nm.place('packed-r0-rank0', {waiter.pid}, "
            "varlen.PROBE_LIMIT)\nprint(m.job, flush=True)\nsys.stdin.read()\n")
    run = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    job = f"bench-varlen-{run.pid}"
    parent = os.path.join(hierarchy.root, "hspmd-" + job)
    child = os.path.join(parent, "packed-r0-rank0")
    try:
        assert run.stdout.readline().strip() == job
        with open(os.path.join(child, "cgroup.procs")) as fh:
            assert [int(x) for x in fh.read().split()] == [waiter.pid]
        assert child not in varlen.sweep_killed_runs(hierarchy)  # its owner is alive
        run.kill()
        run.wait(timeout=10)
        removed = varlen.sweep_killed_runs(hierarchy)
        assert child in removed and parent in removed and not os.path.exists(parent)
        assert _memory_cgroup(waiter.pid) == home and waiter.poll() is None
    finally:
        for proc in (run, waiter):
            proc.kill()
            proc.wait(timeout=10)
        varlen.sweep_killed_runs(hierarchy)


# ---- one quick run --------------------------------------------------------------------------

@pytest.mark.timeout(400)  # a memory probe and three gloo worlds, one after another
def test_a_quick_run_measures_the_three_plans_and_their_parameters_agree(tmp_path):
    out, doc = tmp_path / "result.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Before\n\nkept\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_varlen"),
                           "--quick", "--json", str(out), "--write-doc", str(doc),
                           "--timeout", "120"],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["plans"]) == set(bench.PLANS)
    for name, p in result["plans"].items():
        for key in ("step_s", "tokens_per_s", "padded_tokens_per_s"):
            assert isinstance(p[key], float) and math.isfinite(p[key]) and p[key] > 0, (name, key)
        assert p["steps"] == 2 and p["estimated_s"] > 0
    check = result["agreement"]
    assert check["ok"] and check["worst_rel"] <= 1e-4 and check["dtype"] == "float32"
    assert math.isfinite(check["drift_rel"]) and check["drift_steps"] == 3  # reported only
    # the planner's plans differ by bucket: the short one runs under its own plan, switching
    assert result["buckets"][0]["own"] and result["plans"]["bucketed"]["switches"] >= 2
    assert result["plans"]["bucketed"]["bytes_per_step"] > 0
    assert result["one_device_fits"] == {"8": True, "64": False}
    assert result["verdict"]["bucketed_vs_best"] > 0
    assert result["verdict"]["best_baseline"] in ("packed", "padded")
    memory = result["memory"]  # enforced where the machine lets root write a memory cgroup
    if memory["enforced"]:
        assert all(p and p <= memory["limit_bytes"] for ps in memory["peak_bytes"].values()
                   for p in ps)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Before\n\nkept\n") and bench.SECTION in text
    assert "| bucketed |" in text


def test_the_rounds_alternate_and_the_last_one_runs_packed_first():
    assert bench.round_order(0, 1) == ("packed", "padded", "bucketed")
    assert [bench.round_order(r, 3) for r in range(3)] == [
        ("packed", "padded", "bucketed"), ("bucketed", "padded", "packed"),
        ("packed", "padded", "bucketed")]
    assert bench.round_order(0, 2) == ("bucketed", "padded", "packed")
    assert bench.parse_args(["--quick"]).rounds == 1 and bench.parse_args([]).rounds == 2
