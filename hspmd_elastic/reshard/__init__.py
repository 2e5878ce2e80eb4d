"""Fused Batched-Send-Receive resharding: pure planner (``planner``) and torch executor.

``api`` holds the values and errors; import the executor explicitly (it imports torch):
``from hspmd_elastic.reshard.executor import execute_fused``.
"""

from hspmd_elastic.reshard.api import (
    BSRError,
    ExchangeStats,
    FusedSchedule,
    LinkStats,
    LocalCopies,
    Message,
    ReshardCommError,
    ReshardError,
    ReshardPlanError,
    ReshardTimeoutError,
    Schedule,
    TensorSpec,
    Transfer,
)
from hspmd_elastic.reshard.links import DEFAULT_LINKS, LinkModel, exchange_time
from hspmd_elastic.reshard.planner import clear_plan_cache, fused_bsr_schedule, plan_tensor

__all__ = [
    "BSRError",
    "DEFAULT_LINKS",
    "ExchangeStats",
    "FusedSchedule",
    "LinkModel",
    "LinkStats",
    "LocalCopies",
    "Message",
    "ReshardCommError",
    "ReshardError",
    "ReshardPlanError",
    "ReshardTimeoutError",
    "Schedule",
    "TensorSpec",
    "Transfer",
    "clear_plan_cache",
    "exchange_time",
    "fused_bsr_schedule",
    "plan_tensor",
]
