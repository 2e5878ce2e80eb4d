"""Bad input to hspmd-launch is one line and exit 2, never a traceback, never a silent default.

* every numeric flag, ``--rdzv-conf`` key and numeric environment variable is finite and in its
  range (``launcher.numbers``): ``nan``, ``inf``, 0 where 0 is no value, and values past the
  caps are refused naming the setting and the value;
* a ``--log-dir`` that cannot be created and a ``--no-python`` program that cannot be executed
  are refused before anything starts;
* flags that would silently ignore each other (``--standalone`` with
  ``--hspmd-etcd-endpoints``, ``--run-path`` with ``-m``/``--no-python``) are refused;
* ``hspmd-launch plan`` caps its inventory (``--devices``) and takes a node by position
  (``--fail 0:3``) as well as by name (``node0:3``);
* on a machine without a GPU, device verdicts speak of devices (worker slots), not GPUs.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys

import click
import pytest

from launch_harness import LAUNCH, SCRIPTS, assert_no_leftovers, base_env, new_marker, run_launch

from hspmd_elastic.contract.env import PLAN_VERSION_ENV, ROUND_ENV, EnvError, WorkerEnv
from launcher import cli
from launcher.api import ConfigError

SCRIPT = str(SCRIPTS / "sleeper.py")


def refusal(args: list[str]) -> str:
    """The one-line refusal ``args`` get from the real CLI's parse and validation."""
    ctx = None
    try:
        ctx = cli.launch_command.make_context("hspmd-launch", [*args, SCRIPT])
        cli.build_config(ctx.params)
    except click.ClickException as exc:
        return exc.format_message()
    except ConfigError as exc:
        return str(exc)
    pytest.fail(f"{args} was accepted")


# --------------------------------------------------------------------------- numeric settings
@pytest.mark.parametrize("args, named", [
    (["--hspmd-lease-ttl", "nan"], "--hspmd-lease-ttl"),
    (["--hspmd-lease-ttl", "inf"], "--hspmd-lease-ttl"),
    (["--hspmd-lease-ttl", "0.5"], "--hspmd-lease-ttl"),
    (["--hspmd-lease-ttl", "1e9"], "--hspmd-lease-ttl"),
    (["--hspmd-etcd-outage-limit", "nan"], "--hspmd-etcd-outage-limit"),
    (["--hspmd-etcd-outage-limit", "inf"], "--hspmd-etcd-outage-limit"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--monitor-interval", "nan"], "--monitor-interval"),
    (["--monitor-interval", "inf"], "--monitor-interval"),
    (["--monitor-interval", "0"], "--monitor-interval"),
    (["--rdzv-conf", "lease_ttl=0"], "lease_ttl='0'"),
    (["--rdzv-conf", "lease_ttl=nan"], "lease_ttl='nan'"),
    (["--rdzv-conf", "join_timeout=inf"], "join_timeout='inf'"),
    (["--rdzv-conf", "join_timeout=0"], "join_timeout='0'"),
    (["--rdzv-conf", "last_call_timeout=nan"], "last_call_timeout='nan'"),
    (["--rdzv-conf", "close_timeout=-inf"], "close_timeout='-inf'"),
    (["--rdzv-conf", "exit_barrier_timeout=1e999"], "exit_barrier_timeout='1e999'"),
    (["--hspmd-debounce", "nan"], "--hspmd-debounce"),
    (["--hspmd-seq-len", "0"], "--hspmd-seq-len"),
    (["--hspmd-elastic", "--hspmd-model", "llama-7b", "--hspmd-global-batch", "99999999999"],
     "--hspmd-global-batch"),
])
def test_numeric_settings_are_finite_and_in_range(args, named):
    line = refusal(args)
    value = args[-1].partition("=")[2] or args[-1]
    assert named in line and value in line and "\n" not in line, line


@pytest.mark.parametrize("args, field, value", [
    (["--hspmd-lease-ttl", "1"], "lease_ttl_s", 1.0),
    (["--hspmd-lease-ttl", "3600"], "lease_ttl_s", 3600.0),
    (["--rdzv-conf", "last_call_timeout=0,exit_barrier_timeout=0"], "last_call_timeout_s", 0.0),
    (["--rdzv-conf", "lease_ttl=2.5"], "lease_ttl_s", 2.5),
    (["--hspmd-etcd-outage-limit", "86400"], "etcd_outage_limit_s", 86400.0),
])
def test_the_range_bounds_are_accepted(args, field, value):
    ctx = cli.launch_command.make_context("hspmd-launch", [*args, SCRIPT])
    assert getattr(cli.build_config(ctx.params).rdzv, field) == value


def test_environment_numbers_are_checked_too(monkeypatch):
    monkeypatch.setenv("PET_HSPMD_LEASE_TTL", "nan")  # a flag's PET_ variable: its range
    assert "'nan'" in refusal([])
    monkeypatch.delenv("PET_HSPMD_LEASE_TTL")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "nan")  # torchrun's default
    assert refusal([]).startswith("invalid TORCH_ELASTIC_SHUTDOWN_TIMEOUT: 'nan'")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    ctx = cli.launch_command.make_context("hspmd-launch", [SCRIPT])
    assert cli.build_config(ctx.params).shutdown_timeout_s == 7.0
    for var in (ROUND_ENV, PLAN_VERSION_ENV):  # the worker environment's counts: int64
        with pytest.raises(EnvError, match=var):
            WorkerEnv.from_env({var: str(2**64)})
    assert WorkerEnv.from_env({ROUND_ENV: str(2**63 - 1)}).round == 2**63 - 1


