"""docs/etcd-schema.md cannot drift from schema.py: key table, record fields, allowed values."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

from hspmd_elastic.contract import schema
from hspmd_elastic.coord import (Election, EtcdClient, LeasedSession, append_event,
                                 publish_plan)

DOC = Path(__file__).resolve().parents[1] / "docs" / "etcd-schema.md"
NESTED = schema.NESTED_TYPES


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"section '## {title}' missing from {DOC}"
    return m.group(1)


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line.replace("|", "").strip()) <= {"-", " "}:
            continue
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows[1:]  # drop the header row


def _strip(cell: str) -> str:
    return cell.strip("`")


def test_key_table_matches_registry():
    rows = _table_rows(_section(DOC.read_text(), "Keys"))
    documented = [(_strip(r[0]), r[1], r[2], r[3]) for r in rows]
    registered = [(s.pattern, s.record.__name__, s.lease, s.writer) for s in schema.REGISTRY]
    assert documented == registered


def _record_sections(text: str, title: str = "Records") -> dict[str, tuple[str, list[list[str]]]]:
    """``### <Name> (<header>)`` subsections of section ``title``: name -> (header, rows)."""
    out = {}
    for m in re.finditer(r"^### (\w+) \((.*?)\)\n(.*?)(?=^### |\Z)", _section(text, title),
                         re.M | re.S):
        out[m.group(1)] = (m.group(2), _table_rows(m.group(3)))
    return out


def test_record_fields_types_and_kinds_match_dataclasses():
    sections = _record_sections(DOC.read_text())
    expected = {cls.__name__: cls for cls in (*schema.RECORD_TYPES, *NESTED)}
    assert sorted(sections) == sorted(expected)
    for name, (header, rows) in sections.items():
        cls = expected[name]
        assert header == ("nested" if cls in NESTED else f"kind `{cls.KIND}`"), name
        documented = [(_strip(r[0]), r[1]) for r in rows]
        assert documented == schema.describe_fields(cls), name
        assert all(r[2] for r in rows), f"{name}: every field needs a meaning"


def test_allowed_values_are_documented():
    sections = _record_sections(DOC.read_text())
    for cls in schema.RECORD_TYPES:
        meanings = {_strip(r[0]): r[2] for r in sections[cls.__name__][1]}
        for field, allowed in cls.CHOICES.items():
            listed = re.findall(r"`([^`]+)`", meanings[field])
            assert listed == list(allowed), f"{cls.__name__}.{field}"


def test_event_detail_tables_match_the_registry():
    text = _section(DOC.read_text(), "Event details")
    type_table = _table_rows(text.split("\n### ", 1)[0])
    assert [(_strip(r[0]), r[1]) for r in type_table] == [
        (t, cls.__name__) for t, cls in schema.EVENT_DETAILS.items()]
    assert all(r[2] for r in type_table), "every event type needs its writer"
    sections = _record_sections(DOC.read_text(), "Event details")
    classes = {cls.__name__: cls for cls in (*schema.EVENT_DETAILS.values(),
                                             *schema.NESTED_DETAIL_TYPES)}
    assert sorted(sections) == sorted(classes)
    for name, (header, rows) in sections.items():
        cls = classes[name]
        types = [t for t, c in schema.EVENT_DETAILS.items() if c is cls]
        assert header == ("nested" if cls in schema.NESTED_DETAIL_TYPES
                          else "events " + ", ".join(f"`{t}`" for t in types)), name
        assert [(_strip(r[0]), r[1]) for r in rows] == schema.describe_fields(cls), name
        assert all(r[2] for r in rows), f"{name}: every field needs a meaning"


def _etcdctl_json(endpoint: str, prefix: str) -> list[tuple[str, bytes]]:
    out = subprocess.run(
        ["etcdctl", "--endpoints", endpoint, "get", "--prefix", prefix, "-w", "json"],
        capture_output=True, text=True, timeout=10, env={"ETCDCTL_API": "3"}, check=True,
    )
    kvs = json.loads(out.stdout).get("kvs", [])
    return [(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv["value"])) for kv in kvs]


