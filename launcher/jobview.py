"""One job view per process: the job's records as one set of watches delivers them.

``WatchedJob`` is the one place a process mirrors a job's etcd state. Each table (``Table``:
nodes, device verdicts, workers, reach, retry, the plan, its head, switch acks, the event
journal, ``rdzv/``) is fed by one ``PrefixWatch`` (list, then watch; a compaction resyncs it
from a full read) that runs while some reader holds the table: ``acquire`` / ``release`` are
counted, so the agent's elastic mode, its progress bar, its leader (only while it leads) and
the fault injector's observer share one instance and one watch per prefix. Promises:

* reads do no I/O and never raise: each returns a copy taken under the one lock;
* every applied change bumps ``generation`` and its table's counter (``generations``) and wakes
  ``wait`` / ``wait_for``: a reader waits on a change with a deadline, never sleeps;
* a value that does not decode is skipped (its key drops out of the table: it holds no record)
  and logged once per (key, value) (``schema.decode_valid``); a key outside the schema too;
* a table whose last holder released it is emptied: nobody reads records nobody watches;
* ``subscribe(callback, tables)``: every change applied to those tables, as a ``WatchEvent``
  carrying its record (None for a DELETE), on the watch's thread, once the change is visible.

Depends on ``hspmd_elastic.contract`` / ``hspmd_elastic.coord`` and the standard library only.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import logging
import threading
import time
from typing import Callable, Iterable, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.rounds import TERMINAL, RoundState
from hspmd_elastic.coord.api import EventType, RecordError, WatchEvent
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.watch import DEFAULT_PROGRESS_S, PrefixWatch

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


class Table(str, enum.Enum):
    """A table of the view and the records it holds (keyed as below)."""

    NODES = "nodes"  # node id -> NodeRecord
    DEVICES = "devices"  # (node, index) -> DeviceHealthRecord
    WORKERS = "workers"  # (node, local rank) -> WorkerRecord
    REACH = "reach"  # node -> ReachRecord
    RETRY = "retry"  # node -> RetryRecord
    PLAN = "plan"  # "current" -> PlanRecord (plan/current, the full record)
    HEAD = "head"  # "head" -> PlanHeadRecord (plan/head)
    SWITCH = "switch"  # (plan version, node) -> SwitchAckRecord
    EVENTS = "events"  # seq -> EventRecord
    RDZV = "rdzv"  # "state" -> RoundState (rdzv/state); (round, node) -> RdzvDoneRecord


def _prefix(table: Table, job: str) -> str:
    return {
        Table.NODES: schema.nodes_prefix, Table.DEVICES: schema.devices_prefix,
        Table.WORKERS: schema.workers_prefix, Table.REACH: schema.reach_prefix,
        Table.RETRY: schema.retry_prefix, Table.PLAN: schema.plan_current_key,
        Table.HEAD: schema.plan_head_key, Table.SWITCH: schema.switch_prefix,
        Table.EVENTS: schema.events_prefix, Table.RDZV: schema.rdzv_prefix,
    }[table](job)


def _row(table: Table, spec: schema.KeySpec, params: dict[str, str]) -> object:
    """The row key of a record at a schema key in ``table`` (None: not one of its records)."""
    pattern = spec.pattern
    if table is Table.NODES and pattern == "nodes/<node_id>":
        return params["node_id"]
    if table is Table.DEVICES and pattern == "devices/<node_id>/<index>":
        return params["node_id"], int(params["index"])
    if table is Table.WORKERS and pattern == "workers/<node_id>/<local_rank>":
        return params["node_id"], int(params["local_rank"])
    if table in (Table.REACH, Table.RETRY) and pattern in ("reach/<node_id>", "retry/<node_id>"):
        return params["node_id"]
    if table is Table.PLAN and pattern == "plan/current":
        return "current"
    if table is Table.HEAD and pattern == "plan/head":
        return "head"
    if table is Table.SWITCH and pattern == "switch/<version>/<node_id>":
        return int(params["version"]), params["node_id"]
    if table is Table.EVENTS and pattern == "events/<seq>":
        return int(params["seq"])
    if table is Table.RDZV and pattern == "rdzv/state":
        return "state"
    if table is Table.RDZV and pattern == "rdzv/rounds/<round>/done/<node_id>":
        return int(params["round"]), params["node_id"]
    return None


class WatchedJob:
    """The watched cache of one job in one process (see the module docstring)."""

    def __init__(self, client: EtcdClient, job: str, name: str = "",
                 progress_s: Optional[float] = DEFAULT_PROGRESS_S,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.job = client, job
        self.name = name or f"job {job}"
        self._progress_s, self._clock = progress_s, clock
        self._cond = threading.Condition(threading.RLock())
        self._admin = threading.Lock()  # serialises acquire / release / close
        self._rows: dict[Table, dict] = {t: {} for t in Table}
        self._gens: dict[Table, int] = {t: 0 for t in Table}
        self._generation = 0
        self._seqs: list[int] = []  # the journal's sequence numbers held, sorted
        self._plan_rev = 0
        self._holds: dict[Table, int] = {t: 0 for t in Table}
        self._watches: dict[Table, PrefixWatch] = {}
        self._listeners: dict[int, tuple[Callable[[WatchEvent], None], frozenset]] = {}
        self._next_token = 0
        self._where = f"[{job}] {self.name}"

    # ------------------------------------------------------------------ holding tables
    def acquire(self, tables: Iterable[Table], timeout: float) -> "WatchedJob":
        """Hold ``tables``: their watches start (list, then watch) unless another holder runs
        them; returns once each is registered and listed, within about ``timeout`` in all.
        Raises ``CoordinationError`` (nothing held then) when etcd does not answer in time."""
        wanted = list(dict.fromkeys(Table(t) for t in tables))
        deadline = self._clock() + timeout
        with self._admin:
            started: list[Table] = []
            try:
                for table in wanted:
                    if table not in self._watches:
                        self._start(table, max(deadline - self._clock(), 0.05))
                        started.append(table)
            except BaseException:
                for table in started:
                    self._stop(table, STOP_TIMEOUT_S)
                raise
            for table in wanted:
                self._holds[table] += 1
        return self

    def release(self, tables: Iterable[Table], timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop holding ``tables``; a table nobody holds any more stops and is emptied."""
        with self._admin:
            for table in dict.fromkeys(Table(t) for t in tables):
                if self._holds[table] <= 0:
                    continue
                self._holds[table] -= 1
                if self._holds[table] == 0:
                    self._stop(table, timeout)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every watch and empty every table (whoever still holds them)."""
        with self._admin:
            for table in list(self._watches):
                self._holds[table] = 0
                self._stop(table, timeout)

    def watching(self) -> list[str]:
        """The prefixes watched now, one per running watch (what this process asks etcd)."""
        with self._admin:
            return [w.prefix for w in self._watches.values()]

    def _start(self, table: Table, timeout: float) -> None:
        holder: list[PrefixWatch] = []
        watch = PrefixWatch(self.client, _prefix(table, self.job),
                            lambda ev: self._apply(table, holder, ev), initial=True,
                            name=f"{self.name} {table.value}", progress_s=self._progress_s)
        holder.append(watch)
        self._watches[table] = watch  # before start: the initial listing is applied
        try:
            watch.start(timeout)
        except BaseException:
            self._watches.pop(table, None)
            self._clear(table)
            raise

    def _stop(self, table: Table, timeout: float) -> None:
        watch = self._watches.pop(table, None)
        if watch is not None:
            watch.stop(timeout)
        self._clear(table)

    def _clear(self, table: Table) -> None:
        with self._cond:
            self._rows[table] = {}
            if table is Table.EVENTS:
                self._seqs = []
            if table is Table.PLAN:
                self._plan_rev = 0
            self._bump(table)

    # ------------------------------------------------------------------ applying changes
    def _apply(self, table: Table, holder: list, ev: WatchEvent) -> None:
        record = None
        if ev.type is EventType.PUT:
            good = schema.decode_valid([ev], log, self._where)
            if good:
                record = good[0][1]
        try:
            _, spec, params = schema.match_key(ev.key)
            row = _row(table, spec, params)
        except RecordError:  # a key outside the schema (logged once by decode_valid)
            return
        if row is None:
            return
        if isinstance(record, schema.RdzvStateRecord):
            record = RoundState.decode(ev.key, ev.value, ev.revision)
        with self._cond:
            if not holder or self._watches.get(table) is not holder[0]:
                return  # a watch that was stopped meanwhile: its table is gone
            if record is not None and table is Table.PLAN:
                if ev.revision < self._plan_rev:
                    return
                self._plan_rev = ev.revision
            self._set(table, row, record)
            listeners = [fn for fn, tables in self._listeners.values() if table in tables]
        if listeners:
            out = dataclasses.replace(ev, record=record)
            for fn in listeners:
                try:
                    fn(out)
                except Exception:  # noqa: BLE001 - a listener bug must not stop the watch
                    log.exception("%s: a listener failed on %s", self._where, ev.key)

    def _set(self, table: Table, row: object, record: object) -> None:
        rows = self._rows[table]
        if record is None:
            if rows.pop(row, None) is None:
                return
            if table is Table.EVENTS:
                i = bisect.bisect_left(self._seqs, row)
                if i < len(self._seqs) and self._seqs[i] == row:
                    del self._seqs[i]
        else:
            if table is Table.EVENTS and row not in rows:
                bisect.insort(self._seqs, row)
            rows[row] = record
        self._bump(table)

    def _bump(self, table: Table) -> None:
        self._gens[table] += 1
        self._generation += 1
        self._cond.notify_all()

    def note_plan(self, plan: Optional[schema.PlanRecord], revision: int) -> None:
        """A plan this process read or published itself at ``revision`` (the leader's fresh
        read, its own fenced write): taken when the plan is watched and it is not older."""
        with self._cond:
            if plan is None or Table.PLAN not in self._watches or revision < self._plan_rev:
                return
            self._plan_rev = revision
            self._rows[Table.PLAN]["current"] = plan
            self._bump(Table.PLAN)

    # ------------------------------------------------------------------ listeners
    def subscribe(self, callback: Callable[[WatchEvent], None], tables: Iterable[Table]) -> int:
        """Call ``callback`` with every change applied to ``tables`` from now on; returns a
        token for ``unsubscribe``. It runs on a watch's thread: it must be quick and must not
        acquire or release tables (a release joins that thread)."""
        with self._cond:
            self._next_token += 1
            self._listeners[self._next_token] = (callback, frozenset(Table(t) for t in tables))
            return self._next_token

    def unsubscribe(self, token: int) -> None:
        with self._cond:
            self._listeners.pop(token, None)

    # ------------------------------------------------------------------ waiting
    @property
    def generation(self) -> int:
        """Bumped by every change (of any table)."""
        with self._cond:
            return self._generation

    def generations(self, tables: Iterable[Table]) -> tuple[int, ...]:
        """The change counters of ``tables``: equal tuples, unchanged tables."""
        with self._cond:
            return tuple(self._gens[Table(t)] for t in tables)

    def wait(self, since: int, timeout: float) -> int:
        """Wait (at most ``timeout`` seconds) until ``generation`` is no longer ``since``;
        returns the generation then."""
        deadline = self._clock() + max(timeout, 0.0)
        with self._cond:
            while self._generation == since:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._generation

    def wait_for(self, predicate: Callable[[], object], timeout: float) -> object:
        """Wait (at most ``timeout`` seconds) until ``predicate()`` (called under the view's
        lock, after each change) is truthy; returns its last value."""
        deadline = self._clock() + max(timeout, 0.0)
        with self._cond:
            while True:
                value = predicate()
                left = deadline - self._clock()
                if value or left <= 0:
                    return value
                self._cond.wait(left)

    # ------------------------------------------------------------------ reads (copies)
    def rows(self, table: Table) -> dict:
        """A copy of one table (see ``Table`` for its keys)."""
        with self._cond:
            return dict(self._rows[Table(table)])

    def copy(self, tables: Iterable[Table]) -> tuple[tuple[int, ...], dict[Table, dict]]:
        """(``generations(tables)``, copies of ``tables``), taken together."""
        tables = [Table(t) for t in tables]
        with self._cond:
            return (tuple(self._gens[t] for t in tables),
                    {t: dict(self._rows[t]) for t in tables})

    def nodes(self) -> dict[str, schema.NodeRecord]:
        return self.rows(Table.NODES)

    def verdicts(self) -> dict[tuple[str, int], schema.DeviceHealthRecord]:
        return self.rows(Table.DEVICES)

    def workers(self) -> dict[tuple[str, int], schema.WorkerRecord]:
        return self.rows(Table.WORKERS)

    def plan(self) -> tuple[Optional[schema.PlanRecord], int]:
        """``plan/current`` and its revision ((None, 0) before the first plan)."""
        with self._cond:
            return self._rows[Table.PLAN].get("current"), self._plan_rev

    def head(self) -> Optional[schema.PlanHeadRecord]:
        with self._cond:
            return self._rows[Table.HEAD].get("head")

    def acks(self, version: int) -> list[schema.SwitchAckRecord]:
        """The switch acks of plan ``version``, by node."""
        with self._cond:
            rows = self._rows[Table.SWITCH]
            return [rows[k] for k in sorted(k for k in rows if k[0] == version)]

    def events_after(self, seq: int, limit: Optional[int] = None) -> list[schema.EventRecord]:
        """The journal's events after ``seq``, in order (at most ``limit``)."""
        with self._cond:
            start = bisect.bisect_right(self._seqs, seq)
            end = len(self._seqs) if limit is None else min(len(self._seqs), start + limit)
            rows = self._rows[Table.EVENTS]
            return [rows[s] for s in self._seqs[start:end]]

    def round_state(self) -> Optional[RoundState]:
        """``rdzv/state`` as read (None when absent or bad)."""
        with self._cond:
            return self._rows[Table.RDZV].get("state")

    def job_end(self) -> Optional[RoundState]:
        """``rdzv/state`` when it records the job's end (succeeded or failed), else None."""
        state = self.round_state()
        return state if state is not None and state.state in TERMINAL else None

    def done_nodes(self, rnd: int) -> set[str]:
        """The nodes that marked their slots of round (plan version) ``rnd`` done."""
        with self._cond:
            return {k[1] for k in self._rows[Table.RDZV] if isinstance(k, tuple) and k[0] == rnd}
