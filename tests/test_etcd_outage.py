"""The etcd-outage policy: training does not need etcd, so an etcd stall longer than the lease
TTL restarts nothing, and only an outage past ``--hspmd-etcd-outage-limit`` ends the agent.

The pure policy (limit, slow answers, the reconcile window) on an injected clock; then restart
mode against a real etcd frozen with SIGSTOP for three lease TTLs: the leases expire, every agent
re-creates its records under a new lease, the workers' pids never change and no round or
restart is counted; and an outage past the limit, in both modes: exit 1 with the one-line root
cause, no worker left (both modes' agents run at once, each on its own etcd, in one
module-scoped fixture; each test reads one). (Elastic mode riding out a stall is in
``test_elastic_e2e.py``.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import pytest

from _clock import FakeClock
from _elastic_job import write_tiny
from _wait import wait_for
from launch_harness import SCRIPTS, Launcher, assert_no_leftovers, base_env, new_marker

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from launcher.api import RendezvousConnectionError
from launcher.node.outage import EtcdOutagePolicy
from launcher.standalone import EtcdCluster

TTL = 2.0


# ------------------------------------------------------------------------------ pure policy
def test_policy_tolerates_an_outage_up_to_the_limit_and_names_it_past_it():
    clock = FakeClock(100.0)
    policy = EtcdOutagePolicy(lease_ttl_s=TTL, limit_s=10.0, label="[j] node n: ", clock=clock)
    assert policy.limit_s == 10.0 and not policy.reconciling()
    policy.unreachable(RuntimeError("connection refused"))
    assert policy.in_outage and policy.reconciling()
    clock.advance(10.0)
    policy.unreachable(RuntimeError("connection refused"))  # exactly the limit: still fine
    clock.advance(0.5)
    with pytest.raises(RendezvousConnectionError,
                       match=r"etcd unreachable for more than 10s \(--hspmd-etcd-outage-limit\)"
                             r": connection refused"):
        policy.unreachable(RuntimeError("connection refused"))


def test_policy_limit_is_at_least_three_lease_ttls():
    assert EtcdOutagePolicy(lease_ttl_s=10.0, limit_s=5.0).limit_s == 30.0


def test_reconcile_window_follows_an_outage_and_a_slow_answer():
    clock = FakeClock(0.0)
    policy = EtcdOutagePolicy(lease_ttl_s=TTL, limit_s=60.0, clock=clock)
    policy.reachable(started_at=clock())
    assert not policy.reconciling() and policy.outages == 0
    policy.unreachable(RuntimeError("timeout"))
    clock.advance(5.0)
    policy.reachable(started_at=clock())
    assert policy.reconciling() and policy.outages == 1 and not policy.in_outage
    clock.advance(policy.reconcile_s)
    assert not policy.reconciling()
    # A call that succeeded, but only after more than half a TTL: etcd may have expired leases.
    started = clock()
    clock.advance(TTL / 2 + 0.1)
    policy.reachable(started_at=started)
    assert policy.reconciling() and policy.outages == 2
    # A quick answer starts no window.
    clock.advance(policy.reconcile_s)
    started = clock()
    clock.advance(0.1)
    policy.reachable(started_at=started)
    assert not policy.reconciling() and policy.outages == 2


# ------------------------------------------------------------------------------ restart mode
def _agent(etcd, tmp, env, job: str, node: str, *extra: str) -> Launcher:
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
            "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60",
            "--hspmd-lease-ttl", str(TTL), "--shutdown-timeout", "5", *extra,
            str(SCRIPTS / "outage_worker.py")]
    return Launcher(args, env, tmp, node)


def _node_leases(client: EtcdClient, job: str) -> dict[str, int]:
    prefix = schema.nodes_prefix(job)
    return {kv.key[len(prefix):]: kv.lease for kv in client.get_prefix(prefix)}


def _pids(pid_dir) -> dict[str, list[int]]:
    return {p.stem: [int(x) for x in p.read_text().split()] for p in pid_dir.glob("*.pids")}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_restart_mode_rides_out_an_etcd_stall_of_three_lease_ttls(tmp_path, marker,
                                                                   etcd_server):
    job, pid_dir, go = f"out-{uuid.uuid4().hex[:8]}", tmp_path / "pids", tmp_path / "go"
    pid_dir.mkdir()
    env = base_env(marker, PID_DIR=str(pid_dir), GO_FILE=str(go))
    agents = [_agent(etcd_server, tmp_path, env, job, n) for n in ("node-a", "node-b")]
    etcd = etcd_server.members[0].proc
    with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
        try:
            wait_for(lambda: len(_pids(pid_dir)) == 2, 60, "both workers running",
                     proc=agents[0].proc)
            before = _pids(pid_dir)
            leases = wait_for(lambda: (lambda ls: ls if len(ls) == 2 else None)(
                _node_leases(client, job)), 10, "both node records")
            os.kill(etcd.pid, signal.SIGSTOP)  # every member of the cluster: no etcd at all
            try:
                time.sleep(3 * TTL)  # the fault's length, not a synchronisation
            finally:
                os.kill(etcd.pid, signal.SIGCONT)
            # The leases expired during the stall: each agent re-creates its records under a
            # new lease (the moment a missing record could be taken for a node that left).
            wait_for(lambda: (lambda ls: len(ls) == 2 and all(
                ls[n] not in (0, leases[n]) for n in ls))(_node_leases(client, job)), 30,
                "both nodes re-registered under new leases")
            go.write_text("go")
            for a in agents:
                assert a.wait(60) == 0, a.stderr()[-4000:]
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
            for a in agents:
                if a.proc.poll() is None:
                    a.proc.kill()
        assert _pids(pid_dir) == before, "a worker was restarted"
        kv = client.get(schema.rdzv_state_key(job))
        state = schema.decode(kv.key, kv.value)
        assert (state.round, state.restart_count, state.state) == (0, 0, "succeeded"), state
    for a in agents:
        err = a.stderr()
        assert "etcd unreachable, workers keep running" in err, err[-3000:]
        assert "re-rendezvous" not in err and "restart 1/" not in err, err[-3000:]


def _restart_limit_agent(etcd, tmp, marker: str, client: EtcdClient) -> tuple:
    """Restart mode, one node of two ``outage_worker.py`` workers, outage limit 6 s: the agent,
    and a predicate that returns the workers' pids once both run."""
    job, pid_dir, go = f"out-{uuid.uuid4().hex[:8]}", tmp / "pids", tmp / "go"
    pid_dir.mkdir(parents=True)
    env = base_env(marker, PID_DIR=str(pid_dir), GO_FILE=str(go))
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", "solo", "--hspmd-lease-ttl", str(TTL),
                      "--hspmd-etcd-outage-limit", "6", "--shutdown-timeout", "5",
                      str(SCRIPTS / "outage_worker.py")], env, tmp, "solo")

    def running():
        pids = _pids(pid_dir)
        return [pid for p in pids.values() for pid in p] if len(pids) == 2 else None

    return agent, running, "the workers running"


