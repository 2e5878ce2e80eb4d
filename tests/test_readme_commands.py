"""Every command the README shows runs in a test.

The commands are read from README.md itself: each command of its ```bash blocks (lines joined
over trailing backslashes, a ``python - <<'EOF'`` heredoc kept whole, trailing ``# comments``
dropped) and each ``hspmd-launch ...`` / ``scripts/...`` code span with arguments. ``COVERAGE``
says, for each, how it is proven (matched by a distinctive part of its text, so a command added
to or changed in the README fails ``test_every_readme_command_is_covered`` until a test covers it):

* ``run``: run for real, as written, with only what cannot exist here replaced: the user's
  ``train.py`` (a small stand-in), ``10.0.0.x`` etcd members (a real 3-member etcd cluster on
  loopback), ``/shared`` and ``/tmp/ft`` (a temporary directory);
* ``check``: a command whose real run needs a cluster or a long training run: every flag it
  gives ``hspmd-launch`` is parsed and validated by the real CLI (``build_config``, or the
  subcommand's own parser), and every flag it gives the training script is one the script's
  ``--help`` lists;
* ``skip``: with the reason (the full test suite, which holds this test).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch_harness import LAUNCH, REPO, base_env, new_marker

README = REPO / "README.md"
PY = sys.executable

# (a distinctive part of the command, how it is covered, the test or the reason)
COVERAGE: list[tuple[str, str, str]] = [
    ("scripts/demo --mode restart", "check", "test_demo_restart_mode_is_a_demo_option: the "
     "restart-mode path is proven by tests/test_launch_*.py; running the demo a second time "
     "would add 25 s to the suite"),
    ("scripts/demo", "run", "test_demo_runs"),
    ("scripts/test", "skip", "the whole test suite, which runs this test"),
    ("--standalone --nproc-per-node 3 train.py --epochs 2", "run",
     "test_standalone_example_runs"),
    ("--rdzv-id job42 --max-restarts 3 train.py", "run", "test_two_node_example_runs"),
    ("--rdzv-id job43", "check", "test_elastic_example_parses: two nodes training 200 steps of "
     "the user's model; elastic jobs run in tests/test_elastic_e2e.py"),
    ("data make /shared/train.bin", "run", "test_data_commands_run"),
    ("data check /shared/train.bin", "run", "test_data_commands_run"),
    ("hspmd-launch ... examples/elastic_llama.py", "check", "test_data_commands_run: '...' "
     "stands for the elastic flags above"),
    ("documents make /shared/docs", "run", "test_documents_commands_run"),
    ("examples/elastic_llama.py --config model.json --global-batch 8 --documents", "check",
     "test_documents_commands_run: '...' stands for the elastic flags above; "
     "tests/test_elastic_documents.py runs an elastic job on packed documents"),
    ("examples/elastic_llama.py --config model.json --global-batch 8 --documents "
     "/shared/docs.idx --lengths", "check", "test_length_buckets_command_parses: '...' stands "
     "for the elastic flags above; tests/test_elastic_buckets.py runs a bucketed elastic job"),
    ("save_pretrained(\"/tmp/ft/llama-tiny\")", "run", "test_finetune_example"),
    ("data make /tmp/ft/train.bin", "run", "test_finetune_example"),
    ("examples/finetune_llama.py --model /tmp/ft/llama-tiny", "check", "test_finetune_example: "
     "tests/test_finetune.py runs this fine-tune under hspmd-launch (with a worker killed)"),
    ("after(input_ids=ids)", "skip", "needs the fine-tuned export of the command before it; "
     "tests/test_finetune.py loads that export in transformers and compares it"),
    ("hspmd-launch -- status", "run", "test_script_named_like_a_subcommand_runs"),
    ("hspmd-launch plan --devices", "run", "test_plan_example_runs"),
    ("hspmd-launch status --job ID", "run", "test_two_node_example_runs (then status)"),
    ("hspmd-launch dashboard --job ID", "check", "test_subcommand_examples_parse"),
    ("hspmd-launch inject --job ID", "check", "test_subcommand_examples_parse"),
    ("scripts/bench_recovery --state-moves", "check", "test_benchmark_options_exist: a "
     "benchmark of several minutes (its numbers are in docs/benchmarks.md)"),
    ("scripts/bench_step --mfu", "check", "test_benchmark_options_exist: a benchmark for a GPU "
     "machine (scripts/gpu_check runs it there)"),
]


# ------------------------------------------------------------------------- reading the README
def readme_commands(text: str | None = None) -> list[str]:
    """The README's shell commands, in order (see the module docstring)."""
    text = README.read_text() if text is None else text
    commands: list[str] = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.M | re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            heredoc = re.search(r"<<\s*'?(\w+)'?\s*$", line)
            if heredoc:
                end = lines.index(heredoc.group(1), i)
                commands.append("\n".join([line, *lines[i:end + 1]]))
                i = end + 1
                continue
            while line.endswith("\\"):
                line = line[:-1].rstrip() + " " + lines[i].strip()
                i += 1
            commands.append(re.sub(r"\s+#\s.*$", "", line).strip())
    for span in re.findall(r"`((?:hspmd-launch|scripts/)[^`\n]*)`", text):
        if re.search(r"\s-", span):  # a command with arguments, not a name
            commands.append(span)
    return commands


