"""Elastic mode's declared capacity and redundancy flags, parsed into ``ElasticSettings`` fields.

A node can declare what its devices are, for the leader's planner: ``--hspmd-device-memory`` (a
size with a unit: ``24MiB``, ``1.5GiB``, ``512KiB``) and ``--hspmd-device-speed`` (relative to the
device type's nominal speed, 1.0 by default). The agent advertises them in its node record
(``DeviceInfo.memory_bytes`` and ``speed``), and the planner shards a model that does not fit the
declared memory exactly as it would on real GPUs, so a cluster's layouts can be rehearsed on CPU
workers; ``--hspmd-enforce-memory`` makes that memory a real limit of each worker
(``launcher.cgroup_memory``; it needs ``--hspmd-device-memory``). ``--hspmd-redundancy N`` makes
"every parameter slice on N nodes" a hard constraint of the planner; ``--hspmd-all-devices on``
gives every usable worker a role (the planner otherwise leaves idle a worker that costs the step
more than it adds); ``--hspmd-optimizer-shards uneven`` publishes every plan with uneven
(ZeRO-1 style) optimizer shards (``Plan.optimizer_shards``) and plans for them;
``--hspmd-device-types FILE`` gives the planner device-type constants measured on the job's
machines (``planner.device_types_from_dict``). Bad values raise ``ConfigError`` with one line
naming them.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from launcher.api import ConfigError

CAPACITY_FLAGS = ("hspmd_device_memory", "hspmd_device_speed", "hspmd_redundancy",
                  "hspmd_planner", "hspmd_straggler_replans",
                  "hspmd_straggler_dwell", "hspmd_lengths", "hspmd_enforce_memory",
                  "hspmd_device_types")  # CLI params
PLANNERS = ("hetero", "uniform")  # --hspmd-planner
SWITCHES = {"on": True, "off": False}  # --hspmd-straggler-replans
OPTIMIZER_SHARDS = ("replicated", "uneven")  # --hspmd-optimizer-shards (Plan.optimizer_shards)



def _planner():
    """The planner package, imported on first use: it loads numpy and scipy, which
    ``hspmd-launch --help`` and most usage errors never need."""
    import hspmd_elastic.planner as planner  # startup

    return planner


def parse_device_memory(value: Optional[str]) -> int:
    """``--hspmd-device-memory``: bytes (0 when not given: the device's own, or the type's)."""
    if value is None:
        return 0
    planner = _planner()
    try:
        return planner.parse_bytes(value)
    except planner.PlannerError:
        raise ConfigError(f"invalid --hspmd-device-memory value {value!r}: use a size with a "
                          "unit, KiB, MiB or GiB (e.g. 24MiB)") from None


def parse_device_speed(value: Optional[str]) -> float:
    """``--hspmd-device-speed``: a number > 0 (1.0 when not given)."""
    if value is None:
        return 1.0
    try:
        speed = float(value)
    except (TypeError, ValueError):
        speed = math.nan
    if not (math.isfinite(speed) and speed > 0):
        raise ConfigError(f"invalid --hspmd-device-speed value {value!r}: must be a number > 0 "
                          "(relative to the device type's nominal speed, e.g. 0.5)")
    return speed


def parse_device_types(path: Optional[str]) -> tuple:
    """``--hspmd-device-types FILE``: a JSON object ``{NAME: {field: value}}``
    (``planner.device_types_from_dict``: a known type keeps the fields not given), as a tuple of
    ``DeviceSpec`` (empty when not given)."""
    if path is None:
        return ()

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return tuple(_planner().device_types_from_dict(data).values())
    except OSError as exc:
        raise ConfigError(f"invalid --hspmd-device-types value {path!r}: {exc.strerror}") \
            from None
    except ValueError as exc:  # json.JSONDecodeError and PlannerError
        raise ConfigError(f"invalid --hspmd-device-types value {path!r}: {exc}") from None


def parse_redundancy(value: Optional[str], max_nodes: int) -> int:
    """``--hspmd-redundancy``: nodes every parameter slice must live on (0 when not given: no
    guarantee; the leader then prefers two nodes when it has them)."""
    if value is None:
        return 0
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"invalid --hspmd-redundancy value {value!r}: must be an integer >= 1 "
                          "(nodes every parameter slice lives on)")
    if count > max_nodes:
        raise ConfigError(f"invalid --hspmd-redundancy value {value!r}: the job has at most "
                          f"{max_nodes} node{'s' if max_nodes != 1 else ''} (--nnodes), so no "
                          f"slice can live on {count}")
    return count


def parse_lengths_flag(value: Optional[str]) -> tuple[tuple[int, float], ...]:
    """``--hspmd-lengths LEN:SHARE,...``: the length buckets, shortest first (none when not
    given); the planner's ``parse_lengths`` says what is valid."""
    if value is None:
        return ()
    planner = _planner()
    try:
        return tuple((b.max_len, b.share) for b in planner.parse_lengths(value))
    except planner.PlannerError as exc:
        why = str(exc)
        named = f"lengths {value!r}"  # the planner's message names the value already
        why = why[len(named):].lstrip(":").strip() if why.startswith(named) else why
        raise ConfigError(f"invalid --hspmd-lengths value {value!r}: {why}") from None


