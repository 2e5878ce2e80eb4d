"""The node agent's progress bar on a terminal, for its long waits: a rendezvous collecting
nodes, the first plan of an elastic job, a switch in progress.

Promises:

* pure: ``bar_fields(wait)`` turns a wait's state (``RendezvousWait``, ``PlanWait``,
  ``SwitchWait``: plain values, times already relative) into the bar's fields (``BarFields``);
  ``SwitchTracker`` follows the event journal to the switch in progress; neither does I/O or
  reads a clock;
* ``WaitBar`` draws at most one bar, on stderr, and only when stderr is a terminal
  (``enabled``); otherwise every call is a no-op, so output that is piped to a file or read by
  a program (tests, CI, log collectors) stays exactly the log lines it was;
* workers' output never passes through the bar: workers write to the agent's stdout/stderr
  file descriptors directly or to their ``--redirects``/``--tee`` files; while a bar is shown,
  the launcher's own log lines are printed above it, and the bar is removed (transient) when
  the wait ends;
* ``WaitBar`` never blocks: drawing is done by the caller's thread, on each update; a terminal
  that fails (closed, gone) turns the bar off, never the agent;
* ``ElasticWaits`` is the only part that reads the job (an elastic agent's first-plan and
  switch waits), and only built when a bar is drawn; it reads the agent's job view
  (``launcher.jobview.WatchedJob``, shared with the mode and the leader), never etcd itself.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any, Optional, Union

from hspmd_elastic.contract.schema import switch_of
from hspmd_elastic.coord.plans import plan_nodes

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ wait states
@dataclass(frozen=True)
class RendezvousWait:
    """A restart-mode rendezvous as one node waits in it."""

    round: int
    state: str  # rdzv/state's: joining, or closed (without this node: it waits for the next)
    joined: int
    min_nodes: int
    max_nodes: int
    waited_s: float
    timeout_left_s: float  # until the join timeout
    last_call_left_s: Optional[float] = None  # min_nodes joined: until the round closes


@dataclass(frozen=True)
class PlanWait:
    """An elastic agent waiting for the leader's first plan."""

    nodes: int  # live node records
    min_nodes: int
    waited_s: float
    timeout_left_s: float


@dataclass(frozen=True)
class SwitchWait:
    """A switch to plan ``to_version`` in progress (started by the ``replan`` that replaces a
    plan, not yet ended by ``switch-done``/``switch-failed``)."""

    to_version: int
    from_version: Optional[int]
    phase: str  # the event that started it: replan
    acks_done: int  # switch/<version>/<node> records in state done (0 when none are written)
    acks_expected: Optional[int]  # nodes of the plan, when known
    waited_s: float


Wait = Union[RendezvousWait, PlanWait, SwitchWait]


@dataclass(frozen=True)
class BarFields:
    kind: str  # rendezvous | plan | switch
    description: str
    completed: int
    total: Optional[int]  # None: a pulsing bar
    status: str


def _secs(s: float) -> str:
    return f"{max(0.0, s):.0f}s"


def bar_fields(wait: Wait) -> BarFields:
    """The bar for ``wait`` (pure)."""
    if isinstance(wait, RendezvousWait):
        span = (f"{wait.min_nodes}" if wait.min_nodes == wait.max_nodes
                else f"{wait.min_nodes}..{wait.max_nodes}")
        if wait.state != "joining":
            status = f"round {wait.state} without this node, next round"
        elif wait.last_call_left_s is not None:
            status = f"last call {max(0.0, wait.last_call_left_s):.1f}s"
        else:
            status = f"need {span}"
        return BarFields("rendezvous", f"rendezvous round {wait.round}: nodes joined",
                         wait.joined, wait.max_nodes,
                         f"{status}; timeout {_secs(wait.timeout_left_s)}")
    if isinstance(wait, PlanWait):
        return BarFields("plan", "first plan: nodes up", wait.nodes,
                         max(wait.min_nodes, wait.nodes),
                         f"need {wait.min_nodes}; timeout {_secs(wait.timeout_left_s)}")
    if isinstance(wait, SwitchWait):
        origin = f"v{wait.from_version}" if wait.from_version else "?"
        acked = "" if wait.acks_expected is None else ": nodes acked"
        return BarFields("switch", f"switch {origin} -> plan v{wait.to_version}{acked}",
                         wait.acks_done, wait.acks_expected,
                         f"{wait.phase}, waiting for switch-done")
    raise TypeError(f"not a wait: {wait!r}")


# ------------------------------------------------------------------------ switch tracking
class SwitchTracker:
    """The switch in progress, from events fed in journal order (pure, no I/O), paired by the
    contract's one reader (``contract.events.switch_of``): it starts with the ``replan`` that
    replaces a plan and ends with the ``switch-done``/``switch-failed`` of its version, or when
    a newer switch starts."""

    def __init__(self) -> None:
        self.current: Optional[tuple[int, Optional[int], str, float]] = None  # to, from, phase, at

    def observe(self, ev) -> None:
        mark = switch_of(ev)
        if mark is None:
            return
        if mark.phase == "start":
            if self.current is None or self.current[0] != mark.to_version:
                self.current = (mark.to_version, mark.from_version, ev.type, ev.at)
        elif self.current is not None and self.current[0] <= mark.to_version:
            self.current = None

    def wait(self, now: float, acks_done: int = 0,
             acks_expected: Optional[int] = None) -> Optional[SwitchWait]:
        if self.current is None:
            return None
        to, frm, phase, at = self.current
        return SwitchWait(to, frm, phase, acks_done, acks_expected, max(0.0, now - at))


