"""Scenario files: a versioned JSON timeline of faults to drive a running job (pure, no I/O but
``load_scenario`` reading the file).

A scenario::

    {"schema": 1, "kind": "fault_scenario", "name": "five-faults",
     "defaults": {"detect_timeout_s": 30, "recover_timeout_s": 60},
     "faults": [
       {"at": {"step": 3}, "fault": "kill-worker", "target": {"node": "node-a", "local_rank": 1}},
       {"at": 20.0, "fault": "xid", "target": {"node": "node-a", "device": 0}, "xid": 79}
     ]}

``at`` is seconds after the scenario starts, or ``{"step": n}``: once training completed ``n``
steps (and the previous fault is settled; faults run in order, one at a time). Per fault:

============== ======================================= ==========================================
fault          target                                  parameters
============== ======================================= ==========================================
kill-worker    node, local_rank, rank (all optional)   -
stop-worker    node, local_rank, rank (all optional)   resume_after_s | escalate_after_s
hang           node, local_rank, rank (all optional)   escalate_after_s
kill-agent     node                                    -
freeze-agent   node                                    duration_s (default 10)
xid            node, device                            xid (required)
ecc            node, device                            count (default 1: the burst size)
thermal        node, device                            slowdown in (0, 1] (required)
lost           node, device                            - (the GPU fell off the bus)
suspect        node, device                            - (warning signs: elastic mode drains it)
recover        node, device                            - (healthy again, as after a GPU reset)
etcd-restart   member (name or index, optional)        down_s (default 0.5), how: kill | stop
etcd-stall     - (every etcd member)                   duration_s (default 10)
join           node                                    args (hspmd-launch flags + script), env
partition      node, or member (an etcd member)        links: all | control | data (default
                                                       all; a member has control only),
                                                       mode: down | drop (default down),
                                                       duration_s (default 10)
throttle       node, local_rank (both required)        cpus in (0, cores] (required: the share
                                                       of one core), duration_s (then lifted)
unthrottle     node, local_rank (both required)        - (lifts the cap a throttle set)
============== ======================================= ==========================================

``partition`` cuts links for ``duration_s`` and then heals them; it needs the job's network
topology (``hspmd-launch inject --topology FILE``, ``launcher.inject.topology``). ``mode``
``down`` brings the links down (the cut host's own connections fail at once); ``drop`` leaves
them up and drops every packet (connections from either side hang until their own timeouts). A partition of a
node expects the job to react (a ``leave`` when the control link is cut past the lease TTL, an
``unreachable`` change when only the data link is, or a ``failure``/``stall``) and, in an elastic
job, to take the node back after the heal (a ``join``), as after ``freeze-agent``'s thaw; one of
an etcd member, like ``etcd-restart``, expects the job to ride through it. ``etcd-stall``
stops every etcd member at once (SIGSTOP) for ``duration_s`` and resumes them: longer than the
lease TTL, every lease expires, and the job should ride through it too (the agents re-register;
nothing is replanned).

``throttle`` puts a running worker in a CPU cgroup capped at ``cpus`` of a core
(``launcher.cgroups``: a real CFS quota, so the worker really computes that much slower: a
straggler appears mid-run); ``unthrottle`` (or ``duration_s`` after the throttle) lifts the cap.
They act on this machine's cgroups, so the harness runs on the worker's host; the job is
expected to replan the device ``<node>:<local_rank>`` with a ``degrade`` change (a ``recover``
one after the unthrottle).

Every entry may also give ``detect_timeout_s``, ``recover_timeout_s`` and ``comment``.
Promises: a scenario is validated as a whole; the first problem raises ``ScenarioError`` naming
the file, the entry (index and fault) and the bad value with what would be valid; every number
(``at``, durations, timeouts, ``cpus``...) is finite (JSON's ``Infinity`` and ``NaN`` are
refused), so no wait of the harness is unbounded.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hspmd_elastic.contract.ids import ID_RULE, is_id
from launcher.inject.api import (
    AGENT_FAULTS,
    NETWORK_FAULTS,
    DEVICE_FAULTS,
    FAULT_NAMES,
    SCENARIO_KIND,
    SPEED_FAULTS,
    SCENARIO_SCHEMA,
    WORKER_FAULTS,
    ScenarioError,
)
from launcher.cgroups import MIN_QUOTA_US, PERIOD_US
from launcher.inject.topology import PARTITION_MODES

DEFAULT_DETECT_TIMEOUT_S = 30.0
DEFAULT_RECOVER_TIMEOUT_S = 60.0
DEFAULT_TRIGGER_TIMEOUT_S = 300.0
DEFAULT_FREEZE_S = 10.0
DEFAULT_ETCD_DOWN_S = 0.5
DEFAULT_PARTITION_S = 10.0
DEFAULT_ETCD_STALL_S = 10.0
PARTITION_LINKS = ("all", "control", "data")
SCENARIO_FAULTS = FAULT_NAMES
MIN_CPUS = MIN_QUOTA_US / PERIOD_US

_TOP_FIELDS = {"schema", "kind", "name", "description", "defaults", "faults"}
_DEFAULT_FIELDS = {"detect_timeout_s", "recover_timeout_s", "trigger_timeout_s"}
_COMMON = {"at", "fault", "target", "detect_timeout_s", "recover_timeout_s", "comment"}
_WORKER_TARGET = {"node", "local_rank", "rank"}
_TARGETS: dict[str, set[str]] = {
    **{f: _WORKER_TARGET for f in WORKER_FAULTS},
    **{f: {"node"} for f in AGENT_FAULTS},
    **{f: {"node", "device"} for f in DEVICE_FAULTS},
    "etcd-restart": {"member"},
    "etcd-stall": set(),
    "join": {"node"},
    **{f: {"node", "member"} for f in NETWORK_FAULTS},
    **{f: {"node", "local_rank"} for f in SPEED_FAULTS},
}
_REQUIRED_TARGET: dict[str, tuple[str, ...]] = {
    **{f: ("node",) for f in AGENT_FAULTS},
    **{f: ("node", "device") for f in DEVICE_FAULTS},
    "join": ("node",),
    **{f: ("node", "local_rank") for f in SPEED_FAULTS},
}
_PARAMS: dict[str, set[str]] = {
    "kill-worker": set(),
    "stop-worker": {"resume_after_s", "escalate_after_s"},
    "hang": {"escalate_after_s"},
    "kill-agent": set(),
    "freeze-agent": {"duration_s"},
    "xid": {"xid"},
    "ecc": {"count"},
    "thermal": {"slowdown"},
    "lost": set(),
    "suspect": set(),
    "recover": set(),
    "etcd-restart": {"down_s", "how"},
    "etcd-stall": {"duration_s"},
    "join": {"args", "env"},
    "partition": {"links", "mode", "duration_s"},
    "throttle": {"cpus", "duration_s"},
    "unthrottle": set(),
}


@dataclass(frozen=True)
class FaultSpec:
    """One validated scenario entry. Exactly one of ``at_s`` / ``at_step`` is set."""

    index: int
    fault: str
    target: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    at_s: Optional[float] = 0.0
    at_step: Optional[int] = None
    detect_timeout_s: float = DEFAULT_DETECT_TIMEOUT_S
    recover_timeout_s: float = DEFAULT_RECOVER_TIMEOUT_S
    comment: str = ""

    def describe(self) -> str:
        where = ",".join(f"{k}={v}" for k, v in sorted(self.target.items())) or "any"
        return f"#{self.index} {self.fault}[{where}]"


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[FaultSpec, ...]
    trigger_timeout_s: float = DEFAULT_TRIGGER_TIMEOUT_S
    description: str = ""


# ------------------------------------------------------------------------------------ checks
def _number(value: Any, what: str, where: str, minimum: float = 0.0, positive: bool = False,
            maximum: Optional[float] = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    finite = ok and math.isfinite(value)  # JSON's Infinity and NaN would wait forever
    if ok:
        ok = finite and (value > minimum if positive else value >= minimum)
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        rng = f"> {minimum}" if positive else f">= {minimum}"
        if maximum is not None:
            rng += f" and <= {maximum}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        kind = "a finite number" if number and not finite else "a number"
        raise ScenarioError(where, f"{what} must be {kind} {rng}, got {value!r}")
    return float(value)


def _integer(value: Any, what: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScenarioError(where, f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _ident(value: Any, what: str, where: str) -> str:
    if not is_id(value):
        raise ScenarioError(where, f"{what} must be an id of {ID_RULE}, got {value!r}")
    return value


def _unknown(body: dict, allowed: set[str], what: str, where: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ScenarioError(where, f"unknown {what} {', '.join(extra)}; valid: "
                                   f"{', '.join(sorted(allowed)) or 'none'}")


def _at(value: Any, where: str) -> tuple[Optional[float], Optional[int]]:
    if isinstance(value, dict):
        _unknown(value, {"step"}, "field(s) in at", where)
        if "step" not in value:
            raise ScenarioError(where, "at must be seconds or {\"step\": n}")
        return None, _integer(value["step"], "at.step", where)
    return _number(value, "at (seconds after the start)", where), None


def _target(fault: str, body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ScenarioError(where, f"target must be a JSON object, got {body!r}")
    _unknown(body, _TARGETS[fault], f"target field(s) for {fault}", where)
    for name in _REQUIRED_TARGET.get(fault, ()):
        if name not in body:
            raise ScenarioError(where, f"{fault} needs target.{name}")
    out: dict[str, Any] = {}
    if fault in NETWORK_FAULTS and ("node" in body) == ("member" in body):
        raise ScenarioError(where, f"{fault} needs target.node or target.member (one of them)")
    for name, value in body.items():
        if name == "node":
            out[name] = _ident(value, "target.node", where)
        elif name == "member" and isinstance(value, str):
            out[name] = _ident(value, "target.member", where)
        else:
            out[name] = _integer(value, f"target.{name}", where)
    return out


def _cpus(entry: dict, where: str) -> float:
    """``throttle``'s ``cpus``: the share of one core, in ``[MIN_CPUS, cores]``."""
    if "cpus" not in entry:
        raise ScenarioError(where, "throttle needs cpus: the share of one core the worker keeps "
                                   "(e.g. 0.125)")
    cores = os.cpu_count() or 1
    cpus = _number(entry["cpus"], "cpus", where, positive=True, maximum=float(cores))
    if cpus < MIN_CPUS:
        raise ScenarioError(where, f"cpus must be >= {MIN_CPUS:g} (the kernel's smallest CFS "
                                   f"quota), got {entry['cpus']!r}")
    return cpus


