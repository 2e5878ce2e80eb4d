"""An hspmd-aware training script: a small Llama-style decoder trained with live elasticity.

Under ``hspmd-launch`` every worker slot runs this script. ``hspmd_elastic.runtime.run`` waits for
the leader's plan, builds this worker's part of the model (its pipeline stage and TP shard),
trains, and when a worker dies or a node joins it switches to the new plan in the same process:
parameters and AdamW state move by fused BSR, the interrupted step runs again. Step ``s`` always
trains on global samples ``[s*B, (s+1)*B)``, so the result does not depend on the failures.

    hspmd-launch --nnodes 1:4 --nproc-per-node 2 --rdzv-backend etcd \
        --rdzv-endpoint etcd-host:2379 --rdzv-id job42 \
        --hspmd-elastic --hspmd-model model.json --hspmd-global-batch 8 \
        examples/elastic_llama.py --config model.json --steps 200 --global-batch 8 \
        --data /shared/tokens/train.bin --data-dtype uint16 \
        --checkpoint-dir /shared/ckpt --checkpoint-every 50 --out /shared/final

``--config model.json`` is a ``ModelConfig`` JSON file (``ModelConfig.to_json()``), the same file
the agents get as ``--hspmd-model``, so the leader plans for exactly the model the workers train;
without it the model comes from ``--layers``/``--hidden``/``--heads``/``--seq-len``/``--vocab``.
``--global-batch`` must equal ``--hspmd-global-batch``.

With ``--checkpoint-dir`` the workers also write sharded checkpoints asynchronously; they are read
only when a switch finds state that no surviving worker holds (e.g. the only copy of a pipeline
stage died). ``--out DIR`` writes each worker's final parameter shards (``<device>.pt``).

The tokens are synthetic (row ``i`` depends on ``--seed`` and ``i``) unless ``--data PATH`` names
a flat token file or a directory of ``*.bin`` shards (docs/data.md): every worker gets the same
arguments, so every worker reads the same path (a shared or identical copy on each node), and
sample ``i`` is the same window of it under every plan. ``--data-dtype uint16|uint32`` gives the
token dtype when no sidecar (``PATH.json``, ``PATH/dataset.json``) does; ``--seed`` also keys the
order of the windows. A bad file is one line naming the bad value, exit code 2; so is a run
outside ``hspmd-launch --hspmd-elastic`` (no worker environment). ``main`` is wrapped in
torch's ``@record``: an uncaught error is written to the agent's error file, which its failure
summary and the script-error rule (two workers, the same error) read.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from hspmd_elastic.data import DTYPES, DataError, token_sampler
from hspmd_elastic.documents import DEFAULT_MODE, MODES
from hspmd_elastic.elastic.api import ConfigurationError, WorkerIdentity
from hspmd_elastic.files import atomic_path
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler


@record
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="ModelConfig JSON file (the one given to --hspmd-model); "
                        "overrides --layers/--hidden/--heads/--seq-len/--vocab")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="token file or directory of *.bin shards "
                        "(default: synthetic tokens)")
    parser.add_argument("--data-dtype", choices=sorted(DTYPES),
                        help="token dtype of --data (default: its sidecar's)")
    parser.add_argument("--documents", metavar="PATH",
                        help="documents of any length instead of fixed windows: a Megatron-LM "
                             "indexed dataset (PREFIX.idx/.bin) or a token file with its "
                             ".docs.npy offsets; docs/data.md")
    parser.add_argument("--doc-mode", choices=MODES, default=DEFAULT_MODE,
                        help="with --documents: pack (the default: whole documents packed "
                             "into each row, attention stays inside each document) or "
                             "truncate (one padded document per row)")
    parser.add_argument("--lengths", metavar="LEN:SHARE,...",
                        help="with --documents: each global batch grouped by these length "
                             "buckets (documents packed within a bucket, or one per row with "
                             "--doc-mode truncate); give the launcher the same --hspmd-lengths "
                             "so each bucket runs under its own plan")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--out", help="directory for each worker's final parameter shards")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            config = ModelConfig.from_json(f.read())
    else:
        config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                             num_heads=args.heads, num_layers=args.layers,
                             ffn_size=4 * args.hidden, seq_len=args.seq_len, dtype="float32")
    if args.data_dtype and not (args.data or args.documents):
        print(f"{parser.prog}: error: --data-dtype {args.data_dtype} needs --data PATH",
              file=sys.stderr)
        return 2
    if args.data and args.documents:
        print(f"{parser.prog}: error: --data and --documents cannot be used together",
              file=sys.stderr)
        return 2
    if args.lengths and not args.documents:
        print(f"{parser.prog}: error: --lengths {args.lengths} needs --documents PATH",
              file=sys.stderr)
        return 2
    if args.documents:
        from hspmd_elastic.bucket_data import bucketed_sampler
        from hspmd_elastic.documents import document_sampler

        try:  # checks the index against its tokens; ids are checked as read
            sample = bucketed_sampler(config, args.documents, args.lengths, args.global_batch,
                                      dtype=args.data_dtype, seed=args.seed,
                                      mode=args.doc_mode) \
                if args.lengths else document_sampler(config, args.documents, args.doc_mode,
                                                      dtype=args.data_dtype, seed=args.seed)
        except DataError as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return 2
    elif args.data:
        try:  # checks the files, the dtype and that one sample fits; ids are checked as read
            sample = token_sampler(config, args.data, args.data_dtype, seed=args.seed)
        except DataError as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return 2
    else:
        sample = synthetic_sampler(config, seed=args.seed)  # row i depends on (seed, i) only
    try:  # the inputs first, then where it runs
        WorkerIdentity.from_env()
    except ConfigurationError as exc:
        print(f"{parser.prog}: error: it must run under hspmd-launch --hspmd-elastic, which "
              f"starts each worker with its environment ({exc})", file=sys.stderr)
        return 2

    def on_step(info):
        if info.rank == 0 and info.step % 10 == 0:
            logging.info("step %d loss %.4f (plan v%d)", info.step, info.loss, info.plan_version)

    def on_switch(timings):
        logging.info("switched to plan v%d, resuming at step %d: %s", timings.to_version,
                     timings.resume_step, timings.numeric())

    try:
        result = run(config, sample=sample, global_batch=args.global_batch, steps=args.steps,
                     optim=AdamWConfig(lr=args.lr), seed=args.seed,
                     checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                     timeouts=RuntimeTimeouts(), on_step=on_step, on_switch=on_switch)
    except DataError as exc:  # an out-of-vocabulary id in a sample this worker read
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    logging.info("worker %s: %s after %d steps (plan v%d, %d switches)",
                 os.environ.get("HSPMD_NODE_ID", "?") + ":" + os.environ.get("LOCAL_RANK", "?"),
                 result.state.value, result.steps_done, result.plan_version,
                 len(result.switches))
    if args.out and result.final_state:
        os.makedirs(args.out, exist_ok=True)
        device = f"{os.environ['HSPMD_NODE_ID']}_{os.environ['LOCAL_RANK']}"
        with atomic_path(os.path.join(args.out, f"{device}.pt")) as tmp:
            torch.save(result.final_state, tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
