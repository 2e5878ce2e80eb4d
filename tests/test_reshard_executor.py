"""Executor behaviour that needs no peer: rebinding, local copies, input checks, plan cache."""

from __future__ import annotations

import pytest
import torch

from hspmd_elastic.annotations import TensorAnnotation as T
from hspmd_elastic.reshard import ReshardPlanError, TensorSpec, fused_bsr_schedule
from hspmd_elastic.reshard.executor import execute_fused


def test_unmoved_shard_is_rebound_and_moved_part_is_copied_locally():
    keep = TensorSpec("keep", (4, 6), torch.float32, T.single_group([0], {}), T.single_group([0], {}))
    dp2, tp2 = T.single_group([0, 1], {-1: 2}), T.single_group([0, 1], {1: 2})
    shrink = TensorSpec("shrink", (4, 6), torch.int64, dp2, tp2)
    assert shrink.dtype == "int64"
    schedule = fused_bsr_schedule([keep, shrink], {0, 1}, {})
    assert schedule.transfers == ()
    old = {"keep": torch.rand(4, 6), "shrink": torch.arange(24).reshape(4, 6)}
    new, stats = execute_fused(schedule, 0, old, "cpu", timeout_s=5)
    assert new["keep"] is old["keep"]
    assert new["shrink"].equal(old["shrink"][:, :3])
    assert stats.bytes_copied_locally == 4 * 3 * 8 and stats.messages == 0


def test_wrong_local_shard_is_refused_by_name():
    spec = TensorSpec("w", (4, 6), "float32", T.single_group([0], {}), T.single_group([0, 1], {0: 2}))
    schedule = fused_bsr_schedule([spec], {0}, {})
    with pytest.raises(ReshardPlanError, match=r"'w' needs its old local shard of shape \(4, 6\), got \(2, 6\)"):
        execute_fused(schedule, 0, {"w": torch.zeros(2, 6)}, "cpu", timeout_s=5)
    with pytest.raises(ReshardPlanError, match="planned float32"):
        execute_fused(schedule, 0, {"w": torch.zeros(4, 6, dtype=torch.float64)}, "cpu", timeout_s=5)


def test_plans_are_cached_by_their_inputs():
    spec = TensorSpec("w", (8,), "float32", T.single_group([0, 1], {0: 2}), T.single_group([0, 1, 2], {-1: 3}))
    first = fused_bsr_schedule([spec], {0, 1}, {0: "a", 1: "a", 2: "b"})
    assert fused_bsr_schedule([spec], [1, 0], {2: "b", 1: "a", 0: "a"}) is first
