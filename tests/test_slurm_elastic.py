"""``sbatch`` jobs of ``hspmd-launch`` on a real Slurm whose nodes are network namespaces.

The cluster (``tests/_slurm.py``, one per module): three Slurm nodes ``n1``-``n3``, each a
namespace of its own with its own addresses on the topology's bridges and one ``slurmd -N nX``,
``slurmctld`` on this host's veth of the control bridge, accounting through ``slurmdbd`` on a
private ``mariadbd``; a one-member etcd in a namespace of its own on the control bridge.

The rendezvous is that etcd, given by flag (``--hspmd-etcd-endpoints``), not the embedded etcd
Slurm's environment would start on the first node: an elastic job must outlive any of its
nodes, and the embedded store dies with the first one (the docs recommend an external etcd for
elastic jobs for this reason); and this process reads the job's step counter and plans from
etcd over the control bridge, the only one it is on. Everything else comes from Slurm's
environment: node ids (``SLURMD_NODENAME``), node ranks, ``slurm-<job id>`` as the rendezvous
id, one worker per node.

* Elastic, one spare: ``sbatch -N 3 --no-kill`` runs ``srun --no-kill hspmd-launch --nnodes 2
  --hspmd-elastic``: the script of docs/operations.md "Running under Slurm", its ``#SBATCH``
  options and its ``srun`` command up to ``--hspmd-elastic`` read from the page (the etcd
  endpoints are this cluster's; ``--gpus-per-node`` is left out: no GPU here). Two nodes are
  planned, the third registers as a hot spare. When every planned worker has reported step
  ``PAUSE`` in etcd (where it waits), a planned node other than ``n1`` (the batch host) loses
  everything in its namespace: its slurmd, step daemons, agent and worker (SIGKILL). The
  survivor switches in memory (same pid), the spare is in the next plan and gets its state by
  BSR, the parameters at the end equal the fault-free reference (float64, 1e-9), Slurm sets the
  node DOWN, ``srun --no-kill`` ends the step without it and ``sacct -D`` records the job
  RESIZING on the three nodes, then COMPLETED on the two others.
* Restart mode with ``sbatch --requeue``: the workers of the first run exit 1 (on purpose: no
  ``SLURM_RESTART_COUNT`` yet), the batch script requeues its own job (the docs' ``scontrol
  requeue`` line, as a requeue on node failure would); the second run, the same
  ``SLURM_JOB_ID`` with ``SLURM_RESTART_COUNT=1``, meets under the same rendezvous id in the
  same etcd, in a new round, and completes; ``sacct -D`` shows the REQUEUED run, then the
  COMPLETED one.

The second test runs after the first on the same cluster, with the killed node DOWN: it uses
the two others.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

import _elastic
from _elastic_job import BATCH, PAUSE, REFERENCE, STEPS, elastic_argv, write_tiny
from _netns import topologies
from _slurm import NetnsSlurm
from _wait import wait_for
from launch_harness import LAUNCH, base_env

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.plans import read_plan
from launcher.slurm import expand_hostlist

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

NODES = ("n1", "n2", "n3")
JOB_TIMEOUT_S = 120.0
DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def docs_script() -> tuple[list[str], list[str]]:
    """The sbatch script of docs/operations.md "Running under Slurm": its ``#SBATCH`` options
    and its ``srun`` command line, as tokens."""
    section = DOC.read_text().split("## Running under Slurm", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(#!/bin/bash\n.*?)```", section, re.S)
    assert found, "no sbatch script in docs/operations.md's Slurm section"
    lines = found.group(1).replace("\\\n", " ").splitlines()
    options = [t for ln in lines if ln.startswith("#SBATCH") for t in shlex.split(ln)[1:]]
    srun = [shlex.split(ln) for ln in lines if ln.startswith("srun ")]
    assert len(srun) == 1, lines
    return options, srun[0]


def elastic_script(etcd: str, argv: list[str]) -> tuple[str, str]:
    """The docs' script for this cluster: its ``#SBATCH`` line (no GPUs asked), and its srun
    command up to ``--hspmd-elastic`` with this cluster's etcd, then test-only flags (a short
    lease, the agents' waits), then ``argv`` (from ``--hspmd-elastic`` on)."""
    options, srun = docs_script()
    assert "--no-kill" in options and "--no-kill" in srun and "--hspmd-elastic" in srun, \
        (options, srun)
    assert argv[0] == "--hspmd-elastic", argv
    head = srun[:srun.index("--hspmd-elastic")]
    head[head.index("hspmd-launch")] = LAUNCH
    head[head.index("--hspmd-etcd-endpoints") + 1] = etcd
    options = [o for o in options if not o.startswith("--gpus-per-node")]
    test_only = ["--hspmd-lease-ttl", "2", "--shutdown-timeout", "5", "--rdzv-conf",
                 "join_timeout=60"]
    return "#SBATCH " + shlex.join(options), shlex.join([*head, *test_only, *argv])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm-netns")
    with topologies(base) as make:
        topo = make(nodes=NODES, etcd_members=1)
        slurm = NetnsSlurm(topo, base / "slurm").start()
        try:
            yield slurm
        finally:
            slurm.close()


