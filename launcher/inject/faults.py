"""The faults themselves: each acts on real things of a running job.

* worker faults send real signals to the pid a ``workers/<node>/<local_rank>`` record names,
  once the process itself proved it is that worker of the job (``targets.py``: its environment
  holds the job id, node id and local rank; never its parents or children); ``kill-worker`` is
  SIGKILL, ``stop-worker`` and ``hang`` SIGSTOP (from outside a process, a hang is a process
  that stays alive and stops advancing), optionally resumed (SIGCONT) or escalated (SIGKILL when
  the job has not noticed in time);
* agent faults signal the ``agent_pid`` of ``nodes/<node>``, once its command line (or
  environment) proved it is the job's agent: SIGKILL, or SIGSTOP for ``duration_s`` (longer
  than the lease TTL, so the node's lease expires) then SIGCONT; a process that fails the proof
  is refused (``targets.Refused``, reported with the reason), never signalled;
* device faults append to the node's fault script at ``faults/<node>``, the key a
  ``ScriptedHealthSource`` (``--hspmd-health-source scripted:etcd``) reads, with a
  compare-and-set so that concurrent writers never drop each other's faults;
* ``etcd-restart`` kills (or stops) an etcd member, keeps it down ``down_s`` and starts it
  again on the same ports and data: through the user's ``--etcd-restart-cmd`` when given, else
  a member the harness owns (``EtcdMember``), else (``etcd_by_pid``, as the CLI sets it) the
  process proven to serve the job's endpoint on this host (``etcd_restart.py``);
  ``detail["by"]`` says which;
* ``lost``, ``suspect`` and ``recover`` append the scripted source's kinds of the same names
  (a GPU fallen off the bus; warning signs, which elastic mode answers with a drain; healthy
  again, as after a reset);
* ``etcd-stall`` stops every etcd member at once for ``duration_s`` (``etcd_stall.py``);
* ``join`` starts another ``hspmd-launch`` agent with the job's rendezvous id (inside the
  node's network namespace when the topology names the node);
* ``partition`` cuts a node's links (all, control or data; or an etcd member's) for
  ``duration_s`` and heals them, through the topology file (``launcher.inject.topology``): in
  ``mode`` ``down`` the links go down, in ``drop`` they stay up and drop every packet;
* ``throttle`` caps a worker's CPU at a share of a core in a real cgroup, ``unthrottle`` lifts
  the cap (``throttle.py``; ``InjectContext.close`` removes every cgroup it made).

Promises: a target that matches no live process of the job raises ``TargetNotFound`` naming
the target and what the job has; every process the harness stopped is resumed, every link it
cut is brought up again, and every agent it started is stopped and reaped, by
``InjectContext.close`` (no stopped or orphan process, no cut link is left behind); every wait
is bounded.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable

import psutil

from hspmd_elastic.contract.env import EtcdRestartEnv
from hspmd_elastic.coord.api import Compare, CompareTarget, CoordinationError, PutOp
from hspmd_elastic.coord.client import EtcdClient
from launcher.health.scripted import Fault, encode_fault_script, parse_faults
from launcher.health.verdicts import fault_script_key
from launcher.inject import etcd_restart as er
from launcher.inject.api import InjectError, NotOwnedError, TargetNotFound
from launcher.inject.context import FaultAction, InjectContext, Injection, Timer, worker_dict
from launcher.inject.detect import Injected
from launcher.inject.etcd_stall import stall
from launcher.inject.scenario import SPEED_FAULTS, FaultSpec
from launcher.inject.targets import Refused, find_agent, find_worker
from launcher.inject.throttle import SPEED_FAULT_CLASSES
from launcher.standalone import EtcdStartError

log = logging.getLogger(__name__)

ETCD_START_TIMEOUT_S = 20.0
CAS_TIMEOUT_S = 5.0
__all__ = ["FAULT_CLASSES", "InjectContext", "Refused", "find_agent", "find_worker",
           "make_fault"]


class KillWorker(FaultAction):
    def inject(self, ctx: InjectContext) -> Injection:
        w = find_worker(ctx, self.spec.target)
        ctx.signal(w.process, signal.SIGKILL)
        return Injection(Injected(self.spec.fault, worker_dict(w), (w.pid,)),
                         _refusals(ctx, {"pid": w.pid, "signal": "SIGKILL"}))


class StopWorker(FaultAction):
    """SIGSTOP; ``resume_after_s``: SIGCONT then; ``escalate_after_s``: SIGKILL then, unless
    the job noticed first."""

    def inject(self, ctx: InjectContext) -> Injection:
        w = find_worker(ctx, self.spec.target)
        ctx.signal(w.process, signal.SIGSTOP)
        inj = Injection(Injected(self.spec.fault, worker_dict(w), (w.pid,)),
                        _refusals(ctx, {"pid": w.pid, "signal": "SIGSTOP"}))
        p = self.spec.params
        if "resume_after_s" in p:
            inj.timers.append(Timer(p["resume_after_s"], "SIGCONT",
                                    _quiet(ctx, w.process, signal.SIGCONT), ends_fault=True))
        if "escalate_after_s" in p:
            inj.timers.append(Timer(p["escalate_after_s"], "SIGKILL (not detected in time)",
                                    _quiet(ctx, w.process, signal.SIGKILL),
                                    only_if_undetected=True))
        return inj


class KillAgent(FaultAction):
    def inject(self, ctx: InjectContext) -> Injection:
        node = self.spec.target["node"]
        proc = find_agent(ctx, node)
        ctx.signal(proc, signal.SIGKILL)
        return Injection(Injected(self.spec.fault, {"node": node}, (proc.pid,)),
                         {"pid": proc.pid, "signal": "SIGKILL"})


class FreezeAgent(FaultAction):
    def inject(self, ctx: InjectContext) -> Injection:
        node = self.spec.target["node"]
        proc = find_agent(ctx, node)
        ctx.signal(proc, signal.SIGSTOP)
        duration = self.spec.params["duration_s"]
        return Injection(Injected(self.spec.fault, {"node": node}, (proc.pid,)),
                         {"pid": proc.pid, "signal": "SIGSTOP", "duration_s": duration},
                         [Timer(duration, "SIGCONT (thawed)", _quiet(ctx, proc, signal.SIGCONT),
                                ends_fault=True)])


class DeviceFault(FaultAction):
    """Appends to the node's etcd fault script (read by ``ScriptedHealthSource``)."""

    def faults(self) -> list[Fault]:
        t, p = self.spec.target, self.spec.params
        kind = self.spec.fault
        if kind == "xid":
            return [Fault(device=t["device"], kind="xid", xid=p["xid"])]
        if kind == "ecc":
            return [Fault(device=t["device"], kind="ecc", reason=f"uncorrectable ECC error "
                          f"{i + 1}/{p['count']} (injected burst)") for i in range(p["count"])]
        if kind == "thermal":
            return [Fault(device=t["device"], kind="thermal", slowdown=p["slowdown"])]
        return [Fault(device=t["device"], kind=kind)]  # lost, suspect, recover

    def inject(self, ctx: InjectContext) -> Injection:
        node = self.spec.target["node"]
        key = fault_script_key(ctx.job, node)
        added = self.faults()
        total = append_faults(ctx.client, key, added)
        return Injection(Injected(self.spec.fault, dict(self.spec.target),
                                  xid=self.spec.params.get("xid")),
                         {"key": key, "faults": [f.to_dict() for f in added],
                          "script_length": total})


