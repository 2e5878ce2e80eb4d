"""Progress bars for a job's long waits (a rendezvous collecting nodes, a switch in progress).

Promises: ``WaitProgress`` keeps one rich progress bar per wait of the current ``JobView``
(``view.waits``): a bar with a count when the total is known, a pulsing bar otherwise; bars of
waits that ended are removed. ``sync(view)`` is the only state change and does no I/O besides
drawing; ``follow(cache, stop, deadline)`` redraws on every change of a ``JobStateCache`` (an
etcd watch, no polling) and returns whether the job settled (no wait left) before the deadline;
a job whose prefix holds no key yet is one more wait (``start``): it has not started.
Bars go to stderr and only to a terminal unless ``console`` says otherwise, so piped output
stays clean. Labels are shown as text (never markup, control characters escaped). Used by
``status --wait`` (any machine that reaches etcd). The node agent draws its own waits
(rendezvous, first plan, switch) from what it already knows, with ``launcher.console``.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID,
                           TextColumn, TimeElapsedColumn)

from launcher.ops.safe import clean
from launcher.ops.view import JobView, WaitView

TICK_S = 0.5


class WaitProgress:
    def __init__(self, console: Optional[Console] = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                 BarColumn(bar_width=30), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=False,
                                 auto_refresh=False)
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> "WaitProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    @property
    def labels(self) -> list[str]:
        return list(self._tasks)

    @staticmethod
    def waits_of(cache) -> list[WaitView]:
        """The waits of ``cache``'s view, led by the job's start while it has no key."""
        view = cache.view()
        if not cache.empty:
            return list(view.waits)
        return [WaitView("start", f"job start: no keys under {cache.prefix} yet", 0, None,
                         None, None), *view.waits]

    def sync(self, view: JobView, waits: Optional[list[WaitView]] = None) -> bool:
        """Show ``waits`` (default ``view``'s); returns True when none is left (the job is
        settled)."""
        current = {w.kind: w for w in (view.waits if waits is None else waits)}
        for kind in list(self._tasks):
            if kind not in current:
                self.progress.remove_task(self._tasks.pop(kind))
        for kind, wait in current.items():
            task = self._tasks.get(kind)
            if task is None:
                task = self._tasks[kind] = self.progress.add_task(clean(wait.label),
                                                                  total=wait.total)
            self.progress.update(task, description=clean(wait.label), total=wait.total,
                                 completed=wait.done)
        self.progress.refresh()
        return not current

    def follow(self, cache, stop: threading.Event, deadline: Optional[float] = None) -> bool:
        """Redraw on every change of ``cache`` until settled, ``stop`` or the monotonic
        ``deadline``; True when the job settled."""
        version = -1
        with self:
            while not stop.is_set():
                if version != cache.version or version < 0:
                    version = cache.version
                    if self.sync(cache.view(), self.waits_of(cache)):
                        return True
                tick = TICK_S if deadline is None else min(TICK_S, deadline - time.monotonic())
                if tick <= 0:
                    return False
                cache.wait_changed(version, tick)
                self.progress.refresh()
        return False
