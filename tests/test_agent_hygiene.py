"""What a killed or twice-interrupted agent leaves behind: nothing (``launcher.node.reaper``).

Real launcher processes, real workers and their own children, real signals, a real embedded etcd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from launch_harness import SCRIPTS, Launcher, base_env, pid_alive, sleeper_agent
from _wait import wait_for

from launcher.node import reaper

pytestmark = pytest.mark.multiproc


def _pids(pids_dir, ranks: int, per_rank: int) -> list[int]:
    wait_for(lambda: len(list(pids_dir.glob("*.pids"))) == ranks, 60, "the workers' pids")
    pids = [int(p) for f in pids_dir.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == ranks * per_rank and all(pid_alive(p) for p in pids)
    return pids


def test_a_sigkilled_agent_takes_its_workers_children_and_its_etcd_directory_along(tmp_path,
                                                                                     marker):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    launcher, pids_dir = sleeper_agent(tmp_path, marker, 2, "--standalone", SPAWN_CHILD="1",
                                       TMPDIR=str(tmp))
    pids = _pids(pids_dir, 2, 2)  # each worker and the child it started
    assert list(tmp.glob("hspmd-etcd-agent-*"))  # the embedded etcd's, while it runs
    launcher.proc.send_signal(signal.SIGKILL)
    assert launcher.wait(10) == -signal.SIGKILL
    wait_for(lambda: not [p for p in pids if pid_alive(p)], 20,
             "every worker and every worker's child to die with the agent")
    wait_for(lambda: not list(tmp.glob("hspmd-etcd-*")), 20,
             "the embedded etcd's data directory to be removed")


def test_the_next_agent_sweeps_directories_of_dead_agents_only(tmp_path, marker):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    owners = {"hspmd-etcd-agent-dead": {"pid": dead.pid, "create_time": 1.0},
              "hspmd-etcd-agent-live": {"pid": os.getpid(),
                                        "create_time": __import__("psutil").Process()
                                        .create_time()},
              "hspmd-etcd-agent-unowned": None}
    for name, owner in owners.items():
        (tmp / name).mkdir()
        (tmp / name / "member").write_text("data")
        if owner is not None:
            (tmp / name / reaper.OWNER_FILE).write_text(json.dumps(owner))
    env = base_env(marker, PID_DIR=str(tmp_path), EXIT_NOW="1", TMPDIR=str(tmp))
    launcher = Launcher(["--standalone", "--nproc-per-node", "1", str(SCRIPTS / "sleeper.py")],
                        env, tmp_path)
    assert launcher.wait(60) == 0, launcher.stderr()
    left = sorted(p.name for p in tmp.iterdir())
    assert left == ["hspmd-etcd-agent-live", "hspmd-etcd-agent-unowned"], left


def test_a_second_ctrl_c_kills_workers_that_ignore_the_first(tmp_path, marker):
    launcher, pids_dir = sleeper_agent(tmp_path, marker, 2, "--standalone", "--shutdown-timeout",
                                       "300", IGNORE_TERM="1", IGNORE_INT="1")
    pids = _pids(pids_dir, 2, 1)
    launcher.proc.send_signal(signal.SIGINT)
    wait_for(lambda: "stopping 2 worker(s)" in launcher.stderr(), 30,
             "the agent to forward the first interrupt", proc=launcher.proc)
    assert all(pid_alive(p) for p in pids)  # they ignore it: the grace of 300 s runs
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(60) == 1, launcher.stderr()  # far within the 300 s grace
    assert not [p for p in pids if pid_alive(p)]
    assert "SIGKILL" in launcher.stderr()
