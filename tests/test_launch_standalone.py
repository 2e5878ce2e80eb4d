"""hspmd-launch on one node (embedded etcd): worker environment, restarts, failure summary,
signals, logs. Real launcher processes, real workers over gloo, real signals.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from launch_harness import (
    SCRIPTS,
    Launcher,
    base_env,
    pid_alive,
    read_json_files,
    run_launch,
    sleeper_agent,
)
from _wait import wait_for

pytestmark = pytest.mark.multiproc


def test_env_dump_matches_torchrun(tmp_path, marker):
    dump = tmp_path / "dump"
    dump.mkdir()
    env = base_env(marker, DUMP_DIR=str(dump))
    env.pop("OMP_NUM_THREADS")  # the launcher sets 1 for nproc > 1, like torchrun
    code, out, err = run_launch(["--standalone", "--nproc-per-node", "3",
                                 str(SCRIPTS / "env_dump.py")], env, tmp_path, timeout=90)
    assert code == 0, err
    dumps = read_json_files(dump, "round*_rank*.json")
    assert sorted(dumps) == [f"round0_rank{r}.json" for r in range(3)]
    run_ids, ports = set(), set()
    for rank in range(3):
        d = dumps[f"round0_rank{rank}.json"]
        e = d["env"]
        assert d["launched"] is True and d["all_reduce"] == 3.0
        assert (d["pg_rank"], d["pg_world"]) == (rank, 3)
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1"
        assert e["ROLE_NAME"] == "default" and e["MASTER_ADDR"] == "localhost"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and e["OMP_NUM_THREADS"] == "1"
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
        assert e["HSPMD_JOB_ID"] == e["TORCHELASTIC_RUN_ID"] and e["HSPMD_ETCD_ENDPOINTS"]
        run_ids.add(e["TORCHELASTIC_RUN_ID"])
        ports.add(e["MASTER_PORT"])
    assert len(run_ids) == 1 and len(ports) == 1
    assert "Setting OMP_NUM_THREADS" in err


def test_ddp_survives_a_killed_worker_with_one_restart(tmp_path, marker):
    pause = tmp_path / "pause.pid"
    snapshot = tmp_path / "snapshot.pt"
    env = base_env(marker, PAUSE_AT_EPOCH="2", PAUSE_RANK="1", PAUSE_FILE=str(pause))
    launcher = Launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                         "--shutdown-timeout", "5", str(SCRIPTS / "ddp_snapshot.py"), "4", "1",
                         "--snapshot_path", str(snapshot)], env, tmp_path)
    pid = int(wait_for(lambda: pause.exists() and pause.read_text(), 90, "the pause file",
                       proc=launcher.proc))
    os.kill(pid, signal.SIGKILL)
    code = launcher.wait(120)
    out, err = launcher.stdout(), launcher.stderr()
    assert code == 0, err
    assert "Resuming training from snapshot at Epoch 2" in out
    assert "Epoch 4 | Training snapshot saved" in out
    assert "restart 1/1" in err and "Root Cause" not in err


def test_failure_without_restarts_prints_summary(tmp_path, marker):
    log_dir = tmp_path / "logs"
    env = base_env(marker, FAIL_RANK="1")
    code, out, err = run_launch(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                 "--shutdown-timeout", "5", "--log-dir", str(log_dir),
                                 str(SCRIPTS / "fail_record.py")], env, tmp_path, timeout=90)
    assert code == 1
    script = str(SCRIPTS / "fail_record.py")
    assert f"{script} FAILED" in err
    assert "Failures:" in err and "<NO_OTHER_FAILURES>" in err
    root = err.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : 1" in root
    error_files = list(log_dir.glob("*/attempt_0/1/error.json"))
    assert len(error_files) == 1 and f"error_file: {error_files[0]}" in root
    assert "ValueError: boom from rank 1" in root and "in crunch" in root  # the traceback
    # the worker prints its own traceback (as under torchrun); the launcher prints none
    assert not [name for name in ("launcher/node/", "launcher/cli.py") if name in err]


def test_sigterm_stops_every_worker_within_the_grace(tmp_path, marker):
    launcher, pids_dir = sleeper_agent(tmp_path, marker, 2, "--standalone", "--shutdown-timeout",
                                       "2", IGNORE_TERM="1", SPAWN_CHILD="1")
    wait_for(lambda: len(list(pids_dir.glob("*.pids"))) == 2, 60, "both workers' pids",
             proc=launcher.proc)
    pids = [int(p) for f in pids_dir.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4 and all(pid_alive(p) for p in pids)
    start = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    code = launcher.wait(30)
    elapsed = time.monotonic() - start
    assert code == 1
    assert elapsed < 15  # grace 2 s, then SIGKILL
    assert not [p for p in pids if pid_alive(p)]
    err = launcher.stderr()
    assert "received SIGTERM" in err and "got signal: 15" in err
    assert "SIGKILL" in err  # the workers ignored SIGTERM


def test_sigint_is_forwarded_and_workers_exit(tmp_path, marker):
    launcher, pids_dir = sleeper_agent(tmp_path, marker, 2)
    wait_for(lambda: len(list(pids_dir.glob("*.pids"))) == 2, 60, "both workers' pids",
             proc=launcher.proc)
    pids = [int(f.read_text()) for f in pids_dir.glob("*.pids")]
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(30) == 1
    assert not [p for p in pids if pid_alive(p)]
    assert "SIGKILL" not in launcher.stderr()  # SIGINT ended them within the grace


def test_tee_redirects_and_log_dir_layout(tmp_path, marker):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    log_dir = tmp_path / "logs"
    env = base_env(marker, PID_DIR=str(pids_dir), EXIT_NOW="1")
    code, out, err = run_launch(
        ["--standalone", "--nproc-per-node", "2", "--tee", "1", "--redirects", "0:2",
         "--local-ranks-filter", "0", "--log-dir", str(log_dir), str(SCRIPTS / "sleeper.py")],
        env, tmp_path, timeout=60)
    assert code == 0, err
    assert "[default0]:hello from rank 0" in out
    assert "hello from rank 1" not in out  # filtered from the console, still in its file
    assert "err line from rank 1" not in err and "err line from rank 0" not in err
    (run_dir,) = list(log_dir.iterdir())
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "hello from rank 0\n"
    assert (attempt / "1" / "stdout.log").read_text() == "hello from rank 1\n"
    assert (attempt / "0" / "stderr.log").read_text() == "err line from rank 0\n"
    assert not (attempt / "1" / "stderr.log").exists()


def test_sigkilled_agent_leaves_no_worker_and_no_etcd(tmp_path, marker):
    launcher, pids_dir = sleeper_agent(tmp_path, marker, 2, "--standalone")
    wait_for(lambda: len(list(pids_dir.glob("*.pids"))) == 2, 60, "both workers' pids",
             proc=launcher.proc)
    launcher.proc.kill()
    launcher.wait(10)
    # the marker fixture fails the test if a worker or the embedded etcd outlived the agent


@pytest.mark.parametrize("mode", ["module", "run-path", "no-python"])
def test_module_run_path_and_no_python(tmp_path, marker, mode):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = base_env(marker, PID_DIR=str(pids_dir), EXIT_NOW="1", PYTHONPATH=str(SCRIPTS))
    if mode == "module":
        target = ["-m", "sleeper"]
    elif mode == "run-path":
        target = ["--run-path", str(SCRIPTS / "sleeper.py")]
    else:
        wrapper = tmp_path / "run.sh"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPTS / 'sleeper.py'} \"$@\"\n")
        wrapper.chmod(0o755)
        target = ["--no-python", str(wrapper)]
    code, out, err = run_launch(["--nproc-per-node", "2", *target], env, tmp_path, timeout=60)
    assert code == 0, err
    assert sorted(p.name for p in pids_dir.glob("*.pids")) == ["0.pids", "1.pids"]
    assert "hello from rank 0" in out and "hello from rank 1" in out
