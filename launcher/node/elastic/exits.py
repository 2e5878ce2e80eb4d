"""Worker exits and the verdicts a node agent makes about its own slots.

Promises: a worker exit is a ``WorkerExit`` (exit code, or the killing signal); it is journaled
once as a ``failure`` event (``report_worker_exit``: pid, exit code, signal, device, plan
version, and, given the worker, its rank, host, error file and the exception line the error file
holds) and fails its slot with a verdict of origin ``exit`` (so the leader does not
journal it again); ``SlotVerdicts`` keeps such verdicts (exits, hangs) sticky
and lets the worst of them and the health source's win.

A device fault kills one worker; the script's own error (a plan the script does not accept, a
global batch other than the leader's, a damaged checkpoint, weights it cannot read) kills every
worker that runs into it. ``ScriptErrors`` (pure, fed with the journal's ``failure`` events)
tells them apart: when two worker exits journaled the same error (``error_signature``: the
exception type and its message with numbers and addresses normalised away), on two devices or
on one device again after a replan, it is the script's fault, and the job fails once with the
first of those exits as the root cause (``ScriptError``). Errors a replan can cure (timeouts,
lost peers, an unreachable store or etcd: ``is_cluster_symptom``) and exits without an error
line never count (signals; a script without ``@record`` that printed no error). The error
line of an exit is its error file's (``@record``), else the last error its stderr ends with
(``stderr_error_line``: a traceback's exception line, or a ``prog: error: ...`` line, the
convention of argparse and the examples): the agent keeps every elastic worker's stderr in
its log directory (``workers.ElasticWorkers``). Two exits share an error when their exit codes
and error signatures agree.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.contract.ids import device_id
from hspmd_elastic.coord.journal import append_event
from launcher.health.api import DeviceState, Verdict
from launcher.summary import error_line

_SEVERITY = {DeviceState.HEALTHY: 0, DeviceState.DEGRADED: 1, DeviceState.SUSPECT: 2,
             DeviceState.FAILED: 3}


@dataclass(frozen=True)
class WorkerExit:
    """A worker process that ended: ``exitcode`` (None when killed) or ``signal``."""

    local_rank: int
    pid: int
    exitcode: Optional[int]
    signal: Optional[int] = None

    @classmethod
    def from_returncode(cls, local_rank: int, pid: int, returncode: int) -> "WorkerExit":
        if returncode < 0:
            return cls(local_rank, pid, None, -returncode)
        return cls(local_rank, pid, returncode, None)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"worker pid {self.pid} killed by {name}"
        return f"worker pid {self.pid} exited with code {self.exitcode}"

    def verdict(self, at: float = 0.0) -> Verdict:
        return Verdict.failed(self.describe(), at=at, origin=schema.VerdictOrigin.EXIT.value)


MAX_ERROR_LINE = 500  # characters of a worker's error line journaled with its exit


def report_worker_exit(client: EtcdClient, job: str, node: str, exit: WorkerExit,
                       plan_version: Optional[int] = None,
                       wall_clock: Callable[[], float] = time.time, worker: Any = None,
                       host: str = "") -> schema.EventRecord:
    """Journal a worker exit as a ``failure`` event (pid, exit code, signal, device); with the
    ``worker`` (``launcher.node.workers.Worker``) also its rank, error file and error line."""
    error_file = worker.logs.error_file if worker is not None else ""
    failed = exit.exitcode not in (None, 0)
    line = error_line(error_file) if error_file and failed else ""
    if not line and failed and worker is not None and worker.logs.stderr:
        line = stderr_error_line(worker.logs.stderr)
        error_file = error_file if error_file and os.path.exists(error_file) else ""
    reason = exit.describe() + (f": {line[:MAX_ERROR_LINE]}" if line else "")
    return append_event(client, job, "failure", node, schema.FailureDetail(
        devices=[device_id(node, exit.local_rank)], reason=reason,
        plan_version=plan_version or 0,
        exits=[schema.ExitInfo(exit.local_rank, exit.pid, exit.exitcode, exit.signal,
                               getattr(worker, "global_rank", None), error_file,
                               line[:MAX_ERROR_LINE], host)],
    ), wall_clock=wall_clock)


def worker_of(exits: Iterable[tuple], ex: WorkerExit) -> Any:
    """The worker of ``ex`` in ``ElasticWorkers.exits`` ((exit, worker, final) rows), or None."""
    return next((w for e, w, _final in exits if e is ex), None)


# ------------------------------------------------------------------ the script's own errors
# Exception types whose name says a replan may cure them: the cluster, not the script.
_CLUSTER_SYMPTOM = re.compile(r"Timeout|Unreachable|Abort|Lost|Connection|Network|Requested|"
                              r"BrokenPipe|CommError|Coordination|Etcd|Unavailable|StoreError")
_TYPE = re.compile(r"^([A-Za-z_][\w.]*):(?:\s|$)")  # what ``@record`` writes: "Type: message"
_PROG_ERROR = re.compile(r"^([\w.+-]+): error: (\S.*)$")  # argparse's and the examples' form
_TRACEBACK = "Traceback (most recent call last):"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
# Messages of a lost peer or a timeout, whatever the exception type (gloo's RuntimeError)
_LOST_PEER = re.compile(r"[Cc]onnection (closed|reset|refused)|[Tt]imed out|[Bb]roken pipe|"
                        r"[Pp]eer")
_NUMBER = re.compile(r"\d+")


def error_signature(line: str) -> Optional[tuple[str, str]]:
    """Pure: ``(exception type, normalised message)`` of an error line ``Type: message`` (or
    ``prog: error: message``, type ``error``), or None for no line or an error a replan may
    cure (``is_cluster_symptom``: by its type, or a message about a lost peer or a timeout).
    The message is normalised so the same error on another rank matches: addresses, numbers
    (ranks, pids, ports, shard numbers) and runs of blanks are folded."""
    first = line.strip().splitlines()[0].strip() if line and line.strip() else ""
    prog = _PROG_ERROR.match(first)
    m = _TYPE.match(first)
    if prog:
        kind, message = "error", prog.group(2)
    elif m:
        kind, message = m.group(1).rsplit(".", 1)[-1], first[m.end():]
    else:
        return None
    if is_cluster_symptom(kind) or _LOST_PEER.search(message):
        return None
    text = _NUMBER.sub("#", _ADDRESS.sub("0x#", message))
    return kind, " ".join(text.split())[:MAX_ERROR_LINE]


def is_cluster_symptom(kind: str) -> bool:
    """Pure: an exception type a replan may cure (a timeout, a lost peer, etcd away)."""
    return bool(_CLUSTER_SYMPTOM.search(kind))


STDERR_TAIL_BYTES = 64 * 1024  # of a worker's stderr, read for its last error


def stderr_error_line(path: str, tail_bytes: int = STDERR_TAIL_BYTES) -> str:
    """The error a worker's stderr file ends with, as ``Type: message`` ("" if none): the
    exception line of its last traceback, or a later ``prog: error: message`` line. Only the
    last ``tail_bytes`` are read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return last_error(text.splitlines())


