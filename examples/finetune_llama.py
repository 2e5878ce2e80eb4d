"""Fine-tune a Hugging Face-format Llama checkpoint on a token file, with live elasticity.

Under ``hspmd-launch`` every worker slot runs this script; give the agents the same checkpoint
directory and sequence length, so the leader plans for exactly the model the workers train:

    hspmd-launch --nnodes 1:4 --nproc-per-node 2 --rdzv-backend etcd \\
        --rdzv-endpoint etcd-host:2379 --rdzv-id ft1 \\
        --hspmd-elastic --hspmd-model /shared/llama --hspmd-seq-len 512 \\
        --hspmd-global-batch 8 \\
        examples/finetune_llama.py --model /shared/llama --seq-len 512 --global-batch 8 \\
        --data /shared/tokens/train.bin --data-dtype uint16 --steps 1000 --lr 1e-5 \\
        --checkpoint-dir /shared/ft-ckpt --checkpoint-every 100 --export /shared/llama-ft

``--model DIR`` is a Llama/Mistral checkpoint in Hugging Face format (``config.json`` with
``model.safetensors`` or a sharded index): ``hf.config_from_hf`` turns its config into the
``ModelConfig`` trained here (unsupported fields are refused in one line), and the job's first
switch starts every rank from its own slices of the weights (``runtime.run(init_from=DIR)``: a
rank reads only the byte ranges it holds under the plan). From then on the state lives in the
workers: a worker that dies or a node that joins makes the survivors switch to a new plan in the
same processes, parameters and AdamW state moving by fused BSR, and step ``s`` still trains on
global samples ``[s*B, (s+1)*B)`` of ``--data`` (docs/data.md), so the result is the fault-free
one. With ``--checkpoint-dir`` the workers also write sharded checkpoints; a complete one there
wins over ``--model`` when the job starts again (a resumed fine-tune continues from it).

``--export DIR`` writes the trained model back in Hugging Face format (``hf.export_hf``:
``config.json`` with the source's other fields, ``model.safetensors`` in ``--export-dtype``),
which ``transformers`` loads. At the end every rank of the final plan writes its parameter
slices to ``DIR.parts/`` and rank 0 assembles and writes them, so ``DIR`` must be on a file
system every node sees (as ``--checkpoint-dir``); a ``DIR`` that is not empty is refused before
training. Bad arguments and bad files are one line naming the bad value, exit code 2. ``main``
is wrapped in torch's ``@record``: an uncaught error is written to the agent's error file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Callable, Optional

from torch.distributed.elastic.multiprocessing.errors import record

from hspmd_elastic.data import DTYPES, DataError, token_sampler
from hspmd_elastic.elastic.api import ConfigurationError
from hspmd_elastic.graph.config import ModelConfig, ModelConfigError
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.hf.config import STORAGE_DTYPES
from hspmd_elastic.runtime import RunResult, RuntimeTimeouts, StepInfo, run

log = logging.getLogger("finetune_llama")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face checkpoint directory (the agents' --hspmd-model)")
    parser.add_argument("--data", required=True,
                        help="token file or directory of *.bin shards (docs/data.md)")
    parser.add_argument("--data-dtype", choices=sorted(DTYPES),
                        help="token dtype of --data (default: its sidecar's)")
    parser.add_argument("--seq-len", type=int, required=True,
                        help="training sequence length (the agents' --hspmd-seq-len)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=8,
                        help="rows per step (the agents' --hspmd-global-batch)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--weight-decay", type=float, default=AdamWConfig.weight_decay)
    parser.add_argument("--seed", type=int, default=0, help="keys the order of the samples")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--export", help="directory for the trained model in Hugging Face format")
    parser.add_argument("--export-dtype", choices=STORAGE_DTYPES,
                        help="dtype of the exported weights (default: the training dtype)")
    parser.add_argument("--export-timeout", type=float, default=600.0,
                        help="seconds rank 0 waits for the other ranks' slices")
    return parser.parse_args(argv)


@record
def main(argv: Optional[list[str]] = None,
         on_step: Optional[Callable[[StepInfo], None]] = None) -> int:
    """Run the fine-tune; ``on_step`` (for tests) is called after every step, after logging."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    prog = os.path.basename(sys.argv[0]) or "finetune_llama.py"
    try:
        config, sample = prepare(args)
    except (ModelConfigError, DataError, ConfigurationError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    def step_hook(info: StepInfo) -> None:
        if info.rank == 0 and info.step % 10 == 0:
            log.info("step %d loss %.4f (plan v%d)", info.step, info.loss, info.plan_version)
        if on_step is not None:
            on_step(info)

    def on_switch(timings) -> None:
        log.info("switched to plan v%d from %s, resuming at step %d: %s", timings.to_version,
                 timings.source, timings.resume_step, timings.numeric())

    try:
        result = run(config, sample=sample, global_batch=args.global_batch, steps=args.steps,
                     optim=AdamWConfig(lr=args.lr, weight_decay=args.weight_decay),
                     seed=args.seed, checkpoint_dir=args.checkpoint_dir,
                     checkpoint_every=args.checkpoint_every, timeouts=RuntimeTimeouts(),
                     on_step=step_hook, on_switch=on_switch, init_from=args.model)
    except (DataError, ConfigurationError) as exc:  # a bad id in a row read, a bad plan
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    log.info("%s after %d steps (plan v%d, rank %d of %d, %d switches)", result.state.value,
             result.steps_done, result.plan_version, result.rank, result.world_size,
             len(result.switches))
    if args.export and result.final_state:
        from hspmd_elastic.hf import HFCheckpointError

        try:
            export_final(args.export, config, result, like=args.model, dtype=args.export_dtype,
                         timeout_s=args.export_timeout)
        except (HFCheckpointError, OSError, TimeoutError) as exc:
            print(f"{prog}: error: export to {args.export} failed: {exc}", file=sys.stderr)
            return 1
    return 0


def prepare(args: argparse.Namespace):
    """The config of ``--model`` at ``--seq-len`` and the sampler of ``--data``; every argument
    checked before training (a bad one raises, one line)."""
    from hspmd_elastic.hf import config_from_hf

    for flag, value, least in (("--seq-len", args.seq_len, 1), ("--steps", args.steps, 0),
                               ("--global-batch", args.global_batch, 1)):
        if value < least:
            raise ConfigurationError(f"{flag} {value} must be >= {least}")
    config = config_from_hf(args.model, seq_len=args.seq_len)
    if args.export and os.path.isdir(args.export) and os.listdir(args.export):
        raise ConfigurationError(f"--export {args.export} is not empty; export to a new or "
                                 "empty directory")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ConfigurationError("--checkpoint-every needs --checkpoint-dir")
    # checks the files, the dtype and that one sample fits; ids are checked as rows are read
    return config, token_sampler(config, args.data, args.data_dtype, seed=args.seed)


def export_final(out_dir: str, config: ModelConfig, result: RunResult, *, like: str,
                 dtype: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Every rank of the final plan writes its parameter slices (safetensors, the index ranges
    in the metadata) to ``out_dir.parts/``; rank 0 waits for all of them, writes ``out_dir``
    with ``hf.export_hf`` and removes the parts."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hspmd_elastic.files import atomic_path
    from hspmd_elastic.hf import export_hf

    parts = out_dir.rstrip("/") + ".parts"
    os.makedirs(parts, exist_ok=True)
    job = os.environ.get("HSPMD_JOB_ID", "job")
    name = lambda rank: os.path.join(  # noqa: E731
        parts, f"{job}-v{result.plan_version}-rank{rank}.safetensors")
    mine = name(result.rank)
    with atomic_path(mine) as tmp:  # temporary file, fsync, rename: rank 0 never reads half
        save_file({n: t.contiguous() for n, (_r, t) in result.final_state.items()}, tmp,
                  metadata={n: json.dumps(r) for n, (r, _t) in result.final_state.items()})
    if result.rank != 0:
        return
    files = [name(r) for r in range(result.world_size)]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(f) for f in files):
        if time.monotonic() >= deadline:
            missing = [f for f in files if not os.path.exists(f)]
            raise TimeoutError(f"{len(missing)} rank(s) wrote no slices within {timeout_s:g}s "
                               f"(first: {missing[0]})")
        time.sleep(0.1)
    pieces = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            ranges = f.metadata()
            pieces.append({n: (tuple(map(tuple, json.loads(ranges[n]))), f.get_tensor(n))
                           for n in f.keys()})
    written = export_hf(out_dir, config, pieces, dtype=dtype, like=like)
    shutil.rmtree(parts, ignore_errors=True)
    log.info("exported the trained model to %s (%s)", out_dir,
             ", ".join(os.path.basename(w) for w in written))


if __name__ == "__main__":
    raise SystemExit(main())
