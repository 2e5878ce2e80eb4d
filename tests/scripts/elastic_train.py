"""An hspmd-aware training script for the elastic end-to-end tests and the demo.

Trains the project's decoder with ``hspmd_elastic.runtime.run`` on the model config in
``--config`` (the same JSON file the agents get as ``--hspmd-model``), and on success writes
``<out>/<node>_<local_rank>.pt``: pid, final state, steps, plan version, switch timings and this
rank's final parameter shards. ``--pause-at K`` makes every worker wait, once its state reaches
step K, until ``--release`` exists (bounded); ``--gate STEP:FILE`` (repeatable) does the same at
several steps (bounded by ``--gate-timeout``), so a test acts on a known state. ``--step-time S``
paces the steps (a demo that should be watchable). ``--sample-log DIR`` appends, for every step
this rank completes, one JSON line to ``DIR/<node>_<local_rank>.jsonl``: the step, the plan
version it ran under, this rank's pipeline (index and count), the global sample ids that pipeline
trained (its micro-batch rows of the step's global batch, as ``SpecializedModel.step`` slices
them), the resulting state's step and the loss. The line is written before any pause, so a kill
during the pause finds it on disk. For the fault-injection harness, ``--progress-dir DIR``
appends after every completed step one JSON line ``{"step", "round", "rank", "t", "batch"}`` to
``DIR/<node>_<local_rank>.jsonl`` (``step`` = steps completed, ``round`` = the plan version that
trained it, ``batch`` = the global batch), and ``--comm-timeout`` shortens the collectives'
watchdog below the agent's hang limit, so the peers of a hung worker report that they wait for a
plan (and are not taken for hung themselves). ``--adam-eps`` sets AdamW's eps: with the
default, the rounding differences between two reduction orders (a plan with another data
parallel split than the reference) grow by orders of magnitude every few dozen steps, so only
short runs equal the fault-free reference within 1e-9; with a large eps (1.0: close to momentum
SGD) they stay at machine precision over thousands of steps (the chaos soak).
``--abandon NODE:LOCAL_RANK:STEP`` makes that worker give up the last collective wait of step
STEP once (an injected ``CommTimeoutError``, as on a busy host): it leaves the step while its
peers complete it or wait for it, and nothing in the cluster changes.
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
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--release", default=None)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=40.0, help="each runtime wait")
    parser.add_argument("--sample-log", default=None,
                        help="directory for one JSON line per completed step (sample ids)")
    parser.add_argument("--progress-dir", default=None,
                        help="directory for one JSON line per completed step (the harness's)")
    parser.add_argument("--comm-timeout", type=float, default=None,
                        help="the collectives' watchdog (default: --timeout)")
    parser.add_argument("--gate", action="append", default=[], metavar="STEP:FILE",
                        help="once at STEP, wait (bounded by --gate-timeout) until FILE exists")
    parser.add_argument("--gate-timeout", type=float, default=120.0)
    parser.add_argument("--documents", default=None, metavar="PREFIX",
                        help="train on the documents of a Megatron-LM indexed dataset "
                             "(PREFIX.idx/.bin), rows packed (hspmd_elastic.documents)")
    parser.add_argument("--lengths", default=None, metavar="LEN:SHARE,...",
                        help="with --documents: one document per row, global batches grouped "
                             "by these length buckets (the job's --hspmd-lengths)")
    parser.add_argument("--adam-eps", type=float, default=None,
                        help="AdamW's eps (default: AdamWConfig's); a large one such as 1.0 "
                             "keeps rounding differences from growing over a long run")
    parser.add_argument("--abandon", default=None, metavar="NODE:LOCAL_RANK:STEP",
                        help="that worker abandons the last wait of STEP once (injected)")
    args = parser.parse_args()
    gates = {int(g.split(":", 1)[0]): g.split(":", 1)[1] for g in args.gate}
    if args.pause_at is not None and args.release:
        gates.setdefault(args.pause_at, args.release)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(message)s")

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    with open(args.config, encoding="utf-8") as f:
        config = ModelConfig.from_json(f.read())

    device = f"{os.environ['HSPMD_NODE_ID']}_{os.environ['LOCAL_RANK']}"
    sample_log = None
    if args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        sample_log = open(os.path.join(args.sample_log, f"{device}.jsonl"), "a",
                          encoding="utf-8")
    progress = None
    if args.progress_dir:
        os.makedirs(args.progress_dir, exist_ok=True)
        progress = open(os.path.join(args.progress_dir, f"{device}.jsonl"), "a", encoding="utf-8")

    def log_samples(info):
        plan, pipeline = info.held.plan, info.held.model.placement.pipeline
        base = info.step * args.global_batch
        rows = [r for m in range(plan.pipelines[pipeline].num_microbatches)
                for r in range(*plan.microbatch_rows(pipeline, m))]
        line = {"step": info.step, "plan_version": info.plan_version, "rank": info.rank,
                "pipeline": pipeline, "pipelines": len(plan.pipelines),
                "samples": [base + r for r in rows], "state_step": info.held.step,
                "loss": info.loss}
        sample_log.write(json.dumps(line) + "\n")
        sample_log.flush()

    def on_step(info):
        if sample_log is not None:
            log_samples(info)
        if progress is not None:
            progress.write(json.dumps({"step": info.step + 1, "round": info.plan_version,
                                       "rank": info.rank, "t": time.time(),
                                       "batch": args.global_batch}) + "\n")
            progress.flush()
        if args.step_time:
            time.sleep(args.step_time)  # pacing only
        gate = gates.get(info.step + 1)
        if gate is not None:
            logging.info("worker %s: at gate %d (plan v%d)", device, info.step + 1,
                         info.plan_version)
            limit = 60.0 if gate == args.release else args.gate_timeout
            deadline = time.monotonic() + limit
            while not os.path.exists(gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gate file {gate} did not appear in {limit:.0f}s")
                time.sleep(0.02)

    injector = None
    if args.abandon:
        node, lr, at = args.abandon.rsplit(":", 2)
        if (node, lr) == (os.environ["HSPMD_NODE_ID"], os.environ["LOCAL_RANK"]):
            injector = _abandon_last_wait_of(int(at))

    t = args.timeout
    try:
        if args.documents and args.lengths:  # one document per row, batches by bucket
            from hspmd_elastic.bucket_data import bucketed_sampler

            sample = bucketed_sampler(config, args.documents, args.lengths, args.global_batch,
                                      seed=args.data_seed)
        elif args.documents:
            from hspmd_elastic.documents import document_sampler

            sample = document_sampler(config, args.documents, mode="pack", seed=args.data_seed)
        else:
            sample = synthetic_sampler(config, args.data_seed)
        result = run(config, sample=sample,
                     global_batch=args.global_batch, steps=args.steps, seed=args.seed,
                     optim=AdamWConfig() if args.adam_eps is None else
                     AdamWConfig(eps=args.adam_eps),
                     timeouts=RuntimeTimeouts(plan_wait_s=t, comm_s=args.comm_timeout or t,
                                              regroup_s=t, finish_s=t),
                     on_step=on_step, fault_injector=injector)
    finally:
        for log_file in (sample_log, progress):
            if log_file is not None:
                log_file.close()
    write_result(args.out, device, result)
    return 0


def _abandon_last_wait_of(step: int):
    """A fault injector: the last wait of ``step`` (it has as many as the step before) raises
    ``CommTimeoutError``, once in this process."""
    from hspmd_elastic.graph.comm import CommTimeoutError

    waits: dict[int, int] = {}
    fired = []

    def inject(at: int, what: str) -> None:
        waits[at] = waits.get(at, 0) + 1
        if at == step and not fired and waits[at] == waits.get(at - 1, -1):
            fired.append(what)
            logging.warning("injected: abandoning %s in step %d", what, at)
            raise CommTimeoutError(f"injected failure of {what} in step {at}")

    return inject


def write_result(out_dir: str, device: str, result) -> None:
    """``<out_dir>/<device>.pt`` (written atomically) with what the tests compare: pid, final
    state and this rank's final parameter shards, steps, plan version, switch timings."""
    import torch

    if result.final_state:
        os.makedirs(out_dir, exist_ok=True)
        out = {"pid": os.getpid(), "state": result.state.value, "steps_done": result.steps_done,
               "plan_version": result.plan_version, "rank": result.rank,
               "final_state": result.final_state,
               "switches": [s.as_dict() for s in result.switches],
               "bucket_switches": {k: v.switches for k, v in result.bucket_stats.items()}}
        tmp = os.path.join(out_dir, f".{device}.pt")
        torch.save(out, tmp)
        os.replace(tmp, os.path.join(out_dir, f"{device}.pt"))
    logging.info("worker %s: %s after %d steps (plan v%d, %d switches)", device,
                 result.state.value, result.steps_done, result.plan_version,
                 len(result.switches))


if __name__ == "__main__":
    raise SystemExit(main())