def last_error(lines: list[str]) -> str:
    """Pure: the last error of a stderr's ``lines`` (see ``stderr_error_line``)."""
    found, in_traceback = "", False
    for line in lines:
        if line.startswith(_TRACEBACK):
            in_traceback = True
            continue
        if in_traceback and line and not line[0].isspace():
            if _TYPE.match(line):
                found, in_traceback = line.strip(), False
            continue
        m = _PROG_ERROR.match(line.strip())
        if m:
            found = line.strip()
    return found


@dataclass(frozen=True)
class ScriptError:
    """The same error killed ``count`` workers on ``devices``: ``first`` (an ``ExitInfo``) is
    the job's first worker exit with it, journaled by ``node`` at wall clock ``at`` under plan
    ``plan_version``."""

    first: schema.ExitInfo
    node: str
    at: float
    plan_version: int
    count: int
    devices: tuple[str, ...]
    versions: tuple[int, ...]

    def describe(self, limit: int = 300) -> str:
        """The job's end reason: one line, the root cause first."""
        f = self.first
        where = f"rank {f.global_rank if f.global_rank is not None else '?'} on " \
                f"{device_id(self.node, f.local_rank)}" + (f", host {f.host}" if f.host else "")
        spread = (f"{len(self.devices)} devices ({', '.join(self.devices[:4])}"
                  + (", ..." if len(self.devices) > 4 else "") + ")") \
            if len(self.devices) > 1 else \
            f"{self.devices[0]} again after a replan (plans v{', v'.join(map(str, self.versions))})"
        return (f"the script's error, not a device fault: {f.message[:limit]} (first: {where}, "
                f"error file {f.error_file or '<N/A>'}); the same error killed {self.count} "
                f"worker(s) on {spread}")


class ScriptErrors:
    """Pure: the journal's worker exits by error (``note`` each ``failure`` event, in journal
    order); ``found`` is the first error two exits share, or None."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()  # (node, pid): a failure journaled twice
        self._by_error: dict[tuple, list[tuple]] = {}  # (exit code, *signature) -> exits
        self.found: Optional[ScriptError] = None

    def note(self, event: Any, detail: Any) -> Optional[ScriptError]:
        """Take in one ``failure`` event (``EventRecord``) with its typed ``detail``."""
        for info in getattr(detail, "exits", None) or ():
            if (event.node, info.pid) in self._seen:
                continue
            self._seen.add((event.node, info.pid))
            sig = error_signature(info.message)
            if sig is None:
                continue
            rows = self._by_error.setdefault((info.exitcode, *sig), [])
            rows.append((info, event.node, event.at, detail.plan_version))
            if len(rows) >= 2 and self.found is None:
                first, node, at, version = rows[0]
                devices = tuple(dict.fromkeys(device_id(n, i.local_rank) for i, n, _a, _v in rows))
                versions = tuple(sorted({v for *_r, v in rows}))
                self.found = ScriptError(first, node, at, version, len(rows), devices, versions)
        return self.found


class SlotVerdicts:
    """Verdicts the agent itself made about its slots (worker exit, hang); sticky, worst wins
    over what the health source says."""

    def __init__(self) -> None:
        self._failed: dict[int, Verdict] = {}

    def fail(self, local_rank: int, verdict: Verdict) -> None:
        self._failed.setdefault(local_rank, verdict)

    def clear(self, local_rank: int) -> None:
        self._failed.pop(local_rank, None)

    def failed(self) -> dict[int, Verdict]:
        return dict(self._failed)

    def merged(self, source: Mapping[int, Verdict], slots: Iterable[int]) -> dict[int, Verdict]:
        """One verdict per slot (healthy when nobody says otherwise), the worst one winning."""
        out = {i: Verdict.healthy() for i in slots}
        for verdicts in (source, self._failed):
            for i, v in verdicts.items():
                if i not in out or _SEVERITY[v.state] >= _SEVERITY[out[i].state]:
                    out[i] = v
        return out
