"""Global batches grouped by length bucket: the data side of in-step strategy switching.

``BucketedDocuments(base, windows, rows)`` wraps a ``documents.DocumentSampler`` in
``"truncate"`` mode (one document per row) and lays every global batch of ``sum(rows)`` rows out
by bucket, shortest first: rows ``[start_b, start_b + rows[b])`` of each global batch are
documents of bucket ``b``. Bucket ``b`` holds the documents (after the base's truncation to
``base.max_len + 1`` tokens) of ``windows[b - 1] + 1 < tokens <= windows[b] + 1``: a document of
``n`` tokens predicts ``n - 1`` targets from a window of ``n - 1`` inputs, so a bucket's rows fit a
model whose ``seq_len`` is its window. Promises:

* ``windows`` strictly increase, the last is the base's ``max_len`` (every document has a bucket);
  ``rows`` are positive, one per window; each bucket holds at least one document. Anything else
  is a one-line ``DataError`` naming the bad value (an empty bucket names its length range).
* Sample ``i`` (step ``s = i // G``, position ``j = i % G`` in bucket ``b``) is the
  ``k = s * rows[b] + (j - start_b)``-th document of bucket ``b``'s stream: the bucket's
  documents in dataset order, permuted per epoch of the stream by ``data.WindowOrder`` seeded
  from ``(seed, b)`` (the identity when the base does not shuffle). So ``sample(i)`` depends on
  the documents, the base's settings, ``windows``, ``rows`` and ``i`` only: every plan and every
  switch trains on the same rows, and a single plan run on this sampler computes what the
  bucketed run computes.
* ``sample(i)`` is the base's row format (tokens and segment ids, ``base.max_len + 1`` wide,
  padding 0), so a model at the full length reads it unchanged; ``lengths(i)`` and
  ``documents(i)`` as the base's. ``bucket_of(j)`` is the bucket of position ``j`` of a global
  batch, ``starts`` the first position of each bucket.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import numpy as np
import torch

from hspmd_elastic.data import DataError, WindowOrder
from hspmd_elastic.documents import DocumentSampler


class BucketedDocuments:
    """A document sampler whose global batches are grouped by length bucket (module doc)."""

    def __init__(self, base: DocumentSampler, windows: Sequence[int], rows: Sequence[int],
                 seed: int = 0):
        if base.mode != "truncate":
            raise DataError(f"length buckets need one document per row: document mode "
                            f"{base.mode!r} is not 'truncate'")
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
        self.max_len, self.row_len, self.mode = base.max_len, base.row_len, "truncate"
        self._positions = np.repeat(np.arange(len(rows)), rows)
        sizes = base.sizes  # tokens of base.doc_ids after truncation
        edges = np.asarray((0,) + windows) + 1
        self.streams: list[np.ndarray] = []
        self.orders: list[WindowOrder | None] = []
        for b in range(len(windows)):
            members = base.doc_ids[(sizes > edges[b]) & (sizes <= edges[b + 1])] if b else \
                base.doc_ids[sizes <= edges[1]]
            if not members.size:
                lo = 1 if b == 0 else windows[b - 1] + 2
                raise DataError(f"bucket {b} (documents of {lo}..{windows[b] + 1} tokens) holds "
                                f"no document of {base.docs.path!r}")
            self.streams.append(members)
            shuffled = base.order is not None
            self.orders.append(WindowOrder(len(members), seed * 1_000_003 + b)
                               if shuffled else None)

    def bucket_of(self, position: int) -> int:
        return int(self._positions[position])

    def documents(self, index: int) -> list[int]:
        index = operator.index(index)
        if index < 0:
            raise DataError(f"sample index {index} must be >= 0")
        step, j = divmod(index, self.global_batch)
        b = self.bucket_of(j)
        k = step * self.rows[b] + (j - self.starts[b])
        stream, order = self.streams[b], self.orders[b]
        p, epoch = k % len(stream), k // len(stream)
        return [int(stream[order(p, epoch) if order is not None else p])]

    def lengths(self, index: int) -> tuple[int, ...]:
        full = self.base.docs.offsets
        return tuple(min(int(full[d + 1] - full[d]), self.row_len)
                     for d in self.documents(index))

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.zeros(self.row_len, dtype=np.int64)
        segments = np.zeros(self.row_len, dtype=np.int32)
        (d,) = self.documents(index)
        part = self.base.docs.tokens(d, self.row_len)
        self.base._check_ids(index, d, part)
        tokens[:part.size], segments[:part.size] = part, 1
        return torch.from_numpy(tokens), torch.from_numpy(segments)


def bucketed_sampler(config, path: str, lengths: str, global_batch: int,
                     dtype: Optional[str] = None, seed: int = 0) -> BucketedDocuments:
    """The documents at ``path``, one per row (truncated to ``config.seq_len + 1`` tokens),
    grouped by the buckets of ``lengths`` (``--hspmd-lengths``' ``LEN:SHARE,...``: windows and,
    from the shares, each bucket's rows of ``global_batch`` as the planner splits them,
    ``planner.bucket_rows``)."""
    from hspmd_elastic.documents import document_sampler
    from hspmd_elastic.planner import PlannerError
    from hspmd_elastic.planner.buckets import bucket_rows, parse_lengths

    try:
        buckets = parse_lengths(lengths)
        rows = bucket_rows([b.share for b in buckets], global_batch)
    except PlannerError as exc:
        raise DataError(f"lengths {lengths!r}: {exc}") from None
    base = document_sampler(config, path, "truncate", dtype=dtype, seed=seed)
    return BucketedDocuments(base, [b.max_len for b in buckets], rows, seed=seed)
