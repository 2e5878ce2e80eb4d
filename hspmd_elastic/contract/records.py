"""The records of the etcd schema: one dataclass per value type a job stores.

Promises:

* every record is a dataclass deriving from ``Record``; its JSON is ``{"schema":
  SCHEMA_VERSION, "kind": KIND, ...fields}``; ``CHOICES`` names the fields whose value is one of
  a fixed set;
* fields added after a record type was first written have defaults, so older values decode;
* torch-free and etcd-free: the registry that maps keys to these types, and the codec, are in
  ``contract.schema``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hspmd_elastic.contract.errors import RecordError
from hspmd_elastic.contract.events import EVENT_TYPES
from hspmd_elastic.contract.progress import WorkerFields

# 2: event details are typed (``contract.events``) and device verdicts carry their ``origin``;
# a value of schema 1 is an older release's and is refused in one line (``schema.decode_as``).
SCHEMA_VERSION = 2


class NodeState(str, enum.Enum):
    """The states a node agent writes in ``nodes/<node>`` (``NodeRecord.state``)."""

    JOINING = "joining"  # registered, waiting for a plan (elastic) or a round (restart)
    READY = "ready"  # elastic: registered, in no plan yet (a spare, or before the first plan)
    RUNNING = "running"  # its workers run the current plan (or round)
    LEAVING = "leaving"  # restart mode: the agent is ending (its lease goes next)
    FAILED = "failed"  # restart mode: the job failed; the agent stops its workers


class VerdictOrigin(str, enum.Enum):
    """Who made a device verdict (``DeviceHealthRecord.origin``)."""

    HEALTH = "health"  # the node's health source (NVML, a fault script)
    EXIT = "exit"  # its worker died; the agent journaled a ``failure`` event already
    STALL = "stall"  # its worker hung and was killed; the agent journaled a ``stall`` event


DEVICE_STATES = ("healthy", "degraded", "suspect", "failed")
NODE_STATES = tuple(s.value for s in NodeState)
GONE_NODE_STATES = (NodeState.LEAVING.value, NodeState.FAILED.value)
VERDICT_ORIGINS = tuple(o.value for o in VerdictOrigin)
SWITCH_STATES = ("joined", "ready", "done", "failed")
RDZV_STATES = ("joining", "closed", "succeeded", "failed")
AGENT_MODES = ("restart", "elastic")  # how a node agent runs the job (``NodeClaimRecord.mode``)

# Largest value of a record, in bytes of JSON: ``encode`` refuses and ``decode`` rejects more.
# Plans, the rendezvous state and fault scripts grow with the cluster; the others do not.
MAX_VALUE_BYTES = 64 * 1024
MAX_VALUE_BYTES_BY_KIND = {"plan": 1 << 20, "plan_head": 1 << 20, "rdzv_state": 1 << 20,
                           "fault_script": 1 << 20, "event": 256 * 1024,
                           "plan_layout": 1 << 20}


# ----------------------------------------------------------------------------------------- records
@dataclass
class Record:
    """Base of every record: JSON with ``schema`` and ``kind`` plus the dataclass fields."""

    KIND: ClassVar[str] = ""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def to_dict(self) -> dict[str, Any]:
        body = {"schema": SCHEMA_VERSION, "kind": self.KIND}
        body.update(dataclasses.asdict(self))
        return body

    def to_json(self) -> bytes:
        """Compact, key-sorted UTF-8 JSON; NaN and infinities are refused (not JSON)."""
        try:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                              allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"<{self.KIND} record>", f"not encodable as JSON: {exc}") from exc
        return text.encode("utf-8")


@dataclass
class DeviceInfo:
    """One accelerator of a node (nested in NodeRecord.devices)."""

    index: int
    type: str
    memory_bytes: int
    uuid: str
    speed: float = 1.0  # declared by the node: relative to the type's nominal (1.0 nominal)


@dataclass
class NodeRecord(Record):
    KIND: ClassVar[str] = "node"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": NODE_STATES}

    host: str
    agent_pid: int
    devices: list[DeviceInfo]
    state: str
    started_at: float
    store_endpoint: str = ""  # host:port of the TCPStore this agent hosts ("" when none)


@dataclass
class DeviceHealthRecord(Record):
    KIND: ClassVar[str] = "device_health"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": DEVICE_STATES,
                                                     "origin": VERDICT_ORIGINS}

    state: str
    reason: str
    xid: Optional[int]
    slowdown: Optional[float]
    at: float
    origin: str = VerdictOrigin.HEALTH.value  # who made it (``VerdictOrigin``)


@dataclass
class WorkerRecord(WorkerFields, Record):
    """A worker's progress as its agent relays it (``progress.WorkerFields``, defined there)."""

    KIND: ClassVar[str] = "worker"