def _elastic_limit_agent(etcd, tmp, marker: str, client: EtcdClient) -> tuple:
    """Elastic mode, one node of two ``elastic_train.py`` workers that wait at step 2 (for a
    release that never comes), outage limit 6 s: the agent, and a predicate that returns the
    workers' pids once both wait there (read from their records with ``client``)."""
    job = f"out-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True, exist_ok=True)
    config = write_tiny(tmp / "model.json")
    agent = Launcher(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                      "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job,
                      "--hspmd-node-id", "solo", "--hspmd-lease-ttl", str(TTL),
                      "--hspmd-etcd-outage-limit", "6", "--shutdown-timeout", "5",
                      "--hspmd-elastic", "--hspmd-model", str(config),
                      "--hspmd-global-batch", "4", str(SCRIPTS / "elastic_train.py"),
                      "--config", str(config), "--steps", "6", "--global-batch", "4",
                      "--out", str(tmp / "out"), "--pause-at", "2",
                      "--release", str(tmp / "never")], base_env(marker), tmp, "solo")
    prefix = schema.workers_prefix(job)

    def paused():
        recs = [schema.decode(kv.key, kv.value) for kv in client.get_prefix(prefix)]
        return [r.pid for r in recs] if len(recs) == 2 and all(r.step >= 2 for r in recs) \
            else None

    return agent, paused, "both workers at step 2"


@pytest.fixture(scope="module")
def past_the_limit(tmp_path_factory):
    """Both modes' agents, each on its own etcd, run at once: once the workers of both run,
    both etcds are frozen (SIGSTOP) until the agents exit. mode -> (the agent, its exit code,
    its workers' pids). No process of theirs is left at the end."""
    tmp = tmp_path_factory.mktemp("outage_limit")
    marker = new_marker()
    with contextlib.ExitStack() as stack:
        started = {}
        for mode, start in (("restart", _restart_limit_agent),
                            ("elastic", _elastic_limit_agent)):
            etcd = stack.enter_context(EtcdCluster(size=1, base_dir=str(tmp / mode / "etcd")))
            client = stack.enter_context(EtcdClient(etcd.endpoints, timeout=5.0))
            agent, ready, what = start(etcd, tmp / mode, marker, client)
            stack.callback(_kill, agent)
            started[mode] = (etcd, agent, ready, what)
        workers = {mode: wait_for(ready, 60, what, proc=agent.proc)
                   for mode, (_etcd, agent, ready, what) in started.items()}
        codes = _agent_codes_with_etcd_stopped(
            [etcd for etcd, *_rest in started.values()],
            {mode: agent for mode, (_etcd, agent, *_rest) in started.items()})
        out = {mode: (started[mode][1], codes[mode], workers[mode]) for mode in started}
    assert_no_leftovers(marker)
    return out


def _kill(agent) -> None:
    if agent.proc.poll() is None:
        agent.proc.kill()
        agent.proc.wait(10)


