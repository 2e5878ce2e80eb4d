"""``hspmd_elastic.contract``, the one home of the formats that cross processes: the worker
environment (``WorkerEnv``, ``HangRule``, ``EtcdRestartEnv``), the id rule and device ids, the
progress file, the text-escaping rule; that it stays torch-free and etcd-free; and that no
``HSPMD_*`` name is spelled outside ``contract/env.py``. No etcd, no torch, no processes but
one interpreter for the import check."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hspmd_elastic.contract import env as contract_env
from hspmd_elastic.contract.env import (DEVICE_ENV, HANG_TIMEOUT_ENV, JOB_ID_ENV,
                                        PLAN_VERSION_ENV, PROGRESS_FILE_ENV, ROUND_ENV, EnvError,
                                        EtcdRestartEnv, HangRule, WorkerEnv,
                                        parse_device_setting)
from hspmd_elastic.contract.ids import (ID_RE, IdError, check_id, device_id, device_sort_key,
                                        is_id, node_of, parse_device_id)
from hspmd_elastic.contract.progress import (
    MAX_PROGRESS_BYTES,
    WorkerProgress,
    progress_from_dict,
    read_progress,
    write_progress,
)
from hspmd_elastic.contract.text import bounded, escape, first_line

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "[/bold]\x1b[2J\x1b]0;owned\x07\u202e\u200b\u2028\u2029\x85\ud800\t<x>"

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
counts = st.integers(min_value=0, max_value=10**12)
paths = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
                min_size=1, max_size=30).filter(lambda s: s.strip())


# ------------------------------------------------------------------------------ the package
def test_the_contract_imports_neither_torch_nor_etcd():
    code = ("import sys, hspmd_elastic.contract, hspmd_elastic.contract.schema; "
            "bad = [m for m in ('torch', 'etcd3', 'grpc', 'hspmd_elastic.coord', 'launcher') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


# ------------------------------------------------------------------------------ WorkerEnv
@given(job=st.none() | ids, node=st.none() | ids, endpoints=st.none() | st.just("h:1,h:2"),
       rnd=st.none() | counts, version=st.none() | counts, progress=st.none() | paths,
       device=st.none() | st.sampled_from(["auto", "cuda", "cpu"]))
def test_worker_env_round_trips(job, node, endpoints, rnd, version, progress, device):
    w = WorkerEnv(job=job, node=node, etcd_endpoints=endpoints, round=rnd, plan_version=version,
                  progress_file=progress, device=device)
    env = w.to_env()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert WorkerEnv.from_env(env) == w
    assert len(env) == sum(v is not None for v in (job, node, endpoints, rnd, version,
                                                   progress, device))


def test_worker_env_reads_blank_as_unset_and_normalises_the_device():
    w = WorkerEnv.from_env({JOB_ID_ENV: "", DEVICE_ENV: " CPU ", ROUND_ENV: " 3 ",
                            "UNRELATED": "x"})
    assert w == WorkerEnv(device="cpu", round=3)
    assert WorkerEnv.from_env({}) == WorkerEnv() and WorkerEnv().to_env() == {}
    assert WorkerEnv(progress_file="").to_env() == {}
    assert WorkerEnv.variable("plan_version") == PLAN_VERSION_ENV


@pytest.mark.parametrize("var, value, needle", [
    (JOB_ID_ENV, "a/b", "HSPMD_JOB_ID='a/b' is not valid: use 1-128 characters"),
    (JOB_ID_ENV, "job\n", "HSPMD_JOB_ID='job\\n' is not valid"),
    ("HSPMD_NODE_ID", "x" * 129, "HSPMD_NODE_ID='xxxx"),
    (ROUND_ENV, "-1", "HSPMD_ROUND='-1' is not a non-negative integer"),
    (ROUND_ENV, "1.5", "HSPMD_ROUND='1.5' is not a non-negative integer"),
    (PLAN_VERSION_ENV, "\u0663", "HSPMD_PLAN_VERSION='\u0663' is not a non-negative integer"),
    (DEVICE_ENV, "tpu", "HSPMD_DEVICE='tpu': use one of auto, cuda, cpu"),
    (DEVICE_ENV, "\x1b[2J", "HSPMD_DEVICE='\\x1b[2J'"),
])
def test_bad_worker_env_values_are_one_line_errors_naming_the_variable(var, value, needle):
    with pytest.raises(EnvError) as err:
        WorkerEnv.from_env({var: value})
    message = str(err.value)
    assert needle in message and "\n" not in message and "\x1b" not in message
    assert isinstance(err.value, ValueError) and len(message) < 300


def test_bad_values_are_refused_when_made_too():
    with pytest.raises(EnvError, match="HSPMD_ROUND=True"):
        WorkerEnv(round=True)
    with pytest.raises(EnvError, match="HSPMD_PLAN_VERSION=-2"):
        WorkerEnv(plan_version=-2)
    with pytest.raises(EnvError, match="HSPMD_PROGRESS_FILE="):
        WorkerEnv(progress_file="a\0b")
    assert WorkerEnv(device="CUDA").device == "cuda"


def test_a_reader_of_some_fields_is_not_refused_for_another():
    env = {PROGRESS_FILE_ENV: "/tmp/p.json", ROUND_ENV: "x"}
    with pytest.raises(EnvError, match="HSPMD_ROUND='x'"):
        WorkerEnv.from_env(env)
    assert WorkerEnv.from_env(env, fields=("progress_file",)) == WorkerEnv(
        progress_file="/tmp/p.json")
    with pytest.raises(TypeError, match="no field"):
        WorkerEnv.from_env(env, fields=("nope",))


def test_the_device_setting_rule():
    assert [parse_device_setting(v) for v in (None, "", " Auto", "CPU", "cuda")] == [
        "auto", "auto", "auto", "cpu", "cuda"]
    with pytest.raises(EnvError, match="--flag='gpu': use one of"):
        parse_device_setting("gpu", "--flag")


def test_both_agents_write_what_the_contract_reads():
    from launcher.node.env import elastic_worker_env

    env = elastic_worker_env({"PATH": "/bin", ROUND_ENV: "7"}, ["h:1", "h:2"], "job-1", "n", 2,
                             3, "/tmp/p2.json")
    assert WorkerEnv.from_env(env) == WorkerEnv(job="job-1", node="n", etcd_endpoints="h:1,h:2",
                                                round=7, plan_version=3,
                                                progress_file="/tmp/p2.json")
    assert env["LOCAL_RANK"] == "2"


# ------------------------------------------------------------------------------ HangRule
def test_the_hang_rule_is_parsed_once_here():
    rule = HangRule.from_env({HANG_TIMEOUT_ENV: " 2 ", "HSPMD_HANG_STARTUP_S": "9"})
    assert rule == HangRule(min_timeout_s=2.0, startup_grace_s=9.0)
    assert rule.limits() == {"min_timeout_s": 2.0, "startup_grace_s": 9.0}
    assert HangRule.from_env(rule.to_env()) == rule
    odd = HangRule(multiple=0.1 + 0.2)
    assert HangRule.from_env(odd.to_env()) == odd  # repr: the same float comes back
    assert HangRule.from_env({}) == HangRule() and HangRule().limits() == {}
    assert set(HangRule.variables()) == {"HSPMD_HANG_MULTIPLE", "HSPMD_HANG_TIMEOUT_S",
                                         "HSPMD_HANG_STARTUP_S"}


@pytest.mark.parametrize("value, needle", [
    ("soon", "HSPMD_HANG_TIMEOUT_S='soon' is not a number"),
    ("0", "HSPMD_HANG_TIMEOUT_S='0': min_timeout_s must be > 0 and finite"),
    ("-3", "must be > 0 and finite"),
    ("nan", "HSPMD_HANG_TIMEOUT_S='nan': min_timeout_s must be > 0 and finite"),
    ("inf", "HSPMD_HANG_TIMEOUT_S='inf'"),
    ("1e999", "HSPMD_HANG_TIMEOUT_S='1e999'"),
])
def test_bad_hang_limits_are_one_line_errors(value, needle):
    with pytest.raises(EnvError) as err:
        HangRule.from_env({HANG_TIMEOUT_ENV: value})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_agent_and_the_cli_use_the_rule():
    from launcher.health.api import HealthConfigError
    from launcher.health.progress import hang_detector_from_env

    detector = hang_detector_from_env({"HSPMD_HANG_MULTIPLE": "3"})
    assert (detector.multiple, detector.min_timeout_s) == (3.0, 60.0)  # the default floor
    with pytest.raises(HealthConfigError, match="HSPMD_HANG_MULTIPLE='inf'"):
        hang_detector_from_env({"HSPMD_HANG_MULTIPLE": "inf"})


def test_the_etcd_restart_command_environment():
    env = EtcdRestartEnv(endpoint="h:1", endpoints="h:1,h:2", member="0", how="stop",
                         down_s=1.50, job="j").to_env()
    assert env == {"HSPMD_ETCD_ENDPOINT": "h:1", "HSPMD_ETCD_ENDPOINTS": "h:1,h:2",
                   "HSPMD_ETCD_MEMBER": "0", "HSPMD_ETCD_HOW": "stop",
                   "HSPMD_ETCD_DOWN_S": "1.5", "HSPMD_JOB_ID": "j"}


# ------------------------------------------------------------------------------ ids
@pytest.mark.parametrize("good", ["a", "0", "job-7", "n.1_x", "A" * 128])
def test_the_id_rule_accepts(good):
    assert is_id(good) and ID_RE.match(good) and check_id(good, "node id") == good


@pytest.mark.parametrize("bad", ["", "-a", ".a", "_a", "a/b", "a:b", "a b", "a\n", "\u00e9",
                                 "A" * 129, None, 5])
def test_the_id_rule_refuses_with_one_line(bad):
    assert not is_id(bad)
    with pytest.raises(IdError) as err:
        check_id(bad, "node id")
    assert str(err.value).startswith("node id ") and "is not valid: use 1-128" in str(err.value)
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


def test_every_id_check_uses_the_one_rule():
    from hspmd_elastic.contract import schema
    from launcher import cli

    assert schema.ID_RE is ID_RE
    with pytest.raises(ValueError, match="node id 'a/b' is not valid"):
        schema.node_key("job", "a/b")
    with pytest.raises(ValueError, match="job id 'a\\\\n' is not valid"):
        schema.job_prefix("a\n")
    with pytest.raises(cli.ConfigError, match="invalid --rdzv-id value 'a b': use 1-128"):
        cli._check_id("--rdzv-id", "a b")
    sources = [p for d in ("hspmd_elastic", "launcher") for p in (ROOT / d).rglob("*.py")]
    copies = [p for p in sources if "A-Za-z0-9][A-Za-z0-9._-]" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in copies] == ["hspmd_elastic/contract/ids.py"]


def test_device_ids():
    assert device_id("n0", 3) == "n0:3" and parse_device_id("a:b:12") == ("a:b", 12)
    assert node_of("n1:0") == "n1"
    assert sorted(["n0:10", "n1:0", "n0:2"], key=device_sort_key) == ["n0:2", "n0:10", "n1:0"]
    for bad in ("n0", ":1", "n0:", "n0:x", "n0:-1"):
        with pytest.raises(ValueError, match="is not <node_id>:<index>"):
            parse_device_id(bad)


# ------------------------------------------------------------------------------ progress
REPORT = {"pid": 7, "global_rank": 4, "local_rank": 9, "plan_version": 2, "step": 12,
          "last_progress_at": 1.5e9, "steps_per_s": 3, "state": "training"}


def test_progress_reports_have_one_reader():
    got = progress_from_dict(REPORT, 1)
    assert got == WorkerProgress(pid=7, global_rank=4, local_rank=1, plan_version=2, step=12,
                                 last_progress_at=1.5e9, steps_per_s=3.0, state="training")
    assert isinstance(got.steps_per_s, float)
    assert progress_from_dict({**REPORT, "extra": [1]}, 1) == got  # other keys are ignored
    assert progress_from_dict({k: v for k, v in REPORT.items() if k != "state"}, 1).state == ""
    assert list(got.record_fields()) == ["pid", "global_rank", "local_rank", "plan_version",
                                         "step", "last_progress_at", "steps_per_s", "busy_s",
                                         "probe_s", "probes"]
    assert got.busy_s == 0.0  # optional: absent is "not measured"
    assert progress_from_dict({**REPORT, "busy_s": 0.25}, 1).busy_s == 0.25
    assert progress_from_dict({**REPORT, "busy_s": math.nan}, 1) is None
    idle = progress_from_dict({**REPORT, "probe_s": 0.01, "probes": 3}, 1)  # an idle device's
    assert (idle.probe_s, idle.probes, got.probe_s, got.probes) == (0.01, 3, 0.0, 0)
    assert progress_from_dict({**REPORT, "probes": 1.5}, 1) is None


@pytest.mark.parametrize("change", [
    {"step": True}, {"step": 1.0}, {"pid": "7"}, {"last_progress_at": math.nan},
    {"steps_per_s": math.inf}, {"last_progress_at": 10 ** 400}, {"state": 3},
    {"global_rank": None},
])
def test_a_bad_report_is_no_report(change):
    assert progress_from_dict({**REPORT, **change}, 0) is None


def test_the_progress_file_is_read_back_and_never_raises(tmp_path):
    path = str(tmp_path / "p.json")
    assert read_progress(path, 0) is None  # absent
    sent = WorkerProgress(pid=1, global_rank=0, local_rank=0, plan_version=1, step=5,
                          last_progress_at=2.5, steps_per_s=0.5, state="finishing")
    write_progress(path, sent)
    assert read_progress(path, 0) == sent and not os.path.exists(path + ".tmp")
    for junk in ("{not json", json.dumps([REPORT]), "\xff", "[" * 100_000,
                 json.dumps({**REPORT, "pad": "x" * MAX_PROGRESS_BYTES})):
        Path(path).write_text(junk, encoding="latin-1" if junk == "\xff" else "utf-8")
        assert read_progress(path, 0) is None


def test_the_harness_reads_progress_files_with_the_same_reader(tmp_path):
    from launcher.inject.api import ProgressPoint
    from launcher.inject.progress import FileProgress

    path = tmp_path / "latest.json"
    write_progress(str(path), WorkerProgress(pid=1, global_rank=3, local_rank=0, plan_version=2,
                                             step=4, last_progress_at=8.0, steps_per_s=1.0))
    assert FileProgress(str(path)).poll() == [ProgressPoint(3, 2, 4, 8.0)]


# ------------------------------------------------------------------------------ text
def test_escape_shows_control_format_bidi_and_separator_characters():
    shown = escape(HOSTILE)
    assert shown == ("[/bold]\\x1b[2J\\x1b]0;owned\\x07\\u202e\\u200b\\u2028\\u2029\\x85\\ud800 "
                     "<x>")
    plain = "plain é ü 漢字 \U0001F600 \u00a0"  # printable, or a space: kept as it is
    assert shown.isprintable() and escape(plain) == plain
    assert escape("\U000E0001") == "\\U000e0001"  # a format character beyond the BMP


def test_bounded_cuts_then_escapes_and_says_how_long_it_was():
    assert bounded("short") == "short" and bounded(12) == "12"
    long = "\x1b" * 500
    out = bounded(long, 10)
    assert out == "\\x1b" * 10 + "... (500 chars)"
    assert bounded("x" * 200) == "x" * 200 and bounded("x" * 201).endswith("... (201 chars)")


def test_first_line():
    assert first_line("  plan v2: no live owner\nmore\n") == "plan v2: no live owner"
    assert first_line("") == "" and first_line("  \n ") == ""
    assert first_line("a\u2028b") == "a"  # a line separator ends the line too
    assert first_line("\x1b[2J" + "y" * 400, 50).endswith("... (404 chars)")


def test_the_three_former_rules_are_now_this_one():
    from hspmd_elastic.coord.api import RecordError
    from launcher.node.elastic.judge import JobView, judge
    from launcher.ops.safe import clean

    assert clean(HOSTILE) == bounded(HOSTILE)
    err = RecordError("/hspmd/v1/jobs/j/nodes/n\u202e", HOSTILE)
    assert err.problem == bounded(HOSTILE, 300) and "\u202e" not in str(err)
    state, reason = judge(JobView(switch_failed=HOSTILE + "\nsecond line"))
    assert state == "failed" and reason == "switch failed: " + first_line(HOSTILE, 300)


# ------------------------------------------------------------------------------ one spelling
_NAME = re.compile(r"HSPMD_[A-Z0-9_]+")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                out.add(id(first.value))
    return out


def test_hspmd_names_are_spelled_only_in_contract_env():
    """Outside ``contract/env.py`` a variable is named through its constant: no string (nor
    ``dict(..., HSPMD_X=...)`` keyword) in code spells one; docstrings and comments may."""
    home = ROOT / "hspmd_elastic" / "contract" / "env.py"
    found = []
    for d in ("hspmd_elastic", "launcher"):
        for path in sorted((ROOT / d).rglob("*.py")):
            if path == home:
                continue
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {m}"
                      for m in re.findall(r"[\"']HSPMD_[A-Z0-9_]+[\"']", text)]
            tree = ast.parse(text)
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and id(node) not in docs and _NAME.search(node.value)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
                if isinstance(node, ast.keyword) and node.arg and _NAME.match(node.arg):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}=")
    assert not found, found
    defined = re.findall(r'^[A-Z_]+ = "(HSPMD_[A-Z0-9_]+)"', home.read_text(), re.M)
    assert len(defined) == len(set(defined)) == len(_NAME.findall(
        "\n".join(l for l in home.read_text().splitlines() if " = \"HSPMD_" in l)))
    assert {getattr(contract_env, n) for n in dir(contract_env) if n.endswith("_ENV")
            and isinstance(getattr(contract_env, n), str)} == set(defined)


@pytest.mark.parametrize("mode, other", [("elastic", "restart"), ("restart", "elastic")])
def test_the_agents_two_modes_never_import_each_other(mode, other):
    """``launcher/node`` is three rooms: what both modes use, ``restart/`` and ``elastic/``; the
    job-end record both write is the contract's (``contract.rounds``)."""
    mods = sorted(p.stem for p in (ROOT / "launcher" / "node" / mode).glob("*.py"))
    code = (f"import sys, importlib; [importlib.import_module('launcher.node.{mode}.' + m) "
            f"for m in {mods!r}]; bad = [m for m in sys.modules "
            f"if m.startswith('launcher.node.{other}')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
