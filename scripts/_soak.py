"""``scripts/soak``: the chaos soak, long version.

    scripts/soak [--scenario examples/scenarios/chaos-soak.json] [--report PATH]
                 [--step-time 0.2] [--hang-limit 90] [--work-dir DIR]

Builds the multi-host topology of the tests (``tests/_netns.py``: each node in a network
namespace of its own with a control and a data link, a 3-member etcd in namespaces), starts
the chaos job on it (``tests/_chaos.py``: ``hspmd-launch --hspmd-elastic`` agents node-a,
node-b and node-c with 1, 1 and 3 workers) and drives it through the scenario with the
fault-injection harness (``launcher.inject``, the engine of ``hspmd-launch inject``, run here
in-process because it owns the etcd members that ``etcd-restart`` and ``etcd-stall`` act on),
then judges the run: every fault handled, no sample lost, every agent exited 0, every finished
worker ran every step and switched only by BSR, the parameters equal the fault-free reference
(1e-9), no process of the job left over.

Writes ``PATH.txt`` (the report table, the verdict, the date, duration and machine load) and
``PATH.json`` (the harness's report, the verdict and the same facts); default PATH:
``artifacts/soak/chaos-soak-<UTC time>``. Prints one line per fault as it settles. Ctrl-C (or
SIGTERM) stops the harness at its next wait (the remaining faults are reported not injected) and
still tears everything down: agents, workers, etcd members, namespaces; a second Ctrl-C stops
at once, still tearing down. Exit: 0 when the soak passed, 1 when it did not, 2 for bad usage or
a host without network namespaces, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "scripts"), str(ROOT)]

import _chaos  # noqa: E402
from _netns import topologies  # noqa: E402
from launch_harness import marked_processes, new_marker  # noqa: E402

from hspmd_elastic.files import atomic_write  # noqa: E402
from launcher.inject.api import ScenarioError  # noqa: E402
from launcher.inject.report import render_table  # noqa: E402
from launcher.inject.scenario import load_scenario  # noqa: E402


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=str(_chaos.SCENARIOS / "chaos-soak.json"),
                   help="scenario file (default: examples/scenarios/chaos-soak.json)")
    p.add_argument("--report", default=None,
                   help="report path without suffix: PATH.txt and PATH.json are written")
    p.add_argument("--step-time", type=float, default=0.2,
                   help="seconds of pacing per training step (default 0.2)")
    p.add_argument("--hang-limit", type=float, default=90.0,
                   help="the agents' hang limit, HSPMD_HANG_TIMEOUT_S (default 90 s: above the "
                        "start of a fresh worker on a busy host, which survivors wait for)")
    p.add_argument("--work-dir", default=None,
                   help="where the job's logs go (default: a new temporary directory, kept)")
    args = p.parse_args(argv)
    if not args.step_time >= 0:
        p.error(f"--step-time must be >= 0, got {args.step_time}")
    if not args.hang_limit > _chaos.Pace(steps=1).comm_s:
        p.error(f"--hang-limit must be above the collective timeout "
                f"({_chaos.Pace(steps=1).comm_s:g}s), got {args.hang_limit}")
    try:
        load_scenario(args.scenario)
    except ScenarioError as exc:
        p.error(str(exc))
    return args


class Interrupts:
    """SIGINT/SIGTERM: the first asks the harness to stop at its next wait, the second (or one
    before the harness runs) raises KeyboardInterrupt; teardown runs either way."""

    def __init__(self) -> None:
        self.job = None
        self.count = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, _frame) -> None:
        self.count += 1
        harness = getattr(self.job, "harness", None)
        print(f"soak: {signal.Signals(signum).name}: "
              f"{'stopping the harness' if harness and self.count == 1 else 'stopping now'}; "
              "tearing everything down", file=sys.stderr, flush=True)
        if harness is not None and self.count == 1:
            harness.stop()
        else:
            raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = _args(argv)
    scenario_path = Path(args.scenario)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report_base = Path(args.report or ROOT / "artifacts" / "soak" / f"chaos-soak-{stamp}")
    report_base.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hspmd-soak-"))
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "scenario": str(scenario_path), "cpus": os.cpu_count(), "load_before": _load(),
             "work_dir": str(work), "step_time": args.step_time, "hang_limit_s": args.hang_limit}
    marker = new_marker()
    stop = Interrupts()
    started = time.monotonic()
    report = verdict = None
    interrupted = False
    print(f"soak: scenario {scenario_path}, logs under {work}, load {facts['load_before']}",
          flush=True)
    try:
        with topologies(work) as make:
            topo = make(nodes=tuple(_chaos.NODES), etcd_members=3)
            job = _chaos.ChaosJob(topo, marker, _chaos.Pace(
                steps=_chaos.steps_for(scenario_path), step_time=args.step_time,
                hang_s=args.hang_limit))
            stop.job = job
            try:
                job.start()
                print(f"soak: job {job.name} training on {len(_chaos.NODES)} nodes after "
                      f"{time.monotonic() - started:.0f}s", flush=True)
                scenario = job.scenario(scenario_path)
                report = job.run(scenario, wait_end_s=300, on_row=lambda r: print(
                    f"soak: #{r.index} {r.fault} {r.outcome}"
                    + (f" ({r.note})" if r.note else ""), flush=True))
                facts["load_after_faults"] = _load()
                if not stop.count:  # stopped: no waiting for a job that trains on
                    verdict = job.judge(report)
            finally:
                interrupted = stop.count > 0
                stop.job = None
                job.close()
    except KeyboardInterrupt:
        interrupted = True
    except BaseException as exc:  # noqa: BLE001 - pytest.skip from topologies: no namespaces
        if type(exc).__name__ != "Skipped":
            raise
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    facts["duration_s"] = round(time.monotonic() - started, 1)
    facts["load_after"] = _load()
    left = marked_processes(marker)
    for proc in left:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    problems = list(verdict.problems) if verdict else ["the soak did not finish"]
    if left:
        problems.append(f"{len(left)} process(es) of the job left over (killed): "
                        f"{[p.pid for p in left]}")
    if interrupted:
        problems.append("interrupted")
    table = render_table(report) if report is not None else "(no report: the run did not start)"
    lines = [table, "",
             f"date {facts['date']}, duration {facts['duration_s']:.0f}s, {facts['cpus']} CPUs, "
             f"load average (1, 5, 15 min) before {facts['load_before']}, after "
             f"{facts['load_after']}",
             f"max |elastic - reference| = "
             f"{verdict.max_param_diff if verdict else None}",
             "PASSED" if not problems else "FAILED:\n  " + "\n  ".join(problems)]
    text = "\n".join(lines) + "\n"
    body = {"facts": facts, "passed": not problems, "problems": problems,
            "verdict": verdict.to_dict() if verdict else None,
            "report": report.to_dict() if report is not None else None}
    atomic_write(f"{report_base}.txt", text)
    atomic_write(f"{report_base}.json", json.dumps(body, indent=2, sort_keys=True) + "\n")
    print(text + f"soak: report in {report_base}.txt and {report_base}.json", flush=True)
    if interrupted:
        return 130
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