# ------------------------------------------------------------------------------- drawing
def stderr_is_terminal(stream: Optional[IO[str]] = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


class WaitBar:
    """One transient rich progress bar on a terminal (a no-op when ``enabled`` is False)."""

    def __init__(self, stream: Optional[IO[str]] = None, enabled: Optional[bool] = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = stderr_is_terminal(self.stream) if enabled is None else enabled
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._kind = ""
        self._handlers: list[tuple[logging.StreamHandler, IO[str]]] = []

    @property
    def shown(self) -> Optional[str]:
        """The kind of the bar on screen, or None."""
        return self._kind or None

    def update(self, wait: Optional[Wait]) -> None:
        """Show ``wait`` (None: the wait ended, remove the bar)."""
        if not self.enabled:
            return
        if wait is None:
            self.clear()
            return
        fields = bar_fields(wait)
        with self._lock:
            try:
                if self._progress is not None and self._kind != fields.kind:
                    self._stop()
                if self._progress is None:
                    self._start(fields)
                self._progress.update(self._task, description=fields.description,
                                      completed=fields.completed, total=fields.total,
                                      status=fields.status)
                self._progress.refresh()
            except Exception as exc:  # noqa: BLE001 - a bar is never a reason to fail
                self._give_up(exc)

    def clear(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            try:
                self._stop()
            except Exception as exc:  # noqa: BLE001
                self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        """The terminal went away (or cannot be drawn on): log lines only from now on."""
        log.debug("progress bar disabled: %s", exc)
        self.enabled = False
        for handler, old in self._handlers:
            handler.setStream(old)
        self._handlers = []
        self._progress, self._task, self._kind = None, None, ""

    # ------------------------------------------------------------------------ rich
    def _start(self, fields: BarFields) -> None:
        from rich.console import Console  # startup
        from rich.progress import (  # startup
            BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn)

        console = Console(file=self.stream, force_terminal=True)
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                  BarColumn(bar_width=12), MofNCompleteColumn(),
                                  TimeElapsedColumn(),
                                  TextColumn("{task.fields[status]}", markup=False),
                                  console=console, transient=True, auto_refresh=False,
                                  redirect_stdout=False, redirect_stderr=False)
        self._task = self._progress.add_task(fields.description, total=fields.total,
                                             completed=fields.completed, status=fields.status)
        self._kind = fields.kind
        self._progress.start()
        # the launcher's log lines go above the bar instead of through it
        proxy = _LogStream(console)
        for logger in (logging.getLogger("launcher"), logging.getLogger()):
            for h in logger.handlers:
                if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is \
                        self.stream:
                    self._handlers.append((h, h.setStream(proxy)))

    def _stop(self) -> None:
        if self._progress is None:
            return
        for handler, old in self._handlers:
            partial = handler.setStream(old)
            if isinstance(partial, _LogStream) and partial.pending:
                old.write(partial.pending)
        self._handlers = []
        try:
            self._progress.stop()
        finally:
            self._progress, self._task, self._kind = None, None, ""


# ------------------------------------------------------------------ elastic waits (reads)
class ElasticWaits:
    """What an elastic agent's bar shows, read from the agent's job view (a
    ``launcher.jobview.WatchedJob`` holding the nodes, the journal, the plan's head and the
    switch acks; the agent builds this only when its bar is drawn).

    ``poll(waiting_plan, waited_s, timeout_left_s, now)`` returns the ``PlanWait`` while no plan
    exists, else the ``SwitchWait`` of the switch in progress or None. The view's reads do no
    I/O and never raise: each poll takes the journal's events since the last one."""

    def __init__(self, view, min_nodes: int) -> None:
        self.view, self.min_nodes = view, min_nodes
        self.tracker = SwitchTracker()
        self._seq = 0

    def poll(self, waiting_plan: bool, waited_s: float, timeout_left_s: float,
             now: float) -> Optional[Wait]:
        if waiting_plan:
            return PlanWait(len(self.view.nodes()), self.min_nodes, waited_s, timeout_left_s)
        for ev in self.view.events_after(self._seq):
            self.tracker.observe(ev)
            self._seq = ev.seq
        if self.tracker.current is None:
            return None
        return self.tracker.wait(now, *self._acks(self.tracker.current[0]))

    def _acks(self, version: int) -> tuple[int, Optional[int]]:
        acks = self.view.acks(version)
        if not acks:  # nodes that write no acks: a pulsing bar, not a count stuck at 0
            return 0, None
        head, expected = self.view.head(), None
        if head is not None and head.version == version:
            try:
                expected = len(plan_nodes(head)) or None
            except ValueError:  # a device run that is not <node>:<indices>: no count to show
                expected = None
        return sum(1 for a in acks if a.state == "done"), expected


class _LogStream:
    """A log handler's stream while a bar is shown: whole lines are printed above the bar, as
    they are (no wrapping, no markup, no highlighting)."""

    def __init__(self, console) -> None:
        self.console = console
        self._partial = ""

    def write(self, text: str) -> int:
        from rich.text import Text  # startup

        lines, sep, self._partial = (self._partial + text).rpartition("\n")
        if sep:
            self.console.print(Text(lines), soft_wrap=True)
        return len(text)

    @property
    def pending(self) -> str:
        return self._partial

    def flush(self) -> None:
        pass
