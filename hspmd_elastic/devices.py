"""Where an elastic worker computes, and the communication backend that follows from it.

The agent's ``--hspmd-device auto|cuda|cpu`` reaches each elastic worker as ``HSPMD_DEVICE``
(``launcher/node/env.py``). A worker slot is a device: slot ``i`` of a node is ``LOCAL_RANK``
``i`` and, on a GPU node, CUDA ordinal ``i`` (``launcher/node/devices.py`` numbers the slots the
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

``cuda_available()`` is the selection seam the tests replace; nothing else here reads the
hardware.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

DEVICE_ENV = "HSPMD_DEVICE"
SETTINGS = ("auto", "cuda", "cpu")
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
    """``auto``, ``cuda`` or ``cpu`` (case and surrounding blanks ignored; unset: ``auto``)."""
    text = "auto" if value is None or not str(value).strip() else str(value).strip().lower()
    if text not in SETTINGS:
        raise DeviceSettingError(f"{where}={value!r}: use one of {', '.join(SETTINGS)}")
    return text


def setting_from_env(env: Optional[Mapping[str, str]] = None) -> str:
    return parse_setting((os.environ if env is None else env).get(DEVICE_ENV))


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


def use_device(device: torch.device) -> None:
    """Make ``device`` current for this process (NCCL and the caching allocator follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def nccl_environment(timeout_s: float, env: Optional[dict] = None) -> dict:
    """The NCCL settings an elastic worker needs, set only where the user has not set them:

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the worker's own watchdog gives every wait its
      deadline and aborts the communicators itself when it leaves a plan (torch's
      ``_abort_process_group`` asks for this: with it on, NCCL's watchdog may tear the
      communicators down, or the process, on its own);
    * ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: the longest a non-blocking communicator creation or
      split may take (torch's default is 30 minutes), the worker's communication timeout.

    Returns what it set (``env``: default ``os.environ``)."""
    env = os.environ if env is None else env
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
              "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, int(timeout_s)))}
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = done[name] = value
    return done
