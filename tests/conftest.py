"""Shared fixtures: real etcd servers on free loopback ports, one per test (cheap: ~0.1 s), a
client on them, the elastic-test harness, and the leftover-process check of launched jobs.

``tests/scripts`` goes on ``sys.path`` here, before any test module is imported: the test
modules import its helpers (``launch_harness``, ...) directly."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

# Multi-process tests on a 2-core machine: one intra-op thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Elastic workers of the suite compute on CPUs, also on a machine with GPUs (gpu-marked tests
# choose their device themselves).
os.environ.setdefault("HSPMD_DEVICE", "cpu")

from hspmd_elastic.coord import EtcdClient  # noqa: E402
from launcher.standalone import EtcdCluster  # noqa: E402

# Helpers shared by the tests that launch real jobs (tests/scripts/launch_harness.py).
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from launch_harness import assert_no_leftovers, new_marker  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs CUDA; skipped, with the reason, where torch cannot use it")


@pytest.fixture
def etcd_server(tmp_path):
    """A single real etcd member; yields the EtcdCluster (``.endpoints``, ``.members[0]``)."""
    with EtcdCluster(size=1, base_dir=str(tmp_path / "etcd")) as cluster:
        yield cluster


@pytest.fixture
def etcd_cluster3(tmp_path):
    """A real 3-member etcd cluster on loopback."""
    with EtcdCluster(size=3, base_dir=str(tmp_path / "etcd3")) as cluster:
        yield cluster


@pytest.fixture
def client_timeout() -> float:
    """The per-call deadline (seconds) of the ``client`` fixture. Short, so that a hang fails
    fast; a test module whose calls may take longer overrides this fixture."""
    return 1.0


@pytest.fixture
def client(etcd_server, client_timeout):
    """An ``EtcdClient`` on ``etcd_server``, closed after the test."""
    with EtcdClient(etcd_server.endpoints, timeout=client_timeout) as c:
        yield c


@pytest.fixture
def elastic_job(etcd_server, tmp_path):
    """``elastic_job(payload)``: an ``_elastic.ElasticJob`` on ``etcd_server`` (this process is
    its leader and store host); every job made is closed after the test."""
    from _elastic import ElasticJob

    jobs = []

    def make(payload: dict) -> ElasticJob:
        jobs.append(ElasticJob(etcd_server.endpoint_str, str(tmp_path), payload))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


@pytest.fixture
def netns(tmp_path):
    """``netns(nodes=(...), etcd_members=3)``: a multi-host topology on network namespaces
    (``tests/_netns.py``), torn down after the test even when it fails."""
    from _netns import topologies

    with topologies(tmp_path) as make:
        yield make


def _drop_dead_handlers(logger: logging.Logger) -> None:
    for h in logger.handlers[:]:
        stream = getattr(h, "stream", None)
        if stream is not None and getattr(stream, "closed", False):
            logger.removeHandler(h)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """Commands run in-process (click's main) may install a stderr handler on the root logger,
    or on the ``launcher`` logger (``hspmd-launch``'s own, which does not propagate). That
    handler would hold a test's captured stream after it is closed, so later log lines (other
    tests, background threads) would fail to print: put both loggers back as they were and drop
    any handler whose stream is closed."""
    loggers = [logging.getLogger(), logging.getLogger("launcher")]
    saved = []
    for logger in loggers:
        _drop_dead_handlers(logger)
        saved.append((list(logger.handlers), logger.level, logger.propagate))
    yield
    for logger, (handlers, level, propagate) in zip(loggers, saved):
        for h in logger.handlers[:]:
            if h not in handlers:
                logger.removeHandler(h)
        logger.setLevel(level)
        logger.propagate = propagate
        _drop_dead_handlers(logger)


@pytest.fixture
def marker():
    """A unique tag in the environment of every process a test launches; at the end of the test
    no process carrying it may be left (no orphaned agents, workers or etcd)."""
    m = new_marker()
    yield m
    assert_no_leftovers(m)


def _run_demo(tmp: Path) -> dict:
    """``python scripts/demo_job.py`` (what ``scripts/demo`` runs, its default arguments) with
    ``TMPDIR`` an empty folder of ``tmp``: its exit code, stdout, stderr and seconds, and the
    ``hspmd*`` names and bytes it left in that folder after it exited."""
    import subprocess
    import time

    from launch_harness import REPO, base_env

    tmpdir = tmp / "tmp"
    tmpdir.mkdir()
    env = base_env(new_marker(), TMPDIR=str(tmpdir), PYTHONPATH=str(REPO))
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "scripts/demo_job.py"], cwd=str(REPO), env=env,
                             capture_output=True, text=True, timeout=240)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = None, *(x.decode(errors="replace") if isinstance(x, bytes)
                                       else x or "" for x in (exc.stdout, exc.stderr))
    seconds = time.monotonic() - start
    left = sorted(n for n in os.listdir(tmpdir) if n.startswith("hspmd"))  # demo, logs, ...
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _s, names in os.walk(tmpdir)
               for n in names if not os.path.islink(os.path.join(d, n)))
    return {"code": code, "stdout": stdout, "stderr": stderr, "seconds": seconds,
            "left": left, "left_bytes": size}


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> dict:
    """The demo run once per session (``_run_demo``; ``_hf_worlds.once_per_session`` shares it
    between pytest-xdist workers): tests/test_readme_commands.py checks its result,
    tests/test_demo_cleanup.py what it left in its temporary directory."""
    from _hf_worlds import once_per_session

    return once_per_session(tmp_path_factory, "demo-run", _run_demo)
