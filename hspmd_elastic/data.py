"""Token datasets on disk: a sampler keyed by the global sample index (``runtime.Sampler``) over a
flat token file, or a directory of them, read through memory maps.

A token file is a flat array of little-endian ``uint16`` or ``uint32`` token ids with no header
(the ``.bin`` of nanoGPT and of Megatron-LM's indexed datasets). A directory is the logical
concatenation of its ``*.bin`` files in name order. The dtype is given by the caller or read from
a JSON sidecar (``FILE.bin.json`` beside a file, ``DIR/dataset.json`` inside a directory):
``{"dtype": "uint16", "tokens": 1234567}`` (``tokens`` optional: when present a file of another
length is refused as truncated or overwritten).

Mapping: with ``N`` tokens and ``L = seq_len`` there are ``W = (N - 1) // L`` windows; window
``w`` is tokens ``[w*L, w*L + L + 1)``, so consecutive windows share one token and every token
but the first is a target exactly once per epoch (the ``N - 1 - W*L`` last ones are never used).
Sample ``i`` is window ``order(i % W, epoch=i // W)``: a keyed Feistel permutation of
``[0, W)`` (cycle-walking, six rounds of splitmix64), a fresh key per epoch derived from
``seed``; computed per index in O(1) memory, whatever ``W``. ``shuffle=False`` is the identity.

Promise: ``sample(i)`` depends only on the tokens, ``seq_len``, ``seed``, ``shuffle`` and ``i``
(pure-Python integer arithmetic: not on the numpy or torch version, the plan, the rank, or what
was sampled before), so every plan and every switch trains on the same rows. A call reads only
the ``seq_len + 1`` tokens of its window: only the shard(s) holding them are opened (lazily, on
first use) and sliced. Bad data is a ``DataError``, one line naming the bad value.

Writing (``write_token_file``, ``write_token_shards``) is atomic (``files.atomic_group``): a
bad id or a failure half-way leaves the files it would replace as they were.

``python -m hspmd_elastic.data make|check ...`` writes a demo token file and scans one; ``make``
creates the output's directory, and a bad flag or path is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import bisect
import json
import operator
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from hspmd_elastic.files import AtomicGroup, atomic_group

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SHARD_SUFFIX = ".bin"
DIR_SIDECAR = "dataset.json"
_SHARD_NAME = re.compile(r"^shard-(\d{5,})\.bin$")  # write_token_shards' names
_SIDECAR_KEYS = {"dtype", "tokens", "vocab_size"}

# opener(path, dtype, count) -> an array-like of ``count`` tokens; slicing it reads only the slice
Opener = Callable[[str, np.dtype, int], np.ndarray]


class DataError(ValueError):
    """A token dataset that cannot be read as asked (one line naming the bad value)."""


def memmap_opener(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# ---------------------------------------------------------------------------- files
def sidecar_path(path: str) -> str:
    return os.path.join(path, DIR_SIDECAR) if os.path.isdir(path) else path + ".json"


def read_sidecar(path: str) -> Optional[dict]:
    """The sidecar of ``path`` (a file or a directory), or None if it has none."""
    side = sidecar_path(path)
    if not os.path.exists(side):
        return None
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"sidecar {side!r} is not readable JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise DataError(f"sidecar {side!r} must be a JSON object, not {type(meta).__name__}")
    unknown = sorted(set(meta) - _SIDECAR_KEYS)
    if unknown:
        raise DataError(f"sidecar {side!r} has unknown key {unknown[0]!r}; valid: "
                        f"{', '.join(sorted(_SIDECAR_KEYS))}")
    for key in ("tokens", "vocab_size"):
        if key in meta and (not isinstance(meta[key], int) or meta[key] < 0):
            raise DataError(f"sidecar {side!r}: {key}={meta[key]!r} must be an integer >= 0")
    return meta


def parse_dtype(name) -> np.dtype:
    if name not in DTYPES:
        raise DataError(f"token dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(path: str, dtype: Optional[str]) -> tuple[np.dtype, Optional[dict]]:
    """The dtype given, else the sidecar's (they must agree when both exist); the sidecar."""
    meta = read_sidecar(path)
    side = meta.get("dtype") if meta else None
    if dtype is None and side is None:
        raise DataError(f"no token dtype for {path!r}: give one (--data-dtype "
                        f"{'|'.join(DTYPES)}) or write it in {sidecar_path(path)!r}")
    if dtype is not None and side is not None and dtype != side:
        raise DataError(f"token dtype {dtype!r} given for {path!r} but its sidecar "
                        f"{sidecar_path(path)!r} says {side!r}")
    return parse_dtype(dtype if dtype is not None else side), meta


