"""The report of ``scripts/bench_recovery``: medians and the section's Markdown, one small
function per part (setup line, modes, recovery table, verdicts, breakdown, the state's share,
the reading); ``bench.common.write_section`` writes it into docs/benchmarks.md."""

from __future__ import annotations

import datetime
import json
import os
import platform
import math

from bench.common import md_table
from bench.common import median_of as med
from bench.recovery_setup import AFTER_KILL_STEPS, LEASE_TTL_S


def runs(rows, key="total") -> str:
    return ", ".join(f"{r[key]:.2f}" for r in rows)


def report(el, rs, nl, args, load, elapsed, debounce, setup, sharded=()) -> str:
    """The section's body for one setup (``bench_recovery.Setup``); ``sharded``: the runs of
    the sharded restart baseline (``--state-moves``), empty when not run."""
    lines = [setup_line(args, load, elapsed, setup), ""]
    lines += modes(setup, debounce, nl, sharded)
    lines += ["", f"Plans (A): {el[0]['plan_before']} -> {el[0]['plan_after']}"
              + (f"; (C): -> {nl[0]['plan_after']}" if nl else "") + ".", ""]
    lines += recovery_table(el, rs, nl, sharded)
    lines += ["", verdicts(el, rs, nl, sharded), ""]
    lines += breakdown(el, rs)
    if nl:
        lines += ["", node_loss_line(nl)]
    if setup.device_memory:
        lines += bsr_share(el, rs, sharded)
    lines += ["", steps_redone(el, rs), ""]
    lines += [f"Step time before the fault (median gap between consecutive steps of one "
              f"process): (A) {med(el, 'step_time'):.3f} s, (B) {med(rs, 'step_time'):.3f} s "
              "(rank 0's checkpoint save included).", "", reading(el, rs, load, setup)]
    return "\n".join(lines) + "\n"


def command(args, setup) -> str:
    cmd = f".venv/bin/python scripts/bench_recovery --repeats {args.repeats}"
    if setup.device_memory:
        cmd += " --state-moves"
    if args.kill_at != 4:
        cmd += f" --kill-at {args.kill_at}"
    if args.no_node_loss:
        cmd += " --no-node-loss"
    return cmd


def setup_line(args, load, elapsed, setup) -> str:
    return (
        f"Command: `{command(args, setup)}` ({elapsed:.0f} s). Model {json.dumps(setup.model)} "
        f"({setup.params / 1e6:.1f} M parameters), global batch {setup.global_batch}, "
        "AdamW; 2 nodes x 2 workers (two `hspmd-launch` agents on this host, "
        f"`--hspmd-node-id node0/node1`) on one embedded etcd, gloo on loopback, "
        f"OMP_NUM_THREADS=1; lease TTL {LEASE_TTL_S:g} s (`--hspmd-lease-ttl`). Fault: SIGKILL "
        f"of one worker once its own timeline shows {args.kill_at} completed steps; the job "
        f"then trains {AFTER_KILL_STEPS} more. {os.cpu_count()} CPU cores "
        f"({platform.machine()}), measured {datetime.date.today().isoformat()} with a 1-minute "
        f"load average of {load:.1f} before the run (other work on the machine inflates every "
        f"time). Medians of {args.repeats} runs per mode, modes alternating in one invocation.")


def modes(setup, debounce, nl, sharded) -> list[str]:
    lines = [
        "- (A) elastic: `hspmd-launch --hspmd-elastic --hspmd-model <config.json> "
        f"--hspmd-global-batch {setup.global_batch}"
        + (f" --hspmd-device-memory {setup.device_memory}" if setup.device_memory else "")
        + f"` (default debounce, {debounce:g} s) running "
        "`scripts/bench/elastic_train.py` (`hspmd_elastic.runtime`); the victim is worker 1 of "
        "the node that is not the leader. No checkpoints are written: the survivors keep their "
        "state in memory.",
        "- (B) restart, torchrun-style: the same agents in restart mode (`--max-restarts 1`) "
        "running `scripts/bench/restart_train.py`: DDP over a dense copy of the same model "
        "(`hspmd_elastic.graph.reference`, same initial weights, same batches), rank 0 "
        "`torch.save`s parameters + AdamW state after every step, every rank reloads on start. "
        "Victim `node1:1`; the agents stop the 3 others, re-rendezvous and start 4 new workers "
        "(`--node-rank 0/1`, so node0 hosts the workers' store in both rounds)."]
    if sharded:
        lines.append(
            "- (D) sharded restart, the baseline a practitioner tunes: one agent, 2 workers on "
            "the 2 cores (one core per restarting worker), each declared with the same "
            f"{setup.device_memory} as (A), so the model is sharded the same way (the "
            "planner's plan for 2 such devices, `scripts/bench/sharded_restart_train.py`); "
            "every rank saves its own shard of parameters + AdamW state after every step and "
            "reads only its own shard on restart. Victim `node0:1`.")
    if nl:
        lines.append("- (C) node loss, elastic: SIGKILL of the non-leader agent (its 2 workers "
                     "die with it); the leader learns it when the node's lease expires.")
    return lines


