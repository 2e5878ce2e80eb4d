"""A node id has one live owner, and a job one mode: the agent's claim (``claims/<node_id>``).

Before an agent of either mode writes anything else of the job, ``claim_node`` creates
``claims/<node_id>`` under the agent's lease, only if it is absent, with the agent's host, pid and
mode (``NodeClaimRecord``). Promises:

* **one live owner per node id**: when the key exists, the agent fails in one line naming the id
  and the holder's host and pid. A claim left by a dead agent is not in the way for long: one of
  this host whose pid is gone (a SIGKILLed agent) is taken over at once by revoking its lease,
  and another host's claim is waited out for one lease TTL (a dead holder's lease expires
  within it; a live holder keeps refreshing it);
* **the earliest claim's mode is the job's**: after claiming, the agent reads every claim; when
  a claim of the other mode was created before its own, it deletes its claim and fails in one
  line. etcd orders claims by create revision, so of two agents that claim at the same time the
  later one loses: the job that runs is never the one that loses;
* every wait ends on the agent's abort signal, and every etcd call has a deadline.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.errors import RecordError
from hspmd_elastic.coord.api import Compare, CompareTarget, GetOp, KeyValue, PutOp
from launcher.api import LaunchError
from launcher.node.api import AgentContext

log = logging.getLogger(__name__)

POLL_S = 0.25  # while waiting out another host's claim


class NodeClaimError(LaunchError):
    """The agent may not run this node id in this job (one line)."""


def agent_mode(ctx: AgentContext) -> str:
    return "elastic" if ctx.config.elastic is not None else "restart"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim_node(ctx: AgentContext, timeout: float = 5.0) -> int:
    """Claim ``ctx.node_id`` for this agent; returns the claim's create revision. Raises
    ``NodeClaimError`` (the one line), ``CoordinationError``, or ``SignalReceived``."""
    job, node, mode = ctx.job, ctx.node_id, agent_mode(ctx)
    key = schema.claim_key(job, node)
    mine = schema.NodeClaimRecord(node=node, host=ctx.host, pid=os.getpid(), mode=mode,
                                  at=time.time())
    value = schema.encode(mine)
    ctx.session.start()
    deadline: Optional[float] = None
    while True:
        ctx.check_abort()
        lease = ctx.session.lease_id or 0
        res = ctx.client.txn([Compare(key, CompareTarget.CREATE, "==", 0)],
                             [PutOp(key, value, lease)], [GetOp(key)], timeout=timeout)
        if res.succeeded:
            ctx.session.put(key, value)  # owned: re-created under a new lease after a loss
            revision = res.revision
            break
        holder = res.gets[0] if res.gets else None
        if holder is None:  # it vanished between the compare and the read
            continue
        deadline, again = _in_the_way(ctx, holder, deadline, timeout)
        if not again:
            ctx.wait(POLL_S)
    _check_mode(ctx, revision, timeout)
    return revision


def _holder(kv: KeyValue) -> Optional[schema.NodeClaimRecord]:
    try:
        return schema.decode(kv.key, kv.value)
    except RecordError as exc:
        log.warning("unreadable node claim %s: %s", kv.key, exc)
        return None


def _in_the_way(ctx: AgentContext, kv: KeyValue, deadline: Optional[float],
                timeout: float) -> tuple[Optional[float], bool]:
    """Handle a claim held by another lease: take over a dead local holder's, wait out another
    host's for one lease TTL, fail on a live one. Returns the wait's deadline, and whether to
    claim again at once (the dead holder's claim is gone)."""
    holder = _holder(kv)
    who = (f"host {holder.host}, pid {holder.pid}" if holder is not None
           else "an unreadable claim")
    now = ctx.clock()
    first = deadline is None
    if first:
        deadline = now + ctx.config.rdzv.lease_ttl_s + 1.0
    elif now >= deadline:
        raise NodeClaimError(_held(ctx, who))
    if holder is not None and holder.host == ctx.host and holder.pid != os.getpid():
        if _pid_gone(holder.pid):
            log.warning("[%s] node %s: the claim of agent pid %d on this host is left from a "
                        "dead agent; taking it over", ctx.job, ctx.node_id, holder.pid)
            if kv.lease:
                ctx.client.revoke(kv.lease, timeout=timeout)
            else:
                ctx.client.delete(kv.key, timeout=timeout)
            return deadline, True
        raise NodeClaimError(_held(ctx, who))
    if first:
        log.warning("[%s] node id %r is held by %s; waiting up to %.0fs for that agent's lease "
                    "to end", ctx.job, ctx.node_id, who, deadline - now)
    return deadline, False


def _held(ctx: AgentContext, who: str) -> str:
    return (f"node id {ctx.node_id!r} of job {ctx.job!r} is held by a live agent ({who}); "
            "give every node its own --hspmd-node-id")


def _check_mode(ctx: AgentContext, revision: int, timeout: float) -> None:
    """Give the claim back and fail when an earlier claim runs the job in the other mode."""
    mode = agent_mode(ctx)
    found = ctx.client.get_prefix(schema.claims_prefix(ctx.job), timeout=timeout)
    earlier = []
    for kv in found.kvs:
        rec = _holder(kv)
        if rec is not None and rec.mode != mode and kv.create_revision < revision:
            earlier.append((kv.create_revision, rec))
    if not earlier:
        return
    _, first = min(earlier, key=lambda e: e[0])
    try:
        ctx.session.delete(schema.claim_key(ctx.job, ctx.node_id))
    except Exception as exc:  # noqa: BLE001 - the lease's revocation removes it anyway
        log.warning("[%s] node %s: giving the claim back: %s", ctx.job, ctx.node_id, exc)
    flag = "--hspmd-elastic and the job's --hspmd-* flags" if first.mode == "elastic" else \
        "no --hspmd-elastic"
    raise NodeClaimError(
        f"job {ctx.job!r} runs in {first.mode} mode (node {first.node} on host {first.host}, "
        f"pid {first.pid}); this agent runs in {mode} mode: start it with {flag}, or use "
        "another --rdzv-id")
