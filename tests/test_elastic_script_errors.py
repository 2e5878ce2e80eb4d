"""Elastic mode tells the script's own errors from device faults, and a model that can never fit
from a cluster that may still grow.

End to end (real etcd, ``hspmd-launch --hspmd-elastic`` agents as nodes of this host, workers
over gloo): an error every worker runs into (a global batch other than the leader's, a model
other than the one planned for) kills the workers of both nodes; the job fails once, exit 1 on
every agent, with the first worker's error as the root cause in every agent's torchrun-style
summary (exception, rank, host, error file) and in the job's end reason, not "no usable device
left". A model larger than the memory of a one-node job's whole node fails at once, naming the
shortfall, instead of waiting out ``join_timeout``. The two mismatches' jobs run at once on one
etcd, in one module-scoped fixture; each test reads one of them.

The pure parts (``error_signature``, ``ScriptErrors``, ``largest_cluster``, the judge's order)
are checked exhaustively on values below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest

from _elastic_job import TINY, ElasticLaunchJob
from launch_harness import assert_no_leftovers, new_marker

from hspmd_elastic.contract import schema
from hspmd_elastic.contract.rounds import RoundState
from launcher.standalone import EtcdCluster

ROOT = "Root Cause (first observed failure):"
MISMATCHES = ["global-batch", "model"]


@pytest.fixture
def job(etcd_server, tmp_path, marker):
    with ElasticLaunchJob(etcd_server, tmp_path, marker, prefix="se") as j:
        yield j


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hspmd-launch: error:")]
    assert lines, stderr[-4000:]
    return lines[-1]


def _job_end(job: ElasticLaunchJob) -> RoundState:
    key = schema.rdzv_state_key(job.name)
    kv = job.client.get(key)
    return RoundState.decode(key, kv.value, kv.mod_revision)


def _mismatched(job: ElasticLaunchJob, mismatch: str) -> tuple[tuple[str, ...], str]:
    """The training arguments that differ from what the leader plans for, and the error every
    worker must fail with."""
    if mismatch == "global-batch":
        return ("--global-batch", "8"), "ConfigurationError: plan global_batch=4"
    other = job.tmp / "other.json"
    other.write_text(dataclasses.replace(TINY, num_layers=3).to_json())
    return ("--config", str(other)), "has num_layers=2, model has 3"


@pytest.fixture(scope="module")
def mismatched_jobs(tmp_path_factory):
    """Both mismatches' jobs, run at once on one etcd (each its own job name, two nodes of one
    worker each), waited for until every agent exited: mismatch -> (the job, its agents of
    node-a and node-b, the error expected). No process of theirs is left at the end."""
    tmp = tmp_path_factory.mktemp("script_errors")
    marker = new_marker()
    with EtcdCluster(size=1, base_dir=str(tmp / "etcd")) as etcd, \
            contextlib.ExitStack() as stack:
        jobs = {}
        for mismatch in MISMATCHES:
            (tmp / mismatch).mkdir()
            job = stack.enter_context(ElasticLaunchJob(etcd, tmp / mismatch, marker,
                                                       prefix="se"))
            train, error = _mismatched(job, mismatch)
            jobs[mismatch] = (job, job.start("node-a", 1, train=train),
                              job.start("node-b", 1, train=train), error)
        deadline = time.monotonic() + 90  # one for all: the tests check every exit code
        for job, *agents, _error in jobs.values():
            for agent in agents:
                with contextlib.suppress(AssertionError):  # killed; its test shows why
                    agent.wait(max(1.0, deadline - time.monotonic()))
        yield jobs
    assert_no_leftovers(marker)


@pytest.mark.multiproc
@pytest.mark.timeout(150)  # it may start both jobs (``mismatched_jobs``)
@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_one_error_on_two_nodes_fails_the_job_once_with_the_root_cause(mismatched_jobs,
                                                                        mismatch):
    """Each node's one worker raises the same error at the first plan; both agents exit 1, both
    print a summary whose root cause is the job's first failure (one of them is the other
    node's), and the end reason names the error and where it struck first."""
    job, a, b, error = mismatched_jobs[mismatch]
    job.finish(timeout=60, code=1)  # they exited: the exit codes
    end = _job_end(job)
    assert end.state == "failed" and "the script's error, not a device fault" in end.reason
    assert error in end.reason and "the same error killed 2 worker(s) on 2 devices" in end.reason
    failures = [e for e in job.events() if e.type == "failure"]
    first = schema.event_detail(failures[0]).exits[0]
    assert error in first.message and first.error_file.endswith("error.json")
    assert first.global_rank in (0, 1) and first.host
    assert f"rank {first.global_rank} on {failures[0].node}:0" in end.reason
    roots = []
    for agent in (a, b):
        err = agent.stderr()
        line = _error_line(err)
        assert "job failed: the script's error" in line and error in line, line
        assert "no usable device" not in line
        assert "elastic_train.py FAILED" in err and ROOT in err
        root = err.split(ROOT, 1)[1]
        assert error in root and f"(pid: {first.pid})" in root
        assert f"rank      : {first.global_rank}" in root
        roots.append(root.split("traceback")[0])
    # The other node shows the root cause from the journal: its host and node, its error file.
    other = b if failures[0].node == "node-a" else a
    remote = other.stderr().split(ROOT, 1)[1]
    assert f"(node {failures[0].node})" in remote and first.error_file in remote
    assert not list(job.out.glob("*.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_a_model_larger_than_the_whole_node_fails_at_once_naming_the_shortfall(job):
    """A one-node job (``--nnodes 1``) of two 20 KiB devices for a model that needs about
    235 KiB: the node is the largest cluster the job can have, so the job fails at once (not
    after the 60 s join timeout), saying how much memory is needed and how much there is."""
    started = time.monotonic()
    agent = job.start("node-a", 2, "--hspmd-device-memory", "20KiB", nnodes=1)
    code = agent.wait(30)
    took = time.monotonic() - started
    err = agent.stderr()
    assert code == 1, err[-4000:]
    line = _error_line(err)
    assert "no plan fits the model even on the largest cluster this job can have" in line
    assert "(1 node(s) of --nnodes max 1, 2 device(s))" in line
    assert "needs 234.5 KiB for one replica" in line and "the 2 usable devices offer 36.0 KiB" in line and "short by" in line, line
    assert "waiting for the cluster to change" not in err
    assert took < 30
    assert _job_end(job).reason in line


# ------------------------------------------------------------------------------ pure parts
def _failure(seq: int, node: str, lr: int, pid: int, message: str, version: int = 1):
    detail = schema.FailureDetail(devices=[f"{node}:{lr}"], reason="x", plan_version=version,
                                  exits=[schema.ExitInfo(lr, pid, 1, None, lr, f"/e/{pid}",
                                                         message, "host-" + node)])
    event = schema.EventRecord(seq=seq, type="failure", node=node, detail=detail.to_dict(),
                               timings={}, at=1000.0 + seq)
    return event, detail


def test_error_signature_folds_numbers_and_leaves_out_cluster_symptoms():
    from launcher.node.elastic.exits import error_signature

    assert error_signature("CheckpointError: shard /c/step-00000004/shard-0.pt at 0x7f12") == \
        error_signature("CheckpointError: shard /c/step-00000004/shard-1.pt at 0x9a00")
    assert error_signature("ValueError: x") != error_signature("TypeError: x")
    assert error_signature("pkg.mod.ValueError: bad  value") == ("ValueError", "bad value")
    for symptom in ("PlanWaitTimeout: no plan newer than v3", "CommTimeoutError: step 2",
                    "StoreUnreachable: 127.0.0.1:5", "RegroupAborted: v4", "TimeoutError: x",
                    "ConnectionResetError: peer", "LeaseLostError: gone"):
        assert error_signature(symptom) is None, symptom
    assert error_signature("") is None and error_signature("no type here") is None


def test_script_errors_need_two_exits_of_one_error():
    from launcher.node.elastic.exits import ScriptErrors

    errs = ScriptErrors()
    assert errs.note(*_failure(1, "a", 0, 10, "ValueError: bad rank 0")) is None
    assert errs.note(*_failure(2, "b", 0, 11, "KeyError: other")) is None
    assert errs.note(*_failure(2, "b", 0, 11, "ValueError: bad rank 1")) is None  # journaled twice
    assert errs.note(*_failure(3, "b", 0, 12, "PlanWaitTimeout: v1")) is None
    found = errs.note(*_failure(4, "b", 1, 13, "ValueError: bad rank 1", version=2))
    assert found is not None and found.first.pid == 10 and found.node == "a"
    assert found.devices == ("a:0", "b:1") and found.count == 2 and found.versions == (1, 2)
    text = found.describe()
    assert text.startswith("the script's error, not a device fault: ValueError: bad rank 0 ")
    assert "(first: rank 0 on a:0, host host-a, error file /e/10)" in text
    assert text.endswith("the same error killed 2 worker(s) on 2 devices (a:0, b:1)")
    again = ScriptErrors()  # one device again after a replan (its slot used once more)
    again.note(*_failure(1, "a", 0, 10, "ValueError: v"))
    found = again.note(*_failure(5, "a", 0, 20, "ValueError: v", version=3))
    assert found.describe().endswith("on a:0 again after a replan (plans v1, v3)")


def test_judge_puts_the_script_error_before_its_consequences():
    from launcher.node.elastic.judge import JobView, judge

    view = JobView(nodes=2, usable_devices=0, script_error="the script's error: E: x\nmore",
                   plan_impossible="no plan fits")
    assert judge(view) == ("failed", "the script's error: E: x")
    assert judge(dataclasses.replace(view, switch_failed="lost"))[1] == "switch failed: lost"
    assert judge(JobView(plan_impossible="no plan fits: short by 1 KiB")) == (
        "failed", "no plan fits: short by 1 KiB")
    assert judge(JobView(nodes=1, usable_devices=2))[0] == "running"


def test_largest_cluster_is_max_nodes_with_every_device_usable():
    from launcher.leader import ClusterSnapshot, DeviceView, NodeView, largest_cluster

    def node(name: str, states=("healthy", "healthy"), state="ready", cut=""):
        devs = tuple(DeviceView(f"{name}:{i}", name, i, "CPU", 1024, s)
                     for i, s in enumerate(states))
        return NodeView(name, "h", state, "s:1", devs, cut)

    one = ClusterSnapshot({"a": node("a")})
    assert largest_cluster(one, 1) == "1 node(s) of --nnodes max 1, 2 device(s)"
    assert largest_cluster(one, 2) == "" and largest_cluster(one, None) == ""
    two = ClusterSnapshot({"a": node("a"), "b": node("b"), "c": node("c")})
    assert largest_cluster(two, 2) == "2 node(s) of --nnodes max 2, 4 device(s)"
    assert largest_cluster(ClusterSnapshot({"a": node("a", ("healthy", "failed"))}), 1) == ""
    assert largest_cluster(ClusterSnapshot({"a": node("a", ("healthy", "suspect"))}), 1) == ""
    assert largest_cluster(ClusterSnapshot({"a": node("a", cut="x")}), 1) == ""