def recovery_table(el, rs, nl, sharded) -> list[str]:
    rows = [("(A) elastic, worker SIGKILL", el),
            ("(B) restart + checkpoint reload, worker SIGKILL", rs)]
    if sharded:
        rows.append(("(D) sharded restart, 2 workers on 2 cores, own-shard reload", sharded))
    if nl:
        rows.append(("(C) elastic, node loss (agent SIGKILL)", nl))
    return (["Recovery = SIGKILL -> every surviving (A, C) or restarted (B, D) worker completed "
             "a training step afterwards:", ""]
            + md_table(("mode", "recovery (s)", "runs (s)", "detection (s)", "runs (s)"),
                       [(name, f"{med(r, 'total'):.2f}", runs(r), f"{med(r, 'detect'):.3f}",
                         runs(r, "detect")) for name, r in rows]))


def best_baseline(rs, sharded) -> tuple[str, float]:
    """The fastest restart baseline's name and median recovery."""
    options = [("(B)", med(rs, "total"))] + ([("(D)", med(sharded, "total"))] if sharded else [])
    return min(options, key=lambda o: o[1] if math.isfinite(o[1]) else math.inf)


def verdicts(el, rs, nl, sharded) -> str:
    ratio = med(rs, "total") / med(el, "total")
    name, base = best_baseline(rs, sharded)
    det = med(el, "detect")
    text = (f"Restart / elastic: **{ratio:.1f}x** (target: at least 5x: "
            f"{'met' if ratio >= 5 else 'not met'}). Detection of a worker kill (SIGKILL -> "
            f"the agent's `failure` event): **{det:.3f} s** (target: under 1.5 s: "
            f"{'met' if det < 1.5 else 'not met'}).")
    if sharded:
        gain = base / med(el, "total")
        text += (f" Best baseline {name}: ours (A) recovers **{gain:.2f}x** as fast (target: at "
                 f"least 0.97x: {'met' if gain >= 0.97 else 'not met'}).")
    if nl:
        nd = med(nl, "detect")
        text += (f" Detection of a node loss (SIGKILL -> the leader first sees the node gone): "
                 f"**{nd:.2f} s** against a target of TTL + 1 s = {LEASE_TTL_S + 1:g} s "
                 f"({'met' if nd < LEASE_TTL_S + 1 else 'not met'}).")
    return text


def breakdown(el, rs) -> list[str]:
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
    rows = [(*(a[i] if i < len(a) else ("", "")), *(b[i] if i < len(b) else ("", "")))
            for i in range(max(len(a), len(b)))]
    return (["Breakdown, medians, seconds after the SIGKILL (cumulative), and phase durations; "
             "switch phases are the slowest survivor's:", ""]
            + md_table(("(A) elastic", "s", "(B) restart", "s"), rows))


def node_loss_line(nl) -> str:
    return (f"(C) node loss, medians after the SIGKILL: leader saw the node gone "
            f"{med(nl, 'detect'):.2f} s, plan published {med(nl, 'published'):.2f} s, every "
            f"survivor switched {med(nl, 'switched'):.2f} s, training resumed "
            f"{med(nl, 'total'):.2f} s (switch: regroup {med(nl, 'regroup_s'):.3f}, fused BSR "
            f"{med(nl, 'bsr_s'):.3f} s for {med(nl, 'bsr_bytes_total') / 1e6:.2f} MB, rebuild "
            f"{med(nl, 'rebuild_s'):.3f}).")


def steps_redone(el, rs) -> str:
    return (f"Steps redone: elastic {med(el, 'lost_steps'):.0f} (state sources: "
            f"{', '.join(sorted({s for r in el for s in r['sources']}))}; the survivors resume "
            f"at the step they hold), restart {med(rs, 'lost_steps'):.0f} (it reloads the "
            "checkpoint saved after the last completed step; a checkpoint after every step is "
            "the best case for restart, and neither its save time in normal steps nor steps it "
            "would redo with a sparser checkpoint are counted here).")


def reading(el, rs, load, setup) -> str:
    sw_total, det = med(el, "total_s"), med(el, "detect")
    without_build = med(rs, "total") - med(rs, "built") + med(rs, "pg")
    return (
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
        f"(restart {without_build:.2f} s) the ratio would "
        f"be {without_build / med(el, 'total'):.1f}x. "
        "Detection is the same mechanism in both modes "
        "(the agent's poll of its workers). (B) is measured in its best case: a checkpoint "
        "after every step (no steps redone) and a fixed node count (no rendezvous `last_call` "
        "wait). (C)'s detection is bounded by the lease: the node's records vanish when its "
        f"{LEASE_TTL_S:g} s lease expires, counted from the last keepalive (sent every TTL/3), "
        "so before the full TTL after the kill is possible; etcd checks expiry about every "
        "0.5 s, then the leader's watch sees the deletion. Times vary run to run by tens of "
        f"percent with the machine's load (1-minute load average {load:.1f} before the run, "
        f"{os.getloadavg()[0]:.1f} after).")


def moving_note(el, setup) -> str:
    """What the switch does when the plans shard the model (``--state-moves``)."""
    return (f"The agents declare {setup.device_memory} per device, less than one replica "
            "needs, so the planner shards the model and the fault changes the layout "
            f"({el[0]['plan_before']} -> {el[0]['plan_after']}): the survivors reshard by "
            "fused BSR, and its share is in the table below. ")


def bsr_share(el, rs, sharded=()) -> list[str]:
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
    ] + ([shard_row(sharded)] if sharded else [])


def shard_row(sharded) -> str:
    shard, load = sharded[0]["ckpt_bytes"], med(sharded, "load_s")
    return (f"| (D) sharded reload: every rank reads only its own shard | {shard / 1e6:.1f} MB "
            f"each | {load:.3f} | {shard / 1e6 / load if load else float('nan'):.0f} | - | "
            f"{load / med(sharded, 'total'):.0%} |")
