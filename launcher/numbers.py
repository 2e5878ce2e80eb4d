"""The ranges of the launcher's numeric settings, and the one check they all go through.

Every numeric flag of ``hspmd-launch`` (and of ``hspmd-launch plan``), every ``--rdzv-conf``
key and every numeric environment variable the agent reads is finite and in the range below,
or refused in one line naming the setting and the value (``NumberRange`` in
``hspmd_elastic.contract.env``): ``nan`` and ``inf`` never pass, and never mean "no limit".
A flag gets its range as a click type (``number``), so its ``PET_*`` variable is checked the
same way; a usage error exits 2.

Seconds are capped where a larger value can only be a typo: a lease TTL above an hour would let
a dead node hold its devices for longer than that; the caps are in docs/operations.md.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import click

from hspmd_elastic.contract.env import NumberRange
from launcher.api import ConfigError

SHUTDOWN_TIMEOUT_VAR = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's: --shutdown-timeout's default

HOUR, DAY, WEEK = 3600.0, 86400.0, 604800.0
MAX_ROWS = 2**24  # sequences per step, or tokens per sequence

RANGES: dict[str, NumberRange] = {
    # torchrun's flags
    "--monitor-interval": NumberRange(0.0, HOUR, lo_open=True, unit="seconds"),
    "--shutdown-timeout": NumberRange(0.0, HOUR, unit="seconds"),
    # --rdzv-conf keys (torchrun's names)
    "join_timeout": NumberRange(0.0, WEEK, lo_open=True, unit="seconds"),
    "last_call_timeout": NumberRange(0.0, HOUR, unit="seconds"),
    "close_timeout": NumberRange(0.0, HOUR, lo_open=True, unit="seconds"),
    "exit_barrier_timeout": NumberRange(0.0, DAY, unit="seconds"),
    "lease_ttl": NumberRange(1.0, HOUR, unit="seconds"),  # etcd's minimum TTL is 1 s
    # our own flags
    "--hspmd-lease-ttl": NumberRange(1.0, HOUR, unit="seconds"),
    "--hspmd-etcd-outage-limit": NumberRange(1.0, DAY, unit="seconds"),
    "--hspmd-debounce": NumberRange(0.0, 60.0, unit="seconds"),
    "--hspmd-straggler-dwell": NumberRange(0.0, HOUR, unit="seconds"),
    "--hspmd-seq-len": NumberRange(1, MAX_ROWS, integer=True),
    "--hspmd-global-batch": NumberRange(1, MAX_ROWS, integer=True),
    # hspmd-launch plan
    "plan --global-batch": NumberRange(1, MAX_ROWS, integer=True),
    "plan --alternatives": NumberRange(0, 100, integer=True),
}
RANGES[SHUTDOWN_TIMEOUT_VAR] = RANGES["--shutdown-timeout"]


class Number(click.ParamType):
    """A click type: the value checked against ``RANGES[key]`` (one line: the flag, the value,
    the range)."""

    def __init__(self, key: str):
        self.key = key
        self.range = RANGES[key]
        self.name = "integer" if self.range.integer else "float"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> Any:
        try:
            return self.range.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "INTEGER" if self.range.integer else "FLOAT"


def number(key: str) -> Number:
    """The click type of the flag (or setting) ``key`` of ``RANGES``."""
    return Number(key)


def check(key: str, value: Any, shown: Optional[str] = None) -> Any:
    """``value`` of the setting ``key`` parsed and in range, else ``ConfigError`` naming
    ``shown`` (default ``key``): ``invalid --rdzv-conf lease_ttl='0': '0' is not ...``."""
    try:
        return RANGES[key].parse(value)
    except ValueError as exc:
        raise ConfigError(f"invalid {shown or key}: {exc}") from None


def shutdown_timeout_from_env(env: Optional[Mapping[str, str]] = None,
                              default: float = 30.0) -> float:
    """torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (``--shutdown-timeout``'s default)."""
    env = os.environ if env is None else env
    value = env.get(SHUTDOWN_TIMEOUT_VAR)
    if value is None or not value.strip():
        return default
    return check(SHUTDOWN_TIMEOUT_VAR, value)
