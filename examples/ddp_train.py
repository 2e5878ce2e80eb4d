"""A plain torchrun-style DDP training script (nothing hspmd-specific in it).

Written the way the public PyTorch DDP tutorials write fault-tolerant jobs: it reads torchrun's
environment, snapshots model + optimizer + step to disk every few steps, and resumes from the
snapshot when (re)started. Every step trains on a fixed global batch of synthetic samples chosen by
global sample index, split evenly across ranks, so the result is the same whatever the world size
and however often the job restarts.

    hspmd-launch --standalone --nproc-per-node 3 --max-restarts 1 examples/ddp_train.py \
        --steps 40 --snapshot /tmp/snap.pt --out /tmp/final.pt
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

GLOBAL_BATCH = 12
IN, HIDDEN, OUT = 8, 16, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    ).double()


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` of an endless synthetic dataset (deterministic, no files)."""
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(IN, generator=g, dtype=torch.float64)
    y = torch.randn(OUT, generator=g, dtype=torch.float64)
    return x, y


def global_batch(step: int) -> list[int]:
    return list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))


def train_step(model, opt, step: int, rank: int, world: int) -> float:
    ids = global_batch(step)
    per_rank = len(ids) // world
    mine = ids[rank * per_rank:(rank + 1) * per_rank]
    xs, ys = zip(*(sample(i) for i in mine))
    x, y = torch.stack(xs), torch.stack(ys)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP averages gradients over ranks: the mean over the global batch
    opt.step()
    return loss.item()


def save_atomic(path: str, obj) -> None:
    """``torch.save`` to a fresh temporary file beside ``path``, fsync, rename over ``path``,
    fsync the folder: a kill or a power loss never leaves a torn or empty file (what the
    project's ``hspmd_elastic/files.py`` does, in plain Python: this script needs nothing hspmd)."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass  # a folder that cannot be fsynced: the rename is still atomic


def save_snapshot(path: str, model, opt, step: int) -> None:
    save_atomic(path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--snapshot", default="")
    ap.add_argument("--snapshot-every", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--progress-dir", default="", help="write <dir>/rank<R> with the last step done")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="pause per step (demo pacing)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} must divide the global batch {GLOBAL_BATCH}")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["opt"])
        start = snap["step"]
        print(f"rank {rank}: resumed from snapshot at step {start}", flush=True)
    ddp = DDP(model)
    for step in range(start, args.steps):
        loss = train_step(ddp, opt, step, rank, world)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
        if args.snapshot and rank == 0 and (step + 1) % args.snapshot_every == 0:
            save_snapshot(args.snapshot, model, opt, step + 1)
        if args.progress_dir:
            with open(os.path.join(args.progress_dir, f"rank{rank}"), "w") as f:
                json.dump({"step": step + 1, "pid": os.getpid(),
                           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}, f)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    dist.barrier()
    if rank == 0 and args.out:
        save_atomic(args.out, {"model": model.state_dict(), "steps": args.steps})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
