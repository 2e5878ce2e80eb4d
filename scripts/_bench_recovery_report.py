"""The report of ``scripts/bench_recovery``: medians, the section's Markdown, and writing it
into docs/benchmarks.md (only that section; the file is re-read right before writing)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics

from _bench_recovery_setup import AFTER_KILL_STEPS, LEASE_TTL_S

from hspmd_elastic.files import atomic_write


def med(rows, key) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def runs(rows, key="total") -> str:
    return ", ".join(f"{r[key]:.2f}" for r in rows)


def report(el, rs, nl, args, load, elapsed, debounce, setup) -> str:
    """The section's body for one setup (``bench_recovery.Setup``)."""
    ratio = med(rs, "total") / med(el, "total")
    cmd = f".venv/bin/python scripts/bench_recovery --repeats {args.repeats}"
    if setup.device_memory:
        cmd += " --state-moves"
    if args.kill_at != 4:
        cmd += f" --kill-at {args.kill_at}"
    if args.no_node_loss:
        cmd += " --no-node-loss"
    lines = [
        f"Command: `{cmd}` ({elapsed:.0f} s). Model {json.dumps(setup.model)} "
        f"({setup.params / 1e6:.1f} M parameters), global batch {setup.global_batch}, "
        "AdamW; 2 nodes x 2 workers (two `hspmd-launch` agents on this host, "
        f"`--hspmd-node-id node0/node1`) on one embedded etcd, gloo on loopback, "
        f"OMP_NUM_THREADS=1; lease TTL {LEASE_TTL_S:g} s (`--hspmd-lease-ttl`). Fault: SIGKILL "
        f"of one worker once its own timeline shows {args.kill_at} completed steps; the job "
        f"then trains {AFTER_KILL_STEPS} more. {os.cpu_count()} CPU cores "
        f"({platform.machine()}), measured {datetime.date.today().isoformat()} with a 1-minute "
        f"load average of {load:.1f} before the run (other work on the machine inflates every "
        f"time). Medians of {args.repeats} runs per mode, modes alternating in one invocation.",
        "",
        "- (A) elastic: `hspmd-launch --hspmd-elastic --hspmd-model <config.json> "
        f"--hspmd-global-batch {setup.global_batch}"
        + (f" --hspmd-device-memory {setup.device_memory}" if setup.device_memory else "")
        + f"` (default debounce, {debounce:g} s) running "
        "`scripts/_bench_elastic_train.py` (`hspmd_elastic.runtime`); the victim is worker 1 of "
        "the node that is not the leader. No checkpoints are written: the survivors keep their "
        "state in memory.",
        "- (B) restart, torchrun-style: the same agents in restart mode (`--max-restarts 1`) "
        "running `scripts/_bench_restart_train.py`: DDP over a dense copy of the same model "
        "(`hspmd_elastic.graph.reference`, same initial weights, same batches), rank 0 "
        "`torch.save`s parameters + AdamW state after every step, every rank reloads on start. "
        "Victim `node1:1`; the agents stop the 3 others, re-rendezvous and start 4 new workers "
        "(`--node-rank 0/1`, so node0 hosts the workers' store in both rounds).",
    ]
    if nl:
        lines.append("- (C) node loss, elastic: SIGKILL of the non-leader agent (its 2 workers "
                     "die with it); the leader learns it when the node's lease expires.")
    lines += [
        "",
        f"Plans (A): {el[0]['plan_before']} -> {el[0]['plan_after']}"
        + (f"; (C): -> {nl[0]['plan_after']}" if nl else "") + ".",
        "",
        "Recovery = SIGKILL -> every surviving (A, C) or restarted (B) worker completed a "
        "training step afterwards:",
        "",
        "| mode | recovery (s) | runs (s) | detection (s) | runs (s) |",
        "|---|---|---|---|---|",
        f"| (A) elastic, worker SIGKILL | {med(el, 'total'):.2f} | {runs(el)} | "
        f"{med(el, 'detect'):.3f} | {runs(el, 'detect')} |",
        f"| (B) restart + checkpoint reload, worker SIGKILL | {med(rs, 'total'):.2f} | {runs(rs)} "
        f"| {med(rs, 'detect'):.3f} | {runs(rs, 'detect')} |",
    ]
    if nl:
        lines.append(f"| (C) elastic, node loss (agent SIGKILL) | {med(nl, 'total'):.2f} | "
                     f"{runs(nl)} | {med(nl, 'detect'):.3f} | {runs(nl, 'detect')} |")
    ok_ratio = ratio >= 5
    ok_det = med(el, "detect") < 1.5
    lines += [
        "",
        f"Restart / elastic: **{ratio:.1f}x** (target: at least 5x: "
        f"{'met' if ok_ratio else 'not met'}). Detection of a worker kill (SIGKILL -> the "
        f"agent's `failure` event): **{med(el, 'detect'):.3f} s** (target: under 1.5 s: "
        f"{'met' if ok_det else 'not met'})."
        + (f" Detection of a node loss (SIGKILL -> the leader first sees the node gone): "
           f"**{med(nl, 'detect'):.2f} s** against a target of TTL + 1 s = "
           f"{LEASE_TTL_S + 1:g} s ({'met' if med(nl, 'detect') < LEASE_TTL_S + 1 else 'not met'})."
           if nl else ""),
        "",
        "Breakdown, medians, seconds after the SIGKILL (cumulative), and phase durations; "
        "switch phases are the slowest survivor's:",
        "",
        "| (A) elastic | s | (B) restart | s |",
        "|---|---|---|---|",
    ]
    a = [("`failure` event (agent saw the exit)", f"{med(el, 'detect'):.3f}"),
         ("leader saw the change", f"{med(el, 'leader_saw'):.3f}"),
         ("plan published (after debounce "
          f"{med(el, 'debounce'):.3f}, plan {med(el, 'plan'):.3f}, publish "
          f"{med(el, 'publish'):.3f})", f"{med(el, 'published'):.3f}"),
         ("`switch-done` event (rank 0 of the new plan)", f"{med(el, 'switch_event'):.3f}"),
         ("every survivor switched", f"{med(el, 'switched'):.3f}"),
         ("training resumed (every survivor stepped)", f"**{med(el, 'total'):.3f}**"),
         ("switch: plan seen after publication", f"{med(el, 'detect_s'):.3f}"),
         ("switch: regroup (destroy + store + init)", f"{med(el, 'regroup_s'):.3f}"),
         ("switch: resume-step agreement", f"{med(el, 'exchange_s'):.3f}"),
         (f"switch: fused BSR ({med(el, 'bsr_bytes_total') / 1e6:.2f} MB moved)",
          f"{med(el, 'bsr_s'):.3f}"),
         ("switch: rebuild (groups + model)", f"{med(el, 'rebuild_s'):.3f}"),
         ("switch: total", f"{med(el, 'total_s'):.3f}")]
    b = [("`failure` event (agent saw the exit)", f"{med(rs, 'detect'):.3f}"),
         ("every new worker process created (stop 3, re-rendezvous, spawn 4)",
          f"{med(rs, 'spawned'):.3f}"),
         ("every script started (interpreter)", f"{med(rs, 'started'):.3f}"),
         ("every `import torch` + model code done", f"{med(rs, 'imported'):.3f}"),
         ("process group formed", f"{med(rs, 'pg'):.3f}"),
         ("model + optimizer built (first torch ops)", f"{med(rs, 'built'):.3f}"),
         (f"checkpoint loaded ({rs[0]['ckpt_bytes'] / 1e6:.2f} MB)", f"{med(rs, 'loaded'):.3f}"),
         ("training resumed (every rank stepped)", f"**{med(rs, 'total'):.3f}**")]
    for i in range(max(len(a), len(b))):
        left = f"{a[i][0]} | {a[i][1]}" if i < len(a) else " | "
        right = f"{b[i][0]} | {b[i][1]}" if i < len(b) else " | "
        lines.append(f"| {left} | {right} |")
    if nl:
        lines += [
            "",
            f"(C) node loss, medians after the SIGKILL: leader saw the node gone "
            f"{med(nl, 'detect'):.2f} s, plan published {med(nl, 'published'):.2f} s, every "
            f"survivor switched {med(nl, 'switched'):.2f} s, training resumed "
            f"{med(nl, 'total'):.2f} s (switch: regroup {med(nl, 'regroup_s'):.3f}, fused BSR "
            f"{med(nl, 'bsr_s'):.3f} s for {med(nl, 'bsr_bytes_total') / 1e6:.2f} MB, rebuild "
            f"{med(nl, 'rebuild_s'):.3f}).",
        ]
    if setup.device_memory:
        lines += bsr_share(el, rs)
    lines += [
        "",
        f"Steps redone: elastic {med(el, 'lost_steps'):.0f} (state sources: "
        f"{', '.join(sorted({s for r in el for s in r['sources']}))}; the survivors resume at the "
        f"step they hold), restart {med(rs, 'lost_steps'):.0f} (it reloads the checkpoint saved "
        "after the last completed step; a checkpoint after every step is the best case for "
        "restart, and neither its save time in normal steps nor steps it would redo with a "
        "sparser checkpoint are counted here).",
    ]
    sw_total, det = med(el, "total_s"), med(el, "detect")
    lines += [
        "",
        f"Step time before the fault (median gap between consecutive steps of one process): "
        f"(A) {med(el, 'step_time'):.3f} s, (B) {med(rs, 'step_time'):.3f} s (rank 0's "
        "checkpoint save included).",
        "",
        "Reading the numbers: (A)'s recovery is the agent noticing the exit (its monitor poll, "
        f"{det:.2f} s), the leader's debounce window ({med(el, 'debounce'):.2f} s), planning and "
        f"the fenced publication (~{med(el, 'plan') + med(el, 'publish'):.2f} s), and the switch "
        f"in the survivors ({sw_total:.2f} s on the slowest, from seeing the plan), then one "
        "step; the survivors never "
        "leave their processes, so there is no interpreter start, no `import torch` and no "
        "checkpoint I/O. "
        + (moving_note(el, setup) if setup.device_memory else
           "The planner picks pure data parallelism for this model on CPU "
           "workers, so every survivor already holds every parameter and optimizer state: the "
           f"fused BSR moved {med(el, 'bsr_bytes_total'):.0f} B and the switch is regroup, "
           "agreement and rebuild; `--state-moves` measures the switch when state moves "
           "(section below). ")
        + "(B) pays, for every restarted process at once on 2 cores, "
        "interpreter start, `import torch`, the first torch operations (lazy initialisation "
        "inside model and optimizer construction: the first `torch.optim` optimizer of a "
        "process imports `torch._dynamo`, about 1 s alone on an idle core) and the checkpoint "
        "read; its phases are CPU "
        f"contention between four starting processes more than the checkpoint's size "
        f"({rs[0]['ckpt_bytes'] / 1e6:.1f} MB). Even without the model and optimizer build "
        f"(restart {med(rs, 'total') - med(rs, 'built') + med(rs, 'pg'):.2f} s) the ratio would "
        f"be {(med(rs, 'total') - med(rs, 'built') + med(rs, 'pg')) / med(el, 'total'):.1f}x. "
        "Detection is the same mechanism in both modes "
        "(the agent's poll of its workers). (B) is measured in its best case: a checkpoint "
        "after every step (no steps redone) and a fixed node count (no rendezvous `last_call` "
        "wait). (C)'s detection is bounded by the lease: the node's records vanish when its "
        f"{LEASE_TTL_S:g} s lease expires, counted from the last keepalive (sent every TTL/3), "
        "so before the full TTL after the kill is possible; etcd checks expiry about every "
        "0.5 s, then the leader's watch sees the deletion. Times vary run to run by tens of percent with the machine's "
        f"load (1-minute load average {load:.1f} before the run, {os.getloadavg()[0]:.1f} "
        "after).",
    ]
    return "\n".join(lines) + "\n"


