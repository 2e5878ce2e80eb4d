"""Fine-tuning a Hugging Face checkpoint elastically: examples/finetune_llama.py end to end.

A tiny ``LlamaForCausalLM`` with grouped-query attention and tied embeddings (float64, built and
saved here as in test_hf.py; nothing is downloaded) and a token file written with ``hspmd_elastic.data``. One real ``hspmd-launch
--hspmd-elastic`` agent on a real etcd, given the checkpoint directory as ``--hspmd-model``,
runs two workers of the example (through ``tests/scripts/finetune_gated.py``, which adds a pause
gate); both start from the checkpoint (``runtime.run(init_from=...)``, switch source ``hf``),
one is SIGKILLed while they wait at step PAUSE, and the survivor switches to the new plan in
memory (source ``bsr``) and finishes. Its export loads in transformers and equals transformers'
own model trained with ``torch.optim.AdamW`` on the same global batches (the same sampler),
parameters and logits within 1e-9 in float64: the fault-free result.

The one-line errors: ``--hspmd-model DIR`` without ``--hspmd-seq-len``, a directory without
``config.json``, ``--hspmd-seq-len`` with another kind of model, and ``init_from`` (and the
example's ``--model``) naming something that is not a checkpoint of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import types
import uuid

import pytest
import torch

from _wait import wait_for
from launch_harness import REPO, SCRIPTS, Launcher, base_env
from test_hf import VOCAB, float64_peer, hf_logits, tiny_llama, train_peer

from hspmd_elastic.coord import read_events
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.data import random_tokens, token_sampler, write_token_file
from hspmd_elastic.elastic.api import ConfigurationError
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.hf import config_from_hf
from hspmd_elastic.runtime import global_batch_at, run

SEQ, BATCH, STEPS, PAUSE, SEED, LR = 8, 4, 6, 3, 11, 1e-2
TOL = 1e-9
EXAMPLE = str(REPO / "examples" / "finetune_llama.py")
# Grouped-query attention (two query heads share one key/value head, replicated under TP2) and
# tied input and output embeddings: the family's features through the elastic runtime.
FAMILY = dict(num_key_value_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny model saved with ``save_pretrained``, its float64 peer, a token file."""
    root = tmp_path_factory.mktemp("finetune")
    model = tiny_llama(**FAMILY)
    path = str(root / "llama")
    model.save_pretrained(path)
    data = str(root / "train.bin")
    write_token_file(data, random_tokens(2000, VOCAB, seed=1), "uint16", vocab_size=VOCAB)
    return types.SimpleNamespace(model=model, peer=float64_peer(model), path=path, data=data,
                                 config=config_from_hf(path, seq_len=SEQ), root=root)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_finetune_with_a_worker_killed_equals_transformers_adamw(ckpt, etcd_server, tmp_path,
                                                                  marker):
    from transformers import LlamaForCausalLM

    job, export, release = f"ft-{uuid.uuid4().hex[:8]}", tmp_path / "export", tmp_path / "go"
    args = ["--nnodes", "1", "--nproc-per-node", "3", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd_server.endpoint_str, "--rdzv-id", job,
            "--hspmd-node-id", "node-a", "--hspmd-lease-ttl", "2", "--shutdown-timeout", "5",
            "--hspmd-elastic", "--hspmd-model", ckpt.path, "--hspmd-seq-len", str(SEQ),
            "--hspmd-global-batch", str(BATCH),
            str(SCRIPTS / "finetune_gated.py"), "--pause-at", str(PAUSE), "--release",
            str(release), "--model", ckpt.path, "--data", ckpt.data, "--seq-len", str(SEQ),
            "--steps", str(STEPS), "--global-batch", str(BATCH), "--lr", str(LR),
            "--seed", str(SEED), "--export", str(export)]
    agent = Launcher(args, base_env(marker), tmp_path, "node-a")
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    try:
        devices = ["node-a:0", "node-a:1", "node-a:2"]

        def paused():
            prefix = schema.workers_prefix(job)
            recs = {}
            for kv in client.get_prefix(prefix):
                node, lr = kv.key[len(prefix):].split("/")
                recs[f"{node}:{lr}"] = schema.decode(kv.key, kv.value)
            if all(d in recs and recs[d].step >= PAUSE for d in devices):
                return {d: recs[d].pid for d in devices}
            return None

        pids = wait_for(paused, 60, f"the workers at step {PAUSE}", proc=agent.proc)
        os.kill(pids["node-a:1"], signal.SIGKILL)
        release.touch()
        code = agent.wait(60)
        err = agent.stderr()
        assert code == 0, err[-6000:]
        events = read_events(client, job)
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(timeout=10)
        client.close()
    types_ = [e.type for e in events]
    assert "fallback" not in types_ and "switch-failed" not in types_, types_
    failure = schema.event_detail(next(e for e in events if e.type == "failure"))
    assert failure.devices == ["node-a:1"] and [x.signal for x in failure.exits] == [9]
    sources = [schema.event_detail(e).source for e in events if e.type == "switch-done"]
    assert sources[0] == "hf" and sources[1:] and set(sources[1:]) == {"bsr"}, sources
    assert "job recovered from 1 worker failure" in err
    assert not os.path.exists(f"{export}.parts")
    # The fault-free result: transformers trained with AdamW on the same global batches.
    sample = token_sampler(ckpt.config, ckpt.data, seed=SEED)
    batches = [global_batch_at(sample, s, BATCH) for s in range(STEPS)]
    trained = train_peer(ckpt.peer, batches, AdamWConfig(lr=LR))
    back = LlamaForCausalLM.from_pretrained(str(export)).eval()
    assert next(back.parameters()).dtype == torch.float64
    theirs, start = dict(trained.named_parameters()), dict(ckpt.model.named_parameters())
    for name, value in back.named_parameters():
        assert max_diff(value.detach(), theirs[name].detach()) <= TOL, name
        assert max_diff(value.detach(), start[name].detach()) > 1e-4, name  # it trained
    for batch in (batches[0], global_batch_at(sample, STEPS, BATCH)):
        assert max_diff(hf_logits(float64_peer(back), batch), hf_logits(trained, batch)) <= TOL
    assert config_from_hf(str(export), seq_len=SEQ) == ckpt.config


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_checkpoint_in_checkpoint_dir_wins_over_init_from(ckpt, elastic_job, tmp_path):
    """A resumed fine-tune: ``--checkpoint-dir`` holds a complete checkpoint (here step 0 of
    another model, B), so the first switch reads it, not ``--model`` (A); the export equals B
    trained by transformers."""
    from transformers import LlamaForCausalLM

    from _elastic import payload
    from hspmd_elastic.hf import write_initial_checkpoint
    from hspmd_elastic.plan import simple_plan

    other = tiny_llama(**FAMILY)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    b_path, run_dir, export = str(tmp_path / "b"), str(tmp_path / "run"), tmp_path / "export"
    other.save_pretrained(b_path)
    write_initial_checkpoint(b_path, ckpt.config, run_dir)
    job = elastic_job(payload())
    job.spawn("n0:0", script=[EXAMPLE, "--model", ckpt.path, "--data", ckpt.data,
                              "--seq-len", str(SEQ), "--steps", "2", "--global-batch", str(BATCH),
                              "--lr", str(LR), "--seed", str(SEED), "--checkpoint-dir", run_dir,
                              "--export", str(export)])
    job.publish(simple_plan(num_layers=2, global_batch=BATCH), ["n0:0"], reason="start")
    assert job.procs["n0:0"].wait(timeout=60) == 0, job.log("n0:0")
    assert "switched to plan v1 from checkpoint, resuming at step 0" in job.log("n0:0")
    sample = token_sampler(ckpt.config, ckpt.data, seed=SEED)
    trained = train_peer(float64_peer(other), [global_batch_at(sample, s, BATCH)
                                               for s in range(2)], AdamWConfig(lr=LR))
    theirs = dict(trained.named_parameters())
    for name, value in LlamaForCausalLM.from_pretrained(str(export)).named_parameters():
        assert max_diff(value.detach(), theirs[name].detach()) <= TOL, name


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("model, extra, message", [
    ("ckpt", [], "--hspmd-model '{ckpt}' is a Hugging Face checkpoint directory: give "
                 "--hspmd-seq-len N"),
    ("empty", ["--hspmd-seq-len", "8"], "invalid --hspmd-model value '{empty}': a directory "
                                        "without config.json"),
    ("llama-7b", ["--hspmd-seq-len", "8"], "--hspmd-seq-len 8 is only used with a Hugging Face "
                                           "checkpoint directory as --hspmd-model"),
    ("ckpt", ["--hspmd-seq-len", "65"], "seq_len=65 exceeds field max_position_embeddings=64"),
])
def test_model_flag_bad_values_get_one_line(ckpt, tmp_path, capsys, model, extra, message):
    from launcher.cli import main

    names = {"ckpt": ckpt.path, "empty": str(tmp_path)}
    value = names.get(model, model)
    code = main(["--hspmd-elastic", "--hspmd-model", value, "--hspmd-global-batch", "4", *extra,
                 str(SCRIPTS / "sleeper.py")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hspmd-launch: error: "), err
    assert message.format(**names) in err[0]


def test_model_flag_plans_for_the_checkpoints_config(ckpt):
    from launcher.cli import build_config, launch_command

    ctx = launch_command.make_context("hspmd-launch", [
        "--hspmd-elastic", "--hspmd-model", ckpt.path, "--hspmd-seq-len", str(SEQ),
        "--hspmd-global-batch", "4", str(SCRIPTS / "sleeper.py")])
    profile = build_config(ctx.params).elastic.model_profile
    assert profile.config == ckpt.config and profile.seq_len == SEQ


def test_init_from_a_bad_path_is_one_line_before_training(ckpt, tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(
        json.loads((open(os.path.join(ckpt.path, "config.json")).read()))))
    other = dataclasses.replace(ckpt.config, ffn_size=48)
    cases = [
        (str(tmp_path / "nope"), ckpt.config, r"init_from='.*nope' is not a directory"),
        (str(tmp_path), ckpt.config, r"init_from='.*' holds no config.json"),
        (str(no_weights), ckpt.config, r"holds neither model.safetensors nor "
                                       r"model.safetensors.index.json"),
        (ckpt.path, other, r"tensor model.layers.0.mlp.gate_proj.weight has shape \(32, 16\); "
                           r"the config says \(48, 16\)"),
    ]
    for path, config, message in cases:
        # No identity and no etcd: the check comes before the worker starts.
        with pytest.raises(ConfigurationError, match=message) as err:
            run(config, sample=lambda i: torch.zeros(SEQ + 1, dtype=torch.int64),
                global_batch=BATCH, steps=1, init_from=path)
        assert "\n" not in str(err.value)


def test_the_example_refuses_a_bad_model_directory_in_one_line(ckpt, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, EXAMPLE, "--model", str(tmp_path / "nope"),
                           "--data", ckpt.data, "--seq-len", str(SEQ)],
                          capture_output=True, text=True, env=env, timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("finetune_llama.py: error: cannot read ") and "nope" in err[0]
