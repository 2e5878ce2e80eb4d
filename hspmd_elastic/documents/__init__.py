"""Variable-length documents: a document dataset on disk, samples keyed by the global sample
index (a truncated document, or a packed row of whole documents), and the masks that keep
attention and the loss inside each document.

Two formats (``open_documents``):

* Megatron-LM's indexed dataset: ``PREFIX.idx`` (``MMIDIDX``, version 1) beside ``PREFIX.bin``.
  The index is the magic ``MMIDIDX\\x00\\x00``, ``<Q`` version, ``<B`` dtype code, ``<Q``
  sequence count ``S``, ``<Q`` document-index count ``D + 1``, then ``int32`` sizes ``[S]``,
  ``int64`` byte pointers ``[S]`` and ``int64`` document indices ``[D + 1]``. Document ``d`` is
  sequences ``[di[d], di[d + 1])``, contiguous in the ``.bin``. Opening reads the index through
  memory maps and refuses, in one ``DataError`` line naming the file and the mismatch, a bad
  magic, version or dtype code, an index whose size is not what its header promises, pointers
  that are not the running byte sum of the sizes, document indices that do not rise from 0 to
  ``S``, and a ``.bin`` whose size is not the sizes' sum times the item size.
* A flat token file (``data.py``'s ``.bin`` and dtype sidecar) with ``FILE.bin.docs.npy``: a 1-D
  integer array of ``D + 1`` token offsets, 0 first, non-decreasing, the token count last.

Samples (``DocumentSampler``), rows of ``R = max_len + 1`` tokens and their segment ids (1..k
number the documents of the row, 0 is padding; pad tokens are 0). Empty documents are never
sampled; a longer document keeps its first ``R`` tokens (``truncate=True``), else opening the
sampler is a one-line ``DataError`` naming the document and its length.

* ``"pack"`` (the default, ``DEFAULT_MODE``): epoch ``e`` takes every non-empty document once, in
  ``order``'s epoch-``e`` order, and packs them greedily first-fit into rows: a document goes into
  the first of the ``open_rows`` most recently opened rows with room for it, else opens a new row
  (the oldest open row is then closed; a full row closes at once). Rows keep their documents whole
  and in arrival order, and are numbered in the order they were opened. Packing an epoch costs
  O(documents x open_rows) time and O(documents) memory; sample ``i`` in epoch ``e`` needs the row
  counts of epochs ``0..e`` (each packed once, counts kept) and epoch ``e``'s rows (the latest
  packed epoch is kept).
* ``"truncate"``: one document per row, padded: sample ``i`` is document ``order(i % D',
  epoch=i // D')`` (``D'`` non-empty documents; ``order`` is ``data.WindowOrder``, the identity
  when ``shuffle=False``). Both modes train on the same targets of the same documents
  (``loss_sum``); packing needs fewer rows for them.

Promise: ``sample(i)`` depends only on the documents, ``max_len``, ``mode``, ``seed``,
``shuffle``, ``truncate``, ``open_rows`` and ``i``: not on the plan, the rank or what was
sampled before. ``block_mask``, ``loss_mask``, ``positions`` and ``loss_sum`` are pure torch
functions of the segment ids (the loss contract is in ``loss_sum``).

``python -m hspmd_elastic.documents make|check ...`` writes a demo ``.idx``/``.bin`` and scans one.
"""

from __future__ import annotations

import operator
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from hspmd_elastic.data import DataError, TokenShards, WindowOrder, stage_token_file
from hspmd_elastic.files import atomic_group

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
MMIDIDX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
# Megatron-LM's DType codes; 6 and 7 are floats, never token ids
MMIDIDX_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                  7: "float32", 8: "uint16"}
TOKEN_CODES = {name: code for code, name in MMIDIDX_DTYPES.items() if code not in (6, 7)}
DOCS_SUFFIX = ".docs.npy"
MODES = ("pack", "truncate")  # whole documents packed into rows; one padded document per row
DEFAULT_MODE = "pack"


