"""``hspmd-launch``: torchrun's command line over the etcd-backed node agent, plus subcommands.

Promises:

* ``hspmd-launch [torchrun flags] script.py [script args...]`` takes every torchrun flag with
  torchrun's meaning and default, spelled with dashes or underscores, as ``--flag value`` or
  ``--flag=value``; each flag can also come from ``PET_<FLAG>`` (e.g. ``PET_NPROC_PER_NODE=2``);
  everything after the script belongs to the script;
* our own flags are named ``--hspmd-*``; ``--hspmd-elastic`` (with ``--hspmd-model`` and
  ``--hspmd-global-batch``) runs the agent in elastic mode (``launcher.node.elastic.mode``) instead of
  torchrun's restart mode;
* a first argument naming a subcommand (``status``, ``dashboard``, ``inject``, ``plan``) that is
  not an existing file runs that subcommand; ``hspmd-launch -- status`` runs a script called
  ``status``;
* under ``srun``, flags not given come from Slurm's environment (``launcher.slurm``; flags and
  ``PET_*`` win; ``--hspmd-slurm off`` ignores Slurm);
* bad input prints one line, ``hspmd-launch: error: ...`` naming the bad value and what would be
  valid, and exits 2; runtime errors (etcd unreachable, rendezvous timeout) print one line and
  exit 1; failed workers exit 1 after the failure summary; never a traceback.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import signal as _signal
import socket
import sys
import uuid
from typing import Optional, Sequence

import click

from hspmd_elastic.contract.env import HangRule
from hspmd_elastic.contract.ids import ID_RULE, is_id
from hspmd_elastic.coord.client import format_endpoint, parse_endpoints
from launcher.api import (
    DEFAULT_ROLE,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_SIGNALS,
    EXIT_FAILED,
    EXIT_USAGE,
    ConfigError,
    ElasticSettings,
    LaunchConfig,
    LaunchError,
    LogSettings,
    RendezvousSettings,
)
from launcher.capacity import CAPACITY_FLAGS, capacity_settings
from launcher.health.api import HealthError, parse_health_source
from launcher.etcd_security import launcher_options, launcher_security, server_tls
from launcher.logs import check_log_dir, parse_ranks_filter, parse_std
from launcher.model_flag import parse_model
from launcher.placement import device_env
from launcher.numbers import check, number, shutdown_timeout_from_env
from launcher.planning_flags import planning_options
from launcher.slurm import SETTINGS as SLURM_SETTINGS, fill_from_slurm

log = logging.getLogger("launcher")

PROG = "hspmd-launch"
# Subcommands, imported only when used: name -> "module:click_command". A name whose module is
# not installed yet answers with one line instead of running a script of that name.
SUBCOMMANDS: dict[str, str] = {
    "status": "launcher.ops.commands:status",
    "dashboard": "launcher.ops.commands:dashboard",
    "inject": "launcher.inject.command:command",
    "plan": "launcher.plan_cmd:plan_command",
}
ETCD_BACKENDS = ("etcd", "etcd-v2")
KNOWN_BACKENDS = ("etcd", "etcd-v2", "c10d", "static")
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
RDZV_CONF_FLOATS = {
    "join_timeout": "join_timeout_s",
    "last_call_timeout": "last_call_timeout_s",
    "close_timeout": "close_timeout_s",
    "exit_barrier_timeout": "exit_barrier_timeout_s",
    "lease_ttl": "lease_ttl_s",
}
RDZV_CONF_IGNORED = ("timeout", "read_timeout", "is_host", "keep_alive_interval",
                     "keep_alive_max_attempt", "heartbeat", "protocol", "cacert", "cert", "key",
                     "etcd_prefix", "use_libuv")


def _opt(*names: str, **kw):
    """A torchrun flag: ``--a-b`` and ``--a_b`` spellings, ``PET_A_B`` from the environment."""
    longs = [n for n in names if n.startswith("--")]
    dest = longs[0][2:].replace("-", "_")
    spellings = list(names)
    for n in longs:
        alt = "--" + n[2:].replace("-", "_")
        if alt not in spellings:
            spellings.append(alt)
    kw.setdefault("envvar", f"PET_{dest.upper()}")
    kw.setdefault("show_envvar", False)
    return click.option(*spellings, dest, **kw)


class _LaunchCommand(click.Command):
    """Parsing, then the flags not given from Slurm's environment under srun."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        fill_from_slurm(ctx, os.environ)
        return rest


