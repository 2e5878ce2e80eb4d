"""``python -m hspmd_elastic.documents make|check``: write a random document dataset, or check
one and describe its lengths for the launcher.

Promises:

* Every flag is checked before anything is written, and a bad value is one line naming the
  flag and what would be valid, exit code 2 (``data.run_command``): counts and lengths >= 1,
  ``--seed`` >= 0, ``--vocab`` within what ``--dtype`` holds, ``--long-share`` in [0, 1].
* ``make`` creates the prefix's directory when missing and writes ``PREFIX.bin`` and
  ``PREFIX.idx`` atomically (``documents.write_indexed``): a failed run leaves an earlier
  dataset byte for byte as it was.
* ``check --max-len N`` counts the samples of an epoch as training reads them: rows packed with
  whole documents (``--mode pack``, the default, ``documents.DEFAULT_MODE``) or one padded
  document per row (``--mode truncate``).
* ``check --boundaries W1,...,Wk`` buckets the documents as training does: rows of
  ``max_len + 1`` tokens (``--max-len``, default the last boundary, which must equal it), a
  longer document truncated to them and counted in the last bucket, bucket ``b`` holding
  ``W(b-1) + 2 .. Wb + 1`` tokens (``documents.bucket_index``, the rule of
  ``bucket_data.BucketedDocuments``). The ``--lengths`` line it prints is one the launcher
  takes for a model whose ``seq_len`` is ``max_len`` (``--hspmd-lengths``: checked with the
  planner's ``parse_lengths``).
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import numpy as np

from hspmd_elastic.data import DataError, at_least, parent_made, run_command
from hspmd_elastic.documents import (DEFAULT_MODE, MODES, TOKEN_CODES, DocumentSampler,
                                     open_documents, write_indexed)
from hspmd_elastic.planner import PlannerError, parse_lengths


def _make(args) -> int:
    for flag, value in (("--docs", args.docs), ("--vocab", args.vocab),
                        ("--min-len", args.min_len), ("--max-len", args.max_len),
                        ("--long-len", args.long_len)):
        at_least(flag, value)
    at_least("--seed", args.seed, 0)
    if args.max_len < args.min_len:
        raise DataError(f"--max-len={args.max_len} is below --min-len={args.min_len}")
    if not (math.isfinite(args.long_share) and 0 <= args.long_share <= 1):
        raise DataError(f"--long-share={args.long_share} must be within [0, 1]")
    most = int(np.iinfo(args.dtype).max) + 1
    if args.vocab > most:
        raise DataError(f"--vocab={args.vocab} must be within 1..{most} for {args.dtype}")
    long_len = args.max_len if args.long_len is None else args.long_len
    rng = np.random.default_rng(args.seed)
    short = rng.integers(args.min_len, args.max_len + 1, size=args.docs)
    lengths = np.where(rng.random(args.docs) < args.long_share, long_len, short)
    docs = (rng.integers(0, args.vocab, size=int(n)) for n in lengths)
    n, tokens = write_indexed(parent_made(args.prefix), docs, args.dtype)
    print(f"wrote {n} documents, {tokens} {args.dtype} tokens (vocab {args.vocab}) to "
          f"{args.prefix}.idx/.bin")
    return 0


def _check(args) -> int:
    at_least("--vocab", args.vocab)
    at_least("--max-len", args.max_len)
    bounds = _boundaries(args.boundaries) if args.boundaries is not None else None
    if bounds and args.max_len is not None and bounds[-1] != args.max_len:
        raise DataError(f"the last bucket boundary {bounds[-1]} must be --max-len "
                        f"{args.max_len}: the launcher's last --hspmd-lengths bucket is the "
                        "model's seq_len (longer documents are truncated into it)")
    docs = open_documents(args.path, args.dtype)
    lengths = docs.lengths()
    empty = int((lengths == 0).sum())
    print(f"{docs.path}: {docs.num_docs} documents ({empty} empty), {docs.num_tokens} "
          f"{docs.dtype.name} tokens, lengths {int(lengths.min()) if lengths.size else 0}.."
          f"{int(lengths.max(initial=0))}")
    if args.vocab is not None:
        chunk = 1 << 22
        for lo in range(0, docs.num_tokens, chunk):
            part = docs.source.read(lo, min(lo + chunk, docs.num_tokens)).astype(np.int64)
            bad = np.flatnonzero((part < 0) | (part >= args.vocab))
            if bad.size:
                raise DataError(f"token id {int(part[bad[0]])} (token {lo + int(bad[0])}) is "
                                f"not in [0, {args.vocab})")
    max_len = args.max_len if args.max_len is not None else (bounds[-1] if bounds else None)
    if max_len is None:
        return 0
    sampler = DocumentSampler(docs, max_len, args.mode, shuffle=False,
                              truncate=not args.no_truncate)
    print(f"{sampler.epoch_size(0)} {args.mode} samples of max_len {max_len} per epoch "
          "(epoch 0)")
    if bounds:
        _histogram(sampler, bounds)
    return 0


def _histogram(sampler: DocumentSampler, bounds: list[int]) -> None:
    hist = sampler.length_histogram(bounds)
    low = 1
    for b, n, t in zip(hist.boundaries, hist.documents, hist.tokens):
        cut = f", {hist.truncated} truncated to {b + 1}" if b == bounds[-1] and \
            hist.truncated else ""
        print(f"  window {b} (documents of {low}..{b + 1} tokens{cut}): {n} documents, "
              f"{t} tokens")
        low = b + 2
    spec = hist.spec()
    try:
        parse_lengths(spec)
    except PlannerError as exc:
        raise DataError(f"the buckets make no spec the launcher takes: {exc}") from None
    print(f"--lengths {spec}")


def _boundaries(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        if not item.strip().isdigit():
            raise DataError(f"bucket boundary {item.strip()!r} is not an integer")
        at_least("bucket boundary", int(item))
        out.append(int(item))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hspmd_elastic.documents",
                                     description="Write or check document datasets.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write random documents as PREFIX.idx + PREFIX.bin")
    make.add_argument("prefix", help="PREFIX of the files (its directory is created)")
    make.add_argument("--docs", type=int, required=True, help="how many documents")
    make.add_argument("--vocab", type=int, required=True, help="random ids are below this")
    make.add_argument("--min-len", type=int, default=1)
    make.add_argument("--max-len", type=int, required=True, help="lengths are uniform in range")
    make.add_argument("--long-share", type=float, default=0.0,
                      help="this share of the documents gets --long-len tokens")
    make.add_argument("--long-len", type=int, help="default: --max-len")
    make.add_argument("--dtype", choices=sorted(TOKEN_CODES), default="uint16")
    make.add_argument("--seed", type=int, default=0, help="an integer >= 0")
    check = sub.add_parser("check", help="check a document dataset and summarize it")
    check.add_argument("path", help="PREFIX (.idx/.bin) or a token file with FILE.docs.npy")
    check.add_argument("--dtype", help="a token file's dtype (default: its sidecar's)")
    check.add_argument("--vocab", type=int, help="refuse ids outside [0, this)")
    check.add_argument("--max-len", type=int,
                       help="count the samples of rows of this max_len (the model's seq_len; "
                            "default: the last --boundaries window)")
    check.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                       help="pack: whole documents packed into each row (the default, as "
                            "training reads them); truncate: one padded document per row")
    check.add_argument("--no-truncate", action="store_true",
                       help="refuse documents longer than max_len + 1")
    check.add_argument("--boundaries",
                       help="bucket windows such as 512,8192, the last the model's seq_len: a "
                            "histogram and the --hspmd-lengths spec")
    return run_command(parser.parse_args(argv), _make, _check)


if __name__ == "__main__":
    raise SystemExit(main())
