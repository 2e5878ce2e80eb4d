"""An hspmd-aware training script for the fault-injection harness against an elastic job.

Like ``elastic_train.py`` (``hspmd_elastic.runtime.run`` on the model in ``--config``; on success
``<out>/<node>_<local_rank>.pt`` with pid, final state, steps, plan version, switches and this
rank's final parameter shards), plus a progress log for the harness: after every completed step
each worker appends one JSON line ``{"step", "round", "rank", "t", "batch"}`` to
``<progress-dir>/<node>_<local_rank>.jsonl`` (``step`` = steps completed, ``round`` = the plan
version that trained it, ``batch`` = the global batch). ``--step-time S`` paces the steps so the
faults of a scenario land mid-run; ``--comm-timeout`` shortens the collectives' watchdog below
the agent's hang limit, so the peers of a hung worker report that they wait for a plan (and are
not taken for hung themselves).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)()


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--progress-dir", required=True)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=40.0, help="each runtime wait")
    parser.add_argument("--comm-timeout", type=float, default=None,
                        help="the collectives' watchdog (default: --timeout)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(message)s")

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    with open(args.config, encoding="utf-8") as f:
        config = ModelConfig.from_json(f.read())
    device = f"{os.environ['HSPMD_NODE_ID']}_{os.environ['LOCAL_RANK']}"
    os.makedirs(args.progress_dir, exist_ok=True)
    progress = open(os.path.join(args.progress_dir, f"{device}.jsonl"), "a", encoding="utf-8")

    def on_step(info):
        progress.write(json.dumps({"step": info.step + 1, "round": info.plan_version,
                                   "rank": info.rank, "t": time.time(),
                                   "batch": args.global_batch}) + "\n")
        progress.flush()
        if args.step_time:
            time.sleep(args.step_time)  # pacing only

    t = args.timeout
    try:
        result = run(config, sample=synthetic_sampler(config, args.data_seed),
                     global_batch=args.global_batch, steps=args.steps, seed=args.seed,
                     timeouts=RuntimeTimeouts(plan_wait_s=t, comm_s=args.comm_timeout or t,
                                              regroup_s=t, finish_s=t),
                     on_step=on_step)
    finally:
        progress.close()
    from elastic_train import write_result  # beside this script

    write_result(args.out, device, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
