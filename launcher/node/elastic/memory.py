"""``--hspmd-enforce-memory``: every worker this agent starts runs under a real memory limit, its
declared device memory plus its measured resident baseline (``launcher.cgroup_memory``).

Promises:

* the agent refuses to start (``LaunchError``, one line) when the machine has no writable memory
  controller or the baseline cannot be measured; the baseline is measured once per agent;
* ``prepare`` makes a slot's cgroup ``hspmd-<job>/<node>-<local_rank>`` with its limit before
  the worker is spawned, and the worker joins it before its own code runs (the exec shim of
  ``launcher.node.workers``, ``CGROUP_PROCS_ENV``), so all it allocates is charged there (a
  process it forks later stays there too); ``place`` checks it is there once spawned; a worker
  that cannot be limited is not left running unlimited: ``ElasticWorkers`` stops its group and
  the agent fails;
* ``killed`` says whether a worker's exit was the OOM killer's (SIGKILL with the group's
  ``oom_kill`` count up since it was placed), and ``describe`` is the one-line error of the
  plan, e.g. "plan v3 does not fit the enforced memory: worker node0-1 was killed by the OOM
  killer at 533 MiB (declared 256 MiB + 277 MiB baseline)": not a device failure, the job's
  end (``judge``: the job fails, so no rank trains on after a plan that does not fit);
* ``close`` moves what is left back and removes every cgroup (the agent's end also calls
  ``release_memory``, which restores what a dead agent left).
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

from launcher.api import LaunchError
from launcher.cgroup_memory import MemoryLimits, measure_baseline, memory_limit
from launcher.cgroups import CgroupError, worker_cgroup

log = logging.getLogger(__name__)


class WorkerMemory:
    """The memory limit of every worker of one node's job (see the module doc)."""

    def __init__(self, job: str, node: str, declared: int, baseline: Optional[int] = None,
                 limits: Optional[MemoryLimits] = None):
        self.node = node
        try:
            self.limits = limits if limits is not None else MemoryLimits(job)
            self.limit = memory_limit(declared, measure_baseline() if baseline is None
                                      else baseline)
        except (CgroupError, ValueError) as exc:
            raise LaunchError(f"--hspmd-enforce-memory: {exc}") from None
        self._kills: dict[str, int] = {}  # cgroup -> its oom_kill count when last placed
        log.info("node %s: each worker limited to %s", node, self.limit.describe())

    def name(self, local_rank: int) -> str:
        return worker_cgroup(self.node, local_rank)

    def prepare(self, local_rank: int) -> str:
        """Slot ``local_rank``'s cgroup, made with its limit before the worker is spawned: the
        path its worker writes its pid to first (``workers.CGROUP_PROCS_ENV``)."""
        name = self.name(local_rank)
        self._kills[name] = self.limits.oom_kills(name)
        return self.limits.prepare(name, self.limit)

    def place(self, local_rank: int, pid: int) -> None:
        """Limit worker ``pid`` of slot ``local_rank`` (``ProcessGone`` when it exited): after
        ``prepare`` it checks (and makes sure) the worker is in its cgroup."""
        name = self.name(local_rank)
        self._kills.setdefault(name, self.limits.oom_kills(name))
        self.limits.place(name, pid, self.limit)

    def killed(self, local_rank: int, exitcode: Optional[int]) -> bool:
        """Whether slot ``local_rank``'s worker, which ended with ``exitcode``, was ended by
        the OOM killer of its cgroup."""
        name = self.name(local_rank)
        if exitcode != -signal.SIGKILL or name not in self._kills:
            return False
        try:
            return self.limits.oom_kills(name) > self._kills[name]
        except CgroupError as exc:
            log.warning("node %s: %s", self.node, exc)
            return False

    def describe(self, version: int, local_rank: int) -> str:
        """The plan's one-line error after an OOM kill of slot ``local_rank``'s worker."""
        return (f"plan v{version} does not fit the enforced memory: worker "
                f"{self.name(local_rank)} was killed by the OOM killer at "
                f"{self.limit.describe()}")

    def close(self) -> None:
        try:
            self.limits.close()
        except CgroupError as exc:
            log.warning("node %s: memory cgroups: %s", self.node, exc)
