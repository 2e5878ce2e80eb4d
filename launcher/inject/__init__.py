"""Fault injection: ``hspmd-launch inject`` drives a running job through a scenario of faults
(a timeline in a versioned JSON file) and reports, per fault, when it was injected, detected
and recovered, and how many steps and samples it cost.

Start with ``api.py`` (errors, fault names, report rows); then ``scenario.py`` (the file format,
pure), ``context.py`` (what every fault acts through: ``InjectContext``, and the base
``FaultAction``), ``faults.py`` (each fault acting on real processes, etcd keys and etcd
members; ``etcd_restart.py`` and ``etcd_stall.py`` for the etcd faults, ``topology.py`` for the
links), ``targets.py`` (which processes a fault may signal: only those that prove they are the
job's), ``detect.py`` (what the job recorded: detection and recovery, pure matching;
``progress.py`` reads training progress), ``harness.py`` (the run, one fault at a time),
``report.py`` and ``command.py`` (the CLI).

``command`` (the click command) is imported on first use, so ``launcher.inject:command`` works
as the CLI's subcommand entry without loading click for the pure modules.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "command":
        from launcher.inject.command import command  # startup

        return command
    raise AttributeError(f"module 'launcher.inject' has no attribute {name!r}")
