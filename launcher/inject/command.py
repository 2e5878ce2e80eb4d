"""``hspmd-launch inject``: drive a running job through a scenario of faults and report.

Usage::

    hspmd-launch inject --scenario examples/scenarios/five-faults.json --job my-job \\
        --etcd-endpoints 127.0.0.1:2379 [--progress 'run/progress/*.jsonl'] \\
        [--report report.json] [--json] [--topology topology.json]

Also runnable as ``python -m launcher.inject.command``. Promises: a bad scenario, job id or
endpoint is one line naming the bad value and exit 2 (click's usage errors); an unreachable
etcd, or a job with no keys (a wrong ``--job``, as ``status`` says it), is one line and exit 1
before any fault; after the run the report is printed (a table, or JSON with
``--json``) and written to ``--report`` as JSON, with how the job stood at the end
(``job_end``: succeeded, failed with the reason etcd recorded, or running); the exit code is 0
when every fault was detected and recovered (or, for faults a job rides through, survived) and
the job did not fail, 1 otherwise. SIGINT and SIGTERM stop the run at its next wait: what the
faults hold is released (processes resumed, links healed, caps lifted and cgroups removed), the
report is made, and the exit is 1. Before the first fault, the CPU cgroups of runs that died
(SIGKILL) are restored (``launcher.cgroup_sweep.release``).
``--progress`` names the job's progress files (JSON lines: ``step``, ``round``, ``rank``,
``t``, ``batch``); without it, progress is read from the job's ``workers/`` records.
``etcd-restart`` runs ``--etcd-restart-cmd`` when given (``/bin/sh -c``, bounded by
``--etcd-restart-timeout``; the target endpoint, how and how long come in ``HSPMD_ETCD_*``);
without it, it restarts the etcd process proven to serve the job's endpoint on this host
(``launcher.inject.etcd_restart``); the report's note says which way, or the one reason it
could not; ``etcd-stall`` stops every member at once the same ways (the command once per
member with ``HSPMD_ETCD_HOW=stop``). ``partition`` needs ``--topology FILE``: each node's (and
etcd member's) network namespace and link devices (``launcher.inject.topology``); without it the
fault is reported ``not injected`` with that reason, and a bad file is one line and exit 2; a
``join`` of a node the file names starts its agent in that node's namespace.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional

import click

from hspmd_elastic.contract.env import (ETCD_DOWN_S_ENV, ETCD_ENDPOINT_ENV, ETCD_ENDPOINTS_ENV,
                                        ETCD_HOW_ENV)
from hspmd_elastic.coord.api import CoordinationError, EtcdAuthError
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.schema import job_prefix
from hspmd_elastic.files import atomic_write
from launcher.cgroup_sweep import release as release_cgroups
from launcher.etcd_security import subcommand_options, subcommand_security
from launcher.inject.api import InjectError, ScenarioError
from launcher.inject.detect import JobObserver, default_progress
from launcher.inject.faults import InjectContext
from launcher.inject.harness import Harness
from launcher.inject.report import all_handled, render_json, render_table
from launcher.inject.scenario import load_scenario
from launcher.inject.topology import NetTopology, TopologyError, load_topology
from launcher.ops.api import EtcdUnreachableError, JobNotFoundError
from launcher.ops.state import require_job

log = logging.getLogger(__name__)

ETCD_TIMEOUT_S = 5.0


def _check_job(job: str) -> str:
    try:
        job_prefix(job)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    return job


@click.command("inject", context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})
@click.option("--scenario", "scenario_path", required=True,
              help="Scenario file (JSON, see examples/scenarios/).")
@click.option("--job", required=True, help="The job's id (its --rdzv-id).")
@click.option("--etcd-endpoints", required=True, envvar=ETCD_ENDPOINTS_ENV,
              help="The job's etcd: host:port[,host:port...], IPv6 in brackets "
                   "([::1]:2379).")
@click.option("--report", "report_path", default=None, help="Write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--progress", default=None,
              help="Glob or directory of the job's progress files (default: workers/ records).")
@click.option("--log-dir", default=None, help="Where started agents (join) write their output.")
@click.option("--etcd-restart-cmd", default=None,
              help="Shell command that restarts the job's etcd for etcd-restart faults "
                   f"(env: {ETCD_ENDPOINT_ENV}, {ETCD_HOW_ENV}, {ETCD_DOWN_S_ENV}, ...); "
                   f"etcd-stall runs it for every member at once with {ETCD_HOW_ENV}=stop. "
                   "Default: act on the etcd process serving the job's endpoint on this "
                   "host, once proven to be the job's.")
@click.option("--etcd-restart-timeout", type=click.FloatRange(min=0.0, min_open=True),
              default=60.0, show_default=True,
              help="Seconds --etcd-restart-cmd may run before it is killed.")
@click.option("--topology", "topology_path", default=None,
              help="Network topology file (JSON: each node's network namespace and link "
                   "devices) for partition faults; a join of a node it names starts the agent "
                   "in that namespace.")
@subcommand_options
@click.option("--wait-end", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Seconds to wait after the last fault for the job to end (totals cover the "
                   "whole run).")
def command(scenario_path: str, job: str, etcd_endpoints: str, report_path: Optional[str],
            as_json: bool, progress: Optional[str], log_dir: Optional[str],
            etcd_restart_cmd: Optional[str], etcd_restart_timeout: float,
            topology_path: Optional[str], wait_end: float) -> int:
    """Inject the faults of a scenario into a running job; report detection and recovery."""
    try:
        scenario = load_scenario(scenario_path)
    except ScenarioError as exc:
        raise click.BadParameter(str(exc), param_hint="--scenario") from None
    _check_job(job)
    topology = None
    if topology_path:
        try:
            topology = load_topology(topology_path)
        except TopologyError as exc:
            raise click.BadParameter(str(exc), param_hint="--topology") from None
    security = subcommand_security()
    try:
        client = EtcdClient(etcd_endpoints, timeout=ETCD_TIMEOUT_S, security=security)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--etcd-endpoints") from None
    try:
        return _run(client, scenario, job, report_path, as_json, progress, log_dir, wait_end,
                    etcd_restart_cmd, etcd_restart_timeout, topology)
    except (CoordinationError, InjectError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        client.close()


def _run(client: EtcdClient, scenario, job: str, report_path: Optional[str], as_json: bool,
         progress: Optional[str], log_dir: Optional[str], wait_end: float,
         etcd_restart_cmd: Optional[str] = None, etcd_restart_timeout: float = 60.0,
         topology: Optional[NetTopology] = None) -> int:
    try:  # a job id with no keys is refused at once, as ``status`` does
        require_job(client, job)
    except JobNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    except EtcdUnreachableError as exc:
        cause = exc.__cause__
        if isinstance(cause, EtcdAuthError):
            raise click.ClickException(str(cause)) from None
        raise click.ClickException(f"cannot reach the job's etcd at "
                                   f"{','.join(client.endpoints)}: {cause or exc}") from None
    observer = JobObserver(client, job, default_progress(progress)).start()
    ctx = InjectContext(client, job, log_dir=log_dir, etcd_restart_cmd=etcd_restart_cmd,
                        etcd_restart_timeout_s=etcd_restart_timeout, etcd_by_pid=True,
                        topology=topology, env={**os.environ, **client.security.to_env()})
    harness = Harness(scenario, ctx, observer, wait_end_s=wait_end)
    release_cgroups()  # what an inject that was SIGKILLed left throttled, on this host
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda n, _f: harness.stop(f"{signal.Signals(n).name} "
                                                                "received")) for s in handled}
    try:
        report = harness.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        observer.stop()
    text = render_json(report)
    if report_path:
        atomic_write(report_path, text + "\n")  # never a half-written report
    click.echo(text if as_json else render_table(report))
    return 0 if all_handled(report) and not report.stopped else 1


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname).1s%(asctime)s %(name)s] "
                                                   "%(message)s", stream=sys.stderr)
    try:
        rv = command.main(args=argv, prog_name="hspmd-launch inject", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
