"""A worker whose plan does not fit its memory: it allocates (and touches) ``--block-mib`` MiB
blocks until it holds ``--total-mib`` MiB, then exits 0 (so a limit that does not bite lets the
job succeed, and the test that expects the OOM killer fails). Its pid goes to stdout first."""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-mib", type=int, default=16)
    parser.add_argument("--total-mib", type=int, required=True)
    args = parser.parse_args()
    print(f"memory_hog pid {os.getpid()} rank {os.environ.get('RANK')}", flush=True)
    held = []
    for _ in range(args.total_mib // args.block_mib):
        held.append(bytearray(args.block_mib << 20))  # zero-filled: every page touched
    print(f"memory_hog holds {len(held) * args.block_mib} MiB", flush=True)


if __name__ == "__main__":
    main()
