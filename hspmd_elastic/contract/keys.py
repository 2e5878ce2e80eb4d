"""Key builders of the etcd schema: every key a job writes, under ``/hspmd/v1/jobs/<job_id>/``.

Pure string functions, no I/O. Node ids and job ids are checked (the id rule of
``hspmd_elastic.contract.ids``: 1-128 characters from ``[A-Za-z0-9._-]``, starting with a
letter or digit); versions, sequence numbers and rounds are
zero-padded to ``PAD`` digits, so keys sort in numeric order. ``contract.schema`` re-exports them.
"""

from __future__ import annotations

from typing import Optional

from hspmd_elastic.contract.ids import ID_RE, check_id  # noqa: F401 (ID_RE: re-exported)

ROOT = "/hspmd/v1/jobs/"
PAD = 12  # digits of zero-padded versions and sequence numbers in keys


def _ident(what: str, value: str) -> str:
    return check_id(value, what)


def _number(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _padded(what: str, value: int) -> str:
    if _number(what, value) >= 10**PAD:
        raise ValueError(f"{what} {value} does not fit in {PAD} digits")
    return f"{value:0{PAD}d}"


def job_prefix(job: str) -> str:
    """``/hspmd/v1/jobs/<job_id>/``: everything a job writes lives under it."""
    return f"{ROOT}{_ident('job id', job)}/"


def nodes_prefix(job: str) -> str:
    return job_prefix(job) + "nodes/"


def node_key(job: str, node: str) -> str:
    return nodes_prefix(job) + _ident("node id", node)


def claims_prefix(job: str) -> str:
    """Node-id claims: one live agent owns a node id (its lease), in one mode."""
    return job_prefix(job) + "claims/"


def claim_key(job: str, node: str) -> str:
    return claims_prefix(job) + _ident("node id", node)


def devices_prefix(job: str, node: Optional[str] = None) -> str:
    base = job_prefix(job) + "devices/"
    return base if node is None else f"{base}{_ident('node id', node)}/"


def device_key(job: str, node: str, index: int) -> str:
    return f"{devices_prefix(job, node)}{_number('device index', index)}"


def workers_prefix(job: str, node: Optional[str] = None) -> str:
    base = job_prefix(job) + "workers/"
    return base if node is None else f"{base}{_ident('node id', node)}/"


def worker_key(job: str, node: str, local_rank: int) -> str:
    return f"{workers_prefix(job, node)}{_number('local rank', local_rank)}"


def reach_prefix(job: str) -> str:
    return f"{job_prefix(job)}reach/"


def reach_key(job: str, node: str) -> str:
    return f"{reach_prefix(job)}{_ident('node_id', node)}"


def retry_prefix(job: str) -> str:
    return f"{job_prefix(job)}retry/"


def retry_key(job: str, node: str) -> str:
    return f"{retry_prefix(job)}{_ident('node_id', node)}"


def leader_key(job: str) -> str:
    return job_prefix(job) + "leader"


def election_prefix(job: str) -> str:
    return job_prefix(job) + "election/"


def election_key(job: str, lease_id: int) -> str:
    """A candidate's key: named by its lease (16 hex digits), bound to that lease."""
    return f"{election_prefix(job)}{_number('lease id', lease_id):016x}"


def plan_current_key(job: str) -> str:
    return job_prefix(job) + "plan/current"


def plan_head_key(job: str) -> str:
    """The current plan's head: what a node agent needs of it, written with ``plan/current``."""
    return job_prefix(job) + "plan/head"


def plan_stamp_key(job: str) -> str:
    """The current plan's version and digests: what every worker watches, written with
    ``plan/current``."""
    return job_prefix(job) + "plan/stamp"


def plan_layout_key(job: str) -> str:
    """What a worker's switch needs of the current plan, written with ``plan/current``."""
    return job_prefix(job) + "plan/layout"


def plan_history_prefix(job: str) -> str:
    return job_prefix(job) + "plan/history/"


def plan_history_key(job: str, version: int) -> str:
    return plan_history_prefix(job) + _padded("plan version", version)


def events_prefix(job: str) -> str:
    return job_prefix(job) + "events/"


def event_key(job: str, seq: int) -> str:
    return events_prefix(job) + _padded("event seq", seq)


def event_seq_key(job: str) -> str:
    """Counter holding the last allocated event sequence number."""
    return job_prefix(job) + "event_seq"


def fault_script_key(job: str, node: str) -> str:
    """A node's scripted device faults (fault drills), read by the ``scripted:etcd`` source."""
    return f"{job_prefix(job)}faults/{_ident('node id', node)}"


def switch_prefix(job: str, version: Optional[int] = None) -> str:
    base = job_prefix(job) + "switch/"
    return base if version is None else f"{base}{_padded('plan version', version)}/"


def switch_ack_key(job: str, version: int, node: str) -> str:
    """A node's progress through the switch to plan ``version`` (a barrier)."""
    return switch_prefix(job, version) + _ident("node id", node)


def rdzv_prefix(job: str) -> str:
    """Restart-mode rendezvous (torchrun semantics): rounds of nodes."""
    return job_prefix(job) + "rdzv/"


def rdzv_state_key(job: str) -> str:
    return rdzv_prefix(job) + "state"


def rdzv_round_prefix(job: str, rnd: int) -> str:
    return f"{rdzv_prefix(job)}rounds/{_padded('round', rnd)}/"


def rdzv_join_key(job: str, rnd: int, node: str) -> str:
    return rdzv_round_prefix(job, rnd) + "joined/" + _ident("node id", node)


def rdzv_master_key(job: str, rnd: int) -> str:
    return rdzv_round_prefix(job, rnd) + "master"


def rdzv_done_key(job: str, rnd: int, node: str) -> str:
    return rdzv_round_prefix(job, rnd) + "done/" + _ident("node id", node)
