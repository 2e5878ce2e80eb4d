"""``srun hspmd-launch``: defaults from Slurm's environment (launcher.slurm). No Slurm needed.

Slurm's hostlist syntax expanded (examples, one-line refusals, a round-trip property), the
detection of an ``srun`` step, each rule of the mapping on its own, then the real command line
(``launch_command.make_context`` and ``build_config``) with a step's environment: what a task
of ``srun -N 3`` gets without flags, flags and ``PET_*`` winning over every rule, the one-line
errors of an inconsistent environment, and no change at all without Slurm's variables or with
``--hspmd-slurm off``.
"""

from __future__ import annotations

import os

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch_harness import SCRIPTS

from launcher import cli
from launcher.api import ConfigError
from launcher.slurm import MAX_HOSTS, expand_hostlist, slurm_defaults, under_srun

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(SCRIPTS / "sleeper.py")
HOSTS = ["node01", "node02", "node03"]


def step_env(nodes: str = "node[01-03]", count: int = 3, node: int = 1,
             **extra: str) -> dict[str, str]:
    """What Slurm sets for the task on node ``node`` of ``srun -N <count>`` in job 4242."""
    hosts = expand_hostlist(nodes)
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node), "SLURMD_NODENAME": hosts[node],
        "SLURM_STEP_NUM_NODES": str(count), "SLURM_NNODES": str(count),
        "SLURM_JOB_NUM_NODES": str(count), "SLURM_STEP_NODELIST": nodes,
        "SLURM_JOB_NODELIST": nodes, "SLURM_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{count})", "SLURM_TASKS_PER_NODE": f"1(x{count})",
        "SLURM_STEP_NUM_TASKS": str(count), "SLURM_NTASKS": str(count),
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No Slurm, CUDA or PET_ variable of the machine running the tests leaks in."""
    for name in list(os.environ):
        if name.startswith(("SLURM", "PET_")) or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)


def set_env(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def parse(args: list[str]):
    ctx = cli.launch_command.make_context("hspmd-launch", [*args, SCRIPT])
    return ctx.params, cli.build_config(ctx.params)


def refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse(args)
    line = str(info.value)
    assert "\n" not in line
    return line


# ------------------------------------------------------------------------------------ hostlist
@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("a,b,c", ["a", "b", "c"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("gpu-a[1-2],node[01-03]", ["gpu-a1", "gpu-a2", "node01", "node02", "node03"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[7]", ["n7"]),
    ("n[3-3]x", ["n3x"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("h1.example.org,h[2-3].example.org", ["h1.example.org", "h2.example.org",
                                           "h3.example.org"]),
    (" n[1-2] ", ["n1", "n2"]),
])
def test_hostlist_expands_like_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, why", [
    ("", "empty hostlist"),
    ("n[1-2", "'[' without ']'"),
    ("n1-2]", "']' without '['"),
    ("n[[1-2]]", "nested"),
    ("n[a-b]", "[a-b]"),
    ("n[1-2,]", "[1-2,]"),
    ("n[]", "[]"),
    ("n[3-1]", "3-1 ends before it starts"),
    ("a,,b", "empty host name"),
    ("a,", "empty host name"),
    ("bad host", "outside [A-Za-z0-9._-]"),
    ("n[1-2]/x", "outside [A-Za-z0-9._-]"),
    (f"n[1-{MAX_HOSTS + 1}]", f"more than {MAX_HOSTS} hosts"),
    ("r[1-300]n[1-300]", f"more than {MAX_HOSTS} hosts"),
    ("a[1-40000],b[1-40000]", f"more than {MAX_HOSTS} hosts"),
])
def test_malformed_hostlist_is_one_line_naming_variable_and_value(text, why):
    with pytest.raises(ConfigError) as info:
        expand_hostlist(text, "SLURM_JOB_NODELIST")
    line = str(info.value)
    assert "\n" not in line and why in line
    assert f"SLURM_JOB_NODELIST={text.strip()!r}" in line


_ranges = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 12), st.integers(1, 4)),
                   min_size=1, max_size=4)
_names = st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9.-]{0,5}", fullmatch=True), _ranges,
                            st.from_regex(r"[a-z.-]{0,3}", fullmatch=True)),
                  min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(_names)
def test_hostlist_round_trip(names):
    """A list written in Slurm's syntax expands to exactly the hosts it was written from."""
    text, expected = [], []
    for prefix, ranges, suffix in names:
        parts = []
        for lo, span, width in ranges:
            hi = lo + span
            parts.append(str(lo).zfill(width) if span == 0
                         else f"{str(lo).zfill(width)}-{str(hi).zfill(width)}")
            expected += [f"{prefix}{str(n).zfill(width)}{suffix}" for n in range(lo, hi + 1)]
        text.append(f"{prefix}[{','.join(parts)}]{suffix}")
    assert expand_hostlist(",".join(text)) == expected


