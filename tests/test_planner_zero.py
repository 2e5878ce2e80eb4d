"""The cost model under uneven optimizer shards (``PlannerOptions.optimizer_shards``,
``planner.zero_cost``), ``hspmd-launch plan --optimizer-shards`` and the launcher's
``--hspmd-optimizer-shards`` checks.

With a slow device in DP given few rows, uneven shards predict a shorter update on it and less
optimizer memory (each by its pipeline's share of the rows, the rows approximation of
``graph.zero``'s rule), a plan short of memory when replicated fits when uneven, and replicated
mode predicts what it predicted before."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import click
import pytest
from click.testing import CliRunner

from launch_harness import SCRIPTS

from hspmd_elastic.plan import Pipeline, Plan, Stage
from hspmd_elastic.planner import (BUILTIN_SPECS, Device, Inventory, ModelProfile,
                                   PlanInfeasibleError, PlannerError, PlannerOptions,
                                   estimate_plan)
from hspmd_elastic.planner import cost
from hspmd_elastic.planner.zero_cost import pipeline_share, state_bytes
from launcher import cli
from launcher.api import ConfigError
from launcher.plan_cmd import plan_command

pytestmark = pytest.mark.timeout(120)

PROFILE = ModelProfile("small", num_layers=8, hidden_size=256, ffn_size=1024, num_heads=8,
                       vocab_size=1024, seq_len=128)
CPU = replace(BUILTIN_SPECS["CPU"], update_s_per_param=2e-7)
SLOW = 4.0  # device 1's slowdown
UNEVEN = PlannerOptions(optimizer_shards="uneven")
# DP over two devices: the fast one runs 6 of the 8 rows, the slow one 2
PLAN = Plan((Pipeline((Stage((0,), (0, 8)),), 3, 2), Pipeline((Stage((1,), (0, 8)),), 1, 2)),
            8, 8)


def inventory(spec=CPU) -> Inventory:
    return Inventory((Device(0, "n", spec), Device(1, "n", spec, slowdown=SLOW)))


def whole_update_s(slowdown: float) -> float:
    params = cost.stage_params(PROFILE, PROFILE.num_layers, True, True)
    return CPU.update_s_per_param * slowdown * params


def test_the_share_is_the_pipelines_rows_over_the_batch():
    assert [pipeline_share(PLAN, p, UNEVEN) for p in (0, 1)] == [0.75, 0.25]
    assert [pipeline_share(PLAN, p, PlannerOptions()) for p in (0, 1)] == [1.0, 1.0]
    # the plan's own mode counts too (an uneven plan read back from the leader)
    assert pipeline_share(PLAN.with_optimizer_shards("uneven"), 1, PlannerOptions()) == 0.25
    assert state_bytes(PROFILE) == PROFILE.state_bytes_per_param
    with pytest.raises(PlannerError, match="optimizer_shards='zero3'"):
        PlannerOptions(optimizer_shards="zero3")


def test_uneven_shortens_the_slow_devices_update():
    rep = estimate_plan(PLAN, inventory(), PROFILE)
    une = estimate_plan(PLAN, inventory(), PROFILE, UNEVEN)
    assert une.stage_times_s == rep.stage_times_s  # forward and backward do not change
    for pi, (share, slowdown) in enumerate(((0.75, 1.0), (0.25, SLOW))):
        saved = rep.pipeline_times_s[pi] - une.pipeline_times_s[pi]
        assert saved == pytest.approx(whole_update_s(slowdown) * (1 - share), rel=1e-9)
        assert saved > 0
    # the slow device updated 4x slower on all of it; now on a quarter: its pipeline gains most
    assert rep.pipeline_times_s[1] - une.pipeline_times_s[1] > \
        rep.pipeline_times_s[0] - une.pipeline_times_s[0]
    assert une.step_time_s < rep.step_time_s
    same = estimate_plan(PLAN.with_optimizer_shards("uneven"), inventory(), PROFILE)
    assert same.pipeline_times_s == une.pipeline_times_s


def test_uneven_keeps_less_optimizer_state():
    rep = estimate_plan(PLAN, inventory(), PROFILE)
    une = estimate_plan(PLAN, inventory(), PROFILE, UNEVEN)
    params = cost.stage_params(PROFILE, PROFILE.num_layers, True, True) \
        + PROFILE.num_layers * PROFILE.kv_replica_params(1)
    for dev, share in ((0, 0.75), (1, 0.25)):
        saved = rep.memory_bytes[dev] - une.memory_bytes[dev]
        assert saved == pytest.approx(params * PROFILE.optimizer_bytes * (1 - share), abs=2)
        assert saved > 0


def test_a_plan_short_of_memory_when_replicated_fits_when_uneven():
    une = estimate_plan(PLAN, inventory(), PROFILE, UNEVEN)
    rep = estimate_plan(PLAN, inventory(), PROFILE)
    # usable memory (90%) just above the uneven need, below the replicated need
    need = max(une.memory_bytes.values())
    assert need < min(rep.memory_bytes.values())
    small = replace(CPU, memory_bytes=math.ceil((need + 1024) / 0.9))
    with pytest.raises(PlanInfeasibleError, match="short by"):
        estimate_plan(PLAN, inventory(small), PROFILE)
    fits = estimate_plan(PLAN, inventory(small), PROFILE, UNEVEN)
    assert all(fits.memory_bytes[d] <= fits.memory_limit_bytes[d] for d in (0, 1))


def test_replicated_predicts_what_it_did_before():
    rep = estimate_plan(PLAN, inventory(), PROFILE)
    full = whole_update_s(SLOW)
    assert rep.pipeline_times_s[1] == pytest.approx(sum(rep.stage_times_s[1]) + full)
    assert cost.update_time(PROFILE, cost.group_shape([inventory().devices[1]], None, 0.9),
                            PROFILE.num_layers, True, True) == pytest.approx(full)
    assert rep.memory_bytes[1] == cost.stage_memory(PROFILE, 1, PROFILE.num_layers, True, True,
                                                    2, 1)


# ------------------------------------------------------------------ hspmd-launch plan
def test_plan_cli_takes_optimizer_shards():
    runner = CliRunner()
    args = ["--devices", "2xH100", "--model", "llama-7b", "--degrade", "1=4",
            "--global-batch", "16"]
    text = runner.invoke(plan_command, [*args, "--optimizer-shards", "uneven"])
    assert text.exit_code == 0, text.output
    assert "optimizer shards: uneven" in text.output
    doc = runner.invoke(plan_command, [*args, "--optimizer-shards", "uneven", "--json"])
    assert doc.exit_code == 0 and json.loads(doc.output)["optimizer_shards"] == "uneven"
    plain = runner.invoke(plan_command, args)
    assert plain.exit_code == 0 and "optimizer shards" not in plain.output
    bad = runner.invoke(plan_command, [*args, "--optimizer-shards", "zero3"])
    assert bad.exit_code == 2 and "'zero3'" in bad.output
    both = runner.invoke(plan_command, [*args, "--optimizer-shards", "uneven",
                                        "--lengths", "512:0.5,4096:0.5"])
    assert both.exit_code == 2 and "--lengths" in both.output, both.output


# ------------------------------------------------------------------ hspmd-launch checks
ELASTIC = ["--hspmd-elastic", "--hspmd-model", "llama-7b", "--hspmd-global-batch", "8"]


def settings_of(args: list[str]):
    ctx = cli.launch_command.make_context("hspmd-launch", [*args, str(SCRIPTS / "sleeper.py")])
    return cli.build_config(ctx.params).elastic


def refusal(args: list[str]) -> str:
    try:
        settings_of(args)
    except (click.ClickException, ConfigError) as exc:
        return exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
    pytest.fail(f"{args} was accepted")


def test_the_launcher_flag_reaches_the_settings():
    assert settings_of(ELASTIC).optimizer_shards == "replicated"
    assert settings_of([*ELASTIC, "--hspmd-optimizer-shards", "uneven"]).optimizer_shards == \
        "uneven"
    assert settings_of([*ELASTIC, "--hspmd_optimizer_shards", "Replicated"]).optimizer_shards \
        == "replicated"


@pytest.mark.parametrize("args, needle", [
    ([*ELASTIC, "--hspmd-optimizer-shards", "zero3"],
     "invalid --hspmd-optimizer-shards value 'zero3': use replicated or uneven"),
    ([*ELASTIC, "--hspmd-optimizer-shards", "uneven", "--hspmd-lengths", "512:0.5,4096:0.5"],
     "--hspmd-optimizer-shards uneven is not supported with --hspmd-lengths"),
])
def test_the_launcher_refuses_bad_values_in_one_line(args, needle):
    message = refusal(args)
    assert needle in message and "\n" not in message, message
