"""A worker that fails with an exception on one rank, recorded by torch's ``@record``.

``FAIL_RANK`` (default 1) raises ``ValueError``; the other ranks wait to be stopped.
"""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


def crunch(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if rank == int(os.environ.get("FAIL_RANK", "1")):
        crunch(rank)
    time.sleep(90)  # stopped by the agent once the failing rank is seen


if __name__ == "__main__":
    main()
