"""``examples/finetune_llama.py`` with a pause gate, for tests that act on a known state.

``finetune_gated.py --pause-at K --release FILE [--gate-timeout S] <finetune_llama.py args>``:
every worker, once its state reaches step K, waits until FILE exists (bounded by
``--gate-timeout``, default 60 s), then the fine-tune goes on; everything else is
``finetune_llama.main`` unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause-at", type=int, required=True)
    parser.add_argument("--release", required=True)
    parser.add_argument("--gate-timeout", type=float, default=60.0)
    gate, rest = parser.parse_known_args()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_llama

    def on_step(info) -> None:
        if info.step + 1 != gate.pause_at:
            return
        deadline = time.monotonic() + gate.gate_timeout
        while not os.path.exists(gate.release):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{gate.release} not created within {gate.gate_timeout:g}s")
            time.sleep(0.02)

    return finetune_llama.main(rest, on_step=on_step)


if __name__ == "__main__":
    raise SystemExit(main())