# ----------------------------------------------------------------------------------- detection
def test_only_an_srun_step_counts():
    assert under_srun(step_env())
    batch = {k: v for k, v in step_env(node=0).items() if "STEP" not in k}  # sbatch's script
    assert not under_srun(batch)
    salloc = {k: v for k, v in step_env(node=0).items() if k != "SLURM_PROCID"}
    assert not under_srun(salloc)
    for reserved in ("4294967291", "4294967290", "4294967292", "batch", "extern", "", " "):
        assert not under_srun(step_env(SLURM_STEP_ID=reserved)), reserved
    assert under_srun(step_env(SLURM_STEP_ID="17"))
    assert not under_srun({})


# ---------------------------------------------------------------------------- rules one by one
def test_every_rule_of_a_task_without_flags():
    out = slurm_defaults(step_env(node=2, SLURM_GPUS_ON_NODE="4"), {})
    assert out == {"hspmd_node_id": "node03", "node_rank": 2, "nnodes": "3",
                   "nproc_per_node": "4", "rdzv_id": "slurm-4242", "rdzv_backend": "c10d",
                   "rdzv_endpoint": "node01:29400"}


def test_node_id_falls_back_to_the_hostname():
    env = step_env()
    del env["SLURMD_NODENAME"]
    assert slurm_defaults(env, {}, hostname="gpu7.cluster")["hspmd_node_id"] == "gpu7.cluster"
    assert slurm_defaults(env, {}, hostname="odd host!")["hspmd_node_id"] == "odd-host"


def test_step_variables_come_first():
    """srun -N 2 inside a 3-node allocation: the step's nodes, not the job's."""
    env = step_env(nodes="node[02-03]", count=2, node=0, SLURM_JOB_NODELIST="node[01-03]",
                   SLURM_JOB_NUM_NODES="3")
    out = slurm_defaults(env, {})
    assert out["nnodes"] == "2" and out["rdzv_endpoint"] == "node02:29400"
    assert out["hspmd_node_id"] == "node02" and out["node_rank"] == 0


def test_older_variables_are_enough():
    env = {k: v for k, v in step_env().items() if not k.startswith("SLURM_STEP_")}
    env["SLURM_STEP_ID"] = "3"
    out = slurm_defaults(env, {})
    assert out["nnodes"] == "3" and out["rdzv_endpoint"] == "node01:29400"
    only_list = {k: v for k, v in env.items() if k not in ("SLURM_NNODES",
                                                           "SLURM_JOB_NUM_NODES")}
    assert slurm_defaults(only_list, {})["nnodes"] == "3"


@pytest.mark.parametrize("extra, nproc", [
    ({"SLURM_GPUS_ON_NODE": "8"}, "8"),
    ({"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "2"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "2"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,GPU-cc"}, "3"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, "2"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"CUDA_VISIBLE_DEVICES": ""}, None),
    ({"SLURM_GPUS_ON_NODE": "0"}, None),
    ({}, None),
])
def test_nproc_from_the_gpus_slurm_gave(extra, nproc):
    for given in ({}, {"nproc_per_node": "gpu"}, {"nproc_per_node": "auto"}):
        if nproc is None and given.get("nproc_per_node") == "gpu":
            with pytest.raises(ConfigError, match="Slurm gave this node no GPUs"):
                slurm_defaults(step_env(**extra), given)
            continue
        assert slurm_defaults(step_env(**extra), given).get("nproc_per_node") == nproc
    for explicit in ("2", "cpu", "GPU"):  # a number or another word: the user's
        assert "nproc_per_node" not in slurm_defaults(step_env(**extra),
                                                      {"nproc_per_node": explicit})


def test_requeue_rejoins_under_the_same_id():
    first = slurm_defaults(step_env(), {})
    again = slurm_defaults(step_env(SLURM_RESTART_COUNT="1", SLURM_STEP_ID="0"), {})
    assert first["rdzv_id"] == again["rdzv_id"] == "slurm-4242"


