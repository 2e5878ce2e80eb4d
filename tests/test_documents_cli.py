"""The data CLIs as a user meets them (``python -m hspmd_elastic.documents`` and
``python -m hspmd_elastic.data``): a failed ``make`` keeps the dataset it would have replaced,
``make`` into a missing directory creates it, every bad flag is one line naming that flag (exit
code 2, no traceback), and ``documents check --boundaries`` describes a corpus longer than the
model's ``seq_len`` with a ``--lengths`` spec the launcher and the bucketed sampler take."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from hspmd_elastic.data import main as data_cli
from hspmd_elastic.documents_cli import main as docs_cli
from hspmd_elastic.documents import open_documents, write_indexed

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))


def _one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr


def _bytes(*paths) -> list[bytes]:
    return [open(p, "rb").read() for p in paths]


# ---------------------------------------------------------------------------- defect 5
def test_a_failed_make_leaves_the_existing_dataset_byte_for_byte(tmp_path, capsys):
    prefix = str(tmp_path / "m")
    assert docs_cli(["make", prefix, "--docs", "100", "--vocab", "1000", "--max-len", "50"]) == 0
    before = _bytes(prefix + ".bin", prefix + ".idx")
    assert docs_cli(["make", prefix, "--docs", "100", "--vocab", "70000", "--max-len", "50"]) == 2
    assert "--vocab=70000 must be within 1..65536 for uint16" in capsys.readouterr().err
    assert _bytes(prefix + ".bin", prefix + ".idx") == before
    assert open_documents(prefix).num_docs == 100
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.idx"]  # no temporary file either


def test_a_make_that_fails_while_writing_leaves_the_existing_dataset(tmp_path):
    """Past validation, the write itself fails half-way: a real EFBIG from the kernel (a file
    size limit on the process, as a full disk or a quota would do)."""
    prefix = str(tmp_path / "m")
    made = _run("hspmd_elastic.documents", "make", prefix, "--docs", "30", "--vocab", "100",
                "--max-len", "20")
    assert made.returncode == 0, made.stderr
    before = _bytes(prefix + ".bin", prefix + ".idx")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.run([sys.executable, "-m", "hspmd_elastic.documents", "make", prefix,
                           "--docs", "2000", "--vocab", "100", "--max-len", "200"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, preexec_fn=small_files,
                          env=dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1"))
    _one_line_error(proc, "File too large")
    assert _bytes(prefix + ".bin", prefix + ".idx") == before
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.idx"]  # no temporary file either


# ---------------------------------------------------------------------------- defect 10
def test_make_into_a_missing_directory_creates_it(tmp_path):
    """The README's commands name a directory that need not exist yet."""
    prefix = tmp_path / "new" / "deeper" / "docs"
    made = _run("hspmd_elastic.documents", "make", str(prefix), "--docs", "20", "--vocab", "50",
                "--max-len", "16")
    assert made.returncode == 0, made.stderr
    assert open_documents(str(prefix)).num_docs == 20
    out = tmp_path / "other" / "train.bin"
    made = _run("hspmd_elastic.data", "make", str(out), "--tokens", "500", "--vocab", "100")
    assert made.returncode == 0, made.stderr
    assert out.stat().st_size == 1000 and (tmp_path / "other" / "train.bin.json").exists()


def test_a_negative_seed_is_one_line_naming_it(tmp_path):
    _one_line_error(_run("hspmd_elastic.documents", "make", str(tmp_path / "d"), "--docs", "5",
                         "--vocab", "50", "--max-len", "8", "--seed", "-1"),
                    "--seed=-1 must be >= 0")
    _one_line_error(_run("hspmd_elastic.data", "make", str(tmp_path / "t.bin"), "--tokens", "5",
                         "--vocab", "50", "--seed", "-1"), "--seed=-1 must be >= 0")
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_a_path_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    _one_line_error(_run("hspmd_elastic.documents", "make", str(tmp_path / "file" / "d"),
                         "--docs", "5", "--vocab", "50", "--max-len", "8"), "error: cannot make")
    _one_line_error(_run("hspmd_elastic.data", "make", str(tmp_path / "t.bin"),
                         "--text", str(tmp_path / "missing.txt")), "missing.txt")


