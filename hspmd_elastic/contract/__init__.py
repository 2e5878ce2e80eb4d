"""The one home of the formats that cross processes: what one process writes and another reads.

Each format is defined here once, and its writers and readers on both planes (the node agent,
the leader, the ops and inject tools, the worker runtime, ``hspmd_elastic.heartbeat``) use it:

* ``ids``: the id rule (job and node ids) and device ids (``<node_id>:<index>``);
* ``keys``, ``records``, ``events`` and ``schema``: the etcd key schema (one builder per key),
  its records (``NodeState``, ``VerdictOrigin``...), the event journal's typed details (one
  dataclass per event type, ``switch_of`` the one switch-pairing reader), and the registry and
  codec that tie keys to records (``from hspmd_elastic.contract import schema`` gives all four);
* ``errors``: ``CoordinationError`` and ``RecordError``;
* ``env``: every ``HSPMD_*`` environment variable: ``WorkerEnv`` (what an agent sets for its
  workers, ``to_env`` / ``from_env``), ``HangRule`` (the agent's ``HSPMD_HANG_*``),
  ``EtcdRestartEnv`` and the names of the other settings;
* ``progress``: the worker states and the progress file a worker writes and its agent reads;
* ``text``: the one escaping rule for text from etcd or another process shown in a log or on a
  terminal.

``hspmd_elastic.coord`` is the etcd transport that carries these records; it holds no format.

Promise: torch-free and etcd-free. Importing this package imports neither ``torch`` nor
``etcd3`` nor ``grpc`` (nor ``hspmd_elastic.coord``, whose package imports the etcd client), so
any process, a torchrun-style training script included, can use it at no cost.
"""

from hspmd_elastic.contract.env import (
    DEVICE_ENV,
    DEVICE_SETTINGS,
    ETCD_ENDPOINTS_ENV,
    JOB_ID_ENV,
    NODE_ID_ENV,
    PLAN_VERSION_ENV,
    PROGRESS_FILE_ENV,
    ROUND_ENV,
    EnvError,
    EtcdRestartEnv,
    HangRule,
    WorkerEnv,
    parse_device_setting,
)
from hspmd_elastic.contract.ids import (
    ID_PATTERN,
    ID_RE,
    ID_RULE,
    IdError,
    check_id,
    device_id,
    device_sort_key,
    is_id,
    node_of,
    parse_device_id,
)
from hspmd_elastic.contract.progress import (
    DONE_STATES,
    LEFT_STATES,
    TRAINED_STATES,
    WorkerProgress,
    WorkerState,
    progress_from_dict,
    read_progress,
    write_progress,
)
from hspmd_elastic.contract.text import bounded, escape, first_line

__all__ = [
    "DEVICE_ENV", "DEVICE_SETTINGS", "ETCD_ENDPOINTS_ENV", "JOB_ID_ENV", "NODE_ID_ENV",
    "PLAN_VERSION_ENV", "PROGRESS_FILE_ENV", "ROUND_ENV", "EnvError", "EtcdRestartEnv",
    "HangRule", "WorkerEnv", "parse_device_setting",
    "ID_PATTERN", "ID_RE", "ID_RULE", "IdError", "check_id", "device_id", "device_sort_key",
    "is_id", "node_of", "parse_device_id",
    "DONE_STATES", "LEFT_STATES", "TRAINED_STATES", "WorkerProgress", "WorkerState",
    "progress_from_dict", "read_progress", "write_progress",
    "bounded", "escape", "first_line",
]
