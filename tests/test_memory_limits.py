"""Memory limits per worker (``launcher.cgroup_memory``, ``--hspmd-enforce-memory``), on this
machine's real memory cgroups with real processes: the limit is the declared device memory plus
the measured baseline, written to the v1 files (the v2 ones on a directory laid out like a v2
cgroup); a process over it is ended by the kernel's OOM killer and counted; close and the stale
sweep remove every cgroup; and a real ``hspmd-launch`` job whose plan does not fit the enforced
memory ends non-zero with the plan's one-line error, no orphan and no cgroup left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from _elastic_job import write_tiny
from launch_harness import SCRIPTS, Launcher, base_env, run_launch
from launcher.api import LaunchError
from launcher.cgroup_memory import (
    MIB,
    PAGE,
    MemoryLimits,
    _set_limit,
    detect_memory,
    measure_baseline,
    memory_limit,
    memory_owners,
    mib,
    parse_oom_kills,
    sweep_stale_memory,
)
from launcher.cgroups import CgroupUnavailable, mount_points, owners_root
from launcher.node.elastic.judge import JobView, judge
from launcher.node.elastic.memory import WorkerMemory
from launcher.node.workers import CGROUP_PROCS_ENV, die_with_parent

pytestmark = pytest.mark.timeout(180)

WAITER = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # exits when stdin closes
HOG = [sys.executable, "-c", "import sys\nsys.stdin.readline()\nx = []\n"
       "for _ in range(64): x.append(bytearray(16 << 20))"]  # up to 1 GiB, touched


@pytest.fixture
def hierarchy():
    """This machine's memory cgroup hierarchy: a machine without one FAILS here, with why."""
    try:
        return detect_memory()
    except CgroupUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture
def limits(hierarchy):
    job = f"mt-{uuid.uuid4().hex[:8]}"
    with MemoryLimits(job, hierarchy) as made:
        yield made
    assert not os.path.exists(made.parent)
    assert not os.path.exists(os.path.join(memory_owners(), "hspmd-" + job))


def _where(pid: int) -> str:
    """The memory cgroup ``pid`` is in (its /proc/<pid>/cgroup line)."""
    with open(f"/proc/{pid}/cgroup") as fh:
        lines = fh.read().splitlines()
    return next((ln for ln in lines if ":memory:" in ln), "")


def _procs(path: str) -> list[int]:
    with open(os.path.join(path, "cgroup.procs")) as fh:
        return [int(x) for x in fh.read().split()]


# ------------------------------------------------------------------------------- pure parts
def test_the_limit_is_the_declared_memory_plus_the_baseline_rounded_to_a_page():
    lim = memory_limit(256 * MIB, 277 * MIB)
    assert lim.limit == 533 * MIB and lim.limit % PAGE == 0
    assert lim.describe() == "533 MiB (declared 256 MiB + 277 MiB baseline)"
    odd = memory_limit(1000, 1)
    assert odd.limit == PAGE and memory_limit(PAGE, 0).limit == PAGE
    assert memory_limit(256 << 10, 0).describe() == "0.25 MiB (declared 0.25 MiB + 0 MiB baseline)"
    for declared, baseline, needle in ((0, 1, "declared device memory 0 "),
                                       (-5, 1, "declared device memory -5 "),
                                       (1.5, 1, "declared device memory 1.5 "),
                                       (True, 1, "declared device memory True "),
                                       (10, -1, "memory baseline -1 "),
                                       (10, "1", "memory baseline '1' ")):
        with pytest.raises(ValueError) as info:
            memory_limit(declared, baseline)
        assert needle in str(info.value) and "\n" not in str(info.value)
    assert mib(3 * MIB // 2) == "1.5 MiB"


def test_oom_kills_are_read_from_v1_and_v2_texts():
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n"
    assert parse_oom_kills(v1) == 3 and parse_oom_kills(v2) == 2
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0  # an old kernel: none


def test_memory_is_found_where_it_is_mounted_apart_from_cpu(tmp_path):
    mounts = ("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
              "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
              "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    assert mount_points(mounts) == ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified")
    assert mount_points(mounts, "memory") == ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu io\n")
    (v2 / "cgroup.subtree_control").write_text("cpu\n")
    with pytest.raises(CgroupUnavailable) as info:
        detect_memory(f"cgroup2 {v2} cgroup2 rw 0 0\n")
    assert str(info.value) == ("no writable memory cgroup on this machine: no cgroup v1 memory "
                               f"controller mounted; cgroup v2 at {v2} does not offer the memory "
                               "controller")
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "cgroup.procs").write_text("")
    with pytest.raises(CgroupUnavailable, match="does not enable for its children the memory"):
        detect_memory(f"cgroup2 {v2} cgroup2 rw 0 0\n")
    (v2 / "cgroup.subtree_control").write_text("cpu memory\n")
    found = detect_memory(f"cgroup2 {v2} cgroup2 rw 0 0\n")
    assert (found.version, found.root, found.controller) == (2, str(v2), "memory")


