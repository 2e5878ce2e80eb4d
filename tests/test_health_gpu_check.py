"""scripts/gpu_check: every GPU step skipped without a GPU (one line with --strict), a module that
does not import (one FAIL line naming its wheel), transformers missing (only the mfu step skipped),
the unit step's imports among the preflight's, an unexpected exception (one line), the step
budgets, the NVML step on a scripted driver, the communication step over gloo on CPUs, the elastic
in-memory switch step rehearsed on a CPU worker, and the MFU step (``scripts/bench_step --mfu``:
our step against transformers' LlamaForCausalLM) rehearsed on the CPU, with its FLOP formula,
its parameter-count check at the 0.75 B size, and the dense reference placed on its input's
device."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import zipfile

import pynvml
import pytest
import torch

from launcher.health import gpu_check
from launcher.health.fake_nvml import FakeNvml, fake_gpus
from launcher.health.nvml import probe_nvml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check")


@pytest.fixture(scope="module")
def bench():
    """``scripts/bench/mfu.py``, what ``scripts/bench_step --mfu`` runs."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from bench import mfu
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    return mfu


def test_without_gpus_every_gpu_step_is_skipped_and_strict_fails_with_one_line():
    if probe_nvml(pynvml) is None:
        pytest.skip("this machine has an NVIDIA driver")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run([SCRIPT, "--only", "nvml,comm,unit,kill,mfu"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 8, proc.stdout  # two about the machine, one per step, the verdict
    assert lines[0] == f"gpu_check: torch {torch.__version__}, CUDA n/a, nccl: n/a (no CUDA)"
    assert lines[1].startswith("gpu_check: hub kernels: "), lines[1]
    assert lines[2].startswith("gpu_check: SKIP nvml: no usable NVIDIA GPU: no NVIDIA driver")
    for line, step in zip(lines[3:], ("mfu", "comm", "unit", "kill")):  # mfu right after nvml
        assert line.startswith(f"gpu_check: SKIP {step}: skipped: no CUDA (torch "), line
    assert lines[-1] == "gpu_check: PASS (0 passed, 5 skipped: nvml, mfu, comm, unit, kill)"
    strict = subprocess.run([SCRIPT, "--strict"], capture_output=True, text=True, timeout=60,
                            env=env)
    assert strict.returncode == 1 and strict.stdout.splitlines() == lines[:2]
    assert strict.stderr.strip().splitlines() == [
        "gpu_check: FAIL: nvml cannot run here: no usable NVIDIA GPU: no NVIDIA driver "
        "(NVMLError_LibraryNotFound: NVML Shared Library Not Found)"]


def _wheel(folder, name: str) -> str:
    """A minimal valid pure-Python wheel of an empty package ``name``."""
    info = f"{name}-0.1.dist-info"
    path = os.path.join(folder, f"{name}-0.1-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                      "Root-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n"
                                       f"{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_a_module_that_does_not_import_fails_the_check_in_one_line(tmp_path):
    """grpc made unimportable (a shim ahead of the real one on PYTHONPATH) and no grpcio wheel
    in the folder: one FAIL line naming the module, its wheel and the folder, before any step
    runs; no traceback."""
    shim, wheels = tmp_path / "shim", tmp_path / "wheels"
    (shim / "grpc").mkdir(parents=True)
    (shim / "grpc" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'grpc'\", name='grpc')\n")
    wheels.mkdir()
    _wheel(str(wheels), "hspmd_gpu_check_dummy")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(shim))
    proc = subprocess.run([SCRIPT, "--wheels", str(wheels), "--only", "switches,mfu",
                           "--device", "cpu"], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"gpu_check: FAIL: cannot import grpc (wheel grpcio missing from {wheels}; see "
        "docs/gpu.md)"], proc.stderr


def _shim(folder, module: str, missing: str) -> str:
    """A package ``module`` ahead of the real one whose import fails as a missing ``missing``."""
    (folder / module).mkdir(parents=True)
    (folder / module / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{missing}'\", name='{missing}')\n")
    return str(folder)


@pytest.mark.timeout(90)
def test_without_transformers_only_the_mfu_step_is_skipped(tmp_path):
    """transformers not installed: one SKIP line for mfu and the other steps run (the unit step
    here, rehearsed on the CPU); --strict fails in one line; transformers installed but lacking a
    dependency still fails the preflight."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=_shim(tmp_path / "gone", "transformers", "transformers"))
    proc = subprocess.run([SCRIPT, "--only", "mfu,unit", "--device", "cpu", "--budget", "80"],
                          capture_output=True, text=True, timeout=85, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1] == "gpu_check: hub kernels: n/a (transformers is not installed)"
    assert lines[2] == ("gpu_check: SKIP mfu: transformers is not installed (the GPU machine's "
                        "Python must provide it; see docs/gpu.md)"), proc.stdout
    assert re.fullmatch(r"gpu_check: PASS unit: \d+ passed, \d+ skipped in .*", lines[3]), lines
    assert lines[4:] == ["gpu_check: PASS (1 passed, 1 skipped: mfu)"], proc.stdout
    strict = subprocess.run([SCRIPT, "--only", "mfu", "--device", "cpu", "--strict"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert strict.stderr.splitlines() == [
        "gpu_check: FAIL: mfu cannot run here: transformers is not installed (the GPU machine's "
        "Python must provide it; see docs/gpu.md)"], strict.stderr
    env["PYTHONPATH"] = _shim(tmp_path / "broken", "transformers", "huggingface_hub")
    broken = subprocess.run([SCRIPT, "--only", "mfu,unit", "--device", "cpu"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert broken.returncode == 1 and broken.stdout == "", broken.stdout + broken.stderr
    assert broken.stderr.splitlines() == [
        "gpu_check: FAIL: cannot import transformers: it needs huggingface_hub, which is "
        "missing (not among the wheels: the GPU machine's Python must provide transformers; "
        "see docs/gpu.md)"], broken.stderr


def test_the_preflight_imports_what_the_unit_step_imports():
    """Every module the unit step's files import at their top (its tests, tests/conftest.py and
    the helpers it loads) that is neither the standard library nor this checkout's is in
    ``STEP_IMPORTS["unit"]`` (hypothesis with sortedcontainers, its one dependency), and every
    preflight module names its wheel or the machine's Python in ``ORIGIN``."""
    files = ["tests/conftest.py", "tests/scripts/launch_harness.py", "tests/test_gpu.py",
             "tests/test_device_timer.py"]
    local = {"hspmd_elastic", "launcher", "tests"} | {
        name[:-3] for folder in ("tests", "tests/scripts")
        for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(".py")}
    imported = set()
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - local - {"__future__"}
    unit = {m.split(".")[0] for m in gpu_check.STEP_IMPORTS["unit"]}
    assert third_party and third_party <= unit, sorted(third_party - unit)
    assert "sortedcontainers" in unit  # hypothesis imports it
    every = {m for modules in gpu_check.STEP_IMPORTS.values() for m in modules}
    assert every <= set(gpu_check.ORIGIN), sorted(every - set(gpu_check.ORIGIN))


def test_an_unexpected_exception_in_a_step_is_one_line():
    def broken():
        raise KeyError("runs")

    with pytest.raises(gpu_check.CheckFailed) as info:
        gpu_check._run_step("mfu", broken, False, {})
    assert re.fullmatch(r"mfu: KeyError: 'runs' \(at tests/test_health_gpu_check\.py:\d+\)",
                        str(info.value)), str(info.value)


def test_step_budgets_fit_the_default_budget_and_mfu_runs_second():
    assert gpu_check.STEPS[:2] == ("nvml", "mfu")
    assert gpu_check.CAPS_S["mfu"] == 120.0
    assert sum(gpu_check.CAPS_S.values()) <= gpu_check.DEFAULT_BUDGET_S - 10
    steps = list(gpu_check.STEPS)
    # a step gets its cap plus what no later step has a claim on
    assert gpu_check.step_budget("nvml", steps, 295.0) == 15.0
    assert gpu_check.step_budget("mfu", steps, 290.0) == 130.0
    # the steps after it keep their caps when earlier ones were slow: mfu never gets less ...
    assert gpu_check.step_budget("mfu", steps, 200.0) == 120.0
    # ... except when less is left at all
    assert gpu_check.step_budget("mfu", steps, 90.0) == 90.0
    assert gpu_check.step_budget("kill", steps, 70.0) == 70.0  # the last one: all that is left
    assert gpu_check.step_budget("mfu", ["mfu"], 100.0) == 100.0


def test_nvml_step_on_a_scripted_driver(capsys):
    fake = FakeNvml(fake_gpus(2))
    assert gpu_check.check_nvml(10, nvml=fake) == 2
    out = capsys.readouterr().out
    assert "GPU 1: NVIDIA H100 80GB HBM3 (H100-80GB-HBM3), 80.0 GiB" in out
    assert "Xid event thread: running" in out
    assert fake.initialized == 0


def test_nvml_step_fails_on_a_lost_gpu():
    gpus = fake_gpus(2)
    gpus[1].lost = True
    with pytest.raises(gpu_check.CheckFailed, match=r"GPU\(s\) \[1\] failed"):
        gpu_check.check_nvml(10, nvml=FakeNvml(gpus))


@pytest.mark.multiproc
def test_comm_step_over_gloo():
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([SCRIPT, "--comm-only", "--backend", "gloo", "--budget", "90"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gloo rank 1/2: all_reduce, batch_isend_irecv ring" in proc.stdout
    assert proc.stdout.strip().endswith("gpu_check: PASS")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_switch_step_rehearsed_on_a_cpu_worker(tmp_path):
    """The elastic step of the GPU check on a CPU worker: a real etcd, agent and worker; two
    scripted health changes make two in-memory switches of the same process."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([SCRIPT, "--only", "switches", "--device", "cpu", "--budget", "120",
                           "--keep", str(tmp_path)], capture_output=True, text=True,
                          timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.splitlines()[2]  # after the two lines about the machine
    assert line.startswith("gpu_check: PASS switches: 1 worker on cpu, pid "), line
    assert "v1->v2" in line and "v2->v3" in line and "6 steps done" in line, line


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_mfu_step_rehearsed_on_the_cpu(tmp_path, bench):
    """The MFU step runs ``scripts/bench_step --mfu`` (a tiny model on the CPU here): one PASS
    line with both models' numbers and their ratio, the report files, equal parameter counts,
    the same first loss from the same weights, and the FLOP count of the formula."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    report = tmp_path / "mfu.md"
    proc = subprocess.run([SCRIPT, "--only", "mfu", "--device", "cpu", "--budget", "100",
                           "--mfu-report", str(report)], capture_output=True, text=True,
                          timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("gpu_check: PASS mfu: ours ")]
    assert line and "; transformers " in line[0] and "ours/transformers " in line[0], proc.stdout
    assert "apply on a GPU (not judged on the CPU)" in line[0]
    assert line[0].endswith("; transformers hub kernels: off (use_kernels=False, "
                            "USE_HUB_KERNELS=0; transformers' own layers)"), line[0]
    text = report.read_text()
    assert "| ours: specialized step (SDPA, foreach AdamW, undo copy on the device) |" in text
    assert "| transformers LlamaForCausalLM (SDPA, AdamW) |" in text
    assert "transformers baseline: hub kernels: off (" in text
    result = json.loads((tmp_path / "mfu.md.json").read_text())
    assert result["hub_kernels"].startswith("off (")
    assert result["parameters"] == {"ours": 115008, "transformers": 115008}
    ours, theirs = result["runs"]["ours"], result["runs"]["transformers"]
    assert result["ratio"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    assert len(ours["losses"]) == len(theirs["losses"]) == 4  # 1 warm-up + 3 timed
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-3)
    assert "causal, no mask" in ours["attention"] and "causal, no mask" in theirs["attention"]
    # tiny: 2 x (4 x 64^2 + 3 x 64 x 128) + 256 x 64 matrix parameters; 6 x 2 x 64 x 33
    assert result["flops"] == {"matrix_params": 98304, "attention_per_token": 25344.0,
                               "per_token": 6 * 98304 + 25344.0}
    assert result["targets"]["ratio_met"] is None and result["targets"]["mfu_met"] is None


def test_flops_count_causal_attention_gqa_and_a_tied_head_once(bench):
    from hspmd_elastic.graph.config import ModelConfig

    config = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2,
                         num_layers=2, ffn_size=128, seq_len=32, tie_embeddings=True)
    # per layer: q and o 64 x 64, k and v 32 x 64 (2 KV heads of 16), three 64 x 128 MLP
    # matrices; the tied head 256 x 64 once; attention: 6 x layers x hidden x (seq + 1)
    matrix = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) + 256 * 64
    assert bench.model_flops(config) == {"matrix_params": matrix,
                                         "attention_per_token": 6.0 * 2 * 64 * 33,
                                         "per_token": 6.0 * matrix + 6.0 * 2 * 64 * 33}


def test_targets_are_judged_on_a_gpu_only(bench):
    met = bench._targets(True, "0.7b", "H200", 0.97, 0.42)
    assert (met["ratio_met"], met["mfu_met"]) == (True, True)
    assert met["text"] == "ours/transformers 0.970x >= 0.95x: met; MFU 42.0% >= 40%: met"
    missed = bench._targets(True, "0.7b", "H100", 0.9, 0.3)
    assert (missed["ratio_met"], missed["mfu_met"]) == (False, False)
    variant = bench._targets(True, "0.7b", "H200-NVL", 0.96, 0.41)
    assert (variant["ratio_met"], variant["mfu_met"]) == (True, True)
    other = bench._targets(True, "0.7b", "A100", 1.0, 0.3)
    assert (other["ratio_met"], other["mfu_met"]) == (True, None)
    cpu = bench._targets(False, "tiny", None, 2.0, 0.5)
    assert (cpu["ratio_met"], cpu["mfu_met"]) == (None, None)


@pytest.mark.timeout(60)
def test_the_07b_baseline_has_our_shapes_and_parameter_count(bench):
    """Both 0.75 B models built on the meta device (no memory, no init): ours takes
    transformers' tensors name by name; a shape that differs fails in one line."""
    from hspmd_elastic.graph.config import ModelConfig

    meta = torch.device("meta")
    for extra, count in (({}, 747_685_888), ({"num_kv_heads": 4, "tie_embeddings": True},
                                              606_652_416)):
        config = ModelConfig(**bench.SIZES["0.7b"], **extra)
        hf = bench.build_transformers(config, meta)
        held = bench.build_ours(config, meta, 16, 4, hf, "device")
        assert bench.parameter_count(held.model.params.values()) == count
        assert bench.parameter_count(hf.parameters()) == count
    wider = bench.build_transformers(ModelConfig(**dict(bench.SIZES["0.7b"], ffn_size=5888)),
                                     meta)
    config = ModelConfig(**bench.SIZES["0.7b"])
    with pytest.raises(bench.BenchFailed, match=r"^parameter layers\.0\.mlp\.w_gate\.weight: "
                       r"ours \(5632, 2048\), transformers' "
                       r"model\.layers\.0\.mlp\.gate_proj\.weight \(5888, 2048\)$"):
        bench.build_ours(config, meta, 16, 4, wider, "device")


def test_the_reference_builds_its_tables_on_the_input_device():
    """``graph/reference.py`` on a non-CPU device (meta: shapes only): its RoPE tables, causal
    mask and key/value head index follow the input, so nothing is mixed with CPU tensors."""
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.init import full_params
    from hspmd_elastic.graph.reference import reference_loss

    config = ModelConfig(vocab_size=32, hidden_size=16, num_heads=4, num_kv_heads=2,
                         num_layers=2, ffn_size=32, seq_len=8)
    params = {k: v.to("meta") for k, v in full_params(config, 0).items()}
    batch = torch.zeros(2, 9, dtype=torch.long, device="meta")
    loss = reference_loss(params, batch, config)
    assert loss.device.type == "meta" and loss.shape == ()