# ---------------------------------------------------------------------------- defect 12
@pytest.mark.parametrize("argv, needle", [
    (["make", "{d}/m", "--docs", "5", "--vocab", "50", "--max-len", "0"], "--max-len=0 must be"),
    (["make", "{d}/m", "--docs", "5", "--vocab", "50", "--max-len", "8", "--long-len", "0"],
     "--long-len=0 must be"),
    (["make", "{d}/m", "--docs", "5", "--vocab", "300", "--max-len", "8", "--dtype", "int8"],
     "--vocab=300 must be within 1..128 for int8"),
    (["make", "{d}/m", "--docs", "5", "--vocab", "50", "--max-len", "8", "--long-share", "nan"],
     "--long-share=nan must be within [0, 1]"),
    (["check", "{d}/c", "--max-len", "0"], "--max-len=0 must be >= 1"),
    (["check", "{d}/c", "--max-len", "-5"], "--max-len=-5 must be >= 1"),
    (["check", "{d}/c", "--vocab", "0"], "--vocab=0 must be >= 1"),
    (["check", "{d}/c", "--boundaries", "0,8"], "bucket boundary=0 must be >= 1"),
])
def test_each_bad_documents_flag_is_one_line_naming_that_flag(tmp_path, capsys, argv, needle):
    write_indexed(str(tmp_path / "c"), [np.arange(5), np.arange(9)])
    argv = [a.format(d=tmp_path) for a in argv]
    assert docs_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert "--long-len" not in err or "--long-len" in argv, err
    assert not os.path.exists(tmp_path / "m.bin")


@pytest.mark.parametrize("argv, needle", [
    (["check", "{d}/t.bin", "--vocab", "0"], "--vocab=0 must be >= 1"),
    (["check", "{d}/t.bin", "--seq-len", "0"], "--seq-len=0 must be >= 1"),
])
def test_each_bad_data_check_flag_is_one_line_naming_that_flag(tmp_path, capsys, argv, needle):
    assert data_cli(["make", str(tmp_path / "t.bin"), "--tokens", "100", "--vocab", "10"]) == 0
    capsys.readouterr()
    assert data_cli([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


# ---------------------------------------------------------------------------- defect 9
@pytest.fixture
def long_corpus(tmp_path):
    """Documents of 1..40 tokens, many longer than a seq_len of 16."""
    rng = np.random.default_rng(0)
    lengths = list(range(1, 41)) * 3
    prefix = str(tmp_path / "long")
    write_indexed(prefix, [rng.integers(0, 64, size=n) for n in lengths])
    return prefix, lengths


def test_check_describes_a_corpus_longer_than_seq_len_with_a_spec_the_launcher_takes(
        long_corpus, capsys):
    from hspmd_elastic.bucket_data import bucketed_sampler
    from launcher.api import ElasticSettings
    from launcher.capacity import parse_lengths_flag

    prefix, lengths = long_corpus
    assert docs_cli(["check", prefix, "--max-len", "16", "--boundaries", "4,16"]) == 0
    out = capsys.readouterr().out
    # window 4 holds 1..5 tokens, window 16 holds 6..17 and every longer document, truncated
    short = sum(1 for n in lengths if n <= 5)
    cut = sum(1 for n in lengths if n > 17)
    assert f"window 4 (documents of 1..5 tokens): {short} documents" in out, out
    assert f"window 16 (documents of 6..17 tokens, {cut} truncated to 17): " \
           f"{len(lengths) - short} documents" in out, out
    spec = out.strip().splitlines()[-1].removeprefix("--lengths ")
    buckets = parse_lengths_flag(spec)  # what hspmd-launch --hspmd-lengths parses
    assert buckets[-1][0] == 16 and abs(buckets[0][1] - short / len(lengths)) < 1e-9
    ElasticSettings(model_profile=SimpleNamespace(seq_len=16), global_batch=8, lengths=buckets)
    config = SimpleNamespace(seq_len=16, vocab_size=64)
    sampler = bucketed_sampler(config, prefix, spec, global_batch=8)
    assert sum(len(s.doc_ids) for s in sampler.streams) == len(lengths)


def test_check_without_max_len_takes_the_last_boundary_and_refuses_a_mismatch(long_corpus,
                                                                             capsys):
    prefix, _ = long_corpus
    assert docs_cli(["check", prefix, "--boundaries", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "samples of max_len 16" in out and "--lengths 8:" in out and ",16:" in out, out
    assert docs_cli(["check", prefix, "--max-len", "16", "--boundaries", "8,17"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the last bucket boundary 17 must be --max-len 16" in err


def test_more_buckets_than_the_launcher_plans_are_refused(long_corpus, capsys):
    prefix, _ = long_corpus
    bounds = ",".join(str(w) for w in range(1, 40, 2))  # 20 non-empty buckets
    assert docs_cli(["check", prefix, "--boundaries", bounds]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at most 16" in err, err
