"""The hspmd-aware worker of ``scripts/gpu_check``'s elastic jobs (``launcher/health/gpu_check_job.py``).

Trains the project's decoder with ``hspmd_elastic.runtime.run`` on ``--config`` (the JSON the
agent plans for; ``"compute_dtype": "bfloat16"`` there trains in bf16 with float32 master
weights), with the undo copy where ``--undo`` says (``device``, ``host`` or ``off``). After
every step it writes ``<out>/<node>_<local_rank>.progress.json``
(pid, device, step, plan version, and ``holding`` while it waits at a hold); ``--hold STEP:FILE``
(repeatable; ``{local_rank}`` in FILE is replaced) makes it wait, bounded by ``--timeout``, once
its state reaches STEP, until FILE exists, so the check acts on a known state (a file that never
comes holds that worker until it is killed). On success it writes ``<out>/<node>_<local_rank>.json``:
pid, device, final state, steps, plan version, every switch's timings, and on CUDA the memory
the caching allocator held after each switch (``memory_after_switch``, bytes), and after each
switch ``process_resources()`` (live process groups, threads, open files: ``resources_after_switch``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _write(path: str, data: dict) -> None:
    from hspmd_elastic.files import atomic_write  # temporary file, fsync, rename

    atomic_write(path, json.dumps(data))


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)()


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE")
    parser.add_argument("--timeout", type=float, default=60.0, help="each wait of the runtime")
    parser.add_argument("--comm-timeout", type=float, default=None)
    parser.add_argument("--undo", choices=("device", "host", "off"), default="device",
                        help="where the one-step undo copy lives (runtime.run's undo)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(message)s")

    import torch

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    with open(args.config, encoding="utf-8") as f:
        config = ModelConfig.from_json(f.read())
    local_rank = os.environ["LOCAL_RANK"]
    name = f"{os.environ['HSPMD_NODE_ID']}_{local_rank}"
    holds = {int(h.split(":", 1)[0]): h.split(":", 1)[1].replace("{local_rank}", local_rank)
             for h in args.hold}
    os.makedirs(args.out, exist_ok=True)
    progress_path = os.path.join(args.out, f"{name}.progress.json")
    memory: list[int] = []
    state = {"pid": os.getpid(), "device": None, "step": 0, "plan_version": 0,
             "holding": None}

    def cuda_memory() -> int:
        return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0

    resources: list[dict] = []

    def on_switch(timings):
        from hspmd_elastic.elastic.group import process_resources

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        memory.append(cuda_memory())
        resources.append(process_resources())

    def on_step(info):
        state.update(step=info.step + 1, plan_version=info.plan_version,
                     device=str(info.held.model.device))
        hold = holds.get(info.step + 1)
        state["holding"] = info.step + 1 if hold else None
        _write(progress_path, state)
        if hold is None:
            return
        logging.info("worker %s: holding at step %d (plan v%d)", name, info.step + 1,
                     info.plan_version)
        deadline = time.monotonic() + args.timeout
        while not os.path.exists(hold):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hold file {hold} did not appear in {args.timeout:.0f}s")
            time.sleep(0.02)
        state["holding"] = None
        _write(progress_path, state)

    t = args.timeout
    result = run(config, sample=synthetic_sampler(config, 1), global_batch=args.global_batch,
                 steps=args.steps, seed=0, on_step=on_step, on_switch=on_switch,
                 undo=args.undo,
                 timeouts=RuntimeTimeouts(plan_wait_s=t, comm_s=args.comm_timeout or t,
                                          regroup_s=t, finish_s=t))
    _write(os.path.join(args.out, f"{name}.json"), {
        "pid": os.getpid(), "device": state["device"], "state": result.state.value,
        "steps_done": result.steps_done, "plan_version": result.plan_version,
        "switches": [s.as_dict() for s in result.switches], "memory_after_switch": memory,
        "resources_after_switch": resources,
        "losses": {str(k): v for k, v in result.losses.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