# ---------------------------------------------------------------------------- files
class _BinFile:
    """A ``.bin`` of ``count`` tokens, memory-mapped on first read."""

    def __init__(self, path: str, dtype: np.dtype, count: int):
        self.path, self.dtype, self.num_tokens = path, dtype, count
        self._map: Optional[np.ndarray] = None

    def read(self, start: int, stop: int) -> np.ndarray:
        if self._map is None:
            try:
                self._map = np.memmap(self.path, dtype=self.dtype, mode="r",
                                      shape=(self.num_tokens,))
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot open token file {self.path!r}: {exc}") from None
        return np.array(self._map[start:stop])


@dataclass
class Documents:
    """``D`` documents: document ``d`` is tokens ``[offsets[d], offsets[d + 1])`` of ``source``
    (an object with ``read(start, stop)``)."""

    path: str
    dtype: np.dtype
    offsets: np.ndarray  # int64 [D + 1]
    source: object

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def tokens(self, doc: int, limit: Optional[int] = None) -> np.ndarray:
        """The first ``limit`` (default: all) tokens of document ``doc`` as int64."""
        start, stop = int(self.offsets[doc]), int(self.offsets[doc + 1])
        if limit is not None:
            stop = min(stop, start + limit)
        return self.source.read(start, stop).astype(np.int64)


