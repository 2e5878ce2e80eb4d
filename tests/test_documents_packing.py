"""Packing is the documents' default, and it trains on exactly what padding trains on: the same
targets (the global loss's count is equal, as an integer) and the same per-document losses
(float64, 1e-12), for the single sampler and inside each length bucket; padding one document per
row stays available as ``mode="truncate"``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hspmd_elastic.bucket_data import BucketedDocuments, bucketed_sampler
from hspmd_elastic.documents import (DEFAULT_MODE, MODES, DocumentSampler, document_sampler,
                                     loss_mask, open_documents, write_indexed)
from hspmd_elastic.documents_cli import main as docs_cli
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.init import full_params
from hspmd_elastic.graph.reference import reference_loss

pytestmark = pytest.mark.timeout(180)

CONFIG = ModelConfig(vocab_size=40, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32,
                     seq_len=15, dtype="float64")
# 1-token documents predict nothing; 20 and 31 tokens are cut to the row's 16
LENGTHS = [5, 1, 0, 12, 3, 9, 2, 20, 4, 7, 6, 1, 11, 8, 16, 31, 2, 3]
TOL = 1e-12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, CONFIG.vocab_size, size=n, dtype=np.int64) for n in LENGTHS]
    prefix = str(tmp_path_factory.mktemp("packing") / "corpus")
    write_indexed(prefix, docs, "uint16")
    return prefix


@pytest.fixture(scope="module")
def params():
    return full_params(CONFIG, seed=3)


def _epoch(sampler) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Every row of epoch 0: (tokens, segments, the documents of the row)."""
    return [(*sampler.sample(i), sampler.documents(i)) for i in range(sampler.epoch_size(0))]


def _targets(rows) -> int:
    """The global loss's denominator: the counted targets of every row (``loss_mask``)."""
    return sum(int(loss_mask(seg).sum()) for _, seg, _ in rows)


def _document_losses(rows, params) -> dict[int, tuple[float, int]]:
    """document -> (its summed loss, its counted targets), each document's positions taken
    alone out of the row it was sampled into (the others' segments set to padding)."""
    out: dict[int, tuple[float, int]] = {}
    for tokens, seg, docs in rows:
        for k, doc in enumerate(docs, start=1):
            only = torch.where(seg == k, seg, torch.zeros_like(seg)).unsqueeze(0)
            count = int(loss_mask(only).sum())
            if count == 0:  # a one-token document predicts nothing, packed or padded
                out[doc] = (0.0, 0)
                continue
            mean = reference_loss(params, tokens.unsqueeze(0), CONFIG, only)
            assert torch.isfinite(mean), (doc, float(mean))
            out[doc] = (float(mean) * count, count)
    return out


def _same(packed: dict, padded: dict) -> None:
    assert sorted(packed) == sorted(padded)  # every document, none missing
    for doc, (loss, count) in padded.items():
        assert packed[doc][1] == count, doc
        assert math.isfinite(packed[doc][0]) and abs(packed[doc][0] - loss) <= TOL, \
            (doc, packed[doc][0], loss)


def test_packing_is_the_default_and_padding_stays_available(corpus, tmp_path, capsys):
    assert DEFAULT_MODE == "pack" and MODES[0] == "pack" and "truncate" in MODES
    docs = open_documents(corpus)
    assert DocumentSampler(docs, 15).mode == "pack"
    assert document_sampler(CONFIG, corpus).mode == "pack"
    bucketed = bucketed_sampler(CONFIG, corpus, "4:0.5,15:0.5", global_batch=4)
    assert [s.mode for s in bucketed.streams] == ["pack", "pack"]
    padded = DocumentSampler(docs, 15, "truncate")
    assert padded.mode == "truncate" and padded.epoch_size(0) == sum(n > 0 for n in LENGTHS)
    assert DocumentSampler(docs, 15).epoch_size(0) < padded.epoch_size(0)  # fewer rows
    assert docs_cli(["check", corpus, "--max-len", "15"]) == 0
    assert " pack samples of max_len 15 " in capsys.readouterr().out


def test_packed_and_padded_rows_count_the_same_targets_and_document_losses(corpus, params):
    docs = open_documents(corpus)
    packed = _epoch(DocumentSampler(docs, 15, seed=2))
    padded = _epoch(DocumentSampler(docs, 15, "truncate", seed=2))
    expected = sum(min(n, 16) - 1 for n in LENGTHS if n)  # every document's targets, cut ones too
    assert _targets(packed) == _targets(padded) == expected
    assert any(len(d) > 1 for _, _, d in packed)  # some rows really hold several documents
    by_packed, by_padded = _document_losses(packed, params), _document_losses(padded, params)
    _same(by_packed, by_padded)
    # the global loss (sum over the batch / count) is the same mean, and so is the model's own
    # loss over whole packed rows: documents never see each other
    total = sum(loss for loss, _ in by_padded.values())
    rows_loss = sum(float(reference_loss(params, t.unsqueeze(0), CONFIG, s.unsqueeze(0)))
                    * int(loss_mask(s).sum()) for t, s, _ in packed if loss_mask(s).any())
    assert abs(rows_loss - total) <= TOL * expected, (rows_loss, total)


def test_inside_each_bucket_packing_keeps_the_targets_and_losses(corpus, params):
    docs = open_documents(corpus)
    windows = [4, 15]

    def streams(mode: str):
        base = DocumentSampler(docs, 15, mode, seed=1)
        return BucketedDocuments(base, windows, [1, 1], seed=1).streams

    for window, packed, padded in zip(windows, streams("pack"), streams("truncate")):
        assert packed.mode == "pack" and padded.mode == "truncate"
        rows_packed, rows_padded = _epoch(packed), _epoch(padded)
        assert _targets(rows_packed) == _targets(rows_padded) > 0, window
        assert all(t.numel() == window + 1 for t, _, _ in rows_packed)
        pad = lambda rows: [(torch.nn.functional.pad(t, (0, 15 - window)),  # noqa: E731
                             torch.nn.functional.pad(s, (0, 15 - window)), d) for t, s, d in rows]
        _same(_document_losses(pad(rows_packed), params),
              _document_losses(pad(rows_padded), params))


def test_a_missing_or_wrong_document_fails_the_comparison():
    """The comparison itself can fail: a missing document, a different count, a NaN."""
    good = {1: (2.0, 3), 2: (1.0, 1)}
    for bad in ({1: (2.0, 3)}, {1: (2.0, 2), 2: (1.0, 1)}, {1: (math.nan, 3), 2: (1.0, 1)},
                {1: (2.0 + 1e-9, 3), 2: (1.0, 1)}):
        with pytest.raises(AssertionError):
            _same(bad, good)

