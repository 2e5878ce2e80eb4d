"""Global batches grouped by length bucket: the data side of in-step strategy switching.

``BucketedDocuments(base, windows, rows)`` wraps a ``documents.DocumentSampler`` and lays every
global batch of ``sum(rows)`` rows out by bucket, shortest first: rows ``[start_b, start_b +
rows[b])`` of each global batch are rows of bucket ``b``. Bucket ``b`` holds the documents (after
the base's truncation to ``base.max_len + 1`` tokens) of ``windows[b - 1] + 1 < tokens <=
windows[b] + 1``: a document of ``n`` tokens predicts ``n - 1`` targets from a window of ``n -
1`` inputs, so a bucket's rows fit a model whose ``seq_len`` is its window. Promises:

* ``windows`` strictly increase, the last is the base's ``max_len`` (every document has a bucket);
  ``rows`` are positive, one per window; each bucket holds at least one document. Anything else
  is a one-line ``DataError`` naming the bad value (an empty bucket names its length range).
* Each bucket is a stream of its own: a ``DocumentSampler`` over the bucket's documents only
  (the others count as empty) at the bucket's window, in the base's mode, seeded from
  ``(seed, b)``: in ``"pack"`` mode (the default) whole documents of the bucket packed into rows
  of ``window + 1`` tokens (short documents share a row, and attention and the loss stay inside
  each, ``documents.block_mask``/``loss_mask``), in ``"truncate"`` mode one document per row.
* Sample ``i`` (step ``s = i // G``, position ``j = i % G`` in bucket ``b``) is sample
  ``k = s * rows[b] + (j - start_b)`` of bucket ``b``'s stream. So ``sample(i)`` depends on
  the documents, the base's settings, ``windows``, ``rows`` and ``i`` only: every plan and every
  switch trains on the same rows, and a single plan run on this sampler computes what the
  bucketed run computes.
* ``sample(i)`` is the base's row format (tokens and segment ids, ``base.max_len + 1`` wide,
  padding 0 after the bucket's window), so a model at the full length reads it unchanged;
  ``lengths(i)`` and ``documents(i)`` as the stream's. ``bucket_of(j)`` is the bucket of
  position ``j`` of a global batch, ``starts`` the first position of each bucket.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from hspmd_elastic.data import DataError
from hspmd_elastic.documents import DEFAULT_MODE, DocumentSampler, Documents, bucket_index, \
    document_sampler
from hspmd_elastic.planner import PlannerError
from hspmd_elastic.planner.buckets import bucket_rows, parse_lengths


@dataclass
class _Only(Documents):
    """The same documents with every one outside ``keep`` empty (never sampled)."""

    keep: np.ndarray = None

    def lengths(self) -> np.ndarray:
        return np.where(self.keep, np.diff(self.offsets), 0)


class BucketedDocuments:
    """A document sampler whose global batches are grouped by length bucket (module doc)."""

    def __init__(self, base: DocumentSampler, windows: Sequence[int], rows: Sequence[int],
                 seed: int = 0):
        windows, rows = tuple(windows), tuple(rows)
        if not windows or len(windows) != len(rows):
            raise DataError(f"{len(windows)} bucket window(s) and {len(rows)} row count(s): "
                            "need one row count per window, at least one")
        for what, values in (("window", windows), ("rows", rows)):
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise DataError(f"bucket {what} {v!r} must be an integer >= 1")
        for a, b in zip(windows, windows[1:]):
            if b <= a:
                raise DataError(f"bucket windows {list(windows)} are not strictly increasing "
                                f"({b} after {a})")
        if windows[-1] != base.max_len:
            raise DataError(f"the last bucket window {windows[-1]} is not the documents' "
                            f"max_len {base.max_len}: a document would have no bucket")
        self.base, self.windows, self.rows = base, windows, rows
        self.global_batch = sum(rows)
        self.starts = tuple(int(x) for x in np.cumsum((0,) + rows[:-1]))
        self.max_len, self.row_len, self.mode = base.max_len, base.row_len, base.mode
        self._positions = np.repeat(np.arange(len(rows)), rows)
        docs = base.docs
        truncated = np.minimum(docs.lengths(), base.row_len)  # what the base samples
        which = np.where(truncated > 0, bucket_index(truncated, windows), -1)
        self.streams: list[DocumentSampler] = []
        for b, window in enumerate(windows):
            keep = which == b
            if not keep.any():
                lo = 1 if b == 0 else windows[b - 1] + 2
                raise DataError(f"bucket {b} (documents of {lo}..{window + 1} tokens) holds "
                                f"no document of {docs.path!r}")
            only = _Only(docs.path, docs.dtype, docs.offsets, docs.source, keep=keep)
            self.streams.append(DocumentSampler(
                only, window, base.mode, seed=seed * 1_000_003 + b,
                shuffle=base.order is not None, truncate=True, vocab_size=base.vocab_size,
                open_rows=base.open_rows))

    def bucket_of(self, position: int) -> int:
        return int(self._positions[position])

    def _locate(self, index: int) -> tuple[DocumentSampler, int]:
        """The bucket stream of sample ``index`` and the sample of that stream it is."""
        index = operator.index(index)
        if index < 0:
            raise DataError(f"sample index {index} must be >= 0")
        step, j = divmod(index, self.global_batch)
        b = self.bucket_of(j)
        return self.streams[b], step * self.rows[b] + (j - self.starts[b])

    def documents(self, index: int) -> list[int]:
        stream, k = self._locate(index)
        return stream.documents(k)

    def lengths(self, index: int) -> tuple[int, ...]:
        stream, k = self._locate(index)
        return stream.lengths(k)

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream, k = self._locate(index)
        tokens, segments = stream.sample(k)
        pad = self.row_len - tokens.numel()
        return (torch.nn.functional.pad(tokens, (0, pad)),
                torch.nn.functional.pad(segments, (0, pad)))


def bucketed_sampler(config, path: str, lengths: str, global_batch: int,
                     dtype: Optional[str] = None, seed: int = 0,
                     mode: str = DEFAULT_MODE) -> BucketedDocuments:
    """The documents at ``path`` (truncated to ``config.seq_len + 1`` tokens), packed within
    each bucket (``mode="pack"``, the default) or one per row (``"truncate"``), grouped by the
    buckets of ``lengths`` (``--hspmd-lengths``' ``LEN:SHARE,...``: windows and, from the
    shares, each bucket's rows of ``global_batch`` as the planner splits them,
    ``planner.bucket_rows``)."""
    try:
        buckets = parse_lengths(lengths)
        rows = bucket_rows([b.share for b in buckets], global_batch)
    except PlannerError as exc:
        raise DataError(f"lengths {lengths!r}: {exc}") from None
    base = document_sampler(config, path, mode, dtype=dtype, seed=seed)
    return BucketedDocuments(base, [b.max_len for b in buckets], rows, seed=seed)
