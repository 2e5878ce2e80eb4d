"""A real Slurm (Debian's ``slurm-wlm``) on the network-namespace topology of ``tests/_netns.py``,
with accounting: the cluster the real-Slurm elastic tests run their ``sbatch`` jobs on.

Each Slurm node is a namespace of a ``Topology`` (``n1``, ``n2``, ...) running one ``slurmd -N
<node>`` (``ip netns exec``), whose ``NodeAddr`` is the node's control address; ``slurmctld``
runs in this host's namespace and listens on the topology's one host veth (the control bridge's
``.254``), so every daemon talks over addresses the topology made. Accounting: a private
``mariadbd`` (its own datadir from ``mariadb-install-db``, a unix socket under the cluster's
directory, ``--skip-networking``) under a ``slurmdbd`` on loopback, so ``sacct`` reads real job
records. ``auth/none`` and ``cred/none`` (no munge key to distribute); every state, spool and log
file lives under the cluster's directory. Promises:

* ``start`` returns once every ``slurmd`` registered and is idle (bounded), with the cluster
  registered in ``slurmdbd`` (``sacctmgr add cluster``) before ``slurmctld`` starts;
* ``SlurmdTimeout`` is short (``SLURMD_TIMEOUT_S``): a node whose ``slurmd`` is killed is set
  DOWN within seconds, which is what tells ``srun --no-kill`` that the node's task is gone (it
  would wait for the task's exit otherwise), and ``AuthInfo=cred_expire`` is short, since a
  requeued job may not start again before its last credential expires;
* ``kill_node`` SIGKILLs every process in the node's namespace (``ip netns pids``): its
  ``slurmd``, the ``slurmstepd``s it forked and every task under them, as a power loss would;
* ``close`` (the fixture's finalizer, also after a failed ``start``) stops every daemon by pid,
  SIGKILLs whatever is left in the nodes' namespaces, stops ``slurmdbd`` and ``mariadbd``; the
  ``Topology``'s own finalizer then deletes the namespaces, ``/etc/netns/<ns>`` and the veth.
  Every wait is bounded. Nothing here uses cgroups (``proctrack/linuxproc``, ``task/none``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from _netns import Topology, ip
from _wait import wait_for

SLURMD_PORT = 6818  # the same in every namespace: each slurmd has a network of its own
SLURMD_TIMEOUT_S = 6
CRED_EXPIRE_S = 5
DAEMON_WAIT_S = 60.0
CMD_TIMEOUT_S = 20.0
TOOLS = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "sinfo", "scontrol", "sacct",
         "sacctmgr", "mariadbd", "mariadb-install-db")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM ``proc``'s session, then SIGKILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def netns_pids(netns: str) -> list[int]:
    """Every process in namespace ``netns`` (``ip netns pids``)."""
    res = ip("netns", "pids", netns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def kill_netns(netns: str, rounds: int = 20) -> None:
    """SIGKILL every process in ``netns`` until none is left (bounded: a fork racing the kill
    is caught by the next round)."""
    for _ in range(rounds):
        pids = netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    raise AssertionError(f"processes left in namespace {netns}: {netns_pids(netns)}")



def slurm_conf(root, cluster: str, ctld_host: str, ctld_port: int, names, nodes: str,
               accounting: str = "AccountingStorageType=accounting_storage/none",
               extra: str = "") -> str:
    """A test cluster's slurm.conf: auth/none, state, spool and logs under ``root``, one
    partition of ``names`` (``nodes``: their NodeName lines), plus ``accounting`` and ``extra``
    lines."""
    return f"""ClusterName={cluster}