def enforce_memory(params: dict) -> bool:
    """``--hspmd-enforce-memory``: only with a declared ``--hspmd-device-memory`` to enforce."""
    if params.get("hspmd_enforce_memory") and params.get("hspmd_device_memory") is None:
        raise ConfigError("--hspmd-enforce-memory needs --hspmd-device-memory (the memory each "
                          "worker is limited to, plus its measured baseline)")
    return bool(params.get("hspmd_enforce_memory"))


def all_devices(params: dict) -> bool:
    """``--hspmd-all-devices on|off`` (default off): every usable worker gets a role, even one
    whose per-step fixed costs the planner predicts outweigh its work. Read in elastic mode
    only (not a capacity flag: without ``--hspmd-elastic`` it is ignored, so
    ``PET_HSPMD_ALL_DEVICES`` may be set for every launch)."""
    return SWITCHES[_choice("--hspmd-all-devices", params.get("hspmd_all_devices"),
                            tuple(SWITCHES), "off")]


def optimizer_shards(params: dict, lengths: tuple) -> str:
    """``--hspmd-optimizer-shards replicated|uneven`` (default replicated): where the plans'
    AdamW moments live. Read in elastic mode only, like ``--hspmd-all-devices``. Not with
    ``--hspmd-lengths``: a length bucket's plan keeps replicated moments."""
    mode = _choice("--hspmd-optimizer-shards", params.get("hspmd_optimizer_shards"),
                   OPTIMIZER_SHARDS, OPTIMIZER_SHARDS[0])
    if mode != OPTIMIZER_SHARDS[0] and lengths:
        raise ConfigError(f"--hspmd-optimizer-shards {mode} is not supported with "
                          "--hspmd-lengths (length buckets keep replicated optimizer state)")
    return mode


def _choice(flag: str, value: Optional[str], choices, default: str) -> str:
    text = default if value is None else str(value).strip().lower()
    if text not in choices:
        raise ConfigError(f"invalid {flag} value {value!r}: use {' or '.join(choices)}")
    return text


def capacity_settings(params: dict, max_nodes: int) -> dict:
    """The ``ElasticSettings`` fields of the planning flags (``params``: the CLI's values):
    declared memory and speed, the redundancy guarantee, ``--hspmd-planner`` (``hetero``, the
    default, or ``uniform``: one TP/PP everywhere, even layers and rows) and
    ``--hspmd-straggler-replans`` (``on``, the default, or ``off``), ``--hspmd-lengths`` and
    ``--hspmd-optimizer-shards``."""
    lengths = parse_lengths_flag(params.get("hspmd_lengths"))
    return {"device_memory_bytes": parse_device_memory(params.get("hspmd_device_memory")),
            "device_speed": parse_device_speed(params.get("hspmd_device_speed")),
            "redundancy": parse_redundancy(params.get("hspmd_redundancy"), max_nodes),
            "planner": _choice("--hspmd-planner", params.get("hspmd_planner"), PLANNERS,
                               "hetero"),
            "straggler_replans": SWITCHES[_choice("--hspmd-straggler-replans",
                                                  params.get("hspmd_straggler_replans"),
                                                  tuple(SWITCHES), "on")],
            "lengths": lengths,
            "optimizer_shards": optimizer_shards(params, lengths),
            "all_devices": all_devices(params),
            "enforce_memory": enforce_memory(params),
            "device_types": parse_device_types(params.get("hspmd_device_types")),
            **({} if params.get("hspmd_straggler_dwell") is None else
               {"straggler_dwell_s": params["hspmd_straggler_dwell"]})}
