"""``hspmd-launch`` under a real Slurm (Debian's ``slurm-wlm``): one ``slurmctld`` and one
``slurmd`` per simulated node on this host (Debian's ``slurmd -N NODENAME`` runs several, each
on its own port), ``auth/none``, state and spool under the test's directory, every daemon
stopped and removed in a finalizer.

* One node, no flags but the script's: the step's node name becomes the node id, the job id
  the rendezvous id, and the rendezvous the embedded etcd of a one-node c10d job.
* Two nodes (two real ``srun`` tasks on two slurmd's), an external etcd given by flag (the flag
  wins): node ranks from ``SLURM_NODEID``, ranks 0-3 in node order, one rendezvous under
  ``slurm-<job id>``.

A node's slurmd killed mid-run, spares, ``sacct`` and ``sbatch --requeue`` are in
tests/test_slurm_elastic.py, on a Slurm whose nodes are network namespaces (tests/_slurm.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from _wait import wait_for
from _slurm import slurm_conf
from launch_harness import LAUNCH, base_env

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

NODES = ("n1", "n2")
TRAIN = """\
import os
os.write(1, (f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} node "
             f"{os.environ['HSPMD_NODE_ID']} group {os.environ['GROUP_RANK']} "
             f"job {os.environ.get('TORCHELASTIC_RUN_ID', '?')}\\n").encode())
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Slurm:
    """A real Slurm cluster of ``NODES`` on this host."""

    def __init__(self, root: Path):
        for tool in ("slurmctld", "slurmd", "srun", "sinfo", "scontrol"):
            assert shutil.which(tool), f"{tool} is missing (Debian's slurm-wlm, which " \
                                       "scripts/test installs)"
        self.root = root
        ctld, *ports = _free_ports(1 + len(NODES))
        for sub in ("state", "log", "spool"):
            (root / sub).mkdir(parents=True)
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} "
                          f"CPUs=2 State=UNKNOWN" for n, p in zip(NODES, ports))
        self.conf = root / "slurm.conf"
        self.conf.write_text(slurm_conf(root, "hspmdtest", "localhost(127.0.0.1)", ctld, NODES,
                                        nodes))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []
        try:
            self.procs.append(subprocess.Popen(
                ["slurmctld", "-D", "-f", str(self.conf)], env=self.env,
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for n in NODES:
                self.procs.append(subprocess.Popen(
                    ["slurmd", "-D", "-f", str(self.conf), "-N", n], env=self.env,
                    start_new_session=True, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
            wait_for(self._idle, 60, "every slurmd registered and idle", interval=0.2)
        except BaseException:
            self.close()
            raise

    def _idle(self) -> bool:
        for p in self.procs:
            assert p.poll() is None, (p.args, self.logs())
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                             capture_output=True, text=True, timeout=10).stdout.split()
        return out.count("idle") == len(NODES)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted((self.root / "log").glob("*")))

    def srun(self, nodes: int, argv: list[str], env: dict, timeout: float = 120
             ) -> subprocess.CompletedProcess:
        return subprocess.run(["srun", "-N", str(nodes), "-n", str(nodes),
                               "--ntasks-per-node=1", *argv], env={**env, **{
                                   "SLURM_CONF": str(self.conf)}},
                              capture_output=True, text=True, timeout=timeout,
                              cwd=str(self.root))

    def close(self) -> None:
        """Stop every daemon (and whatever it started: its session), bounded."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def slurm(tmp_path):
    cluster = Slurm(tmp_path / "slurm")
    try:
        yield cluster
    finally:
        cluster.close()


def _lines(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return sorted(ln for ln in out.stdout.splitlines() if ln.startswith("rank "))


def test_one_node_under_srun_needs_no_flag(slurm, marker, tmp_path):
    (slurm.root / "train.py").write_text(TRAIN)
    out = slurm.srun(1, [LAUNCH, "--nproc-per-node", "2", "train.py"],
                     base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    lines = _lines(out)
    job = lines[0].rsplit(" ", 1)[1]
    assert job.startswith("slurm-") and job[len("slurm-"):].isdigit(), lines
    assert lines == [f"rank {r} of 2 node n1 group 0 job {job}" for r in range(2)]


def test_two_nodes_under_srun_meet_at_the_etcd_a_flag_names(slurm, marker, tmp_path,
                                                            etcd_server):
    (slurm.root / "train.py").write_text(TRAIN)
    out = slurm.srun(2, [LAUNCH, "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                         "--rdzv-endpoint", etcd_server.endpoint_str, "train.py"],
                     base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    lines = _lines(out)
    job = lines[0].rsplit(" ", 1)[1]
    assert lines == [f"rank {r} of 4 node {NODES[r // 2]} group {r // 2} job {job}"
                     for r in range(4)], lines
    with EtcdClient(etcd_server.endpoints, timeout=5.0) as client:
        kv = client.get(schema.rdzv_state_key(job))
        state = schema.decode(kv.key, kv.value)
    assert state.state == "succeeded" and [p.node for p in state.participants] == list(NODES)