def shard_paths(path: str) -> list[str]:
    """``[path]`` for a file; a directory's ``*.bin`` files sorted by name."""
    if not os.path.exists(path):
        raise DataError(f"token data {path!r} does not exist")
    if not os.path.isdir(path):
        return [path]
    names = sorted(n for n in os.listdir(path)
                   if n.endswith(SHARD_SUFFIX) and os.path.isfile(os.path.join(path, n)))
    if not names:
        raise DataError(f"token data directory {path!r} holds no *{SHARD_SUFFIX} shards")
    return [os.path.join(path, n) for n in names]


@dataclass(frozen=True)
class Shard:
    path: str
    start: int  # offset of its first token in the logical stream
    tokens: int


class TokenShards:
    """The tokens of a file or a directory of shards as one logical stream. Construction only
    stats the files; ``read`` opens (memory-maps) a shard the first time a range needs it."""

    def __init__(self, path: str, dtype: Optional[str] = None,
                 opener: Opener = memmap_opener):
        self.path, self.opener = str(path), opener
        paths = shard_paths(self.path)
        self.dtype, meta = resolve_dtype(self.path, dtype)
        self.dtype_name = self.dtype.name
        size = self.dtype.itemsize
        shards, start = [], 0
        for p in paths:
            nbytes = os.path.getsize(p)
            if nbytes % size:
                raise DataError(f"{p!r} is {nbytes} bytes, not a multiple of {size} "
                                f"({self.dtype_name}): wrong dtype, or a truncated file")
            shards.append(Shard(p, start, nbytes // size))
            start += nbytes // size
        if meta and "tokens" in meta and meta["tokens"] != start:
            raise DataError(f"{self.path!r} holds {start} tokens but {sidecar_path(self.path)!r} "
                            f"says tokens={meta['tokens']}: a truncated or overwritten file")
        self.shards = [s for s in shards if s.tokens]  # empty shards hold nothing to read
        self.num_tokens = start
        self._starts = [s.start for s in self.shards]
        self._open: dict[int, np.ndarray] = {}

    def locate(self, offset: int) -> tuple[Shard, int]:
        """The shard holding logical token ``offset`` and the offset within it."""
        k = bisect.bisect_right(self._starts, offset) - 1
        return self.shards[k], offset - self.shards[k].start

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (a copy), reading only the shards and pages that hold them."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise DataError(f"token range [{start}, {stop}) is outside [0, {self.num_tokens}) "
                            f"of {self.path!r}")
        if start == stop:
            return np.empty(0, dtype=self.dtype)
        pieces = []
        k = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            shard = self.shards[k]
            hi = min(stop, shard.start + shard.tokens)
            pieces.append(np.array(self._shard(k)[start - shard.start:hi - shard.start]))
            start, k = hi, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._open:
            shard = self.shards[k]
            try:
                self._open[k] = self.opener(shard.path, self.dtype, shard.tokens)
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot open token shard {shard.path!r}: {exc}") from None
        return self._open[k]


# ---------------------------------------------------------------------------- order
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class WindowOrder:
    """A seeded permutation of ``[0, size)`` per epoch, evaluated one position at a time: a
    balanced Feistel network on the smallest even bit width covering ``size`` (a bijection of
    ``[0, 4**k)``), cycle-walked into ``[0, size)`` (fewer than 4 steps on average)."""

    ROUNDS = 6

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise DataError(f"window count {size} must be >= 1")
        self.size, self.seed = size, seed
        half = max(1, ((size - 1).bit_length() + 1) // 2)
        self._half, self._mask = half, (1 << half) - 1
        self._keys: tuple[int, tuple[int, ...]] = (-1, ())

    def __call__(self, position: int, epoch: int = 0) -> int:
        if not 0 <= position < self.size:
            raise DataError(f"position {position} is outside [0, {self.size})")
        keys = self._round_keys(epoch)
        x = position
        while True:
            left, right = x >> self._half, x & self._mask
            for key in keys:
                left, right = right, left ^ (_mix64(key ^ right) & self._mask)
            x = (left << self._half) | right
            if x < self.size:
                return x

    def _round_keys(self, epoch: int) -> tuple[int, ...]:
        if self._keys[0] != epoch:
            base = _mix64(_mix64(self.seed & _M64) ^ (epoch & _M64))
            self._keys = (epoch, tuple(_mix64(base + r) for r in range(self.ROUNDS)))
        return self._keys[1]


# ---------------------------------------------------------------------------- sampler
class TokenSampler:
    """``sample(i)``: the (seq_len + 1)-token LongTensor of global sample ``i`` (module doc)."""

    def __init__(self, shards: TokenShards, seq_len: int, vocab_size: int, seed: int = 0,
                 shuffle: bool = True):
        if seq_len < 1 or vocab_size < 1:
            raise DataError(f"seq_len={seq_len} and vocab_size={vocab_size} must be >= 1")
        self.shards, self.seq_len, self.vocab_size = shards, seq_len, vocab_size
        self.num_windows = (shards.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{shards.path!r} holds {shards.num_tokens} tokens, too few for one "
                            f"sample of seq_len + 1 = {seq_len + 1} tokens")
        self.order = WindowOrder(self.num_windows, seed) if shuffle else None

    def window(self, index: int) -> int:
        index = operator.index(index)  # numpy integers too; exact Python integer arithmetic
        if index < 0:
            raise DataError(f"sample index {index} must be >= 0")
        position, epoch = index % self.num_windows, index // self.num_windows
        return self.order(position, epoch) if self.order is not None else position

    def tokens(self, index: int) -> np.ndarray:
        """Sample ``index``'s tokens as stored (uint16/uint32), every id checked against the
        vocabulary."""
        start = self.window(index) * self.seq_len
        row = self.shards.read(start, start + self.seq_len + 1)
        bad = np.flatnonzero(row >= self.vocab_size)
        if bad.size:
            shard, at = self.shards.locate(start + int(bad[0]))
            raise DataError(f"sample {index}: token id {int(row[bad[0]])} (token {at} of "
                            f"{shard.path!r}) is not below vocab_size={self.vocab_size}")
        return row

    def __call__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens(index).astype(np.int64))


def token_sampler(config, path: str, dtype: Optional[str] = None, seed: int = 0,
                  shuffle: bool = True, opener: Opener = memmap_opener) -> TokenSampler:
    """A ``runtime.Sampler`` over the token file or shard directory ``path`` for ``config``
    (a ``ModelConfig``: its ``seq_len`` and ``vocab_size``)."""
    return TokenSampler(TokenShards(path, dtype, opener), config.seq_len, config.vocab_size,
                        seed, shuffle)


# ---------------------------------------------------------------------------- writing
def write_token_file(path: str, chunks: Iterable[np.ndarray], dtype: str = "uint16",
                     vocab_size: Optional[int] = None, sidecar: bool = True) -> int:
    """Write token chunks to a flat ``.bin`` (and its sidecar), atomically (``files``): a bad
    id or any failure half-way leaves the old file and sidecar as they were; the token count."""
    with atomic_group() as group:
        return stage_token_file(group, path, chunks, dtype, vocab_size, sidecar)


def stage_token_file(group: AtomicGroup, path: str, chunks: Iterable[np.ndarray],
                     dtype: str = "uint16", vocab_size: Optional[int] = None,
                     sidecar: bool = True) -> int:
    """``write_token_file`` into ``group`` (replaced when the group commits); the token count.
    The sidecar is staged after the tokens: it records their count, so a reader refuses a new
    ``.bin`` beside an old sidecar."""
    np_dtype, count = parse_dtype(dtype), 0
    f = group.open(path, "wb")
    for chunk in chunks:
        chunk = np.asarray(chunk)
        bad = chunk[(chunk < 0) | (chunk > np.iinfo(np_dtype).max)]
        if bad.size:
            raise DataError(f"token id {int(bad[0])} does not fit {dtype}")
        f.write(chunk.astype(np_dtype).tobytes())
        count += chunk.size
    if sidecar:
        _stage_sidecar(group, sidecar_path(path), dtype, count, vocab_size)
    return count


def write_token_shards(directory: str, tokens: np.ndarray, shards: int, dtype: str = "uint16",
                       vocab_size: Optional[int] = None) -> list[str]:
    """Split ``tokens`` into ``shards`` files ``shard-00000.bin``... in ``directory`` (created)
    plus ``dataset.json``, all replaced together (``files.atomic_group``); shards of an earlier,
    larger write are removed after. The shard paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    with atomic_group() as group:
        for k, part in enumerate(np.array_split(np.asarray(tokens), shards)):
            paths.append(os.path.join(directory, f"shard-{k:05d}{SHARD_SUFFIX}"))
            stage_token_file(group, paths[-1], [part], dtype, sidecar=False)
        _stage_sidecar(group, os.path.join(directory, DIR_SIDECAR), dtype, len(tokens),
                       vocab_size)
    for name in os.listdir(directory):
        match = _SHARD_NAME.match(name)
        if match and int(match.group(1)) >= shards:
            os.unlink(os.path.join(directory, name))
    return paths


def _stage_sidecar(group: AtomicGroup, path: str, dtype: str, tokens: int,
                   vocab_size: Optional[int]) -> None:
    meta = {"dtype": dtype, "tokens": tokens}
    if vocab_size is not None:
        meta["vocab_size"] = vocab_size
    f = group.open(path, "w")
    json.dump(meta, f)
    f.write("\n")


def random_tokens(count: int, vocab_size: int, seed: int = 0,
                  chunk: int = 1 << 20) -> Iterable[np.ndarray]:
    """``count`` uniform token ids below ``vocab_size``, in chunks (any size, bounded memory)."""
    rng = np.random.default_rng(seed)
    for lo in range(0, count, chunk):
        yield rng.integers(0, vocab_size, size=min(chunk, count - lo), dtype=np.int64)


# ---------------------------------------------------------------------------- CLI
def at_least(flag: str, value, low: int = 1) -> None:
    """A one-line ``DataError`` naming ``flag`` when ``value`` (given) is below ``low``."""
    if value is not None and value < low:
        raise DataError(f"{flag}={value} must be >= {low}")


def parent_made(path: str) -> str:
    """``path``, its parent directory created if missing (what ``make`` users expect)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def _make(args) -> int:
    at_least("--shards", args.shards)
    at_least("--seed", args.seed, 0)
    if args.text:
        with open(args.text, "rb") as f:
            tokens = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
        vocab = 256  # byte-level: every byte is a token
        if not tokens.size:
            raise DataError(f"--text file {args.text!r} is empty: no token to write")
    else:
        if args.tokens is None or args.vocab is None:
            raise DataError("make needs --tokens N and --vocab V (or --text FILE)")
        most = np.iinfo(parse_dtype(args.dtype)).max + 1
        at_least("--tokens", args.tokens)
        if not 1 <= args.vocab <= most:
            raise DataError(f"--vocab={args.vocab} must be within 1..{most} for {args.dtype}")
        tokens, vocab = None, args.vocab
    if args.shards > 1:
        if tokens is None:
            tokens = np.concatenate(list(random_tokens(args.tokens, vocab, args.seed)))
        write_token_shards(args.out, tokens, args.shards, args.dtype, vocab)
        count = len(tokens)
    else:
        count = write_token_file(parent_made(args.out), [tokens] if tokens is not None else
                                 random_tokens(args.tokens, vocab, args.seed), args.dtype, vocab)
    print(f"wrote {count} {args.dtype} tokens (vocab {vocab}) to {args.out}")
    return 0


def _check(args) -> int:
    at_least("--vocab", args.vocab)
    at_least("--seq-len", args.seq_len)
    shards = TokenShards(args.path, args.dtype)
    meta = read_sidecar(args.path) or {}
    vocab = args.vocab if args.vocab is not None else meta.get("vocab_size")
    top, chunk = -1, 1 << 22
    for lo in range(0, shards.num_tokens, chunk):
        part = shards.read(lo, min(lo + chunk, shards.num_tokens))
        if vocab is not None and part.size and int(part.max()) >= vocab:
            first = lo + int(np.flatnonzero(part >= vocab)[0])
            shard, at = shards.locate(first)
            raise DataError(f"token id {int(part[first - lo])} (token {at} of {shard.path!r}) "
                            f"is not below vocab_size={vocab}")
        top = max(top, int(part.max()) if part.size else -1)
    windows = max(0, (shards.num_tokens - 1) // args.seq_len) if args.seq_len else None
    print(f"{args.path}: {len(shards.shards)} shard(s), {shards.num_tokens} {shards.dtype_name} "
          f"tokens, largest id {top}" + (f", vocab_size {vocab}" if vocab is not None else "")
          + (f", {windows} samples of seq_len {args.seq_len}" if windows is not None else ""))
    return 0


def run_command(args, make: Callable, check: Callable) -> int:
    """``make`` or ``check`` for the parsed ``args`` of a data command; a ``DataError`` or an
    ``OSError`` is one line and exit code 2 (this module's CLI and ``hspmd_elastic.documents``')."""
    try:
        return make(args) if args.command == "make" else check(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be read or written: one line, no traceback
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"error: cannot {args.command}{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hspmd_elastic.data",
                                     description="Write or check flat token files.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a random (or byte-level text) token file")
    make.add_argument("out", help="the .bin file to write (a directory with --shards > 1)")
    make.add_argument("--tokens", type=int, help="how many random tokens")
    make.add_argument("--vocab", type=int, help="random ids are below this")
    make.add_argument("--text", help="use this file's bytes as tokens (vocab 256) instead")
    make.add_argument("--dtype", choices=sorted(DTYPES), default="uint16")
    make.add_argument("--shards", type=int, default=1, help="split into this many shard files")
    make.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check", help="scan a token file or directory and summarize it")
    check.add_argument("path")
    check.add_argument("--dtype", choices=sorted(DTYPES), help="default: the sidecar's")
    check.add_argument("--vocab", type=int, help="refuse ids >= this (default: the sidecar's)")
    check.add_argument("--seq-len", type=int, help="also count the samples of this length")
    return run_command(parser.parse_args(argv), _make, _check)


if __name__ == "__main__":
    raise SystemExit(main())