def moving_note(el, setup) -> str:
    """What the switch does when the plans shard the model (``--state-moves``)."""
    return (f"The agents declare {setup.device_memory} per device, less than one replica "
            "needs, so the planner shards the model and the fault changes the layout "
            f"({el[0]['plan_before']} -> {el[0]['plan_after']}): the survivors reshard by "
            "fused BSR, and its share is in the table below. ")


def bsr_share(el, rs) -> list[str]:
    """The BSR's share of the elastic recovery, against the restart's checkpoint reload."""
    moved, bsr = med(el, "bsr_bytes_total"), med(el, "bsr_s")
    ckpt = rs[0]["ckpt_bytes"]
    load = med(rs, "load_s")
    first_step = med(el, "total") - med(el, "switched")
    return [
        "",
        f"(A)'s recovery ends with the first step under the new plan ({first_step:.2f} s after "
        "the last survivor switched): the new layout has one device fewer, and its first step "
        "also builds what the new specialized graph runs for the first time. The switch "
        "itself, state moved included, is the `switch: total` row.",
        "",
        "Where the state moves, medians (seconds; shares of that mode's recovery):",
        "",
        "| | bytes | time (s) | rate (MB/s) | share of the switch | share of the recovery |",
        "|---|---|---|---|---|---|",
        f"| (A) fused BSR: weights + AdamW state to their new owners | {moved / 1e6:.1f} MB | "
        f"{bsr:.3f} | {moved / 1e6 / bsr if bsr else float('nan'):.0f} | "
        f"{bsr / med(el, 'total_s'):.0%} | {bsr / med(el, 'total'):.0%} |",
        f"| (B) checkpoint reload: every rank reads the whole checkpoint | {ckpt / 1e6:.1f} MB "
        f"each | {load:.3f} | {ckpt / 1e6 / load if load else float('nan'):.0f} | - | "
        f"{load / med(rs, 'total'):.0%} |",
    ]


def write_section(path: str, section: str, body: str) -> None:
    with open(path) as f:  # re-read right before writing: other sections belong to others
        text = f.read()
    start = text.find("\n" + section + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section + "\n\n" + body
    else:
        start += 1
        nxt = text.find("\n## ", start + len(section))
        tail = "" if nxt < 0 else text[nxt:]
        text = text[:start] + section + "\n\n" + body.rstrip("\n") + "\n" + tail
    atomic_write(path, text)  # temporary file, fsync, rename: a failure never truncates the doc
