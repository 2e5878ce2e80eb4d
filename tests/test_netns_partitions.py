"""Partitions on the multi-host topology (``tests/_netns.py``): real links brought down in real
network namespaces, a 3-member etcd, ``hspmd-launch --hspmd-elastic`` agents, real workers.

* the leader's node cut off entirely for longer than the lease TTL: the survivor becomes leader
  and replans it away (the time from the cut to the new plan is printed); a write under the old
  leader's fence is refused, and etcd's revision history shows one write per plan version, none
  with the old term after the new one began; the survivor trains on in the same process; after
  the heal the node's stale worker never comes back: a fresh one joins through the BSR, and the
  parameters equal the fault-free reference;
* a partition through the fault-injection harness: links down, healed by its timer or by
  ``InjectContext.close``; without a topology, or for a node the topology does not name, one
  line;
* one node's data link only cut, etcd still reachable (three nodes): the peers leave their
  collectives at the collective timeout, the agents report what they cannot reach, the leader
  replans the node away (an ``unreachable`` change); after the heal the node rejoins as a joiner
  through the BSR, and the parameters equal the reference;
* restart mode, one node cut off entirely for longer than the TTL: the survivor starts a new
  round without it and trains on from the snapshot; the cut node's worker completes no step
  after the cut and never takes part in that round; after the heal the node's agent finds the
  job moved on, stops its stale worker, and the next round has both nodes again; the final
  parameters equal the fault-free reference;
* a minority etcd member cut off for three lease TTLs (until a lease granted at the cut expires):
  the clients fail over and keep their leases; then every member, until every agent saw the
  outage and gave its lease up and the workers trained to the end: nothing in the job notices
  (one plan, no leave, no failure), the parameters equal the reference.

Workers wait at gates (``elastic_train.py --gate STEP:FILE``), so every cut and heal hits a known
state; every fault lasts until an event (a record in etcd, a step reached, a line an agent
logs), never a sleep; every wait is a poll with a deadline, and no pass or fail depends on how
long anything took (the times printed are for reading).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import _elastic
from _elastic_job import TINY, elastic_argv, write_tiny
from _netns import NetnsJob
from _wait import wait_for
from launch_harness import SCRIPTS, base_env

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.plans import read_plan
from launcher.inject.topology import PARTITION_MODES

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

CONFIG = TINY
STEPS, BATCH, SEED, DATA_SEED, TTL = 6, 4, 3, 7, 2.0
REFERENCE = _elastic.reference_payload(CONFIG, steps=STEPS, global_batch=BATCH, seed=SEED,
                                       data_seed=DATA_SEED)


def elastic_args(job: NetnsJob, node: str, gates: dict[int, str], nnodes: str = "2",
                 comm_timeout: float = 10.0, timeout: float = 30.0) -> list[str]:
    config = write_tiny(job.topo.tmp / "model.json")
    args = job.args(node, nnodes, 1, *elastic_argv(
        config, BATCH, steps=STEPS, out=job.topo.tmp / "out", seed=SEED, data_seed=DATA_SEED,
        train=("--timeout", f"{timeout:g}", "--comm-timeout", f"{comm_timeout:g}")))
    for step, path in gates.items():
        args += ["--gate", f"{step}:{path}"]
    return args


def at_step(job: NetnsJob, devices: list[str], step: int, timeout: float = 90.0) -> dict:
    def reached():
        job.check_agents()
        recs = job.workers()
        if all(d in recs and recs[d].step >= step for d in devices):
            return {d: recs[d] for d in devices}
        return None

    return wait_for(reached, timeout, f"{devices} at step {step}", interval=0.1)


def plan_where(job: NetnsJob, pred, newer_than: int):
    """A poll for ``wait_for``: the current plan once it is newer than ``newer_than`` and
    ``pred`` holds (the agents must still run)."""
    def check():
        job.check_agents()
        plan, _ = read_plan(job.client, job.name)
        return plan if plan.version > newer_than and pred(plan) else None
    return check


def results(job: NetnsJob) -> dict[str, dict]:
    import torch

    return {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
            for p in sorted((job.topo.tmp / "out").glob("*.pt"))}


@pytest.fixture
def cluster(netns, marker):
    topo = netns()
    job = NetnsJob(topo, base_env(marker), ttl=TTL)
    yield topo, job
    job.close()


def plan_writes(client, job: str) -> list[tuple[int, object]]:
    """Every value ``plan/current`` ever held, oldest first, with the revision that wrote it
    (read back through etcd's history: nothing in the test compacts it)."""
    from etcd3 import etcdrpc


    key = schema.plan_current_key(job)
    out, rev = [], 0
    while True:
        req = etcdrpc.RangeRequest(key=key.encode(), revision=rev)
        resp = client.call("plan at a revision", lambda ch, t: etcdrpc.KVStub(ch).Range(req, t))
        if not resp.kvs:
            return out[::-1]
        kv = resp.kvs[0]
        out.append((kv.mod_revision, schema.decode(key, kv.value)))
        rev = kv.mod_revision - 1


@pytest.mark.parametrize("mode", PARTITION_MODES)
def test_the_leaders_node_cut_off_is_replanned_away_fenced_and_rejoins_after_the_heal(cluster,
                                                                                     mode):
    from hspmd_elastic.coord.api import Compare, CompareTarget, FencedWriteRejected, PutOp

    topo, job = cluster
    gates = {2: str(topo.tmp / "gate2"), 4: str(topo.tmp / "gate4")}
    for node in topo.nodes:  # --timeout: the survivor waits for the joiner's fresh worker
        job.start(node, elastic_args(job, node, gates, comm_timeout=3, timeout=90))
    devices = ["node-a:0", "node-b:0"]
    before = at_step(job, devices, 2)
    first, _ = read_plan(job.client, job.name)
    assert sorted(first.devices) == devices
    old = schema.decode(schema.leader_key(job.name),
                        job.client.get(schema.leader_key(job.name)).value)
    cut, kept = old.node, next(n for n in topo.nodes if n != old.node)
    assert first.leader == cut and first.term == old.term
    cut_at = time.time()
    topo.cut(cut, mode=mode)  # control and data: etcd and the peer are both gone
    open(gates[2], "w").close()

    away = wait_for(plan_where(job, lambda p: f"{cut}:0" not in p.devices, first.version), 30,
                    f"a plan without {cut}", interval=0.05)
    print(f"leader's node cut off ({mode}, TTL {TTL:g}s, debounce 1s): the new leader published "
          f"after {away.created_at - cut_at:.2f}s")  # shown, never checked: see benchmarks
    assert away.leader == kept and away.term > old.term
    assert sorted(away.devices) == [f"{kept}:0"]
    # A late write under the old leader's fence (what its publish_plan would send) is refused.
    with pytest.raises(FencedWriteRejected):
        job.client.fenced_txn(old.candidate_key, old.term,
                              [Compare(schema.plan_current_key(job.name), CompareTarget.VERSION,
                                       ">", 0)],
                              [PutOp(schema.plan_current_key(job.name), b"{}")])
    at_step(job, [f"{kept}:0"], 4)  # the survivor trains on in the same process, then waits
    topo.heal(cut)
    back = wait_for(plan_where(job, lambda p: f"{cut}:0" in p.devices, away.version), 90,
                    f"a plan with {cut} again", interval=0.05)
    open(gates[4], "w").close()
    job.finish(90)
    res = results(job)
    assert sorted(res) == devices
    _elastic.assert_recovered_in_memory(res, {f"{kept}:0": before[f"{kept}:0"].pid}, REFERENCE)
    rejoined = res[f"{cut}:0"]
    assert rejoined["pid"] != before[f"{cut}:0"].pid  # the stale worker never came back
    assert rejoined["plan_version"] == back.version
    assert rejoined["switches"][0]["source"] == "bsr"
    assert rejoined["switches"][0]["bsr_bytes_received"] > 0
    # From etcd's revisions: one write per version, each by the leadership of its time; after
    # the new term began, nothing carries the old one.
    writes = plan_writes(job.client, job.name)
    assert [p.version for _, p in writes] == list(range(1, back.version + 1))
    terms = [(p.leader, p.term) for _, p in writes]
    assert terms[0] == (cut, old.term) and terms[-1][1] > old.term
    new_term_at = next(rev for rev, p in writes if p.term != old.term)
    assert all(p.term != old.term for rev, p in writes if rev >= new_term_at), terms
    types = [(e.type, e.node) for e in job.events()]
    assert ("leave", cut) in types and "switch-failed" not in {t for t, _ in types}, types


@pytest.mark.parametrize("mode", PARTITION_MODES)
def test_a_data_link_cut_is_replanned_away_and_the_node_rejoins_after_the_heal(netns, marker,
                                                                               mode):
    topo = netns(nodes=("node-a", "node-b", "node-c"), etcd_members=1)
    job = NetnsJob(topo, base_env(marker), ttl=TTL)
    comm_timeout = 3.0
    try:
        gates = {2: str(topo.tmp / "gate2"), 4: str(topo.tmp / "gate4")}
        for node in topo.nodes:
            # --timeout bounds the survivors' wait for the joiner's fresh worker to start
            job.start(node, elastic_args(job, node, gates, nnodes="3",
                                         comm_timeout=comm_timeout, timeout=90))
        devices = ["node-a:0", "node-b:0", "node-c:0"]
        before = at_step(job, devices, 2)
        first, _ = read_plan(job.client, job.name)
        assert sorted(first.devices) == devices
        cut_at = time.time()
        topo.cut("node-c", "data", mode=mode)  # etcd stays reachable: node-c keeps its lease
        open(gates[2], "w").close()

        away = wait_for(plan_where(job, lambda p: "node-c:0" not in p.devices, first.version),
                        60, "a plan without node-c", interval=0.05)
        print(f"data link cut ({mode}): replanned away after {away.created_at - cut_at:.2f}s "
              f"(collective timeout {comm_timeout:g}s)")  # shown, never checked
        assert sorted(away.devices) == ["node-a:0", "node-b:0"]
        replan = wait_for(lambda: [e for e in job.events() if e.type == "replan"
                                   and schema.event_detail(e).version == away.version], 10,
                          "the replan's journal")
        [change] = schema.event_detail(replan[0]).changes
        assert (change.kind, change.node, change.devices) == (
            "unreachable", "node-c", ["node-c:0"]), change
        assert change.reason == "unreachable over the data network from node-a, node-b"
        changes = [(e.type, e.node) for e in job.events() if e.type == "unreachable"]
        assert changes == [("unreachable", "node-c")], changes
        at_step(job, ["node-a:0", "node-b:0"], 4)  # the survivors trained on, then wait
        topo.heal("node-c", "data")
        back = wait_for(plan_where(job, lambda p: "node-c:0" in p.devices, away.version), 60,
                        "a plan with node-c again", interval=0.05)
        open(gates[4], "w").close()
        job.finish(90)
        res = results(job)
        assert sorted(res) == devices
        _elastic.assert_recovered_in_memory(
            res, {d: before[d].pid for d in ("node-a:0", "node-b:0")}, REFERENCE)
        joiner = res["node-c:0"]
        assert joiner["pid"] != before["node-c:0"].pid  # its old worker left with the cut
        assert joiner["plan_version"] == back.version
        joined = joiner["switches"][0]
        assert joined["source"] == "bsr" and joined["bsr_bytes_received"] > 0, joined
        types = [e.type for e in job.events()]
        assert "switch-failed" not in types and "failure" not in types, types
    finally:
        job.close()


LEASE_LOST = "lost: no refresh succeeded for over"  # an agent's keep-alive giving up
OUTAGE = "etcd unreachable, workers keep running"  # an agent's etcd call failing


def lease_gone(job: NetnsJob, lease: int) -> bool:
    """Whether etcd says ``lease`` has expired (False while no member answers in time)."""
    try:
        return job.client.lease_ttl(lease) == -1
    except CoordinationError:
        return False


@pytest.mark.parametrize("mode", PARTITION_MODES)
def test_a_minority_etcd_member_then_every_member_cut_off_change_nothing(cluster, mode):
    topo, job = cluster
    gates = {2: str(topo.tmp / "gate2")}
    for node in topo.nodes:
        job.start(node, elastic_args(job, node, gates))
    before = at_step(job, ["node-a:0", "node-b:0"], 2)
    # The member cut is the one node-a's agent talks to (a client starts on a member drawn at
    # random): the one its process holds a connection to, as the kernel says.
    agent = job.agents["node-a"]
    assert "etcd client moved" not in agent.stderr()  # still on the member it started on
    [endpoint] = topo.etcd_connections("node-a", agent.proc.pid)
    member = topo.members[topo.etcd.endpoints.index(endpoint)].name
    moved = f"etcd client moved from member {endpoint} to "
    held = job.client.get(schema.node_key(job.name, "node-a"))
    assert held is not None and held.lease
    topo.cut(member, mode=mode)
    # The fault lasts three lease TTLs as etcd counts them: until a lease granted now expires.
    probe = job.client.grant(int(3 * TTL))
    # Its client failed over to another member (its own log line, written when another member
    # answered it) while the member was still cut.
    wait_for(lambda: moved in agent.stderr() or job.check_agents(), 60,
             f"node-a's etcd client moving off {member} ({endpoint})", interval=0.1)
    wait_for(lambda: lease_gone(job, probe), 60, f"a {3 * TTL:g}s lease granted at the cut "
             "to expire (the member still cut)", interval=0.1)
    # ... and kept its lease meanwhile: refreshed through the other members, never re-granted.
    now = job.client.get(schema.node_key(job.name, "node-a"))
    assert now.lease == held.lease and job.client.lease_ttl(held.lease) > 0
    topo.heal(member)
    # No etcd at all: every member cut until every agent saw the outage and its keep-alive gave
    # its lease up (no refresh for over a TTL), and the workers, released meanwhile, trained to
    # the end.
    def said(node: str) -> tuple[int, int]:
        err = job.agents[node].stderr()
        return err.count(OUTAGE), err.count(LEASE_LOST)

    before_cut = {node: said(node) for node in job.agents}
    for m in topo.members:
        topo.cut(m.name, mode=mode)
    open(gates[2], "w").close()
    wait_for(lambda: job.check_agents() or all(
        min(n - b for n, b in zip(said(node), before_cut[node])) > 0 for node in job.agents),
        60, "every agent seeing the outage and losing its lease while no member answers",
        interval=0.1)
    wait_for(lambda: job.check_agents() or len(list((topo.tmp / "out").glob("*.pt"))) == 2, 60,
             "the workers' results, written while no member answers", interval=0.1)
    for m in topo.members:
        topo.heal(m.name)
    job.finish(90)
    res = results(job)
    _elastic.assert_recovered_in_memory(res, {d: r.pid for d, r in before.items()}, REFERENCE)
    assert all(r["plan_version"] == 1 and len(r["switches"]) == 1 for r in res.values()), \
        {d: (r["plan_version"], len(r["switches"])) for d, r in res.items()}
    types = [e.type for e in job.events()]
    assert types.count("replan") == 1 and not {"leave", "failure", "switch-failed"} & set(types), \
        types


@pytest.mark.parametrize("mode", PARTITION_MODES)
def test_partition_fault_cuts_and_heals_links_through_the_topology_file(netns, mode):
    from launcher.inject.api import InjectError, NotOwnedError
    from launcher.inject.faults import InjectContext, Partition
    from launcher.inject.scenario import parse_fault
    from launcher.inject.topology import drop_table, load_topology

    topo = netns(etcd_members=0)
    defaults = {"detect_timeout_s": 5.0, "recover_timeout_s": 5.0}
    spec = parse_fault({"fault": "partition", "target": {"node": "node-b"}, "links": "data",
                        "mode": mode, "duration_s": 0.5}, 0, defaults, "test")
    a_dat, b_dat = topo.nodes["node-a"].data_addr, topo.nodes["node-b"].data_addr

    def state(node: str, dev: str) -> str:
        """``down``: the link is down; ``drop``: up, and dropping every packet; ``up``."""
        ns = topo.nodes[node].netns
        out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev],
                             capture_output=True, text=True, timeout=10).stdout
        if "state DOWN" in out or "UP" not in out.split(">")[0]:
            return "down"
        tables = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "tables"],
                                capture_output=True, text=True, timeout=10).stdout
        return "drop" if drop_table(dev) in tables else "up"

    with pytest.raises(NotOwnedError, match="partition needs the job's network topology"):
        Partition(spec).inject(InjectContext(None, "j"))
    assert topo.connect("node-b", a_dat) == "refused"  # linked: the peer answers at once
    ctx = InjectContext(None, "j", topology=load_topology(str(topo.topology_file())))
    inj = Partition(spec).inject(ctx)
    assert inj.detail["devices"] == ["dat"] and inj.detail["mode"] == mode
    assert state("node-b", "dat") == mode
    assert state("node-b", "ctl") == "up" and state("node-a", "dat") == "up"
    # What each mode models: a host whose own port went down learns it at once (the kernel's
    # own error, not a timeout); a dropping path (a failed switch, a firewall) tells neither
    # side anything: connects hang until the caller gives up.
    assert topo.connect("node-b", a_dat) == (
        "Network is unreachable" if mode == "down" else "timeout")
    assert topo.connect("node-a", b_dat, timeout=0.5) in (
        ("timeout", "No route to host") if mode == "down" else ("timeout",))
    inj.timers[0].action()  # the heal, as the harness fires it after duration_s
    assert state("node-b", "dat") == "up" and not ctx.cut
    assert topo.connect("node-b", a_dat) == "refused"
    every = parse_fault({"fault": "partition", "target": {"node": "node-a"}, "mode": mode}, 1,
                        defaults, "t")
    Partition(every).inject(ctx)
    assert state("node-a", "dat") == mode and state("node-a", "ctl") == mode
    ctx.close()  # heals whatever is still cut
    assert state("node-a", "dat") == "up" and state("node-a", "ctl") == "up"
    assert topo.connect("node-a", b_dat) == "refused"
    ghost = parse_fault({"fault": "partition", "target": {"node": "node-z"}}, 2, defaults, "t")
    with pytest.raises(InjectError, match="node 'node-z' is not in the topology file"):
        Partition(ghost).inject(ctx)


