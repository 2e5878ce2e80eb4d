"""A real elastic job (one ``hspmd-launch --hspmd-elastic`` agent, two workers over gloo) while a
thread writes 60 hostile values under its prefix: malformed JSON, 200-300 KB values, wrong types,
NaN, deep nesting, keys and values full of rich markup, ANSI escapes and ``<script>``, at
``nodes/``, ``workers/``, ``devices/``, ``events/`` and ``plan/history/`` keys. The agent, its
leader and its workers skip what they cannot decode: the job finishes every step, its
parameters finite, without waiting on a bad key. The dashboard answers while the job runs;
``status`` (terminal and ``--json``) and the dashboard (``/``, ``/api/state``, ``/metrics``,
HEAD) show the values as text."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import pytest
import torch

from _elastic_job import elastic_argv, write_tiny
from _wait import wait_for
from launch_harness import Launcher, base_env

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from launcher.ops.commands import main as ops_main
from launcher.ops.dashboard import DashboardServer
from launcher.ops.state import JobStateCache

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

STEPS, BATCH, SEED, DATA_SEED, PAUSE = 4, 4, 3, 7, 2
NODE = "node-f"
MARKUP = "[/bold][red]\x1b[2J\x1b]0;owned\x07<script>alert(1)</script>\u202e"
HIGH = 900_000  # event seqs and plan versions far above the job's own


def hostile_writes(job: str) -> list[tuple[str, bytes]]:
    """60 (key, value) pairs; none decodes as a record the job would act on."""
    p = schema.job_prefix(job)
    junk = [b"{not json", b"\xff\xfe\x00", b"[" * 20_000, b'{"schema": 2, "at": NaN}',
            MARKUP.encode(), b"null"]
    node = {"schema": 2, "kind": "node", "host": MARKUP, "agent_pid": "1", "devices": [],
            "state": "running", "started_at": 1.0}  # agent_pid of the wrong type
    writes: list[tuple[str, bytes]] = []
    for i in range(6):
        writes += [(f"{p}nodes/fz{i}", junk[i]), (f"{p}workers/fz{i}/0", junk[-1 - i]),
                   (f"{p}devices/fz{i}/0", junk[(i + 2) % 6])]
    big = json.dumps(dict(node, host="x" * 200_000)).encode()
    writes += [(f"{p}nodes/fz-big", big), (f"{p}workers/fz-big/0", big),
               (f"{p}devices/fz-big/0", big), (f"{p}nodes/fz-type", json.dumps(node).encode()),
               (f"{p}nodes/fz\x1b[2J[/bold]", b"{}"), (f"{p}workers/<script>/0", b"{}")]
    for i in range(12):  # valid events and plans far above the job's: shown, never acted on
        writes.append((schema.event_key(job, HIGH + i), schema.encode(schema.EventRecord(
            seq=HIGH + i, type="failure" if i % 2 else "degrade", node=MARKUP,
            detail={"reason": MARKUP, "devices": [MARKUP]}, timings={}, at=time.time()))))
        writes.append((schema.plan_history_key(job, HIGH + i), schema.encode(schema.PlanRecord(
            version=HIGH + i, reason=MARKUP, devices=[MARKUP], strategy={"x": MARKUP},
            store_endpoint=MARKUP, created_at=time.time()))))
    for i in range(6):
        writes.append((f"{p}events/{HIGH * 10 + i:012d}", b'{"schema": 2, "kind": "event"}'
                       if i % 2 else b"x" * 300_000))
        writes.append((f"{p}devices/{NODE}/{i + 10}", json.dumps({  # a state no verdict has
            "schema": 2, "kind": "device_health", "state": MARKUP, "reason": MARKUP,
            "xid": None, "slowdown": None, "at": 1.0}).encode()))
    assert len(writes) == 60
    return writes


def _tensors(value):
    """Every floating-point tensor in a nested result."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def get(server: DashboardServer, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_job_and_tools_survive_hostile_records(etcd_server, tmp_path, marker, capsys,
                                               monkeypatch):
    job = f"fz-{uuid.uuid4().hex[:8]}"
    model, out, release = tmp_path / "model.json", tmp_path / "out", tmp_path / "release"
    write_tiny(model)
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", NODE, "--shutdown-timeout", "5",
                      *elastic_argv(model, BATCH, steps=STEPS, out=out, seed=SEED,
                                    data_seed=DATA_SEED,
                                    train=("--pause-at", str(PAUSE), "--release", str(release),
                                           "--timeout", "30"))],
                     base_env(marker), tmp_path, NODE)
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    cache = JobStateCache(client, job)
    server = None
    try:
        def paused() -> bool:
            recs = [schema.decode(kv.key, kv.value)
                    for kv in client.get_prefix(schema.workers_prefix(job))]
            return len(recs) == 2 and all(r.step >= PAUSE for r in recs)

        wait_for(paused, 60, f"both workers at step {PAUSE}", proc=agent.proc)
        cache.start(5.0)
        server = DashboardServer(cache, port=0).start()
        writes = hostile_writes(job)

        def fuzz() -> None:  # half while the workers wait, half while they train
            for i, (key, value) in enumerate(writes):
                client.put(key, value)
                if i == len(writes) // 2:
                    release.touch()

        writer = threading.Thread(target=fuzz, name="fuzz writer")
        writer.start()
        writer.join(30)
        assert not writer.is_alive()
        assert get(server, "/api/state")[0] == 200 and get(server, "/metrics")[0] == 200
        assert agent.wait(60) == 0, agent.stderr()[-4000:]
        assert "still running" not in agent.stderr()  # no wait on a bad workers/ key
        results = {p.stem: torch.load(p, weights_only=False)
                   for p in sorted(out.glob("*.pt"))}
        assert len(results) == 2
        for res in results.values():
            assert res["state"] == "done" and res["steps_done"] == STEPS, res["state"]
            tensors = list(_tensors(res["final_state"]))
            assert tensors and all(torch.isfinite(t).all() for t in tensors)

        monkeypatch.setenv("COLUMNS", "250")
        args = ["status", "--job", job, "--etcd-endpoints", etcd_server.endpoint_str]
        assert ops_main(args) == 0
        text, err = capsys.readouterr()
        assert "Traceback" not in text + err and "\x1b" not in text and "\u202e" not in text
        assert "[/bold][red]\\x1b[2J\\x1b]0;owned\\x07<script>alert(1)</script>\\u202e" in text
        assert ops_main([*args, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["events"]["recent"][-1]["node"] == MARKUP
        assert len(doc["problems"]) >= 30  # every undecodable key listed, none fatal

        wait_for(lambda: len(cache.view().bad_records) >= 30, 10, "the dashboard's cache")
        status, page = get(server, "/")
        assert status == 200 and b'<script>\n"use strict";' in page
        status, body = get(server, "/api/state")
        assert status == 200 and b"<" not in body and b"\x1b" not in body  # escaped JSON
        assert json.loads(body)["events"]["recent"][-1]["summary"].startswith(MARKUP)
        status, metrics = get(server, "/metrics")
        assert status == 200 and b"hspmd_events_total" in metrics and b"\x1b" not in metrics
        assert get(server, "/api/state", "HEAD") == (200, b"")
    finally:
        if server is not None:
            server.stop()
        cache.stop()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        client.close()
