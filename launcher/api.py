"""The launcher's vocabulary: launch configuration, worker identity and errors.

A reader learns ``launcher`` (the ``hspmd-launch`` control plane) from this file. Promises:

* ``LaunchConfig`` is the whole, validated input of one node agent; the CLI builds it and nothing
  else reads command-line flags or ``PET_*`` variables;
* every failure the launcher reports is a ``LaunchError`` subclass carrying one line for the user
  (the CLI prints ``hspmd-launch: error: <line>``, never a traceback);
* exit codes follow torchrun: 0 success, 1 workers failed (after the last restart), a signal or a
  runtime error, 2 usage errors.

The node agent's own vocabulary (modes, their outcomes and context) is ``launcher.node.api``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hspmd_elastic.coord.security import EtcdSecurity

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_ROLE = "default"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30 s
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


# --------------------------------------------------------------------------------------- errors
class LaunchError(Exception):
    """Root of the launcher's errors; ``str(err)`` is the one line shown to the user."""

    exit_code = EXIT_FAILED


class ConfigError(LaunchError):
    """A flag value is invalid (names the value and what would be valid)."""

    exit_code = EXIT_USAGE


class RendezvousError(LaunchError):
    """The job's rendezvous could not complete."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous backend (etcd) cannot be reached."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes joined before the join timeout."""


class RendezvousClosedError(RendezvousError):
    """The job already ended (failed or succeeded); no new round can be joined."""


class WorkerSpawnError(LaunchError):
    """A worker process could not be started (names the command and the OS error)."""


class SignalReceived(LaunchError):
    """The agent received a signal it handles (like torchrun's SignalException)."""

    def __init__(self, signum: int, name: str):
        self.signum = signum
        super().__init__(f"process got signal: {signum} ({name})")


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class RendezvousSettings:
    """Where and how the nodes of a job meet (``--rdzv-*`` flags, ``--rdzv-conf`` keys)."""

    backend: str  # as spelled on the command line; every backend is served by etcd
    endpoints: tuple[str, ...]  # etcd client endpoints host:port
    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout_s: float = 600.0  # torchrun's default
    last_call_timeout_s: float = 30.0  # torchrun's default
    close_timeout_s: float = 60.0
    lease_ttl_s: float = 10.0
    etcd_outage_limit_s: float = 120.0  # --hspmd-etcd-outage-limit (launcher.node.outage)
    exit_barrier_timeout_s: float = 300.0  # torchrun agent's default
    node_rank: Optional[int] = None  # --node-rank when given: orders nodes in a round
    standalone: bool = False  # the agent runs the embedded etcd
    host_etcd: bool = False  # c10d/static: this node may serve the store (etcd) at endpoints[0]


@dataclass(frozen=True)
class LogSettings:
    """``--log-dir``, ``--redirects``, ``--tee`` and ``--local-ranks-filter``.

    ``redirects``/``tee`` map local rank -> bitmask (1 stdout, 2 stderr), as torchrun's ``Std``.
    A missing rank means 0; ``default`` applies to ranks not in the map.
    """

    log_dir: Optional[str] = None
    redirects: dict[int, int] = field(default_factory=dict)
    redirects_default: int = 0
    tee: dict[int, int] = field(default_factory=dict)
    tee_default: int = 0
    local_ranks_filter: Optional[frozenset[int]] = None

    def redirect_of(self, local_rank: int) -> int:
        return self.redirects.get(local_rank, self.redirects_default)

    def tee_of(self, local_rank: int) -> int:
        return self.tee.get(local_rank, self.tee_default)