@click.command(
    cls=_LaunchCommand,
    name=PROG,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    epilog="Subcommands: " + ", ".join(SUBCOMMANDS) + " (hspmd-launch <name> --help). "
           "Use 'hspmd-launch -- <script>' to run a script named like a subcommand.",
)
@_opt("--nnodes", default="1:1", show_default=True, help="N or MIN:MAX nodes.")
@_opt("--nproc-per-node", default="1", show_default=True,
      help="Workers per node: an integer, auto, cpu, gpu or xpu.")
@_opt("--rdzv-backend", default="static", show_default=True,
      help="etcd (etcd v3); etcd-v2, c10d and static are mapped onto it (see docs).")
@_opt("--rdzv-endpoint", default="",
      help="etcd endpoint(s) host:port[,host:port...]; IPv6 in brackets: [::1]:2379.")
@_opt("--rdzv-id", default="none", show_default=True, help="Job id shared by all nodes.")
@_opt("--rdzv-conf", default="", help="k=v,... : join_timeout, last_call_timeout, "
      "close_timeout, exit_barrier_timeout, lease_ttl (seconds, each finite and in its range: "
      "docs/operations.md).")
@_opt("--standalone", is_flag=True, help="Run an embedded single-member etcd (single node; "
      "not with --hspmd-etcd-endpoints).")
