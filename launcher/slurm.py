"""``srun hspmd-launch ...``: the flags a user did not give, from Slurm's environment.

Under ``srun`` (one ``hspmd-launch`` per node) no per-node flag is needed: a flag the user did
not give, neither on the command line nor as ``PET_*``, takes its value from the variables Slurm
sets for the step's task; a flag the user gave always wins. Promises:

* **detection** (``under_srun``): only inside an ``srun`` step, where ``SLURM_JOB_ID``,
  ``SLURM_STEP_ID`` and ``SLURM_PROCID`` are all set and ``SLURM_STEP_ID`` is the decimal id of
  an ordinary step. A batch script has no ``SLURM_STEP_ID``; an ``salloc`` shell has no
  ``SLURM_PROCID``; the ids Slurm reserves for its batch, extern and interactive steps are
  0xFFFFFFF0 and up. So ``hspmd-launch`` run directly by a batch script or an allocation's shell
  is a plain launch. ``--hspmd-slurm off`` (or ``PET_HSPMD_SLURM=off``) turns all of this off;
* **one agent per node**: the step's tasks per node (``SLURM_STEP_TASKS_PER_NODE``, else
  ``SLURM_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``; Slurm writes ``2(x3),1``) must all
  be 1: two agents on one node would fight over its devices (``srun --ntasks-per-node=1``);
* **node identity**: ``--hspmd-node-id`` is ``SLURMD_NODENAME`` (else the hostname, made an
  id), the same after a requeue onto the same node; ``--node-rank`` is ``SLURM_NODEID``, the
  node's index in the step (0 is the first host of the step's node list). Restart mode orders a
  round's nodes by it, so with more nodes than ``--nnodes`` the last ones wait as spares;
* **--nnodes**: the step's node count, ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``, which
  ``srun`` sets to the step's count too, else ``SLURM_JOB_NUM_NODES``; without any of them the
  size of the node list). A given ``N`` or ``MIN:MAX`` wins: an elastic job with spares gives
  ``--nnodes 2`` and runs ``srun -N 3``; every node still gets its rank and the one rendezvous,
  and the third node waits as a spare (restart mode) or registers and is used when a node is
  lost (elastic mode);
* **--nproc-per-node**: when not given, or given as ``gpu`` or ``auto``: the GPUs Slurm gave the
  node, ``SLURM_GPUS_ON_NODE``, else the entries of ``CUDA_VISIBLE_DEVICES`` (up to the first
  negative one, as CUDA reads it). None given (0 or neither variable): the value stays (the
  default 1; ``auto`` counts as it does off Slurm), but ``gpu`` is refused naming the variable;
* **--rdzv-id**: ``slurm-<SLURM_JOB_ID>``. ``sbatch --requeue`` keeps ``SLURM_JOB_ID`` (it
  counts ``SLURM_RESTART_COUNT`` instead), so a requeued job meets under the same id, as
  torchrun users' ``--rdzv-id $SLURM_JOB_ID`` does: with the default hosted etcd the store is
  new, and on an external etcd restart mode starts a new run of an id whose previous run ended
  once none of its nodes is alive. Two ``srun`` steps of one job running at once need their own
  ``--rdzv-id``;
* **rendezvous**: without ``--rdzv-endpoint``, ``--hspmd-etcd-endpoints`` or ``--standalone``:
  ``--rdzv-backend c10d`` at ``<first host of the node list>:29400``, the first node hosting
  the embedded etcd and the others waiting for it, as c10d does off Slurm (``--rdzv-backend
  c10d`` given: the same endpoint; ``static`` given: ``--master-addr`` is that host and node
  rank 0 serves). The node list is the step's, ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``): its first host runs an agent of this step
  even when the step uses part of the allocation. ``--hspmd-etcd-endpoints`` (an external etcd
  cluster) without ``--rdzv-backend`` selects ``etcd``, also on one node. With ``--standalone``
  neither ``--nnodes`` nor the rendezvous is filled;
* **errors**: an inconsistent environment is one ``ConfigError`` line naming the variable and
  its value: a count that is not a number, ``SLURM_NODEID`` past the node count, a node list
  whose size differs from the node count or that is not a Slurm hostlist, a ``SLURMD_NODENAME``
  that is not an id or not a host of the node list, a ``SLURMD_NODENAME`` that is not the host
  ``SLURM_NODEID`` names in it, several tasks per node. Only the variables a filled flag needs
  are read: the node count only for ``--nnodes``, ``SLURM_NODEID``'s bound and the node list's
  size check; the tasks per node only when the node's identity or ``--nproc-per-node`` is
  filled; with every flag given, none is;
* ``expand_hostlist`` expands Slurm's hostlist syntax (``node[01-03,07],gpu-a[1-2]``, several
  bracket groups in one name, zero padding from the lower bound) in Slurm's order, pure.
"""

