"""The worker environment: what a node agent puts in each worker's environment.

Our variables are ``hspmd_elastic.contract.env.WorkerEnv`` (written with ``to_env``, read back
with ``from_env``: each ``HSPMD_*`` name is defined there once). Restart mode gives torchrun's
variables (``worker_env``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the store
node 0's agent hosts, ...) plus ours: ``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``,
``HSPMD_NODE_ID``, ``HSPMD_ROUND`` and ``HSPMD_PROGRESS_FILE`` (the opt-in to hang detection)
and, once the health source failed a device, ``CUDA_VISIBLE_DEVICES`` naming the usable ones.
Elastic mode gives no rank (the plan gives it, and it changes per plan), only who the worker is
and where etcd is (``elastic_worker_env``): ``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``,
``HSPMD_NODE_ID``, ``LOCAL_RANK``, ``HSPMD_PLAN_VERSION`` (the plan that started it) and
``HSPMD_PROGRESS_FILE``; the agent adds ``TORCHELASTIC_ERROR_FILE`` for the failure summary,
and ``HSPMD_DEVICE`` (``contract.env.DEVICE_ENV``: ``--hspmd-device``, auto, cuda or cpu, through
``LaunchConfig.extra_env``). ``hspmd_elastic.elastic.api.WorkerIdentity.from_env`` reads it back.

etcd's TLS and auth settings reach elastic workers as the agent has them
(``EtcdSecurity.to_env``: ``HSPMD_ETCD_CACERT``, ``HSPMD_ETCD_CERT``, ``HSPMD_ETCD_KEY``,
``HSPMD_ETCD_USER``, ``HSPMD_ETCD_TLS``, and the password as ``HSPMD_ETCD_PASSWORD`` or the path
``HSPMD_ETCD_PASSWORD_FILE``), in the environment, never on a command line. Restart-mode workers
never talk to etcd: their environment holds no etcd password (``SECRET_ENV`` is removed).

Both modes: with ``--local-addr`` (the address other nodes reach this node at), the workers'
gloo binds the interface that holds that address (``GLOO_SOCKET_IFNAME``, ``node_address_env``)
unless the user set it. Without it gloo takes the address the hostname resolves to, and a
hostname that resolves to loopback (``127.0.1.1 myhost`` in ``/etc/hosts`` is common) makes every
rank advertise 127.0.0.1 to its peers on other hosts: the group never forms.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import psutil

from hspmd_elastic.contract.env import SECRET_ENV, WorkerEnv
from launcher.api import LaunchConfig
from launcher.node.api import RoundInfo

LOCAL_RANK_MACRO = "${local_rank}"
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> Optional[str]:
    """The name of this host's network interface that holds ``address`` (None: none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def node_address_env(local_addr: Optional[str],
                     base: Mapping[str, str] = {}) -> dict[str, str]:  # noqa: B006 - read only
    """What the worker environment gets from ``--local-addr``: gloo on the interface that
    holds it (``GLOO_SOCKET_IFNAME``), unless ``base`` sets one or no interface holds it (a
    name, not an address: gloo then resolves the hostname as before)."""
    if not local_addr or base.get(GLOO_IFNAME_ENV):
        return {}
    name = interface_of(local_addr)
    return {GLOO_IFNAME_ENV: name} if name else {}


def worker_argv(entrypoint: Sequence[str], local_rank: int) -> tuple[str, ...]:
    """The entrypoint with torchrun's ``${local_rank}`` macro filled in."""
    return tuple(a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in entrypoint)


def worker_env(base: dict[str, str], config: LaunchConfig, info: RoundInfo, local_rank: int,
               master: tuple[str, int], error_file: str, endpoints: tuple[str, ...],
               progress_file: Optional[str] = None,
               visible_devices: Optional[Sequence[str]] = None) -> dict:
    """The environment of one worker (ARCHITECTURE.md, CONTRACT: worker environment).

    ``progress_file``: the worker's ``HSPMD_PROGRESS_FILE`` (``hspmd_elastic.heartbeat``
    writes there: the opt-in to hang detection). ``visible_devices``: the node's usable
    devices once a health source failed some (``CUDA_VISIBLE_DEVICES``: local rank ``i`` runs
    on the ``i``-th usable device); None leaves the variable as the agent had it."""
    a = info.assignment
    env = dict(base)
    env.update({
        "LOCAL_RANK": str(local_rank),
        "RANK": str(a.global_rank(local_rank)),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(a.role_rank(local_rank)),
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.role_world_size),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RESTART_COUNT": str(info.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.rdzv.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(config.signals),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    env.update(WorkerEnv(job=config.rdzv.run_id, node=config.node_id,
                         etcd_endpoints=",".join(endpoints), round=info.round,
                         progress_file=progress_file).to_env())
    if "OMP_NUM_THREADS" in base:
        env["OMP_NUM_THREADS"] = base["OMP_NUM_THREADS"]
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
    env.update(node_address_env(config.local_addr, base))
    env.update(config.extra_env)
    for name in SECRET_ENV:  # the script never talks to etcd
        env.pop(name, None)
    return env


def elastic_worker_env(base: Mapping[str, str], endpoints: Sequence[str], job: str, node: str,
                       local_rank: int, plan_version: int,
                       progress_file: Optional[str] = None) -> dict[str, str]:
    """The environment of one elastic-mode worker (see the module docstring)."""
    env = dict(base)
    env["LOCAL_RANK"] = str(local_rank)
    env.update(WorkerEnv(job=job, node=node, etcd_endpoints=",".join(endpoints),
                         plan_version=plan_version, progress_file=progress_file).to_env())
    return env
