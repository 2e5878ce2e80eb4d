"""Harness for the elastic tests: this process is the node agent (it hosts the plan's TCPStore)
and the leader (it campaigns with ``Election`` and publishes plans); workers are real processes
running ``hspmd_elastic.runtime.run`` over gloo, each in its own session.

``ElasticJob`` spawns workers (``spawn(device)``), publishes plans (``publish(plan, devices)``),
kills with real signals, and waits on progress files and process exits, always with deadlines.
The worker side is ``main()`` below: it reads a JSON payload, trains, and writes its
``RunResult`` (or its error) with ``torch.save``. ``pause_at`` makes every worker wait, after the
step that brings it to that step count, until the test creates the release file: the test then
acts on a known state. ``hold_steps: N`` makes every worker
wait after each of its first N steps, step k until ``<release>-k`` exists, so a test can act
between any two steps. After every switch a worker records ``process_resources()`` (its
result's ``resources``). ``die_in`` (``{"version", "state"[, "signal"]}``) makes a worker send
itself a signal (default SIGKILL) as it enters that state of that plan version.

The scenario pieces the elastic tests share are here too: the model and timeouts (``payload``),
a heterogeneous plan, and the check of final parameters against the dense reference
(``conftest.elastic_job`` makes the jobs).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Optional

from _wait import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = "elastic-test"
CONFIG = dict(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32, seq_len=8,
              dtype="float64")
TIMEOUTS = dict(plan_wait_s=40.0, comm_s=30.0, regroup_s=30.0, finish_s=40.0)


class HarnessError(AssertionError):
    pass


class ElasticJob:
    def __init__(self, etcd_endpoints: str, tmp: str, payload: dict):
        import torch.distributed as dist

        from hspmd_elastic.coord import Election, EtcdClient, LeasedSession

        self.tmp, self.endpoints = str(tmp), etcd_endpoints
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.client = EtcdClient(etcd_endpoints, timeout=5.0)
        self.session = LeasedSession(self.client, ttl=5)
        self.election = Election(self.client, self.session, job=JOB, node="leader")
        if not self.election.campaign(timeout=10.0):
            raise HarnessError("the test could not become leader")
        self.payload = dict(payload, release=os.path.join(self.tmp, "release"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.publish_times: dict[int, float] = {}

    # ------------------------------------------------------------------ leader side
    def publish(self, plan, devices: list[str], reason: str = "test",
                drain: tuple[str, ...] = (), step: int = 0) -> int:
        from hspmd_elastic.coord import publish_plan, read_plan
        from hspmd_elastic.contract import schema

        current, rev = read_plan(self.client, JOB)
        version = current.version + 1 if current else 1
        record = schema.PlanRecord(version=version, reason=reason, devices=list(devices),
                                   strategy=plan.to_dict(),
                                   store_endpoint=f"127.0.0.1:{self.store.port}",
                                   created_at=time.time(), drain=list(drain), step=step)
        publish_plan(self.election, record, rev, version - 1)
        self.publish_times[version] = record.created_at
        return version

    # ------------------------------------------------------------------ agent side
    def spawn(self, device: str, script: Optional[list[str]] = None,
              **overrides) -> subprocess.Popen:
        """Start ``device``'s worker: this module's ``main`` on the job payload (with
        ``overrides``), or ``script`` (a script path and its arguments)."""
        node, local_rank = device.rsplit(":", 1)
        path = self._path(device, "payload.json")
        with open(path, "w") as f:
            json.dump(dict(self.payload, **overrides, out=self._path(device, "out.pt")), f)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   HSPMD_ETCD_ENDPOINTS=self.endpoints, HSPMD_JOB_ID=JOB, HSPMD_NODE_ID=node,
                   LOCAL_RANK=local_rank,
                   HSPMD_PROGRESS_FILE=self._path(device, "progress.json"))
        log = open(self._path(device, "log.txt"), "w")
        cmd = script or [os.path.abspath(__file__), path]
        proc = subprocess.Popen([sys.executable, *cmd], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=ROOT)
        self.procs[device] = proc
        return proc

    def _path(self, device: str, name: str) -> str:
        return os.path.join(self.tmp, f"{device.replace(':', '_')}.{name}")

    def progress(self, device: str) -> Optional[dict]:
        try:
            with open(self._path(device, "progress.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wait_step(self, devices, step: int, timeout: float = 60.0) -> None:
        def reached():
            for d in devices:
                if self.procs[d].poll() is not None:
                    raise HarnessError(f"{d} exited ({self.procs[d].returncode}):\n{self.log(d)}")
            return all((self.progress(d) or {}).get("step", -1) >= step for d in devices)

        wait_for(reached, timeout, f"{list(devices)} to reach step {step}")

    def release(self) -> None:
        open(self.payload["release"], "w").close()

    def kill(self, device: str, timeout: float = 10.0) -> None:
        proc = self.procs[device]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)

    def join(self, devices, timeout: float = 60.0) -> dict[str, dict]:
        """Wait for ``devices`` to exit; their results (``{"ok": ...}`` or ``{"error": ...}``)."""
        import torch

        deadline = time.monotonic() + timeout
        out = {}
        for d in devices:
            try:
                self.procs[d].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise HarnessError(f"{d} still running after {timeout:g}s:\n{self.log(d)}")
            path = self._path(d, "out.pt")
            if not os.path.exists(path):
                raise HarnessError(f"{d} exited ({self.procs[d].returncode}) without a result:"
                                   f"\n{self.log(d)}")
            out[d] = dict(torch.load(path, weights_only=False),
                          returncode=self.procs[d].returncode)
        return out

    def join_ok(self, devices, timeout: float = 60.0) -> dict[str, dict]:
        """``join``, then each device must have ended ok (else its traceback and log)."""
        results = self.join(devices, timeout)
        for d, r in results.items():
            assert r["ok"], f"{d}: {r.get('traceback')}\n{self.log(d)}"
        return results

    def log(self, device: str) -> str:
        try:
            with open(self._path(device, "log.txt")) as f:
                return f.read()[-6000:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5.0)
        try:
            self.election.resign(timeout=2.0)
            self.session.stop(timeout=2.0)
        finally:
            self.client.close()


# ---------------------------------------------------------------------- scenarios
def payload(**kw) -> dict:
    """The workers' payload: a 2-layer float64 model, 5 steps of 4 rows, paused after step 2."""
    return dict(dict(config=CONFIG, steps=5, global_batch=4, seed=3, data_seed=7, pause_at=2,
                     timeouts=TIMEOUTS), **kw)


