"""The planner: a cost model and a heterogeneous plan search over whatever devices survive.

``plan_for(inventory, profile, global_batch, current_plan=None, options=PlannerOptions())``
returns a ``PlanResult`` (chosen plan, estimate, ranked alternatives); ``estimate_plan`` scores
any ``Plan``; ``fallback_dp_plan`` is a plain data-parallel plan for callers that must have one
when the search fails. All are pure: no I/O, and the same inputs give the same answer.
"""

from hspmd_elastic.planner.api import (Candidate, Device, DeviceSpec, Estimate, Health, Inventory,
                                       ModelProfile, PlanInfeasibleError, PlannerError,
                                       PlannerOptions, PlanResult, RedundancyError, fmt_bytes,
                                       parse_bytes)
from hspmd_elastic.planner.buckets import (BucketPlan, BucketPlans, LengthBucket, SinglePlan,
                                           bucket_rows, parse_lengths, plan_buckets)
from hspmd_elastic.planner.cost import estimate_plan, switch_bytes
from hspmd_elastic.planner.devices import (BUILTIN_SPECS, cpu_inventory, device_types_from_dict,
                                           inventory_from_dict, inventory_from_nodes, lookup_spec,
                                           register_device_type, spec_for_device,
                                           uniform_inventory)
from hspmd_elastic.planner.explain import layout_line
from hspmd_elastic.planner.fallback import fallback_dp_plan
from hspmd_elastic.planner.profiles import PRESETS, preset, profile_from_config, profile_from_dict
from hspmd_elastic.planner.search import plan_for

__all__ = [
    "BUILTIN_SPECS", "BucketPlan", "BucketPlans", "Candidate", "Device", "DeviceSpec", "Estimate",
    "Health", "Inventory", "LengthBucket", "ModelProfile", "PRESETS", "PlanInfeasibleError",
    "PlanResult", "PlannerError", "PlannerOptions", "RedundancyError", "SinglePlan", "bucket_rows",
    "cpu_inventory", "device_types_from_dict", "estimate_plan", "fallback_dp_plan", "fmt_bytes",
    "inventory_from_dict",
    "inventory_from_nodes", "layout_line", "lookup_spec", "parse_bytes", "parse_lengths",
    "plan_buckets", "plan_for", "preset", "profile_from_config", "profile_from_dict",
    "register_device_type", "spec_for_device", "switch_bytes", "uniform_inventory",
]
