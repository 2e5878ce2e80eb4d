"""The torchrun-style side of ``scripts/bench_recovery``: a plain DDP script (nothing
hspmd-specific in its training path) over a dense copy of the same decoder.

The model is ``hspmd_elastic.graph.reference`` (the dense semantics every plan reproduces) with
the same initial weights (``full_params(config, seed)``), the same synthetic global batches (a
copy of ``runtime.synthetic_sampler``/``global_batch_at``, split evenly over ranks), and
``torch.optim.AdamW`` with the runtime's AdamW settings. Like torchrun users do, rank 0 saves the
full parameters and optimizer state with ``torch.save`` after every step (atomically:
temporary file, fsync, rename, as the elastic side's checkpoints), and
every rank loads the newest checkpoint when (re)started. A timeline
(``scripts/bench/timeline.py``) records ``spawned``, ``start``, ``imported``, ``pg`` (process
group ready), ``built`` (model and optimizer constructed), ``loaded`` (checkpoint step), every
``step`` and ``saved``.
"""

from __future__ import annotations

import time

T0 = time.time()

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timeline import read_config, training_start  # noqa: E402


def synthetic_sampler(config, seed: int):
    """Row ``i`` of the synthetic data set: the same tokens as ``runtime.synthetic_sampler``
    (copied, so that this script imports nothing of the elastic runtime)."""
    import torch

    def sample(index: int):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randint(0, config.vocab_size, (config.seq_len + 1,), generator=gen)

    return sample


def global_batch_at(sample, step: int, global_batch: int):
    import torch

    return torch.stack([sample(step * global_batch + i) for i in range(global_batch)])


def main() -> int:
    args, tl = training_start(__doc__, T0,
                              lambda ap: ap.add_argument("--checkpoint", required=True))

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hspmd_elastic.files import atomic_path
    from hspmd_elastic.graph.init import full_params
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.graph.reference import reference_loss

    tl.mark("imported")
    config = read_config(args.config)

    class DenseLlama(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            full = full_params(config, args.seed)
            self.names = list(full)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(full[n]) for n in self.names)

        def forward(self, batch):
            return reference_loss(dict(zip(self.names, self.weights)), batch, config)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tl.mark("pg", rank=rank, world=world)
    if args.global_batch % world:
        raise SystemExit(f"world size {world} must divide the global batch {args.global_batch}")
    model = DenseLlama()
    cfg = AdamWConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    tl.mark("built")
    start = 0
    if os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
        tl.mark("loaded", step=start, bytes=os.path.getsize(args.checkpoint))
    ddp = DDP(model)
    sample = synthetic_sampler(config, args.data_seed)
    per = args.global_batch // world
    for step in range(start, args.steps):
        rows = global_batch_at(sample, step, args.global_batch)[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = ddp(rows)
        loss.backward()  # DDP averages gradients: the mean over the global batch
        opt.step()
        tl.mark("step", step=step, loss=loss.item())
        if rank == 0:
            # temporary file, fsync, rename: a kill mid-write never leaves a torn checkpoint
            with atomic_path(args.checkpoint) as tmp:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, tmp)
            tl.mark("saved", step=step + 1)
    dist.barrier()
    dist.destroy_process_group()
    tl.mark("end")
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    raise SystemExit(record(main)())
