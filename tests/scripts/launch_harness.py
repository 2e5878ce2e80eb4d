"""Test harness for hspmd-launch: run the real console script, read its files, sweep orphans.

The polling wait the launch tests use is ``tests/_wait.py``'s ``wait_for``.

Every launcher started here carries ``HSPMD_TEST_MARKER=<unique>`` in its environment, which its
workers and its embedded etcd inherit; ``assert_no_leftovers`` finds any process still carrying
the marker, kills it (so a failing test does not disturb others) and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import click
import psutil

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent.parent
LAUNCH = str(Path(sys.executable).parent / "hspmd-launch")
MARKER = "HSPMD_TEST_MARKER"


def new_marker() -> str:
    return f"launch-{uuid.uuid4().hex[:12]}"


def base_env(marker: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # PYTHONFAULTHANDLER: a worker that dies in native code (SIGABRT, SIGSEGV) still prints the
    # Python stacks of its threads, so a failed test says where it was.
    # PET_HSPMD_ALL_DEVICES (--hspmd-all-devices, read in elastic mode only): every worker gets
    # a role, as these tests follow every worker through kills and reshards; the tiny models'
    # fixed costs would leave some idle. A test of idle workers passes "off".
    env.update({MARKER: marker, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1", "PET_HSPMD_ALL_DEVICES": "on"})
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Launcher:
    """One ``hspmd-launch`` process with its output in files."""

    def __init__(self, args: list[str], env: dict[str, str], out_dir: Path, name: str = "launch"):
        out_dir.mkdir(parents=True, exist_ok=True)
        if "--log-dir" not in args and "PET_LOG_DIR" not in env:
            env = dict(env, PET_LOG_DIR=str(out_dir / f"{name}-logs"))  # keep /tmp clean
        self.stdout_path = out_dir / f"{name}.stdout"
        self.stderr_path = out_dir / f"{name}.stderr"
        self._out = open(self.stdout_path, "wb")
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([LAUNCH, *args], env=env, stdout=self._out,
                                     stderr=self._err, stdin=subprocess.DEVNULL, cwd=str(REPO),
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"hspmd-launch did not exit within {timeout}s; stderr:\n"
                                 + self.stderr())
        finally:
            self._out.close()
            self._err.close()

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def sleeper_agent(tmp_path: Path, marker: str, nproc: int, *flags: str,
                  **env: str) -> tuple[Launcher, Path]:
    """A launcher of ``nproc`` ``sleeper.py`` workers (launcher ``flags`` before the script),
    ``env`` in their environment (``IGNORE_TERM``, ``SPAWN_CHILD`` ...). Each worker writes its
    pid (and its child's) to a file in the returned folder, ``tmp_path/pids``."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    launcher = Launcher(["--nproc-per-node", str(nproc), *flags, str(SCRIPTS / "sleeper.py")],
                        base_env(marker, PID_DIR=str(pids_dir), **env), tmp_path)
    return launcher, pids_dir


def assert_agents_running(agents: dict) -> None:
    """AssertionError, with its stderr, if an agent (by name; each with ``proc`` and
    ``stderr()``) has exited."""
    for name, agent in agents.items():
        if agent.proc.poll() is not None:
            raise AssertionError(f"agent {name} exited {agent.proc.returncode} early:\n"
                                 + agent.stderr()[-4000:])


def run_launch(args: list[str], env: dict[str, str], out_dir: Path, timeout: float,
               name: str = "launch") -> tuple[int, str, str]:
    launcher = Launcher(args, env, out_dir, name)
    code = launcher.wait(timeout)
    return code, launcher.stdout(), launcher.stderr()


def read_json_files(directory: Path, pattern: str) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob(pattern))}


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def assert_no_leftovers(marker: str, grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_processes(marker)
    if left:
        described = []
        for p in left:
            try:
                described.append(f"{p.pid}:{' '.join(p.cmdline())[:100]}")
            except psutil.Error:
                described.append(str(p.pid))
            try:
                p.kill()
            except psutil.Error:
                pass
        raise AssertionError(f"processes left behind: {described}")


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@click.command("hello")
@click.option("--name", default="world")
def hello_command(name: str) -> int:
    """A subcommand for dispatch tests."""
    click.echo(f"hello {name}")
    return 0