def covering(command: str) -> list[tuple[str, str, str]]:
    """The COVERAGE entries whose text is in ``command`` (the longest match wins a tie of
    prefixes: ``scripts/demo --mode restart`` over ``scripts/demo``)."""
    hits = [entry for entry in COVERAGE if entry[0] in command]
    longest = max((len(e[0]) for e in hits), default=0)
    return [e for e in hits if len(e[0]) == longest]


def command(part: str) -> str:
    """The one README command that ``part`` covers."""
    found = [c for c in readme_commands() if covering(c) and covering(c)[0][0] == part]
    assert len(found) == 1, (part, found)
    return found[0]


def words(cmd: str, **subst: str) -> list[str]:
    """``cmd`` split as the shell would (``"$(hostname)"`` expanded, optional ``[...]`` flags
    taken), each ``old=new`` of ``subst`` applied to the text first."""
    for old, new in subst.items():
        cmd = cmd.replace(old, new)
    cmd = cmd.replace('"$(hostname)"', socket.gethostname())
    cmd = re.sub(r"\[(--[^\]]*)\]", r"\1", cmd)
    return shlex.split(cmd)


def script_flags(argv: list[str], script: str) -> list[str]:
    """The ``--flags`` after ``script`` in ``argv``."""
    return [a for a in argv[argv.index(script) + 1:] if a.startswith("--")]


@functools.lru_cache(maxsize=None)
def _script_help(script: Path) -> str:
    """``script --help``, run once per script (several tests read the same script's)."""
    out = subprocess.run([PY, str(script), "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def assert_script_takes(script: str, flags: list[str]) -> None:
    """Every one of ``flags`` is in ``script --help`` (the script's own parser)."""
    text = _script_help(REPO / script)
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])",
                                                 text)]
    assert not missing, f"{script} does not take {missing}"


def parse_launch(argv: list[str]):
    """The real CLI's parse and validation of ``hspmd-launch`` ``argv`` (no process started)."""
    from launcher import cli

    assert argv[0] == "hspmd-launch"
    ctx = cli.launch_command.make_context("hspmd-launch", argv[1:])
    return cli.build_config(ctx.params)


def run(argv: list[str], cwd: Path, env: dict, timeout: float = 120, **kw):
    exe = {"hspmd-launch": LAUNCH, "python": PY}.get(argv[0], argv[0])
    return subprocess.run([exe, *argv[1:]], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


TRAIN_PY = """\
import argparse, os
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
# one write per line: workers sharing the agent's stdout never interleave within a line
os.write(1, f"train.py rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}, "
            f"{args.epochs} epochs\\n".encode())
"""


# ------------------------------------------------------------------------------- the coverage
def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) >= 15, commands  # the reader found the blocks
    for cmd in commands:
        assert len(covering(cmd)) == 1, f"README command not covered by one test: {cmd!r}"
    used = {covering(c)[0][0] for c in commands}
    stale = [e[0] for e in COVERAGE if e[0] not in used]
    assert not stale, f"COVERAGE entries that match no README command: {stale}"


def test_the_reader_joins_lines_and_keeps_heredocs():
    text = ("```bash\n# note\nhspmd-launch --a 1 \\\n    --b 2 x.py   # why\n"
            "python - <<'EOF'\nprint(1)\nEOF\n```\n| `hspmd-launch plan --devices 8xH800` |\n"
            "`hspmd-launch plan` names a subcommand\n")
    assert readme_commands(text) == ["hspmd-launch --a 1 --b 2 x.py",
                                     "python - <<'EOF'\nprint(1)\nEOF",
                                     "hspmd-launch plan --devices 8xH800"]


