"""The environment variables that cross processes: each ``HSPMD_*`` name is defined here, once.

Every other module names a variable through a constant of this module, or through ``WorkerEnv``
/ ``HangRule`` / ``EtcdRestartEnv``. Sections:

* **the worker environment** (``WorkerEnv``): what a node agent sets for its workers besides
  torchrun's variables. Restart mode: ``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``,
  ``HSPMD_NODE_ID``, ``HSPMD_ROUND`` and, for hang detection, ``HSPMD_PROGRESS_FILE``. Elastic
  mode: ``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``, ``HSPMD_NODE_ID``, ``HSPMD_PLAN_VERSION`` (the
  plan the worker was started for), ``HSPMD_PROGRESS_FILE`` and, with ``--hspmd-device``,
  ``HSPMD_DEVICE`` (auto, cuda or cpu). ``WorkerEnv.to_env`` writes the fields that are set;
  ``WorkerEnv.from_env`` reads them back, parsed and checked once;
* **etcd's TLS and auth settings** (``HSPMD_ETCD_CACERT`` ... ``HSPMD_ETCD_TLS``): written and
  read by ``hspmd_elastic.coord.security.EtcdSecurity.to_env`` / ``from_env`` (the agent, its
  elastic workers, the ops and inject tools); ``SECRET_ENV`` are the two that carry a password;
* **the agent's own settings**: the hang rule (``HangRule``: ``HSPMD_HANG_*``), the embedded
  etcd's server certificate and key, the etcd binary, the GPU check's wheel folder;
* **the environment of** ``hspmd-launch inject --etcd-restart-cmd`` (``EtcdRestartEnv``).

Values are checked when a ``WorkerEnv`` or ``HangRule`` is made (by ``from_env`` or directly):
a bad one raises an ``EnvError`` (a ``ValueError``), one line naming the variable and the value.
A number is finite and in its range (``NumberRange``, the rule the launcher's numeric flags use
too): ``nan``, ``inf`` and out-of-range values are refused, never taken as "no limit".
A blank value counts as unset. Torch-free and etcd-free (``hspmd_elastic.contract``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional

from hspmd_elastic.contract.ids import ID_RULE, is_id
from hspmd_elastic.contract.text import bounded

# ------------------------------------------------------------------ the worker environment
ETCD_ENDPOINTS_ENV = "HSPMD_ETCD_ENDPOINTS"  # host:port[,host:port...]; also the ops tools' default
JOB_ID_ENV = "HSPMD_JOB_ID"  # the job (the rdzv id); also the ops tools' default
NODE_ID_ENV = "HSPMD_NODE_ID"
ROUND_ENV = "HSPMD_ROUND"  # restart mode: the rendezvous round the worker belongs to
PLAN_VERSION_ENV = "HSPMD_PLAN_VERSION"  # elastic mode: the plan the worker was started for
PROGRESS_FILE_ENV = "HSPMD_PROGRESS_FILE"  # where the worker writes its progress reports
DEVICE_ENV = "HSPMD_DEVICE"  # elastic mode: where the worker computes (DEVICE_SETTINGS)

DEVICE_SETTINGS = ("auto", "cuda", "cpu")

# ------------------------------------------------------------- etcd TLS and auth (EtcdSecurity)
ETCD_CACERT_ENV = "HSPMD_ETCD_CACERT"
ETCD_CERT_ENV = "HSPMD_ETCD_CERT"
ETCD_KEY_ENV = "HSPMD_ETCD_KEY"
ETCD_USER_ENV = "HSPMD_ETCD_USER"
ETCD_PASSWORD_ENV = "HSPMD_ETCD_PASSWORD"
ETCD_PASSWORD_FILE_ENV = "HSPMD_ETCD_PASSWORD_FILE"
ETCD_TLS_ENV = "HSPMD_ETCD_TLS"  # "1": TLS with the system's roots (https:// endpoints, no CA)
SECRET_ENV = (ETCD_PASSWORD_ENV, ETCD_PASSWORD_FILE_ENV)  # never in a restart-mode worker

# ------------------------------------------------------------------ the agent's own settings
HANG_MULTIPLE_ENV = "HSPMD_HANG_MULTIPLE"
HANG_TIMEOUT_ENV = "HSPMD_HANG_TIMEOUT_S"
HANG_STARTUP_ENV = "HSPMD_HANG_STARTUP_S"
ETCD_SERVER_CERT_ENV = "HSPMD_ETCD_SERVER_CERT"  # the embedded etcd's server certificate
ETCD_SERVER_KEY_ENV = "HSPMD_ETCD_SERVER_KEY"  # ... and its key
ETCD_BINARY_ENV = "HSPMD_ETCD_BINARY"  # the etcd server binary the embedded etcd runs
GPU_CHECK_WHEELS_ENV = "HSPMD_GPU_CHECK_WHEELS"  # set by scripts/gpu_check: its wheel folder
# the cgroup.procs file of a worker's memory cgroup: the agent's start shim joins it, then drops
# the variable (``--hspmd-enforce-memory``; launcher.node.workers)
CGROUP_PROCS_ENV = "HSPMD_CGROUP_PROCS"

# ----------------------------------------------------- the --etcd-restart-cmd's environment
ETCD_ENDPOINT_ENV = "HSPMD_ETCD_ENDPOINT"  # the member to act on
ETCD_MEMBER_ENV = "HSPMD_ETCD_MEMBER"  # its index or name, as the scenario gave it ("" if none)
ETCD_HOW_ENV = "HSPMD_ETCD_HOW"  # stop (SIGSTOP, then SIGCONT) or kill (then start again)
ETCD_DOWN_S_ENV = "HSPMD_ETCD_DOWN_S"  # seconds the member stays down


MAX_COUNT = 2**63 - 1  # a round or plan version: etcd's int64


class EnvError(ValueError):
    """An environment variable (or the field that travels in it) has a bad value: one line
    naming the variable and the value."""


def _shown(value: Any) -> str:
    return bounded(repr(value), 140)


def parse_device_setting(value: Optional[str], where: str = DEVICE_ENV) -> str:
    """``auto``, ``cuda`` or ``cpu`` (case and surrounding blanks ignored; unset or blank:
    ``auto``); ``EnvError`` naming ``where`` and the value otherwise."""
    text = "" if value is None else str(value).strip().lower()
    if not text:
        return "auto"
    if text not in DEVICE_SETTINGS:
        raise EnvError(f"{where}={_shown(value)}: use one of {', '.join(DEVICE_SETTINGS)}")
    return text


# ------------------------------------------------------------------ numeric ranges
@dataclass(frozen=True)
class NumberRange:
    """The values a numeric setting may take: finite, between ``lo`` and ``hi`` (``lo`` itself
    excluded when ``lo_open``), an integer when ``integer``. ``parse`` is the one check every
    numeric flag, ``--rdzv-conf`` key and environment variable of the launcher goes through
    (``launcher.numbers``); it raises ``ValueError`` with the reason alone, e.g. ``'nan' is not
    a number of seconds from 1 to 3600``, and each caller names the setting."""

    lo: float
    hi: float
    lo_open: bool = False
    integer: bool = False
    unit: str = ""  # "seconds", or "" for a plain number

    def describe(self) -> str:
        noun = "an integer" if self.integer else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        lo, hi = (f"{int(v)}" if self.integer else f"{v:g}" for v in (self.lo, self.hi))
        return f"{noun}{unit} " + (f"> {lo} and <= {hi}" if self.lo_open else f"from {lo} to {hi}")

    def parse(self, value: Any) -> Any:
        """``value`` (a string or a number) as an ``int`` or ``float`` in range."""
        number: Any = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = int(value.strip()) if self.integer else float(value.strip())
            except ValueError:
                pass
        if self.integer and isinstance(number, float) and number.is_integer():
            number = int(number)
        if isinstance(number, float) and not math.isfinite(number):
            number = None
        if self.integer and not isinstance(number, int):
            number = None
        if number is None or not (number > self.lo if self.lo_open else number >= self.lo) \
                or number > self.hi:
            raise ValueError(f"{_shown(str(value))} is not {self.describe()}")
        return int(number) if self.integer else float(number)


# ------------------------------------------------------------------ field rules
def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _id(var: str, value: Any) -> Optional[str]:
    if value is None or value == "":
        return None
    if not is_id(value):
        raise EnvError(f"{var}={_shown(value)} is not valid: use {ID_RULE}")
    return value


def _text(var: str, value: Any) -> Optional[str]:
    if _blank(value):
        return None
    if not isinstance(value, str) or "\0" in value:
        raise EnvError(f"{var}={_shown(value)} is not a string an environment can hold")
    return value


def _count(var: str, value: Any) -> Optional[int]:
    if _blank(value):
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and text.isdigit() and len(text) < 20 and int(text) <= MAX_COUNT:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    raise EnvError(f"{var}={_shown(value)} is not a non-negative integer (at most {MAX_COUNT})")


def _device(var: str, value: Any) -> Optional[str]:
    return None if _blank(value) else parse_device_setting(value, var)


def _seconds(var: str, value: Any, what: str) -> Optional[float]:
    if _blank(value):
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise EnvError(f"{var}={_shown(value)} is not a number") from None
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise EnvError(f"{var}={_shown(value)}: {what} must be > 0 and finite")
    return number


def _check(obj: Any, rules: Mapping[str, tuple[str, Callable[[str, Any], Any]]]) -> None:
    for name, (var, rule) in rules.items():
        object.__setattr__(obj, name, rule(var, getattr(obj, name)))


def _read(cls: Any, env: Optional[Mapping[str, str]], names: Iterable[str]) -> Any:
    env = os.environ if env is None else env
    rules = cls.RULES
    unknown = sorted(set(names) - set(rules))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
    return cls(**{name: env.get(rules[name][0]) for name in names})


# ------------------------------------------------------------------ the worker environment
@dataclass(frozen=True)
class WorkerEnv:
    """The ``HSPMD_*`` variables a node agent sets for a worker (see the module docstring).
    None: not set. Made with a bad value it raises ``EnvError``; ``device`` is normalised
    (``" CPU"`` is ``"cpu"``)."""

    job: Optional[str] = None  # HSPMD_JOB_ID: an id (contract.ids)
    node: Optional[str] = None  # HSPMD_NODE_ID: an id
    etcd_endpoints: Optional[str] = None  # HSPMD_ETCD_ENDPOINTS: host:port[,host:port...]
    round: Optional[int] = None  # HSPMD_ROUND (restart mode), >= 0
    plan_version: Optional[int] = None  # HSPMD_PLAN_VERSION (elastic mode), >= 0
    progress_file: Optional[str] = None  # HSPMD_PROGRESS_FILE: a path
    device: Optional[str] = None  # HSPMD_DEVICE: one of DEVICE_SETTINGS

    RULES: ClassVar[dict[str, tuple[str, Callable[[str, Any], Any]]]] = {
        "job": (JOB_ID_ENV, _id),
        "node": (NODE_ID_ENV, _id),
        "etcd_endpoints": (ETCD_ENDPOINTS_ENV, _text),
        "round": (ROUND_ENV, _count),
        "plan_version": (PLAN_VERSION_ENV, _count),
        "progress_file": (PROGRESS_FILE_ENV, _text),
        "device": (DEVICE_ENV, _device),
    }

    def __post_init__(self) -> None:
        _check(self, self.RULES)

    def to_env(self) -> dict[str, str]:
        """The variables of the fields that are set (values as ``from_env`` reads them)."""
        return {var: str(getattr(self, name)) for name, (var, _) in self.RULES.items()
                if getattr(self, name) is not None}

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None,
                 fields: Optional[Iterable[str]] = None) -> "WorkerEnv":
        """The worker environment ``env`` (default ``os.environ``) holds, checked; ``EnvError``
        names the first bad variable. ``fields``: read only these (the others stay None), so
        a reader that needs two values is not refused for a bad third one."""
        return _read(cls, env, cls.RULES if fields is None else fields)

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable ``field`` travels in."""
        return cls.RULES[field][0]


