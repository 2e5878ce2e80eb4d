"""``inject`` signals only processes that prove they are the job's: a forged ``workers/`` or
``nodes/`` record naming another process (a ``sleep`` this test started, without the job's
environment; the real worker under another node's key) is refused with the reason and the process
keeps running, while the real worker of a real ``hspmd-launch`` agent is killed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from _wait import wait_for
from launch_harness import SCRIPTS, Launcher, base_env, pid_alive

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from launcher.inject.faults import InjectContext, Refused, make_fault
from launcher.inject.scenario import parse_fault
from launcher.inject.targets import check_agent

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]
DEFAULTS = {"detect_timeout_s": 5.0, "recover_timeout_s": 5.0, "trigger_timeout_s": 5.0}
NODE = "node-s"


def fault(**entry):
    return make_fault(parse_fault(entry, 0, DEFAULTS, "<test>"))


def forge_worker(client: EtcdClient, job: str, node: str, local_rank: int, pid: int,
                 rank: int) -> None:
    rec = schema.WorkerRecord(pid=pid, global_rank=rank, local_rank=local_rank, plan_version=0,
                              step=1, last_progress_at=time.time(), steps_per_s=1.0)
    client.put(schema.worker_key(job, node, local_rank), schema.encode(rec))


def test_forged_records_are_refused_and_the_real_worker_is_killed(tmp_path, marker, etcd_server):
    job = f"sec-{uuid.uuid4().hex[:8]}"
    pids = tmp_path / "pids"
    pids.mkdir()
    env = base_env(marker, PID_DIR=str(pids))
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", NODE, "--max-restarts", "0", "--shutdown-timeout", "3",
                      str(SCRIPTS / "sleeper.py")], env, tmp_path, NODE)
    stranger = subprocess.Popen(["sleep", "60"], env={
        k: v for k, v in os.environ.items() if not k.startswith(("HSPMD_", "TORCHELASTIC_"))})
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    try:
        worker = int(wait_for(lambda: (pids / "0.pids").exists()
                              and (pids / "0.pids").read_text().split()[0], 60,
                              "the worker's pid", proc=agent.proc))
        wait_for(lambda: client.get(schema.worker_key(job, NODE, 0)), 20,
                 "the agent's worker record", proc=agent.proc)
        ctx = InjectContext(client, job, log_dir=str(tmp_path / "inject"))

        # a worker record naming a process without the job's environment
        forge_worker(client, job, NODE, 7, stranger.pid, rank=7)
        with pytest.raises(Refused, match=rf"pid {stranger.pid} does not carry job '{job}'"):
            fault(fault="kill-worker", target={"node": NODE, "local_rank": 7}).inject(ctx)
        # the real worker's pid under another node's key: the job's, but not that worker
        forge_worker(client, job, "node-z", 0, worker, rank=9)
        with pytest.raises(Refused, match="is not that worker"):
            fault(fault="kill-worker", target={"node": "node-z"}).inject(ctx)
        # a node record naming the stranger as its agent
        client.put(schema.node_key(job, "node-f"), schema.encode(schema.NodeRecord(
            host="h", agent_pid=stranger.pid, devices=[], state="running",
            started_at=time.time())))
        with pytest.raises(Refused, match="neither on its command line"):
            fault(fault="kill-agent", target={"node": "node-f"}).inject(ctx)
        # the real agent proves itself by its command line, and only for its own job and node
        assert check_agent(agent.proc.pid, job, NODE).pid == agent.proc.pid
        with pytest.raises(Refused):
            check_agent(agent.proc.pid, "another-job", NODE)
        with pytest.raises(Refused, match="agent of node 'node-s'"):
            check_agent(agent.proc.pid, job, "node-q")
        assert stranger.poll() is None and pid_alive(worker)  # nothing signalled so far

        # rank 0 names a forged record (node-a sorts first) and the real worker: the forged
        # one is refused on the way, the real one killed, and the refusal is in the detail
        forge_worker(client, job, "node-a", 0, stranger.pid, rank=0)
        inj = fault(fault="kill-worker", target={"rank": 0}).inject(ctx)
        assert inj.detail["pid"] == worker and inj.detail["signal"] == "SIGKILL"
        assert len(inj.detail["refused"]) == 1 and str(stranger.pid) in inj.detail["refused"][0]
        wait_for(lambda: not pid_alive(worker), 10, "the real worker to die")
        assert stranger.poll() is None  # the forged target is still alive
        assert agent.wait(30) != 0  # its only worker was killed, no restart allowed
    finally:
        stranger.kill()
        stranger.wait(10)
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        client.close()