@_opt("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True)
@_opt("--monitor-interval", type=number("--monitor-interval"), default=0.1, show_default=True,
      help="Seconds between checks of the workers (> 0, at most 3600).")
@_opt("--start-method", type=click.Choice(["spawn", "fork", "forkserver"]), default="spawn",
      show_default=True, help="Accepted for compatibility: workers are always new processes.")
@_opt("--event-log-handler", default="null", hidden=True)
@_opt("--role", default=DEFAULT_ROLE, show_default=True)
@_opt("-m", "--module", is_flag=True, help="Run the script as a module (python -m).")
@_opt("--no-python", is_flag=True, help="Execute the script directly, without python (a "
      "program on PATH, or the path of an executable file).")
@_opt("--run-path", is_flag=True, help="Run the script with runpy.run_path (not with -m or "
      "--no-python).")
@_opt("--log-dir", default=None)
@_opt("-r", "--redirects", default="0", show_default=True,
      help="Redirect std streams to files: 0-3 or per rank, e.g. 0:3,1:1.")
@_opt("-t", "--tee", default="0", show_default=True, help="Tee std streams to files and console.")
@_opt("--local-ranks-filter", default="", help="Only show these local ranks on the console.")
@_opt("--duplicate-stdout-filters", default="", hidden=True)
@_opt("--duplicate-stderr-filters", default="", hidden=True)
@_opt("--node-rank", type=click.IntRange(min=0), default=None,
      help="Order of this node in the job (default: join order).")
@_opt("--master-addr", default="127.0.0.1", show_default=True,
      help="static backend: address of rank 0.")
@_opt("--master-port", type=click.IntRange(0, 65535), default=None,
      help="static backend: port of rank 0's store.")
@_opt("--local-addr", default=None, help="Address other nodes reach this node at.")
@_opt("--logs-specs", default=None, hidden=True)
@_opt("--numa-binding", default=None, hidden=True)
@_opt("--signals-to-handle", default=DEFAULT_SIGNALS, show_default=True)
@_opt("--shutdown-timeout", type=number("--shutdown-timeout"), default=None,
      help="Seconds between SIGTERM and SIGKILL when stopping workers (0..3600; default "
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30).")
@_opt("--virtual-local-rank", is_flag=True, hidden=True)
@_opt("--hspmd-node-id", default=None,
            help="This agent's node id (default <hostname>-<pid>); lets several agents on one "
                 "host act as separate nodes.")
@_opt("--hspmd-etcd-endpoints", default=None,
            help="etcd endpoints for coordination, host:port[,...] or [ipv6]:port "
                 "(overrides --rdzv-endpoint).")
@_opt("--hspmd-health-source", default="auto", show_default=True,
            help="Where GPU verdicts come from: auto (NVML when the NVIDIA driver loads, "
                 "otherwise none, said once in the log), nvml, none, scripted:<file> or "
                 "scripted:etcd. In restart mode a GPU with a fatal verdict makes the job "
                 "restart without it (fewer workers, CUDA_VISIBLE_DEVICES and WORLD_SIZE "
                 "follow); a script that calls hspmd_elastic.heartbeat(step) each step is "
                 f"also watched for hangs ({', '.join(HangRule.variables())}).")
@_opt("--hspmd-lease-ttl", type=number("--hspmd-lease-ttl"), default=None,
            help="TTL of the node's etcd lease in seconds (1..3600, default 10).")
@_opt("--hspmd-etcd-outage-limit", type=number("--hspmd-etcd-outage-limit"), default=None,
            help="Seconds the workers keep running while etcd cannot be reached (1..86400, "
                 "default 120; at least 3 lease TTLs): training does not need etcd; past the limit "
                 "the agent stops its workers and exits 1 naming the outage.")
@_opt("--hspmd-elastic", is_flag=True,
            help="Live elasticity for hspmd-aware scripts (hspmd_elastic.runtime): a worker "
                 "failure, node loss or join makes the elected leader publish a new plan and "
                 "the surviving workers switch to it in memory (no restart, no checkpoint "
                 "read); the agent starts workers only for devices a plan adds. Needs "
                 "--hspmd-model and --hspmd-global-batch.")
@_opt("--hspmd-model", default=None,
            help="Elastic mode: the model the leader plans for: a ModelConfig JSON file (the "
                 "one the script trains; plans are checked against it), an inline JSON object, "
                 "a preset (llama-7b, llama-13b, llama-32b), or a Hugging Face checkpoint "
                 "directory (holding config.json; needs --hspmd-seq-len).")
@_opt("--hspmd-seq-len", type=number("--hspmd-seq-len"), default=None,
            help="Elastic mode, with a checkpoint directory as --hspmd-model: the training "
                 "sequence length (config.json does not hold it; the script's --seq-len).")
@_opt("--hspmd-global-batch", type=int, default=None,
            help="Elastic mode: rows per training step, the same under every plan.")
@_opt("--hspmd-debounce", type=number("--hspmd-debounce"), default=None,
            help="Elastic mode: seconds the leader waits for the cluster to settle before it "
                 "replans (0..60, default 0.25): longer folds a burst of failures into one switch, "
                 "shorter recovers sooner.")
@planning_options(_opt)
@_opt("--hspmd-slurm", type=click.Choice(SLURM_SETTINGS, case_sensitive=False), default="auto",
      show_default=True, help="auto: under srun (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_PROCID "
      "set), flags not given come from Slurm: node id and rank, --nnodes, --nproc-per-node, "
      "--rdzv-id, the rendezvous (flags and PET_* win); off: ignore Slurm's environment.")
@launcher_options
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(**params) -> int:
    """Start the node agent: rendezvous through etcd, then run NPROC_PER_NODE workers of
    TRAINING_SCRIPT with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    config = build_config(params)
    from launcher.node.launch import launch  # startup: keeps --help and usage errors fast

    return launch(config)


# ------------------------------------------------------------------------------ config building
def parse_nnodes(value: str) -> tuple[int, int]:
    parts = str(value).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError(value)
    except ValueError:
        raise ConfigError(f"invalid --nnodes value {value!r}: use N or MIN:MAX") from None
    if not 0 < lo <= hi:
        raise ConfigError(
            f"invalid --nnodes value {value!r}: need 0 < MIN <= MAX (got min={lo}, max={hi})"
        )
    return lo, hi


def resolve_nproc(value: str) -> int:
    text = str(value).strip()
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is not None:
        if n < 1:
            raise ConfigError(f"invalid --nproc-per-node value {value!r}: must be >= 1")
        return n
    if text not in NPROC_WORDS:
        raise ConfigError(
            f"invalid --nproc-per-node value {value!r}: use a positive integer or one of "
            + ", ".join(NPROC_WORDS)
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if text == "cpu":
        return cpus or 1
    import torch  # torch: only for accelerator counts

    if text == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc-per-node gpu: CUDA is not available on this node")
        return torch.cuda.device_count()
    if text == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise ConfigError("--nproc-per-node xpu: XPU is not available on this node")
        return torch.xpu.device_count()
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.device_count()
    return cpus or 1


def parse_rdzv_conf(value: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if not value:
        return out
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"invalid --rdzv-conf entry {item!r}: use key=value[,key=value]")
        if key in RDZV_CONF_FLOATS:
            out[RDZV_CONF_FLOATS[key]] = check(key, val, f"--rdzv-conf {key}={val.strip()!r}")
        elif key in RDZV_CONF_IGNORED:
            log.info("--rdzv-conf %s is not used by the etcd rendezvous; ignored", key)
        else:
            raise ConfigError(
                f"unknown --rdzv-conf key {key!r}: use " + ", ".join(RDZV_CONF_FLOATS)
            )
    return out


def _endpoints(spec: str, flag: str) -> tuple[str, ...]:
    try:  # an IPv6 host keeps its brackets: [::1]:2379
        return tuple(format_endpoint(h, p) for h, p in parse_endpoints(spec))
    except ValueError as exc:
        raise ConfigError(f"invalid {flag} value {spec!r}: {exc}") from None


def _entrypoint(params: dict) -> tuple[tuple[str, ...], str]:
    script, args = params["training_script"], list(params["training_script_args"])
    if params["run_path"]:
        for flag, other in (("--module", "module"), ("--no-python", "no_python")):
            if params[other]:
                raise ConfigError(f"--run-path and {flag} cannot be used together (--run-path "
                                  "runs the script file with runpy.run_path)")
        if not os.path.isfile(script):
            raise ConfigError(f"training script {script!r} does not exist")
        code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        return (sys.executable, "-u", "-c", code, script, *args), script
    if params["no_python"]:
        if params["module"]:
            raise ConfigError("--no-python and --module cannot be used together")
        _check_program(script)
        return (script, *args), script
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if params["module"]:
        return (python, "-u", "-m", script, *args), script
    if not os.path.isfile(script):
        raise ConfigError(f"training script {script!r} does not exist")
    return (python, "-u", script, *args), script


def _check_program(program: str) -> None:
    """``--no-python``: ``program`` is what ``execvp`` will run: a name found on PATH, or a
    path (with a ``/``) to an executable file."""
    if os.sep not in program:
        if shutil.which(program):
            return
        here = (f"; to run the file here use ./{program}" if os.path.isfile(program) else "")
        raise ConfigError(f"program {program!r} is not on PATH (--no-python runs it "
                          f"directly){here}")
    if not os.path.isfile(program):
        raise ConfigError(f"program {program!r} does not exist (--no-python runs it directly)")
    if not os.access(program, os.X_OK):
        raise ConfigError(f"program {program!r} is not executable (--no-python runs it "
                          "directly: chmod +x it, or leave out --no-python)")


def _check_id(flag: str, value: str) -> str:
    if not is_id(value):
        raise ConfigError(f"invalid {flag} value {value!r}: use {ID_RULE}")
    return value


def default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._") or "node"
    return f"{host[:100]}-{os.getpid()}"


def _rendezvous(params: dict, min_nodes: int, max_nodes: int) -> RendezvousSettings:
    backend = params["rdzv_backend"].strip().lower()
    endpoint = params["rdzv_endpoint"].strip()
    run_id = params["rdzv_id"]
    standalone = bool(params["standalone"])
    if standalone and params["hspmd_etcd_endpoints"]:
        raise ConfigError(f"--standalone runs its own embedded etcd: --hspmd-etcd-endpoints "
                          f"{params['hspmd_etcd_endpoints']!r} cannot be used with it (leave "
                          "out one of them)")
    if backend not in KNOWN_BACKENDS:
        raise ConfigError(
            f"unknown --rdzv-backend {backend!r}: use etcd (also accepted: "
            + ", ".join(b for b in KNOWN_BACKENDS if b != "etcd") + ")"
        )
    if standalone or (backend == "static" and not endpoint and params["master_port"] is None
                      and max_nodes == 1):
        run_id = str(uuid.uuid4())  # torchrun: a standalone job gets a fresh id
    # A single node needs no shared store: torchrun's static and c10d backends then run
    # standalone here, on an embedded etcd.
    standalone = standalone or (backend in ("static", "c10d") and max_nodes == 1)
    if standalone and params["hspmd_etcd_endpoints"]:
        raise ConfigError(f"--rdzv-backend {backend} with one node runs an embedded etcd: "
                          f"--hspmd-etcd-endpoints {params['hspmd_etcd_endpoints']!r} would be "
                          "ignored (use --rdzv-backend etcd to meet at that etcd)")
    host_etcd = False
    node_rank = params["node_rank"]
    if standalone:
        endpoints: tuple[str, ...] = ()
    elif params["hspmd_etcd_endpoints"]:
        endpoints = _endpoints(params["hspmd_etcd_endpoints"], "--hspmd-etcd-endpoints")
    elif backend == "static":
        # torchrun: node rank 0 serves the store at --master-addr:--master-port; so here.
        spec = endpoint or f"{params['master_addr']}:{params['master_port'] or 29500}"
        endpoints = _endpoints(spec, "--rdzv-endpoint")
        node_rank = node_rank or 0
        host_etcd = node_rank == 0
    else:
        if not endpoint:
            raise ConfigError(
                f"--rdzv-backend {backend} needs --rdzv-endpoint <host:port[,...]> "
                "(or --standalone for a single node)"
            )
        if backend == "c10d" and ":" not in endpoint:
            endpoint += ":29400"  # torchrun's default c10d port
        endpoints = _endpoints(endpoint, "--rdzv-endpoint")
        # c10d: the node at the endpoint serves the store (an etcd here), unless one runs there
        host_etcd = backend == "c10d" and len(endpoints) == 1
    _check_id("--rdzv-id", run_id)
    conf = parse_rdzv_conf(params["rdzv_conf"])
    if params["hspmd_lease_ttl"] is not None:
        conf["lease_ttl_s"] = params["hspmd_lease_ttl"]
    if params["hspmd_etcd_outage_limit"] is not None:
        conf["etcd_outage_limit_s"] = params["hspmd_etcd_outage_limit"]
    return RendezvousSettings(
        backend=backend, endpoints=endpoints, run_id=run_id, min_nodes=min_nodes,
        max_nodes=max_nodes, node_rank=node_rank, standalone=standalone, host_etcd=host_etcd,
        **conf,
    )


def build_config(params: dict) -> LaunchConfig:
    """Validate flags into a LaunchConfig; ConfigError names the first bad value."""
    min_nodes, max_nodes = parse_nnodes(params["nnodes"])
    nproc = resolve_nproc(params["nproc_per_node"])
    rdzv = _rendezvous(params, min_nodes, max_nodes)
    entrypoint, name = _entrypoint(params)
    red_default, red_map = parse_std("--redirects", params["redirects"])
    tee_default, tee_map = parse_std("--tee", params["tee"])
    logs = LogSettings(
        log_dir=check_log_dir(params["log_dir"]), redirects=red_map, redirects_default=red_default,
        tee=tee_map, tee_default=tee_default,
        local_ranks_filter=parse_ranks_filter(params["local_ranks_filter"]),
    )
    node_id = _check_id("--hspmd-node-id", params["hspmd_node_id"] or default_node_id())
    health = _health_source(params["hspmd_health_source"])
    signals = _signals(params["signals_to_handle"])
    # MASTER_ADDR/PORT: torchrun's static backend fixes them; on several nodes the port serves
    # the rendezvous etcd, so the workers' store takes a free port on that address.
    static = params["rdzv_backend"].strip().lower() == "static"
    fixed = params["master_port"] is not None and (rdzv.standalone or static)
    master_addr = params["master_addr"] if fixed or (static and not rdzv.standalone) else None
    master_port = params["master_port"] if fixed and rdzv.standalone else None
    timeout = params["shutdown_timeout"]
    if timeout is None:
        timeout = shutdown_timeout_from_env(os.environ, DEFAULT_SHUTDOWN_TIMEOUT_S)
    elastic = _elastic(params, max_nodes)

    return LaunchConfig(
        rdzv=rdzv, nproc_per_node=nproc, entrypoint=entrypoint, entrypoint_name=name,
        node_id=node_id, role=params["role"], max_restarts=params["max_restarts"],
        monitor_interval_s=params["monitor_interval"], local_addr=params["local_addr"],
        master_addr=master_addr, master_port=master_port, logs=logs, shutdown_timeout_s=timeout,
        signals=signals, health_source=health, elastic=elastic, extra_env=device_env(params),
        etcd=launcher_security(params), etcd_server=server_tls(params, rdzv),
    )


def _elastic(params: dict, max_nodes: int) -> Optional[ElasticSettings]:
    model, batch = params["hspmd_model"], params["hspmd_global_batch"]
    if not params["hspmd_elastic"]:
        for flag, given in (("--hspmd-model", model), ("--hspmd-global-batch", batch),
                            ("--hspmd-debounce", params["hspmd_debounce"]),
                            ("--hspmd-seq-len", params["hspmd_seq_len"]),
                            *((f"--{k.replace('_', '-')}", params[k]) for k in CAPACITY_FLAGS)):
            if given is not None:
                raise ConfigError(f"{flag} {given} is only used with --hspmd-elastic")
        return None
    if model is None or batch is None:
        missing = [f for f, v in (("--hspmd-model", model), ("--hspmd-global-batch", batch))
                   if v is None]
        raise ConfigError(f"--hspmd-elastic needs {' and '.join(missing)} (what the leader "
                          "plans for)")
    if batch < 1:
        raise ConfigError(f"invalid --hspmd-global-batch value {batch}: must be >= 1")
    check("--hspmd-global-batch", batch)  # the upper bound (MAX_ROWS)
    debounce = params["hspmd_debounce"]  # in range: its click type (launcher.numbers)
    if params["max_restarts"]:
        log.info("--max-restarts %d is not used with --hspmd-elastic: surviving workers are "
                 "never restarted", params["max_restarts"])
    extra = {} if debounce is None else {"debounce_s": debounce}
    return ElasticSettings(model_profile=parse_model(model, params["hspmd_seq_len"]),
                           global_batch=batch,
                           model_spec=str(model), **extra, **capacity_settings(params, max_nodes))


def _health_source(value: str) -> str:
    """``--hspmd-health-source``: auto, nvml, none, scripted:<file> or scripted:etcd."""
    from launcher.health.progress import hang_detector_from_env  # startup

    try:
        kind, target = parse_health_source(value)
    except HealthError as exc:
        raise ConfigError(f"invalid --hspmd-health-source: {exc}") from None
    try:
        hang_detector_from_env(os.environ)  # HangRule: refused here, not in the agent
    except HealthError as exc:
        raise ConfigError(f"invalid hang limit: {exc}") from None
    if kind == "scripted" and target != "etcd" and not os.path.isfile(target):
        raise ConfigError(f"invalid --hspmd-health-source {value!r}: fault script {target!r} "
                          "is not a readable file")
    return value.strip()


def _signals(value: str) -> tuple[str, ...]:
    names = tuple(s.strip().upper() for s in value.split(",") if s.strip())
    for name in names:
        if not hasattr(_signal, name) or not name.startswith("SIG"):
            raise ConfigError(
                f"invalid --signals-to-handle entry {name!r}: use signal names like SIGTERM"
            )
    return names


# ---------------------------------------------------------------------------------- entry point
def _run_subcommand(name: str, args: list[str]) -> int:
    module_name, _, attr = SUBCOMMANDS[name].partition(":")
    try:
        command = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:
        if not module_name.startswith(exc.name or "\0"):
            raise  # the subcommand's module exists but one of its imports is missing
        command = None
    except AttributeError:
        command = None
    if not isinstance(command, click.Command):
        _error(f"subcommand {name!r} is not available in this installation "
               f"(to run a script named {name!r}: {PROG} -- {name})")
        return EXIT_USAGE
    return _invoke(command, args, f"{PROG} {name}")


def _invoke(command: click.Command, args: list[str], prog: str) -> int:
    try:
        rv = command.main(args=args, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help
        return exc.exit_code
    except click.Abort:
        _error("aborted")
        return EXIT_FAILED
    except click.ClickException as exc:
        _error(exc.format_message().replace("\n", " "))
        return exc.exit_code
    except LaunchError as exc:
        _error(str(exc))
        return exc.exit_code
    return rv if isinstance(rv, int) else 0


def _error(line: str) -> None:
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)


def _setup_logging() -> None:
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s", "%m%d %H:%M:%S"))
    root = logging.getLogger("launcher")
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level, logging.INFO))
    root.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script entry; returns (and exits with) the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    _setup_logging()
    if args and args[0] in SUBCOMMANDS and not os.path.exists(args[0]):
        code = _run_subcommand(args[0], args[1:])
    else:
        code = _invoke(launch_command, args, PROG)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
