"""Restart-mode rendezvous on etcd: rounds of nodes, closed by one compare-and-set.

Keys (under ``/hspmd/v1/jobs/<job>/rdzv/``; builders and records in ``hspmd_elastic.contract.schema``,
documented in docs/etcd-schema.md):

* ``state`` (kind ``rdzv_state``, no lease): the current round, its state (``joining``,
  ``closed``, ``succeeded``, ``failed``), the restart count, the ordered participants once closed;
  every change is a compare-and-set on its mod revision;
* ``rounds/<round>/joined/<node>`` (kind ``rdzv_join``, agent lease): a node's wish to be in that
  round; a node that finds a closed round registers for the next one (the waiting list);
* ``rounds/<round>/master`` (kind ``rdzv_master``, lease of the round's node 0): the address and
  port of the store that node hosts for the round's workers (MASTER_ADDR/MASTER_PORT);
* ``rounds/<round>/done/<node>`` (kind ``rdzv_done``, no lease): the node's workers all exited 0.

Promises:

* a round closes when ``max_nodes`` joined, or ``min_nodes`` joined and the last-call window
  passed with no closing yet; the closing txn fixes the node order (``--node-rank`` first, then
  join order by create revision) and only the first ``max_nodes`` nodes;
* ranks are torchrun's: consecutive per node in node order (``assign_ranks``, pure);
* a worker failure moves the job to the next round and counts a restart, or fails the job when
  the restarts are used up; a join (with room) or a leave moves to the next round without counting;
  when several nodes react to the same event only the first compare-and-set wins, so one event is
  one restart;
* every wait has a deadline and also ends when ``abort`` is set (a signal);
* a wait for a round or its store rides out an etcd outage as the agent's ``outage`` policy
  says (a node already joined keeps waiting, re-joins under its new lease, and fails only past
  ``--hspmd-etcd-outage-limit`` or the join timeout); an auth refusal fails at once;
* ``on_wait`` (optional) is called on every tick of ``next_round`` with the wait's state
  (``launcher.console.RendezvousWait``: nodes joined, min..max, last-call countdown, time left
  until the join timeout); the agent sets it only when it draws a progress bar, so without a
  terminal the rendezvous makes no extra etcd reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hspmd_elastic.coord.api import (CompareTarget, Compare, CoordinationError, EtcdAuthError,
                                      LeaseLostError, PutOp, RecordError)
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord import journal
from hspmd_elastic.contract import schema
from hspmd_elastic.contract.schema import decode_valid
from hspmd_elastic.contract.rounds import (  # noqa: F401 (the round state, re-exported)
    CLOSED,
    FAILED,
    JOINING,
    SUCCEEDED,
    TERMINAL,
    Participant,
    RoundState,
)

from launcher.console import RendezvousWait
from launcher.node.api import RoundInfo
from launcher.node.outage import EtcdOutagePolicy
from launcher.api import (
    RankAssignment,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousSettings,
    RendezvousTimeoutError,
    SignalReceived,
)

log = logging.getLogger(__name__)

POLL_S = 0.1


class RoundMoved(RendezvousError):
    """The round this node was about to run ended first; join the next one."""


# ----------------------------------------------------------------------------- pure decisions
def order_participants(joined: list[Participant], max_nodes: int) -> tuple[Participant, ...]:
    """Node order of a closing round: ``--node-rank`` first (ascending), then join order."""
    big = float("inf")
    ordered = sorted(joined, key=lambda p: (p.node_rank if p.node_rank is not None else big,
                                            p.create_revision, p.node))
    return tuple(ordered[:max_nodes])


def should_close(n_joined: int, min_nodes: int, max_nodes: int,
                 last_call_since: Optional[float], now: float, last_call_s: float) -> bool:
    if n_joined >= max_nodes:
        return True
    if n_joined < min_nodes or last_call_since is None:
        return False
    return now - last_call_since >= last_call_s


def assign_ranks(participants: tuple[Participant, ...], node: str) -> RankAssignment:
    """torchrun's ranks: a node's workers get consecutive global ranks, nodes in round order."""
    base, mine = 0, None
    for idx, p in enumerate(participants):
        if p.node == node:
            mine = (idx, base, p.local_world_size)
        base += p.local_world_size
    if mine is None:
        raise RendezvousError(f"node {node} is not a participant of the round")
    idx, my_base, lws = mine
    return RankAssignment(group_rank=idx, group_world_size=len(participants),
                          local_world_size=lws, base_global_rank=my_base, world_size=base,
                          role_base_rank=my_base, role_world_size=base)


# ------------------------------------------------------------------------------------ effects
def append_event(client: EtcdClient, job: str, type_: str, node: Optional[str],
                 detail: schema.Detail) -> Optional[int]:
    """Journal an event; best effort (events are for people and dashboards): a failure is
    logged, not raised."""
    try:
        return journal.append_event(client, job, type_, node, detail).seq
    except CoordinationError as exc:
        log.warning("[%s] could not record %s event: %s", job, type_, exc)
        return None


@dataclass
class EtcdRendezvous:
    """One node's view of the job's rounds."""

    client: EtcdClient
    session: LeasedSession
    settings: RendezvousSettings
    node: str
    host: str
    local_world_size: int
    abort: threading.Event = field(default_factory=threading.Event)
    clock: Callable[[], float] = time.monotonic
    on_wait: Optional[Callable[[RendezvousWait], None]] = None
    # The agent's etcd outage policy: waits for a round or its store ride out an outage up to
    # its limit (None: an unanswered call is an error at once)
    outage: Optional[EtcdOutagePolicy] = None

    @property
    def job(self) -> str:
        return self.settings.run_id

    # ------------------------------------------------------------------------------ reads
    def read_state(self) -> Optional[RoundState]:
        key = schema.rdzv_state_key(self.job)
        kv = self._call("read rendezvous state", self.client.get, key)
        if kv is None:
            return None
        try:
            return RoundState.decode(key, kv.value, kv.mod_revision)
        except RecordError as exc:
            raise RendezvousError(f"unreadable rendezvous state: {exc}") from exc

    def joined(self, rnd: int) -> list[Participant]:
        prefix = schema.rdzv_round_prefix(self.job, rnd) + "joined/"
        out = []
        kvs = list(self._call("read joined nodes", self.client.get_prefix, prefix))
        created = {kv.key: kv.create_revision for kv in kvs}
        for key, rec in decode_valid(kvs, log, f"[{self.job}] rendezvous"):  # bad: skipped
            out.append(Participant(node=rec.node, host=rec.host,
                                   local_world_size=rec.local_world_size,
                                   node_rank=rec.node_rank, create_revision=created[key]))
        return out

    def done_nodes(self, rnd: int) -> set[str]:
        prefix = schema.rdzv_round_prefix(self.job, rnd) + "done/"
        res = self._call("read done nodes", self.client.get_prefix, prefix)
        return {kv.key[len(prefix):] for kv in res}

    # ------------------------------------------------------------------------------ writes
    def _cas_state(self, seen: Optional[RoundState], new: RoundState) -> bool:
        key = schema.rdzv_state_key(self.job)
        cmp = Compare(key, CompareTarget.MOD, "==", seen.mod_revision if seen else 0)
        res = self._call("update rendezvous state", self.client.txn, [cmp],
                         [PutOp(key, new.encode())])
        return res.succeeded

    def _join(self, rnd: int) -> None:
        key = schema.rdzv_join_key(self.job, rnd, self.node)
        if key in self.session.owned_keys():
            return
        rec = schema.RdzvJoinRecord(node=self.node, host=self.host,
                                    local_world_size=self.local_world_size,
                                    node_rank=self.settings.node_rank, at=time.time())
        try:
            self._call("join round", self.session.put, key, schema.encode(rec))
        except RendezvousConnectionError as exc:
            lost = exc.__cause__
            if not (isinstance(lost, LeaseLostError) and lost.lease_id is None):
                raise
            # The lease is being re-granted (after an etcd outage or a partition): the session
            # keeps the key and writes it under the new lease; the round's own deadline bounds
            # the wait for it.
            log.info("[%s] node %s joins round %d once its new lease is granted", self.job,
                     self.node, rnd)
            return
        log.info("[%s] node %s joined round %d", self.job, self.node, rnd)

    def forget_rounds_before(self, rnd: int) -> None:
        """Drop our join keys of older rounds (they only matter while their round runs)."""
        for key in self.session.owned_keys():
            marker = schema.rdzv_prefix(self.job) + "rounds/"
            if key.startswith(marker):
                try:
                    num = int(key[len(marker):].split("/", 1)[0])
                except ValueError:
                    continue
                if num < rnd:
                    self._call("forget old round", self.session.delete, key)

    # ---------------------------------------------------------------------------- joining
    def ensure_job(self, fresh: bool = False) -> RoundState:
        """Create the job's state; a ``fresh`` agent starts over when a previous run of this id
        ended and none of its nodes is alive. An ended job is RendezvousClosedError otherwise."""
        while True:
            seen = self.read_state()
            if seen is None:
                new = RoundState(round=0, state=JOINING, restart_count=0, reason="start",
                                 at=time.time())
            elif seen.state in TERMINAL:
                live = self._call("read nodes", self.client.get_prefix,
                                  schema.nodes_prefix(self.job))
                others = [kv for kv in live if not kv.key.endswith("/" + self.node)]
                if not fresh:
                    raise RendezvousClosedError(
                        f"job {self.job!r} {seen.state} while this node was between rounds "
                        f"({seen.reason})")
                if others:
                    raise RendezvousClosedError(
                        f"rendezvous {self.job!r} already {seen.state}; nodes of that run are "
                        "still alive: use another --rdzv-id"
                    )
                new = RoundState(round=seen.round + 1, state=JOINING, restart_count=0,
                                 reason="new run", at=time.time())
            else:
                return seen
            if self._cas_state(seen, new):
                log.info("[%s] rendezvous state created (round %d)", self.job, new.round)

    def next_round(self, timeout_s: Optional[float] = None, fresh: bool = False) -> RoundInfo:
        """Join the current (or next) round and return it once closed with us in it."""
        timeout = self.settings.join_timeout_s if timeout_s is None else timeout_s
        started = self.clock()
        deadline = started + timeout
        last_call_since: Optional[float] = None
        watched_round = -1
        while True:
            self._check_abort()
            begun, st = self.clock(), None
            try:
                st = self.ensure_job(fresh)
                fresh = False  # only the very first read may start a new run of this id
                if st.state == CLOSED and self.node in st.nodes():
                    info = RoundInfo(st.round, st.restart_count, st.participants,
                                     assign_ranks(st.participants, self.node))
                    self.forget_rounds_before(st.round)
                    self._reachable(begun)
                    return info
                target = st.round if st.state == JOINING else st.round + 1
                self._join(target)
                if st.state == JOINING:
                    if watched_round != st.round:
                        watched_round, last_call_since = st.round, None
                    joined = self.joined(st.round)
                    now = self.clock()
                    if last_call_since is None and len(joined) >= self.settings.min_nodes:
                        last_call_since = now
                    if should_close(len(joined), self.settings.min_nodes,
                                    self.settings.max_nodes, last_call_since, now,
                                    self.settings.last_call_timeout_s):
                        self._close(st, joined)
                        continue
                if self.on_wait is not None:
                    n = len(joined) if st.state == JOINING else len(self.joined(target))
                    self.on_wait(self._wait_state(st, n, started, deadline,
                                                  last_call_since if st.state == JOINING
                                                  else None))
                self._reachable(begun)
            except RendezvousConnectionError as exc:
                self._ride_out(exc)  # waits on while the outage policy allows
            if self.clock() >= deadline:
                where = f"round {st.round}, state {st.state}" if st is not None else \
                    "etcd unreachable"
                raise RendezvousTimeoutError(
                    f"rendezvous {self.job!r} timed out after {timeout:.0f}s waiting for "
                    f"{self.settings.min_nodes} node(s) ({where})"
                )
            self.abort.wait(POLL_S)

    def _ride_out(self, exc: RendezvousConnectionError) -> None:
        """etcd did not answer during a wait: an outage the agent's policy rides out (it
        raises past ``--hspmd-etcd-outage-limit``); without a policy, or for a refusal that
        waiting cannot cure (auth), the error itself."""
        if self.outage is None or isinstance(exc.__cause__, EtcdAuthError):
            raise exc
        self.outage.unreachable(exc)

    def _reachable(self, begun: float) -> None:
        if self.outage is not None:
            self.outage.reachable(begun)

    def _wait_state(self, st: RoundState, joined: int, started: float,
                    deadline: float, last_call_since: Optional[float]) -> RendezvousWait:
        now, cfg = self.clock(), self.settings
        left = None if last_call_since is None else (
            last_call_since + cfg.last_call_timeout_s - now)
        return RendezvousWait(round=st.round, state=st.state, joined=joined,
                              min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
                              waited_s=now - started, timeout_left_s=deadline - now,
                              last_call_left_s=left)

    def _close(self, seen: RoundState, joined: list[Participant]) -> None:
        participants = order_participants(joined, self.settings.max_nodes)
        new = RoundState(round=seen.round, state=CLOSED, restart_count=seen.restart_count,
                         participants=participants, reason=seen.reason, at=time.time())
        if self._cas_state(seen, new):
            log.info("[%s] round %d closed with %d node(s): %s", self.job, seen.round,
                     len(participants), ",".join(p.node for p in participants))

    # ---------------------------------------------------------------------------- master
    def publish_master(self, rnd: int, addr: str, port: int) -> None:
        rec = schema.RdzvMasterRecord(node=self.node, addr=addr, port=int(port), at=time.time())
        self._call("publish master", self.session.put, schema.rdzv_master_key(self.job, rnd),
                   schema.encode(rec))

    def wait_master(self, rnd: int, timeout_s: float) -> tuple[str, int]:
        """The store address node 0 of round ``rnd`` published. RoundMoved when the round
        ended first, or node 0 left before publishing (this call then moves the job on)."""
        deadline = self.clock() + timeout_s
        key = schema.rdzv_master_key(self.job, rnd)
        while True:
            self._check_abort()
            begun = self.clock()
            try:
                kv = self._call("read master", self.client.get, key)
                if kv is not None:
                    rec = self._decode(key, kv.value)
                    self._reachable(begun)
                    return rec.addr, rec.port
                st = self.read_state()
                if st is None or st.round != rnd or st.state != CLOSED:
                    raise RoundMoved(f"round {rnd} ended before its store was published")
                first = st.participants[0].node
                if first not in {p.node for p in self.joined(rnd)}:
                    reason = f"node {first} left"
                    self.move_on(st, reason, count_restart=False, max_restarts=0)
                    raise RoundMoved(f"round {rnd}: {reason} before publishing its store")
                self._reachable(begun)
            except RendezvousConnectionError as exc:
                self._ride_out(exc)
            if self.clock() >= deadline:
                raise RendezvousTimeoutError(
                    f"node 0 of round {rnd} did not publish its store within {timeout_s:.0f}s")
            self.abort.wait(POLL_S)

    # ---------------------------------------------------------------------------- running
    def observe(self, info: RoundInfo) -> tuple[str, Optional[RoundState]]:
        """What changed while our round runs: ``ok``, ``moved``, ``failed``, ``succeeded``,
        ``left:<node>`` or ``join``."""
        st = self.read_state()
        if st is None or st.round != info.round:
            return "moved", st
        if st.state in TERMINAL:
            return st.state, st
        if st.state != CLOSED:
            return "moved", st
        present = {p.node for p in self.joined(info.round)}
        missing = [n for n in st.nodes() if n not in present]
        if missing:
            done = self.done_nodes(info.round)
            gone = [n for n in missing if n not in done]
            if gone:
                return f"left:{gone[0]}", st
        if len(st.participants) < self.settings.max_nodes and self.joined(info.round + 1):
            return "join", st
        return "ok", st

    def move_on(self, seen: RoundState, reason: str, count_restart: bool,
                max_restarts: int) -> tuple[RoundState, bool]:
        """Leave round ``seen`` for the next one (or fail the job when restarts are used up).

        Returns the state now in etcd and whether it is ours (our compare-and-set won) rather
        than that of a node that reacted first.
        """
        if count_restart and seen.restart_count >= max_restarts:
            new = RoundState(round=seen.round, state=FAILED, restart_count=seen.restart_count,
                             participants=seen.participants, reason=reason, at=time.time())
        else:
            new = RoundState(round=seen.round + 1, state=JOINING,
                             restart_count=seen.restart_count + (1 if count_restart else 0),
                             reason=reason, at=time.time())
        if self._cas_state(seen, new):
            log.info("[%s] round %d -> %s (%s, restarts %d/%d)", self.job, seen.round,
                     new.state if new.state == FAILED else f"round {new.round}", reason,
                     new.restart_count, max_restarts)
            return new, True
        return self.read_state() or new, False

    def mark_done(self, info: RoundInfo) -> None:
        """Record that our workers succeeded; the last node to finish ends the job."""
        rec = schema.RdzvDoneRecord(node=self.node, at=time.time())
        self._call("mark done", self.client.put,
                   schema.rdzv_done_key(self.job, info.round, self.node), schema.encode(rec))
        self.settle(info)

    def settle(self, info: RoundInfo) -> Optional[RoundState]:
        st = self.read_state()
        if st is None or st.round != info.round or st.state != CLOSED:
            return st
        if set(st.nodes()) <= self.done_nodes(info.round):
            new = RoundState(round=st.round, state=SUCCEEDED, restart_count=st.restart_count,
                             participants=st.participants, reason="all nodes done",
                             at=time.time())
            if self._cas_state(st, new):
                log.info("[%s] job succeeded (round %d)", self.job, st.round)
            return self.read_state()
        return st

    # ----------------------------------------------------------------------------- plumbing
    def _check_abort(self) -> None:
        if self.abort.is_set():
            raise SignalReceived(0, "abort")

    def _decode(self, key: str, raw: bytes):
        try:
            return schema.decode(key, raw)
        except RecordError as exc:
            raise RendezvousError(f"unreadable rendezvous record: {exc}") from exc

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except CoordinationError as exc:
            raise RendezvousConnectionError(f"{what} for job {self.job!r}: {exc}") from exc