@pytest.fixture
def etcd(cluster):
    with EtcdClient(cluster.topo.etcd.endpoints, timeout=5.0) as client:
        yield client


def _script(path, header: str, body: str):
    path.write_text(f"#!/bin/bash\n{header}\n{body}\n")
    return path


def _end(cluster: NetnsSlurm, job_id: int, state: str = "COMPLETED") -> list[dict]:
    """Wait for the job's end; it must be ``state``; its sacct rows once recorded as such."""
    fields = cluster.wait_job_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                             "NODE_FAIL", "OUT_OF_MEMORY"), JOB_TIMEOUT_S)
    assert fields["JobState"] == state, (fields, cluster.job_output(job_id)[-6000:])
    def recorded():
        rows = cluster.sacct(job_id)
        runs = [r for r in rows if r["JobID"] == str(job_id)]  # not its steps
        return rows if runs and runs[-1]["State"] == state else None

    return wait_for(recorded, 30, lambda: f"sacct of job {job_id}: {cluster.sacct(job_id)}",
                    interval=0.2)


def test_elastic_job_with_a_spare_survives_a_killed_node(cluster, etcd, tmp_path, marker):
    out, release = tmp_path / "out", tmp_path / "release"
    model = write_tiny(tmp_path / "model.json")
    argv = elastic_argv(model, BATCH, steps=STEPS, out=out, train=(
        "--pause-at", str(PAUSE), "--release", str(release), "--timeout", "30"))
    header, srun = elastic_script(cluster.topo.endpoint_str, argv)
    assert "-N 3" in header and "--nnodes 2" in srun, (header, srun)
    script = _script(tmp_path / "elastic.sh", header, srun)
    job_id = cluster.sbatch(script, env=base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    name = f"slurm-{job_id}"
    try:
        def paused():
            recs = {}
            for kv in etcd.get_prefix(schema.workers_prefix(name)):
                node, lr = kv.key[len(schema.workers_prefix(name)):].split("/")
                recs[f"{node}:{lr}"] = schema.decode(kv.key, kv.value)
            nodes = {kv.key for kv in etcd.get_prefix(schema.nodes_prefix(name))}
            if len(nodes) < len(NODES):
                return None
            plan, _ = read_plan(etcd, name)
            if plan is None:
                return None
            planned = sorted(plan.devices)
            if len(planned) == 2 and all(d in recs and recs[d].step >= PAUSE for d in planned):
                return {d: recs[d].pid for d in planned}
            return None

        pids = wait_for(paused, JOB_TIMEOUT_S,
                        lambda: f"2 planned workers at step {PAUSE}, 3 nodes registered:\n"
                                + cluster.job_output(job_id)[-4000:], interval=0.25)
        planned = sorted(d.split(":")[0] for d in pids)
        victim = [n for n in planned if n != "n1"][-1]
        survivor = next(n for n in planned if n != victim)
        spare = next(n for n in NODES if n not in planned)
        cluster.kill_node(victim)
        wait_for(lambda: f"{spare}:0" in {kv.key.rsplit("/", 2)[-2] + ":0" for kv in
                                         etcd.get_prefix(schema.workers_prefix(name))},
                 60, f"the spare {spare}'s worker to start")
        release.touch()
        rows = _end(cluster, job_id)
        # Accounting: the job on three nodes until Slurm took the lost one out (RESIZING), then
        # on the two others to its end.
        runs = [(r["State"], r["ExitCode"], expand_hostlist(r["NodeList"]))
                for r in rows if r["JobID"] == str(job_id)]
        assert runs == [("RESIZING", "0:0", list(NODES)),
                        ("COMPLETED", "0:0", sorted([survivor, spare]))], rows
        assert cluster.node_state(victim).startswith("down"), cluster.node_state(victim)

        import torch

        results = {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
                   for p in sorted(out.glob("*.pt"))}
        assert sorted(results) == sorted([f"{survivor}:0", f"{spare}:0"]), sorted(results)
        _elastic.assert_recovered_in_memory(results, {f"{survivor}:0": pids[f"{survivor}:0"]},
                                            REFERENCE)
        joined = results[f"{spare}:0"]["switches"]
        assert len(joined) == 1 and joined[0]["source"] == "bsr", joined
        plan, _ = read_plan(etcd, name)
        assert sorted(plan.devices) == sorted([f"{survivor}:0", f"{spare}:0"]), plan.devices
        assert plan.version >= 2
    finally:
        cluster.run("scancel", str(job_id), check=False)


RESTART_TRAIN = """\
import json, os, sys
rec = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT",
                                      "TORCHELASTIC_RUN_ID", "HSPMD_NODE_ID", "RANK",
                                      "WORLD_SIZE")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(rec) + "\\n")
sys.exit(0 if os.environ.get("SLURM_RESTART_COUNT") else 1)  # the first run fails
"""


def test_restart_mode_requeued_job_meets_again_under_its_job_id(cluster, etcd, tmp_path,
                                                                 marker):
    train, log = tmp_path / "train.py", tmp_path / "runs.jsonl"
    train.write_text(RESTART_TRAIN)
    # Two idle nodes (after the elastic test: the two it did not kill, once no longer completing).
    up = wait_for(lambda: (idle := [n for n in NODES if cluster.node_state(n) == "idle"])[1:]
                  and idle, 30, lambda: f"two idle nodes: {cluster.states()}", interval=0.2)
    script = _script(tmp_path / "restart.sh",
                     f"#SBATCH -N 2 --ntasks-per-node=1 --requeue -w {','.join(up[:2])}", (
                         f"srun {LAUNCH} --hspmd-etcd-endpoints {cluster.topo.endpoint_str} "
                         f"--max-restarts 0 --hspmd-lease-ttl 2 --shutdown-timeout 5 "
                         f"{train} {log} "  # the docs' requeue-once line:
                         '|| { [ -z "${SLURM_RESTART_COUNT:-}" ] && '
                         'scontrol requeue "$SLURM_JOB_ID"; exit 1; }'))
    job_id = cluster.sbatch(script, env=base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    try:
        rows = _end(cluster, job_id)
        assert [r["State"] for r in rows if r["JobID"] == str(job_id)] == \
            ["REQUEUED", "COMPLETED"], rows
        runs = [json.loads(ln) for ln in log.read_text().splitlines()]
        first = [r for r in runs if r["SLURM_RESTART_COUNT"] is None]
        second = [r for r in runs if r["SLURM_RESTART_COUNT"] == "1"]
        assert len(first) == 2 and len(second) == 2 and len(runs) == 4, runs
        assert {r["TORCHELASTIC_RUN_ID"] for r in runs} == {f"slurm-{job_id}"}, runs
        assert {r["SLURM_JOB_ID"] for r in runs} == {str(job_id)}, runs
        assert sorted(r["HSPMD_NODE_ID"] for r in second) == sorted(up[:2]), runs
        kv = etcd.get(schema.rdzv_state_key(f"slurm-{job_id}"))
        state = schema.decode(kv.key, kv.value)
        assert state.state == "succeeded" and state.round >= 1, state
        assert sorted(p.node for p in state.participants) == sorted(up[:2]), state
    finally:
        cluster.run("scancel", str(job_id), check=False)
