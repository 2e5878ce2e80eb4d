"""Which processes a fault may signal: only the job's own, proven from the process itself.

A pid comes from a record in etcd (``workers/<node>/<local_rank>``, ``nodes/<node>``), and anyone
who can write the job's prefix can write one naming any process. So a record only says where to
look; the process must prove it is the job's:

* a worker: its environment (``/proc/<pid>/environ``, as it was when the process started) holds
  the job id (``HSPMD_JOB_ID`` or ``TORCHELASTIC_RUN_ID``) and the node id and local rank of the
  record that names it (``HSPMD_NODE_ID``, ``LOCAL_RANK``), as the node agent sets them for
  every worker (``launcher/node/env.py``);
* an agent: its command line names the job (``--rdzv-id JOB``, ``--rdzv_id=JOB``, ...), or its
  environment holds it (``PET_RDZV_ID``, ``HSPMD_JOB_ID``, ``TORCHELASTIC_RUN_ID``); an agent's
  own environment does not hold the job id (``os.environ`` set at run time never reaches
  ``/proc/<pid>/environ``, so exporting it there would prove nothing), and a ``--standalone``
  agent's generated id is in neither, so it is refused; with ``--hspmd-node-id`` on its
  command line, that id must be the record's node;
* never this process or one it runs under (the harness and the shell that started it may well
  carry the job id), never pid 0 or 1, never a zombie.

No parent or child is ever looked at. A process that cannot be read (``AccessDenied``: another
user's) is refused; one that is gone is ``TargetNotFound`` (the harness retries a little, the
job may be restarting it); one that fails the proof is ``Refused``, with the reason, and is
reported as such. The proven process is signalled through psutil, which checks that its pid was
not reused in between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import psutil

from hspmd_elastic.contract.env import JOB_ID_ENV, NODE_ID_ENV
from hspmd_elastic.contract.text import bounded
from hspmd_elastic.contract import schema
from hspmd_elastic.contract.schema import decode_or_none, decode_valid
from launcher.inject.api import TargetNotFound

log = logging.getLogger(__name__)

WORKER_JOB_ENV = (JOB_ID_ENV, "TORCHELASTIC_RUN_ID")
AGENT_JOB_ENV = ("PET_RDZV_ID", *WORKER_JOB_ENV)
AGENT_JOB_FLAGS = ("--rdzv-id", "--rdzv_id")
AGENT_NODE_FLAGS = ("--hspmd-node-id", "--hspmd_node_id")


class Refused(TargetNotFound):
    """A record names a process that is not provably the job's: it is not signalled."""


@dataclass(frozen=True)
class WorkerTarget:
    node: str
    local_rank: int
    rank: int
    pid: int
    process: Optional[psutil.Process] = None


def _open(pid: Any, what: str) -> psutil.Process:
    """The live process ``pid``; Refused for a pid no job can own, TargetNotFound if gone."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise Refused(f"{what}: pid {pid!r} is not a process a job can own")
    me = psutil.Process()
    if pid == me.pid or pid in {p.pid for p in me.parents()}:
        raise Refused(f"{what}: pid {pid} is this harness or a process it runs under")
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise TargetNotFound(f"{what}: pid {pid} has exited")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        raise TargetNotFound(f"{what}: pid {pid} is gone") from None
    except psutil.AccessDenied:
        raise Refused(f"{what}: pid {pid} cannot be inspected (permission denied)") from None
    return proc


def _read(proc: psutil.Process, what: str, attr: str) -> Any:
    try:
        return getattr(proc, attr)()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        raise TargetNotFound(f"{what}: pid {proc.pid} is gone") from None
    except (psutil.AccessDenied, OSError) as exc:
        raise Refused(f"{what}: cannot read the {attr} of pid {proc.pid} "
                      f"({type(exc).__name__})") from None


def check_worker(pid: Any, job: str, node: str, local_rank: int) -> psutil.Process:
    """The process of the worker record ``workers/<node>/<local_rank>``, once proven."""
    what = f"worker record {node}/{local_rank}"
    proc = _open(pid, what)
    env = _read(proc, what, "environ")
    if not any(env.get(k) == job for k in WORKER_JOB_ENV):
        raise Refused(f"{what}: pid {pid} does not carry job {job!r} in its environment "
                      f"({' or '.join(WORKER_JOB_ENV)}); not signalled")
    if env.get(NODE_ID_ENV) != node or env.get("LOCAL_RANK") != str(local_rank):
        raise Refused(f"{what}: pid {pid} is not that worker (its environment says node "
                      f"{bounded(repr(env.get(NODE_ID_ENV)), 140)}, local rank "
                      f"{bounded(repr(env.get('LOCAL_RANK')), 40)}); not signalled")
    return proc


def _flag_value(argv: list[str], flags: tuple[str, ...]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg in flags and i + 1 < len(argv):
            return argv[i + 1]
        for flag in flags:
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1:]
    return None


def check_agent(pid: Any, job: str, node: str) -> psutil.Process:
    """The agent process the record ``nodes/<node>`` names, once proven."""
    what = f"agent of node {node}"
    proc = _open(pid, what)
    argv = _read(proc, what, "cmdline")
    by_argv = _flag_value(argv, AGENT_JOB_FLAGS) == job
    if not by_argv:
        env = _read(proc, what, "environ")
        if not any(env.get(k) == job for k in AGENT_JOB_ENV):
            raise Refused(f"{what}: pid {pid} names job {job!r} neither on its command line "
                          f"(--rdzv-id) nor in its environment; not signalled")
    named = _flag_value(argv, AGENT_NODE_FLAGS)
    if named is not None and named != node:
        raise Refused(f"{what}: pid {pid} is the agent of node {named!r}; not signalled")
    return proc


def find_worker(ctx: Any, target: dict[str, Any]) -> WorkerTarget:
    """The live, proven worker of the job that ``target`` (node, local_rank, rank) names.
    Refusals on the way are logged and kept in ``ctx.refusals``."""
    prefix = schema.workers_prefix(ctx.job)
    found = []
    for key, rec in decode_valid(ctx.client.get_prefix(prefix), log, f"[{ctx.job}] inject"):
        node = key[len(prefix):].split("/", 1)[0]
        w = WorkerTarget(node, rec.local_rank, rec.global_rank, rec.pid)
        if all(target.get(k, v) == v for k, v in
               (("node", w.node), ("local_rank", w.local_rank), ("rank", w.rank))):
            found.append(w)
    refused = []
    for w in sorted(found, key=lambda w: (w.node, w.local_rank)):
        try:
            proc = check_worker(w.pid, ctx.job, w.node, w.local_rank)
        except Refused as exc:
            refused.append(str(exc))
            log.warning("[%s] %s", ctx.job, exc)
            continue
        except TargetNotFound:
            continue
        ctx.refusals.extend(refused)
        return WorkerTarget(w.node, w.local_rank, w.rank, w.pid, proc)
    what = f"no live worker of job {ctx.job} matches target {target} ({len(found)} matching " \
           "record(s)"
    if refused:
        raise Refused(f"{what}: {'; '.join(refused)})")
    raise TargetNotFound(f"{what}, none alive)")


def find_agent(ctx: Any, node: str) -> psutil.Process:
    """The live, proven agent process of ``node``."""
    key = schema.node_key(ctx.job, node)
    kv = ctx.client.get(key)
    if kv is None:
        raise TargetNotFound(f"node {node} has no record in job {ctx.job} (not running)")
    rec = decode_or_none(kv, log, f"[{ctx.job}] inject")
    if rec is None:
        raise Refused(f"node {node}'s record in job {ctx.job} is not a valid node record")
    try:
        return check_agent(rec.agent_pid, ctx.job, node)
    except Refused as exc:
        log.warning("[%s] %s", ctx.job, exc)
        raise
