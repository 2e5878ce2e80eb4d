"""The examples' own errors end an elastic job as the script's error, with or without ``@record``.

End to end (real etcd, one ``hspmd-launch --hspmd-elastic`` agent of two CPU workers per job,
``examples/elastic_llama.py`` and ``examples/finetune_llama.py``): a mistake every worker runs
into (tokens of a larger vocabulary than the model's, the script's ``--lengths`` other than
``--hspmd-lengths``, another ``seq_len`` than the launcher plans for, from ``--hspmd-model`` or
``--hspmd-seq-len``, a fine-tune ``--export`` into a non-empty directory) fails the job
once, exit 1, as "the script's error, not a device fault" with the error the workers printed,
never "no usable device left in the job". Some of these errors are printed lines (``prog:
error: ...``, exit 2), which no error file holds: the agent reads them from the workers'
stderr. A ``seq_len`` other than the planned one is refused as ``num_layers`` is.

All the jobs run at once, in one module-scoped world; each test reads one of them. The pure
reading of a stderr tail (``exits.last_error``) is checked on values at the end.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from launch_harness import Launcher, base_env

from hspmd_elastic.graph.config import ModelConfig
from launcher.standalone import EtcdCluster

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
LLAMA, FINETUNE = ROOT / "examples" / "elastic_llama.py", ROOT / "examples" / "finetune_llama.py"
MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_layers=4, ffn_size=256,
                    seq_len=64)
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
      "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
      "num_hidden_layers": 2, "intermediate_size": 128, "max_position_embeddings": 128,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "hidden_act": "silu", "torch_dtype": "float32"}


def _files(tmp: Path) -> dict[str, str]:
    from hspmd_elastic.data import write_token_file
    from hspmd_elastic.documents import write_documents

    model = tmp / "model.json"
    model.write_text(MODEL.to_json())
    (tmp / "seq.json").write_text(dataclasses.replace(MODEL, seq_len=32).to_json())
    rng = np.random.default_rng(0)
    write_token_file(str(tmp / "wide.bin"), [rng.integers(0, 512, 20_000)], dtype="uint16")
    docs = [rng.integers(0, 256, int(n)) for n in rng.integers(8, 64, 200)]
    write_documents(str(tmp / "docs.bin"), docs)
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF))
    _write_weights(hf / "model.safetensors")
    write_token_file(str(tmp / "tokens.bin"), [rng.integers(0, 256, 20_000)], dtype="uint16")
    (tmp / "export").mkdir()
    (tmp / "export" / "keep.txt").write_text("x")
    return {"model": str(model), "seq": str(tmp / "seq.json"), "wide": str(tmp / "wide.bin"),
            "docs": str(tmp / "docs.bin"), "hf": str(hf),
            "tokens": str(tmp / "tokens.bin"), "export": str(tmp / "export")}


def _write_weights(path: Path) -> None:
    """Zero weights of the shapes ``HF`` names, in Hugging Face's Llama names."""
    import torch
    from safetensors.torch import save_file

    h, f, v = HF["hidden_size"], HF["intermediate_size"], HF["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(HF["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + f"self_attn.{p}_proj.weight": (h, h) for p in "qkvo"})
        shapes.update({pre + "mlp.gate_proj.weight": (f, h), pre + "mlp.up_proj.weight": (f, h),
                       pre + "mlp.down_proj.weight": (h, f),
                       pre + "input_layernorm.weight": (h,),
                       pre + "post_attention_layernorm.weight": (h,)})
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(path))


