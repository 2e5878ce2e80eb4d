"""The planning options of ``hspmd-launch`` in elastic mode (``--hspmd-device-memory`` ...
``--hspmd-optimizer-shards``), one decorator for ``launcher.cli``; ``launcher.capacity`` parses
their values into ``ElasticSettings`` fields."""

from __future__ import annotations

from typing import Callable

from launcher.numbers import number


def planning_options(opt: Callable) -> Callable:
    """A decorator adding the elastic planning options, in help order; ``opt``: the CLI's
    option factory (``launcher.cli._opt``: dash and underscore spellings, ``PET_*``)."""
    options = [
        opt("--hspmd-device-memory", default=None, help="Elastic mode: memory of each device "
            "of this node as the planner sees it (24MiB, 1.5GiB): rehearse a cluster's layouts "
            "on CPUs."),
        opt("--hspmd-enforce-memory", is_flag=True, default=None, help="Elastic mode: limit "
            "each worker to --hspmd-device-memory plus its measured baseline (a memory cgroup); "
            "a plan that does not fit ends the job (the OOM killer's kill, reported as the "
            "plan's error)."),
        opt("--hspmd-device-speed", default=None, help="Elastic mode: speed of this node's "
            "devices relative to their type's nominal (default 1.0)."),
        opt("--hspmd-device", default=None, help="Elastic mode: where workers compute: auto "
            "(cuda:LOCAL_RANK when CUDA is available, else CPU; the default), cuda or cpu."),
        opt("--hspmd-redundancy", default=None, help="Elastic mode: every parameter slice on "
            "this many nodes, a hard constraint; the job fails when no plan keeps it (default: "
            "none)."),
        opt("--hspmd-planner", default=None, help="Elastic mode: hetero (the default: plans "
            "fitted to each device's speed and memory) or uniform (one TP/PP everywhere, even "
            "layers and rows)."),
        opt("--hspmd-all-devices", default=None, help="Elastic mode: on or off (the default): "
            "give every usable worker a role, even one the planner predicts costs the step more "
            "than it adds (left idle otherwise, and the leader's log says why), in the length "
            "buckets' plans too."),
        opt("--hspmd-optimizer-shards", default=None, help="Elastic mode: replicated (the "
            "default: every holder of a parameter keeps its AdamW moments and updates it) or "
            "uneven (ZeRO-1 style: each row's moments and update on one holder, each pipeline's "
            "share by its rows, so a slow device updates less; the planner plans for it). Not "
            "with --hspmd-lengths."),
        opt("--hspmd-device-types", default=None, help="Elastic mode: a JSON file of device-type "
            "constants measured on these machines, {NAME: {field: value}} (peak_tflops, mfu, "
            "microbatch_overhead_s, link_latency_s, update_s_per_param, intra_node_gbps, ...); "
            "a known type (CPU, H100) keeps the fields not given. The planner plans with them."),
        opt("--hspmd-straggler-replans", default=None, help="Elastic mode: on (the default) or "
            "off: replan when measured device speeds say a new plan gains more than the switch "
            "costs."),
        opt("--hspmd-straggler-dwell", type=number("--hspmd-straggler-dwell"), default=None,
            help="Elastic mode: seconds at least between two switches driven by measured speeds "
                 "(0..3600, default 30), so a noisy device does not flap."),
        opt("--hspmd-lengths", default=None, help="Elastic mode: length buckets LEN:SHARE,... "
            "(512:0.9,2048:0.1; the last LEN is the model's seq_len): each bucket's rows run "
            "under its own plan inside every step (the script groups its batches the same "
            "way)."),
    ]

    def apply(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply
