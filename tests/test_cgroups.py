"""CPU cgroups per worker, on this machine's real cgroups with real processes: a busy loop
capped at a tenth of a core is throttled and gets well under a core; the cap is lifted; close
(or the finalizer, or the interpreter's exit) moves every process back and removes every
cgroup; bad fractions are one-line errors. The pure parts (mounts, cpu.stat, detection of a
v2 hierarchy) on recorded texts and directories."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import given, strategies as st

from _wait import wait_for
from launcher import cgroups
from launcher.cgroups import (
    CgroupUnavailable,
    CpuQuota,
    CpuStat,
    Hierarchy,
    ProcessGone,
    available,
    cgroup_of,
    check_fraction,
    detect,
    mount_points,
    parse_cpu_stat,
    parse_quota,
    quota_us,
    worker_cgroup,
)
from launcher.cgroup_sweep import release, sweep_stale

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
BUSY = [sys.executable, "-c", "while True: pass"]
WAITER = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # exits when stdin closes


@pytest.fixture
def hierarchy() -> Hierarchy:
    """This machine's CPU cgroup hierarchy: a machine without one FAILS here, with the reason."""
    found, line = available()
    if found is None:
        pytest.fail(line)
    return found


@pytest.fixture
def quota(hierarchy):
    """A ``CpuQuota`` for a job of its own, closed (and checked gone) after the test."""
    q = CpuQuota(f"test-{uuid.uuid4().hex[:10]}", hierarchy)
    try:
        yield q
    finally:
        q.close()
        assert not os.path.exists(q.parent)


@pytest.fixture
def spawn():
    """``spawn(argv)``: a real child process (one compute thread), killed after the test."""
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), **kw)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdin:
            proc.stdin.close()
        if proc.stdout:
            proc.stdout.close()


def home_of(pid: int, hierarchy: Hierarchy) -> str:
    return cgroup_of(Path(f"/proc/{pid}/cgroup").read_text(), hierarchy.version)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def read(path: str, name: str) -> str:
    return Path(path, name).read_text().strip()


# --------------------------------------------------------------------------------- real cgroups
def test_a_shorter_cfs_period_keeps_the_share_and_bounds_the_fraction_by_it(spawn, hierarchy):
    """``CpuQuota(period_us=...)``: the quota is the share of that period; the kernel's 1 ms
    minimum then refuses smaller shares, in one line; a period out of range is refused."""
    q = CpuQuota(f"test-{uuid.uuid4().hex[:10]}", hierarchy, period_us=20_000)
    try:
        sleeper = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
        path = q.place("node-a-0", sleeper.pid, 0.125)
        if hierarchy.version == 1:
            assert (read(path, "cpu.cfs_quota_us"), read(path, "cpu.cfs_period_us")) == \
                ("2500", "20000")
        else:
            assert read(path, "cpu.max") == "2500 20000"
        assert q.quota("node-a-0") == pytest.approx(0.125, rel=1e-12)
        with pytest.raises(ValueError, match="per 20000 us period"):
            q.set("node-a-0", 0.04)
        with pytest.raises(ValueError, match="period_us=500"):
            CpuQuota("test-x", hierarchy, period_us=500)
    finally:
        q.close()
    assert not os.path.exists(q.parent)


def test_a_busy_loop_capped_at_a_tenth_of_a_core_is_throttled(quota, spawn, hierarchy):
    busy = spawn(BUSY)
    home = home_of(busy.pid, hierarchy)
    path = quota.place("node-a-0", busy.pid, 0.1)
    assert path == os.path.join(hierarchy.root, f"hspmd-{quota.job}", "node-a-0")
    assert quota.pids("node-a-0") == [busy.pid]
    assert quota.quota("node-a-0") == pytest.approx(0.1)
    if hierarchy.version == 1:
        assert (read(path, "cpu.cfs_quota_us"), read(path, "cpu.cfs_period_us")) == \
            ("10000", "100000")
    else:
        assert read(path, "cpu.max") == "10000 100000"
    # the cap bites: throttled in some period, and a window of periods gets well under a core
    first = wait_for(lambda: (s := quota.stat("node-a-0")).nr_throttled > 0 and s, 30,
                     "the capped busy loop throttled in some CFS period")
    cpu0, wall0 = cpu_seconds(busy.pid), time.monotonic()
    wait_for(lambda: quota.stat("node-a-0").nr_periods >= first.nr_periods + 10, 30,
             "ten more CFS periods of the capped busy loop")
    used, wall = cpu_seconds(busy.pid) - cpu0, time.monotonic() - wall0
    assert used < 0.5 * wall, f"{used:.2f}s of CPU in {wall:.2f}s under a 0.1 cap"
    assert quota.stat("node-a-0").throttled_s > 0

    quota.set("node-a-0", 0.5)
    assert quota.quota("node-a-0") == pytest.approx(0.5)
    quota.set("node-a-0", None)  # lifted
    assert quota.quota("node-a-0") is None
    assert read(path, "cpu.cfs_quota_us" if hierarchy.version == 1 else "cpu.max") == \
        ("-1" if hierarchy.version == 1 else "max 100000")
    assert busy.poll() is None  # a cap never stops a process

    quota.close()
    quota.close()  # idempotent
    assert not os.path.exists(quota.parent)
    assert home_of(busy.pid, hierarchy) == home  # back where it came from


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, -math.inf, 1e9, 0.001, True, "0.5",
                                 None])
def test_bad_fractions_are_one_line_errors_and_touch_nothing(quota, spawn, bad):
    proc = spawn(WAITER, stdin=subprocess.PIPE)
    with pytest.raises(ValueError) as err:
        quota.place("node-a-0", proc.pid, bad)
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)
    assert not os.path.exists(quota.parent)
    quota.place("node-a-0", proc.pid, 0.5)
    with pytest.raises(ValueError, match=r"cpu fraction .* is not valid|too small"):
        quota.set("node-a-0", bad if bad is not None else math.nan)
    assert quota.quota("node-a-0") == pytest.approx(0.5)  # unchanged


def test_more_cores_than_the_machine_has_is_refused(quota, spawn):
    proc = spawn(WAITER, stdin=subprocess.PIPE)
    with pytest.raises(ValueError, match=rf"use a number in \(0, {quota.cores}\]"):
        quota.place("node-a-0", proc.pid, quota.cores + 0.5)
    quota.place("node-a-0", proc.pid, quota.cores)  # all of them is fine


def test_processes_that_exited_or_were_forked_there_are_handled(quota, spawn, hierarchy):
    gone = spawn(WAITER, stdin=subprocess.PIPE)
    quota.place("node-a-0", gone.pid, 0.5)
    gone.stdin.close()  # it exits, in its cgroup, before close()
    gone.wait(10)
    with pytest.raises(ProcessGone, match=rf"process {gone.pid} is gone"):
        quota.place("node-a-1", gone.pid, 0.5)
    # a worker that forks after it was capped: its child is capped with it, and close()
    # moves both back where the worker came from
    parent = spawn([sys.executable, "-c",
                    "import subprocess, sys; sys.stdin.readline(); "
                    "c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
                    " stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.read()"],
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    home = home_of(parent.pid, hierarchy)
    quota.place("node-b-0", parent.pid, 0.5)
    parent.stdin.write("fork\n")
    parent.stdin.flush()
    child = int(parent.stdout.readline())
    assert sorted(quota.pids("node-b-0")) == sorted([parent.pid, child])
    quota.close()
    assert not os.path.exists(quota.parent)
    assert home_of(parent.pid, hierarchy) == home_of(child, hierarchy) == home


def test_the_finalizer_cleans_up_what_was_not_closed(hierarchy, spawn):
    proc = spawn(WAITER, stdin=subprocess.PIPE)
    home = home_of(proc.pid, hierarchy)
    q = CpuQuota(f"test-{uuid.uuid4().hex[:10]}", hierarchy)
    parent = q.parent
    q.place("node-a-0", proc.pid, 0.25)
    assert os.path.isdir(parent)
    del q
    gc.collect()
    assert not os.path.exists(parent)
    assert home_of(proc.pid, hierarchy) == home


def test_an_interpreter_that_exits_without_closing_cleans_up(hierarchy, spawn):
    proc = spawn(WAITER, stdin=subprocess.PIPE)
    home = home_of(proc.pid, hierarchy)
    job = f"test-{uuid.uuid4().hex[:10]}"
    code = ("import sys; from launcher.cgroups import CpuQuota\n"
            f"q = CpuQuota({job!r}); q.place('node-a-0', {proc.pid}, 0.25)\n"
            "print(q.pids('node-a-0'), flush=True)\n")  # exits with q still open
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(REPO))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"[{proc.pid}]"
    assert not os.path.exists(os.path.join(hierarchy.root, f"hspmd-{job}"))
    assert home_of(proc.pid, hierarchy) == home


def test_sweep_stale_removes_empty_parents_only(hierarchy, spawn):
    stale = f"test-{uuid.uuid4().hex[:10]}"
    os.makedirs(os.path.join(hierarchy.root, f"hspmd-{stale}", "node-a-0"))  # a dead run's
    live = CpuQuota(f"test-{uuid.uuid4().hex[:10]}", hierarchy)
    try:
        live.place("node-a-0", spawn(WAITER, stdin=subprocess.PIPE).pid, 0.5)
        removed = sweep_stale(hierarchy=hierarchy)
        assert os.path.join(hierarchy.root, f"hspmd-{stale}") in removed
        assert live.parent not in removed and os.path.isdir(live.parent)
        assert sweep_stale(stale, hierarchy) == []  # nothing left of it
    finally:
        live.close()
    assert not os.path.exists(live.parent)


def test_a_sigkilled_owners_cgroup_is_restored_by_the_sweep(hierarchy, spawn, tmp_path):
    """The owner is on record before the cgroup exists; once it is SIGKILLed (no finalizer
    runs), ``sweep_stale`` lifts the cap, moves the process home and removes everything; a live
    owner's cgroup is left alone."""
    proc = spawn(WAITER, stdin=subprocess.PIPE)
    home = home_of(proc.pid, hierarchy)
    job, owners = f"test-{uuid.uuid4().hex[:10]}", str(tmp_path / "owners")
    code = ("import sys; from launcher.cgroups import CpuQuota\n"
            f"q = CpuQuota({job!r}, owners={owners!r}); q.place('node-a-0', {proc.pid}, 0.25)\n"
            "print('placed', flush=True); sys.stdin.read()\n")
    owner = spawn([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                  cwd=str(REPO))
    assert owner.stdout.readline().strip() == b"placed"
    parent = os.path.join(hierarchy.root, f"hspmd-{job}")
    record = json.loads(Path(owners, f"hspmd-{job}", "node-a-0.json").read_text())
    assert (record["owner_pid"], record["home"]) == (owner.pid, os.path.normpath(
        os.path.join(hierarchy.root, home.lstrip("/"))))
    assert sweep_stale(job, hierarchy, owners) == []  # its owner lives: left alone
    owner.kill()
    owner.wait(10)
    assert home_of(proc.pid, hierarchy) == f"/hspmd-{job}/node-a-0"  # SIGKILL: left behind
    removed = sweep_stale(job, hierarchy, owners)
    assert removed == [os.path.join(parent, "node-a-0"), parent]
    assert home_of(proc.pid, hierarchy) == home and not os.path.exists(parent)
    assert not os.path.exists(os.path.join(owners, f"hspmd-{job}"))
    assert release(job) == []  # nothing left; never raises


# ---------------------------------------------------------------------------------- pure parts
MOUNTS_V1 = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_mount_points_find_the_cpu_controller():
    assert mount_points(MOUNTS_V1) == ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified")
    joint = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"
    assert mount_points(joint) == ("/sys/fs/cgroup/cpu,cpuacct", None)
    assert mount_points("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n") == \
        (None, "/sys/fs/cgroup")
    assert mount_points("proc /proc proc rw 0 0\n") == (None, None)


def _v2(root: Path, controllers: str, enabled: str) -> str:
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(enabled + "\n")
    return f"cgroup2 {root} cgroup2 rw 0 0\n"


def test_detect_a_v2_hierarchy_or_say_why_none(tmp_path):
    mounts = _v2(tmp_path / "ok", "cpuset cpu io memory", "cpu memory")
    assert detect(mounts) == Hierarchy(2, str(tmp_path / "ok"))
    mounts = _v2(tmp_path / "off", "cpu memory", "memory")
    with pytest.raises(CgroupUnavailable) as err:
        detect(mounts)
    assert str(err.value) == (
        "no usable CPU cgroup on this machine: no cgroup v1 cpu controller mounted; cgroup v2 "
        f"at {tmp_path / 'off'} does not enable cpu for its children (cgroup.subtree_control: "
        "memory)")
    mounts = _v2(tmp_path / "none", "memory pids", "")
    found, line = available(mounts)
    assert found is None and "does not offer the cpu controller (cgroup.controllers: memory " \
                             "pids)" in line and "\n" not in line
    found, line = available("proc /proc proc rw 0 0\n")
    assert found is None and line.endswith("no cgroup v2 mounted")
    v1 = tmp_path / "v1"
    v1.mkdir()
    found, line = available(f"cgroup {v1} cgroup rw,cpu 0 0\n")
    assert found is None and f"cgroup v1 cpu at {v1} has no cpu.cfs_quota_us; " in line
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
        (v1 / name).write_text("")
    assert available(f"cgroup {v1} cgroup rw,cpu 0 0\n") == \
        (Hierarchy(1, str(v1)), f"cgroup v1 cpu controller at {v1}")


def test_cpu_stat_quota_and_proc_cgroup_texts():
    v1 = "nr_periods 48\nnr_throttled 47\nthrottled_time 4200000000\nnr_bursts 0\n"
    assert parse_cpu_stat(v1) == CpuStat(48, 47, 4.2)
    v2 = "usage_usec 100\nuser_usec 90\nsystem_usec 10\nnr_periods 5\nnr_throttled 2\n" \
         "throttled_usec 1500000\n"
    assert parse_cpu_stat(v2) == CpuStat(5, 2, 1.5)
    assert parse_quota("-1 100000", 1) == (None, 100000)
    assert parse_quota("25000 100000", 1) == (25000, 100000)
    assert parse_quota("max 100000\n", 2) == (None, 100000)
    assert parse_quota("12500 100000", 2) == (12500, 100000)
    text = "9:name=systemd:/\n4:cpu,cpuacct:/user.slice\n1:memory:/x\n0::/init.scope\n"
    assert cgroup_of(text, 1) == "/user.slice" and cgroup_of(text, 2) == "/init.scope"
    assert cgroup_of("1:memory:/x\n", 1) is None
    assert worker_cgroup("node-a", 3) == "node-a-3"
    for node, rank, what in (("bad/node", 0, "node id"), ("a", -1, "local rank"),
                             ("a", True, "local rank")):
        with pytest.raises(ValueError, match=what):
            worker_cgroup(node, rank)


@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(1, 64))
def test_check_fraction_accepts_exactly_the_finite_caps_the_kernel_takes(value, cores):
    ok = math.isfinite(value) and 0 < value <= cores and \
        quota_us(value) >= cgroups.MIN_QUOTA_US
    try:
        got = check_fraction(value, cores)
    except ValueError as exc:
        assert not ok and "\n" not in str(exc) and repr(value) in str(exc)
    else:
        assert ok and got == value
        assert abs(quota_us(got) - got * cgroups.PERIOD_US) <= 0.5