def _map(path: str, dtype: str, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_indexed(prefix: str) -> Documents:
    """The documents of Megatron-LM's ``PREFIX.idx`` / ``PREFIX.bin`` (checked: module doc)."""
    idx, binp = prefix + ".idx", prefix + ".bin"
    for p in (idx, binp):
        if not os.path.isfile(p):
            raise DataError(f"{p!r} does not exist (an indexed dataset is PREFIX.idx + PREFIX.bin)")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:9] != MMIDIDX_MAGIC:
        raise DataError(f"{idx!r} is not a Megatron-LM index: it does not start with "
                        f"{MMIDIDX_MAGIC!r}")
    _, version, code, seqs, ndi = _HEADER.unpack(head)
    if version != MMIDIDX_VERSION:
        raise DataError(f"{idx!r}: index version {version}, only {MMIDIDX_VERSION} is read")
    if code not in MMIDIDX_DTYPES:
        raise DataError(f"{idx!r}: dtype code {code} is not one of Megatron-LM's 1..8")
    if code not in TOKEN_CODES.values():
        raise DataError(f"{idx!r}: dtype code {code} ({MMIDIDX_DTYPES[code]}) is not a token "
                        "dtype")
    dtype = np.dtype(MMIDIDX_DTYPES[code]).newbyteorder("<")
    expected = _HEADER.size + 12 * seqs + 8 * ndi
    if size != expected:
        raise DataError(f"{idx!r} is {size} bytes but its header promises {expected} ({seqs} "
                        f"sequences, {ndi} document indices)")
    sizes = _map(idx, "<i4", _HEADER.size, seqs).astype(np.int64)
    pointers = _map(idx, "<i8", _HEADER.size + 4 * seqs, seqs)
    doc_index = _map(idx, "<i8", _HEADER.size + 12 * seqs, ndi).astype(np.int64)
    if sizes.size and sizes.min() < 0:
        k = int(np.flatnonzero(sizes < 0)[0])
        raise DataError(f"{idx!r}: sequence {k} has a negative size {int(sizes[k])}")
    starts = np.zeros(seqs + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    bad = np.flatnonzero(pointers != starts[:-1] * dtype.itemsize)
    if bad.size:
        k = int(bad[0])
        raise DataError(f"{idx!r}: sequence {k}'s pointer is {int(pointers[k])}, not "
                        f"{int(starts[k]) * dtype.itemsize} (the sizes before it x "
                        f"{dtype.itemsize} bytes): a wrong dtype code, or a damaged index")
    if ndi < 1 or doc_index[0] != 0 or doc_index[-1] != seqs or \
            (ndi > 1 and np.diff(doc_index).min() < 0):
        raise DataError(f"{idx!r}: the {ndi} document indices must rise from 0 to the sequence "
                        f"count {seqs}")
    tokens, nbytes = int(starts[-1]), os.path.getsize(binp)
    if tokens * dtype.itemsize != nbytes:
        raise DataError(f"{binp!r} is {nbytes} bytes but {idx!r} holds {tokens} {dtype.name} "
                        f"tokens ({tokens * dtype.itemsize} bytes): a truncated .bin or the "
                        "wrong index")
    return Documents(idx, dtype, starts[doc_index], _BinFile(binp, dtype, tokens))


def read_offsets(path: str, dtype: Optional[str] = None) -> Documents:
    """The documents of the flat token file ``path`` split by ``path.docs.npy``."""
    shards, side = TokenShards(path, dtype), path + DOCS_SUFFIX
    try:
        offsets = np.load(side, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"document offsets {side!r} are not a readable .npy: {exc}") from None
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or offsets.size < 1:
        raise DataError(f"document offsets {side!r} must be a non-empty 1-D integer array, not "
                        f"{offsets.dtype} of shape {offsets.shape}")
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets[0] != 0 or offsets[-1] != shards.num_tokens or \
            (offsets.size > 1 and np.diff(offsets).min() < 0):
        raise DataError(f"document offsets {side!r} must rise from 0 to the token count "
                        f"{shards.num_tokens} of {path!r}; they run {int(offsets[0])}.."
                        f"{int(offsets[-1])}")
    return Documents(path, shards.dtype, offsets, shards)


def open_documents(path: str, dtype: Optional[str] = None) -> Documents:
    """``PREFIX`` or ``PREFIX.idx`` / ``PREFIX.bin`` with an ``.idx`` (Megatron-LM), else a token
    file with ``FILE.bin.docs.npy``."""
    path = str(path)
    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    if os.path.isfile(prefix + ".idx"):
        return read_indexed(prefix)
    if os.path.isfile(path + DOCS_SUFFIX):
        return read_offsets(path, dtype)
    raise DataError(f"no document index for {path!r}: expected {prefix + '.idx'!r} "
                    f"(Megatron-LM) or {path + DOCS_SUFFIX!r} (token offsets)")


# ---------------------------------------------------------------------------- writing
def write_indexed(prefix: str, docs: Iterable, dtype: str = "uint16") -> tuple[int, int]:
    """Write ``PREFIX.bin`` and a Megatron-LM ``PREFIX.idx`` (one sequence per document),
    atomically (``files.atomic_group``: a bad id or any failure half-way leaves both files as
    they were; the ``.idx``, which records the ``.bin``'s size, is renamed last);
    (documents, tokens)."""
    if dtype not in TOKEN_CODES:
        raise DataError(f"index dtype {dtype!r} is not one of {', '.join(TOKEN_CODES)}")
    np_dtype, info, sizes = np.dtype(dtype).newbyteorder("<"), np.iinfo(dtype), []
    with atomic_group() as group:
        f = group.open(prefix + ".bin")
        for k, doc in enumerate(docs):
            doc = np.asarray(doc, dtype=np.int64).reshape(-1)
            bad = doc[(doc < info.min) | (doc > info.max)]
            if bad.size:
                raise DataError(f"document {k}: token id {int(bad[0])} does not fit {dtype}")
            if doc.size > np.iinfo(np.int32).max:
                raise DataError(f"document {k} has {doc.size} tokens: too many for an int32 "
                                "size")
            f.write(doc.astype(np_dtype).tobytes())
            sizes.append(doc.size)
        lengths = np.asarray(sizes, dtype=np.int64)
        pointers = (np.cumsum(lengths) - lengths) * np_dtype.itemsize
        doc_index = np.arange(len(sizes) + 1, dtype="<i8")
        f = group.open(prefix + ".idx")
        f.write(_HEADER.pack(MMIDIDX_MAGIC, MMIDIDX_VERSION, TOKEN_CODES[dtype], len(sizes),
                             len(doc_index)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.tobytes())
    return len(sizes), int(lengths.sum())


def write_documents(path: str, docs: Iterable, dtype: str = "uint16",
                    vocab_size: Optional[int] = None) -> tuple[int, int]:
    """Write a flat token file (``data.write_token_file``, with its sidecar) and
    ``path.docs.npy``, the three atomically together; (documents, tokens)."""
    docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    with atomic_group() as group:
        count = stage_token_file(group, path, docs, dtype, vocab_size)
        np.save(group.open(path + DOCS_SUFFIX), offsets, allow_pickle=False)
    return len(docs), count


# ---------------------------------------------------------------------------- order, packing
def _mix64_np(x: np.ndarray) -> np.ndarray:
    """``data._mix64`` on a uint64 array (wrapping arithmetic, the same values)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permutation(order: Optional[WindowOrder], size: int, epoch: int) -> np.ndarray:
    """``[order(p, epoch) for p in range(size)]`` at once (the identity for ``None``)."""
    if order is None:
        return np.arange(size, dtype=np.int64)
    keys = [np.uint64(k) for k in order._round_keys(epoch)]
    half, mask = np.uint64(order._half), np.uint64(order._mask)
    out = np.arange(size, dtype=np.uint64)
    todo = np.arange(size)
    while todo.size:  # cycle-walk the positions still outside [0, size)
        x = out[todo]
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64_np(key ^ right) & mask)
        out[todo] = (left << half) | right
        todo = todo[out[todo] >= np.uint64(size)]
    return out.astype(np.int64)


def pack(sizes: Sequence[int], capacity: int, open_rows: int = 8) -> list[list[int]]:
    """Greedy first-fit of items of ``sizes`` (each ``<= capacity``) into rows over a window of
    the ``open_rows`` latest open rows (module doc): the rows, as lists of item positions."""
    rows: list[list[int]] = []
    open_ids: list[int] = []
    free: list[int] = []
    for j, size in enumerate(sizes):
        if size > capacity:
            raise DataError(f"item {j} of size {size} exceeds the row capacity {capacity}")
        for k, room in enumerate(free):
            if room >= size:
                break
        else:
            k = len(free)
            rows.append([])
            open_ids.append(len(rows) - 1)
            free.append(capacity)
        rows[open_ids[k]].append(j)
        free[k] -= size
        if free[k] == 0:
            del open_ids[k], free[k]
        elif len(free) > open_rows:
            del open_ids[0], free[0]
    return rows


# ---------------------------------------------------------------------------- sampler
class DocumentSampler:
    """``sample(i)`` -> (tokens [max_len + 1] int64, segments [max_len + 1] int32) (module doc)."""

    def __init__(self, docs: Documents, max_len: int, mode: str = DEFAULT_MODE, seed: int = 0,
                 shuffle: bool = True, truncate: bool = True, vocab_size: Optional[int] = None,
                 open_rows: int = 8):
        if mode not in MODES:
            raise DataError(f"document mode {mode!r} is not one of {', '.join(MODES)}")
        for name, value in (("max_len", max_len), ("open_rows", open_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{name}={value!r} must be an integer >= 1")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise DataError(f"vocab_size={vocab_size!r} must be an integer >= 1")
        self.docs, self.max_len, self.mode = docs, max_len, mode
        self.row_len, self.vocab_size, self.open_rows = max_len + 1, vocab_size, open_rows
        lengths = docs.lengths()
        if not truncate:
            long = np.flatnonzero(lengths > self.row_len)
            if long.size:
                d = int(long[0])
                raise DataError(f"document {d} of {docs.path!r} has {int(lengths[d])} tokens, "
                                f"more than max_len + 1 = {self.row_len} (truncation is off)")
        self.doc_ids = np.flatnonzero(lengths > 0)
        if not self.doc_ids.size:
            raise DataError(f"{docs.path!r} holds no non-empty document")
        self.sizes = np.minimum(lengths[self.doc_ids], self.row_len)
        self.order = WindowOrder(len(self.doc_ids), seed) if shuffle else None
        self._epoch_rows: list[int] = []  # rows per packed epoch, epochs 0.. in order
        self._packed: tuple[int, list[list[int]]] = (-1, [])  # (epoch, rows of doc ids)

    # ---- which documents
    def epoch_size(self, epoch: int) -> int:
        """Samples in ``epoch``."""
        if self.mode == "truncate":
            return len(self.doc_ids)
        while len(self._epoch_rows) <= epoch:
            self._rows(len(self._epoch_rows))
        return self._epoch_rows[epoch]

    def documents(self, index: int) -> list[int]:
        """The documents (indices in the dataset) of sample ``index``, in row order."""
        index = operator.index(index)
        if index < 0:
            raise DataError(f"sample index {index} must be >= 0")
        if self.mode == "truncate":
            n = len(self.doc_ids)
            p, e = index % n, index // n
            return [int(self.doc_ids[self.order(p, e) if self.order is not None else p])]
        epoch = 0
        while index >= self.epoch_size(epoch):
            index -= self._epoch_rows[epoch]
            epoch += 1
        return list(self._rows(epoch)[index])

    def _rows(self, epoch: int) -> list[list[int]]:
        if self._packed[0] != epoch:
            perm = permutation(self.order, len(self.doc_ids), epoch)
            rows = pack(self.sizes[perm].tolist(), self.row_len, self.open_rows)
            ids = self.doc_ids[perm]
            self._packed = (epoch, [[int(ids[j]) for j in row] for row in rows])
            if epoch == len(self._epoch_rows):
                self._epoch_rows.append(len(rows))
        return self._packed[1]

    def lengths(self, index: int) -> tuple[int, ...]:
        """The real tokens of each document of sample ``index`` (after truncation)."""
        full = self.docs.offsets
        return tuple(min(int(full[d + 1] - full[d]), self.row_len)
                     for d in self.documents(index))

    def length_histogram(self, boundaries: Sequence[int]) -> "LengthHistogram":
        """The sampled documents' lengths (after truncation to ``max_len + 1``) by the bucket
        windows ``boundaries``, whose last must be ``max_len`` (``length_histogram``)."""
        bounds = tuple(boundaries)
        if bounds and bounds[-1] != self.max_len:
            raise DataError(f"the last bucket boundary {bounds[-1]} must be max_len "
                            f"{self.max_len}: the rows' length, which holds every document "
                            "after truncation")
        return length_histogram(self.docs.lengths()[self.doc_ids], bounds)

    # ---- the row
    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.zeros(self.row_len, dtype=np.int64)
        segments = np.zeros(self.row_len, dtype=np.int32)
        at = 0
        for k, d in enumerate(self.documents(index), start=1):
            part = self.docs.tokens(d, self.row_len - at)
            self._check_ids(index, d, part)
            tokens[at:at + part.size], segments[at:at + part.size] = part, k
            at += part.size
        return torch.from_numpy(tokens), torch.from_numpy(segments)

    def _check_ids(self, index: int, doc: int, part: np.ndarray) -> None:
        top = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int64).max
        bad = np.flatnonzero((part < 0) | (part >= top))
        if bad.size:
            limit = f"[0, {self.vocab_size})" if self.vocab_size is not None else ">= 0"
            raise DataError(f"sample {index}: token id {int(part[bad[0]])} (token {int(bad[0])} "
                            f"of document {doc} of {self.docs.path!r}) is not {limit}")


def document_sampler(config, path: str, mode: str = DEFAULT_MODE, dtype: Optional[str] = None,
                     seed: int = 0, shuffle: bool = True, truncate: bool = True,
                     open_rows: int = 8) -> DocumentSampler:
    """A ``DocumentSampler`` over ``path`` for ``config`` (its ``seq_len`` as ``max_len``, and
    its ``vocab_size``)."""
    return DocumentSampler(open_documents(path, dtype), config.seq_len, mode, seed, shuffle,
                           truncate, config.vocab_size, open_rows)


# ---------------------------------------------------------------------------- lengths
def bucket_index(lengths, windows: Sequence[int]) -> np.ndarray:
    """The length bucket of each document length (tokens) under bucket ``windows`` (strictly
    increasing): bucket ``b`` holds ``windows[b - 1] + 1 < n <= windows[b] + 1`` (a window of
    ``w`` inputs predicts ``w`` targets, so a document of ``w + 1`` tokens fits it; the first
    from 1); a length beyond the last window + 1 gets ``len(windows)``, no bucket. The one rule
    of ``length_histogram`` and ``bucket_data.BucketedDocuments``."""
    edges = np.asarray(windows, dtype=np.int64) + 1
    return np.searchsorted(edges, np.asarray(lengths, dtype=np.int64), side="left")


@dataclass(frozen=True)
class LengthHistogram:
    """Documents and tokens (after truncation to ``boundaries[-1] + 1``) per bucket of the
    windows ``boundaries`` (``bucket_index``); ``truncated``: documents cut to that length,
    counted in the last bucket."""

    boundaries: tuple[int, ...]
    documents: tuple[int, ...]
    tokens: tuple[int, ...]
    truncated: int = 0

    @property
    def shares(self) -> tuple[float, ...]:
        """Each bucket's share of the documents (sequences)."""
        total = sum(self.documents)
        return tuple(n / total for n in self.documents)

    def spec(self) -> str:
        """``LEN:SHARE,...`` for ``--hspmd-lengths`` / ``hspmd-launch plan --lengths``: the
        non-empty buckets, the last of them at the last window (the model's ``seq_len``, which
        the launcher requires of the last bucket) when the buckets after it are empty: the
        same documents fall in each bucket as under all the windows."""
        kept = [(b, s) for b, s in zip(self.boundaries, self.shares) if s > 0]
        kept[-1] = (self.boundaries[-1], kept[-1][1])
        return ",".join(f"{b}:{s:.12g}" for b, s in kept)


def length_histogram(lengths: Sequence[int], boundaries: Sequence[int]) -> LengthHistogram:
    """Bucket document ``lengths`` (each >= 1) by the windows ``boundaries`` (integers >= 1,
    strictly increasing, the last the rows' ``max_len``): a length over ``boundaries[-1] + 1``
    is truncated to it, as the sampler truncates rows, and counted in the last bucket. A
    one-line ``DataError`` names a bad boundary."""
    bounds = tuple(boundaries)
    if not bounds:
        raise DataError("no bucket boundary: give the buckets' windows, such as 512,8192")
    for k, b in enumerate(bounds):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise DataError(f"bucket boundary {b!r} must be an integer >= 1")
        if k and b <= bounds[k - 1]:
            raise DataError(f"bucket boundary {b} is not above the previous {bounds[k - 1]}: "
                            "boundaries must increase")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise DataError("no document length to bucket")
    if lengths.min() < 1:
        raise DataError(f"document length {int(lengths.min())} must be >= 1")
    row = int(bounds[-1]) + 1
    truncated = int((lengths > row).sum())
    lengths = np.minimum(lengths, row)
    which = bucket_index(lengths, bounds)
    docs = np.bincount(which, minlength=len(bounds))
    toks = np.bincount(which, weights=lengths, minlength=len(bounds))
    return LengthHistogram(tuple(int(b) for b in bounds), tuple(int(n) for n in docs),
                           tuple(int(n) for n in toks), truncated)


# ---------------------------------------------------------------------------- model side
def _batched(segments: torch.Tensor) -> torch.Tensor:
    if segments.dim() == 1:
        segments = segments.unsqueeze(0)
    if segments.dim() != 2:
        raise ValueError(f"segments of shape {tuple(segments.shape)} must be [L] or [b, L]")
    return segments


def block_mask(segments: torch.Tensor) -> torch.Tensor:
    """A bool SDPA mask [b, 1, L, L] (True: attend): causal, within one document; a padding
    position (segment 0) attends to itself only, so no softmax row is empty."""
    seg = _batched(segments)
    n = seg.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & (seg != 0).unsqueeze(-1)
    eye = torch.eye(n, dtype=torch.bool, device=seg.device)
    return ((same & causal) | eye).unsqueeze(1)


def loss_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, L - 1] bool: target ``j + 1`` counts iff positions ``j`` and ``j + 1`` are real
    tokens of the same document."""
    seg = _batched(segments)
    return (seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1])


def positions(segments: torch.Tensor) -> torch.Tensor:
    """[b, L] int64: each position's offset within its document (padding: within its run), the
    rotary positions that make a packed row equal its documents run alone."""
    seg = _batched(segments)
    idx = torch.arange(seg.shape[-1], device=seg.device).expand_as(seg)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


def loss_sum(logits: torch.Tensor, tokens: torch.Tensor,
             segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over the counted targets, their count) for ``logits`` [b, L - 1, V]
    of rows ``tokens`` [b, L] with ``segments`` [b, L]. The loss contract: a step's loss is the
    sum of these sums over every micro-batch and rank of the global batch divided by the sum of
    the counts, the mean over the global batch's real targets; padding and the position that
    ends a document (whose next token is another document's) count for nothing."""
    mask = loss_mask(segments)
    targets = _batched(tokens)[:, 1:]
    per = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), reduction="none")
    mask = mask.reshape(-1)
    return (per * mask.to(per.dtype)).sum(), int(mask.sum())