def _params(fault: str, entry: dict, where: str) -> dict[str, Any]:
    p: dict[str, Any] = {}
    if fault == "stop-worker":
        if "resume_after_s" in entry and "escalate_after_s" in entry:
            raise ScenarioError(where, "give resume_after_s or escalate_after_s, not both")
    for name in ("resume_after_s", "escalate_after_s", "duration_s"):
        if name in entry:
            p[name] = _number(entry[name], name, where, positive=True)
    if fault == "freeze-agent":
        p.setdefault("duration_s", DEFAULT_FREEZE_S)
    if fault == "etcd-stall":
        p.setdefault("duration_s", DEFAULT_ETCD_STALL_S)
    if fault == "partition":
        p.setdefault("duration_s", DEFAULT_PARTITION_S)
        links = entry.get("links", "all")
        if links not in PARTITION_LINKS:
            raise ScenarioError(where, f"links must be one of {', '.join(PARTITION_LINKS)}, "
                                       f"got {links!r}")
        p["links"] = links
        mode = entry.get("mode", "down")
        if mode not in PARTITION_MODES:
            raise ScenarioError(where, f"mode must be one of {', '.join(PARTITION_MODES)}, "
                                       f"got {mode!r}")
        p["mode"] = mode
    if fault == "xid":
        if "xid" not in entry:
            raise ScenarioError(where, "xid needs an xid number (e.g. 79: GPU fell off the bus)")
        p["xid"] = _integer(entry["xid"], "xid", where)
    if fault == "ecc":
        p["count"] = _integer(entry.get("count", 1), "count", where, minimum=1)
    if fault == "thermal":
        if "slowdown" not in entry:
            raise ScenarioError(where, "thermal needs a slowdown in (0, 1] (relative speed)")
        p["slowdown"] = _number(entry["slowdown"], "slowdown", where, positive=True, maximum=1.0)
    if fault == "throttle":
        p["cpus"] = _cpus(entry, where)
    if fault == "etcd-restart":
        p["down_s"] = _number(entry.get("down_s", DEFAULT_ETCD_DOWN_S), "down_s", where)
        how = entry.get("how", "kill")
        if how not in ("kill", "stop"):
            raise ScenarioError(where, f"how must be kill or stop, got {how!r}")
        p["how"] = how
    if fault == "join":
        args = entry.get("args")
        if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
            raise ScenarioError(where, "join needs args: a non-empty list of strings (the "
                                       "hspmd-launch flags and the training script)")
        env = entry.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            raise ScenarioError(where, f"env must map names to strings, got {env!r}")
        p["args"], p["env"] = list(args), dict(env)
    return p


