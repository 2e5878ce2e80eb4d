"""A restart-mode worker that needs no etcd: it appends its pid to ``$PID_DIR/<RANK>.pids``,
then waits (bounded, 120 s) until the file ``$GO_FILE`` exists and exits 0. A restarted worker
appends a second pid, so the test sees every restart."""

import os
import sys
import time


def main() -> int:
    with open(os.path.join(os.environ["PID_DIR"], f"{os.environ['RANK']}.pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["GO_FILE"]):
        if time.monotonic() > deadline:
            print("no go file within 120 s", file=sys.stderr)
            return 3
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