def test_v2_limit_files_are_written_and_lifted(tmp_path):
    """The v2 files (memory.max, memory.swap.max) on a directory laid out like a v2 cgroup:
    one value written to each, as the kernel takes them (files emptied between the writes: a
    plain file is not replaced by a write as a cgroup file is)."""
    def empty():
        for name in ("memory.max", "memory.swap.max"):
            (tmp_path / name).write_text("")

    empty()
    _set_limit(2, str(tmp_path), 64 * MIB)
    assert (tmp_path / "memory.max").read_text() == str(64 * MIB)
    assert (tmp_path / "memory.swap.max").read_text() == "0"
    empty()
    _set_limit(2, str(tmp_path), None)
    assert (tmp_path / "memory.max").read_text() == "max"
    assert (tmp_path / "memory.swap.max").read_text() == "max"


def test_an_oom_kill_ends_the_job_before_its_consequences():
    """The plan's error wins over what the kill causes (no usable device, a failed switch)."""
    error = "plan v2 does not fit the enforced memory: worker n-0 was killed by the OOM killer"
    view = JobView(memory_error=error, nodes=1, usable_devices=0, switch_failed="no owner",
                   script_error="the script's error")
    assert judge(view) == ("failed", error)
    assert judge(JobView(nodes=1, usable_devices=0)) == ("failed",
                                                         "no usable device left in the job")
    assert judge(JobView(memory_error=error, finished_worker="n:0 done"))[0] == "succeeded"


# ------------------------------------------------------------------------ real cgroups
def test_a_placed_process_gets_the_limit_and_goes_home_at_close(limits, hierarchy):
    proc = subprocess.Popen(WAITER, stdin=subprocess.PIPE)
    home = _where(proc.pid)
    try:
        lim = memory_limit(32 * MIB, 48 * MIB)
        path = limits.place("node0-1", proc.pid, lim)
        assert path == os.path.join(hierarchy.root, f"hspmd-{limits.job}", "node0-1")
        assert limits.pids("node0-1") == [proc.pid] and limits.limit("node0-1") == 80 * MIB
        if hierarchy.version == 1:
            with open(os.path.join(path, "memory.limit_in_bytes")) as fh:
                assert int(fh.read()) == 80 * MIB
            memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # swap may not go past the limit either
                with open(memsw) as fh:
                    assert int(fh.read()) == 80 * MIB
        record = os.path.join(memory_owners(), f"hspmd-{limits.job}", "node0-1.json")
        assert os.path.exists(record) and memory_owners().startswith(owners_root())
        assert limits.oom_kills("node0-1") == 0
        limits.close()
        assert not os.path.exists(path) and not os.path.exists(record)
        assert _where(proc.pid) == home and proc.poll() is None  # home, alive
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_spawned_worker_joins_its_prepared_cgroup_before_its_own_code(limits, hierarchy):
    """The agent's exec shim writes the worker's pid to the prepared cgroup.procs before it
    execs the worker: the worker's first line already runs (and allocates) in the cgroup."""
    procs = limits.prepare("node0-2", memory_limit(64 * MIB, 64 * MIB))
    assert procs == os.path.join(limits.path("node0-2"), "cgroup.procs")
    assert limits.pids("node0-2") == [] and limits.limit("node0-2") == 128 * MIB
    code = ("import os\nprint(open('/proc/self/cgroup').read())\n"
            f"print('env', os.environ.get({CGROUP_PROCS_ENV!r}))")
    out = subprocess.run(die_with_parent((sys.executable, "-c", code)), capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, **{CGROUP_PROCS_ENV: procs}))
    assert out.returncode == 0, out.stderr
    assert f":memory:/hspmd-{limits.job}/node0-2\n" in out.stdout, out.stdout
    assert "env None" in out.stdout  # the worker itself does not see it


def test_a_process_over_the_limit_is_killed_by_the_oom_killer(limits, hierarchy):
    memory = WorkerMemory(limits.job, "node0", 32 * MIB, baseline=32 * MIB, limits=limits)
    hog = subprocess.Popen(HOG, stdin=subprocess.PIPE)
    try:
        memory.place(1, hog.pid)
        hog.stdin.write(b"go\n")
        hog.stdin.flush()
        code = hog.wait(timeout=60)
    finally:
        hog.kill()
        hog.wait(timeout=10)
    assert code == -signal.SIGKILL, code  # not the end of its loop (exit 0)
    assert limits.oom_kills("node0-1") == 1 and memory.killed(1, code)
    assert not memory.killed(1, 1) and not memory.killed(0, code)  # a plain failure; another slot
    assert memory.describe(3, 1) == ("plan v3 does not fit the enforced memory: worker node0-1 "
                                     "was killed by the OOM killer at 64 MiB (declared 32 MiB + "
                                     "32 MiB baseline)")