def test_what_a_job_writes_decodes_and_is_documented(etcd_server):
    job = "docjob"
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    session = LeasedSession(client, ttl=5, name="agent node-a")
    election = Election(client, session, job, "node-a")
    try:
        session.put(schema.claim_key(job, "node-a"), schema.NodeClaimRecord(
            node="node-a", host="gpu-a", pid=1, mode="elastic", at=0.0).to_json())
        session.put(schema.node_key(job, "node-a"), schema.NodeRecord(
            host="gpu-a", agent_pid=1, devices=[schema.DeviceInfo(0, "H200", 1 << 30, "GPU-1")],
            state="running", started_at=0.0).to_json())
        session.put(schema.device_key(job, "node-a", 0), schema.DeviceHealthRecord(
            state="healthy", reason="", xid=None, slowdown=None, at=0.0).to_json())
        session.put(schema.worker_key(job, "node-a", 0), schema.WorkerRecord(
            pid=2, global_rank=0, local_rank=0, plan_version=1, step=0, last_progress_at=0.0,
            steps_per_s=0.0).to_json())
        session.put(schema.reach_key(job, "node-a"), schema.ReachRecord(
            node="node-a", unreachable=["node-b"], at=0.0).to_json())
        session.put(schema.retry_key(job, "node-a"), schema.RetryRecord(
            node="node-a", plan_version=1, slots=[0], waited_s=20.0, at=0.0).to_json())
        session.put(schema.switch_ack_key(job, 1, "node-a"), schema.SwitchAckRecord(
            node="node-a", plan_version=1, state="done", at=0.0).to_json())
        member = schema.RdzvParticipant(node="node-a", host="gpu-a", local_world_size=1,
                                        node_rank=None, create_revision=7)
        client.put(schema.rdzv_state_key(job), schema.RdzvStateRecord(
            round=0, state="closed", restart_count=0, participants=[member], reason="",
            at=0.0).to_json())
        session.put(schema.rdzv_join_key(job, 0, "node-a"), schema.RdzvJoinRecord(
            node="node-a", host="gpu-a", local_world_size=1, node_rank=None, at=0.0).to_json())
        session.put(schema.rdzv_master_key(job, 0), schema.RdzvMasterRecord(
            node="node-a", addr="gpu-a", port=29500, at=0.0).to_json())
        client.put(schema.rdzv_done_key(job, 0, "node-a"), schema.RdzvDoneRecord(
            node="node-a", at=0.0).to_json())
        client.put(schema.fault_script_key(job, "node-a"), schema.FaultScriptRecord(
            faults=[{"at": 1.0, "device": 0, "kind": "xid", "xid": 79}]).to_json())
        assert election.campaign(5.0)
        plan = schema.PlanRecord(version=1, reason="start", devices=["node-a:0"], strategy={},
                                 store_endpoint="gpu-a:29500", created_at=0.0)
        publish_plan(election, plan, 0)  # plan/current, plan/head and plan/history/1
        append_event(client, job, "join", "node-a", schema.ChangeDetail(devices=["node-a:0"]))
        prefix = schema.job_prefix(job)
        if shutil.which("etcdctl"):
            stored = _etcdctl_json(etcd_server.endpoints[0], prefix)
        else:  # the operator's view needs etcdctl; the client sees the same bytes
            stored = [(kv.key, kv.value) for kv in client.get_prefix(prefix)]
        seen = {schema.match_key(key)[1].pattern for key, _ in stored}
        assert seen == {s.pattern for s in schema.REGISTRY}
        for key, value in stored:
            schema.decode(key, value)  # raises RecordError on anything off-schema
    finally:
        election.resign()
        session.stop()
        client.close()



def test_package_usage_example_runs(etcd_server):
    import logging
    import os
    import time

    import hspmd_elastic.coord as coord

    doc = coord.__doc__
    start = doc.index("Usage (a node agent)::") + len("Usage (a node agent)::")
    code = "\n".join(line[4:] for line in doc[start:].splitlines())
    code = code.replace('"127.0.0.1:2379,127.0.0.1:2381"', repr(etcd_server.endpoint_str))
    exec(code, {"os": os, "time": time, "log": logging.getLogger("example")})  # noqa: S102
    client = EtcdClient(etcd_server.endpoints, timeout=2.0)
    try:
        current, _ = coord.read_plan(client, "job1")
        assert current is not None and current.version == 1
        assert [e.type for e in coord.read_events(client, "job1")] == ["replan"]
    finally:
        client.close()
