"""Several node agents on one host (distinct ``--hspmd-node-id``) meeting through a real etcd:
one 2x2 job, and membership changes (join, leave) that re-rendezvous without using a restart.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from launch_harness import (
    SCRIPTS,
    Launcher,
    base_env,
    pid_alive,
    read_json_files,
)
from _wait import wait_for

from hspmd_elastic.contract import schema
from launcher.standalone import free_ports
from hspmd_elastic.coord.client import EtcdClient

pytestmark = pytest.mark.multiproc


def agent_args(etcd, job: str, node: str, nnodes: str, *extra: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
            "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60", "--hspmd-lease-ttl", "2",
            "--shutdown-timeout", "5", *extra, str(SCRIPTS / "env_dump.py")]


def test_two_agents_form_one_2x2_job(tmp_path, marker, etcd_server):
    dump = tmp_path / "dump"
    dump.mkdir()
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, DUMP_DIR=str(dump))
    a = Launcher(agent_args(etcd_server, job, "node-a", "2"), env, tmp_path, "a")
    b = Launcher(agent_args(etcd_server, job, "node-b", "2"), env, tmp_path, "b")
    assert a.wait(120) == 0, a.stderr()
    assert b.wait(60) == 0, b.stderr()
    dumps = read_json_files(dump, "round0_rank*.json")
    assert sorted(dumps) == [f"round0_rank{r}.json" for r in range(4)]
    by_node: dict[str, list[int]] = {}
    for name, d in dumps.items():
        e = d["env"]
        assert d["launched"] and d["all_reduce"] == 6.0 and d["pg_world"] == 4
        assert e["WORLD_SIZE"] == "4" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["TORCHELASTIC_RUN_ID"] == job
        assert int(e["RANK"]) == 2 * int(e["GROUP_RANK"]) + int(e["LOCAL_RANK"])
        by_node.setdefault(e["HSPMD_NODE_ID"], []).append(int(e["RANK"]))
    assert sorted(map(sorted, by_node.values())) == [[0, 1], [2, 3]]
    assert len({d["env"]["MASTER_PORT"] for d in dumps.values()}) == 1
    # what the job left in etcd: the rendezvous state and events; leased keys are gone
    with EtcdClient(etcd_server.endpoints) as client:
        keys = [kv.key for kv in client.get_prefix(schema.job_prefix(job))]
        assert schema.job_prefix(job) + "rdzv/state" in keys
        assert not [k for k in keys if "/nodes/" in k or "/workers/" in k or "/joined/" in k]


def test_join_and_leave_rerendezvous_without_using_a_restart(tmp_path, marker, etcd_server):
    dump = tmp_path / "dump"
    dump.mkdir()
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, DUMP_DIR=str(dump), EXIT_AT_ROUND="2")
    a = Launcher(agent_args(etcd_server, job, "node-a", "1:2", "--max-restarts", "0"), env,
                 tmp_path, "a")
    wait_for(lambda: len(list(dump.glob("round0_*.json"))) == 2, 60, "round 0 on node-a alone",
             proc=a.proc)
    b = Launcher(agent_args(etcd_server, job, "node-b", "1:2", "--max-restarts", "0"), env,
                 tmp_path, "b")
    wait_for(lambda: len(list(dump.glob("round1_*.json"))) == 4, 90, "round 1 with both nodes",
             proc=a.proc)
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 1
    assert a.wait(90) == 0, a.stderr()
    rounds = {r: read_json_files(dump, f"round{r}_*.json") for r in range(3)}
    assert [len(rounds[r]) for r in range(3)] == [2, 4, 2]
    for r, world in ((0, "2"), (1, "4"), (2, "2")):
        for d in rounds[r].values():
            assert d["env"]["WORLD_SIZE"] == world
            assert d["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert {d["env"]["HSPMD_NODE_ID"] for d in rounds[2].values()} == {"node-a"}
    with EtcdClient(etcd_server.endpoints) as client:
        events = [schema.decode(kv.key, kv.value)
                  for kv in client.get_prefix(schema.events_prefix(job))]
    assert {"join", "leave"} <= {e.type for e in events}
    assert "failure" not in {e.type for e in events}
    err = a.stderr()
    assert "node joined; re-rendezvous (no restart consumed)" in err
    assert "node node-b left; re-rendezvous (no restart consumed)" in err


def test_records_under_lease_and_no_orphans_when_the_agent_is_killed(tmp_path, marker,
                                                                     etcd_server):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, PID_DIR=str(pids_dir))
    args = agent_args(etcd_server, job, "node-k", "1")
    args[-1] = str(SCRIPTS / "sleeper.py")
    agent = Launcher(args, env, tmp_path, "k")
    wait_for(lambda: len(list(pids_dir.glob("*.pids"))) == 2, 60, "both workers' pids",
             proc=agent.proc)
    pids = sorted(int(f.read_text()) for f in pids_dir.glob("*.pids"))
    with EtcdClient(etcd_server.endpoints) as client:
        def records():
            found = {kv.key: schema.decode(kv.key, kv.value)
                     for kv in client.get_prefix(schema.workers_prefix(job, "node-k"))}
            return found if len(found) == 2 else None

        workers = wait_for(records, 10, "worker records")
        assert sorted(r.pid for r in workers.values()) == pids
        assert sorted(r.global_rank for r in workers.values()) == [0, 1]
        def node_running():
            kv = client.get(schema.node_key(job, "node-k"))
            node = schema.decode(kv.key, kv.value) if kv else None
            return node if node and node.state == "running" else None

        node = wait_for(node_running, 10, "the node record in state running")
        assert node.agent_pid == agent.proc.pid
        agent.proc.kill()  # SIGKILL: no cleanup code runs in the agent
        agent.wait(10)
        wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "workers to die with the agent")
        wait_for(lambda: not len(client.get_prefix(schema.nodes_prefix(job))), 15,
                 "the node record to expire with the lease")


def test_a_failure_restarts_every_node_once(tmp_path, marker, etcd_server):
    dump = tmp_path / "dump"
    dump.mkdir()
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, DUMP_DIR=str(dump), FAIL_RANK="3")
    agents = []
    for node in ("node-a", "node-b"):
        args = agent_args(etcd_server, job, node, "2", "--max-restarts", "1")
        args[-1] = str(SCRIPTS / "flaky.py")
        agents.append(Launcher(args, env, tmp_path, node))
    codes = [a.wait(120) for a in agents]
    assert codes == [0, 0], [a.stderr() for a in agents]
    dumps = read_json_files(dump, "attempt*_rank*.json")
    assert sorted(dumps) == [f"attempt1_rank{r}.json" for r in range(4)]
    assert {d["WORLD_SIZE"] for d in dumps.values()} == {"4"}
    with EtcdClient(etcd_server.endpoints) as client:
        events = [schema.decode(kv.key, kv.value)
                  for kv in client.get_prefix(schema.events_prefix(job))]
    assert [e.type for e in events].count("restart") == 1
    assert "failure" in {e.type for e in events}


def test_sigterm_while_waiting_for_nodes_and_join_timeout(tmp_path, marker, etcd_server):
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, DUMP_DIR=str(tmp_path))
    waiting = Launcher(agent_args(etcd_server, job, "node-w", "2"), env, tmp_path, "w")
    with EtcdClient(etcd_server.endpoints) as client:
        wait_for(lambda: client.get(schema.rdzv_join_key(job, 0, "node-w")), 30,
                 "node-w to join round 0", proc=waiting.proc)
    start = time.monotonic()
    waiting.proc.send_signal(signal.SIGTERM)
    assert waiting.wait(30) == 1
    assert time.monotonic() - start < 10
    assert "got signal: 15" in waiting.stderr()

    args = agent_args(etcd_server, f"{job}-t", "node-t", "2")
    args[args.index("last_call_timeout=0.5,join_timeout=60")] = "join_timeout=1"
    lonely = Launcher(args, env, tmp_path, "t")
    assert lonely.wait(60) == 1
    errors = [ln for ln in lonely.stderr().splitlines() if ln.startswith("hspmd-launch: error:")]
    assert len(errors) == 1 and "timed out after 1s waiting for 2 node(s)" in errors[0]


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_torchrun_multinode_flags_without_an_etcd(tmp_path, marker, backend):
    """torchrun's c10d/static multi-node flags: the node at the endpoint serves the store."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    port = free_ports(1)[0]
    env = base_env(marker, PID_DIR=str(pids_dir), EXIT_NOW="1")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--shutdown-timeout", "5",
              "--rdzv-conf", "join_timeout=60"]
    if backend == "static":
        flags = [[*common, "--node-rank", str(r), "--master-addr", "127.0.0.1",
                  "--master-port", str(port)] for r in (1, 0)]  # node 1 waits for node 0
    else:
        flags = [[*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", "c10d-job", "--hspmd-node-id", n] for n in ("n-a", "n-b")]
    agents = [Launcher([*f, str(SCRIPTS / "sleeper.py")], env, tmp_path, f"agent{i}")
              for i, f in enumerate(flags)]
    codes = [a.wait(90) for a in agents]
    assert codes == [0, 0], [a.stderr() for a in agents]
    assert sorted(p.name for p in pids_dir.glob("*.pids")) == [f"{r}.pids" for r in range(4)]
    served = [a for a in agents if "serving the rendezvous store" in a.stderr()]
    assert len(served) == 1
    if backend == "static":
        assert served[0] is agents[1]  # node rank 0


def test_a_finished_job_id_can_be_run_again(tmp_path, marker, etcd_server):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    job = f"job-{uuid.uuid4().hex[:8]}"
    env = base_env(marker, PID_DIR=str(pids_dir), EXIT_NOW="1")
    for attempt in range(2):
        args = agent_args(etcd_server, job, "node-r", "1")
        args[-1] = str(SCRIPTS / "sleeper.py")
        run = Launcher(args, env, tmp_path, f"run{attempt}")
        assert run.wait(60) == 0, run.stderr()
    with EtcdClient(etcd_server.endpoints) as client:
        kv = client.get(schema.rdzv_state_key(job))
        state = schema.decode(kv.key, kv.value)
    assert state.state == "succeeded" and state.round == 1 and state.reason == "all nodes done"
