"""GPU health monitoring for the node agent: health sources, verdicts, the hang rule.

Start with ``api.py`` (interfaces, values, errors); ``docs/health.md`` has the rules.
"""

from launcher.health.api import (
    DeviceInfo,
    DeviceState,
    FaultScriptError,
    HealthConfigError,
    HealthError,
    HealthSource,
    HealthSourceUnavailable,
    NullHealthSource,
    Verdict,
    parse_health_source,
)

__all__ = [
    "DeviceInfo",
    "DeviceState",
    "FaultScriptError",
    "HealthConfigError",
    "HealthError",
    "HealthSource",
    "HealthSourceUnavailable",
    "NullHealthSource",
    "Verdict",
    "parse_health_source",
]