def test_rendezvous_choices():
    env = step_env()
    assert slurm_defaults(env, {"rdzv_backend": "c10d"})["rdzv_endpoint"] == "node01:29400"
    assert "rdzv_backend" not in slurm_defaults(env, {"rdzv_backend": "c10d"})
    static = slurm_defaults(env, {"rdzv_backend": "static"})
    assert static["master_addr"] == "node01" and "rdzv_endpoint" not in static
    assert "master_addr" not in slurm_defaults(env, {"rdzv_backend": "static",
                                                     "master_addr": "10.0.0.1"})
    etcd = slurm_defaults(env, {"rdzv_backend": "etcd"})
    assert "rdzv_endpoint" not in etcd and "rdzv_backend" not in etcd
    external = slurm_defaults(env, {"hspmd_etcd_endpoints": "e1:2379"})
    assert external["rdzv_backend"] == "etcd" and "rdzv_endpoint" not in external
    given = slurm_defaults(env, {"rdzv_endpoint": "head:1234"})
    assert "rdzv_endpoint" not in given and "rdzv_backend" not in given
    alone = slurm_defaults(env, {"standalone": True})
    assert not {"nnodes", "rdzv_backend", "rdzv_endpoint"} & set(alone)


# ------------------------------------------------------------------------- the real CLI: rules
def test_without_slurm_nothing_changes(monkeypatch):
    plain, cfg = parse([])
    off, _ = parse(["--hspmd-slurm", "off"])
    assert {k: v for k, v in plain.items() if k != "hspmd_slurm"} == \
        {k: v for k, v in off.items() if k != "hspmd_slurm"}
    assert cfg.rdzv.standalone and cfg.nproc_per_node == 1 and cfg.rdzv.node_rank is None
    batch = {k: v for k, v in step_env(node=0).items() if "STEP" not in k}
    set_env(monkeypatch, batch)  # a batch script running hspmd-launch itself
    again, _ = parse([])
    assert again == plain


def test_a_task_of_srun_needs_no_flags(monkeypatch):
    set_env(monkeypatch, step_env(node=1, SLURM_GPUS_ON_NODE="4"))
    _, cfg = parse([])
    assert cfg.node_id == "node02" and cfg.rdzv.node_rank == 1
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (3, 3)
    assert cfg.nproc_per_node == 4 and cfg.rdzv.run_id == "slurm-4242"
    assert cfg.rdzv.backend == "c10d" and cfg.rdzv.endpoints == ("node01:29400",)
    assert cfg.rdzv.host_etcd and not cfg.rdzv.standalone  # the node at node01 serves it


def test_a_single_node_step_runs_standalone(monkeypatch):
    set_env(monkeypatch, step_env(nodes="solo", count=1, node=0))
    _, cfg = parse([])
    assert cfg.rdzv.standalone and cfg.node_id == "solo"


def test_off_ignores_slurm(monkeypatch):
    set_env(monkeypatch, step_env(SLURM_NODEID="7", SLURM_GPUS_ON_NODE="4"))
    for args in (["--hspmd-slurm", "off"], ["--hspmd-slurm=OFF"]):
        params, cfg = parse(args)
        assert cfg.rdzv.standalone and cfg.nproc_per_node == 1 and params["node_rank"] is None
    monkeypatch.setenv("PET_HSPMD_SLURM", "off")
    _, cfg = parse([])
    assert cfg.rdzv.max_nodes == 1 and cfg.rdzv.run_id != "slurm-4242"


def test_bad_setting_is_refused(monkeypatch):
    with pytest.raises(click.BadParameter, match="sometimes"):
        parse(["--hspmd-slurm", "sometimes"])


# ---------------------------------------------------------------------- the real CLI: flags win
def test_spares_flags_and_pet_variables_win(monkeypatch):
    set_env(monkeypatch, step_env(node=2, SLURM_GPUS_ON_NODE="4"))
    _, cfg = parse(["--nnodes", "2"])  # an elastic job of 2 nodes, srun -N 3: one spare
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (2, 2)
    assert cfg.rdzv.node_rank == 2 and cfg.rdzv.endpoints == ("node01:29400",)
    _, cfg = parse(["--nnodes=2:3"])
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (2, 3)
    _, cfg = parse(["--node-rank", "0", "--hspmd-node-id", "mine", "--rdzv-id", "run-9",
                    "--nproc-per-node", "2"])
    assert cfg.rdzv.node_rank == 0 and cfg.node_id == "mine" and cfg.rdzv.run_id == "run-9"
    assert cfg.nproc_per_node == 2
    _, cfg = parse(["--nproc-per-node", "gpu"])  # a word that counts: Slurm's count
    assert cfg.nproc_per_node == 4
    set_env(monkeypatch, {"PET_NNODES": "1:3", "PET_NODE_RANK": "5", "PET_RDZV_ID": "pet",
                          "PET_HSPMD_NODE_ID": "pet-node", "PET_NPROC_PER_NODE": "3"})
    _, cfg = parse([])
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (1, 3) and cfg.rdzv.node_rank == 5
    assert cfg.rdzv.run_id == "pet" and cfg.node_id == "pet-node" and cfg.nproc_per_node == 3
    _, cfg = parse(["--nnodes", "3", "--rdzv-id", "flag"])  # and the command line wins over PET
    assert cfg.rdzv.max_nodes == 3 and cfg.rdzv.run_id == "flag"