def parse_fault(entry: Any, index: int, defaults: dict[str, float], where: str) -> FaultSpec:
    """One scenario entry -> ``FaultSpec``; ``ScenarioError`` names the entry and the problem."""
    here = f"{where} fault {index}"
    if not isinstance(entry, dict):
        raise ScenarioError(here, f"expected a JSON object, got {type(entry).__name__}")
    fault = entry.get("fault")
    if fault not in SCENARIO_FAULTS:
        raise ScenarioError(here, f"fault {fault!r} is not one of {', '.join(SCENARIO_FAULTS)}")
    here = f"{here} ({fault})"
    _unknown(entry, _COMMON | _PARAMS[fault], f"field(s) for {fault}", here)
    at_s, at_step = _at(entry.get("at", 0.0), here)
    comment = entry.get("comment", "")
    if not isinstance(comment, str):
        raise ScenarioError(here, f"comment must be a string, got {comment!r}")
    timeouts = {
        name: _number(entry.get(name, defaults[name]), name, here, positive=True)
        for name in ("detect_timeout_s", "recover_timeout_s")
    }
    return FaultSpec(index=index, fault=fault, target=_target(fault, entry.get("target", {}), here),
                     params=_params(fault, entry, here), at_s=at_s, at_step=at_step,
                     comment=comment, **timeouts)


