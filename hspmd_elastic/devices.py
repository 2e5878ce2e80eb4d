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
import math
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
_warned: list[str] = []  # the user's NCCL settings already warned about (once each)


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


# torch's own NCCL watchdog times a work out at the group's timeout; ours must always act first
# (and abort), so a group on a backend that completes at enqueue gets this much more
TORCH_TIMEOUT_MARGIN_S = 30.0


def backend_timeout_s(backend: str, comm_s: float, abort_s: float) -> float:
    """The ``timeout`` a process group of ``backend`` is made with, for waits bounded by
    ``comm_s`` and aborts by ``abort_s``. gloo: ``comm_s`` (gloo's own timeout is what fails a
    collective whose peer died). NCCL: well above ``comm_s`` plus the abort bound, so torch's
    watchdog never times a work out before the elastic runtime has left it: torch's timeout
    path fails the work, and with a dump configured sleeps and writes ``exception_dump`` to the
    store (docs/gpu.md, "NCCL as it really is")."""
    if not completes_at_enqueue(backend):
        return comm_s
    return 2.0 * comm_s + abort_s + TORCH_TIMEOUT_MARGIN_S


def nonblocking_timeout_s(init_timeout_s: float) -> int:
    """``TORCH_NCCL_NONBLOCKING_TIMEOUT`` for a creation bound of ``init_timeout_s``: torch
    compares whole elapsed seconds with ``>`` (``C10D_CHECK_TIMEOUT``), so a value of N fires
    after N + 1 s; N = ceil(bound) - 1 fires by the bound (at least 1)."""
    return max(1, math.ceil(init_timeout_s) - 1)


_USER_DEBUG = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING")


def nccl_environment(init_timeout_s: float, env: Optional[dict] = None) -> dict:
    """The NCCL settings an elastic worker needs, set only where the user has not set them:

    * ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``: communicators are created and split in NCCL's
      non-blocking mode, so torch waits for them with a bound instead of inside a blocking
      ``ncclCommInitRank``/``ncclCommSplit`` that a peer dying mid-creation would never end
      (torch stopped choosing this mode by itself for eager init in 2.7.1, pytorch#153960);
    * ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: that bound, in whole seconds, chosen so that it fires
      by ``init_timeout_s`` (``nonblocking_timeout_s``). torch reads it once per process, so the
      first value set stays;
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: torch's own NCCL watchdog neither aborts the
      communicators nor tears the process down on a timeout. Leaving a plan is ours: the
      worker's ``Watchdog`` polls every wait against its deadline and newer plans, and the
      ``AbortMonitor`` thread aborts the plan's communicators when a wait is abandoned or the
      main thread is stuck (torch's ``_abort_process_group`` asks for this setting);
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` and ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0``: on a
      timeout or an NCCL error (a killed peer's ``ncclRemoteError``) torch's watchdog would
      otherwise write ``exception_dump`` at the root of the plan's store and sleep 4 x the dump
      wait (60 s) on the watchdog thread that the group's destructor joins;
    * ``TORCH_NCCL_ENABLE_MONITORING=0``: the heartbeat monitor of a process's first group
      polls that key, and a worker that joins after it was written would be terminated
      ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s) later. The agent's hang rule watches the
      workers instead.

    A user's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``TORCH_NCCL_DUMP_ON_TIMEOUT`` or
    ``TORCH_NCCL_ENABLE_MONITORING`` other than 0 is kept, with one warning naming it.

    Returns what it set (``env``: default ``os.environ``)."""
    env = os.environ if env is None else env
    handling = str(env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")).strip()
    if handling != "0" and "handling" not in _warned:
        _warned.append("handling")
        log.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s is set: torch's NCCL watchdog may abort "
                    "the communicators, or end this worker, when a collective times out, before "
                    "the worker can switch plans in memory; unset it (or set 0) for elastic "
                    "mode", handling)
    for name in _USER_DEBUG:
        value = str(env.get(name, "0")).strip().lower()
        if value not in ("0", "false", "no", "n") and name not in _warned:
            _warned.append(name)
            log.warning("%s=%s is set: after a timed-out or failed collective torch writes "
                        "exception_dump to the plan's store, and a worker that joins later can "
                        "be terminated by its heartbeat monitor; unset it (or set 0) for "
                        "elastic mode", name, env.get(name))
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
              "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
              "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(nonblocking_timeout_s(init_timeout_s)),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
              "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
              "TORCH_NCCL_ENABLE_MONITORING": "0"}
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = done[name] = value
    return done
