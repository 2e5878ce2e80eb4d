"""``throttle`` and ``unthrottle``: a running worker's CPU capped at a share of a core, and the cap
lifted, through a real CFS quota (``launcher.cgroups``): a real straggler appears mid-run.

``throttle`` finds the worker the way every worker fault does (``targets.find_worker``: the pid
its ``workers/<node>/<local_rank>`` record names, once the process proved it is that worker of
the job), puts it in the job's worker cgroup ``hspmd-<job>/<node>-<local_rank>`` capped at
``cpus`` of a core, and with ``duration_s`` lifts the cap then (a follow-up that ends the
fault). ``unthrottle`` lifts the cap of the worker's cgroup; the worker stays in it, uncapped,
until the harness closes.

Promises: only a proven process of the job goes into a cgroup; the job's ``CpuQuota`` is made
on the first throttle and kept in ``InjectContext.cpu_quota`` (``Quotas``), whose ``close`` (run
by ``InjectContext.close``) moves every process back and removes every cgroup the harness made,
logging (never raising) what it could not (each cgroup's owner is on record, so that what a
SIGKILLed harness left is restored by the next ``inject`` or by the agent at its job's end:
``cgroup_sweep.release``); a machine without a usable CPU cgroup, or a cap
that cannot be set, is ``NotOwnedError``/``InjectError`` with one line saying why; a worker
that exited meanwhile is ``TargetNotFound`` (the harness retries a little).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from launcher.cgroups import CgroupError, CgroupUnavailable, CpuQuota, ProcessGone, \
    worker_cgroup
from launcher.inject.api import InjectError, NotOwnedError, TargetNotFound
from launcher.inject.detect import Injected
from launcher.inject.context import FaultAction, InjectContext, Injection, Timer, worker_dict
from launcher.inject.targets import find_worker

log = logging.getLogger(__name__)


class Quotas:
    """The harness's CPU cgroups of one job (``InjectContext.cpu_quota``): made on first use,
    closed by ``InjectContext.close``."""

    def __init__(self, job: str, quota: Optional[CpuQuota] = None):
        self.job = job
        self._quota = quota

    def get(self) -> CpuQuota:
        if self._quota is None:
            try:
                self._quota = CpuQuota(self.job)
            except CgroupUnavailable as exc:
                raise NotOwnedError(f"throttle needs a CPU cgroup on this machine: {exc}") \
                    from None
        return self._quota

    def close(self) -> None:
        """Every process back, every cgroup removed; a problem is logged, never raised."""
        if self._quota is None:
            return
        try:
            self._quota.close()
        except CgroupError as exc:
            log.warning("[%s] CPU cgroups: %s", self.job, exc)


def quotas(ctx: InjectContext) -> CpuQuota:
    """The job's ``CpuQuota`` (made, and kept in ``ctx.cpu_quota``, on first use)."""
    if ctx.cpu_quota is None:
        ctx.cpu_quota = Quotas(ctx.job)
    return ctx.cpu_quota.get()


def _lift(ctx: InjectContext, name: str) -> Callable[[], None]:
    """A follow-up: lift the cap of cgroup ``name``; a cgroup already gone is no error."""
    def lift() -> None:
        try:
            quotas(ctx).set(name, None)
        except (CgroupError, InjectError) as exc:
            log.warning("[%s] lifting the cap of %s: %s", ctx.job, name, exc)
    return lift


class Throttle(FaultAction):
    """Cap a worker at ``cpus`` of a core; with ``duration_s``, lift the cap then."""

    def inject(self, ctx: InjectContext) -> Injection:
        w = find_worker(ctx, self.spec.target)
        quota = quotas(ctx)
        name = worker_cgroup(w.node, w.local_rank)
        cpus = self.spec.params["cpus"]
        if w.process is not None and not w.process.is_running():  # the pid was reused
            raise TargetNotFound(f"worker {w.node}/{w.local_rank} (pid {w.pid}) of job "
                                 f"{ctx.job} is gone")
        try:
            path = quota.place(name, w.pid, cpus)
        except ProcessGone as exc:
            raise TargetNotFound(f"worker {w.node}/{w.local_rank} of job {ctx.job}: {exc}") \
                from None
        except (CgroupError, ValueError) as exc:
            raise InjectError(f"throttle of worker {w.node}/{w.local_rank}: {exc}") from None
        detail: dict[str, Any] = {
            "pid": w.pid, "cpus": cpus, "cgroup": path,
            "done_by": f"pid {w.pid} capped at {cpus:g} of a core ({quota.hierarchy.describe()}"
                       f": {path})"}
        timers = []
        if "duration_s" in self.spec.params:
            detail["duration_s"] = self.spec.params["duration_s"]
            timers.append(Timer(self.spec.params["duration_s"], "cap lifted", _lift(ctx, name),
                                ends_fault=True))
        return Injection(Injected(self.spec.fault, worker_dict(w), (w.pid,)), detail, timers)


class Unthrottle(FaultAction):
    """Lift the cap a ``throttle`` set on a worker."""

    def inject(self, ctx: InjectContext) -> Injection:
        w = find_worker(ctx, self.spec.target)
        name = worker_cgroup(w.node, w.local_rank)
        quota = quotas(ctx)
        if name not in quota.placed():
            raise InjectError(f"unthrottle: worker {w.node}/{w.local_rank} of job {ctx.job} was "
                              f"not throttled by this harness")
        try:
            quota.set(name, None)
        except CgroupError as exc:
            raise InjectError(f"unthrottle of worker {w.node}/{w.local_rank}: {exc}") from None
        return Injection(Injected(self.spec.fault, worker_dict(w), (w.pid,)),
                         {"pid": w.pid, "cgroup": quota.path(name),
                          "done_by": f"cap of pid {w.pid} lifted ({quota.path(name)})"})


SPEED_FAULT_CLASSES: dict[str, type[FaultAction]] = {"throttle": Throttle,
                                                     "unthrottle": Unthrottle}
