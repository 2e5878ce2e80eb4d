"""A worker that fails once: on the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank FAIL_RANK
exits 1 and the other ranks wait to be stopped; on any later attempt every rank records its
environment in ``$DUMP_DIR/attempt<restart count>_rank<RANK>.json`` and exits 0. No torch import:
cheap restarts.
"""

import json
import os
import sys
import time


def main() -> None:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if restart == 0:
        if rank == int(os.environ.get("FAIL_RANK", "0")):
            print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(90)  # stopped by the agent when the job restarts
        sys.exit(4)
    keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "HSPMD_NODE_ID",
            "HSPMD_ROUND")
    path = os.path.join(os.environ["DUMP_DIR"], f"attempt{restart}_rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: os.environ[k] for k in keys}, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
