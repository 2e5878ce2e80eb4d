"""What the fault-injection tests against a real job share: the observer and the inject context
on the job, closed (and the job's agents killed if still running) when the test is done."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from hspmd_elastic.coord.client import EtcdClient
from launcher.inject.detect import FileProgress, JobObserver
from launcher.inject.faults import InjectContext


@contextmanager
def injecting(etcd_server, job: str, progress_dir: Path, log_dir: Path, env: dict,
              agents: Iterable) -> Iterator[tuple[EtcdClient, JobObserver, InjectContext]]:
    """A client on ``etcd_server``, a ``JobObserver`` of ``job`` reading the workers' progress
    files (``progress_dir/*.jsonl``) and an ``InjectContext`` logging to ``log_dir``. On exit
    they stop, and every agent (a ``launch_harness.Launcher``) still running is killed."""
    client = EtcdClient(etcd_server.endpoints, timeout=5.0)
    observer = JobObserver(client, job, FileProgress(str(progress_dir / "*.jsonl"))).start()
    ctx = InjectContext(client, job, etcd_members=etcd_server.members, log_dir=str(log_dir),
                        env=env)
    try:
        yield client, observer, ctx
    finally:
        observer.stop()
        ctx.close()
        for agent in agents:
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait(10)
        client.close()