# ---------------------------------------------------------------------------------- run ones
def test_plan_example_runs(tmp_path):
    argv = words(command("hspmd-launch plan --devices"))
    out = run(argv, tmp_path, base_env(new_marker()), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "(1 failed: 3)" in out.stdout.splitlines()[0]
    by_name = run([a.replace("0:3", "node0:3") for a in argv], tmp_path,
                  base_env(new_marker()), timeout=60)
    assert by_name.stdout == out.stdout  # NODE:INDEX by position or by name: the same device


def test_standalone_example_runs(tmp_path, marker):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    argv = words(command("--standalone --nproc-per-node 3 train.py --epochs 2"))
    out = run(argv, tmp_path, base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    assert out.returncode == 0, out.stderr
    said = sorted(ln for ln in out.stdout.splitlines() if ln.startswith("train.py rank"))
    assert said == [f"train.py rank {r} of 3, 2 epochs" for r in range(3)], out.stdout


def test_two_node_example_runs(tmp_path, marker, etcd_cluster3):
    """Both nodes run the README's command (its three members: a real etcd cluster); then
    ``status`` reads the job."""
    (tmp_path / "train.py").write_text(TRAIN_PY)
    members = ",".join(etcd_cluster3.endpoints)
    argv = words(command("--rdzv-id job42 --max-restarts 3 train.py"),
                 **{"10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379": members})
    env = base_env(marker, PET_LOG_DIR=str(tmp_path / "logs"))
    procs = [subprocess.Popen([LAUNCH, *argv[1:]], cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    said = sorted(ln for o in outs for ln in o[0].splitlines() if ln.startswith("train.py"))
    assert said == sorted(f"train.py rank {r} of 8, 1 epochs" for r in range(8))
    status = words(command("hspmd-launch status --job ID"), ID="job42", **{" [--watch]": ""})
    out = run([*status, "--etcd-endpoints", members], tmp_path, env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["job"] == "job42"


def test_script_named_like_a_subcommand_runs(tmp_path, marker):
    (tmp_path / "status").write_text("print('the script called status ran')\n")
    argv = words(command("hspmd-launch -- status"))
    out = run(argv, tmp_path, base_env(marker, PET_LOG_DIR=str(tmp_path / "logs")))
    assert out.returncode == 0, out.stderr
    assert "the script called status ran" in out.stdout


def test_data_commands_run(tmp_path):
    env = base_env(new_marker())
    shared = str(tmp_path / "shared")
    Path(shared).mkdir()
    for part in ("data make /shared/train.bin", "data check /shared/train.bin"):
        out = run(words(command(part), **{"/shared": shared}), tmp_path, env)
        assert out.returncode == 0, out.stderr
    assert "10000000 uint16 tokens" in out.stdout
    argv = words(command("hspmd-launch ... examples/elastic_llama.py"))
    assert_script_takes("examples/elastic_llama.py",
                        script_flags(argv, "examples/elastic_llama.py"))


def test_documents_commands_run(tmp_path):
    env = base_env(new_marker())
    shared = str(tmp_path / "shared")
    Path(shared).mkdir()
    make = words(command("documents make /shared/docs"), **{"/shared": shared},
                 **{"--docs 10000": "--docs 200"})
    out = run(make, tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert (Path(shared) / "docs.idx").is_file() and (Path(shared) / "docs.bin").is_file()
    key = "examples/elastic_llama.py --config model.json --global-batch 8 --documents"
    argv = words(command(key), **{"/shared": shared})
    assert_script_takes("examples/elastic_llama.py",
                        script_flags(argv, "examples/elastic_llama.py"))


def test_length_buckets_command_parses(tmp_path, monkeypatch):
    from _elastic_job import write_tiny

    from launcher.api import ConfigError

    monkeypatch.chdir(tmp_path)
    write_tiny(tmp_path / "tiny.json")
    model = json.loads((tmp_path / "tiny.json").read_text())
    (tmp_path / "model.json").write_text(json.dumps(dict(model, seq_len=2048)))
    key = ("examples/elastic_llama.py --config model.json --global-batch 8 --documents "
           "/shared/docs.idx --lengths")
    elastic = ("--nnodes 1 --rdzv-endpoint 10.0.0.1:2379 --hspmd-elastic --hspmd-model "
               "model.json --hspmd-global-batch 8")
    argv = words(command(key), **{"...": elastic, "examples/": str(REPO / "examples") + "/"})
    cfg = parse_launch(argv)
    assert cfg.elastic.lengths == ((256, 0.9), (2048, 0.1))
    script = str(REPO / "examples/elastic_llama.py")
    assert_script_takes(script, script_flags(argv, script))
    with pytest.raises(ConfigError, match="longest bucket .1024 tokens. must be the model's "
                                          "sequence length 2048"):
        parse_launch([a.replace("2048:0.1", "1024:0.1") for a in argv])


@pytest.mark.timeout(300)  # it may start the session's demo run (``demo_run``, conftest.py)
def test_demo_runs(demo_run):
    """``scripts/demo`` is the environment's set-up (what scripts/test did already) and then
    ``python scripts/demo_job.py``: that runs here, to its RESULT line (the session's one demo
    run; tests/test_demo_cleanup.py checks what it left behind)."""
    assert command("scripts/demo") == "scripts/demo"
    assert (REPO / "scripts/demo").read_text().rstrip().endswith(
        'exec python scripts/demo_job.py "$@"')
    out = demo_run
    assert out["code"] == 0, out["stdout"][-3000:] + out["stderr"][-3000:]
    result = json.loads(out["stdout"].strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["recovered"] == result["faults"] == 1 and result["samples_lost"] == 0
    assert out["seconds"] < 240


# -------------------------------------------------------------------------------- check ones
def test_demo_restart_mode_is_a_demo_option():
    argv = words(command("scripts/demo --mode restart"))
    out = subprocess.run([PY, "scripts/demo_job.py", "--help"], cwd=str(REPO),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--mode {elastic,restart}" in out.stdout, out.stdout
    assert argv[1:] == ["--mode", "restart"]


def test_elastic_example_parses(tmp_path, monkeypatch):
    from _elastic_job import write_tiny

    monkeypatch.chdir(tmp_path)
    write_tiny(tmp_path / "model.json")
    script = str(REPO / "examples/elastic_llama.py")
    argv = words(command("--rdzv-id job43"), **{"examples/": str(REPO / "examples") + "/"})
    cfg = parse_launch(argv)
    assert cfg.elastic is not None and cfg.elastic.global_batch == 8
    assert cfg.rdzv.endpoints == ("10.0.0.1:2379",) and cfg.node_id == socket.gethostname()
    assert cfg.elastic.debounce_s == 0.25
    assert_script_takes(script, script_flags(argv, script))


def test_finetune_example(tmp_path, monkeypatch):
    """The tiny checkpoint and the token file are made for real; the fine-tune's flags are
    parsed by the real CLI (it reads the checkpoint's config.json) and by the script."""
    pytest.importorskip("transformers")
    ft = str(tmp_path / "ft")
    env = base_env(new_marker())
    make = command("save_pretrained(\"/tmp/ft/llama-tiny\")").replace("/tmp/ft", ft)
    head, _, body = make.partition("\n")
    out = run(shlex.split(head.split("<<")[0]), REPO, env, timeout=180,
              input=body.rsplit("\n", 1)[0] + "\n")
    assert out.returncode == 0, out.stderr
    assert (Path(ft) / "llama-tiny" / "config.json").is_file()
    out = run(words(command("data make /tmp/ft/train.bin"), **{"/tmp/ft": ft}), REPO, env)
    assert out.returncode == 0, out.stderr
    monkeypatch.chdir(REPO)
    argv = words(command("examples/finetune_llama.py --model /tmp/ft/llama-tiny"),
                 **{"/tmp/ft": ft})
    cfg = parse_launch(argv)
    assert cfg.rdzv.standalone and cfg.nproc_per_node == 2 and cfg.elastic.global_batch == 8
    assert_script_takes("examples/finetune_llama.py",
                        script_flags(argv, "examples/finetune_llama.py"))


@pytest.mark.parametrize("part", ["scripts/bench_recovery --state-moves",
                                  "scripts/bench_step --mfu"])
def test_benchmark_options_exist(part):
    argv = words(command(part))
    assert_script_takes(argv[0], argv[1:])


def test_subcommand_examples_parse(tmp_path):
    """``dashboard`` and ``inject`` need a running job: their flags, placeholders filled, go
    through the subcommands' own parsers."""
    import importlib

    from launcher.cli import SUBCOMMANDS

    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    scenario = next((REPO / "examples" / "scenarios").glob("*.json"))
    fills = {"ID": "job42", " P ": " 0 ", "NAME": "localhost", " F]": f" {token}]",
             "--scenario FILE": f"--scenario {scenario}",
             "--topology FILE": f"--topology {tmp_path / 'topology.json'}", "CMD": "true"}
    for part in ("hspmd-launch dashboard --job ID", "hspmd-launch inject --job ID"):
        argv = words(command(part), **fills)
        module, _, attr = SUBCOMMANDS[argv[1]].partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        ctx = cmd.make_context(f"hspmd-launch {argv[1]}",
                               [*argv[2:], "--etcd-endpoints", "127.0.0.1:2379"])
        assert ctx.params["job"] == "job42"
