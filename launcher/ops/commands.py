"""``hspmd-launch status`` and ``hspmd-launch dashboard``: click commands over ``launcher.ops``.

    hspmd-launch status --job J [--watch | --wait] [--for S] [--json]
    hspmd-launch dashboard --job J [--port P] [--host H] [--allow-host NAME]... [--token-file F]
    python -m launcher.ops.commands status --job J      # the same, without the launcher

Connection: ``--etcd-endpoints host:port[,host:port...]`` (an IPv6 address in brackets,
``[::1]:2379``; default ``$HSPMD_ETCD_ENDPOINTS``),
``--job`` (default ``$HSPMD_JOB_ID``), TLS and auth with ``--etcd-cacert``, ``--etcd-cert``,
``--etcd-key``, ``--etcd-user``, ``--etcd-password-file`` (``launcher.etcd_security``; a read-only
role is enough). Promises: bad input is a click usage error naming the
bad value (exit 2); etcd unreachable or an unknown job is one line and exit 1, except that
``status --wait`` waits for a job that has not started yet (its first key), up to ``--for``;
nothing is written to etcd; every etcd call has ``--timeout`` seconds.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator, Optional, Sequence

import click

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient, parse_endpoints

from launcher.etcd_security import subcommand_options, subcommand_security
from launcher.ops.access import TokenError, is_loopback, read_token
from launcher.ops.api import DEFAULT_HOST, ENV_ENDPOINTS, ENV_JOB, OpsError
from launcher.ops.state import JobStateCache, read_view

DEFAULT_PORT = 8470
WATCH_TICK_S = 1.0  # redraw period of --watch when nothing changes (ages move on)


# ----------------------------------------------------------------------------- option parsing
def _check_endpoints(ctx, param, value: Optional[str]) -> str:
    if not value:
        raise click.BadParameter(
            f"no etcd endpoints: give --etcd-endpoints host:port[,host:port...] or set "
            f"{ENV_ENDPOINTS}", param_hint="--etcd-endpoints")
    try:
        parse_endpoints(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--etcd-endpoints") from None
    return value


def _check_job(ctx, param, value: Optional[str]) -> str:
    if not value:
        raise click.BadParameter(f"no job id: give --job ID or set {ENV_JOB}",
                                 param_hint="--job")
    try:
        schema.job_prefix(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    return value


def _read_token(ctx, param, value: Optional[str]) -> Optional[str]:
    """``--token-file PATH`` -> the token it holds (never the token itself on the command line)."""
    if value is None:
        return None
    try:
        return read_token(value)
    except TokenError as exc:
        raise click.BadParameter(str(exc), param_hint="--token-file") from None


def _connection_options(fn):
    fn = subcommand_options(fn)
    fn = click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=5.0,
                      show_default=True, help="Seconds for each etcd call.")(fn)
    fn = click.option("--etcd-endpoints", envvar=ENV_ENDPOINTS, callback=_check_endpoints,
                      help="etcd endpoints host:port[,host:port...], IPv6 in brackets "
                           f"([::1]:2379; default ${ENV_ENDPOINTS}).")(fn)
    fn = click.option("--job", envvar=ENV_JOB, callback=_check_job,
                      help=f"Job id (the rdzv id; default ${ENV_JOB}).")(fn)
    return fn


@contextmanager
def _client(endpoints: str, timeout: float) -> Iterator[EtcdClient]:
    security = subcommand_security()
    try:
        client = EtcdClient(endpoints, timeout=timeout, security=security)
    except (ValueError, CoordinationError) as exc:
        raise click.ClickException(f"cannot connect to etcd at {endpoints}: {exc}") from exc
    try:
        yield client
    finally:
        client.close()


@contextmanager
def _ops_errors() -> Iterator[None]:
    """OpsError -> one line, exit 1 (a ClickException, as hspmd-launch reports them)."""
    try:
        yield
    except OpsError as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT/SIGTERM while inside (main thread only; else never set)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------------------------ status
@click.command("status", context_settings={"help_option_names": ["-h", "--help"]})
@_connection_options
@click.option("--watch", is_flag=True, help="Follow the job live (an etcd watch) until Ctrl-C.")
@click.option("--wait", is_flag=True,
              help="First wait, with progress bars, until the job has started and no "
                   "rendezvous or switch is in progress (exit 1 if --for runs out).")
@click.option("--for", "duration", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="With --watch: stop after this many seconds; with --wait: give up after.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the status document (docs/operations.md); with --watch one per line.")
def status(job: str, etcd_endpoints: str, timeout: float, watch: bool, wait: bool,
           duration: Optional[float], as_json: bool) -> int:
    """Show a job: nodes, GPUs with health, the plan, the leader, throughput, recent events."""
    if duration is not None and not (watch or wait):
        raise click.UsageError("--for only applies with --watch or --wait")
    if watch and wait:
        raise click.UsageError("--watch and --wait cannot be used together")
    with _ops_errors(), _client(etcd_endpoints, timeout) as client:
        if watch:
            return _watch(client, job, etcd_endpoints, timeout, duration, as_json)
        if wait:
            _wait_settled(client, job, timeout, duration)
        view = read_view(client, job, timeout=timeout)
        if as_json:
            click.echo(json.dumps(view.document(), indent=2, sort_keys=True))
        else:
            draw = _drawing()
            draw.Console().print(draw.render(view, etcd_endpoints))
    return 0


def _wait_settled(client: EtcdClient, job: str, timeout: float,
                  duration: Optional[float]) -> None:
    deadline = None if duration is None else time.monotonic() + duration
    cache = JobStateCache(client, job).start(timeout)
    try:
        if cache.empty:  # a job not started yet (or a wrong id): wait for its first key
            bound = "" if duration is None else f" (at most {duration:g}s)"
            click.echo(f"note: job {job!r} has no keys under {cache.prefix} yet: waiting for it "
                       f"to start{bound}", err=True)
        with _stop_on_signals() as stop:
            bars = _drawing().WaitProgress()
            settled = bars.follow(cache, stop, deadline)
        if not settled:
            still = "; ".join(w.label for w in bars.waits_of(cache)) or "interrupted"
            raise click.ClickException(f"job {job} not settled: {still}")
    finally:
        cache.stop()


def _watch(client: EtcdClient, job: str, endpoints: str, timeout: float,
           duration: Optional[float], as_json: bool) -> int:
    deadline = None if duration is None else time.monotonic() + duration
    cache = JobStateCache(client, job).start(timeout)
    try:
        with _stop_on_signals() as stop:
            if as_json:
                _watch_json(cache, stop, deadline)
            else:
                _watch_rich(cache, endpoints, stop, deadline)
    finally:
        cache.stop()
    return 0


def _ticks(cache, stop: threading.Event, deadline: Optional[float]) -> Iterator[bool]:
    """Yield (changed?) on every change of the cache or tick, until stop or the deadline."""
    version = -1
    while not stop.is_set():
        tick = WATCH_TICK_S
        if deadline is not None:
            tick = min(tick, deadline - time.monotonic())
            if tick <= 0:
                return
        current = cache.wait_changed(version, tick)
        changed = current != version
        version = current
        yield changed


def _watch_json(cache, stop: threading.Event, deadline: Optional[float]) -> None:
    for changed in _ticks(cache, stop, deadline):
        if changed:
            click.echo(json.dumps(cache.view().document(), sort_keys=True))
            sys.stdout.flush()


def _watch_rich(cache, endpoints: str, stop: threading.Event, deadline: Optional[float]) -> None:
    draw = _drawing()
    with draw.Live(draw.render(cache.view(), endpoints), console=draw.Console(),
                   auto_refresh=False, transient=False) as live:
        for _ in _ticks(cache, stop, deadline):
            live.update(draw.render(cache.view(), endpoints), refresh=True)


def _drawing() -> SimpleNamespace:
    """rich and the views drawn with it (``ops.status``, ``ops.progress``), imported by the
    commands that draw: about 0.16 s that ``status --json`` and ``dashboard`` never spend."""
    from rich import console, live  # startup

    from launcher.ops import progress, status  # startup

    return SimpleNamespace(Console=console.Console, Live=live.Live, render=status.render,
                           WaitProgress=progress.WaitProgress)


# --------------------------------------------------------------------------------- dashboard
@click.command("dashboard", context_settings={"help_option_names": ["-h", "--help"]})
@_connection_options
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port (0: any free port; the URL is printed).")
@click.option("--host", default=DEFAULT_HOST, show_default=True,
              help="Address to listen on (loopback by default; any other needs --token-file).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header is NAME (a DNS name or address of "
                   "this machine, or a reverse proxy's); repeatable.")
@click.option("--token-file", "token", callback=_read_token, metavar="PATH",
              help="File holding a bearer token (at least 16 characters): every request must "
                   "then send 'Authorization: Bearer <token>'. Needed off loopback.")
def dashboard(job: str, etcd_endpoints: str, timeout: float, port: int, host: str,
              allow_hosts: tuple[str, ...], token: Optional[str]) -> int:
    """Serve a live page of the job, /api/state, /api/stream and Prometheus /metrics."""
    from launcher.ops.dashboard import DashboardServer  # startup

    if token is None and not is_loopback(host):
        raise click.UsageError(f"--host {host} is not a loopback address: give --token-file "
                               "PATH (a bearer token every request must send) to serve there")
    with _ops_errors(), _client(etcd_endpoints, timeout) as client:
        cache = JobStateCache(client, job).start(timeout)
        try:
            server = DashboardServer(cache, host, port, allow_hosts, token=token)
            if not cache.view().nodes and not cache.view().events:
                click.echo(f"note: job {job!r} has nothing under {schema.job_prefix(job)} yet; "
                           "the page fills in when it starts", err=True)
            click.echo(f"serving job {job} at {server.url} (metrics: {server.url}metrics)")
            sys.stdout.flush()
            with _stop_on_signals() as stop:
                try:
                    server.serve_until(stop)
                finally:
                    server.stop()
        finally:
            cache.stop()
    return 0


# -------------------------------------------------------------------------------- module main
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def ops() -> None:
    """hspmd-elastic operations: status and dashboard."""


ops.add_command(status)
ops.add_command(dashboard)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m launcher.ops.commands``: errors as one line, usage errors exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = "hspmd-launch " + (args[0] if args and args[0] in ops.commands else "ops")
    try:
        rv = ops.main(args=args, prog_name="hspmd-launch", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        print(f"{prog}: error: {exc.format_message()}".replace("\n", " "), file=sys.stderr)
        return exc.exit_code
    except click.Abort:
        print(f"{prog}: error: aborted", file=sys.stderr)
        return 1
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