SlurmctldHost={ctld_host}
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
{accounting}
MpiDefault=none
ReturnToService=2
{extra}
{nodes}
PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP
"""

class Accounting:
    """A private ``mariadbd`` (unix socket only) and a ``slurmdbd`` on loopback over it."""

    def __init__(self, root: Path, conf_dir: Path):
        self.root, self.conf_dir = root, conf_dir
        self.socket = root / "mysqld.sock"
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, MYSQL_UNIX_PORT=str(self.socket))

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        with open(self.root / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        data = self.root / "mysql"
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}",
                        "--user=root", "--skip-test-db"], check=True, capture_output=True,
                       timeout=60)
        db = self._spawn(["mariadbd", "--no-defaults", f"--datadir={data}",
                          f"--socket={self.socket}", "--skip-networking", "--user=root",
                          f"--pid-file={self.root / 'mysqld.pid'}",
                          f"--log-error={self.root / 'mysqld.log'}",
                          "--innodb-buffer-pool-size=16M"], "mariadbd")
        wait_for(lambda: self.socket.exists(), DAEMON_WAIT_S, "mariadbd's socket", proc=db,
                 interval=0.05)
        conf = self.conf_dir / "slurmdbd.conf"  # slurmdbd reads it next to SLURM_CONF
        conf.write_text(f"""AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.port}