from __future__ import annotations

import itertools
import logging
import re
import socket
from typing import Any, Mapping, Optional

import click
from click.core import ParameterSource

from hspmd_elastic.contract.ids import ID_RULE, is_id
from hspmd_elastic.contract.text import bounded
from launcher.api import ConfigError

log = logging.getLogger(__name__)

SETTINGS = ("auto", "off")  # --hspmd-slurm
SRUN_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")
FIRST_RESERVED_STEP_ID = 0xFFFFFFF0  # Slurm's batch, extern, interactive... step ids
NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
RDZV_PORT = 29400  # torchrun's c10d port
MAX_HOSTS = 65536  # a hostlist expanding past this is refused, not expanded
_DIGITS = re.compile(r"[0-9]+")
_HOST_PART = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def _bad(name: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"invalid Slurm environment {name}={bounded(repr(value))}: {why} "
                       "(--hspmd-slurm off ignores Slurm's environment)")


# ------------------------------------------------------------------------------------ hostlist
def _split_top(text: str, name: str) -> list[str]:
    """``text`` cut at the commas outside brackets; brackets balanced and not nested."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise _bad(name, text, "nested '[' in the hostlist")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(name, text, "']' without '[' in the hostlist")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(name, text, "'[' without ']' in the hostlist")
    items.append(text[start:])
    if any(not item for item in items):
        raise _bad(name, text, "an empty host name in the hostlist")
    return items


def _expand_group(body: str, name: str, text: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` (the width of each lower bound kept)."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise _bad(name, text, f"[{body}] is not a list of numbers and ranges like 01-03")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise _bad(name, text, f"range {part} ends before it starts")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise _bad(name, text, f"more than {MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    return out


def _expand_name(item: str, name: str, text: str) -> list[str]:
    """One host name with bracket groups: ``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2."""
    pieces = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
    choices: list[list[str]] = []
    size = 1
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if not _HOST_PART.fullmatch(piece):
                raise _bad(name, text, f"host name {item!r} has characters outside "
                                       "[A-Za-z0-9._-]")
            choices.append([piece])
        else:
            group = _expand_group(piece, name, text)
            size *= len(group)
            if size > MAX_HOSTS:
                raise _bad(name, text, f"more than {MAX_HOSTS} hosts")
            choices.append(group)
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_hostlist(text: str, name: str = "hostlist") -> list[str]:
    """Slurm's hostlist ``text`` as host names, in order (``scontrol show hostnames``).
    ``ConfigError`` naming ``name`` and the text when it is not a hostlist."""
    text = text.strip()
    if not text:
        raise _bad(name, text, "an empty hostlist")
    hosts: list[str] = []
    for item in _split_top(text, name):
        hosts.extend(_expand_name(item, name, text))
        if len(hosts) > MAX_HOSTS:
            raise _bad(name, text, f"more than {MAX_HOSTS} hosts")
    return hosts


# ------------------------------------------------------------------------------ the variables
def under_srun(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an ``srun`` step (see the module docstring)."""
    if not all(env.get(var, "").strip() for var in SRUN_VARS):
        return False
    step = env["SLURM_STEP_ID"].strip()
    return _DIGITS.fullmatch(step) is not None and int(step) < FIRST_RESERVED_STEP_ID


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """The first of ``names`` set (not blank) in ``env``: (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _number(name: str, value: str, minimum: int = 0) -> int:
    if _DIGITS.fullmatch(value) is None or int(value) < minimum:
        kind = "a positive integer" if minimum else "a non-negative integer"
        raise _bad(name, value, f"not {kind}")
    return int(value)


def check_one_task_per_node(env: Mapping[str, str]) -> None:
    """Every node of the step runs one task (one agent); ``ConfigError`` otherwise."""
    found = _first(env, TASKS_VARS)
    if found is None:
        return
    name, value = found
    for part in value.split(","):
        m = _TASKS.fullmatch(part.strip())
        if m is None:
            raise _bad(name, value, "not a tasks-per-node list like 1(x3)")
        if int(m.group(1)) != 1:
            raise _bad(name, value, "hspmd-launch runs one agent per node, which starts the "
                                    "node's workers itself: use srun --ntasks-per-node=1")


def node_count(env: Mapping[str, str]) -> Optional[tuple[str, int]]:
    """The step's node count and the variable it came from (None: none set)."""
    found = _first(env, NODE_COUNT_VARS)
    return None if found is None else (found[0], _number(*found, minimum=1))


