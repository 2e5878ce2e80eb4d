"""What an agent leaves behind when it is SIGKILLed: nothing.

The kernel's death signal (``workers.die_with_parent``) reaches an agent's direct children only. A
worker's own children (data-loader processes, a compiler, a shell's pipeline) would outlive a
SIGKILLed agent, and so would the embedded etcd's data directory. This module closes both gaps:

* **a guard process per agent**, in its own session so that a signal to the agent's process group
  does not reach it, ignoring SIGINT, SIGTERM and SIGHUP. The agent registers every worker's
  process group (``+g <pgid>``, ``-g`` once that group was reaped) and every directory it owns
  (``+d <path>``) on a pipe. When the pipe reaches end of file, because the agent exited in any
  way SIGKILL included, the guard SIGKILLs every group still registered and removes every
  directory still registered, then exits;
* **a sweep at start** (``sweep_stale_dirs``): a directory made by ``owned_tmpdir`` carries an
  owner file with the pid and start time of the process that made it; one whose owner is gone
  (the guard itself was killed, or the machine rebooted) is removed by the next agent that
  starts on the machine;
* **a second Ctrl-C escalates** (``escalate``): the agent's wait for its workers after SIGTERM
  ends at once and what is left gets SIGKILL, as torchrun users expect.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Optional

import psutil

from hspmd_elastic.files import atomic_write

log = logging.getLogger(__name__)

OWNER_FILE = ".hspmd-owner"  # {"pid": ..., "create_time": ...} of the directory's maker

_GUARD = (
    "import os, shutil, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
    "groups, dirs = set(), set()\n"
    "for line in sys.stdin:\n"
    "    op, _, arg = line.strip().partition(' ')\n"
    "    if op == '+g': groups.add(int(arg))\n"
    "    elif op == '-g': groups.discard(int(arg))\n"
    "    elif op == '+d': dirs.add(arg)\n"
    "    elif op == '-d': dirs.discard(arg)\n"
    "for g in groups:\n"
    "    try: os.killpg(g, signal.SIGKILL)\n"
    "    except OSError: pass\n"
    "for d in dirs: shutil.rmtree(d, ignore_errors=True)\n"
)

_lock = threading.Lock()
_guard: Optional[subprocess.Popen] = None
_hurry = threading.Event()


def _send(line: str) -> None:
    """One line to the guard, starting it on first use (best effort: a guard that cannot start
    or has died leaves the death signal and the start sweep in place)."""
    global _guard
    if not sys.platform.startswith("linux"):
        return
    with _lock:
        if _guard is None or _guard.poll() is not None:
            try:
                _guard = subprocess.Popen(
                    [sys.executable, "-S", "-c", _GUARD], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                    start_new_session=True)
            except OSError as exc:
                log.warning("cannot start the process guard: %s", exc)
                _guard = None
                return
        try:
            _guard.stdin.write(f"{line}\n".encode())
            _guard.stdin.flush()
        except OSError as exc:  # the guard died: the next line starts a new one
            log.warning("process guard gone: %s", exc)


def guard_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` if this process dies before ``release_group``."""
    _send(f"+g {int(pgid)}")


def release_group(pgid: int) -> None:
    """Group ``pgid`` was reaped: the guard forgets it (its id may be reused)."""
    _send(f"-g {int(pgid)}")


def guard_dir(path: str) -> None:
    """Remove ``path`` if this process dies before ``release_dir``."""
    _send(f"+d {os.path.abspath(path)}")


def release_dir(path: str) -> None:
    _send(f"-d {os.path.abspath(path)}")


def escalate() -> None:
    """A second interrupt: stop waiting for workers to end on their own (see ``hurried``)."""
    _hurry.set()


def hurried() -> bool:
    return _hurry.is_set()


def wait_hurried(seconds: float) -> bool:
    """Sleep up to ``seconds``; True when ``escalate`` was called."""
    return _hurry.wait(seconds)


# ----------------------------------------------------------------------- owned temp directories
def _me() -> dict:
    return {"pid": os.getpid(), "create_time": psutil.Process().create_time()}


def owned_tmpdir(prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=...)`` with an owner file, guarded: removed when this process
    dies, and by ``sweep_stale_dirs`` if even the guard could not."""
    path = tempfile.mkdtemp(prefix=prefix)
    atomic_write(os.path.join(path, OWNER_FILE), json.dumps(_me()))
    guard_dir(path)
    return path


def remove_owned(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    release_dir(path)


def _owner_alive(owner: dict) -> bool:
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["create_time"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def sweep_stale_dirs(prefix: str, root: Optional[str] = None) -> list[str]:
    """Remove ``root``'s directories named ``prefix*`` whose owner file names a process that is
    gone; a directory without a readable owner file is left alone. Returns what was removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and not _owner_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d directory(ies) left by dead agents: %s", len(removed),
                 ", ".join(removed))
    return removed
