"""``--hspmd-device auto|cuda|cpu``: where elastic workers compute, parsed for the worker
environment.

The setting reaches each elastic worker as ``HSPMD_DEVICE`` (``contract.env.DEVICE_ENV``;
without the flag a worker keeps the agent's own ``HSPMD_DEVICE``, if any), and the worker turns
it into its device (``hspmd_elastic.devices.select_device``: ``auto`` is ``cuda:<LOCAL_RANK>``
when CUDA is available, else the CPU). Restart mode runs any script, which
places itself: the flag is refused there. ``cuda`` on a node where torch cannot use CUDA is
refused here, before any worker starts. Bad values raise ``ConfigError`` with one line naming
them.
"""

from __future__ import annotations

from typing import Optional

from hspmd_elastic.contract.env import DEVICE_ENV, DEVICE_SETTINGS
from launcher.api import ConfigError


def _cuda_missing() -> Optional[str]:
    """Why torch cannot use CUDA on this node (None: it can)."""
    import torch  # torch: only for --hspmd-device cuda

    if torch.cuda.is_available():
        return None
    build = ("a CPU-only build" if torch.version.cuda is None
             else f"built for CUDA {torch.version.cuda}, no GPU visible")
    return f"CUDA is not available on this node (torch {torch.__version__}: {build})"


def parse_device_setting(value: Optional[str]) -> str:
    """``--hspmd-device``: auto (the default), cuda or cpu."""
    text = "auto" if value is None else str(value).strip().lower()
    if text not in DEVICE_SETTINGS:
        raise ConfigError(f"invalid --hspmd-device value {value!r}: use one of "
                          f"{', '.join(DEVICE_SETTINGS)}")
    if text == "cuda":
        why = _cuda_missing()
        if why is not None:
            raise ConfigError(f"invalid --hspmd-device value {value!r}: {why}")
    return text


def device_env(params: dict) -> dict[str, str]:
    """The workers' environment from ``--hspmd-device`` (``params``: the CLI's values). Not
    given: nothing, so workers keep an ``HSPMD_DEVICE`` the agent's environment has, else
    ``auto``."""
    value = params.get("hspmd_device")
    if not params.get("hspmd_elastic"):
        if value is not None:
            raise ConfigError(f"--hspmd-device {value} is only used with --hspmd-elastic")
        return {}
    return {} if value is None else {DEVICE_ENV: parse_device_setting(value)}