@dataclass
class ReachRecord(Record):
    """The peers a node cannot reach over the data network (written while it sees any)."""

    KIND: ClassVar[str] = "reach"

    node: str
    unreachable: list[str]
    at: float


@dataclass
class RetryRecord(Record):
    """A node whose workers wait after a switch into ``plan_version`` failed with no change in
    the cluster to explain it (written while they wait; the leader publishes the plan again)."""

    KIND: ClassVar[str] = "retry"

    node: str
    plan_version: int
    slots: list[int]
    waited_s: float
    at: float


@dataclass
class CandidateRecord(Record):
    KIND: ClassVar[str] = "candidate"

    node: str
    at: float


@dataclass
class LeaderRecord(Record):
    KIND: ClassVar[str] = "leader"

    node: str
    since: float
    candidate_key: str
    term: int


@dataclass
class PlanRecord(Record):
    KIND: ClassVar[str] = "plan"

    version: int
    reason: str
    devices: list[str]
    strategy: dict[str, Any]
    store_endpoint: str
    created_at: float
    # Every device usable when the plan was made -> its speed relative to nominal (1.0 =
    # nominal): the leader replans when the cluster no longer matches it.
    inventory: dict[str, float] = field(default_factory=dict)
    # Devices of the previous plan that leave this one alive (suspect: drained): they join the
    # switch's group after the plan's ranks, serve as BSR sources only, then leave.
    drain: list[str] = field(default_factory=list)
    # Who wrote it: the leader's node and term (the create revision of its election key, the
    # fence of the write). Optional: older values without them read as "" and 0.
    leader: str = ""
    term: int = 0
    # The furthest step any worker had reported when the plan was made, or the previous plan's
    # if larger (0: nobody trained yet): a switch where nobody holds state starts from the seed
    # only when it is 0.
    step: int = 0
    # Length buckets (``--hspmd-lengths``): per bucket, shortest first, its window (tokens),
    # its first row of the global batch and the plan its rows run under inside each step
    # ({"window", "start", "strategy"}; graph.bucketed); empty: every row runs under
    # ``strategy``.
    buckets: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class PlanHeadRecord(Record):
    """What a node agent needs of the current plan, written in the same transaction as
    ``plan/current`` (``coord.plans``): a few bytes per node instead of the whole strategy."""

    KIND: ClassVar[str] = "plan_head"

    version: int
    created_at: float
    store_endpoint: str
    step: int
    # sha256 of the plan record's bytes as stored in plan/current ("sha256:<hex>")
    digest: str
    # The plan's devices in rank order as runs "<node>:<first>-<last>" (or "<node>:<index>"):
    # consecutive ranks on one node with consecutive device indexes.
    devices: list[str]
    drain: list[str] = field(default_factory=list)  # the plan's drain list, as runs too


@dataclass
class EventRecord(Record):
    KIND: ClassVar[str] = "event"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"type": EVENT_TYPES}

    seq: int
    type: str
    node: Optional[str]
    detail: dict[str, Any]  # the JSON of ``events.EVENT_DETAILS[type]`` (``schema.event_detail``)
    timings: dict[str, float]
    at: float


