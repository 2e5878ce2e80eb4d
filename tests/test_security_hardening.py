"""Hardening of the tools against what anyone able to write etcd can put there, and of the
dashboard against other web pages and other users: records are validated (size, strict JSON,
bounded messages) and a bad one is skipped and logged once; ``status`` shows markup and control
characters as text; the dashboard checks the Host header and a bearer token and answers HEAD;
checkpoints load as tensors only (a planted pickle runs no code)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import pickle
import time

import pytest
import torch

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import RecordError
from hspmd_elastic.contract.schema import decode_valid
from hspmd_elastic.elastic.checkpoint import (CheckpointError, CheckpointWriter,
                                              latest_complete, load_shards)
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.state import state_specs
from hspmd_elastic.plan import simple_plan
from launcher.ops.api import DashboardError
from launcher.ops.commands import main as ops_main
from launcher.ops.dashboard import DashboardServer
from launcher.ops.state import JobStateCache

pytestmark = pytest.mark.timeout(60)
JOB = "secjob"
NODE_KEY = schema.node_key(JOB, "n1")
HOSTILE = "[/bold]\x1b[2J<script>alert(1)</script>\u202e"
TOKEN = "0123456789abcdef-test-token"


@pytest.fixture
def client_timeout():
    return 5.0


def node_json(**fields) -> bytes:
    body = {"schema": 2, "kind": "node", "host": "h", "agent_pid": 1, "devices": [],
            "state": "running", "started_at": 1.0}
    body.update(fields)
    return json.dumps(body).encode()


# ------------------------------------------------------------------------------ records
@pytest.mark.parametrize("raw, problem", [
    (node_json(host="x" * 70_000), "over the 65536-byte limit of node records"),
    (b'{"schema": 2, "kind": "node", "started_at": NaN}', "NaN is not JSON"),
    (b'{"schema": 2, "kind": "node", "started_at": 1e999}', "out of range"),
    (node_json(started_at=10 ** 400),
     "number 1000000000000000000000000000000000000000 is out of range"),
    (b"[" * 60_000, "nested too deeply"),
    (node_json(**{"\x1b[2J": 1}), "unknown field(s) \\x1b[2J"),
    (b"\xff\xfe", "malformed JSON"),
])
def test_bad_records_are_errors_with_short_escaped_messages(raw, problem):
    with pytest.raises(RecordError) as err:
        schema.decode(NODE_KEY, raw)
    assert problem in err.value.problem
    assert len(str(err.value)) < 600 and "\x1b" not in str(err.value)


def test_writers_refuse_oversized_records_and_plans_may_be_larger():
    with pytest.raises(RecordError, match="over the 65536-byte limit"):
        schema.encode(schema.NodeRecord(host="h" * 70_000, agent_pid=1, devices=[],
                                        state="running", started_at=1.0))
    plan = schema.PlanRecord(version=1, reason="r", devices=[f"n{i}:0" for i in range(8000)],
                             strategy={}, store_endpoint="", created_at=1.0)
    assert schema.decode(schema.plan_current_key(JOB), schema.encode(plan)) == plan


def test_decode_valid_skips_bad_records_and_logs_each_once(caplog):
    good = schema.encode(schema.NodeRecord(host="h", agent_pid=1, devices=[], state="running",
                                           started_at=1.0))
    kvs = [(NODE_KEY, good), (schema.node_key(JOB, "n2"), b"{not json"),
           (schema.job_prefix(JOB) + "nodes/x\x1b[2J", good)]
    log = logging.getLogger("test.valid")
    bad: list = []
    with caplog.at_level(logging.WARNING, logger="test.valid"):
        for _ in range(3):  # a reader that polls logs each bad record once
            assert [k for k, _ in decode_valid(kvs, log, "reader", bad)] == [NODE_KEY]
    assert len(bad) == 6
    assert len(caplog.records) == 2 and "\x1b" not in caplog.text


# ------------------------------------------------------------------------------ status
def seed_hostile(client) -> None:
    client.put(NODE_KEY, schema.encode(schema.NodeRecord(
        host=HOSTILE, agent_pid=1, devices=[schema.DeviceInfo(0, HOSTILE, 1, HOSTILE)],
        state="running", started_at=time.time())))
    client.put(schema.device_key(JOB, "n1", 0), schema.encode(schema.DeviceHealthRecord(
        state="failed", reason=HOSTILE, xid=None, slowdown=None, at=1e300)))
    client.put(schema.plan_current_key(JOB), schema.encode(schema.PlanRecord(
        version=1, reason=HOSTILE, devices=[HOSTILE], strategy={"x": HOSTILE},
        store_endpoint=HOSTILE, created_at=time.time())))
    client.put(schema.event_key(JOB, 1), schema.encode(schema.EventRecord(
        seq=1, type="failure", node=HOSTILE, detail={"reason": HOSTILE}, timings={},
        at=time.time())))
    client.put(schema.node_key(JOB, "n2"), b"[/bold]\x1b[2J")  # not even JSON


def test_status_shows_markup_and_control_characters_as_text(etcd_server, client, capsys,
                                                           monkeypatch):
    seed_hostile(client)
    monkeypatch.setenv("COLUMNS", "250")
    args = ["status", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str]
    assert ops_main(args) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert out.count("[/bold]\\x1b[2J<script>alert(1)</script>\\u202e") >= 4  # host, reason,
    assert "\x1b" not in out and "\u202e" not in out  # plan, event; escaped, never raw
    assert "nodes/n2" in out and "malformed JSON" in out  # the bad record is listed, skipped
    assert ops_main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"][0]["host"] == HOSTILE  # JSON carries the value as it is, escaped
    assert [p["key"] for p in doc["problems"]] == [schema.node_key(JOB, "n2")]


# ------------------------------------------------------------------------------ dashboard
def request(server: DashboardServer, method: str, path: str, host: str,
            token: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True)
        if host:
            conn.putheader("Host", host)
        if token:
            conn.putheader("Authorization", f"Bearer {token}")
        conn.endheaders()
        resp = conn.getresponse()
        body = resp.read() if method != "HEAD" else b""
        return resp.status, dict(resp.getheaders()), body
    finally:
        conn.close()


def test_dashboard_checks_host_and_token_and_answers_head(client):
    seed_hostile(client)
    with JobStateCache(client, JOB) as cache, \
            DashboardServer(cache, port=0, allow_hosts=["dash.example"], token=TOKEN) as srv:
        port = srv.address[1]
        for host in (f"evil.example:{port}", "", "127.0.0.1.evil.example"):  # DNS rebinding
            status, _, body = request(srv, "GET", "/api/state", host, TOKEN)
            assert status == 403 and body.count(b"\n") == 1, (host, body)
        for token in (None, "wrong-token-0123456789", TOKEN + "x"):
            status, headers, _ = request(srv, "GET", "/api/state", f"127.0.0.1:{port}", token)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "dash.example"):
            status, headers, body = request(srv, "GET", "/api/state", host, TOKEN)
            assert status == 200 and json.loads(body)["nodes"][0]["host"] == HOSTILE
        status, headers, body = request(srv, "GET", "/", "localhost", TOKEN)
        assert status == 200 and "script-src 'sha256-" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff" and b"innerHTML" not in body
        for path in ("/", "/api/state", "/metrics", "/api/stream"):
            get_status, get_headers, _ = request(srv, "GET", path, "localhost", TOKEN) \
                if path != "/api/stream" else (200, {}, b"")
            status, headers, body = request(srv, "HEAD", path, "localhost", TOKEN)
            assert status == get_status == 200 and body == b""
            assert headers["Content-Type"] == (get_headers or headers)["Content-Type"]
        status, _, _ = request(srv, "POST", "/api/state", "localhost", TOKEN)
        assert status == 405
    with JobStateCache(client, JOB) as cache, pytest.raises(DashboardError, match="token"):
        DashboardServer(cache, "0.0.0.0", 0)


def test_dashboard_command_needs_a_token_file_off_loopback(etcd_server, tmp_path, capsys):
    args = ["dashboard", "--job", JOB, "--etcd-endpoints", etcd_server.endpoint_str,
            "--port", "0"]
    assert ops_main([*args, "--host", "0.0.0.0"]) == 2
    short = tmp_path / "short"
    short.write_text("abc\n")
    assert ops_main([*args, "--token-file", str(short)]) == 2
    assert ops_main([*args, "--token-file", str(tmp_path / "missing")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "--token-file" in lines[0] and "Traceback" not in lines
    assert "at least 16 characters" in lines[1] and "cannot read token file" in lines[2]


# ------------------------------------------------------------------------------ checkpoints
class _Planted:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_checkpoints_load_as_tensors_only(tmp_path):
    config = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=1, ffn_size=16,
                         seq_len=4, dtype="float64")
    plan = simple_plan(num_layers=1, global_batch=2)
    state = {name: torch.full(spec.shape, 2.0, dtype=getattr(torch, spec.dtype))
             for name, spec in state_specs(config, plan).items()}
    writer = CheckpointWriter(str(tmp_path / "ckpt"), every=1)
    writer.submit(1, config, plan, 0, state)
    assert writer.flush(10.0) and not writer.errors
    root = str(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "step-00000001" / "shard-0.pt"
    torch.load(shard, weights_only=True)  # what is saved loads under weights_only
    loaded = load_shards(root, 1, config, plan, 0)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())

    original = shard.read_bytes()
    planted = tmp_path / "planted"
    torch.save({"step": 1, "tensors": _Planted(str(planted))}, shard)
    with pytest.raises(CheckpointError, match="not readable as tensors only"):
        load_shards(root, 1, config, plan, 0)
    shard.write_bytes(pickle.dumps(_Planted(str(planted)), protocol=2))  # a plain pickle
    with pytest.raises(CheckpointError, match="shard-0.pt"):
        load_shards(root, 1, config, plan, 0)
    assert not planted.exists()  # no code ran

    name = next(iter(state))
    torch.save({"step": 1, "tensors": {name: (((0, 1),), torch.zeros(1))}}, shard)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_shards(root, 1, config, plan, 0)
    shard.write_bytes(original)
    manifest = shard.parent / "manifest.json"
    manifest.write_text(json.dumps({"step": 1, "shards": ["../../planted"]}))
    assert latest_complete(root) == -1  # a manifest may only name its own shard files