def test_a_dead_owners_memory_cgroup_is_restored_and_removed(hierarchy, tmp_path):
    """The owner (a process that placed a worker, then was SIGKILLed) leaves its cgroup; the
    sweep lifts the limit, moves the worker home and removes the cgroup and its record."""
    job = f"ms-{uuid.uuid4().hex[:8]}"
    waiter = subprocess.Popen(WAITER, stdin=subprocess.PIPE)
    home = _where(waiter.pid)
    owner_code = (f"import sys, time\nsys.path[:0] = {sys.path!r}\n"
                  "from launcher.cgroup_memory import MemoryLimits, memory_limit\n"
                  f"m = MemoryLimits({job!r})\nm.place('node0-0', {waiter.pid}, "
                  f"memory_limit({64 * MIB}, {64 * MIB}))\nprint('placed', flush=True)\n"
                  "sys.stdin.read()\n")
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    path = os.path.join(hierarchy.root, f"hspmd-{job}")
    try:
        assert owner.stdout.readline().strip() == "placed"
        assert _procs(os.path.join(path, "node0-0")) == [waiter.pid]
        assert sweep_stale_memory(job) == []  # a live owner's cgroup is left alone
        owner.kill()
        owner.wait(timeout=10)
        removed = sweep_stale_memory(job)
        assert removed == [os.path.join(path, "node0-0"), path]
        assert _where(waiter.pid) == home and waiter.poll() is None
        assert not os.path.exists(os.path.join(memory_owners(), f"hspmd-{job}"))
    finally:
        for p in (owner, waiter):
            p.kill()
            p.wait(timeout=10)
        sweep_stale_memory(job)


def test_the_baseline_is_measured_and_a_missing_memory_controller_refused():
    baseline = measure_baseline()
    assert 50 * MIB < baseline < 4096 * MIB  # interpreter, torch, gloo: not nothing, not all
    assert measure_baseline() == baseline  # once per agent
    with pytest.raises(LaunchError) as info:
        WorkerMemory("mt-bad", "node0", 0, baseline=baseline)
    assert str(info.value).startswith("--hspmd-enforce-memory: declared device memory 0 ")


# --------------------------------------------------------------------------- end to end
def _args(etcd, job: str, model: Path, *flags: str) -> list[str]:
    return ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", "node0",
            "--hspmd-lease-ttl", "2", "--shutdown-timeout", "5", "--rdzv-conf",
            "join_timeout=60", "--hspmd-elastic", "--hspmd-model", str(model),
            "--hspmd-global-batch", "4", *flags]


def test_the_flag_needs_a_declared_memory(etcd_server, marker, tmp_path):
    model = write_tiny(tmp_path / "model.json")
    code, _, err = run_launch(_args(etcd_server, "mf-x", model, "--hspmd-enforce-memory",
                                    str(SCRIPTS / "sleeper.py")),
                              base_env(marker), tmp_path, timeout=60)
    assert code != 0
    assert "--hspmd-enforce-memory needs --hspmd-device-memory" in err, err[-2000:]


def test_a_plan_that_does_not_fit_the_enforced_memory_ends_the_job(etcd_server, marker,
                                                                   tmp_path, hierarchy):
    job = f"mem-{uuid.uuid4().hex[:8]}"
    model = write_tiny(tmp_path / "model.json")
    agent = Launcher(_args(etcd_server, job, model, "--hspmd-device-memory", "1MiB",
                           "--hspmd-enforce-memory", str(SCRIPTS / "memory_hog.py"),
                           "--total-mib", "2048"),
                     base_env(marker), tmp_path, "node0")
    code = agent.wait(150)
    err = agent.stderr()
    assert code == 1, err[-4000:]
    line = ("plan v1 does not fit the enforced memory: worker node0-0 was killed by the OOM "
            "killer at ")
    assert line in err and "(declared 1 MiB + " in err, err[-4000:]
    assert "memory_hog holds" not in agent.stdout()  # killed before it held it all
    summary = err[err.index("FAILED\n"):]
    assert line in summary and "exitcode  : -9" in summary, summary
    assert not os.path.exists(os.path.join(hierarchy.root, f"hspmd-{job}"))
    assert not os.path.exists(os.path.join(memory_owners(), f"hspmd-{job}"))