@dataclass
class CounterRecord(Record):
    KIND: ClassVar[str] = "counter"

    value: int


@dataclass
class FaultScriptRecord(Record):
    """Scripted device faults for one node (fault drills); read by ``ScriptedHealthSource``."""

    KIND: ClassVar[str] = "fault_script"

    faults: list[dict[str, Any]]


@dataclass
class SwitchAckRecord(Record):
    KIND: ClassVar[str] = "switch_ack"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": SWITCH_STATES}

    node: str
    plan_version: int
    state: str
    at: float


@dataclass
class RdzvParticipant:
    """One node of a closed restart-mode round (nested in RdzvStateRecord.participants)."""

    node: str
    host: str
    local_world_size: int
    node_rank: Optional[int]
    create_revision: int


@dataclass
class RdzvStateRecord(Record):
    KIND: ClassVar[str] = "rdzv_state"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"state": RDZV_STATES}

    round: int
    state: str
    restart_count: int
    participants: list[RdzvParticipant]
    reason: str
    at: float


@dataclass
class RdzvJoinRecord(Record):
    KIND: ClassVar[str] = "rdzv_join"

    node: str
    host: str
    local_world_size: int
    node_rank: Optional[int]
    at: float


@dataclass
class RdzvMasterRecord(Record):
    KIND: ClassVar[str] = "rdzv_master"

    node: str
    addr: str
    port: int
    at: float


@dataclass
class RdzvDoneRecord(Record):
    KIND: ClassVar[str] = "rdzv_done"

    node: str
    at: float


@dataclass
class NodeClaimRecord(Record):
    """``claims/<node>``: the one live agent that owns a node id, under its lease
    (``launcher.node.claim``). The earliest claim's ``mode`` is the job's: an agent of the other
    mode, or a second agent with the same node id, is refused; the running job never is."""

    KIND: ClassVar[str] = "node_claim"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"mode": AGENT_MODES}

    node: str
    host: str
    pid: int
    mode: str
    at: float


@dataclass
class PlanStampRecord(Record):
    """The current plan's version and digests, written with ``plan/current`` (``coord.plans``):
    the few bytes every worker watches to learn that a plan superseded its own."""

    KIND: ClassVar[str] = "plan_stamp"

    version: int
    created_at: float
    digest: str  # sha256 of the plan record's bytes as stored in plan/current ("sha256:<hex>")
    # sha256 of the plan/layout value written in the same transaction ("" when none was)
    layout_digest: str


@dataclass
class PlanLayoutRecord(Record):
    """What a worker's switch needs of the current plan, written with ``plan/current``
    (``coord.plans``): its devices and drains as runs and its strategy with pipelines as runs."""

    KIND: ClassVar[str] = "plan_layout"

    version: int
    created_at: float
    store_endpoint: str
    step: int
    digest: str  # the plan record's digest, as in plan/head and plan/stamp
    devices: list[str]  # the plan's devices as runs (as in plan/head)
    drain: list[str]  # the plan's drain list as runs
    # The plan's strategy with its pipelines as runs (``coord.strategy_runs``), or verbatim
    # when it is no plan's strategy.
    strategy: dict[str, Any]
    # The plan's length buckets, verbatim (``PlanRecord.buckets``)
    buckets: list[dict[str, Any]] = field(default_factory=list)


RECORD_TYPES: tuple[type[Record], ...] = (
    NodeRecord, DeviceHealthRecord, WorkerRecord, ReachRecord, RetryRecord, CandidateRecord,
    LeaderRecord, PlanRecord, PlanHeadRecord, EventRecord, CounterRecord, FaultScriptRecord,
    SwitchAckRecord, RdzvStateRecord, RdzvJoinRecord, RdzvMasterRecord, RdzvDoneRecord,
    PlanStampRecord, PlanLayoutRecord, NodeClaimRecord,
)
NESTED_TYPES: tuple[type, ...] = (DeviceInfo, RdzvParticipant)