def append_faults(client: EtcdClient, key: str, added: list[Fault],
                  timeout: float = CAS_TIMEOUT_S) -> int:
    """Append ``added`` to the fault script at ``key`` (compare-and-set, retried on contention);
    returns the script's new length."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(key)
        current = parse_faults(kv.value.decode("utf-8"), f"etcd key {key}") if kv else []
        script = current + added
        res = client.txn([Compare(key, CompareTarget.MOD, "==", kv.mod_revision if kv else 0)],
                         [PutOp(key, encode_fault_script(script))])
        if res.succeeded:
            return len(script)
    raise CoordinationError(f"fault script {key} contended for {timeout}s")


class EtcdRestart(FaultAction):
    def member(self, ctx: InjectContext) -> Any:
        if not ctx.etcd_members:
            raise NotOwnedError("etcd-restart needs the etcd members the harness owns; this run "
                                "was given none (the job's etcd is not the harness's)")
        want = self.spec.target.get("member", 0)
        for i, m in enumerate(ctx.etcd_members):
            if want in (i, m.name):
                return m
        names = ", ".join(m.name for m in ctx.etcd_members)
        raise TargetNotFound(f"etcd member {want!r} is not one of the harness's: {names}")

    def inject(self, ctx: InjectContext) -> Injection:
        how, down = self.spec.params["how"], self.spec.params["down_s"]
        if ctx.etcd_restart_cmd or (ctx.etcd_by_pid and not ctx.etcd_members):
            return self._inject_unowned(ctx, how, down)
        member = self.member(ctx)
        (member.kill if how == "kill" else member.stop)()
        log.info("[%s] etcd member %s %s; down for %.1fs", ctx.job, member.name,
                 "killed" if how == "kill" else "stopped", down)
        threading.Event().wait(down)  # the outage itself
        try:
            member.launch()
            member.wait_healthy(ETCD_START_TIMEOUT_S)
        except (EtcdStartError, OSError) as exc:
            raise InjectError(f"etcd member {member.name} did not come back: {exc}") from exc
        back = time.time()
        log.info("[%s] etcd member %s is back at %s", ctx.job, member.name, member.endpoint)
        return Injection(Injected(self.spec.fault, {"member": member.name}, ended_at=back),
                         {"member": member.name, "how": how, "down_s": down,
                          "endpoint": member.endpoint, "by": "owned",
                          "done_by": f"etcd member {member.name} the harness owns: "
                                     f"{'killed' if how == 'kill' else 'stopped'}, down "
                                     f"{down:g}s, started again"})

    def _inject_unowned(self, ctx: InjectContext, how: str, down: float) -> Injection:
        """Through ``--etcd-restart-cmd``, or the etcd process proven to serve the job."""
        endpoint = er.target_endpoint(list(ctx.client.endpoints),
                                      self.spec.target.get("member"))
        if ctx.etcd_restart_cmd:
            env = dict(ctx.env, **EtcdRestartEnv(
                endpoint=endpoint, endpoints=ctx.endpoints,
                member=str(self.spec.target.get("member", "")), how=how, down_s=down,
                job=ctx.job).to_env())
            detail = er.run_restart_command(ctx.etcd_restart_cmd, ctx.etcd_restart_timeout_s,
                                            env)
        else:
            found = er.find_member(endpoint, ctx.job, getattr(ctx.client, "security", None))
            log_dir = ctx.log_dir or tempfile.mkdtemp(prefix="hspmd-inject-")
            detail = er.restart_found(found, how, down, log_dir, ctx.stopped)
        er.wait_answering(ctx.client)
        back = time.time()
        log.info("[%s] etcd restart done: %s", ctx.job, detail["done_by"])
        return Injection(Injected(self.spec.fault, {"member": endpoint}, ended_at=back),
                         {"endpoint": endpoint, **detail})


class EtcdStall(FaultAction):
    """Every etcd member stopped for ``duration_s``, then resumed (``etcd_stall.py``)."""

    def inject(self, ctx: InjectContext) -> Injection:
        detail = stall(ctx, self.spec.params["duration_s"])
        return Injection(Injected(self.spec.fault, {}, ended_at=time.time()), detail)


class Join(FaultAction):
    def inject(self, ctx: InjectContext) -> Injection:
        node = self.spec.target["node"]
        if node in ctx.spawned and ctx.spawned[node].poll() is None:
            raise TargetNotFound(f"node {node} was already started by this harness (pid "
                                 f"{ctx.spawned[node].pid})")
        args = list(self.spec.params["args"])
        fixed = {"--rdzv-backend": "etcd", "--rdzv-id": ctx.job,
                 "--rdzv-endpoint": ctx.endpoints, "--hspmd-node-id": node}
        front = [x for flag, value in fixed.items() if not _has_flag(args, flag)
                 for x in (flag, value)]
        host = ctx.topology.nodes.get(node) if ctx.topology is not None else None
        netns = ["ip", "netns", "exec", host.netns] if host is not None else []
        argv = [*netns, *ctx.launcher_argv, *front, *args]  # in the node's namespace, if named
        ctx.log_dir = ctx.log_dir or tempfile.mkdtemp(prefix="hspmd-inject-")
        os.makedirs(ctx.log_dir, exist_ok=True)
        out = open(os.path.join(ctx.log_dir, f"join-{node}.log"), "ab")
        try:
            proc = subprocess.Popen(argv, env={**ctx.env, **self.spec.params["env"]},
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise TargetNotFound(f"cannot start agent {argv[0]}: {exc}") from exc
        finally:
            out.close()
        ctx.spawned[node] = proc
        log.info("[%s] started agent for node %s (pid %d)", ctx.job, node, proc.pid)
        return Injection(Injected(self.spec.fault, {"node": node}, (proc.pid,)),
                         {"pid": proc.pid, "argv": argv})


class Partition(FaultAction):
    """Cut a node's links (all, control or data), or an etcd member's, for ``duration_s``: down,
    or up and dropping every packet (``mode``)."""

    def inject(self, ctx: InjectContext) -> Injection:
        if ctx.topology is None:
            raise NotOwnedError("partition needs the job's network topology: give hspmd-launch "
                                "inject --topology FILE (each node's network namespace and "
                                "link devices)")
        t, p = self.spec.target, self.spec.params
        host = ctx.topology.host(node=t.get("node"), member=t.get("member"))
        devices, mode = host.devices(p["links"]), p.get("mode", "down")
        ctx.set_links(host.netns, devices, up=False, mode=mode)
        duration = p["duration_s"]

        def heal() -> None:
            try:
                ctx.set_links(host.netns, devices, up=True, mode=mode)
            except InjectError as exc:
                log.warning("[%s] healing %s: %s", ctx.job, self.spec.describe(), exc)

        return Injection(Injected(self.spec.fault, dict(t)),
                         {"netns": host.netns, "devices": devices, "links": p["links"],
                          "mode": mode, "duration_s": duration},
                         [Timer(duration, "links healed", heal, ends_fault=True)])


def _has_flag(args: list[str], flag: str) -> bool:
    spellings = (flag, "--" + flag[2:].replace("-", "_"))
    return any(a in spellings or a.startswith(tuple(s + "=" for s in spellings)) for a in args)




def _quiet(ctx: InjectContext, proc: psutil.Process, sig: signal.Signals
           ) -> Callable[[], None]:
    """A follow-up signal: a process that already exited (or whose pid was reused) is no
    error."""
    def send() -> None:
        try:
            ctx.signal(proc, sig)
        except TargetNotFound:
            log.info("[%s] pid %d already gone; %s not sent", ctx.job, proc.pid, sig.name)
    return send


def _refusals(ctx: InjectContext, detail: dict[str, Any]) -> dict[str, Any]:
    """``detail`` plus the processes records named that were refused on the way, if any."""
    if ctx.refusals:
        detail["refused"] = list(ctx.refusals)
        ctx.refusals.clear()
    return detail


FAULT_CLASSES: dict[str, type[FaultAction]] = {
    "kill-worker": KillWorker, "stop-worker": StopWorker, "hang": StopWorker,
    "kill-agent": KillAgent, "freeze-agent": FreezeAgent, "xid": DeviceFault,
    "ecc": DeviceFault, "thermal": DeviceFault, "etcd-restart": EtcdRestart, "join": Join,
    "partition": Partition, "lost": DeviceFault, "suspect": DeviceFault, "recover": DeviceFault,
    "etcd-stall": EtcdStall,
}


def make_fault(spec: FaultSpec) -> FaultAction:
    if spec.fault in SPEED_FAULTS:
        return SPEED_FAULT_CLASSES[spec.fault](spec)
    return FAULT_CLASSES[spec.fault](spec)