def hetero_plan():
    """Pipeline 0: TP2 on devices 0,1; pipeline 1: TP1 on device 2 (two rows each)."""
    from hspmd_elastic.plan import Pipeline, Plan, Stage

    return Plan((Pipeline((Stage((0, 1), (0, 2)),), 1, 2), Pipeline((Stage((2,), (0, 2)),), 1, 2)),
                global_batch=4, num_layers=2)


# ---------------------------------------------------------------------- reference
def reference_params(payload: dict):
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.graph.reference import reference_train
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler

    config = ModelConfig(**payload["config"])
    eps = payload.get("adam_eps")
    optim = AdamWConfig() if eps is None else AdamWConfig(eps=eps)
    if payload.get("documents"):  # packed documents: the rows and their segment ids
        from hspmd_elastic.documents import document_sampler
        from hspmd_elastic.runtime import document_rows_at

        if payload.get("lengths"):  # one document per row, grouped by length bucket
            from hspmd_elastic.bucket_data import bucketed_sampler

            docs = bucketed_sampler(config, payload["documents"], payload["lengths"],
                                    payload["global_batch"], seed=payload["data_seed"])
        else:
            docs = document_sampler(config, payload["documents"], mode="pack",
                                    seed=payload["data_seed"])
        rows = [document_rows_at(docs, s, payload["global_batch"], (0, payload["global_batch"]))
                for s in range(payload["steps"])]
        params, _losses = reference_train(config, payload["seed"], [t for t, _ in rows], optim,
                                          [g for _, g in rows])
        return params
    sample = synthetic_sampler(config, payload["data_seed"])
    batches = [global_batch_at(sample, s, payload["global_batch"])
               for s in range(payload["steps"])]
    params, _losses = reference_train(config, payload["seed"], batches, optim)
    return params


def assemble(results: list[dict], payload: dict):
    from hspmd_elastic.graph.config import ModelConfig, param_specs
    from hspmd_elastic.runtime import gather_full

    config = ModelConfig(**payload["config"])
    shapes = {n: s.shape for n, s in param_specs(config).items()}
    return gather_full([r["final_state"] for r in results], shapes)


def param_diffs(results, payload: dict) -> dict[str, float]:
    """Per parameter, the largest |final value - fault-free reference| over its elements."""
    got = assemble(list(results), payload)
    return {n: (got[n] - ref.to(got[n].dtype)).abs().max().item()
            for n, ref in reference_params(payload).items()}


def max_param_diff(results, payload: dict) -> float:
    """Largest |final parameter - fault-free reference| over every parameter element."""
    return max(param_diffs(results, payload).values())


def assert_matches_reference(results, payload: dict, tol: float = 1e-9) -> None:
    for name, diff in param_diffs(results, payload).items():
        assert diff <= tol, f"{name}: max |elastic - reference| = {diff:g}"