@dataclass(frozen=True)
class ElasticSettings:
    """``--hspmd-elastic``: what the leader plans for. ``model_profile`` is a
    ``hspmd_elastic.planner.ModelProfile`` (from ``--hspmd-model``; when it comes from a
    ``ModelConfig`` JSON the planner checks its plans against that model), ``global_batch`` the
    rows of every step (``--hspmd-global-batch``), the same whatever the plan; the declared
    capacity and the redundancy guarantee come from ``launcher.capacity``."""

    model_profile: Any
    global_batch: int
    model_spec: str = ""  # the --hspmd-model value, for messages
    # The leader waits this long for the cluster to settle before it replans. Short: a worker
    # kill is one event, and a burst that outlasts the window is still handled (the switch
    # follows the newest plan), so a short window costs at most an extra switch.
    debounce_s: float = 0.25
    # What this node declares its devices to be (``launcher.capacity``): memory in bytes (0: the
    # device's own, or its type's) and speed relative to the type's nominal.
    device_memory_bytes: int = 0
    device_speed: float = 1.0
    enforce_memory: bool = False  # --hspmd-enforce-memory: a memory cgroup per worker
    redundancy: int = 0  # every parameter slice on this many nodes, a hard constraint (0: none)
    planner: str = "hetero"  # --hspmd-planner: hetero (HSPMD) or uniform (one TP/PP everywhere)
    # --hspmd-all-devices: every usable worker gets a role, even one the planner would leave idle
    all_devices: bool = False
    # --hspmd-straggler-replans: the leader replans on measured speeds (launcher.leader.speeds)
    straggler_replans: bool = True
    straggler_dwell_s: float = 30.0  # --hspmd-straggler-dwell: seconds between such switches
    # --hspmd-lengths: length buckets as (longest sequence, share), shortest first; each plan
    # then runs each bucket's rows under the bucket's plan inside the step (graph.bucketed)
    lengths: tuple[tuple[int, float], ...] = ()
    # --hspmd-optimizer-shards: every published plan's Plan.optimizer_shards, and the planner's
    # cost model's (PlannerOptions.optimizer_shards)
    optimizer_shards: str = "replicated"
    # --hspmd-device-types: device types (planner.DeviceSpec) measured on the job's machines,
    # registered in the agent before its leader plans (planner.register_device_type)
    device_types: tuple = ()

    def __post_init__(self) -> None:
        seq_len = getattr(self.model_profile, "seq_len", None)
        if self.lengths and seq_len is not None and self.lengths[-1][0] != seq_len:
            raise ConfigError(f"invalid --hspmd-lengths: the longest bucket "
                              f"({self.lengths[-1][0]} tokens) must be the model's sequence "
                              f"length {seq_len}: every sequence needs a bucket")


@dataclass(frozen=True)
class EtcdServerTLS:
    """TLS of an etcd the agent runs itself (``--hspmd-etcd-server-cert`` / ``-key``); with
    ``client_ca_file`` (``--hspmd-etcd-cacert``) clients must show a certificate it signed."""

    cert_file: str
    key_file: str
    client_ca_file: Optional[str] = None


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one node agent needs, validated."""

    rdzv: RendezvousSettings
    nproc_per_node: int
    entrypoint: tuple[str, ...]  # the command every worker runs (python -u script.py args...)
    entrypoint_name: str  # shown in the failure summary title (``<script> FAILED``)
    node_id: str
    role: str = DEFAULT_ROLE
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    local_addr: Optional[str] = None
    master_addr: Optional[str] = None  # static backend: fixed master address
    master_port: Optional[int] = None  # static backend: fixed master port
    logs: LogSettings = field(default_factory=LogSettings)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    signals: tuple[str, ...] = tuple(DEFAULT_SIGNALS.split(","))
    health_source: str = "auto"  # launcher.health.select_health_source
    extra_env: dict[str, str] = field(default_factory=dict)
    elastic: Optional[ElasticSettings] = None  # None: restart mode (torchrun's semantics)
    etcd: EtcdSecurity = field(default_factory=EtcdSecurity)  # --hspmd-etcd-cacert, -user...
    etcd_server: Optional[EtcdServerTLS] = None  # TLS of the etcd this agent runs, if any


# ------------------------------------------------------------------------------ worker identity
@dataclass(frozen=True)
class RankAssignment:
    """Ranks of one node's workers in a closed round (torchrun's meaning of each variable)."""

    group_rank: int
    group_world_size: int
    local_world_size: int
    base_global_rank: int  # global rank of local rank 0
    world_size: int
    role_base_rank: int
    role_world_size: int

    def global_rank(self, local_rank: int) -> int:
        return self.base_global_rank + local_rank

    def role_rank(self, local_rank: int) -> int:
        return self.role_base_rank + local_rank
