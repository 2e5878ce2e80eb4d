"""Variable-length data: bucketed in-step switching against the best single plan, on CPU workers.

One run, gloo worlds of ``--workers`` processes (OMP_NUM_THREADS=1, float32), a synthetic
mixed-length corpus written to a temporary directory (default ``32:0.9,256:0.1``: 90 % of the
documents 2..33 tokens, 10 % 129..257), and each worker declared as a CPU device whose memory
holds one replica at the shortest length but not at the longest (``varlen_pure.
declared_memory``: the number follows from the model's size), so the long bucket needs TP or PP
and the planner's plans differ by bucket. The declared memory is enforced: each worker runs in a
cgroup limited to it plus the worker's resident baseline and ``varlen_pure.LIMIT_SLACK`` of it
(``launcher.cgroup_memory``, job ``bench-varlen-<pid>``; a run starts by sweeping the cgroups of
runs killed before they could remove theirs; where the machine has no writable memory
controller, or with ``--no-memory-limit``, the report says it was not). The three plans run
one after another, each in a gloo world of its own (so each worker holds one plan's state under
the limit), ``--rounds`` times, the order reversed every other round (a drift of the machine's
load falls on every plan alike), each from the same initial parameters, with the same global
batch of rows:

* packed:   the best single plan (``plan_for`` at the full length with the whole global
            batch), whole documents packed into rows of the full length
            (``documents.document_sampler``, ``pack``): the baseline a practitioner runs first;
* padded:   the same plan, one document per row padded to the full length;
* bucketed: ours: ``bucket_layouts``' choice per bucket (its own plan where the cost model says
            it pays), rows packed within each bucket (``bucketed_sampler``, ``pack``), the
            in-step switches by fused BSR, one optimizer step.

A step's time is its slowest rank's, between two barriers; the table gives the median over
``--steps`` after ``--warmup`` of every round, tokens/s of the real tokens (the targets the loss
counts) and of the padded ones (the positions computed), the in-step switch time
(``BucketedModel.stats``) as a share of the step and the bytes moved per step; ours / the best
baseline is the headline. Then, in the last round (packed first), the check step: padded and
bucketed load the packed plan's state (parameters and AdamW moments: the three share one home
layout) and each plan runs one more step on the same next global batch; their parameters must
agree (relative to each tensor's largest element: 1e-4 in float32, 1e-9 with ``--dtype
float64``), else exit 1 with one ``bench_varlen: FAIL:`` line and nothing is written into the
docs. A loss that is not finite, or a worker the OOM killer ended (the plan does not fit the
enforced memory), fails the same way. The drift of the plans' own parameters before that
(rounding, amplified by training over the steps) is reported, not checked. A worker that fails
is named with the last line of its output (``BENCH_VARLEN_DEBUG=1``: all of it on stderr).

Usage: .venv/bin/python scripts/bench_varlen [--steps 20] [--warmup 3] [--rounds 2] [--workers 2]
       [--global-batch 20] [--lengths 32:0.9,256:0.1] [--docs 2000] [--dtype float32|float64]
       [--no-memory-limit] [--quick] [--json PATH] [--write-doc docs/benchmarks.md]
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

from bench import varlen_pure as pure
from bench.common import SCRIPTS, finite

from hspmd_elastic.files import atomic_path, atomic_write
from launcher import cgroup_memory
from launcher.cgroups import PREFIX, CgroupError, CgroupUnavailable, ProcessGone

ENTRY = os.path.join(SCRIPTS, "bench_varlen")  # the workers run the entry point with --worker

MODEL_SEED, DATA_SEED = 11, 3
GROUP_TIMEOUT_S = 120.0
PROBE_LIMIT = cgroup_memory.memory_limit(8 << 30, 0)  # the probe's group: one it never reaches
JOB = "bench-varlen"  # the memory cgroups of a run are job bench-varlen-<its pid>
PEAK_FILE = {1: "memory.max_usage_in_bytes", 2: "memory.peak"}  # by cgroup version


# ---- the workers ----------------------------------------------------------------------------

def _samplers(config, payload: dict) -> dict:
    from hspmd_elastic.bucket_data import bucketed_sampler
    from hspmd_elastic.documents import document_sampler

    g = payload["global_batch"]
    path, lengths = payload["corpus"], payload["lengths"]
    return {"padded": lambda: bucketed_sampler(config, path, lengths, g, seed=DATA_SEED),
            "packed": lambda: document_sampler(config, path, "pack", seed=DATA_SEED),
            "bucketed": lambda: bucketed_sampler(config, path, lengths, g, seed=DATA_SEED,
                                                 mode="pack")}


def _batches(config, payload: dict, name: str) -> list:
    """Plan ``name``'s global batches: ``padded`` one document per row (the bucketed sampler in
    ``truncate`` mode, read at the full length), ``packed`` whole documents packed into rows of
    the full length (``documents.document_sampler``, ``pack``), ``bucketed`` packed within each
    bucket (``bucketed_sampler``, ``pack``). The last batch, the check step's, is bucketed's for
    every plan (a model at the full length reads its rows unchanged)."""
    import torch

    g = payload["global_batch"]
    steps = payload["warmup"] + payload["steps"]
    samplers = _samplers(config, payload)

    def batch(sample, s: int):
        pairs = [sample.sample(s * g + j) for j in range(g)]
        return (torch.stack([t for t, _ in pairs]), torch.stack([x for _, x in pairs]).long())

    own = samplers[name]()
    return [batch(own, s) for s in range(steps)] + [batch(samplers["bucketed"](), steps)]


def probe() -> None:
    """What a worker holds before its model: the interpreter, torch, gloo (one rank), the model
    code and torch's lazy initialisation (autograd, the first AdamW step), warmed by one step
    of a one-layer model of a few hundred parameters on one device; its resident bytes on
    stdout (the bench reads its cgroup's peak instead where it can)."""
    import torch
    import torch.distributed as dist

    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.planner import fallback_dp_plan

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    config = ModelConfig(vocab_size=8, hidden_size=8, num_heads=2, num_layers=1, ffn_size=8,
                         seq_len=4, dtype="float32")
    model = SpecializedModel.build(config, fallback_dp_plan([0], 1, 2), 0)
    tokens = torch.randint(1, 8, (2, 5))
    model.step(tokens, segments=torch.ones(2, 5, dtype=torch.long), real_tokens=8)
    print(pure.rss_bytes(open("/proc/self/status").read()), flush=True)
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, payload_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hspmd_elastic.graph.bucketed import Bucket, BucketedModel, create_comms
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.model import document_masks
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.plan import Plan

    with open(payload_path) as f:
        payload = json.load(f)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    config = ModelConfig.from_json(payload["config"])
    home = Plan.from_dict(payload["home"])

    def buckets(key: str) -> list:
        return [Bucket(b["window"], b["start"], Plan.from_dict(b[key]))
                for b in payload["buckets"]]

    def create(plan, cfg):
        return Comm.create(plan, cfg, rank, timeout_s=GROUP_TIMEOUT_S)

    name = payload["plan"]
    comm = create(home, config)
    model = SpecializedModel.build(config, home, rank, seed=MODEL_SEED, comm=comm)
    runner = None
    if name == "bucketed":
        own = buckets("strategy")
        runner = BucketedModel(model, own, create_comms(home, own, config, rank, create),
                               timeout_s=GROUP_TIMEOUT_S)
    data = _batches(config, payload, name)
    records, losses, real = [], [], []
    measured = payload["warmup"] + payload["steps"]
    drift = None
    for i, (tokens, seg) in enumerate(data):
        if i == measured and not payload["check"]:
            break
        if i == measured:  # the check step: every plan from the packed plan's state
            drift = model.local_params()
            handoff(model, payload["state"], rank, save=name == "packed")
        counted = int(document_masks(seg)[1].sum())
        dist.barrier()
        start = time.perf_counter()
        if runner is not None:
            loss = runner.step(tokens, seg, counted)
        else:
            loss = model.step(tokens, segments=seg, real_tokens=counted)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if not payload["warmup"] <= i < measured:
            continue
        real.append(counted)
        stats = runner.stats if runner is not None else None
        records.append({"seconds": elapsed, "switch_s": stats.switch_s if stats else 0.0,
                        "switches": stats.switches if stats else 0,
                        "bytes_sent": stats.bytes_moved if stats else 0})
    dist.barrier()
    with atomic_path(out_path) as tmp:
        torch.save({"records": {name: records}, "losses": {name: losses},
                    "real_tokens": {name: real}, "drift": {name: drift},
                    "params": {name: model.local_params()}}, tmp)
    dist.destroy_process_group()


def handoff(model, prefix: str, rank: int, save: bool) -> None:
    """The packed plan saves its rank's state (parameters and AdamW moments) before the check
    step; the other plans, run after it on the same layout, load it."""
    import torch

    path = f"{prefix}.{rank}.pt"
    if save:
        with atomic_path(path) as tmp:
            torch.save({n: t.clone() for n, (t, _ann) in model.state_tensors().items()}, tmp)
    else:
        model.load_state_tensors(torch.load(path, weights_only=True))


# ---- the parent -----------------------------------------------------------------------------

def fail(message: str) -> None:
    print(f"bench_varlen: FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def write_corpus(settings: pure.Settings, config, prefix: str) -> dict:
    import numpy as np

    from hspmd_elastic.documents import write_indexed

    lengths = pure.doc_lengths(settings.buckets(), settings.docs, settings.seed)
    gen = np.random.default_rng(settings.seed)
    docs, tokens = write_indexed(prefix, (gen.integers(1, config.vocab_size, n)
                                          for n in lengths))
    ranges = pure.length_ranges(settings.buckets())
    return {"documents": docs, "tokens": tokens,
            "ranges": [list(r) for r in ranges],
            "shares": [sum(lo <= n <= hi for n in lengths) / len(lengths) for lo, hi in ranges]}


def planned(settings: pure.Settings, config) -> dict:
    """The declared devices, the single plan and each bucket's plan (``bucket_layouts``)."""
    from hspmd_elastic.planner import (Device, Health, Inventory, LengthBucket, PlannerError,
                                       PlannerOptions, plan_for, spec_for_device)
    from hspmd_elastic.planner import cost
    from hspmd_elastic.planner.bucket_layouts import bucket_layouts, spread_rows
    from hspmd_elastic.planner.buckets import profile_at
    from hspmd_elastic.planner.explain import layout_line
    from hspmd_elastic.planner.profiles import profile_from_config

    profile = profile_from_config(config, "bench-varlen")
    options = PlannerOptions(use_all_devices=True)
    lengths = [LengthBucket(n, s) for n, s in settings.buckets()]
    needs = [cost.stage_memory(profile_at(profile, b.max_len), 1, config.num_layers, True, True,
                               1, 1) for b in (lengths[0], lengths[-1])]
    try:
        memory = pure.declared_memory(needs[0], needs[1], options.memory_fraction)
    except ValueError as exc:
        fail(str(exc))
    spec = spec_for_device("CPU", memory)
    inventory = Inventory(tuple(Device(i, "bench", spec, Health.HEALTHY)
                                for i in range(settings.workers)))
    try:
        home = plan_for(inventory, profile, settings.global_batch, options=options).plan
        layouts = bucket_layouts(inventory, profile, home, lengths, options)
    except PlannerError as exc:
        fail(f"planning: {exc}")
    single_s = cost.estimate_plan(home, inventory, profile, options).step_time_s
    one = Inventory(inventory.devices[:1])
    fits = {}
    for b in (lengths[0], lengths[-1]):
        try:
            plan_for(one, profile_at(profile, b.max_len), settings.global_batch, options=options)
            fits[b.max_len] = True
        except PlannerError:
            fits[b.max_len] = False
    buckets = []
    for b in layouts:
        at_home = spread_rows(home, b.plan.global_batch)
        buckets.append({"window": b.window, "start": b.start, "rows": b.plan.global_batch,
                        "own": b.own, "layout": layout_line(b.plan),
                        "strategy": b.plan.to_dict(), "home_strategy": at_home.to_dict(),
                        "home_layout": layout_line(at_home), "step_s": b.step_s,
                        "home_s": b.home_s, "switch_s": b.switch_s})
    return {"memory_bytes": memory, "one_replica_bytes": {str(lengths[0].max_len): needs[0],
                                                          str(lengths[-1].max_len): needs[1]},
            "one_device_fits": {str(k): v for k, v in fits.items()},
            "home": home.to_dict(), "home_layout": layout_line(home), "buckets": buckets,
            "home_microbatches": [[p.num_microbatches, p.microbatch_size]
                                  for p in home.pipelines],
            "estimated_s": {"packed": single_s, "padded": single_s,
                            "bucketed": sum(b["step_s"] + b["switch_s"] for b in buckets)}}


def baseline_bytes(limits) -> int:
    """What a worker's cgroup is charged before its model: a ``probe`` process in a group of its
    own, its peak as the kernel counts it (shared library pages already cached are not charged
    to it, as they are not to the workers), measured once per run."""
    proc = subprocess.Popen([sys.executable, ENTRY, "--probe"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        place(limits, "probe", proc, PROBE_LIMIT)
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        fail("the memory probe did not finish within 120 s")
    if proc.returncode != 0:
        fail(f"the memory probe failed: {(err.strip().splitlines() or ['-'])[-1][:300]}")
    peak = peak_bytes(limits, "probe")
    return peak if peak else int(out.strip())


def place(limits, name: str, proc: subprocess.Popen, limit) -> None:
    """``proc`` into the worker cgroup ``name`` under ``limit`` (one gone is left to its exit
    status); a cgroup that cannot be written fails the run."""
    try:
        limits.place(name, proc.pid, limit)
    except ProcessGone:
        pass
    except CgroupError as exc:
        proc.kill()
        proc.wait(timeout=10)
        fail(f"memory cgroup: {exc}")


def peak_bytes(limits, name: str):
    """The most the worker cgroup ``name`` was charged, in bytes (None: the kernel has no
    record)."""
    path = os.path.join(limits.path(name), PEAK_FILE[limits.hierarchy.version])
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def sweep_killed_runs(hierarchy) -> list:
    """The memory cgroups of runs (jobs ``bench-varlen-*``) killed before their ``close``,
    restored and removed (``sweep_stale_memory``: a live run's are left alone)."""
    try:
        jobs = sorted(n[len(PREFIX):] for n in os.listdir(hierarchy.root)
                      if n.startswith(f"{PREFIX}{JOB}-"))
        return [p for job in jobs for p in cgroup_memory.sweep_stale_memory(job, hierarchy)]
    except (CgroupError, OSError) as exc:
        print(f"bench_varlen: memory cgroups of earlier runs left: {exc}", file=sys.stderr)
        return []


def open_limits():
    """This run's memory cgroups (job ``bench-varlen-<pid>``), after ``sweep_killed_runs``;
    ``CgroupUnavailable`` saying why where the machine has no writable memory controller."""
    hierarchy = cgroup_memory.detect_memory()
    sweep_killed_runs(hierarchy)
    return cgroup_memory.MemoryLimits(f"{JOB}-{os.getpid()}", hierarchy)


def enforce(memory_bytes: int, enabled: bool) -> tuple[object, object, dict]:
    """The memory cgroups and the limit per worker (None when off or unavailable), and what
    the report says."""
    if not enabled:
        return None, None, {"enforced": False, "why": "--no-memory-limit"}
    try:
        limits = open_limits()
    except CgroupUnavailable as exc:
        return None, None, {"enforced": False, "why": str(exc)}
    base = baseline_bytes(limits)
    limit = cgroup_memory.memory_limit(memory_bytes, pure.limit_baseline(base))
    return limits, limit, {"enforced": True, "baseline_bytes": base, "limit_bytes": limit.limit}


def group(payload: dict, rank: int) -> str:
    return f"{payload['plan']}-r{payload['round']}-rank{rank}"


def run_world(settings: pure.Settings, payload: dict, tmp: str, limits=None,
              limit=None) -> list[dict]:
    import torch
    import torch.distributed as dist

    world = settings.workers
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    path = os.path.join(tmp, "payload.json")
    atomic_write(path, json.dumps(payload))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = [os.path.join(tmp, f"out{r}.pt") for r in range(world)]
    logs = [open(os.path.join(tmp, f"log{r}.txt"), "w") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, ENTRY, "--worker", str(r),
                               str(world), str(store.port), path, outs[r]], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(world)]
    deadline = time.monotonic() + settings.timeout_s
    try:
        if limits is not None:
            for r, p in enumerate(procs):
                place(limits, group(payload, r), p, limit)
        for r, p in enumerate(procs):
            try:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                fail(f"worker {r} still running after {settings.timeout_s:g} s")
            if code != 0:
                with open(os.path.join(tmp, f"log{r}.txt")) as f:
                    text = f.read()
                if os.environ.get("BENCH_VARLEN_DEBUG"):
                    print(text, file=sys.stderr)
                tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["-"]
                if limits is not None and limits.oom_kills(group(payload, r)):
                    fail(f"{payload['plan']}: worker {r} was killed by the kernel's OOM killer: "
                         f"the plan does not fit the enforced memory "
                         f"({limit.limit / 2**20:.1f} MiB per worker)")
                fail(f"{payload['plan']}: worker {r} exited with {code}: {tail[0][:300]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
    peaks = [peak_bytes(limits, group(payload, r)) if limits is not None else None
             for r in range(world)]
    return [dict(torch.load(o, weights_only=False), peak_bytes=peak)
            for o, peak in zip(outs, peaks)]


def worst_difference(results: list[dict], key_: str = "params") -> tuple[float, str]:
    """The largest relative difference of any tensor on any rank, padded and bucketed against
    packed (each plan's home shards sit on the same ranks: one layout), and where."""
    worst, where = 0.0, "-"
    for rank, r in enumerate(results):
        ref = r[key_]["packed"]
        for name in ("padded", "bucketed"):
            for key, t in r[key_][name].items():
                scale = max(float(ref[key].abs().max()), 1e-12)
                diff = float((t - ref[key]).abs().max())
                rel = diff / scale if math.isfinite(diff) else math.inf
                if rel > worst or not math.isfinite(rel):
                    worst, where = rel, f"{name} {key} on rank {rank}"
    return worst, where


def run_round(settings: pure.Settings, payload: dict, tmp: str, round_: int, limits,
              limit) -> dict:
    """One world per plan, one after another; the order reversed every other round, the last
    round in ``PLANS`` order with the check step (packed first: the others load its state)."""
    last = round_ == settings.rounds - 1
    order = pure.round_order(round_, settings.rounds)
    out = {}
    for name in order:
        d = os.path.join(tmp, f"r{round_}-{name}")
        os.makedirs(d)
        out[name] = run_world(settings, dict(payload, plan=name, check=last, round=round_,
                                             state=os.path.join(tmp, "packed-state")),
                              d, limits, limit)
    return out


def measure(settings: pure.Settings, config, plans: dict, corpus: str) -> dict:
    payload = {"config": config.to_json(), "home": plans["home"], "buckets": plans["buckets"],
               "corpus": corpus, "lengths": settings.lengths, "global_batch": settings.global_batch,
               "steps": settings.steps, "warmup": settings.warmup}
    limits, memory = None, {}
    try:
        limits, limit, memory = enforce(plans["memory_bytes"], settings.memory_limit)
        with tempfile.TemporaryDirectory(prefix="bench-varlen-") as tmp:
            rounds = [run_round(settings, payload, tmp, r, limits, limit)
                      for r in range(settings.rounds)]
    finally:
        try:
            if limits is not None:
                limits.close()
        except CgroupError as exc:  # what is left, the next run sweeps
            print(f"bench_varlen: {exc}", file=sys.stderr)
    last = rounds[-1]  # the check round
    memory["peak_bytes"] = {name: [max((w[name][r]["peak_bytes"] or 0 for w in rounds),
                                       default=0) or None for r in range(settings.workers)]
                            for name in pure.PLANS}
    results = [{key: {name: last[name][r][key][name] for name in pure.PLANS}
                for key in ("losses", "drift", "params")} for r in range(settings.workers)]
    for r, res in enumerate(results):  # every round's measured steps count
        for key in ("records", "real_tokens"):
            res[key] = {name: [x for w in rounds for x in w[name][r][key][name]]
                        for name in pure.PLANS}
    full = settings.global_batch * config.seq_len
    padded = {"packed": full, "padded": full,
              "bucketed": sum(b["rows"] * b["window"] for b in plans["buckets"])}
    layouts = {"packed": plans["home_layout"], "padded": plans["home_layout"],
               "bucketed": " + ".join(f"{b['window']}: {b['layout']}" for b in plans["buckets"])}
    out = {}
    for name in pure.PLANS:
        real = results[0]["real_tokens"][name]
        steps = [pure.StepRecord(*zip(*[(r["records"][name][i][k] for k in
                                         ("seconds", "switch_s", "switches", "bytes_sent"))
                                        for r in results]))
                 for i in range(settings.steps * settings.rounds)]
        out[name] = dict(pure.summarize(name, layouts[name], steps, sum(real) / len(real),
                                        padded[name]), estimated_s=plans["estimated_s"][name])
    losses = {name: results[0]["losses"][name] for name in pure.PLANS}
    bad = [(n, i) for n, ls in losses.items() for i, v in enumerate(ls) if not math.isfinite(v)]
    if bad:
        fail(f"plan {bad[0][0]}: the loss of step {bad[0][1]} is not finite")
    worst, where = worst_difference(results)
    drift, drift_where = worst_difference(results, "drift")
    return {"plans": out, "losses": losses, "memory": memory,
            "agreement": dict(pure.agreement(worst, settings.tolerance), where=where,
                              dtype=settings.dtype, drift_rel=drift, drift_where=drift_where,
                              drift_steps=settings.warmup + settings.steps)}


def header(settings: pure.Settings, config, plans: dict, corpus: dict, load: float,
           elapsed: float) -> str:
    mib = plans["memory_bytes"] / 2**20
    shares = ", ".join(f"{100 * s:.0f} % of {lo}..{hi} tokens"
                       for s, (lo, hi) in zip(corpus["shares"], corpus["ranges"]))
    need = plans["one_replica_bytes"]
    fits = plans["one_device_fits"]
    lengths = list(need)
    return (
        f"`scripts/bench_varlen`: one run, {datetime.date.today().isoformat()}, "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), 1-minute load average {load:.1f} "
        f"before it, {elapsed:.0f} s in all. Model {json.dumps(config_dict(config))}, AdamW; "
        f"{settings.workers} worker processes in one gloo world on loopback, OMP_NUM_THREADS=1, "
        f"each declared as a CPU device of {mib:.1f} MiB (one replica with one row of "
        f"activations needs {need[lengths[0]] / 2**20:.1f} MiB at {lengths[0]} tokens, "
        f"{need[lengths[-1]] / 2**20:.1f} MiB at {lengths[-1]}: one device "
        f"{'holds' if fits[lengths[0]] else 'does not hold'} the short bucket and "
        f"{'holds' if fits[lengths[-1]] else 'does not hold'} the long one). Corpus: "
        f"{corpus['documents']} synthetic documents ({shares}), lengths "
        f"`{settings.lengths}`, global batch {settings.global_batch} rows: packed (whole "
        f"documents packed into rows of {config.seq_len}), padded (one document per row) and "
        f"bucketed (rows grouped by bucket, `bucket_data.bucketed_sampler`, packed within each "
        f"bucket). The three plans run one after another, each in a gloo world of its own, "
        f"{settings.rounds} round(s), the order reversed every other round, from the same "
        f"initial parameters; a step is its slowest rank's time between two barriers, the "
        f"median over {settings.steps} steps after {settings.warmup} warm-up of every round. "
        f"Real tokens are the targets the loss counts, padded tokens "
        f"the positions computed. Single plan (packed and padded): "
        f"{cell(plans['home_layout'])}, "
        + ", ".join(f"{m} micro-batches of {b} row{'s' if b != 1 else ''}"
                    for m, b in plans["home_microbatches"])
        + ".")


def cell(text: str) -> str:
    return pure.cell(text)


def config_dict(config) -> dict:
    keys = ("vocab_size", "hidden_size", "num_heads", "num_layers", "ffn_size", "seq_len",
            "dtype")
    return {k: getattr(config, k) for k in keys}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        probe()
        return 0
    if argv[:1] == ["--worker"]:
        r, w, port, payload, out = argv[1:6]
        worker(int(r), int(w), int(port), payload, out)
        return 0
    settings = pure.parse_args(argv, __doc__.splitlines()[0])
    from hspmd_elastic.graph.config import ModelConfig, ModelConfigError

    try:
        config = ModelConfig(**settings.model)
    except ModelConfigError as exc:
        fail(f"model: {exc}")
    began, load = time.monotonic(), os.getloadavg()[0]
    plans = planned(settings, config)
    print(f"single plan (full length {config.seq_len}, {settings.global_batch} rows): "
          f"{plans['home_layout']}", flush=True)
    for b in plans["buckets"]:
        print(f"bucket {b['window']} tokens, rows {b['start']}+{b['rows']}: "
              f"{'its own plan' if b['own'] else pure.HOME_LAYOUT}: {b['layout']} "
              f"(estimated {1000 * b['step_s']:.0f} ms; single plan layout "
              f"{1000 * b['home_s']:.0f} ms, switch {1000 * b['switch_s']:.1f} ms)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-varlen-corpus-") as tmp:
        prefix = os.path.join(tmp, "corpus")
        corpus = write_corpus(settings, config, prefix)
        result = measure(settings, config, plans, prefix)
    elapsed = time.monotonic() - began
    command = " ".join([".venv/bin/python", "scripts/bench_varlen", *map(shlex.quote, argv)])
    result.update(settings={k: v for k, v in vars(settings).items()},
                  model=config_dict(config), corpus=corpus, buckets=plans["buckets"],
                  home_layout=plans["home_layout"], memory_bytes=plans["memory_bytes"],
                  one_replica_bytes=plans["one_replica_bytes"],
                  one_device_fits=plans["one_device_fits"], verdict=pure.verdict(result),
                  command=command, date=datetime.date.today().isoformat(), load_average=load,
                  elapsed_s=elapsed)
    body = pure.report(result, command, header(settings, config, plans, corpus, load, elapsed))
    print(body, flush=True)
    if settings.json_path:
        atomic_write(settings.json_path, json.dumps(finite(result), indent=1))
    if not result["agreement"]["ok"]:
        fail(f"the parameters of the three plans differ: worst relative difference "
             f"{result['agreement']['worst_rel']:.3g} > {settings.tolerance:g} "
             f"({result['agreement']['where']})")
    if settings.write_doc:
        path = settings.write_doc
        text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
        atomic_write(path, pure.with_section(text, body))  # a failure never truncates the doc
    return 0