# ------------------------------------------------------------------ the agent's hang rule
@dataclass(frozen=True)
class HangRule:
    """The hang detector's limits from the agent's environment (``launcher.health.progress``
    ``HangDetector``); None: the detector's default. Each set value is a finite number > 0."""

    multiple: Optional[float] = None  # HSPMD_HANG_MULTIPLE: limit = multiple * step time
    min_timeout_s: Optional[float] = None  # HSPMD_HANG_TIMEOUT_S: the limit's floor
    startup_grace_s: Optional[float] = None  # HSPMD_HANG_STARTUP_S: the limit before a step

    RULES: ClassVar[dict[str, tuple[str, Callable[[str, Any], Any]]]] = {
        "multiple": (HANG_MULTIPLE_ENV, lambda var, v: _seconds(var, v, "multiple")),
        "min_timeout_s": (HANG_TIMEOUT_ENV, lambda var, v: _seconds(var, v, "min_timeout_s")),
        "startup_grace_s": (HANG_STARTUP_ENV,
                            lambda var, v: _seconds(var, v, "startup_grace_s")),
    }

    def __post_init__(self) -> None:
        _check(self, self.RULES)

    def limits(self) -> dict[str, float]:
        """The set limits, as ``HangDetector``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def to_env(self) -> dict[str, str]:
        """The variables of the set limits (``repr``: ``from_env`` reads the same float)."""
        return {self.RULES[name][0]: repr(value) for name, value in self.limits().items()}

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "HangRule":
        """The limits ``env`` (default ``os.environ``) sets; ``EnvError`` names a bad one."""
        return _read(cls, env, cls.RULES)

    @classmethod
    def variables(cls) -> tuple[str, ...]:
        return tuple(var for var, _ in cls.RULES.values())


# --------------------------------------------------- the --etcd-restart-cmd's environment
@dataclass(frozen=True)
class EtcdRestartEnv:
    """What ``hspmd-launch inject --etcd-restart-cmd`` finds in its environment: the member
    to act on (``endpoint``, ``member``), all of the job's endpoints, ``how`` (``stop`` or
    ``kill``), how long the member stays down, and the job."""

    endpoint: str
    endpoints: str
    member: str
    how: str
    down_s: float
    job: str

    def to_env(self) -> dict[str, str]:
        return {ETCD_ENDPOINT_ENV: self.endpoint, ETCD_ENDPOINTS_ENV: self.endpoints,
                ETCD_MEMBER_ENV: self.member, ETCD_HOW_ENV: self.how,
                ETCD_DOWN_S_ENV: f"{self.down_s:g}", JOB_ID_ENV: self.job}
