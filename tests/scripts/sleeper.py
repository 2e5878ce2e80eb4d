"""A worker that records its pid (and its child's) and sleeps until stopped.

``IGNORE_TERM=1`` ignores SIGTERM (so only SIGKILL ends it), ``IGNORE_INT=1`` SIGINT too; ``SPAWN_CHILD=1`` starts a
grandchild process that sleeps too. Pids go to ``$PID_DIR/<RANK>.pids``.
"""

import os
import signal
import subprocess
import sys
import time


def main() -> None:
    if os.environ.get("IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("IGNORE_INT") == "1":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids = [os.getpid()]
    if os.environ.get("SPAWN_CHILD") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        pids.append(child.pid)
    path = os.path.join(os.environ["PID_DIR"], f"{os.environ['RANK']}.pids")
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(path + ".tmp", path)
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    print(f"err line from rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    if os.environ.get("EXIT_NOW") == "1":
        return
    time.sleep(120)


if __name__ == "__main__":
    main()