def test_given_rendezvous_wins(monkeypatch):
    set_env(monkeypatch, step_env(node=0))
    _, cfg = parse(["--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd-a:2379,etcd-b:2379"])
    assert cfg.rdzv.endpoints == ("etcd-a:2379", "etcd-b:2379") and not cfg.rdzv.host_etcd
    _, cfg = parse(["--hspmd-etcd-endpoints", "etcd-a:2379"])
    assert cfg.rdzv.backend == "etcd" and cfg.rdzv.endpoints == ("etcd-a:2379",)
    _, cfg = parse(["--rdzv-backend", "static"])  # node rank 0 serves at the first host
    assert cfg.rdzv.endpoints == ("node01:29500",) and cfg.rdzv.host_etcd
    _, cfg = parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", "head"])
    assert cfg.rdzv.endpoints == ("head:29400",)
    _, cfg = parse(["--standalone"])
    assert cfg.rdzv.standalone and cfg.rdzv.max_nodes == 1 and cfg.node_id == "node01"
    set_env(monkeypatch, step_env(nodes="solo", count=1, node=0))
    _, cfg = parse(["--hspmd-etcd-endpoints", "etcd-a:2379"])  # one node, external etcd
    assert not cfg.rdzv.standalone and cfg.rdzv.endpoints == ("etcd-a:2379",)


# ---------------------------------------------------------------- inconsistent environments
@pytest.mark.parametrize("extra, args, names", [
    ({"SLURM_NODEID": "3"}, [], "SLURM_NODEID='3'"),
    ({"SLURM_NODEID": "one"}, [], "SLURM_NODEID='one'"),
    ({"SLURM_NODEID": "-1"}, [], "SLURM_NODEID='-1'"),
    ({"SLURM_STEP_NUM_NODES": "three"}, [], "SLURM_STEP_NUM_NODES='three'"),
    ({"SLURM_STEP_NUM_NODES": "0"}, [], "SLURM_STEP_NUM_NODES='0'"),
    ({"SLURM_STEP_NODELIST": "node[01-04]"}, [], "SLURM_STEP_NODELIST='node[01-04]'"),
    ({"SLURM_STEP_NODELIST": "node[01-03"}, [], "SLURM_STEP_NODELIST='node[01-03'"),
    ({"SLURM_STEP_NODELIST": "node[01-04]"}, ["--nnodes", "2"], "4 hosts"),
    ({"SLURMD_NODENAME": "bad/name"}, [], "SLURMD_NODENAME='bad/name'"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, [], "SLURM_STEP_TASKS_PER_NODE='2(x3)'"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,2,1"}, [], "--ntasks-per-node=1"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x"}, [], "SLURM_STEP_TASKS_PER_NODE='1(x'"),
    ({"SLURM_GPUS_ON_NODE": "four"}, [], "SLURM_GPUS_ON_NODE='four'"),
    ({"SLURM_JOB_ID": "12abc"}, [], "SLURM_JOB_ID='12abc'"),
    ({"SLURM_GPUS_ON_NODE": "0"}, ["--nproc-per-node", "gpu"], "SLURM_GPUS_ON_NODE='0'"),
])
def test_inconsistent_environment_is_one_line(monkeypatch, extra, args, names):
    set_env(monkeypatch, step_env(**extra))
    assert names in refusal(args)


def test_tasks_per_node_of_the_step_decide(monkeypatch):
    """sbatch --ntasks-per-node=8 leaves SLURM_NTASKS_PER_NODE=8 to an srun of one task per
    node: the step's own layout is what counts. Without it, the older variables are read."""
    set_env(monkeypatch, step_env(SLURM_NTASKS_PER_NODE="8"))
    _, cfg = parse([])
    assert cfg.rdzv.max_nodes == 3
    env = {k: v for k, v in step_env(SLURM_NTASKS_PER_NODE="2").items()
           if "TASKS_PER_NODE" not in k or k == "SLURM_NTASKS_PER_NODE"}
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE")
    monkeypatch.delenv("SLURM_TASKS_PER_NODE")
    set_env(monkeypatch, env)
    assert "SLURM_NTASKS_PER_NODE='2'" in refusal([])