def _cases(f: dict[str, str]) -> dict[str, tuple[list[str], list[str], str]]:
    """name -> (launcher flags, script and its args, the error the job must end with)."""
    elastic = ["--hspmd-model", f["model"], "--hspmd-global-batch", "8"]
    train = [str(LLAMA), "--global-batch", "8", "--steps", "100000"]
    tune = ["--hspmd-model", f["hf"], "--hspmd-global-batch", "8"]
    finetune = [str(FINETUNE), "--model", f["hf"], "--data", f["tokens"], "--global-batch",
                "8", "--steps", "100000"]
    return {
        "vocab": (elastic, [*train, "--config", f["model"], "--data", f["wide"]],
                  "elastic_llama.py: error:"),
        "lengths": ([*elastic, "--hspmd-lengths", "16:0.5,64:0.5"],
                    [*train, "--config", f["model"], "--documents", f["docs"], "--lengths",
                     "32:0.5,64:0.5"], "give the script the same lengths as --hspmd-lengths"),
        "seq-len": (elastic, [*train, "--config", f["seq"]],
                    "PlanError: plan was made for seq_len=64, model has seq_len=32"),
        "hspmd-seq-len": ([*tune, "--hspmd-seq-len", "32"], [*finetune, "--seq-len", "64"],
                          "PlanError: plan was made for seq_len=32, model has seq_len=64"),
        "export": ([*tune, "--hspmd-seq-len", "64"],
                   [*finetune, "--seq-len", "64", "--export", f["export"]],
                   f"finetune_llama.py: error: --export {f['export']} is not empty"),
    }


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every case's job, all at once on one etcd: name -> (the agent's exit code, its stderr,
    the error expected)."""
    tmp = tmp_path_factory.mktemp("example_errors")
    with EtcdCluster(size=1, base_dir=str(tmp / "etcd")) as etcd:
        return _run_jobs(etcd, tmp)


def _run_jobs(etcd_server, tmp: Path) -> dict[str, tuple[int, str, str]]:
    files = _files(tmp)
    env = base_env(f"exerr-{uuid.uuid4().hex[:8]}")
    agents = {}
    for name, (flags, script, expected) in _cases(files).items():
        args = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", etcd_server.endpoint_str,
                "--rdzv-id", f"exerr-{name}-{uuid.uuid4().hex[:6]}", "--hspmd-node-id",
                "node-a", "--hspmd-elastic", "--shutdown-timeout", "5", *flags, *script]
        agents[name] = (Launcher(args, env, tmp, name=name), expected)
    out = {}
    deadline = time.monotonic() + 150  # one for all: a job that trains on is a failed case
    try:
        for name, (agent, expected) in agents.items():
            try:
                code = agent.wait(max(1.0, deadline - time.monotonic()))
            except AssertionError:  # still running: killed by the wait
                code = None
            out[name] = (code, agent.stderr(), expected)
    finally:
        for agent, _expected in agents.values():
            if agent.proc.poll() is None:  # only after a failed wait above
                agent.proc.kill()
                agent.proc.wait(10)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["vocab", "lengths", "seq-len", "hspmd-seq-len", "export"])
def test_a_script_error_ends_the_job_as_the_scripts_error(jobs, case):
    code, err, expected = jobs[case]
    lines = [ln for ln in err.splitlines() if ln.startswith("hspmd-launch: error:")]
    assert code == 1 and lines, err[-4000:]
    line = lines[-1]
    assert "the script's error, not a device fault" in line, line
    assert expected in line and "no usable device" not in line, line
    assert "the same error killed 2 worker(s) on 2 devices (node-a:" in line, line


def test_the_last_error_of_a_stderr_tail():
    from launcher.node.elastic.exits import error_signature, last_error

    traceback = ["I0101 12:00:00 step 1", "Traceback (most recent call last):",
                 '  File "x.py", line 1, in <module>', "    main()", "    ^^^^^^",
                 "pkg.PlanError: plan has num_layers=4, model has 3", "more logging: here"]
    assert last_error(traceback) == "pkg.PlanError: plan has num_layers=4, model has 3"
    printed = ["2024-01-01 12:00:00,000 INFO root step 0", "train.py: error: bad id 300"]
    assert last_error(printed) == "train.py: error: bad id 300"
    assert last_error(traceback + printed) == "train.py: error: bad id 300"
    assert last_error(["INFO: fine", "note: nothing failed"]) == ""
    assert error_signature("a.py: error: bad id 300 at row 2") == \
        error_signature("a.py: error: bad id 301 at row 7") == ("error", "bad id # at row #")
    for symptom in ("RuntimeError: Connection closed by peer [127.0.0.1]:4242",
                    "x.py: error: the store timed out"):
        assert error_signature(symptom) is None, symptom
