"""A stand-in worker for the fault-landing tests: appends one progress line (JSON: rank, round,
step, t) to ``argv[1]`` every ``argv[2]`` seconds, and exits by itself after ``argv[3]`` seconds
so that a failing test leaves nothing behind."""

import json
import sys
import time

path, period, lifetime = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + lifetime
step = 0
with open(path, "a") as out:
    while time.monotonic() < end:
        step += 1
        out.write(json.dumps({"rank": 0, "round": 0, "step": step, "t": time.time()}) + "\n")
        out.flush()
        time.sleep(period)
