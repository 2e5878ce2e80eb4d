"""Dump the launcher-given environment of this worker, then prove env:// works over gloo.

Writes ``$DUMP_DIR/round<HSPMD_ROUND or 0>_rank<RANK>.json`` with every variable of the worker
environment contract, ``is_torchelastic_launched()`` and the result of an all_reduce.
``EXIT_AT_ROUND=<n>``: in an earlier rendezvous round, wait (bounded) to be stopped and restarted
by the agent instead of exiting.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

CONTRACT = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS", "HSPMD_ETCD_ENDPOINTS", "HSPMD_JOB_ID", "HSPMD_NODE_ID", "HSPMD_ROUND",
]


def main() -> None:
    out_dir = os.environ["DUMP_DIR"]
    env = {k: os.environ.get(k) for k in CONTRACT}
    result = {"env": env, "launched": dist.is_torchelastic_launched(), "pid": os.getpid()}
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    result["all_reduce"] = t.item()
    result["pg_rank"], result["pg_world"] = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    name = f"round{os.environ.get('HSPMD_ROUND', '0')}_rank{os.environ['RANK']}.json"
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, name))
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} done", flush=True)
    if int(os.environ.get("HSPMD_ROUND", "0")) < int(os.environ.get("EXIT_AT_ROUND", "0")):
        time.sleep(90)  # the agent restarts us in a later round long before this ends
        sys.exit(3)


if __name__ == "__main__":
    main()
