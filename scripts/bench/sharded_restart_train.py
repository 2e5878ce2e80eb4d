"""The sharded restart baseline of ``scripts/bench_recovery`` (mode D): a torchrun-style script
(restart mode, no elastic runtime) that trains the decoder sharded as the planner shards it on
devices of ``--device-memory``, and checkpoints by shard.

The plan is ``planner.plan_for`` on ``WORLD_SIZE`` CPU devices of that memory (what the elastic
leader would publish for them); each rank builds its specialized graph
(``graph.specialize.SpecializedModel``) with the same initial weights as every other mode, trains
the same synthetic global batches, and after every step saves only its own state (its shard of
the parameters and AdamW moments, ``state_tensors``) to ``<checkpoint>.<rank>.s<step % 2>.pt``
(temporary file, fsync, rename). A (re)started rank reads only its own shard back, of the
newest step every rank saved. A timeline
(``scripts/bench/timeline.py``) records ``spawned``, ``start``, ``imported``, ``pg``, ``built``,
``loaded`` (checkpoint step and the bytes this rank read), every ``step`` and ``saved``.
"""

from __future__ import annotations

import time

T0 = time.time()

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timeline import read_config, training_start  # noqa: E402


def plan_for_world(config, world: int, memory: str, global_batch: int):
    """The planner's plan for ``world`` CPU devices of ``memory`` each, on one node."""
    import json

    from hspmd_elastic.planner import (Device, Health, Inventory, PlannerOptions, parse_bytes,
                                       plan_for, profile_from_dict, spec_for_device)

    spec = spec_for_device("CPU", parse_bytes(memory))
    inventory = Inventory(tuple(Device(r, "node0", spec, Health.HEALTHY) for r in range(world)))
    profile = profile_from_dict(json.loads(config.to_json()))
    return plan_for(inventory, profile, global_batch,
                    options=PlannerOptions(use_all_devices=True)).plan


def shard_paths(prefix: str, rank: int) -> list[str]:
    """This rank's two shard files: step ``s`` goes to the one of ``s % 2``, so the shard of
    the step before survives a kill in the middle of a save."""
    return [f"{prefix}.{rank}.s{k}.pt" for k in (0, 1)]


def load_shard(model, prefix: str, rank: int) -> tuple[int, int]:
    """(step, bytes read) of the newest step every rank holds a shard of ((0, 0): none). Ranks
    step together, so their newest saved steps differ by one at most; they agree on the
    smallest (an all-reduce) and each reads only its own shard of it."""
    import torch
    import torch.distributed as dist

    saved = {}
    for path in shard_paths(prefix, rank):
        if os.path.exists(path):
            saved[int(torch.load(path, weights_only=True)["step"])] = path
    newest = torch.tensor([max(saved, default=0)])
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest.item())
    if step == 0:
        return 0, 0
    if step not in saved:
        raise SystemExit(f"rank {rank}: no shard of step {step} (have {sorted(saved)})")
    model.load_state_tensors(torch.load(saved[step], weights_only=True)["state"])
    return step, os.path.getsize(saved[step])


def save_shard(model, prefix: str, rank: int, step: int) -> None:
    import torch

    from hspmd_elastic.files import atomic_path

    with atomic_path(shard_paths(prefix, rank)[step % 2]) as tmp:
        torch.save({"state": {n: t for n, (t, _a) in model.state_tensors().items()},
                    "step": step}, tmp)


def main() -> int:
    def more(ap) -> None:
        ap.add_argument("--device-memory", required=True)
        ap.add_argument("--checkpoint", required=True, help="prefix: <prefix>.<rank>.s<0|1>.pt")

    args, tl = training_start(__doc__, T0, more)

    import torch
    import torch.distributed as dist

    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler

    tl.mark("imported")
    torch.set_num_threads(1)
    config = read_config(args.config)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tl.mark("pg", rank=rank, world=world)
    plan = plan_for_world(config, world, args.device_memory, args.global_batch)
    model = SpecializedModel.build(config, plan, rank, seed=args.seed)
    tl.mark("built")
    start, nbytes = load_shard(model, args.checkpoint, rank)
    if nbytes:
        tl.mark("loaded", step=start, bytes=nbytes)
    sample = synthetic_sampler(config, args.data_seed)
    for step in range(start, args.steps):
        loss = model.step(global_batch_at(sample, step, args.global_batch))
        tl.mark("step", step=step, loss=loss)
        save_shard(model, args.checkpoint, rank, step + 1)
        tl.mark("saved", step=step + 1)
    dist.barrier()
    dist.destroy_process_group()
    tl.mark("end")
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    raise SystemExit(record(main)())