def node_list(env: Mapping[str, str], count: Optional[tuple[str, int]],
              hosts: Optional[list[str]] = None) -> list[str]:
    """The step's hosts, in Slurm's order (``hosts``: already expanded); their number must be
    the node count."""
    found = _first(env, NODELIST_VARS)
    if found is None:
        raise ConfigError(f"Slurm's environment has no node list ({', '.join(NODELIST_VARS)}) "
                          "for the rendezvous: give --rdzv-endpoint, or --hspmd-slurm off")
    name, value = found
    hosts = expand_hostlist(value, name) if hosts is None else hosts
    if count is not None and len(hosts) != count[1]:
        raise _bad(name, value, f"{len(hosts)} hosts, but {count[0]}={count[1]}")
    return hosts


def node_rank(env: Mapping[str, str], nodes: Optional[int]) -> Optional[int]:
    """``SLURM_NODEID``, checked against the node count ``nodes`` (None: not set)."""
    value = env.get("SLURM_NODEID", "").strip()
    if not value:
        return None
    rank = _number("SLURM_NODEID", value)
    if nodes is not None and rank >= nodes:
        raise _bad("SLURM_NODEID", value, f"the step has {nodes} nodes (ids 0..{nodes - 1})")
    return rank


def node_id(env: Mapping[str, str], hostname: str) -> str:
    """``SLURMD_NODENAME``, else ``hostname`` made an id."""
    name = env.get("SLURMD_NODENAME", "").strip()
    if name:
        if not is_id(name):
            raise _bad("SLURMD_NODENAME", name, f"a node id is {ID_RULE} (give --hspmd-node-id)")
        return name
    return re.sub(r"[^A-Za-z0-9._-]", "-", hostname).strip("-._")[:128] or "node"


class _Step:
    """The step's node count and node list, each read (and checked) when first needed."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self._count: Optional[tuple[Optional[tuple[str, int]]]] = None
        self._hosts: Optional[tuple[Optional[list[str]]]] = None

    def count(self) -> Optional[tuple[str, int]]:
        """The node count variable and its value (None: none set)."""
        if self._count is None:
            self._count = (node_count(self.env),)
        return self._count[0]

    def hosts(self, sized: bool = True) -> Optional[list[str]]:
        """The node list (None: no list); ``sized``: its size checked against the node
        count, which is then read too."""
        if self._hosts is None:
            found = _first(self.env, NODELIST_VARS)
            self._hosts = (None if found is None else expand_hostlist(found[1], found[0]),)
        hosts = self._hosts[0]
        if sized and hosts is not None:
            node_list(self.env, self.count(), hosts)
        return hosts

    def nodes(self) -> Optional[int]:
        """How many nodes the step has: the node count, else the node list's size."""
        count = self.count()
        if count is not None:
            return count[1]
        hosts = self.hosts()
        return None if hosts is None else len(hosts)


def _identity(env: Mapping[str, str], given: Mapping[str, Any], step: _Step,
              hostname: Optional[str]) -> dict[str, Any]:
    """``--hspmd-node-id`` and ``--node-rank`` when not given; ``SLURMD_NODENAME`` must be a
    host of the node list, and the one ``SLURM_NODEID`` names when both are read."""
    out: dict[str, Any] = {}
    name = env.get("SLURMD_NODENAME", "").strip()
    if "hspmd_node_id" not in given:
        out["hspmd_node_id"] = node_id(env, socket.gethostname() if hostname is None
                                       else hostname)
    if "node_rank" not in given:
        rank = node_rank(env, step.nodes())
        if rank is not None:
            out["node_rank"] = rank
    if "hspmd_node_id" in out and name:
        hosts = step.hosts(sized=False)
        if hosts is not None and name not in hosts:
            raise _bad("SLURMD_NODENAME", name, f"not a host of the step's node list "
                                                f"({bounded(', '.join(hosts))})")
        rank = out.get("node_rank")
        if hosts is not None and rank is not None and hosts[rank] != name:
            raise _bad("SLURMD_NODENAME", name, f"SLURM_NODEID={rank} names {hosts[rank]} "
                                                "in the step's node list")
    return out