@pytest.mark.parametrize("required", [None, "0", "1"])
def test_a_refused_namespace_fails_where_namespaces_must_work(monkeypatch, required):
    """Unset: fails on Linux as root (this machine's own user decides), else skips; 1 fails and
    0 skips anywhere; either way in one line with the kernel's words."""
    import os
    import sys

    import _netns

    if required is None:
        monkeypatch.delenv(_netns.REQUIRE_ENV, raising=False)
        fails = sys.platform.startswith("linux") and os.geteuid() == 0
    else:
        monkeypatch.setenv(_netns.REQUIRE_ENV, required)
        fails = required == "1"
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(outcome) as ended:
        _netns.refused(_netns.NetnsRefused("mount --make-shared /run/netns failed:\n"
                                           "Operation not permitted"))
    msg = str(ended.value.msg)
    assert msg.startswith("network namespaces refused by the kernel") and msg.endswith(
        ": mount --make-shared /run/netns failed: Operation not permitted"), msg  # one line
    assert ("where they are required" in msg) == fails, msg


def test_a_partition_mode_that_does_not_exist_is_one_line(tmp_path, capsys):
    from launcher.inject.command import main

    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"schema": 1, "kind": "fault_scenario", "faults": [
        {"fault": "partition", "target": {"node": "a"}, "mode": "unplug"}]}))
    assert main(["--scenario", str(scenario), "--job", "j", "--etcd-endpoints",
                 "127.0.0.1:9"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "Error" in ln]
    assert len(err) == 1 and "mode must be one of down, drop, got 'unplug'" in err[0], err


def test_inject_cli_rejects_a_bad_topology_file_in_one_line(tmp_path, capsys):
    from launcher.inject.command import main

    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"schema": 1, "kind": "fault_scenario", "faults": [
        {"fault": "partition", "target": {"node": "a"}}]}))
    bad = tmp_path / "topology.json"
    bad.write_text(json.dumps({"schema": 1, "kind": "netns_topology",
                               "nodes": {"a": {"netns": "x"}}}))
    assert main(["--scenario", str(scenario), "--job", "j", "--etcd-endpoints",
                 "127.0.0.1:9", "--topology", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("bad topology" in ln and "control must be a namespace or device name" in ln
               for ln in err), err


@pytest.mark.parametrize("mode", PARTITION_MODES)
def test_restart_mode_cut_off_node_leaves_a_round_and_joins_the_next_after_the_heal(cluster,
                                                                                    mode):
    import torch

    from inject_train import reference_params

    topo, job = cluster
    # Paced (0.25 s a step): the round without node-b must still be training when node-b
    # comes back, a second or two after the heal (which waits for that round's first step),
    # so it keeps well over 5 s of steps left; the steps after node-b's return prove nothing
    # more, so there are few of them.
    steps, batch = 30, 12
    progress, snapshot = topo.tmp / "progress", topo.tmp / "snapshot.pt"
    script = [str(SCRIPTS / "inject_train.py"), "--steps", str(steps), "--batch", str(batch),
              "--snapshot", str(snapshot), "--progress-dir", str(progress),
              "--step-sleep", "0.25"]
    for node in topo.nodes:
        job.start(node, job.args(node, "1:2", 1, "--max-restarts", "3", *script))

    def lines() -> list[dict]:
        out = []
        for path in progress.glob("rank*.jsonl"):
            out += [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return out

    def reached(pred):
        def check():
            job.check_agents()
            return [ln for ln in lines() if pred(ln)] or None
        return check

    both = wait_for(reached(lambda ln: ln["rank"] == 1 and ln["step"] >= 3), 90,
                    "both nodes training", interval=0.1)
    r0 = both[0]["round"]
    cut_at = time.time()
    topo.cut("node-b", mode=mode)
    # The last step node-b's worker had reported when its links went: it may still report the
    # one step whose all-reduce ended before the cut, never one after.
    at_cut = max(ln["step"] for ln in lines() if ln["round"] == r0 and ln["rank"] == 1)

    def round_without_b():
        job.check_agents()
        kv = job.client.get(schema.rdzv_state_key(job.name))
        st = schema.decode(kv.key, kv.value) if kv is not None else None
        return st if st is not None and st.round > r0 and st.state == "closed" else None

    closed = wait_for(round_without_b, 60, "a round without node-b", interval=0.05)
    assert [p.node for p in closed.participants] == ["node-a"], closed
    r1 = closed.round
    first = wait_for(reached(lambda ln: ln["round"] == r1), 60, "training in that round",
                     interval=0.05)
    print(f"restart mode, node cut off ({mode}, TTL {TTL:g}s): round {r1} without it closed "
          f"{closed.at - cut_at:.2f}s after the cut, first step {first[0]['t'] - cut_at:.2f}s")
    assert all(ln["rank"] == 0 for ln in lines() if ln["round"] == r1)  # without node-b
    # The cut node's agent must have seen the outage (an etcd call that failed, not one still
    # blocked in its timeout) before the heal, or the heal would hide it.
    wait_for(lambda: "etcd unreachable, workers keep running" in
             job.agents["node-b"].stderr(), 60, "node-b's agent seeing the outage",
             interval=0.1)
    topo.heal("node-b")
    wait_for(reached(lambda ln: ln["round"] > r1 and ln["rank"] == 1), 90,
             "node-b back in a later round", interval=0.1)
    job.finish(120)
    # The cut node's worker completed no step after the cut: its last step is at most the one
    # in flight at the cut, and no later than the snapshot round r1 resumed from (rank 0's last
    # step of round r0: a step of node-b's needs rank 0's all-reduce).
    stale = max(ln["step"] for ln in lines() if ln["round"] == r0 and ln["rank"] == 1)
    kept = max(ln["step"] for ln in lines() if ln["round"] == r0 and ln["rank"] == 0)
    resumed = min(ln["step"] for ln in lines() if ln["round"] == r1) - 1
    assert stale <= at_cut + 1 and stale <= resumed == kept, (at_cut, stale, kept, resumed)
    final = torch.load(snapshot, map_location="cpu")
    assert final["step"] == steps
    for name, value in reference_params(steps, batch).items():
        torch.testing.assert_close(final["model"][name], value, rtol=1e-9, atol=1e-12)
    err = job.agents["node-b"].stderr()
    assert "etcd unreachable, workers keep running" in err, err[-3000:]