def test_flags_not_filled_do_not_read_their_variables(monkeypatch):
    """Only the variables a filled flag needs are read: giving the flag gets past them."""
    set_env(monkeypatch, step_env(SLURMD_NODENAME="bad/name", SLURM_NODEID="9",
                                  SLURM_STEP_NODELIST="garbage["))
    _, cfg = parse(["--hspmd-node-id", "n1", "--node-rank", "1", "--rdzv-backend", "etcd",
                    "--rdzv-endpoint", "e:2379"])
    assert cfg.node_id == "n1" and cfg.rdzv.max_nodes == 3


def test_the_command_prints_one_line_and_exits_2(monkeypatch, capsys):
    set_env(monkeypatch, step_env(SLURM_NODEID="3"))
    assert cli.main([SCRIPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hspmd-launch: error: invalid Slurm environment")
    assert "SLURM_NODEID='3'" in err[0]


# --------------------------------------------------- each variable read only where it is needed
ALL_FLAGS = ["--hspmd-node-id", "n1", "--node-rank", "1", "--nnodes", "3",
             "--nproc-per-node", "2", "--rdzv-id", "run-1", "--rdzv-backend", "etcd",
             "--rdzv-endpoint", "e:2379"]


@pytest.mark.parametrize("extra", [
    {"SLURM_STEP_NUM_NODES": None, "SLURM_NNODES": "abc"},
    {"SLURM_STEP_NUM_NODES": "abc"},
    {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)"},
    {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "2(x2)"},
    {"SLURM_NODEID": "7", "SLURMD_NODENAME": "elsewhere", "SLURM_JOB_ID": "x"},
])
def test_every_flag_given_reads_no_slurm_variable(monkeypatch, extra):
    """With every flag Slurm could fill given, no Slurm variable is read, so none can abort."""
    set_env(monkeypatch, {k: v for k, v in step_env(**extra).items() if v is not None})
    for name in [k for k, v in extra.items() if v is None]:
        monkeypatch.delenv(name, raising=False)
    _, cfg = parse(ALL_FLAGS)
    assert cfg.node_id == "n1" and cfg.rdzv.node_rank == 1 and cfg.rdzv.max_nodes == 3
    assert cfg.nproc_per_node == 2 and cfg.rdzv.run_id == "run-1"


def test_the_tasks_per_node_still_guard_a_filled_identity(monkeypatch):
    set_env(monkeypatch, step_env(SLURM_STEP_TASKS_PER_NODE="2(x2)"))
    assert "SLURM_STEP_TASKS_PER_NODE='2(x2)'" in refusal(ALL_FLAGS[2:])  # node id filled


def _without_counts(node: int = 1, **extra: str) -> dict[str, str]:
    return {k: v for k, v in step_env(node=node, **extra).items()
            if k not in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                         "SLURM_STEP_NODELIST")}


def test_node_id_past_the_node_list_is_refused_without_a_node_count():
    env = _without_counts(SLURM_NODEID="7", SLURM_JOB_NODELIST="node[01-03]",
                          SLURM_NODELIST="node[01-03]")
    with pytest.raises(ConfigError, match=r"SLURM_NODEID='7': the step has 3 nodes \(ids 0..2\)"):
        slurm_defaults(env, {})
    out = slurm_defaults(_without_counts(node=2), {})
    assert out["node_rank"] == 2 and out["nnodes"] == "3" and out["hspmd_node_id"] == "node03"


@pytest.mark.parametrize("extra, why", [
    ({"SLURMD_NODENAME": "node09"}, "not a host of the step's node list (node01, node02, "
                                    "node03)"),
    ({"SLURMD_NODENAME": "node03", "SLURM_NODEID": "1"},
     "SLURM_NODEID=1 names node02 in the step's node list"),
])
def test_a_node_name_the_node_list_does_not_back_is_refused(monkeypatch, extra, why):
    set_env(monkeypatch, step_env(**extra))
    line = refusal([])
    assert f"SLURMD_NODENAME={extra['SLURMD_NODENAME']!r}" in line and why in line, line
    _, cfg = parse(["--hspmd-node-id", "mine"])  # a given node id: SLURMD_NODENAME unread
    assert cfg.node_id == "mine"