def gpu_count(env: Mapping[str, str]) -> Optional[tuple[str, int]]:
    """The GPUs Slurm gave this node and the variable that says so (None: neither is set)."""
    value = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if value:
        return "SLURM_GPUS_ON_NODE", _number("SLURM_GPUS_ON_NODE", value)
    if "CUDA_VISIBLE_DEVICES" not in env:
        return None
    entries = [e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",")]
    shown = list(itertools.takewhile(lambda e: e and not e.startswith("-"), entries))
    return "CUDA_VISIBLE_DEVICES", len(shown)


# --------------------------------------------------------------------------------- the mapping
def _nproc(env: Mapping[str, str], given: Mapping[str, Any]) -> dict[str, Any]:
    word = str(given.get("nproc_per_node", "")).strip()
    if "nproc_per_node" in given and word not in ("gpu", "auto"):
        return {}
    gpus = gpu_count(env)
    if gpus is not None and gpus[1] > 0:
        return {"nproc_per_node": str(gpus[1])}
    if word == "gpu":
        where = "neither SLURM_GPUS_ON_NODE nor CUDA_VISIBLE_DEVICES is set" if gpus is None \
            else f"{gpus[0]}={bounded(repr(env[gpus[0]]))}"
        raise ConfigError(f"--nproc-per-node gpu: Slurm gave this node no GPUs ({where}); "
                          "ask for them (srun --gpus-per-node=N) or give a number")
    return {}


def _rendezvous(env: Mapping[str, str], given: Mapping[str, Any],
                step: _Step) -> dict[str, Any]:
    backend = given.get("rdzv_backend")
    if given.get("hspmd_etcd_endpoints"):  # an external etcd cluster
        return {} if backend or given.get("rdzv_endpoint") else {"rdzv_backend": "etcd"}
    if given.get("rdzv_endpoint"):
        return {}
    chosen = str(backend or "c10d").strip().lower()
    if chosen not in ("c10d", "static"):
        return {}  # etcd without an endpoint: the CLI asks for one
    hosts = step.hosts()
    if hosts is None:
        raise ConfigError(f"Slurm's environment has no node list ({', '.join(NODELIST_VARS)}) "
                          "for the rendezvous: give --rdzv-endpoint, or --hspmd-slurm off")
    first = hosts[0]
    if chosen == "static":
        return {} if "master_addr" in given else {"master_addr": first}
    out: dict[str, Any] = {"rdzv_endpoint": f"{first}:{RDZV_PORT}"}
    if not backend:
        out["rdzv_backend"] = "c10d"
    return out


def slurm_defaults(env: Mapping[str, str], given: Mapping[str, Any],
                   hostname: Optional[str] = None) -> dict[str, Any]:
    """The CLI params (``launch_command``'s names) to fill from Slurm's ``env`` for a task of an
    ``srun`` step, given ``given``: the params the user set (command line or ``PET_*``) and
    their values, which are never overridden; ``hostname`` (default: this host's) names the
    node when ``SLURMD_NODENAME`` is not set. Pure apart from that default; ``ConfigError``
    names the first inconsistent variable, among those a filled flag needs."""
    step = _Step(env)
    out = _identity(env, given, step, hostname)
    if "rdzv_id" not in given:
        out["rdzv_id"] = f"slurm-{_number('SLURM_JOB_ID', env.get('SLURM_JOB_ID', '').strip())}"
    out.update(_nproc(env, given))
    if out.keys() & {"hspmd_node_id", "node_rank", "nproc_per_node"}:
        check_one_task_per_node(env)  # two agents would share this node's id, rank, devices
    if given.get("standalone"):
        return out
    if "nnodes" not in given:
        nodes = step.nodes()
        if nodes is not None:
            out["nnodes"] = str(nodes)
    out.update(_rendezvous(env, given, step))
    return out


def fill_from_slurm(ctx: click.Context, env: Mapping[str, str]) -> None:
    """The CLI's hook, after parsing: under ``srun`` and unless ``--hspmd-slurm off``, the
    params the user did not set (click's source is the default) take ``slurm_defaults``."""
    params = ctx.params
    if str(params.get("hspmd_slurm") or "auto").lower() == "off" or not under_srun(env):
        return
    given = {name: value for name, value in params.items()
             if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}
    filled = slurm_defaults(env, given)
    params.update(filled)
    log.info("Slurm job %s step %s: %s from Slurm's environment", env["SLURM_JOB_ID"].strip(),
             env["SLURM_STEP_ID"].strip(),
             ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(filled.items())))
