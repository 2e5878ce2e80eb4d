"""Worker logs: ``--log-dir`` layout, ``--redirects``/``--tee`` destinations, prefixed console tails.

Promises (torchrun's behaviour):

* the run directory is ``<log_dir>/<rdzv_id>_<random>/`` (``log_dir`` defaults to a fresh temp
  dir), one per agent, reused across restarts; a ``--log-dir`` that cannot be created or
  written is a one-line ``ConfigError`` (``check_log_dir``, before the agent starts); each
  attempt gets ``attempt_<restart_count>/<local_rank>/{stdout.log,stderr.log,error.json}``, and
  an attempt directory is emptied when it is reused (a membership change restarts with the
  same count);
* ``error.json`` is the worker's ``TORCHELASTIC_ERROR_FILE``;
* a redirected stream goes only to its file; a tee'd stream goes to its file and to the agent's
  console with the ``[<role><local_rank>]:`` prefix on every line; other streams are inherited
  (no prefix), except for ranks left out by ``--local-ranks-filter``, whose console output is
  dropped (files are still written);
* tails stop only after the worker exited and the file was read to its end.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional, TextIO

from launcher.api import ConfigError, LogSettings

log = logging.getLogger(__name__)

OUT, ERR = 1, 2
_VALUE_RE = re.compile(r"^[0-3]$")
_MAPPING_RE = re.compile(r"^(\d+:[0-3],)*(\d+:[0-3])$")
TAIL_INTERVAL_S = 0.05


def parse_std(flag: str, value: str) -> tuple[int, dict[int, int]]:
    """``"3"`` -> (3, {}); ``"0:1,1:2"`` -> (0, {0: 1, 1: 2}); anything else: ConfigError."""
    text = (value or "0").strip()
    if _VALUE_RE.match(text):
        return int(text), {}
    if _MAPPING_RE.match(text):
        mapping = {}
        for item in text.split(","):
            rank, std = item.split(":")
            mapping[int(rank)] = int(std)
        return 0, mapping
    raise ConfigError(
        f"invalid {flag} value {value!r}: use 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or a "
        "per-local-rank map like 0:3,1:1"
    )


def parse_ranks_filter(value: str) -> Optional[frozenset[int]]:
    if not value:
        return None
    try:
        ranks = frozenset(int(v) for v in value.split(","))
    except ValueError:
        ranks = frozenset()
    if not ranks:
        raise ConfigError(
            f"invalid --local-ranks-filter value {value!r}: use a comma-separated list of "
            "integers like 0,1,2"
        )
    return ranks


@dataclass(frozen=True)
class WorkerLogPaths:
    """Where one worker's streams go: a file path, or None for the agent's console."""

    stdout: Optional[str]
    stderr: Optional[str]
    error_file: str
    tee_stdout: bool
    tee_stderr: bool
    console: bool  # False: left out by --local-ranks-filter


def check_log_dir(path: Optional[str]) -> Optional[str]:
    """``--log-dir``: a directory this process can create (if missing) and write in, else
    ``ConfigError`` naming it and the OS's reason (checked before anything starts)."""
    if path is None:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--log-dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--log-dir {path!r} cannot be created: "
                          f"{exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {path!r} is not writable by this user")
    return path


class RunLogDir:
    """The per-agent run directory and its attempt layout."""

    def __init__(self, settings: LogSettings, run_id: str):
        self.settings = settings
        try:
            base = check_log_dir(settings.log_dir) or tempfile.mkdtemp(prefix="hspmd_elastic_")
            self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        except OSError as exc:  # a full disk, or the directory removed since the check
            raise ConfigError(f"--log-dir {settings.log_dir or tempfile.gettempdir()!r}: "
                              f"cannot create the run directory: {exc.strerror or exc}") from None
        log.info("log directory set to: %s", self.run_dir)

    def attempt(self, restart_count: int, local_world_size: int) -> dict[int, WorkerLogPaths]:
        attempt_dir = os.path.join(self.run_dir, f"attempt_{restart_count}")
        shutil.rmtree(attempt_dir, ignore_errors=True)
        os.makedirs(attempt_dir)
        paths = {}
        ranks_filter = self.settings.local_ranks_filter
        for lr in range(local_world_size):
            wdir = os.path.join(attempt_dir, str(lr))
            os.mkdir(wdir)
            tee = self.settings.tee_of(lr)
            redirect = self.settings.redirect_of(lr) | tee
            console = ranks_filter is None or lr in ranks_filter
            paths[lr] = WorkerLogPaths(
                stdout=os.path.join(wdir, "stdout.log") if redirect & OUT else None,
                stderr=os.path.join(wdir, "stderr.log") if redirect & ERR else None,
                error_file=os.path.join(wdir, "error.json"),
                tee_stdout=bool(tee & OUT) and console,
                tee_stderr=bool(tee & ERR) and console,
                console=console,
            )
        return paths


class TailLog:
    """Copy lines appended to files onto a console stream with ``[<role><rank>]:`` prefixes."""

    def __init__(self, role: str, files: dict[int, str], dst: TextIO, stop: threading.Event):
        self._threads = [
            threading.Thread(
                target=self._tail, args=(f"[{role}{lr}]:", path, dst, stop),
                name=f"tail-{role}{lr}", daemon=True,
            )
            for lr, path in sorted(files.items())
        ]
        self._stop = stop

    def start(self) -> "TailLog":
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float = 5.0) -> None:
        for t in self._threads:
            t.join(timeout)

    @staticmethod
    def _tail(header: str, path: str, dst: TextIO, stop: threading.Event) -> None:
        while not os.path.exists(path):
            if stop.wait(TAIL_INTERVAL_S):
                if not os.path.exists(path):
                    return
        with open(path, errors="replace") as fp:
            pending = ""
            while True:
                chunk = fp.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        _write(dst, header + pending)
                        pending = ""
                    continue
                if stop.is_set():
                    rest = fp.read()
                    if pending or rest:
                        text = pending + rest
                        _write(dst, header + text + ("" if text.endswith("\n") else "\n"))
                    return
                stop.wait(TAIL_INTERVAL_S)


def _write(dst: TextIO, text: str) -> None:
    try:
        dst.write(text)
        dst.flush()
    except (OSError, ValueError):  # console gone: the file still has everything
        pass


def open_console_tails(role: str, paths: dict[int, WorkerLogPaths],
                       stop: threading.Event) -> list[TailLog]:
    outs = {lr: p.stdout for lr, p in paths.items() if p.tee_stdout and p.stdout}
    errs = {lr: p.stderr for lr, p in paths.items() if p.tee_stderr and p.stderr}
    return [TailLog(role, outs, sys.stdout, stop).start(),
            TailLog(role, errs, sys.stderr, stop).start()]
