"""Coordination through etcd: the transport (client, leases, watches, leader election, the
fenced plan publication and the event journal's append).

This package is the only code in hspmd-elastic that talks to etcd. Errors are
``CoordinationError`` subclasses (see ``api.py``); the keys, records and event details it
carries are the contract's (``hspmd_elastic.contract.schema``), documented in
docs/etcd-schema.md. TLS and authentication: ``EtcdClient(..., security=
EtcdSecurity(ca_file=..., cert_file=..., key_file=..., user=..., password=...))``
(``security.py``, docs/security.md).

Usage (a node agent)::

    from hspmd_elastic.contract import schema
    from hspmd_elastic.coord import (
        Election, EtcdClient, LeasedSession, PrefixWatch, append_event, publish_plan, read_plan,
    )

    client = EtcdClient("127.0.0.1:2379,127.0.0.1:2381", timeout=2.0)
    session = LeasedSession(client, ttl=5, on_lost=lambda err: log.warning("%s", err))
    record = schema.NodeRecord(host="gpu-3", agent_pid=os.getpid(), devices=[],
                               state="ready", started_at=time.time())
    session.put(schema.node_key("job1", "gpu-3"), record.to_json())  # gone if the node dies

    def on_node(event):  # WatchEvent: type, key, value, revision, record
        print(event.type.value, event.key, event.record)

    watch = PrefixWatch(client, schema.nodes_prefix("job1"), on_node, decode=True).start()

    election = Election(client, session, job="job1", node="gpu-3",
                        on_change=lambda leading: print("leading" if leading else "follower"))
    if election.campaign(timeout=5.0):
        current, read_rev = read_plan(client, "job1")
        version = current.version if current else 0
        plan = schema.PlanRecord(version=version + 1, reason="start", devices=["gpu-3:0"],
                                 strategy={}, store_endpoint="gpu-3:29500", created_at=time.time())
        publish_plan(election, plan, read_rev, version)  # fenced on our leadership
        append_event(client, "job1", "replan", "gpu-3", schema.ReplanDetail(
            version=version + 1, previous_version=version, reason="start", device_count=1,
            planner="dp", store_endpoint="gpu-3:29500"))

    watch.stop(); election.resign(); session.stop(); client.close()
"""

from hspmd_elastic.coord.api import (
    Clock,
    Compare,
    CompareTarget,
    ConflictError,
    CoordinationError,
    DeleteOp,
    EtcdAuthError,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdUnavailableError,
    EventType,
    FencedWriteRejected,
    GetOp,
    KeyValue,
    LeaseLostError,
    PutOp,
    RangeResult,
    RecordError,
    TxnResult,
    WatchCompactedError,
    WatchEvent,
)
from hspmd_elastic.coord.client import EtcdClient, parse_endpoints
from hspmd_elastic.coord.election import Election
from hspmd_elastic.coord.journal import NewEvent, append_event, append_events, read_events
from hspmd_elastic.coord.plans import publish_plan, read_plan
from hspmd_elastic.coord.lease import KeepAlive, LeasedSession, LeaseTracker, LeaseVerdict
from hspmd_elastic.coord.security import EtcdSecurity
from hspmd_elastic.coord.watch import PrefixWatch

__all__ = [
    "Clock", "Compare", "CompareTarget", "ConflictError", "CoordinationError", "DeleteOp", "Election",
    "EtcdAuthError", "EtcdClient", "EtcdRequestError", "EtcdSecurity", "EtcdTimeoutError", "EtcdUnavailableError", "EventType",
    "FencedWriteRejected", "GetOp", "KeepAlive", "KeyValue", "LeaseLostError", "LeaseTracker",
    "LeaseVerdict", "LeasedSession", "NewEvent", "PrefixWatch", "PutOp", "RangeResult",
    "RecordError", "TxnResult", "WatchCompactedError", "WatchEvent", "append_event",
    "append_events", "parse_endpoints", "publish_plan", "read_events", "read_plan",
]
