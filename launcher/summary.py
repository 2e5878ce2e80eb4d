"""Failure summary: the ``<script> FAILED`` block torchrun prints, from worker exits and error files.

Promises:

* the text has torchrun's shape (title, ``Failures:``, ``Root Cause (first observed failure):``,
  one ``[i]:`` block per failure with time/host/rank/exitcode/error_file/traceback), so people and
  log scrapers that know torchrun's output read ours;
* the error file is the one ``torch.distributed.elastic.multiprocessing.errors.record`` writes to
  ``TORCHELASTIC_ERROR_FILE``; its traceback and timestamp are used when present, a signal name or
  a pointer to the ``@record`` docs otherwise;
* the root cause is the failure with the smallest timestamp (ties: the lowest rank), unless the
  caller names it (elastic mode: the job's first failure, possibly another node's, rebuilt from
  its journaled ``ExitInfo`` with ``WorkerFailure.from_exit``);
* each failure shows its own host when it has one (another node's), else the agent's;
* ``error_line`` is the exception line (``Type: message``) of an error file, the one line an
  elastic agent journals with a worker's exit;
* a malformed error file never hides the failure: its parse error becomes the message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from hspmd_elastic.contract.events import ExitInfo

NOT_AVAILABLE = "<N/A>"
NO_TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
MAX_WIDTH = 60


@dataclass
class WorkerFailure:
    """One failed worker: how it ended and what its error file says."""

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int  # negative: killed by that signal (Popen's convention)
    error_file: str
    observed_at: float = field(default_factory=time.time)
    message: str = ""
    timestamp: int = 0
    host: str = ""  # another node's failure: its host (empty: this agent's)
    journaled: bool = False  # rebuilt from the journal: the error file is not read here

    def __post_init__(self) -> None:
        if self.journaled:
            return
        data = _read_error_file(self.error_file) if self.error_file else None
        if data is None:
            self.error_file = NOT_AVAILABLE
            self.timestamp = int(self.observed_at)
            self.message = self._fallback_message()
        else:
            self.message, self.timestamp = _message_and_time(data, self.observed_at)
            if not self.message:
                self.message = self._fallback_message()

    @classmethod
    def from_exit(cls, info: ExitInfo, node: str, at: float) -> "WorkerFailure":
        """A failure as another agent journaled it (``ExitInfo`` of a ``failure`` event at wall
        clock ``at``): its error line is the message, its error file is named, not read."""
        code = info.exitcode if info.exitcode is not None else -(info.signal or 0)
        host = f"{info.host} (node {node})" if info.host else f"node {node}"
        return cls(local_rank=info.local_rank, global_rank=info.global_rank or 0, pid=info.pid,
                   exitcode=code, error_file=info.error_file or NOT_AVAILABLE,
                   observed_at=at, message=info.message or NOT_AVAILABLE, timestamp=int(at),
                   host=host, journaled=True)

    def signal_name(self) -> str:
        if self.exitcode >= 0:
            return NOT_AVAILABLE
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return NOT_AVAILABLE

    def _fallback_message(self) -> str:
        if self.exitcode < 0:
            return f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        return NO_TRACEBACK_HINT

    def exit_info(self) -> ExitInfo:
        """This failure as a ``failure`` event lists it (``contract.events.ExitInfo``)."""
        killed = self.exitcode < 0
        return ExitInfo(self.local_rank, self.pid, None if killed else self.exitcode,
                        -self.exitcode if killed else None, self.global_rank, self.error_file,
                        self.message)

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank, "global_rank": self.global_rank, "pid": self.pid,
            "exitcode": self.exitcode, "error_file": self.error_file,
            "timestamp": self.timestamp, "message": self.message,
        }


def _read_error_file(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
    except (OSError, ValueError) as exc:
        return {"message": f"unreadable error file {path}: {exc}"}
    return data if isinstance(data, dict) else {"message": str(data)}


def error_line(path: str) -> str:
    """The exception line (``Type: message``) of the error file ``path``; "" when there is none.
    ``@record`` writes it as the error's ``message``; a plain message's first line otherwise."""
    data = _read_error_file(path) if path else None
    if data is None:
        return ""
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message") or ""
    lines = str(message).strip().splitlines()
    return lines[0].strip() if lines else ""


def _message_and_time(data: dict, default_ts: float) -> tuple[str, int]:
    """The traceback (or message) and timestamp of an error file written by ``@record``.

    Its layout: ``{"message": {"message": "...", "extraInfo": {"py_callstack": "...",
    "timestamp": "..."}}}``, or ``{"message": "...", "timestamp": ...}`` for plain messages.
    """
    message = data.get("message", "")
    if isinstance(message, dict):
        extra = message.get("extraInfo", {}) or {}
        text = extra.get("py_callstack") or message.get("message") or NOT_AVAILABLE
        ts = extra.get("timestamp", default_ts)
    else:
        text = str(message)
        ts = data.get("timestamp", default_ts)
    try:
        stamp = int(ts)
    except (TypeError, ValueError):
        stamp = int(default_ts)
    return str(text), stamp


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    if not failures:
        raise ValueError("a failure summary needs at least one failure")
    return min(failures, key=lambda f: (f.timestamp, f.global_rank))


def _format_one(idx: int, failure: WorkerFailure, hostname: str) -> str:
    sig = failure.signal_name()
    sig_text = f" ({sig})" if sig != NOT_AVAILABLE else ""
    when = datetime.fromtimestamp(failure.timestamp).isoformat(sep="_")
    traceback = failure.message.replace("\n", "\n  ")
    return "\n".join([
        f"[{idx}]:",
        f"  time      : {when}",
        f"  host      : {failure.host or hostname}",
        f"  rank      : {failure.global_rank} (local_rank: {failure.local_rank})",
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}) {sig_text}",
        f"  error_file: {failure.error_file}",
        f"  traceback : {traceback}",
    ])


def format_summary(name: str, failures: list[WorkerFailure], hostname: Optional[str] = None,
                   root: Optional[WorkerFailure] = None) -> str:
    """The summary block, starting and ending with a newline like torchrun's. ``root``: the root
    cause when the caller knows it (else ``root_cause``); it is listed if ``failures`` lacks it."""
    host = hostname or socket.getfqdn()
    title = f"{name} FAILED"
    if root is None:
        root = root_cause(failures)
    elif all(f is not root for f in failures):
        failures = [*failures, root]
    ordered = sorted(failures, key=lambda f: f.global_rank)
    root_text, others = "", []
    width = len(title)
    for idx, failure in enumerate(ordered):
        text = _format_one(idx, failure, host)
        width = max(width, *(len(line) for line in text.split("\n")))
        if failure is root:
            root_text = text
        else:
            others.append(text)
    width = min(width, MAX_WIDTH)
    lines = [
        "",
        "=" * width,
        title,
        "-" * width,
        "Failures:",
        "\n".join(others) if others else "  <NO_OTHER_FAILURES>",
        "-" * width,
        "Root Cause (first observed failure):",
        root_text,
        "=" * width,
    ]
    return "\n".join(lines)