SlurmUser=root
PidFile={self.root}/slurmdbd.pid
LogFile={self.root}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
""")
        conf.chmod(0o600)

    def start_dbd(self, env: dict[str, str], cluster: str) -> None:
        self.env = dict(env, MYSQL_UNIX_PORT=str(self.socket))
        dbd = self._spawn(["slurmdbd", "-D"], "slurmdbd")

        def registered() -> bool:
            res = subprocess.run(["sacctmgr", "-i", "add", "cluster", cluster], env=self.env,
                                 capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
            return res.returncode == 0 or "already exists" in res.stdout + res.stderr

        wait_for(registered, DAEMON_WAIT_S, "slurmdbd to register the cluster", proc=dbd,
                 interval=0.1)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


class NetnsSlurm:
    """A Slurm cluster whose nodes are ``topo``'s nodes (see the module docstring)."""

    def __init__(self, topo: Topology, root: Path, cpus: int = 2):
        missing = [t for t in TOOLS if not shutil.which(t)]
        assert not missing, f"{', '.join(missing)} missing (Debian's slurm-wlm, slurmdbd and " \
                            "mariadb-server, which scripts/_env.sh installs)"
        self.topo, self.root = topo, root
        self.nodes = list(topo.nodes)
        self.cluster = f"hspmd{topo.suffix}"
        for sub in ("state", "log", "etc", "db", *(f"spool/{n}" for n in self.nodes)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.ctld_addr = topo.control(254)  # this host's veth on the control bridge
        self.ctld_port = free_port()
        self.conf = root / "etc" / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.accounting = Accounting(root / "db", root / "etc")
        self.ctld: Optional[subprocess.Popen] = None
        self.slurmds: dict[str, subprocess.Popen] = {}
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={topo.nodes[n].control_addr} "
            f"Port={SLURMD_PORT} CPUs={cpus} State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(slurm_conf(
            root, self.cluster, f"localhost({self.ctld_addr})", self.ctld_port, self.nodes, nodes,
            accounting=f"AccountingStorageType=accounting_storage/slurmdbd\n"
                       f"AccountingStorageHost=localhost\n"
                       f"AccountingStoragePort={self.accounting.port}\nJobCompType=jobcomp/none",
            extra=f"SlurmdPort={SLURMD_PORT}\nAuthInfo=cred_expire={CRED_EXPIRE_S}\n"
                  f"SlurmdTimeout={SLURMD_TIMEOUT_S}\nInactiveLimit=0\nKillWait=5\n"
                  "MessageTimeout=3\nSchedulerParameters=bf_interval=1\nMinJobAge=600"))

    # ---------------------------------------------------------------------------- lifecycle
    def start(self) -> "NetnsSlurm":
        try:
            self.accounting.start()
            self.accounting.start_dbd(self.env, self.cluster)
            with open(self.root / "log" / "slurmctld.out", "wb") as out:
                self.ctld = subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)],
                                             env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            for n in self.nodes:
                self.start_slurmd(n)
            wait_for(lambda: self._check() or self.states().count("idle") == len(self.nodes),
                     DAEMON_WAIT_S, lambda: f"every slurmd idle: {self.states()}\n{self.logs()}",
                     interval=0.2)
        except BaseException:
            self.close()
            raise
        return self

    def start_slurmd(self, node: str) -> subprocess.Popen:
        """``slurmd -N node`` as the node: in its network namespace (``nsenter --net``), in a
        UTS namespace whose host name is ``node`` and a mount namespace where ``/etc/hosts``,
        ``resolv.conf`` and ``nsswitch.conf`` are the topology's (``/etc/netns/<ns>``): what
        ``ip netns exec`` does, except that it keeps this host's ``/sys`` (``ip netns exec``
        remounts it, hiding the cgroup hierarchies without which slurmd refuses to start). The
        host name matters: ``srun`` tells slurmctld its short host name, which slurmctld maps
        to the node's ``NodeAddr`` to reach ``srun`` (node failures, step ends)."""
        netns = self.topo.nodes[node].netns
        etc = Path("/etc/netns") / netns
        binds = " && ".join(f"mount --bind {etc / f} /etc/{f}" for f in
                            ("hosts", "resolv.conf", "nsswitch.conf")
                            if (etc / f).exists() and Path("/etc", f).exists())
        inner = f"{binds} && hostname {node} && exec slurmd -D -f {self.conf} -N {node}"
        with open(self.root / "log" / f"slurmd-{node}.out", "wb") as out:
            self.slurmds[node] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", inner], env=self.env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self.slurmds[node]

    def _check(self) -> None:
        assert self.ctld is not None and self.ctld.poll() is None, \
            f"slurmctld exited:\n{self.logs()}"
        for proc in self.accounting.procs:
            assert proc.poll() is None, f"{proc.args[0]} exited:\n{self.logs()}"

    def close(self) -> None:
        """Every daemon stopped, every process in the nodes' namespaces killed (bounded)."""
        for proc in self.slurmds.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for n in self.nodes:
            with contextlib.suppress(AssertionError):
                kill_netns(self.topo.nodes[n].netns)
        if self.ctld is not None:
            _stop(self.ctld)
        self.accounting.close()

    # ---------------------------------------------------------------------------- commands
    def run(self, *argv: str, timeout: float = CMD_TIMEOUT_S, check: bool = True,
            env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), env={**(env or self.env), "SLURM_CONF": str(self.conf)},
                             capture_output=True, text=True, timeout=timeout, cwd=str(self.root))
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {res.returncode}: "
                                 f"{res.stdout[-2000:]}{res.stderr[-2000:]}")
        return res

    def states(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return out[1::2]

    def node_state(self, node: str) -> str:
        out = self.run("sinfo", "-h", "-n", node, "-N", "-o", "%t", check=False).stdout
        return out.strip()

    def sbatch(self, script: Path, *args: str, env: dict[str, str]) -> int:
        out = self.run("sbatch", "--parsable", f"--output={self.root}/slurm-%j.out", *args,
                       str(script), env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (a missing job: {})."""
        res = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout)) if res.returncode == 0 else {}

    def wait_job_state(self, job_id: int, states: Sequence[str], timeout: float) -> dict:
        def reached():
            self._check()
            fields = self.job(job_id)
            return fields if fields.get("JobState") in states else None

        return wait_for(reached, timeout,
                        lambda: f"job {job_id} in {'/'.join(states)}: {self.job(job_id)}\n"
                                + self.job_output(job_id)[-3000:], interval=0.2)

    def job_output(self, job_id: int) -> str:
        path = self.root / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def sacct(self, job_id: int) -> list[dict[str, str]]:
        """The job's records in the accounting database: the job, then its steps."""
        fields = ("JobID", "State", "ExitCode", "NodeList")
        out = self.run("sacct", "-n", "-P", "-D", "-j", str(job_id), "-o",
                       ",".join(fields)).stdout
        return [dict(zip(fields, ln.split("|"))) for ln in out.splitlines() if ln.strip()]

    def kill_node(self, node: str) -> None:
        """SIGKILL everything in ``node``'s namespace: its slurmd, step daemons and tasks."""
        kill_netns(self.topo.nodes[node].netns)

    def logs(self) -> str:
        paths = sorted((self.root / "log").glob("*")) + [self.root / "db" / "slurmdbd.log"]
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in paths if p.exists())
