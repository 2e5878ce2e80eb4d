"""Elastic mode's workers on one node: surviving workers are never restarted.

``ElasticWorkers.apply_plan`` starts workers only for this node's devices that a plan adds
(``new_local_ranks``, pure; a plan is its full record or its head, ``coord.plans.node_ranks``:
the agent follows the head), spawning through ``launcher.node.workers`` with the elastic worker
environment (``launcher.node.env``); a slot whose worker exited is not started again (a failed
one is failed for the leader too), unless the worker left because the newest plan did not use
its device (its last report is ``excluded``, ``contract.LEFT_STATES``): a later plan that uses
the device again (a healed partition) starts a new worker there. ``poll`` reports each exit once and keeps it
in ``exits`` with the worker's final reported state, read from its progress file.

A worker's stderr always goes to ``stderr.log`` beside its error file (``with_stderr_file``),
copied to the agent's console as ``--tee 2`` does when the console shows it: the agent reads
the error a failed worker printed from it, with or without ``@record`` (``exits``).

With ``memory`` (``--hspmd-enforce-memory``, ``elastic.memory.WorkerMemory``) each worker joins
its memory cgroup, made beforehand, before its own code runs, and is checked to be there once
spawned; one that cannot be limited is stopped with its group (``LaunchError``: the agent fails, no worker runs unlimited); ``oom_killed`` holds the pids
the OOM killer ended.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
from typing import Callable, Iterable, Mapping, Optional, Sequence

from hspmd_elastic.contract.progress import LEFT_STATES, read_progress
from hspmd_elastic.coord.plans import AnyPlan, node_ranks
from launcher.api import LaunchError
from launcher.cgroups import CgroupError, ProcessGone
from launcher.logs import WorkerLogPaths
from launcher.node.env import elastic_worker_env, worker_argv
from launcher.node.elastic.exits import WorkerExit
from launcher.node.elastic.memory import WorkerMemory
from launcher.node.workers import CGROUP_PROCS_ENV, Worker, WorkerGroup

log = logging.getLogger(__name__)


def plan_rank(plan: AnyPlan, node: str, local_rank: int) -> Optional[int]:
    """The rank of slot ``local_rank`` of ``node`` in ``plan`` (None when not in it)."""
    return node_ranks(plan, node).get(local_rank)


def with_stderr_file(logs: WorkerLogPaths) -> WorkerLogPaths:
    """Pure: ``logs`` with stderr kept in ``stderr.log`` beside the error file (shown on the
    console as before when it was, with the rank's prefix); itself when already kept."""
    if logs.stderr is not None:
        return logs
    return dataclasses.replace(
        logs, stderr=os.path.join(os.path.dirname(logs.error_file), "stderr.log"),
        tee_stderr=logs.console)


def new_local_ranks(plan: AnyPlan, node: str, running: Iterable[int]) -> list[int]:
    """Pure: this node's slots that ``plan`` uses and that run no worker yet."""
    have = set(running)
    return [lr for lr in sorted(node_ranks(plan, node)) if lr not in have]


def idle_local_ranks(plan: AnyPlan, node: str, slots: Iterable[int],
                     skip: Iterable[int]) -> list[int]:
    """Pure: this node's ``slots`` that ``plan`` leaves idle while it uses another slot of the
    node (a node the plan does not use at all is a spare: no worker), less ``skip``."""
    used = node_ranks(plan, node)
    if not used:
        return []
    skip = set(skip)
    return sorted(lr for lr in set(slots) if lr not in used and lr not in skip)


class ElasticWorkers:
    """This node's workers in elastic mode: started per plan for new slots only, each exit
    reported once by ``poll`` and remembered in ``exits`` with its worker (for the failure
    summary) and the final state it reported in its progress file (``done``, ``excluded``)."""

    def __init__(self, job: str, node: str, entrypoint: Sequence[str], endpoints: Sequence[str],
                 log_paths: Callable[[int, int], WorkerLogPaths],
                 base_env: Optional[Mapping[str, str]] = None, role: str = "default",
                 progress_dir: Optional[str] = None, memory: Optional[WorkerMemory] = None):
        self.job, self.node, self.role = job, node, role
        self.progress_dir = progress_dir or tempfile.mkdtemp(prefix=f"hspmd_progress_{node}_")
        self.entrypoint, self.endpoints = tuple(entrypoint), tuple(endpoints)
        self._log_paths = log_paths  # (plan version, local rank) -> paths
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._groups: list[WorkerGroup] = []
        self._running: dict[int, Worker] = {}
        self._ended: set[int] = set()  # slots whose worker exited: never started again
        # slot -> the plan version its idle worker was started under; one that exited is not
        # started again under the same plan (it left because the job ended)
        self._idle: dict[int, int] = {}
        self._idle_done: dict[int, int] = {}
        self.exits: list[tuple[WorkerExit, Worker, str]] = []  # (exit, worker, final state)
        self.memory = memory  # --hspmd-enforce-memory
        self.oom_killed: set[int] = set()  # pids of workers the OOM killer ended

    def progress_file(self, local_rank: int) -> str:
        """Where slot ``local_rank``'s worker writes its progress (``HSPMD_PROGRESS_FILE``)."""
        return os.path.join(self.progress_dir, f"progress_{local_rank}.json")

    def final_state(self, local_rank: int, pid: int) -> str:
        """The state the worker ``pid`` of slot ``local_rank`` reported last ("" if none)."""
        report = read_progress(self.progress_file(local_rank), local_rank)
        return report.state if report is not None and report.pid == pid else ""

    def running(self) -> dict[int, int]:
        """local rank -> pid of the workers alive now."""
        return {lr: w.pid for lr, w in self._running.items()}

    def apply_plan(self, plan: AnyPlan, slots: Iterable[int] = (),
                   idle_only: bool = False) -> list[Worker]:
        """Start workers for the slots ``plan`` (its full record or its head) adds on this
        node; survivors are left alone. ``slots``: this node's slots; when the plan uses one
        of them, each other one that runs no worker (and has not ended) gets an idle worker,
        which probes its device while it waits for a plan that uses it (``idle_local_ranks``).
        ``idle_only``: only those idle workers (a worker the plan drained left its slot)."""
        ranks = node_ranks(plan, self.node)
        skip = set(self._running) | self._ended
        new = [] if idle_only else [lr for lr in sorted(ranks) if lr not in skip]
        for lr in new:
            self._idle.pop(lr, None)  # a planned slot: its worker is no idle one
        idle = [lr for lr in idle_local_ranks(plan, self.node, slots, skip)
                if self._idle_done.get(lr) != plan.version]
        self._idle.update({lr: plan.version for lr in idle})
        ranks = {**{lr: -1 for lr in idle}, **ranks}  # an idle worker has no rank yet
        new = sorted(new + idle)
        if not new:
            return []
        workers = []
        for lr in new:
            argv = worker_argv(self.entrypoint, lr)
            progress = self.progress_file(lr)
            if os.path.exists(progress):  # a previous worker's last report
                os.unlink(progress)
            env = elastic_worker_env(self._base_env, self.endpoints, self.job, self.node, lr,
                                     plan.version, progress)
            logs = with_stderr_file(self._log_paths(plan.version, lr))
            env["TORCHELASTIC_ERROR_FILE"] = logs.error_file  # for torchrun's failure summary
            if self.memory is not None:  # the worker joins its memory cgroup before its code
                env[CGROUP_PROCS_ENV] = self._prepare(lr)
            workers.append(Worker(local_rank=lr, global_rank=ranks[lr],
                                  argv=argv, env=env, logs=logs))
        group = WorkerGroup(role=self.role, workers=workers)
        group.start()
        self._limit(group)
        self._groups.append(group)
        self._running.update({w.local_rank: w for w in workers})
        log.info("[%s] node %s: plan v%d adds slot(s) %s%s: started pid(s) %s", self.job,
                 self.node, plan.version, new, f" ({idle} idle)" if idle else "",
                 [w.pid for w in workers])
        return workers

    def _prepare(self, local_rank: int) -> str:
        try:
            return self.memory.prepare(local_rank)
        except (CgroupError, ValueError) as exc:
            raise LaunchError(f"--hspmd-enforce-memory: slot {local_rank}: {exc}") from None

    def _limit(self, group: WorkerGroup) -> None:
        """Each new worker under its memory limit; none left running unlimited."""
        if self.memory is None:
            return
        for w in group.workers:
            try:
                self.memory.place(w.local_rank, w.pid)
            except ProcessGone:
                pass  # exited already: poll reports it
            except (CgroupError, ValueError) as exc:
                group.stop(signal.SIGKILL, grace_s=0.0)
                raise LaunchError(f"--hspmd-enforce-memory: worker {w.local_rank} "
                                  f"(pid {w.pid}) cannot be limited: {exc}") from None

    def poll(self) -> list[WorkerExit]:
        """Workers that ended since the last poll (each reported once)."""
        for group in self._groups:
            group.poll()
        out = []
        for lr, w in sorted(self._running.items()):
            if w.exitcode is not None:
                ex = WorkerExit.from_returncode(lr, w.pid, w.exitcode)
                if self.memory is not None and self.memory.killed(lr, w.exitcode):
                    self.oom_killed.add(w.pid)
                out.append(ex)
                del self._running[lr]
                if lr in self._idle:
                    self._idle_done[lr] = self._idle.pop(lr)
                final = self.final_state(lr, w.pid)
                if final not in LEFT_STATES:  # a slot a plan left may be used again later
                    self._ended.add(lr)
                self.exits.append((ex, w, final))
        live = [g for g in self._groups
                if any(w.local_rank in self._running and self._running[w.local_rank] is w
                       for w in g.workers)]
        for group in self._groups:
            if all(g is not group for g in live):  # every worker exited: its console copies end, files close
                group.finish_logs()
        self._groups = live
        return out

    def stop(self, grace_s: float = 30.0) -> None:
        for group in self._groups:
            group.stop(signal.SIGTERM, grace_s)
        self._groups, self._running = [], {}
        if self.memory is not None:
            self.memory.close()