def test_number_range_rule():
    from hspmd_elastic.contract.env import NumberRange

    seconds = NumberRange(1.0, 60.0, unit="seconds")
    assert seconds.parse(" 2.5 ") == 2.5 and seconds.parse(60) == 60.0
    for bad in ("nan", "inf", "-inf", "0.99", "61", "x", "", True, float("nan")):
        with pytest.raises(ValueError, match="is not a number of seconds from 1 to 60"):
            seconds.parse(bad)
    count = NumberRange(0, 10, lo_open=True, integer=True)
    assert count.parse("3") == 3 and count.parse(4.0) == 4
    for bad in ("0", "2.5", "1e1", "11", 10**400):
        with pytest.raises(ValueError, match="is not an integer > 0 and <= 10"):
            count.parse(bad)


def test_nan_lease_ttl_end_to_end_is_one_line(tmp_path):
    """The issue's reproduction: a traceback before; one line and exit 2 now."""
    marker = new_marker()
    for args in (["--hspmd-lease-ttl", "nan"], ["--rdzv-conf", "lease_ttl=0"]):
        code, _, err = run_launch([*args, SCRIPT], base_env(marker), tmp_path, timeout=60)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and "Traceback" not in err, err
        assert len(lines) == 1 and lines[0].startswith("hspmd-launch: error: "), err
    assert_no_leftovers(marker)


# ------------------------------------------------------------------------ paths and programs
def test_log_dir_that_cannot_be_created_is_one_line(tmp_path):
    marker = new_marker()
    afile = tmp_path / "afile"
    afile.write_text("")
    for where, needle in (("/proc/nope", "cannot be created"),
                          (str(afile / "sub"), "cannot be created"),
                          (str(afile), "is a file")):
        code, _, err = run_launch(["--log-dir", where, SCRIPT], base_env(marker), tmp_path,
                                  timeout=60)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and "Traceback" not in err, err
        assert len(lines) == 1 and where in lines[0] and needle in lines[0], err
    assert_no_leftovers(marker)


