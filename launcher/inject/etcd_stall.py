"""``etcd-stall``: every etcd member of the job stopped at once (SIGSTOP) for ``duration_s``, then
resumed (SIGCONT): the whole coordination layer freezes, as in a maintenance stall or a stuck
storage volume, and every lease that expires meanwhile is gone when it comes back.

The members are reached the ways ``etcd-restart`` reaches one (``faults.EtcdRestart``):

* through the user's ``--etcd-restart-cmd``, run once per endpoint, all at the same time, with
  ``HSPMD_ETCD_HOW=stop`` and ``HSPMD_ETCD_DOWN_S`` the stall's length (the command's "stop"
  is a stall of that member for that long);
* the members the harness owns (``EtcdMember``, e.g. the multi-host topology's, each in its
  network namespace): SIGSTOP to each running member's process;
* (``etcd_by_pid``, as the CLI sets it) the process proven to serve each endpoint on this host
  (``etcd_restart.find_member``).

Promises: all members or none: one that cannot be reached or proven refuses the whole fault
(a stall of some members is a different fault, an etcd member cut off) with one line naming
it; a stopped pid is in ``InjectContext.stopped`` until it is resumed, so ``close`` resumes it
even when the run is interrupted mid-stall; returns once etcd answers again (bounded).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hspmd_elastic.contract.env import ETCD_HOW_ENV, EtcdRestartEnv
from launcher.inject import etcd_restart as er
from launcher.inject.api import InjectError, NotOwnedError

log = logging.getLogger(__name__)


def _stall_by_command(ctx: Any, duration: float) -> dict[str, Any]:
    endpoints = list(ctx.client.endpoints)

    def one(i: int) -> dict[str, Any]:
        env = dict(ctx.env, **EtcdRestartEnv(endpoint=endpoints[i], endpoints=ctx.endpoints,
                                             member=str(i), how="stop", down_s=duration,
                                             job=ctx.job).to_env())
        return er.run_restart_command(ctx.etcd_restart_cmd, ctx.etcd_restart_timeout_s, env)

    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        done = list(pool.map(one, range(len(endpoints))))
    took = max(d["took_s"] for d in done)
    return {"by": "command", "members": endpoints, "command": ctx.etcd_restart_cmd,
            "done_by": f"--etcd-restart-cmd with {ETCD_HOW_ENV}=stop for each of "
                       f"{len(endpoints)} members at once (longest {took:.1f}s)"}


def _pids(ctx: Any) -> tuple[str, list[tuple[str, int]]]:
    """``(how, [(member, pid), ...])``: every member's process, owned or proven."""
    if ctx.etcd_members:
        down = [m.name for m in ctx.etcd_members if not m.running]
        if down:
            raise NotOwnedError(f"etcd-stall: member(s) {', '.join(down)} not running; a stall "
                                "stops every member")
        return "owned", [(m.name, m.proc.pid) for m in ctx.etcd_members]
    if not ctx.etcd_by_pid:
        raise NotOwnedError("etcd-stall needs the job's etcd members: the harness owns none "
                            "and may not look for them (give --etcd-restart-cmd)")
    security = getattr(ctx.client, "security", None)
    found = [er.find_member(ep, ctx.job, security) for ep in ctx.client.endpoints]
    return "pid", [(f.endpoint, f.pid) for f in found]


def stall(ctx: Any, duration: float) -> dict[str, Any]:
    """Stop every member of the job's etcd for ``duration`` seconds, resume them, and wait
    until etcd answers; the injection's detail (``done_by`` says how)."""
    if ctx.etcd_restart_cmd:
        detail = _stall_by_command(ctx, duration)
    else:
        how, pids = _pids(ctx)
        stopped = []
        try:
            for name, pid in pids:
                os.kill(pid, signal.SIGSTOP)
                ctx.stopped.add(pid)
                stopped.append(pid)
            log.info("[%s] etcd stalled: %s stopped for %.1fs", ctx.job,
                     ", ".join(n for n, _ in pids), duration)
            threading.Event().wait(duration)  # the stall itself
        except ProcessLookupError as exc:
            raise InjectError(f"etcd-stall: a member exited before it could be stopped "
                              f"({exc})") from exc
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                ctx.stopped.discard(pid)
        detail = {"by": how, "members": [n for n, _ in pids], "pids": [p for _, p in pids],
                  "done_by": f"{len(pids)} etcd member(s) "
                             f"{'the harness owns' if how == 'owned' else 'proven by pid'}: "
                             f"SIGSTOP for {duration:g}s, then SIGCONT"}
    started = time.monotonic()
    er.wait_answering(ctx.client)
    detail.update(duration_s=duration, answered_after_s=round(time.monotonic() - started, 3))
    return detail