@pytest.mark.multiproc
@pytest.mark.timeout(180)  # it may start both modes' agents (``past_the_limit``)
def test_an_outage_past_the_limit_ends_the_agent_with_one_line(past_the_limit):
    _check_ended_past_the_limit(*past_the_limit["restart"])


@pytest.mark.multiproc
@pytest.mark.timeout(180)  # it may start both modes' agents (``past_the_limit``)
def test_elastic_mode_past_the_outage_limit_ends_with_one_line_and_no_worker_left(
        past_the_limit):
    _check_ended_past_the_limit(*past_the_limit["elastic"])


def _agent_codes_with_etcd_stopped(etcds, agents: dict) -> dict:
    """Freeze every member of ``etcds`` (SIGSTOP) until every agent of ``agents`` (by name) has
    exited: their exit codes, by name (etcd resumes after)."""
    procs = [member.proc for etcd in etcds for member in etcd.members]
    try:
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        return {name: agent.wait(60) for name, agent in agents.items()}
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)
        for agent in agents.values():
            _kill(agent)


def _check_ended_past_the_limit(agent, code: int, workers) -> None:
    """Exit 1 with the one-line root cause naming the 6 s limit and its flag, after workers ran on
    during the outage, and no worker left (the agent stopped them before it exited)."""
    assert code == 1
    err = agent.stderr()
    lines = [ln for ln in err.splitlines() if ln.startswith("hspmd-launch: error:")]
    assert len(lines) == 1 and "etcd unreachable for more than 6s" in lines[0], lines
    assert "--hspmd-etcd-outage-limit" in lines[0]
    assert "etcd unreachable, workers keep running" in err
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid



# ------------------------------------------------------------------- outages mid-rendezvous
def _stall(etcd_server, client: EtcdClient, job: str, seconds: float) -> dict:
    """The ``etcd-stall`` fault (``launcher.inject.etcd_stall``): every member SIGSTOPped for
    ``seconds``, resumed, and back once etcd answers."""
    from launcher.inject.etcd_stall import stall
    from launcher.inject.faults import InjectContext

    ctx = InjectContext(client, job, etcd_members=etcd_server.members)
    try:
        return stall(ctx, seconds)
    finally:
        ctx.close()  # resumes a member a failed stall left stopped


def _restart_agent(etcd, tmp, env, job: str, node: str, snapshot, progress, steps: int,
                   *extra: str) -> Launcher:
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
            "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60",
            "--hspmd-lease-ttl", str(TTL), "--shutdown-timeout", "5", *extra,
            str(SCRIPTS / "inject_train.py"), "--steps", str(steps), "--batch", "4",
            "--snapshot", str(snapshot), "--progress-dir", str(progress)]
    return Launcher(args, env, tmp, node)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_restart_mode_rides_out_an_etcd_stall_while_a_node_waits_in_the_rendezvous(
        tmp_path, marker, etcd_server):
    """node-a joined round 0 and waits for node-b when every etcd member stalls for three
    lease TTLs (its join record's lease expires): it waits on through the outage, re-joins
    under a new lease, and once node-b comes the round closes with both; one round, no
    restart, and the parameters equal the fault-free run."""
    import torch

    from inject_train import reference_params

    job, steps = f"out-{uuid.uuid4().hex[:8]}", 4
    snapshot, progress = tmp_path / "snapshot.pt", tmp_path / "progress"
    env = base_env(marker)
    a = _restart_agent(etcd_server, tmp_path, env, job, "node-a", snapshot, progress, steps)
    agents = [a]
    with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
        try:
            joined = schema.rdzv_join_key(job, 0, "node-a")
            wait_for(lambda: client.get(joined) is not None, 60, "node-a joined round 0",
                     proc=a.proc)
            lease = client.get(joined).lease
            _stall(etcd_server, client, job, 3 * TTL)
            assert a.proc.poll() is None, a.stderr()[-3000:]  # it waited through the outage
            # Its join record came back under a new lease (the old one expired in the stall).
            wait_for(lambda: (lambda kv: kv is not None and kv.lease not in (0, lease))(
                client.get(joined)), 30, "node-a's join record under a new lease",
                proc=a.proc)
            agents.append(_restart_agent(etcd_server, tmp_path, env, job, "node-b", snapshot,
                                         progress, steps))
            for agent in agents:
                assert agent.wait(60) == 0, agent.stderr()[-4000:]
        finally:
            for agent in agents:
                if agent.proc.poll() is None:
                    agent.proc.kill()
        kv = client.get(schema.rdzv_state_key(job))
        state = schema.decode(kv.key, kv.value)
    assert (state.round, state.restart_count, state.state) == (0, 0, "succeeded"), state
    assert [p.node for p in state.participants] == ["node-a", "node-b"], state
    final = torch.load(snapshot, map_location="cpu")
    assert final["step"] == steps
    for name, value in reference_params(steps, 4).items():
        torch.testing.assert_close(final["model"][name], value, rtol=1e-9, atol=1e-12)
    assert "etcd unreachable" in a.stderr(), a.stderr()[-3000:]
