"""Elastic mode, node side: what a node agent does every tick so the leader can plan and the
workers can switch. ``ElasticNode`` bundles the small pieces beside it into one ``start`` /
``tick`` / ``stop`` that ``launcher.node.elastic.ElasticMode`` calls. Promises:

* the node record ``nodes/<node>`` carries the device table (``devices.py``) and the endpoint
  of the store this agent hosts (``store.py``);
* the agent follows the plan's head ``plan/head`` (``coord.plans``: version, store, step and
  the devices and drains as runs per node, a few bytes per node) through the process's job view
  (``launcher.jobview.WatchedJob``, given by the mode and shared with the leader and the
  progress bar; a node given none makes its own), plus a read every ``PLAN_RECHECK_S``
  (``read_plan_head``: the head and one compare, so a missed event costs at most that long; a
  failed read is retried on the next tick, which is how an etcd outage shows in a quiet node),
  not a read per tick; the plan's peers' store endpoints come from the view's node records;
  it never reads the full ``plan/current``
  (every device's strategy and inventory: its workers read that) unless the head is missing or
  older than ``plan/current`` (a plan published by a leader without heads);
* the agent owns ``workers/<node>/<local_rank>``: written when it starts a worker, updated from
  the worker's progress file (``contract.progress.read_progress``) when it changed, all changed
  slots in one transaction and at most once per ``PROGRESS_WRITE_S`` (at once when a worker
  moved to another plan version), deleted when the worker exits;
* a worker exit is reported once (``exits.py``): a ``failure`` event and a sticky failed
  verdict for its slot; every exit's verdict is sticky before any etcd call, so a failed call
  loses none; a worker whose heartbeat stalls (``hangs.py``) gets a ``stall`` event and a
  failed verdict of origin ``stall``, and is SIGKILLed (its exit is not journaled
  again); slot verdicts override the health source's (worst wins) and go to
  ``devices/<node>/<index>`` through the ``VerdictPublisher``;
* on each newer plan, before it starts any worker, the agent reads ``plan/layout`` once and
  relays it to its workers' relay file (``launcher.plan_relay``, ``contract.relay``), so etcd
  sends the layout once per node, not once per worker;
* surviving workers are never restarted (``workers.py``); a worker that left because
  the newest plan does not use its device (final report ``excluded``) is no failure: no event,
  no failed verdict, and a later plan may use the slot again;
* while a plan uses some of this node's slots and leaves others idle (the planner found them
  not worth their cost), each idle slot whose verdict is healthy or degraded runs an idle
  worker (``workers.idle_local_ranks``): it holds nothing, probes its device and reports the
  probe (``WorkerRecord.probe_s``), so the leader keeps measuring the device; it joins the
  first plan that uses it like any joiner, and leaves when the job ends;
* while a local worker waits for a plan after it trained (it left a collective), the agent
  probes its plan's peers over the data network (``reach.py``) and writes the ones it cannot
  reach to ``reach/<node>`` under its lease until they answer again, probing them on after a
  plan left them out (the leader replans a node that a majority cannot reach away, and takes it
  back only once it answers);
* while a local worker waits after its switch into the current plan failed, with nothing in the
  cluster to explain it (``retry.py``), the agent writes ``retry/<node>`` under its lease once
  that lasted its ``retry_after_s``, and deletes it when no worker waits so any more (the
  leader publishes the plan again);
* the agent acks every plan that uses its node (``acks.py``) in ``switch/<version>/<node>``,
  under its lease, level-triggered: a state is remembered only once etcd took it;
* every etcd call has the client's deadline; ``tick`` raises ``CoordinationError`` when etcd
  cannot be reached, and the agent's outage policy decides how long that is tolerated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Callable, Optional

from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.contract.progress import (LEFT_STATES, WorkerProgress, WorkerState,
                                            read_progress)
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.contract import worker_record
from hspmd_elastic.coord.journal import append_event
from hspmd_elastic.coord.lease import LeasedSession
from hspmd_elastic.coord.plans import plan_nodes, read_plan_head
from launcher.health.api import HealthSource, Verdict
from launcher.health.verdicts import VerdictPublisher
from launcher.leader import Leader
from launcher.jobview import Table, WatchedJob
from launcher.node.elastic.acks import ACK_KEEP, ACK_ORDER, ack_state
from launcher.node.elastic.devices import node_record
from launcher.node.elastic.workers import ElasticWorkers, new_local_ranks, plan_rank
from launcher.node.elastic.exits import (SlotVerdicts, WorkerExit, report_worker_exit,
                                         worker_of)
from launcher.node.hangs import ProgressMonitor, watched_slots
from launcher.node.elastic.reach import ReachProbe
from launcher.plan_relay import relay_plan
from launcher.node.elastic.retry import StuckSwitches, retry_after_s
from launcher.node.store import StoreServer
from launcher.node.workers import Worker

log = logging.getLogger(__name__)

PLAN_RECHECK_S = 5.0  # a plain read of plan/current at least this often, besides the watch
PROGRESS_WRITE_S = 1.0  # progress records: at most one write per this long per agent
NODE_TABLES = (Table.HEAD, Table.NODES)  # what a node reads of the job view


class ElasticNode:
    """The agent's elastic mode in one object: ``start()``, ``tick()`` every monitor interval,
    ``stop()``. ``leader`` is this agent's ``launcher.leader.Leader`` (None: never leads).
    ``view``: the process's job view (None: the node makes, and closes, its own).
    ``plan_recheck_s``: how often ``tick`` reads ``plan/current`` besides the watch (0: every
    tick, synchronous)."""

    def __init__(self, client: EtcdClient, session: LeasedSession, job: str, node: str,
                 host: str, devices: list[schema.DeviceInfo], workers: ElasticWorkers,
                 leader: Optional[Leader] = None, health: Optional[HealthSource] = None,
                 monitor: Optional[ProgressMonitor] = None, store_host: Optional[str] = None,
                 store_port: int = 0, reach: Optional[ReachProbe] = None,
                 plan_recheck_s: float = PLAN_RECHECK_S,
                 retry_after: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 view: Optional[WatchedJob] = None):
        self.client, self.session, self.job, self.node, self.host = client, session, job, node, host
        self.view = view if view is not None else WatchedJob(client, job, name=f"node {node}")
        self._own_view, self._holding = view is None, False
        self.devices, self.workers, self.leader, self.health = devices, workers, leader, health
        self.monitor = monitor or ProgressMonitor(clock=clock, wall_clock=wall_clock)
        self.slots = SlotVerdicts()
        self._verdicts: dict = {}  # slot -> its latest merged verdict (publish_verdicts)
        self.store = StoreServer(store_host or host, store_port)
        self.plan: Optional[schema.PlanHeadRecord] = None  # the newest plan applied (head)
        self.plan_version = 0
        self.slot_plan: list[int] = []  # this node's slots in the current plan
        self.succeeded: set[int] = set()  # slots whose worker exited 0
        self.records: dict[int, schema.WorkerRecord] = {}  # what workers/<node>/<slot> holds
        self.reports: dict[int, WorkerProgress] = {}  # slot -> its worker's latest report
        self.acks: dict[int, str] = {}  # plan version -> the ack this node wrote for it
        self._clock, self._wall = clock, wall_clock
        self._started_at = wall_clock()
        self._state = "joining"
        self._killed_hung: set[int] = set()  # pids of workers killed because they hung
        self.reach = reach or ReachProbe(node)
        self.plan_nodes: frozenset = frozenset()  # the nodes of the current plan
        self._reach_written: frozenset = frozenset()  # what reach/<node> holds
        self._reach_peers_at = float("-inf")
        self.stuck = StuckSwitches(retry_after if retry_after is not None
                                   else retry_after_s(session.ttl), clock=clock)
        self._retry_written: Optional[tuple[int, tuple[int, ...]]] = None  # retry/<node>
        self._peers: dict[str, str] = {}  # the plan's other nodes -> their store endpoints
        self._newest: Optional[schema.PlanHeadRecord] = None  # the newest head seen
        self._plan_read_at = float("-inf")
        self._plan_recheck_s = plan_recheck_s
        self._progress_written_at = float("-inf")
        self.publisher = VerdictPublisher(client, job, node, lease=lambda: session.lease_id or 0,
                                          clock=clock, wall_clock=wall_clock)

    def start(self, state: str = "ready") -> "ElasticNode":
        self.store.start()
        self.view.acquire(NODE_TABLES, self.client.timeout)
        self._holding = True
        self.put_node(state)
        self.publish_verdicts()
        if self.leader is not None:
            self.leader.start()
        return self

    def put_node(self, state: str) -> None:
        self._state = state
        rec = node_record(self.host, self.devices, state, self._started_at, self.store.endpoint)
        self.session.put(schema.node_key(self.job, self.node), schema.encode(rec))

    def tick(self) -> None:
        """One level-triggered round: follow the plan, report exits and hangs, publish
        verdicts, move this node's switch ack forward. Raises CoordinationError when etcd
        cannot be reached (the agent decides how long to tolerate that)."""
        plan = self._newest_plan()
        if plan is not None and plan.version > self.plan_version:
            if isinstance(plan, schema.PlanHeadRecord):
                # One read of plan/layout for the whole node, before any new worker starts:
                # the workers take it from the relay file (``contract.relay``), not from etcd.
                relay_plan(self.client, self.job, plan, self.workers.progress_dir)
            for w in self.workers.apply_plan(plan, self._idle_slots()):
                self._put_worker(w, plan.version)
            self.plan = plan
            self.plan_version = plan.version
            self.plan_nodes = plan_nodes(plan)
            self.slot_plan = new_local_ranks(plan, self.node, ())
            self._rank_idle(plan)
            if self.workers.running() and self._state != "running":
                self.put_node("running")
        exits = self.workers.poll()
        if self.plan is not None and exits and any(  # the final states poll just read
                final in LEFT_STATES for _ex, _w, final in self.workers.exits[-len(exits):]):
            # a worker the plan drained (its device left idle) handed its state over and
            # left: its slot gets an idle worker that probes the device
            for w in self.workers.apply_plan(self.plan, self._idle_slots(), idle_only=True):
                self._put_worker(w, self.plan_version)
        # Every exit's verdict is sticky before any etcd call: a failed call must not lose one
        # (poll reports each exit only once).
        for ex in exits:
            log.log(logging.INFO if ex.ok else logging.WARNING, "[%s] node %s: %s (slot %d)",
                    self.job, self.node, ex.describe(), ex.local_rank)
            self.records.pop(ex.local_rank, None)
            self._final_report(ex)
            if self._left(ex):
                log.info("[%s] node %s: slot %d left plan v%d, which does not use it", self.job,
                         self.node, ex.local_rank, self.plan_version)
            elif ex.ok:
                self.succeeded.add(ex.local_rank)
            else:
                self.slots.fail(ex.local_rank, ex.verdict(self._clock()))
        for ex in exits:
            self.session.delete(schema.worker_key(self.job, self.node, ex.local_rank))
            if not ex.ok and ex.pid not in self._killed_hung and not self._left(ex):
                report_worker_exit(self.client, self.job, self.node, ex, self.plan_version,
                                   self._wall, worker_of(self.workers.exits, ex), self.host)
        if self.plan is not None and any(self._left(ex) for ex in exits):
            # A worker that left an older plan may exit after a newer one took its slot back
            # (a healed partition): that plan gets a fresh worker now.
            for w in self.workers.apply_plan(self.plan, self._idle_slots()):
                self._put_worker(w, self.plan.version)
        self._relay_progress()
        self.monitor.observe(watched_slots(self.records, self.reports))
        for hang in self.monitor.new_hangs():
            log.warning("[%s] node %s: %s", self.job, self.node, hang.reason())
            self.slots.fail(hang.worker, Verdict.failed(
                hang.reason(), at=hang.since, origin=schema.VerdictOrigin.STALL.value))
            pid = self.workers.running().get(hang.worker)
            append_event(self.client, self.job, "stall", self.node, schema.StallDetail(
                devices=[device_id(self.node, hang.worker)], reason=hang.reason(),
                plan_version=self.plan_version, local_rank=hang.worker, pid=pid,
                step=hang.step, stalled_s=round(hang.stalled_s, 3)), wall_clock=self._wall)
            self._kill_hung(hang.worker, pid)
        self.publish_verdicts()
        self._probe_reach()
        self._request_retry()
        self._ack()  # last: whatever happens to this write, the verdicts above are out

    def _note_head(self, head: Optional[schema.PlanHeadRecord]) -> None:
        if head is not None and (self._newest is None or head.version > self._newest.version):
            self._newest = head

    def _newest_plan(self) -> Optional[schema.PlanHeadRecord]:
        """The newest head the job view holds; a plain read (``read_plan_head``) as well when the
        last one is ``PLAN_RECHECK_S`` old (level-triggered: a lost event cannot stall the node,
        and a plan without a head is found too)."""
        now = self._clock()
        if now - self._plan_read_at >= self._plan_recheck_s:
            head = read_plan_head(self.client, self.job)
            self._plan_read_at = now
            self._note_head(head)
        self._note_head(self.view.head())
        return self._newest

    def _probe_reach(self) -> None:
        """Arm the data-link probe while a local worker waits for a plan after it trained,
        give it the plan's peers (their store endpoints, re-read at most once per probe
        interval while needed), and mirror what it cannot reach into ``reach/<node>``."""
        running = self.workers.running()
        armed = any(r.state == WorkerState.WAITING_PLAN.value and r.plan_version > 0
                    and r.global_rank >= 0  # an idle worker (no rank) took part in no plan
                    for lr, r in self.reports.items() if running.get(lr) == r.pid)
        now = self._clock()
        if (armed or self.reach.unreachable()) and \
                now - self._reach_peers_at >= self.reach.interval_s:
            self._reach_peers_at = now
            # A peer found unreachable stays probed after a plan leaves it out, so its report
            # lasts as long as the cut: the leader does not take it back while the cut lasts.
            probed = set(self.plan_nodes) | self.reach.unreachable()
            self._peers = {name: rec.store_endpoint for name, rec in self.view.nodes().items()
                           if name in probed and name != self.node}
        self.reach.update(armed, self._peers)
        now_unreachable = self.reach.unreachable()
        if now_unreachable == self._reach_written:
            return
        key = schema.reach_key(self.job, self.node)
        if now_unreachable:
            self.session.put(key, schema.encode(schema.ReachRecord(
                node=self.node, unreachable=sorted(now_unreachable), at=self._wall())))
        else:
            self.session.delete(key)
        self._reach_written = now_unreachable

    def _request_retry(self) -> None:
        """Mirror the workers stuck after a failed switch into ``retry/<node>``."""
        planned = {lr: pid for lr, pid in self.workers.running().items()
                   if lr in self.slot_plan}  # an idle worker waits by design, it is not stuck
        stuck = self.stuck.observe(self.plan_version, planned, self.reports)
        want = None if stuck is None else (self.plan_version, tuple(stuck[0]))
        if want == self._retry_written:
            return
        key = schema.retry_key(self.job, self.node)
        if want is not None:
            slots, waited = stuck
            log.warning("[%s] node %s: slot(s) %s wait after their switch into plan v%d failed "
                        "(%.1fs) and no change explains it: asking the leader to publish it "
                        "again", self.job, self.node, ",".join(map(str, slots)),
                        self.plan_version, waited)
            self.session.put(key, schema.encode(schema.RetryRecord(
                node=self.node, plan_version=self.plan_version, slots=list(slots),
                waited_s=round(waited, 3), at=self._wall())))
        else:
            self.session.delete(key)
        self._retry_written = want

    def _kill_hung(self, local_rank: int, pid: Optional[int]) -> None:
        """A hung worker never exits by itself (frozen, stopped, deadlocked): SIGKILL it, so
        its slot is freed and nothing is left behind; its exit is not journaled again."""
        if pid is None:
            return
        self._killed_hung.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("[%s] node %s: killed hung worker pid %d (slot %d)", self.job,
                        self.node, pid, local_rank)
        except ProcessLookupError:
            pass

    @property
    def done(self) -> bool:
        """Every slot of this node in the current plan ran its worker to exit code 0."""
        return bool(self.slot_plan) and set(self.slot_plan) <= self.succeeded

    def _put_worker(self, w: Worker, plan_version: int) -> None:
        """The worker's record: its start is its first progress heartbeat."""
        rec = schema.WorkerRecord(pid=w.pid, global_rank=w.global_rank, local_rank=w.local_rank,
                                  plan_version=plan_version, step=0,
                                  last_progress_at=self._wall(), steps_per_s=0.0)
        self._put_record(rec)

    def _rank_idle(self, plan) -> None:
        """An idle worker (no rank) that ``plan`` uses: its record gets the plan's rank now
        (its own reports follow once it switched)."""
        for lr, rec in list(self.records.items()):
            rank = plan_rank(plan, self.node, lr)
            if rec.global_rank < 0 and rank is not None:
                self._put_record(dataclasses.replace(rec, global_rank=rank))

    def _put_record(self, rec: schema.WorkerRecord) -> None:
        self.records[rec.local_rank] = rec
        self.session.put(schema.worker_key(self.job, self.node, rec.local_rank),
                         schema.encode(rec))

    def _relay_progress(self) -> None:
        """Copy the live workers' latest progress reports into their etcd records when they
        changed (a report of another pid, e.g. a previous worker's, is ignored): the changed
        slots in one transaction, at most once per ``PROGRESS_WRITE_S``, at once when a worker
        moved to another plan version."""
        changed, urgent = {}, False
        for lr, pid in self.workers.running().items():
            report = read_progress(self.workers.progress_file(lr), lr)
            if report is None or report.pid != pid:
                continue
            self.reports[lr] = report  # before the etcd write: the acks need it either way
            record, old = worker_record(report), self.records.get(lr)
            if record != old:
                changed[lr] = record
                urgent = urgent or old is None or old.plan_version != record.plan_version
        now = self._clock()
        if not changed or (not urgent and now - self._progress_written_at < PROGRESS_WRITE_S):
            return
        self.session.put_many({schema.worker_key(self.job, self.node, lr): schema.encode(rec)
                               for lr, rec in changed.items()})
        self.records.update(changed)
        self._progress_written_at = now

    def _left(self, ex: WorkerExit) -> bool:
        """The worker left by itself because the newest plan does not use its device (its
        final report says ``excluded``): not a failure, whatever its exit code (a worker may
        crash in its interpreter's teardown after it left)."""
        report = self.reports.get(ex.local_rank)
        return report is not None and report.pid == ex.pid and report.state in LEFT_STATES

    def _final_report(self, ex: WorkerExit) -> None:
        """Keep what an exited worker reported last (it may have written it after our last
        read): its final state says whether it finished the plan (``ack_state``)."""
        lr = ex.local_rank
        report = read_progress(self.workers.progress_file(lr), lr)
        if report is not None and report.pid == ex.pid:
            self.reports[lr] = report
        elif lr in self.reports and self.reports[lr].pid != ex.pid:
            del self.reports[lr]  # another worker's report says nothing about this one

    def _ack(self) -> None:
        """Move this node's ack of the current plan forward (``ack_state``), if the plan uses
        the node. Level-triggered: a state is remembered only once etcd took it, so a failed
        write is retried next tick, and a state already written is never written again. The
        ack is an owned key of the session: it goes with the node, and comes back after a
        lease loss. Then the node's acks of old versions are deleted (keys stay bounded; the
        console and the ops views read the version of the switch in progress)."""
        version = self.plan_version
        written = self.acks.get(version)
        if version and self.slot_plan and written not in ("done", "failed"):
            state = ack_state(version, self.slot_plan, self.workers.running(), self.reports,
                              self.succeeded, self.slots.failed())
            if written is None or state == "failed" or \
                    ACK_ORDER.index(state) > ACK_ORDER.index(written):
                rec = schema.SwitchAckRecord(node=self.node, plan_version=version, state=state,
                                             at=self._wall())
                self.session.put(schema.switch_ack_key(self.job, version, self.node),
                                 schema.encode(rec))
                self.acks[version] = state
                log.debug("[%s] node %s: switch ack of plan v%d: %s", self.job, self.node,
                          version, state)
        for old in sorted(v for v in self.acks if v < version - ACK_KEEP):
            self.session.delete(schema.switch_ack_key(self.job, old, self.node))
            del self.acks[old]

    def publish_verdicts(self) -> None:
        source = self.health.poll(self._clock()) if self.health is not None else {}
        self._verdicts = self.slots.merged(source, [d.index for d in self.devices])
        self.publisher.publish(self._verdicts)

    def _idle_slots(self) -> list[int]:
        """This node's slots that may run an idle worker when a plan leaves them out: those
        whose latest verdict is healthy or degraded (a failed or suspect device gets none)."""
        return [d.index for d in self.devices
                if self._verdicts.get(d.index) is None
                or self._verdicts[d.index].state.value in ("healthy", "degraded")]

    def stop(self, grace_s: float = 30.0, timeout: float = 5.0) -> None:
        """Stop the workers and the leader, close the store (the agent owns the session)."""
        self.workers.stop(grace_s)
        self.reach.stop(timeout)
        if self.leader is not None:
            self.leader.stop(timeout)
        if self._holding:
            self._holding = False
            self.view.release(NODE_TABLES, timeout)
        if self._own_view:
            self.view.close(timeout)
        self.store.close()
