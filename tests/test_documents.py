"""Variable-length documents (hspmd_elastic/documents/): Megatron-LM's .idx read back as written
(and as Megatron lays it out by hand), an .idx that does not match its .bin refused in one line,
token-offset sidecars, samples keyed only by the index, packing that keeps documents whole within
the row, the length histogram, and the block mask and loss mask equal to running each document
alone."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.data import DataError, WindowOrder
from hspmd_elastic.documents import (DocumentSampler, block_mask, length_histogram, loss_mask,
                                     loss_sum, open_documents, pack, permutation, positions,
                                     read_indexed, write_documents, write_indexed)
from hspmd_elastic.documents_cli import main as docs_cli
from hspmd_elastic.planner import parse_lengths

pytestmark = pytest.mark.timeout(120)

HEADER = 34  # magic 9, version 8, dtype code 1, sequences 8, document indices 8


def _docs(lengths, vocab: int = 50, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n, dtype=np.int64) for n in lengths]


LENGTHS = [5, 1, 0, 12, 3, 9, 2, 30, 4, 7, 6, 1, 11, 8]


@pytest.fixture
def indexed(tmp_path):
    docs = _docs(LENGTHS)
    prefix = str(tmp_path / "corpus")
    assert write_indexed(prefix, docs, "uint16") == (len(docs), sum(LENGTHS))
    return prefix, docs


def _one_line(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------- formats
@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_indexed_round_trip(tmp_path, dtype):
    docs = _docs(LENGTHS, vocab=40_000 if dtype == "uint16" else 100_000)
    prefix = str(tmp_path / "c")
    write_indexed(prefix, docs, dtype)
    for path in (prefix, prefix + ".idx", prefix + ".bin"):
        got = open_documents(path)
        assert got.num_docs == len(docs) and got.num_tokens == sum(LENGTHS)
        assert got.dtype.name == dtype and list(got.lengths()) == LENGTHS
        for d, doc in enumerate(docs):
            assert np.array_equal(got.tokens(d), doc) and got.tokens(d).dtype == np.int64
        assert np.array_equal(got.tokens(3, 4), docs[3][:4])


def test_reads_megatrons_layout_with_several_sequences_per_document(tmp_path):
    """An index laid out by hand as Megatron-LM's _IndexWriter does (uint16, code 8), where
    document 0 is sequences 0 and 1: documents are the sequences between document indices."""
    seqs = _docs([3, 4, 2, 5])
    sizes = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 2
    doc_index = [0, 2, 3, 4]
    with open(tmp_path / "m.bin", "wb") as f:
        f.write(np.concatenate(seqs).astype("<u2").tobytes())
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
                + np.asarray(doc_index, "<i8").tobytes())
    got = read_indexed(str(tmp_path / "m"))
    assert got.num_docs == 3 and list(got.lengths()) == [7, 2, 5]
    assert np.array_equal(got.tokens(0), np.concatenate(seqs[:2]))
    assert np.array_equal(got.tokens(2), seqs[3])


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


S, D1 = len(LENGTHS), len(LENGTHS) + 1  # sequences, document indices


@pytest.mark.parametrize("damage,needle", [
    (lambda p: open(p + ".bin", "r+b").truncate(2 * sum(LENGTHS) - 2),
     f"corpus.bin' is {2 * sum(LENGTHS) - 2} bytes but"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), f"holds {sum(LENGTHS)} uint16 tokens"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 99)), "dtype code 99 is not one of"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 6)), "code 6 (float64) is not a token"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 4)),  # int32: pointers in 4-byte items
     "sequence 1's pointer is 10, not 20 (the sizes before it x 4 bytes): a wrong dtype code"),
    (lambda p: _patch(p + ".idx", 0, b"NOTANIDX"), "is not a Megatron-LM index"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "index version 2"),
    (lambda p: open(p + ".idx", "ab").write(b"\0"), "but its header promises"),
    (lambda p: _patch(p + ".idx", HEADER, struct.pack("<i", -1)), "negative size -1"),
    (lambda p: _patch(p + ".idx", HEADER + 4 * S + 8 * 3, struct.pack("<q", 7)),
     "sequence 3's pointer is 7, not 12"),
    (lambda p: _patch(p + ".idx", HEADER + 12 * S + 8 * (D1 - 1), struct.pack("<q", 3)),
     f"must rise from 0 to the sequence count {S}"),
    (lambda p: __import__("os").remove(p + ".bin"), "corpus.bin' does not exist"),
])
def test_an_idx_that_does_not_match_its_bin_is_one_line(indexed, damage, needle):
    prefix, _ = indexed
    damage(prefix)
    with pytest.raises(DataError) as info:
        open_documents(prefix)
    message = _one_line(info)
    assert needle in message and "corpus" in message


def test_token_file_with_offsets_sidecar(tmp_path):
    docs = _docs(LENGTHS)
    path = str(tmp_path / "t.bin")
    write_documents(path, docs, "uint16", vocab_size=50)
    got = open_documents(path)
    assert list(got.lengths()) == LENGTHS and got.dtype.name == "uint16"
    assert all(np.array_equal(got.tokens(d), doc) for d, doc in enumerate(docs))
    np.save(path + ".docs.npy", np.asarray([0, 5, 3, sum(LENGTHS)]))
    with pytest.raises(DataError) as info:
        open_documents(path)
    assert "must rise from 0 to the token count" in _one_line(info)
    np.save(path + ".docs.npy", np.asarray([0, 5, sum(LENGTHS) + 1]))
    with pytest.raises(DataError, match=r"they run 0\.\.%d" % (sum(LENGTHS) + 1)):
        open_documents(path)
    with pytest.raises(DataError, match="no document index for"):
        open_documents(str(tmp_path / "none.bin"))


# ---------------------------------------------------------------------------- samples
def test_permutation_is_window_order_at_once():
    for size in (1, 2, 3, 7, 100, 1000):
        order = WindowOrder(size, seed=11)
        for epoch in (0, 3):
            assert permutation(order, size, epoch).tolist() == \
                [order(p, epoch) for p in range(size)]
    assert permutation(None, 5, 2).tolist() == list(range(5))


def test_truncate_mode_is_one_document_per_sample(indexed):
    prefix, docs = indexed
    nonempty = [d for d, n in enumerate(LENGTHS) if n]
    plain = DocumentSampler(open_documents(prefix), max_len=7, mode="truncate", shuffle=False)
    for i in range(2 * len(nonempty)):
        d = nonempty[i % len(nonempty)]
        tokens, segments = plain.sample(i)
        n = min(len(docs[d]), 8)
        assert tokens.shape == segments.shape == (8,)
        assert tokens.dtype == torch.int64 and segments.dtype == torch.int32
        assert tokens[:n].tolist() == docs[d][:n].tolist() and not tokens[n:].any()
        assert segments.tolist() == [1] * n + [0] * (8 - n)
        assert plain.lengths(i) == (n,) and plain.documents(i) == [d]
    shuffled = DocumentSampler(open_documents(prefix), max_len=7, mode="truncate", seed=4)
    order = WindowOrder(len(nonempty), 4)
    assert [shuffled.documents(i)[0] for i in range(len(nonempty))] == \
        [nonempty[order(p, 0)] for p in range(len(nonempty))]


@pytest.mark.parametrize("mode", ["truncate", "pack"])
def test_samples_depend_only_on_the_index(indexed, mode):
    prefix, _ = indexed
    make = lambda: DocumentSampler(open_documents(prefix), 15, mode, seed=3)  # noqa: E731
    first = make()
    forward = [first.sample(i) for i in range(40)]
    other = make()  # a fresh sampler, read backwards (across epochs) then at random
    for i in list(range(39, -1, -1)) + [17, 3, 33, 0]:
        tokens, segments = other.sample(i)
        assert torch.equal(tokens, forward[i][0]) and torch.equal(segments, forward[i][1])
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(forward, forward[1:]))


def test_pack_mode_keeps_documents_whole_and_visits_each_once_per_epoch(indexed):
    prefix, docs = indexed
    sampler = DocumentSampler(open_documents(prefix), 15, "pack", seed=1)
    for epoch, base in ((0, 0), (1, sampler.epoch_size(0))):
        seen = []
        for i in range(base, base + sampler.epoch_size(epoch)):
            tokens, segments = sampler.sample(i)
            ids, lengths = sampler.documents(i), sampler.lengths(i)
            assert sum(lengths) <= 16 and len(ids) == int(segments.max())
            at = 0
            for k, (d, n) in enumerate(zip(ids, lengths), start=1):
                assert n == min(len(docs[d]), 16)
                assert tokens[at:at + n].tolist() == docs[d][:n].tolist()
                assert (segments[at:at + n] == k).all()
                at += n
            assert not segments[at:].any() and not tokens[at:].any()
            seen += ids
        assert sorted(seen) == [d for d, n in enumerate(LENGTHS) if n]
    assert sampler.lengths(0) != () and sampler.epoch_size(0) < 13  # rows hold several documents


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=60), st.integers(20, 40), st.integers(1, 5))
def test_pack_is_first_fit_never_over_the_row(sizes, capacity, open_rows):
    rows = pack(sizes, capacity, open_rows)
    assert sorted(j for row in rows for j in row) == list(range(len(sizes)))
    for row in rows:
        assert row == sorted(row) and 0 < sum(sizes[j] for j in row) <= capacity
    for r, row in enumerate(rows):  # row r opened only because the rows before had no room
        j = row[0]
        for q in range(max(0, r - open_rows), r):
            used = sum(sizes[x] for x in rows[q] if x < j)
            assert capacity - used < sizes[j], (r, q)


def test_a_document_longer_than_the_row_is_truncated_or_one_line(indexed):
    prefix, docs = indexed
    with pytest.raises(DataError) as info:
        DocumentSampler(open_documents(prefix), 9, "pack", truncate=False)
    assert _one_line(info) == (f"document 3 of {prefix + '.idx'!r} has 12 tokens, more than "
                               "max_len + 1 = 10 (truncation is off)")
    sampler = DocumentSampler(open_documents(prefix), 9, "pack", shuffle=False)
    rows = [sampler.documents(i) for i in range(sampler.epoch_size(0))]
    row = next(i for i, ids in enumerate(rows) if 7 in ids)  # document 7 has 30 tokens
    assert rows[row] == [7] and sampler.sample(row)[0].tolist() == docs[7][:10].tolist()
    DocumentSampler(open_documents(prefix), 29, truncate=False)  # 30 tokens fit max_len 29


def test_bad_sampler_arguments_and_ids_are_one_line(indexed):
    prefix, _ = indexed
    docs = open_documents(prefix)
    for kwargs, needle in (({"mode": "zip"}, "document mode 'zip'"),
                           ({"max_len": 0}, "max_len=0 must be"),
                           ({"open_rows": 0}, "open_rows=0 must be")):
        with pytest.raises(DataError, match=needle):
            DocumentSampler(docs, **{"max_len": 8, **kwargs})
    with pytest.raises(DataError, match="sample index -1"):
        DocumentSampler(docs, 8).sample(-1)
    with pytest.raises(DataError) as info:
        DocumentSampler(docs, 8, shuffle=False, vocab_size=3).sample(0)
    assert "is not [0, 3)" in _one_line(info) and "of document 0 of" in str(info.value)


def test_length_histogram_feeds_the_planner(indexed):
    """Boundaries are the buckets' windows, as the sampler and the launcher read them: window w
    holds documents of up to w + 1 tokens, the last is max_len, and a longer document is
    truncated to max_len + 1 and counted in the last bucket."""
    prefix, _ = indexed
    sampler = DocumentSampler(open_documents(prefix), 15)
    hist = sampler.length_histogram([4, 8, 15])
    assert hist.documents == (6, 4, 3) and hist.tokens == (16, 30, 39) and hist.truncated == 1
    assert sum(hist.tokens) == sum(min(n, 16) for n in LENGTHS)
    buckets = parse_lengths(hist.spec())
    assert [b.max_len for b in buckets] == [4, 8, 15]
    assert [round(b.share, 9) for b in buckets] == [round(n / 13, 9) for n in (6, 4, 3)]
    # empty buckets are left out; an empty last one gives its window to the last non-empty
    assert length_histogram([1, 5], [1, 2, 4]).spec() == "1:0.5,4:0.5"
    assert length_histogram([1, 2], [1, 2, 3]).spec() == "3:1"
    for bounds, needle in (([8, 4, 15], "boundary 4 is not above the previous 8"),
                           ([0, 15], "boundary 0 must be"), ([], "no bucket boundary"),
                           ([4, 8], "the last bucket boundary 8 must be max_len 15")):
        with pytest.raises(DataError) as info:
            sampler.length_histogram(bounds)
        assert needle in _one_line(info)


def test_the_histogram_buckets_documents_as_the_bucketed_sampler_does(indexed):
    """One rule (documents.bucket_index): each bucket of the histogram holds exactly the
    documents that bucket_data.BucketedDocuments streams in that bucket, truncated ones too."""
    from hspmd_elastic.bucket_data import BucketedDocuments

    prefix, _ = indexed
    for windows in ([4, 8, 15], [1, 3, 11, 15], [15]):
        sampler = DocumentSampler(open_documents(prefix), 15, shuffle=False)
        hist = sampler.length_histogram(windows)
        bucketed = BucketedDocuments(sampler, windows, [1] * len(windows))
        assert hist.documents == tuple(len(s.doc_ids) for s in bucketed.streams), windows
        assert hist.tokens == tuple(int(s.sizes.sum()) for s in bucketed.streams), windows


# ---------------------------------------------------------------------------- masks and loss
def _packed_row(seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Segments of a 24-position row holding documents of 5, 1, 9 and 6 tokens, then padding."""
    spans, at, seg = [], 0, torch.zeros(24, dtype=torch.int32)
    for k, n in enumerate((5, 1, 9, 6), start=1):
        seg[at:at + n] = k
        spans.append((at, at + n))
        at += n
    return seg, spans


