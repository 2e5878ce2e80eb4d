"""Where an elastic worker computes, and the communication backend that follows from it.

The agent's ``--hspmd-device auto|cuda|cpu`` reaches each elastic worker as ``HSPMD_DEVICE``
(``launcher/node/env.py``). A worker slot is a device: slot ``i`` of a node is ``LOCAL_RANK``
``i`` and, on a GPU node, CUDA ordinal ``i`` (``launcher/node/elastic/devices.py`` numbers the slots the
same way). ``select_device(setting, local_rank)`` is the one decision:

* ``cpu``: the CPU;
* ``cuda``: ``cuda:<local_rank>``; without CUDA, or with fewer GPUs than that, a
  ``DeviceSettingError`` naming the value;
* ``auto``: ``cuda:<local_rank>`` when CUDA is available (a CUDA build of torch that sees a GPU),
  else the CPU; a local rank beyond the visible GPUs is an error, not a silent CPU worker (the
  ranks of one job must all use one backend).

``backend_for(device)`` is the one place the backend is chosen: ``gloo`` on the CPU; on CUDA
``cpu:gloo,cuda:nccl``, so the plan's tensors (activations, gradients, the fused BSR) travel over
NCCL while the switch's small exchange of host integers stays on gloo. ``graph/comm.py`` creates
the sub-groups with the backend the default group was formed with, and ``elastic/group.py`` forms
the default group with this one.

``completes_at_enqueue(backend)`` says which backends have NCCL's completion semantics: a
``Work``'s future is done when the operation is enqueued, not when it ends, ``wait()`` only orders
streams, and a peer that dies leaves the operation running until the communicators are aborted.
That is NCCL, and any backend registered with ``register_enqueue_backend`` (a double with NCCL's
semantics plugs in there, through torch's own ``dist.Backend.register_backend``). Waits on such
backends poll ``Work.is_completed()`` and leaving a plan aborts its communicators
(``elastic/group.py``, ``elastic/monitor.py``); gloo's futures complete when the work ends.

``cuda_available()`` is the selection seam the tests replace; nothing else here reads the
hardware.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from hspmd_elastic.contract.env import DEVICE_ENV, DEVICE_SETTINGS, EnvError, parse_device_setting

log = logging.getLogger(__name__)

SETTINGS = DEVICE_SETTINGS
GLOO = "gloo"
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


class DeviceSettingError(ValueError):
    """The device setting cannot be honoured here; one line naming the value."""


def cuda_available() -> bool:
    """True when this torch build can use CUDA and sees a GPU (the seam tests replace)."""
    return torch.cuda.is_available()


def cuda_count() -> int:
    return torch.cuda.device_count() if cuda_available() else 0


def parse_setting(value: Optional[str], where: str = DEVICE_ENV) -> str:
    """``auto``, ``cuda`` or ``cpu`` (case and surrounding blanks ignored; unset: ``auto``;
    the rule of ``contract.env.parse_device_setting``)."""
    try:
        return parse_device_setting(value, where)
    except EnvError as exc:
        raise DeviceSettingError(str(exc)) from None


def _no_cuda_reason() -> str:
    build = torch.version.cuda
    why = "a CPU-only build" if build is None else f"built for CUDA {build}, but no GPU is visible"
    return f"CUDA is not available (torch {torch.__version__}: {why})"


def select_device(setting: str, local_rank: int) -> torch.device:
    """The device worker slot ``local_rank`` computes on under ``setting`` (see the module
    docstring); ``DeviceSettingError`` when it cannot be honoured."""
    setting = parse_setting(setting)
    if setting == "cpu":
        return torch.device("cpu")
    if not cuda_available():
        if setting == "cuda":
            raise DeviceSettingError(f"{DEVICE_ENV}='cuda': {_no_cuda_reason()}")
        return torch.device("cpu")
    count = cuda_count()
    if not 0 <= local_rank < count:
        raise DeviceSettingError(
            f"{DEVICE_ENV}={setting!r}: LOCAL_RANK={local_rank} has no GPU ({count} visible: "
            f"ordinals 0..{count - 1}); run at most {count} workers per node, or use cpu")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device | str) -> str:
    """The backend of every process group a worker on ``device`` forms."""
    return CUDA_BACKEND if torch.device(device).type == "cuda" else GLOO


def uses_nccl(backend: str) -> bool:
    """True when ``backend`` (as ``dist.get_backend`` reports it) has an NCCL part."""
    return "nccl" in str(backend).lower()


_ENQUEUE_BACKENDS: set[str] = set()
_warned: list[str] = []  # the user's TORCH_NCCL_ASYNC_ERROR_HANDLING, once warned about


def register_enqueue_backend(name: str) -> None:
    """Declare that the c10d backend ``name`` (registered with ``dist.Backend.register_backend``)
    completes its works' futures at enqueue, as NCCL does (see the module docstring)."""
    _ENQUEUE_BACKENDS.add(str(name).lower())


def completes_at_enqueue(backend: str) -> bool:
    """True when some part of ``backend`` has NCCL's completion semantics: waits must poll
    ``is_completed()`` and leaving means aborting the communicators."""
    parts = {p.rpartition(":")[2].strip() for p in str(backend).lower().split(",")}
    return "nccl" in parts or bool(parts & _ENQUEUE_BACKENDS)


def use_device(device: torch.device) -> None:
    """Make ``device`` current for this process (NCCL and the caching allocator follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def nccl_environment(init_timeout_s: float, env: Optional[dict] = None) -> dict:
    """The NCCL settings an elastic worker needs, set only where the user has not set them:

    * ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``: communicators are created and split in NCCL's
      non-blocking mode, so torch waits for them with a bound instead of inside a blocking
      ``ncclCommInitRank``/``ncclCommSplit`` that a peer dying mid-creation would never end
      (torch stopped choosing this mode by itself for eager init in 2.7.1);
    * ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: that bound, in whole seconds: the regroup deadline
      (``init_timeout_s``). torch reads it once per process, so the first value set stays;
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: torch's own NCCL watchdog neither aborts the
      communicators nor tears the process down on a timeout. Leaving a plan is ours: the
      worker's ``Watchdog`` polls every wait against its deadline and newer plans, and the
      ``AbortMonitor`` thread aborts the plan's communicators when a wait is abandoned or the
      main thread is stuck (torch's ``_abort_process_group`` asks for this setting: with error
      handling on, torch's watchdog may abort the same communicators, or kill the survivor,
      on its own).

    A user's ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` other than 0 is kept, with a warning: torch's
    watchdog may then tear the worker down on a timed-out collective before it can switch.

    Returns what it set (``env``: default ``os.environ``)."""
    env = os.environ if env is None else env
    handling = str(env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")).strip()
    if handling != "0" and not _warned:
        _warned.append(handling)
        log.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s is set: torch's NCCL watchdog may abort "
                    "the communicators, or end this worker, when a collective times out, before "
                    "the worker can switch plans in memory; unset it (or set 0) for elastic "
                    "mode", handling)
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
              "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
              "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, int(init_timeout_s)))}
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = done[name] = value
    return done
