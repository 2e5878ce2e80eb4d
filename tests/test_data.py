"""Token datasets on disk (hspmd_elastic/data.py): the documented window mapping, the same global
batch rows under every plan, a shard directory equal to the one file it splits, reads that touch
only the sample's window, the bad-file errors, the CLI, and examples/elastic_llama.py trained on a
token file by two gloo workers under two plans, equal to the dense reference, or stopped in one
line by an out-of-vocabulary id."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from _elastic import CONFIG, ROOT, assemble
from hspmd_elastic.data import (DataError, WindowOrder, memmap_opener, token_sampler,
                                write_token_file, write_token_shards)
from hspmd_elastic.data import main as data_cli
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.reference import reference_train
from hspmd_elastic.plan import Pipeline, Plan, Stage, simple_plan
from hspmd_elastic.runtime import global_batch_at

MODEL = ModelConfig(**CONFIG)  # vocab 32, seq_len 8
L = MODEL.seq_len


def _tokens(n: int, vocab: int = MODEL.vocab_size, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int64)


@pytest.fixture
def token_file(tmp_path):
    """1001 tokens (125 windows of 9 tokens at stride 8) in ``tokens.bin`` with a sidecar."""
    tokens = _tokens(1001)
    path = str(tmp_path / "tokens.bin")
    write_token_file(path, [tokens], "uint16", MODEL.vocab_size)
    return path, tokens


# ---------------------------------------------------------------------------- mapping
def test_window_order_is_a_seeded_permutation_per_epoch():
    for size in range(1, 130):
        order = WindowOrder(size, seed=3)
        for epoch in (0, 1, 7):
            assert sorted(order(p, epoch) for p in range(size)) == list(range(size)), size
    order = WindowOrder(100, seed=3)
    epoch0, epoch1 = [order(p, 0) for p in range(100)], [order(p, 1) for p in range(100)]
    assert epoch0 != epoch1 and epoch0 != list(range(100))
    assert epoch0 != [WindowOrder(100, seed=4)(p, 0) for p in range(100)]
    big = WindowOrder(10**12, seed=1)  # nothing of size W is materialized
    assert 0 <= big(10**12 - 1, 5) < 10**12
    with pytest.raises(DataError, match="position 100 is outside"):
        order(100)


def test_samples_are_the_documented_windows(token_file):
    path, tokens = token_file
    plain = token_sampler(MODEL, path, shuffle=False)
    assert plain.num_windows == (1001 - 1) // L == 125
    for i in (0, 1, 124, 125, 300):  # wraps around after the last window
        w = i % 125
        assert torch.equal(plain(i), torch.from_numpy(tokens[w * L:w * L + L + 1]))
        assert plain(i).dtype == torch.int64 and plain(i).shape == (L + 1,)
    assert plain(0)[-1] == plain(1)[0]  # stride seq_len: the targets chain
    shuffled = token_sampler(MODEL, path, seed=5)
    for i in range(250):  # every window once per epoch, in the order of WindowOrder(125, 5)
        w = WindowOrder(125, 5)(i % 125, i // 125)
        assert torch.equal(shuffled(i), torch.from_numpy(tokens[w * L:w * L + L + 1]))
    assert sorted(shuffled.window(i) for i in range(125)) == list(range(125))


def test_uint32_ids_above_uint16_and_the_dtype_from_the_sidecar(tmp_path):
    big = ModelConfig(**dict(CONFIG, vocab_size=100_000))
    tokens = _tokens(500, vocab=100_000, seed=1)
    path = str(tmp_path / "wide.bin")
    write_token_file(path, [tokens], "uint32")
    sample = token_sampler(big, path, shuffle=False)  # dtype read from wide.bin.json
    assert sample.shards.dtype_name == "uint32" and sample(3).max() > 65535
    assert torch.equal(sample(3), torch.from_numpy(tokens[24:33]))
    os.remove(path + ".json")  # a plain .bin: the dtype is given
    assert torch.equal(token_sampler(big, path, "uint32", shuffle=False)(3), sample(3))


# ---------------------------------------------------------------------------- plans
HETERO = Plan((Pipeline((Stage((0, 1), (0, 2)),), 2, 2), Pipeline((Stage((2,), (0, 2)),), 1, 4)),
              global_batch=8, num_layers=2)
PLANS = {"one device": simple_plan(num_layers=2, global_batch=8),
         "dp4": simple_plan(dp=4, num_layers=2, global_batch=8),
         "dp2 pp2 tp2 mb2": simple_plan(dp=2, pp=2, tp=2, num_layers=2, global_batch=8,
                                        num_microbatches=2),
         "hetero": HETERO}


def test_every_plan_trains_the_same_global_batch_rows(token_file):
    """Each rank builds its rows from its own sampler (as its own process does); the rows of
    every pipeline, in plan order, are the global batch of one sampler, step after step,
    across a switch from one plan to the next."""
    path, _ = token_file
    reference = token_sampler(MODEL, path, seed=9)
    steps, batch = 40, 8  # 320 samples: past the 125 windows of an epoch
    want = [global_batch_at(reference, s, batch) for s in range(steps)]
    names = list(PLANS)
    for start in range(0, steps, 10):  # switch plans every 10 steps
        plan = PLANS[names[(start // 10) % len(names)]]
        for rank in plan.devices:
            mine = token_sampler(MODEL, path, seed=9)
            pi = plan.locate(rank).pipeline
            for s in range(start, start + 10):
                got = global_batch_at(mine, s, batch)
                for m in range(plan.pipelines[pi].num_microbatches):
                    lo, hi = plan.microbatch_rows(pi, m)
                    assert torch.equal(got[lo:hi], want[s][lo:hi]), (plan, rank, s, m)
    backwards = token_sampler(MODEL, path, seed=9)  # what was read before does not matter
    for s in reversed(range(steps)):
        assert torch.equal(global_batch_at(backwards, s, batch), want[s])


# ---------------------------------------------------------------------------- shards
def test_a_shard_directory_reads_as_the_file_it_splits(tmp_path, token_file):
    path, tokens = token_file
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    for name, part in (("a.bin", tokens[:300]), ("b.bin", tokens[300:305]),
                       ("c.bin", tokens[305:])):  # b.bin is shorter than one window
        write_token_file(str(shard_dir / name), [part], "uint16", sidecar=False)
    (shard_dir / "notes.txt").write_text("not a shard")
    one, three = token_sampler(MODEL, path, seed=2), token_sampler(MODEL, str(shard_dir),
                                                                   "uint16", seed=2)
    assert [s.tokens for s in three.shards.shards] == [300, 5, 696]
    assert three.num_windows == one.num_windows
    straddling = {w for w in range(one.num_windows) if w * L < 305 < w * L + L + 1}
    assert straddling  # some windows span a.bin/b.bin/c.bin boundaries
    for i in range(2 * one.num_windows):
        assert torch.equal(three(i), one(i)), i
    split = str(tmp_path / "even")
    write_token_shards(split, tokens, 3, "uint16")  # dtype from even/dataset.json
    assert all(torch.equal(token_sampler(MODEL, split, seed=2)(i), one(i)) for i in range(200))


def test_one_sample_reads_only_its_window_of_its_shard(tmp_path, token_file):
    _, tokens = token_file
    write_token_shards(str(tmp_path / "s"), tokens, 3, "uint16")  # 334, 334, 333 tokens
    opens, reads = [], []

    class Recording:
        def __init__(self, path, dtype, count):
            self.name, self.array = os.path.basename(path), memmap_opener(path, dtype, count)
            opens.append(self.name)

        def __getitem__(self, key):
            reads.append((self.name, key.start, key.stop))
            return self.array[key]

    sample = token_sampler(MODEL, str(tmp_path / "s"), shuffle=False, opener=Recording)
    assert opens == reads == []  # opening the dataset maps and reads nothing
    window = 50  # tokens 400..408: inside shard 1
    assert torch.equal(sample(window), torch.from_numpy(tokens[400:409]))
    assert reads == [("shard-00001.bin", 66, 75)]  # exactly its 9 tokens, one slice
    assert opens == ["shard-00001.bin"]
    reads.clear()
    assert torch.equal(sample(41), torch.from_numpy(tokens[328:337]))  # spans shards 0 and 1
    assert reads == [("shard-00000.bin", 328, 334), ("shard-00001.bin", 0, 3)]
    assert opens == ["shard-00001.bin", "shard-00000.bin"]  # each mapped once, when first read
    # The other shards are never opened: with them gone, samples of shard 1 still read.
    fresh = token_sampler(MODEL, str(tmp_path / "s"), shuffle=False)
    os.remove(tmp_path / "s" / "shard-00000.bin")
    os.remove(tmp_path / "s" / "shard-00002.bin")
    assert all(torch.equal(fresh(w), torch.from_numpy(tokens[w * L:w * L + L + 1]))
               for w in range(42, 83))
    with pytest.raises(DataError, match="cannot open token shard .*shard-00002.bin"):
        fresh(90)


# ---------------------------------------------------------------------------- bad files
def _bad(tmp_path, case):
    """(a call that must fail, the text its error must hold)"""
    d = str(tmp_path)
    raw = os.path.join(d, "raw.bin")
    with open(raw, "wb") as f:
        f.write(np.arange(101, dtype="<u2").tobytes())  # 202 bytes
    if case == "missing path":
        return lambda: token_sampler(MODEL, d + "/nope.bin", "uint16"), "'" + d + "/nope.bin'"
    if case == "empty directory":
        os.mkdir(d + "/empty")
        return (lambda: token_sampler(MODEL, d + "/empty", "uint16"),
                "directory '" + d + "/empty' holds no *.bin shards")
    if case == "wrong dtype":  # 202 bytes are not uint32 tokens
        return lambda: token_sampler(MODEL, raw, "uint32"), "is 202 bytes, not a multiple of 4"
    if case == "truncated":  # the sidecar says 120 tokens, the file holds 101
        write_token_file(d + "/t.bin", [np.arange(120)], "uint16")
        with open(d + "/t.bin", "r+b") as f:
            f.truncate(202)
        return lambda: token_sampler(MODEL, d + "/t.bin"), "holds 101 tokens but"
    if case == "odd byte":  # a write cut in the middle of a token
        with open(raw, "ab") as f:
            f.write(b"\x01")
        return lambda: token_sampler(MODEL, raw, "uint16"), "is 203 bytes, not a multiple of 2"
    if case == "too short":
        with open(raw, "r+b") as f:
            f.truncate(16)  # 8 tokens < seq_len + 1
        return lambda: token_sampler(MODEL, raw, "uint16"), "holds 8 tokens, too few"
    if case == "out of vocab":  # ids 0..100, vocab 32: window 4 holds 32..40
        sample = token_sampler(MODEL, raw, "uint16", shuffle=False)
        return lambda: sample(4), "sample 4: token id 32 (token 32 of '" + raw + "') is not " \
            "below vocab_size=32"
    if case == "no dtype":
        return lambda: token_sampler(MODEL, raw), "no token dtype for '" + raw + "'"
    if case == "unknown dtype":
        return lambda: token_sampler(MODEL, raw, "int8"), "token dtype 'int8' is not one of"
    if case == "dtype disagrees with sidecar":
        write_token_file(d + "/s.bin", [np.arange(20)], "uint32")
        return lambda: token_sampler(MODEL, d + "/s.bin", "uint16"), "sidecar '" + d + \
            "/s.bin.json' says 'uint32'"
    if case == "bad sidecar":
        with open(raw + ".json", "w") as f:
            f.write('{"dtype": "uint16", "token": 101}')
        return lambda: token_sampler(MODEL, raw), "has unknown key 'token'; valid: dtype, tokens"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing path", "empty directory", "wrong dtype", "truncated",
                                  "odd byte", "too short", "out of vocab", "no dtype",
                                  "unknown dtype", "dtype disagrees with sidecar", "bad sidecar"])
def test_a_bad_file_is_one_line_naming_the_bad_value(tmp_path, case):
    call, text = _bad(tmp_path, case)
    with pytest.raises(DataError) as err:
        call()
    assert text in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_cli_makes_shards_and_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    out = tmp_path / "demo"
    made = subprocess.run([sys.executable, "-m", "hspmd_elastic.data", "make", str(out),
                           "--tokens", "5000", "--vocab", "100", "--shards", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert made.returncode == 0, made.stderr
    assert sorted(os.listdir(out)) == ["dataset.json", "shard-00000.bin", "shard-00001.bin",
                                       "shard-00002.bin"]
    assert data_cli(["check", str(out), "--seq-len", "8"]) == 0
    summary = capsys.readouterr().out
    assert "3 shard(s), 5000 uint16 tokens" in summary and "624 samples of seq_len 8" in summary
    assert data_cli(["check", str(out), "--vocab", "50"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not below vocab_size=50" in err, err
    assert data_cli(["make", str(tmp_path / "x.bin"), "--tokens", "10", "--vocab", "70000"]) == 2
    assert "--vocab=70000 must be within 1..65536 for uint16" in capsys.readouterr().err


# ---------------------------------------------------------------------------- end to end
def _example(path, config_file, out, *extra):
    return [os.path.join(ROOT, "examples", "elastic_llama.py"), "--config", str(config_file),
            "--steps", "3", "--global-batch", "4", "--seed", "3", "--lr", "0.01",
            "--data", str(path), "--out", str(out), *extra]


def test_the_example_refuses_a_bad_token_file_in_one_line(tmp_path):
    config_file = tmp_path / "model.json"
    config_file.write_text(MODEL.to_json())
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 21)
    proc = subprocess.run([sys.executable, *_example(tmp_path / "odd.bin", config_file, tmp_path),
                           "--data-dtype", "uint16"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc
    assert "odd.bin' is 21 bytes, not a multiple of 2 (uint16)" in proc.stderr


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize("plan", ["dp2", "tp2"])
def test_the_example_trains_on_a_token_file_to_the_reference_under_any_plan(
        elastic_job, tmp_path, plan):
    """Two gloo workers run examples/elastic_llama.py on a plain .bin (dtype on the command
    line) under DP2 or TP2; the parameters equal the dense float64 reference trained on the
    same file's global batches, so the two plans train to equal parameters."""
    path = tmp_path / "train.bin"
    write_token_file(str(path), [_tokens(2000, seed=4)], "uint16", sidecar=False)
    config_file = tmp_path / "model.json"
    config_file.write_text(MODEL.to_json())
    out = tmp_path / "final"
    job = elastic_job({})
    devices = ["n0:0", "n0:1"]
    for d in devices:
        job.spawn(d, script=_example(path, config_file, out, "--data-dtype", "uint16"))
    layout = dict(dp=2) if plan == "dp2" else dict(tp=2)
    job.publish(simple_plan(**layout, num_layers=2, global_batch=4), devices, reason="start")
    for d in devices:
        assert job.procs[d].wait(timeout=60) == 0, job.log(d)
        assert "done after 3 steps (plan v1, 1 switches)" in job.log(d)
    assert sorted(os.listdir(out)) == ["n0_0.pt", "n0_1.pt"]
    results = [{"final_state": torch.load(out / f"{d.replace(':', '_')}.pt")} for d in devices]
    got = assemble(results, {"config": dataclasses.asdict(MODEL)})
    sample = token_sampler(MODEL, str(path), "uint16", seed=3)
    batches = [global_batch_at(sample, s, 4) for s in range(3)]
    want, _ = reference_train(MODEL, 3, batches, AdamWConfig(lr=0.01))
    for name, ref in want.items():
        diff = (got[name] - ref).abs().max().item()
        assert diff <= 1e-9, f"{plan} {name}: max |elastic - reference| = {diff:g}"


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_an_out_of_vocab_id_stops_the_worker_with_one_line(elastic_job, tmp_path):
    path = tmp_path / "wide.bin"
    write_token_file(str(path), [np.full(200, MODEL.vocab_size + 8)], "uint16")
    config_file = tmp_path / "model.json"
    config_file.write_text(MODEL.to_json())
    job = elastic_job({})
    job.spawn("n0:0", script=_example(path, config_file, tmp_path / "final"))
    job.publish(simple_plan(num_layers=2, global_batch=4), ["n0:0"], reason="start")
    assert job.procs["n0:0"].wait(timeout=40) == 2, job.log("n0:0")
    first = token_sampler(MODEL, str(path), seed=3).window(0) * L  # sample 0's first token
    errors = [line for line in job.log("n0:0").splitlines() if "error: " in line]
    assert errors == [f"elastic_llama.py: error: sample 0: token id 40 (token {first} of "
                      f"'{path}') is not below vocab_size=32"], job.log("n0:0")
