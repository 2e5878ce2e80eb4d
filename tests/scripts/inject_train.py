"""A small data-parallel training job for the fault-injection tests (CPU, gloo, float64).

Step ``s`` trains on samples ``[s*B, (s+1)*B)`` of a fixed synthetic data set whatever the
world size (each rank takes every WORLD_SIZE-th row of the global batch, gradients are summed
over ranks), so a run that restarts, loses or gains nodes computes what a fault-free run
computes (up to float summation order). Rank 0 saves a snapshot (model, optimizer, steps done)
after every step; a restarted round resumes from it. Every rank appends one JSON line per
completed step to ``<progress_dir>/rank<r>.jsonl``: ``rank``, ``round`` (HSPMD_ROUND), ``step``
(steps completed), ``t`` (wall clock), ``batch`` (the global batch).

``reference_params(steps, batch)`` computes the fault-free result in one process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

FEATURES = 8
LR, MOMENTUM = 0.05, 0.9


def dataset(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(steps * batch, FEATURES, generator=g, dtype=torch.float64)
    w = torch.linspace(-1.0, 1.0, FEATURES, dtype=torch.float64)
    y = (x @ w + 0.1 * torch.rand(steps * batch, generator=g, dtype=torch.float64)).unsqueeze(1)
    return x, y


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train_step(model, opt, x, y, batch: int, rank: int, world: int) -> None:
    opt.zero_grad()
    xs, ys = x[rank::world], y[rank::world]
    loss = ((model(xs) - ys) ** 2).sum() / batch
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    opt.step()


def reference_params(steps: int, batch: int) -> dict[str, torch.Tensor]:
    x, y = dataset(steps, batch)
    model, opt = make_model()
    for s in range(steps):
        train_step(model, opt, x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch],
                   batch, 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--progress-dir", required=True)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rnd = int(os.environ.get("HSPMD_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    x, y = dataset(args.steps, args.batch)
    model, opt = make_model()
    start = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, map_location="cpu")
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["opt"])
        start = snap["step"]
    os.makedirs(args.progress_dir, exist_ok=True)
    progress = open(os.path.join(args.progress_dir, f"rank{rank}.jsonl"), "a")
    for s in range(start, args.steps):
        b = args.batch
        train_step(model, opt, x[s * b:(s + 1) * b], y[s * b:(s + 1) * b], b, rank, world)
        if rank == 0:
            tmp = args.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s + 1},
                       tmp)
            os.replace(tmp, args.snapshot)
        progress.write(json.dumps({"rank": rank, "round": rnd, "step": s + 1, "t": time.time(),
                                   "batch": b}) + "\n")
        progress.flush()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # pacing, so faults land mid-training
    progress.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
