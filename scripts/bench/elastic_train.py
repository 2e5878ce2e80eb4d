"""The hspmd-aware side of ``scripts/bench_recovery``: ``hspmd_elastic.runtime.run`` training the
decoder in ``--config`` on the synthetic global batches, with a timeline of every completed step
(``scripts/bench/timeline.py``): ``start`` (script entry), ``imported``, ``step`` (step index,
plan version) and ``switch`` (the runtime's switch timings), so the bench can tell when training
resumed after a fault. Run by ``hspmd-launch --hspmd-elastic`` agents.
"""

from __future__ import annotations

import time

T0 = time.time()

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timeline import read_config, training_start  # noqa: E402


def main() -> int:
    args, tl = training_start(__doc__, T0, lambda ap: ap.add_argument(
        "--timeout", type=float, default=30.0, help="each runtime wait (s)"))

    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    tl.mark("imported")
    config = read_config(args.config)
    t = args.timeout
    result = run(config, sample=synthetic_sampler(config, args.data_seed),
                 global_batch=args.global_batch, steps=args.steps, seed=args.seed,
                 timeouts=RuntimeTimeouts(plan_wait_s=t, comm_s=t, regroup_s=t, finish_s=t),
                 on_step=lambda i: tl.mark("step", step=i.step, v=i.plan_version),
                 on_switch=lambda s: tl.mark("switch", timings=s.as_dict()))
    tl.mark("end", state=result.state.value, steps_done=result.steps_done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
