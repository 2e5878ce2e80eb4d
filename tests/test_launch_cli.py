"""hspmd-launch's pure parts and its answers to bad input.

Flag parsing (torchrun's spellings, defaults and PET_ variables), rank assignment and round
closing decisions, the failure summary (compared with torch's own formatter), the agent's state
table, and one-line errors with a non-zero exit for bad input.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import click
import pytest

from launch_harness import SCRIPTS, assert_no_leftovers, base_env, new_marker, run_launch  # noqa: E402

from launcher import cli  # noqa: E402
from launcher.api import ConfigError  # noqa: E402
from launcher.node.restart.mode import TRANSITIONS, RestartState  # noqa: E402
from launcher.node.restart.rendezvous import (  # noqa: E402
    Participant,
    RoundInfo,
    assign_ranks,
    order_participants,
    should_close,
)
from launcher.standalone import free_ports  # noqa: E402
from launcher.summary import WorkerFailure, format_summary  # noqa: E402

SCRIPT = str(SCRIPTS / "sleeper.py")


def parse(args: list[str]):
    ctx = cli.launch_command.make_context("hspmd-launch", list(args))
    return ctx.params, cli.build_config(ctx.params)


# ------------------------------------------------------------------------------- flag parsing
def test_torchrun_defaults():
    params, cfg = parse([SCRIPT])
    assert cfg.rdzv.min_nodes == cfg.rdzv.max_nodes == 1
    assert cfg.nproc_per_node == 1 and cfg.max_restarts == 0
    assert cfg.monitor_interval_s == 0.1 and cfg.role == "default"
    assert params["rdzv_backend"] == "static" and params["start_method"] == "spawn"
    assert cfg.rdzv.standalone  # single node, no endpoint: standalone, like torchrun
    assert cfg.rdzv.join_timeout_s == 600 and cfg.rdzv.last_call_timeout_s == 30
    assert cfg.shutdown_timeout_s == 30
    assert cfg.entrypoint == (sys.executable, "-u", SCRIPT)
    assert cfg.entrypoint_name == SCRIPT


def test_dashes_underscores_equals_and_script_args():
    _, cfg = parse(["--nproc_per_node=3", "--max-restarts", "2", "--rdzv_conf",
                    "join_timeout=5,last_call_timeout=0.5", "--nnodes=1:2",
                    "--rdzv-backend", "etcd", "--rdzv_endpoint", "127.0.0.1:2379",
                    "--rdzv-id", "job-7", SCRIPT, "--lr", "0.1", "--nproc-per-node", "9"])
    assert cfg.nproc_per_node == 3 and cfg.max_restarts == 2
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (1, 2)
    assert cfg.rdzv.join_timeout_s == 5 and cfg.rdzv.last_call_timeout_s == 0.5
    assert cfg.rdzv.endpoints == ("127.0.0.1:2379",) and cfg.rdzv.run_id == "job-7"
    assert not cfg.rdzv.standalone
    assert cfg.entrypoint[-4:] == ("--lr", "0.1", "--nproc-per-node", "9")


def test_pet_environment_variables(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_TEE", "3")
    monkeypatch.setenv("PET_HSPMD_NODE_ID", "n-1")
    _, cfg = parse([SCRIPT])
    assert cfg.nproc_per_node == 2 and cfg.max_restarts == 4 and cfg.rdzv.standalone
    assert cfg.logs.tee_default == 3 and cfg.node_id == "n-1"
    _, cfg = parse(["--nproc-per-node", "1", SCRIPT])  # the command line wins
    assert cfg.nproc_per_node == 1


def test_module_no_python_and_macro():
    _, cfg = parse(["-m", "json.tool", "--indent", "2"])
    assert cfg.entrypoint == (sys.executable, "-u", "-m", "json.tool", "--indent", "2")
    _, cfg = parse(["--no-python", "true", "x"])
    assert cfg.entrypoint == ("true", "x")
    with pytest.raises(ConfigError, match="--no-python and --module"):
        parse(["--no-python", "-m", "true"])


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "2:1"], "--nnodes value '2:1'"),
    (["--nnodes", "x"], "--nnodes value 'x'"),
    (["--nproc-per-node", "banana"], "'banana'"),
    (["--nproc-per-node", "0"], "must be >= 1"),
    (["--redirects", "7"], "--redirects value '7'"),
    (["--local-ranks-filter", "a,b"], "--local-ranks-filter"),
    (["--rdzv-backend", "zookeeper"], "'zookeeper'"),
    (["--rdzv-backend", "etcd"], "needs --rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "nohost"], "'nohost'"),
    (["--rdzv-conf", "join_timeout=soon"], "join_timeout='soon'"),
    (["--rdzv-conf", "colour=blue"], "'colour'"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "a b"],
     "--rdzv-id value 'a b'"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0"], "'h:0'"),
    (["--hspmd-health-source", "magic"], "'magic'"),
])
def test_bad_values_name_the_value(args, needle):
    with pytest.raises(ConfigError) as err:
        parse([*args, SCRIPT])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_script_is_a_config_error():
    with pytest.raises(ConfigError, match="does not exist"):
        parse(["/nonexistent/train.py"])


def test_subcommand_dispatch(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "hello", "launch_harness:hello_command")
    monkeypatch.setitem(cli.SUBCOMMANDS, "later", "launcher.not_written_yet:command")
    assert cli.main(["hello", "--name", "x"]) == 0
    assert capsys.readouterr().out == "hello x\n"
    assert cli.main(["later"]) == 2  # reserved name, module not installed: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "subcommand 'later'" in err[0] and "-- later" in err[0]
    # `--` makes it a script name; an existing file named like a subcommand is a script too.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--", "hello"]) == 2
    assert "training script 'hello' does not exist" in capsys.readouterr().err
    (tmp_path / "hello").write_text("print('script')\n")
    launched = []
    fake = click.Command("fake", params=[click.Argument(["args"], nargs=-1)],
                         callback=lambda args: launched.append(args) or 0)
    monkeypatch.setattr(cli, "launch_command", fake)
    assert cli.main(["hello", "--", "--name"]) == 0 and launched == [("hello", "--name")]


# --------------------------------------------------------------------------- pure decisions
def _p(node, lws=2, rank=None, rev=0):
    return Participant(node=node, host="h", local_world_size=lws, node_rank=rank,
                       create_revision=rev)


def test_ranks_are_consecutive_per_node_in_node_order():
    parts = (_p("a", 2), _p("b", 3), _p("c", 1))
    got = {n: assign_ranks(parts, n) for n in "abc"}
    assert [got[n].base_global_rank for n in "abc"] == [0, 2, 5]
    assert all(g.world_size == 6 and g.group_world_size == 3 for g in got.values())
    assert [got[n].group_rank for n in "abc"] == [0, 1, 2]
    assert got["b"].global_rank(2) == 4 and got["b"].role_rank(2) == 4


def test_node_order_join_order_then_node_rank():
    joined = [_p("late", rev=9), _p("early", rev=3), _p("ranked", rank=0, rev=12)]
    assert [p.node for p in order_participants(joined, 3)] == ["ranked", "early", "late"]
    assert [p.node for p in order_participants(joined, 2)] == ["ranked", "early"]


def test_round_closing_rule():
    assert should_close(3, 1, 3, None, 0.0, 30.0)  # max reached: at once
    assert not should_close(1, 2, 3, 0.0, 100.0, 30.0)  # below min: never
    assert not should_close(2, 2, 3, 10.0, 20.0, 30.0)  # min reached, last call running
    assert should_close(2, 2, 3, 10.0, 40.0, 30.0)


def test_agent_state_table():
    assert RestartState.RUNNING in TRANSITIONS[RestartState.RENDEZVOUS]
    assert RestartState.RENDEZVOUS in TRANSITIONS[RestartState.RESTARTING]
    assert not TRANSITIONS[RestartState.SUCCEEDED]
    assert RestartState.SUCCEEDED not in TRANSITIONS[RestartState.RUNNING]
    assert all(RestartState.INTERRUPTED in v for k, v in TRANSITIONS.items() if v)


def test_worker_env_is_torchruns():
    from launcher.node.env import worker_env

    _, cfg = parse(["--nproc-per-node", "2", "--max-restarts", "3", SCRIPT])
    parts = (_p("a", 2), _p("b", 2))
    info = RoundInfo(round=4, restart_count=1, participants=parts,
                     assignment=assign_ranks(parts, "b"))
    env = worker_env({"OMP_NUM_THREADS": "1"}, cfg, info, 1, ("hostx", 1234), "/e.json",
                     ("127.0.0.1:1",))
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_RANK",
                                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "hostx", "MASTER_PORT": "1234"}
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/e.json" and env["HSPMD_ROUND"] == "4"


# ---------------------------------------------------------------------------- failure summary
def test_summary_matches_torch_formatter(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom"
    f1 = tmp_path / "e1.json"
    f1.write_text(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": tb, "timestamp": "1700000000"}}}))
    f2 = tmp_path / "e2.json"
    f2.write_text(json.dumps({"message": "plain failure", "timestamp": 1700000009}))
    ours = [WorkerFailure(local_rank=1, global_rank=3, pid=11, exitcode=1, error_file=str(f1)),
            WorkerFailure(local_rank=0, global_rank=2, pid=10, exitcode=2, error_file=str(f2))]
    theirs = ChildFailedError("train.py", {  # torch lists failures in local rank order
        2: ProcessFailure(local_rank=0, pid=10, exitcode=2, error_file=str(f2)),
        3: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(f1)),
    })
    assert format_summary("train.py", ours, socket.getfqdn()) == theirs.format_msg()


def test_summary_for_a_signal_without_error_file():
    f = WorkerFailure(local_rank=0, global_rank=0, pid=42, exitcode=-9, error_file="/nope.json",
                      observed_at=time.time())
    text = format_summary("t.py", [f], "host")
    assert "exitcode  : -9 (pid: 42)  (SIGKILL)" in text
    assert "error_file: <N/A>" in text and "Signal 9 (SIGKILL) received by PID 42" in text
    assert "t.py FAILED" in text and "<NO_OTHER_FAILURES>" in text


# --------------------------------------------------------------------- bad input, end to end
@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "2:1", SCRIPT], "'2:1'"),
    (["--nproc-per-node", "banana", SCRIPT], "'banana'"),
    (["/nonexistent/train.py"], "/nonexistent/train.py"),
    (["--bogus-flag", SCRIPT], "--bogus-flag"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "j",
      SCRIPT], "cannot reach etcd"),
])
def test_bad_input_one_line_nonzero_exit(tmp_path, args, needle):
    marker = new_marker()
    port = free_ports(1)[0]
    args = [a.replace("{port}", str(port)) for a in args]
    start = time.monotonic()
    code, out, err = run_launch(args, base_env(marker), tmp_path, timeout=30)
    elapsed = time.monotonic() - start
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and elapsed < 20
    assert "Traceback" not in err
    errors = [ln for ln in lines if ln.startswith("hspmd-launch: error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert_no_leftovers(marker)


def test_torchrun_backends_map_onto_etcd():
    # one node: static and c10d need no shared store -> embedded etcd (standalone)
    _, cfg = parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400",
                    "--rdzv-id", "100", SCRIPT])
    assert cfg.rdzv.standalone and cfg.rdzv.run_id == "100"  # c10d keeps the user's id
    _, cfg = parse(["--rdzv-id", "100", SCRIPT])
    assert cfg.rdzv.standalone and cfg.rdzv.run_id != "100"  # torchrun: fresh id
    # several nodes: the endpoint is the etcd the nodes meet at
    for backend in ("etcd", "etcd-v2", "c10d"):
        _, cfg = parse(["--nnodes", "1:4", "--rdzv-backend", backend, "--rdzv-endpoint",
                        "http://10.0.0.1:2379,10.0.0.2:2379", "--rdzv-id", "j1", SCRIPT])
        assert not cfg.rdzv.standalone and cfg.rdzv.backend == backend
        assert cfg.rdzv.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    _, cfg = parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
                    "--hspmd-etcd-endpoints", "e1:2379", SCRIPT])
    assert cfg.rdzv.endpoints == ("e1:2379",) and not cfg.rdzv.host_etcd
    # c10d and static on several nodes: one node serves the store (an etcd) at the endpoint
    _, cfg = parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", SCRIPT])
    assert cfg.rdzv.endpoints == ("h:29400",) and cfg.rdzv.host_etcd
    _, cfg = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1",
                    "--master-port", "1234", SCRIPT])
    assert cfg.rdzv.endpoints == ("10.1.1.1:1234",) and not cfg.rdzv.host_etcd
    assert cfg.rdzv.node_rank == 1 and cfg.master_addr == "10.1.1.1" and cfg.master_port is None
    _, cfg = parse(["--nnodes", "2", SCRIPT])  # torchrun's defaults: 127.0.0.1:29500, rank 0
    assert cfg.rdzv.endpoints == ("127.0.0.1:29500",) and cfg.rdzv.host_etcd
    _, cfg = parse(["--master-addr", "127.0.0.2", "--master-port", "1234", SCRIPT])
    assert cfg.rdzv.standalone and (cfg.master_addr, cfg.master_port) == ("127.0.0.2", 1234)