def test_block_mask_attention_equals_each_document_alone():
    seg, spans = _packed_row()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    mask = block_mask(torch.stack([seg, seg]))
    assert mask.shape == (2, 1, 24, 24) and mask.dtype == torch.bool
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(packed).all()  # padding attends to itself: no empty softmax row
    for lo, hi in spans:
        alone = F.scaled_dot_product_attention(q[..., lo:hi, :], k[..., lo:hi, :],
                                               v[..., lo:hi, :], is_causal=True)
        torch.testing.assert_close(packed[..., lo:hi, :], alone, rtol=0, atol=1e-12)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the mask matters
    assert not torch.allclose(causal[..., 5:15, :], packed[..., 5:15, :])
    assert not mask[0, 0, 21:, :21].any() and not mask[0, 0, :21, 21:].any()  # padding apart
    assert positions(seg)[0, :15].tolist() == [0, 1, 2, 3, 4, 0] + list(range(9))


def test_loss_mask_counts_real_targets_of_the_same_document():
    seg, spans = _packed_row()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (24,), generator=gen)
    logits = torch.randn(1, 23, 11, dtype=torch.float64, generator=gen)
    total, count = loss_sum(logits, tokens, seg)
    alone, alone_count = torch.zeros((), dtype=torch.float64), 0
    for lo, hi in spans:  # each document alone: its own targets, nothing across its end
        alone = alone + F.cross_entropy(logits[0, lo:hi - 1], tokens[lo + 1:hi], reduction="sum")
        alone_count += hi - lo - 1
    assert count == alone_count == 4 + 0 + 8 + 5
    torch.testing.assert_close(total, alone, rtol=0, atol=1e-12)
    mask = loss_mask(seg)[0]
    assert mask.shape == (23,) and not mask[4] and not mask[5] and not mask[20:].any()
    other = tokens.clone()
    other[21:] = 7
    other[5] = (tokens[5] + 1) % 11  # the target of a 1-token document, and padding
    assert loss_sum(logits, other, seg)[0] == total  # change nothing that does not count


# ---------------------------------------------------------------------------- CLI
def test_cli_make_and_check(tmp_path, capsys):
    prefix = str(tmp_path / "demo")
    assert docs_cli(["make", prefix, "--docs", "50", "--vocab", "100", "--max-len", "20",
                     "--seed", "1"]) == 0
    docs = open_documents(prefix)
    assert docs.num_docs == 50 and 1 <= docs.lengths().min() and docs.lengths().max() <= 20
    assert docs_cli(["check", prefix, "--vocab", "100", "--max-len", "19", "--mode", "pack",
                     "--boundaries", "8,19"]) == 0
    out = capsys.readouterr().out
    assert "50 documents (0 empty)" in out and "pack samples of max_len 19" in out
    assert "lengths %d..%d" % (docs.lengths().min(), docs.lengths().max()) in out
    assert "--lengths 8:" in out
    assert docs_cli(["check", prefix, "--vocab", "10"]) == 2
    assert docs_cli(["check", prefix, "--boundaries", "8,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is not in [0, 10)" in err[0] and "bucket boundary 'x'" in err[1] and len(err) == 2