def parse_scenario(body: Any, where: str = "<scenario>") -> Scenario:
    """A decoded scenario object -> ``Scenario`` (validated as a whole)."""
    if not isinstance(body, dict):
        raise ScenarioError(where, f"expected a JSON object with schema, kind and faults, got "
                                   f"{type(body).__name__}")
    _unknown(body, _TOP_FIELDS, "top-level field(s)", where)
    if body.get("schema") != SCENARIO_SCHEMA:
        raise ScenarioError(where, f"schema must be {SCENARIO_SCHEMA}, got "
                                   f"{body.get('schema')!r}")
    if body.get("kind") != SCENARIO_KIND:
        raise ScenarioError(where, f"kind must be {SCENARIO_KIND!r}, got {body.get('kind')!r}")
    raw_defaults = body.get("defaults", {})
    if not isinstance(raw_defaults, dict):
        raise ScenarioError(where, f"defaults must be an object, got {raw_defaults!r}")
    _unknown(raw_defaults, _DEFAULT_FIELDS, "field(s) in defaults", where)
    defaults = {"detect_timeout_s": DEFAULT_DETECT_TIMEOUT_S,
                "recover_timeout_s": DEFAULT_RECOVER_TIMEOUT_S,
                "trigger_timeout_s": DEFAULT_TRIGGER_TIMEOUT_S}
    for name, value in raw_defaults.items():
        defaults[name] = _number(value, f"defaults.{name}", where, positive=True)
    faults = body.get("faults")
    if not isinstance(faults, list) or not faults:
        raise ScenarioError(where, "faults must be a non-empty list of fault entries")
    specs = tuple(parse_fault(e, i, defaults, where) for i, e in enumerate(faults))
    name = body.get("name", "")
    description = body.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise ScenarioError(where, "name and description must be strings")
    return Scenario(name=name, faults=specs, trigger_timeout_s=defaults["trigger_timeout_s"],
                    description=description)


def parse_scenario_text(text: str, where: str = "<scenario>") -> Scenario:
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ScenarioError(where, f"not JSON ({exc})") from exc
    return parse_scenario(body, where)


def load_scenario(path: str) -> Scenario:
    """Read and validate a scenario file (``ScenarioError`` for a missing or bad file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ScenarioError(path, f"cannot read it ({exc.strerror or exc})") from exc
    return parse_scenario_text(text, path)