def test_no_python_program_that_cannot_run_is_one_line(tmp_path):
    marker = new_marker()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # not executable
    code, out, err = run_launch(["--no-python", str(script)], base_env(marker), tmp_path,
                                timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err + out, err
    assert len(lines) == 1 and "is not executable" in lines[0] and str(script) in lines[0], err
    assert_no_leftovers(marker)
    assert "not on PATH" in refusal(["--no-python", "no-such-program-here"])


# ------------------------------------------------------------------------------ conflicts
@pytest.mark.parametrize("args, needle", [
    (["--standalone", "--hspmd-etcd-endpoints", "127.0.0.1:2379"],
     "--standalone runs its own embedded etcd: --hspmd-etcd-endpoints '127.0.0.1:2379'"),
    (["--hspmd-etcd-endpoints", "127.0.0.1:2379"],
     "--hspmd-etcd-endpoints '127.0.0.1:2379' would be ignored"),
    (["--run-path", "-m"], "--run-path and --module cannot be used together"),
    (["--run-path", "--no-python"], "--run-path and --no-python cannot be used together"),
])
def test_conflicting_flags_are_refused(args, needle):
    assert needle in refusal(args)


# ----------------------------------------------------------------------------- plan command
def _plan(args: list[str], limit_bytes: int = 2 << 30) -> subprocess.CompletedProcess:
    """``hspmd-launch plan`` with its address space capped, so that an inventory that grows
    without bound fails this test instead of the machine."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([LAUNCH, "plan", *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap)


def test_plan_inventory_is_capped(tmp_path):
    inventory = tmp_path / "inv.json"
    inventory.write_text(json.dumps({"nodes": "8xH800,1000000000xH800"}))
    for spec in ("1000000000xH800", "8xH800,65529xH20", str(inventory)):
        out = _plan(["--devices", spec])
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert len(lines) == 1 and "the most a plan can ask about is 65536" in lines[0], lines


def test_plan_takes_a_node_by_position_or_by_name():
    by_position = _plan(["--devices", "8xH800,8xH800", "--fail", "0:3,1:0"])
    by_name = _plan(["--devices", "8xH800,8xH800", "--fail", "node0:3,node1:0"])
    assert by_position.returncode == 0, by_position.stderr
    assert by_position.stdout == by_name.stdout and "(2 failed: 3,8)" in by_name.stdout
    out = _plan(["--devices", "8xH800,8xH800", "--fail", "2:0"])
    assert out.returncode == 2 and "positions 0..1" in out.stderr


@pytest.mark.parametrize("args", [["--global-batch", "nan"], ["--alternatives", "1000"]])
def test_plan_numbers_are_in_range(args):
    ctx_args = ["--devices", "8xH800", *args]
    from launcher.plan_cmd import plan_command

    with pytest.raises(click.BadParameter, match=args[1]):
        plan_command.make_context("plan", ctx_args)


# ------------------------------------------------------------------------- device wording
def test_cpu_slots_are_devices_not_gpus(client, caplog):
    from launcher.health.api import Verdict
    from launcher.health.verdicts import VerdictPublisher

    caplog.set_level(logging.INFO, logger="launcher.health.verdicts")
    VerdictPublisher(client, "job1", "node-a").publish({0: Verdict.healthy(),
                                                        1: Verdict.healthy()})
    said = [r.getMessage() for r in caplog.records]
    assert "node node-a device 0: healthy" in said and "node node-a device 1: healthy" in said
    assert not [m for m in said if "GPU" in m], said


# ------------------------------------------------------------------------------ M28 leftovers
def test_the_dashboard_labels_slots_by_their_kind_not_as_gpus():
    from launcher.ops.page import PAGE

    assert '"GPU " + g.index' not in PAGE
    assert '(g.type || "device") + " " + g.index' in PAGE


def test_elastic_llama_outside_the_launcher_is_one_line(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "elastic_llama.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSPMD_", "LOCAL_RANK"))}
    out = subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic_llama.py: error: it must run under "
                                                   "hspmd-launch --hspmd-elastic"), lines


def test_a_plan_made_for_one_seq_len_refuses_a_model_of_another():
    import dataclasses

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.plan import Plan, PlanError, simple_plan

    config = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_layers=4,
                         ffn_size=256, seq_len=64)
    plan = simple_plan(dp=2, num_layers=4, global_batch=8)
    plan.check_model(dataclasses.replace(config, seq_len=32))  # not said: not checked
    made = plan.at_seq_len(64)
    assert made == plan and Plan.from_dict(made.to_dict()).seq_len == 64
    assert "seq_len" not in plan.to_dict() and made.relabel({0: 1, 1: 0}).seq_len == 64
    made.check_model(config)
    with pytest.raises(PlanError, match="plan was made for seq_len=64, model has seq_len=32"):
        made.check_model(dataclasses.replace(config, seq_len=32))
    with pytest.raises(PlanError, match="seq_len=0 must be a positive integer"):
        plan.at_seq_len(0)
