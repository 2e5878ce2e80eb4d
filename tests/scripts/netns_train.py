"""``elastic_train.py`` with gates, for the multi-host (network namespace) tests.

``--gate STEP:FILE`` (repeatable): once its state reaches step STEP, the worker waits (bounded by
``--gate-timeout``) until FILE exists, so a test cuts or heals a link while every worker holds a
known state, and lets them on by creating the file. Everything else is ``elastic_train.py``'s
(``--config``, ``--steps``, ``--global-batch``, ``--seed``, ``--data-seed``, ``--out``,
``--timeout``, ``--comm-timeout``); the result file is the same.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--gate", action="append", default=[], help="STEP:FILE")
    parser.add_argument("--gate-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="each runtime wait")
    parser.add_argument("--comm-timeout", type=float, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(message)s")
    gates = {int(g.split(":", 1)[0]): g.split(":", 1)[1] for g in args.gate}

    from elastic_train import write_result

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    with open(args.config, encoding="utf-8") as f:
        config = ModelConfig.from_json(f.read())
    device = f"{os.environ['HSPMD_NODE_ID']}_{os.environ['LOCAL_RANK']}"

    def on_step(info):
        gate = gates.get(info.step + 1)
        if gate is None:
            return
        logging.info("worker %s: at gate %d (plan v%d)", device, info.step + 1,
                     info.plan_version)
        deadline = time.monotonic() + args.gate_timeout
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} did not open in {args.gate_timeout:.0f}s")
            time.sleep(0.02)

    t = args.timeout
    result = run(config, sample=synthetic_sampler(config, args.data_seed),
                 global_batch=args.global_batch, steps=args.steps, seed=args.seed,
                 timeouts=RuntimeTimeouts(plan_wait_s=t, comm_s=args.comm_timeout or t,
                                          regroup_s=t, finish_s=t),
                 on_step=on_step)
    write_result(args.out, device, result)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