def reference_payload(config, *, steps: int, global_batch: int, seed: int,
                      data_seed: int, adam_eps: Optional[float] = None,
                      documents: Optional[str] = None, lengths: Optional[str] = None
                      ) -> dict:
    """What the reference needs of a run of ``tests/scripts/elastic_train.py`` with these
    arguments (``config``: a ``ModelConfig``; ``adam_eps``: its ``--adam-eps``, if given)."""
    import dataclasses

    payload = {"config": dataclasses.asdict(config), "data_seed": data_seed,
               "global_batch": global_batch, "steps": steps, "seed": seed}
    if adam_eps is not None:
        payload["adam_eps"] = adam_eps
    if documents is not None:  # its --documents: packed rows of that dataset
        payload["documents"] = documents
    if lengths is not None:  # its --lengths: one document per row, by length bucket
        payload["lengths"] = lengths
    return payload


def assert_recovered_in_memory(results: dict[str, dict], survivors: dict[str, int],
                               payload: dict) -> float:
    """Every worker (device -> its result) finished every step, no switch read a checkpoint,
    each survivor (device -> pid) is the process it was before the faults, and the final
    parameters equal the fault-free reference within 1e-9; the largest difference."""
    assert set(survivors) <= set(results), sorted(results)
    for dev, res in results.items():
        assert res["state"] == "done" and res["steps_done"] == payload["steps"], \
            (dev, res["state"])
        assert all(s["source"] in ("init", "bsr") for s in res["switches"]), res["switches"]
        # The plans came from plan/layout (relayed by the agent, or read), never the full record.
        assert all(s["plan_from"] in ("relay", "layout") for s in res["switches"]), \
            res["switches"]
    for dev, pid in survivors.items():
        assert results[dev]["pid"] == pid, f"{dev} was restarted"
    diff = max_param_diff(results.values(), payload)
    assert diff <= 1e-9, f"max |elastic - reference| = {diff:g}"
    return diff


# ---------------------------------------------------------------------- worker side
class _DyingReporter:
    """A progress reporter that sends its own process a signal (default SIGKILL) on entering
    ``state`` of ``version``."""

    def __init__(self, inner, die_in: dict):
        self.inner, self.die_in = inner, die_in

    def report(self, progress) -> None:
        self.inner.report(progress)
        if (progress.plan_version == self.die_in["version"]
                and progress.state == self.die_in["state"]):
            os.kill(os.getpid(), getattr(signal, self.die_in.get("signal", "SIGKILL")))


def main(payload_path: str) -> int:
    import logging

    import torch

    from hspmd_elastic.elastic.api import reporter_from_env
    from hspmd_elastic.graph.comm import CommTimeoutError
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.runtime import RuntimeTimeouts, run, synthetic_sampler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with open(payload_path) as f:
        payload = json.load(f)
    config = ModelConfig(**payload["config"])

    def on_step(info):
        if payload.get("pause_at") == info.step + 1:
            wait_for(lambda: os.path.exists(payload["release"]), 60.0, "the release file")
        if info.step + 1 <= payload.get("hold_steps", 0):  # every step up to it: <release>-<k>
            wait_for(lambda: os.path.exists(f"{payload['release']}-{info.step + 1}"), 60.0,
                     f"the release file of step {info.step + 1}")

    resources: list[dict] = []  # process_resources() after every switch

    def on_switch(_timings):
        from hspmd_elastic.elastic.group import process_resources

        resources.append(process_resources())

    fault = payload.get("fail_last_wait_of_step")  # this rank abandons that step's last wait
    waits: dict[int, int] = {}

    def fault_injector(step, what):
        waits[step] = waits.get(step, 0) + 1
        if step == fault and waits[step] == waits.get(step - 1, -1):
            raise CommTimeoutError(f"injected failure of {what} in step {step}")

    die_in = payload.get("die_in")
    try:
        result = run(config, sample=synthetic_sampler(config, payload["data_seed"]),
                     global_batch=payload["global_batch"], steps=payload["steps"],
                     seed=payload["seed"], checkpoint_dir=payload.get("checkpoint_dir"),
                     checkpoint_every=payload.get("checkpoint_every", 0),
                     timeouts=RuntimeTimeouts(**payload.get("timeouts", {})), on_step=on_step,
                     fault_injector=fault_injector if fault is not None else None,
                     undo=payload.get("undo", "device"), on_switch=on_switch,
                     reporter=_DyingReporter(reporter_from_env(), die_in) if die_in else None)
        out = {"ok": True, "pid": os.getpid(), "state": result.state.value,
               "steps_done": result.steps_done, "plan_version": result.plan_version,
               "rank": result.rank, "final_state": result.final_state,
               "switches": [t.as_dict() for t in result.switches], "losses": result.losses,
               "drained": result.drained.as_dict() if result.drained else None,
               "resources": resources}
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out = {"ok": False, "pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()}
        code = 1
    torch.save(out, payload["out"])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
