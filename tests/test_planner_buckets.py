"""Length buckets with their own plans: parsing, rows per bucket, the plans, the single-plan
baseline and its gain, and ``hspmd-launch plan --lengths``."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.planner import (LengthBucket, PlanInfeasibleError, PlannerError, bucket_rows,
                                   inventory_from_nodes, parse_lengths, plan_buckets, plan_for,
                                   preset)
from hspmd_elastic.planner.buckets import MAX_BUCKETS, profile_at
from hspmd_elastic.planner.profiles import profile_from_config
from launcher.plan_cmd import plan_command

pytestmark = pytest.mark.timeout(120)

MIXED = "512:0.9,8192:0.1"


def _layout(plan) -> tuple:
    return tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines)


# ---- parsing ----------------------------------------------------------------------------------

def test_parse_lengths_gives_the_buckets_shortest_first():
    assert parse_lengths(MIXED) == (LengthBucket(512, 0.9), LengthBucket(8192, 0.1))
    assert parse_lengths(" 128 : 0.3, 1024:0.3 ,4096:0.4") == (
        LengthBucket(128, 0.3), LengthBucket(1024, 0.3), LengthBucket(4096, 0.4))
    assert parse_lengths("2048:1") == (LengthBucket(2048, 1.0),)


@pytest.mark.parametrize("text,needle", [
    ("8192:0.1,512:0.9", "'512:0.9': length 512 is below the previous bucket's 8192"),
    ("512:0.5,512:0.5", "'512:0.5': length 512 appears twice"),
    ("512:0,8192:1", "'512:0': share 0.0 must be in (0, 1]"),
    ("512:-0.1,8192:1.1", "'512:-0.1': share -0.1"),
    ("512:x,8192:0.1", "share 'x' is not a number"),
    ("5k:0.9,8192:0.1", "length '5k' is not a positive integer"),
    ("0:0.5,8:0.5", "length 0 must be an integer in 1.."),
    ("512,8192:0.1", "'512': expected LEN:SHARE"),
    ("512:0.5,8192:0.4", "the shares sum to 0.9, not 1"),
    ("512:9,8192:1", "'512:9': share 9.0 must be in (0, 1]"),
    ("512:nan,8192:1", "share nan"),
    ("", "are empty"),
    (f"{2**24 + 1}:1", f"length {2**24 + 1} must be an integer"),
    (",".join(f"{i + 1}:{1 / (MAX_BUCKETS + 1)}" for i in range(MAX_BUCKETS + 1)),
     f"at most {MAX_BUCKETS}"),
])
def test_bad_lengths_are_one_line_errors_naming_the_item(text, needle):
    with pytest.raises(PlannerError) as info:
        parse_lengths(text)
    message = str(info.value)
    assert needle in message and "\n" not in message


# ---- rows per bucket --------------------------------------------------------------------------

def test_rows_follow_the_shares_by_largest_remainders():
    assert bucket_rows([0.9, 0.1], 64) == (58, 6)  # 57.6 and 6.4
    assert bucket_rows([0.9, 0.1], 128) == (115, 13)  # 115.2 and 12.8
    assert bucket_rows([0.5, 0.5], 3) == (2, 1)  # a tie goes to the shorter bucket
    assert bucket_rows([0.999, 0.001], 10) == (9, 1)  # the rare long bucket still gets a row
    with pytest.raises(PlannerError, match="global_batch=1 is below the 2 length buckets"):
        bucket_rows([0.5, 0.5], 1)


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(min_value=1, max_value=1000), min_size=1,
                        max_size=MAX_BUCKETS),
       extra=st.integers(min_value=0, max_value=5000))
def test_rows_sum_to_the_global_batch_and_every_bucket_gets_one(weights, extra):
    shares = [w / sum(weights) for w in weights]
    batch = len(shares) + extra
    rows = bucket_rows(shares, batch)
    assert sum(rows) == batch
    assert len(rows) == len(shares) and min(rows) >= 1
    if all(s * batch >= 1 for s in shares):
        assert all(math.floor(s * batch + 1e-9) <= r <= math.ceil(s * batch - 1e-9)
                   for s, r in zip(shares, rows))


# ---- the plans --------------------------------------------------------------------------------

def test_attention_makes_a_sequence_cost_quadratic_in_its_length():
    base = preset("llama-7b")
    short, long = profile_at(base, 512), profile_at(base, 8192)
    assert (short.seq_len, long.seq_len) == (512, 8192)
    attention = long.layer_flops_per_token - short.layer_flops_per_token
    assert attention == pytest.approx(4.0 * (8192 - 512) * base.hidden_size)


def test_a_config_profile_is_rebuilt_at_the_bucket_length():
    config = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, ffn_size=64,
                         seq_len=16, dtype="float64")
    profile = profile_from_config(config, "tiny")
    longer = profile_at(profile, 64)
    assert longer.config.seq_len == 64 and longer.name == "tiny"
    # eager attention keeps a score row per token: its memory per token grows with the length
    assert longer.activation_bytes_per_token_layer > profile.activation_bytes_per_token_layer


def test_short_buckets_get_more_data_parallelism_and_the_gain_is_above_one():
    inventory, profile = inventory_from_nodes("8xH800"), preset("llama-7b")
    result = plan_buckets(inventory, profile, 128, MIXED)
    short, long = result.buckets
    assert (short.rows, long.rows) == (115, 13)
    assert len(short.plan.pipelines) > len(long.plan.pipelines)
    assert max(s.tp for p in long.plan.pipelines for s in p.stages) > 1
    for bp in result.buckets:  # each bucket's plan is the planner's at its length and rows
        assert bp.plan.global_batch == bp.rows
        assert bp.plan == plan_for(inventory, profile_at(profile, bp.bucket.max_len),
                                   bp.rows).plan
    single = result.single
    assert len({_layout(p) for p in single.plans}) == 1  # one layout for every bucket
    assert [p.global_batch for p in single.plans] == [115, 13]
    assert result.single_step_time_s == pytest.approx(sum(e.step_time_s
                                                          for e in single.estimates))
    assert result.bucketed_step_time_s == pytest.approx(short.estimate.step_time_s
                                                        + long.estimate.step_time_s)
    assert result.gain > 1.0
    assert result.gain == pytest.approx(result.single_step_time_s / result.bucketed_step_time_s)


def test_switch_cost_is_added_per_bucket_change():
    inventory, profile = inventory_from_nodes("8xH800"), preset("llama-7b")
    free = plan_buckets(inventory, profile, 128, MIXED)
    costly = plan_buckets(inventory, profile, 128, MIXED, switch_cost_s=0.25)
    assert free.switches == costly.switches == 2  # short -> long, and back for the next step
    assert costly.bucketed_step_time_s == pytest.approx(free.bucketed_step_time_s + 0.5)
    assert costly.gain < free.gain
    with pytest.raises(PlannerError, match="switch_cost_s=-1"):
        plan_buckets(inventory, profile, 128, MIXED, switch_cost_s=-1)


def test_one_bucket_is_the_plain_plan_with_gain_one():
    inventory, profile = inventory_from_nodes("8xH800,8xH20"), preset("llama-7b")
    result = plan_buckets(inventory, profile, 64, [LengthBucket(profile.seq_len, 1.0)])
    expected = plan_for(inventory, profile, 64).plan
    assert result.buckets[0].plan == expected
    assert result.single.plans == (expected,)
    assert result.switches == 0
    assert result.gain == 1.0


def test_a_bucket_nothing_fits_is_named():
    with pytest.raises(PlanInfeasibleError, match=r"length bucket 1048576 \(1 row\)"):
        plan_buckets(inventory_from_nodes("8xH800"), preset("llama-7b"), 16,
                     "512:0.95,1048576:0.05")


# ---- hspmd-launch plan --lengths --------------------------------------------------------------

def _run(*args: str):
    return CliRunner().invoke(plan_command, list(args))


def test_cli_prints_each_bucket_plan_and_the_gain():
    res = _run("--devices", "8xH800", "--model", "llama-7b", "--global-batch", "128",
               "--lengths", MIXED)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "Bucket <= 512 tokens (90% of sequences): 115 rows" in out
    assert "Bucket <= 8192 tokens (10% of sequences): 13 rows" in out
    assert out.count("DP4: ") >= 1 and "memory up to" in out
    assert "Best single plan that fits the longest bucket" in out
    assert "Estimated gain of the bucket plans:" in out
    # what a job's leader would publish: the home plan and each bucket's plan in the step
    assert "In an elastic job with --hspmd-lengths (the model at 8192 tokens): home plan" in out
    assert "<= 512 tokens, rows 0+115: the home layout, no switch" in out
    assert "<= 8192 tokens, rows 115+13: its own plan, switched in the step" in out


def test_cli_json_has_the_bucket_plans_and_the_gain():
    res = _run("--devices", "8xH800", "--global-batch", "128", "--lengths", MIXED, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [b["max_len"] for b in data["buckets"]] == [512, 8192]
    assert [b["rows"] for b in data["buckets"]] == [115, 13]
    assert all(b["chosen"]["plan"]["global_batch"] == b["rows"] for b in data["buckets"])
    assert data["gain"] > 1.0
    assert data["gain"] == pytest.approx(data["single_step_time_s"]
                                         / data["bucketed_step_time_s"])
    in_step = data["in_step"]
    assert in_step["seq_len"] == 8192 and [b["rows"] for b in in_step["buckets"]] == [115, 13]
    assert [b["start"] for b in in_step["buckets"]] == [0, 115]
    for b in in_step["buckets"]:  # its own plan only where it pays for the switch
        assert (not b["own"]) or b["home_s"] is None or b["step_s"] + b["switch_s"] < b["home_s"]


@pytest.mark.parametrize("args,needle", [
    (("--lengths", "8192:0.1,512:0.9"), "'512:0.9'"),
    (("--lengths", "512:0,8192:1"), "'512:0'"),
    (("--lengths", "512:x,8192:0.1"), "'x'"),
    (("--lengths", "512:0.5,8192:0.4"), "sum to 0.9"),
    (("--lengths", "512:0.5,8192:0.5", "--global-batch", "1"), "global_batch=1"),
])
def test_cli_bad_lengths_are_one_line_usage_errors(args, needle):
    res = _run("--devices", "8xH800", *args)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in res.output
