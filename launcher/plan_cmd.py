"""``hspmd-launch plan``: ask the planner about a hypothetical cluster.

    hspmd-launch plan --devices 8xH800,8xH800,8xH20,8xH20 --model llama-13b --fail node0:3,7

prints the plan the leader would choose (layout, estimated step time, memory per device, the
next-best alternatives); ``--json`` prints the same as JSON. ``--device-memory``,
``--redundancy`` ask what the leader of agents started with ``--hspmd-device-memory`` and
``--hspmd-redundancy`` would plan. It runs the pure planner only: no
etcd, no processes. ``--fail`` takes device ids or ``NODE:INDEX``, the node by name (``node0``)
or by position (``0``); ``--devices`` names at most ``MAX_DEVICES`` devices, counted before any
is made. Bad input is a usage error (exit 2) with one line naming the bad value; a
model that fits no layout exits 1 with the planner's shortfall. Also runnable as
``python -m launcher.plan_cmd``.

    hspmd-launch plan --devices 8xH800 --model llama-7b --global-batch 128 \
        --lengths 512:0.9,8192:0.1

plans for mixed-length data instead (``planner.buckets``): each item is a length bucket, the
longest sequence it holds (tokens) and its share of the sequences; buckets shortest first, the
shares summing to 1 (they are not normalised). Each bucket gets its rows of the global batch
(largest remainders, at least one each) and its own plan at its length; the output shows every
bucket's plan (layout line, estimated step time, memory), the best single plan that fits the
longest bucket (its step time summed over the buckets' rows) and the estimated gain, the single
plan's step time over the sum of the buckets' (no switch cost counted); then what an elastic
job's leader publishes for them (``--hspmd-lengths``): the home plan and each bucket's plan
inside the step (``planner.bucket_layouts``). ``--json`` prints the same (``in_step``). A
bucket the home layout cannot run (fewer rows than its pipelines, or past a device's memory)
says so instead of a step time. ``--lengths`` does not combine with ``--current``; with
``--uniform`` it shows what the leader of agents with ``--hspmd-planner uniform
--hspmd-lengths`` publishes: the uniform home plan, and each bucket's plan chosen over the
devices as they are (``planner.bucket_layouts``, as ``leader.planning`` calls it).

``--uniform`` plans the best uniform plan over any prefix of the devices by speed
(``planner.subsets.best_uniform``: for each prefix, fastest first, every device of it taken for
its weakest, the others idle; the least predicted step wins) and tells the result on the devices
as they are: their types, and the step time and memory the cost model estimates there
(``--json``: the same, with ``uniform`` holding that step time).

Idle devices are listed with why (``Estimate.idle``): each one's speed relative to the fastest
device and the predicted step time of the best plan that gives it work against the chosen
plan's (``--json``: ``estimate.idle``). The planner leaves a device idle when it costs the step
more than it adds; ``--all-devices`` asks for plans that give every device a role instead.

``--optimizer-shards uneven`` asks what the leader of agents started with
``--hspmd-optimizer-shards uneven`` would plan: the cost model charges each device's optimizer
update and optimizer state at its pipeline's share of the rows (``planner.zero_cost``), so the
step time and memory shown are those of uneven optimizer shards; not with ``--lengths``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import replace
from typing import Iterator, Optional

import click

from hspmd_elastic.contract.ids import parse_device_id
from hspmd_elastic.plan import OPTIMIZER_SHARDS, Plan, PlanError
from hspmd_elastic.planner import (Candidate, Inventory, LengthBucket, PlanInfeasibleError,
                                   PlannerError, PlannerOptions, PlanResult, estimate_plan,
                                   inventory_from_dict, inventory_from_nodes, parse_bytes,
                                   parse_lengths, plan_buckets, plan_for, preset,
                                   profile_from_dict)
from hspmd_elastic.planner.bucket_layouts import bucket_layouts, spread_rows
from hspmd_elastic.planner.buckets import profile_at
from hspmd_elastic.planner.explain import describe, explain, layout_line, result_to_dict
from hspmd_elastic.planner.subsets import best_uniform
from launcher.numbers import number


@contextlib.contextmanager
def _planner_errors() -> Iterator[None]:
    """A plan that cannot exist fails the command (exit 1); bad planner input is a usage
    error (exit 2); one line each."""
    try:
        yield
    except PlanInfeasibleError as exc:
        raise click.ClickException(str(exc)) from None
    except PlannerError as exc:
        raise click.UsageError(str(exc)) from None

def _load_json(path: str, param: str) -> object:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path!r}: {exc.strerror}", param_hint=param) \
            from None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{path!r} is not valid JSON: {exc}", param_hint=param) from None


MAX_DEVICES = 65536  # --devices: more is a typo (the planner takes ~2 s at this size)


def _count_devices(spec: str) -> int:
    """Devices a ``COUNTxTYPE,...`` spec names, counted before any is made (a bad item counts
    as one: the planner's parser names it)."""
    total = 0
    for item in str(spec).split(","):
        match = re.match(r"\s*(\d+)\s*[xX*]", item)
        total += int(match.group(1)) if match else 1
    return total


def _capped(count: int, spec: str) -> None:
    if count > MAX_DEVICES:
        shown = spec if len(spec) <= 60 else spec[:57] + "..."
        raise click.BadParameter(f"{shown!r} names {count} devices; the most a plan can ask "
                                 f"about is {MAX_DEVICES}", param_hint="--devices")


def load_inventory(spec: str) -> Inventory:
    """The inventory of ``--devices``: a ``COUNTxTYPE,...`` spec or an inventory JSON file,
    at most ``MAX_DEVICES`` devices (``click.BadParameter`` otherwise)."""
    if spec.endswith(".json") or os.path.isfile(spec):
        data = _load_json(spec, "--devices")
        if isinstance(data, dict) and isinstance(data.get("nodes"), str):
            _capped(_count_devices(data["nodes"]), data["nodes"])
        elif isinstance(data, dict) and isinstance(data.get("devices"), list):
            _capped(len(data["devices"]), spec)
        return inventory_from_dict(data)
    _capped(_count_devices(spec), spec)
    return inventory_from_nodes(spec)


def _node_named(node: str, nodes: list[str]) -> Optional[str]:
    """``node`` as named, or a bare position (``0`` for the first node listed) when no node
    has that name."""
    if node in nodes:
        return node
    if node.isdigit() and int(node) < len(nodes):
        return nodes[int(node)]
    return None


def resolve_device(token: str, inventory: Inventory, param: str) -> int:
    """A device id, or ``NODE:INDEX`` (the INDEX-th device of that node, by id); NODE is a
    node's name (``node0``) or its position in the inventory (``0``)."""
    token = token.strip()
    if ":" in token:
        try:
            node, index = parse_device_id(token)
        except ValueError:
            raise click.BadParameter(f"{token!r} is not NODE:INDEX (INDEX: a number)",
                                     param_hint=param) from None
        nodes = list(dict.fromkeys(d.node for d in inventory.devices))  # in inventory order
        name = _node_named(node, nodes)
        members = [d.id for d in inventory.devices if d.node == name]
        if not members:
            raise click.BadParameter(f"node {node!r} in {token!r} is unknown; nodes: "
                                     f"{', '.join(nodes)} (or their positions 0.."
                                     f"{len(nodes) - 1})", param_hint=param)
        node = name
        if index >= len(members):
            raise click.BadParameter(f"index '{index}' in {token!r}: node {node} has devices "
                                     f"0..{len(members) - 1}", param_hint=param)
        return members[index]
    if not token.isdigit():
        raise click.BadParameter(f"{token!r} is neither a device id nor NODE:INDEX",
                                 param_hint=param)
    ids = {d.id for d in inventory.devices}
    if int(token) not in ids:
        raise click.BadParameter(f"device {token} is not in the inventory (ids "
                                 f"{min(ids)}..{max(ids)})", param_hint=param)
    return int(token)


def _tokens(values: tuple[str, ...]) -> list[str]:
    return [t for v in values for t in v.split(",") if t.strip()]


def _degrades(values: tuple[str, ...], inventory: Inventory) -> dict[int, float]:
    out = {}
    for token in _tokens(values):
        target, sep, factor = token.rpartition("=")
        try:
            value = float(factor)
        except ValueError:
            value = float("nan")
        if not sep or not value >= 1.0 or value == float("inf"):
            raise click.BadParameter(f"{token.strip()!r}: expected ID=FACTOR with FACTOR >= 1 "
                                     "(2 means half speed)", param_hint="--degrade")
        out[resolve_device(target, inventory, "--degrade")] = value
    return out


def _degrees(text: Optional[str], param: str) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: expected positive integers such as 1,2,4",
                                 param_hint=param)
    return values


def declare_memory(inventory: Inventory, size: Optional[str]) -> Inventory:
    """Every device with ``size`` of memory (``--device-memory``, as the agents declare it)."""
    if size is None:
        return inventory
    try:
        memory = parse_bytes(size)
    except PlannerError as exc:
        raise click.BadParameter(str(exc), param_hint="--device-memory") from None
    return Inventory(tuple(replace(d, spec=replace(d.spec, memory_bytes=memory))
                           for d in inventory.devices))


def _lengths(text: Optional[str], current: Optional[str]) -> Optional[tuple[LengthBucket, ...]]:
    """The buckets of ``--lengths`` (None without it); a usage error names a bad item."""
    if text is None:
        return None
    try:
        buckets = parse_lengths(text)
    except PlannerError as exc:  # the planner's line names the spec as "lengths '...'" first
        message = str(exc).removeprefix("lengths ")
        raise click.BadParameter(message, param_hint="--lengths") from None
    if current is not None:
        raise click.UsageError("--lengths does not combine with --current")
    return buckets


def load_profile(model: str):
    if model.endswith(".json") or os.path.isfile(model):
        return profile_from_dict(_load_json(model, "--model"))
    return preset(model)


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--devices", required=True, metavar="NODES|FILE.json",
              help="One item per node, e.g. 8xH800,8xH800,16xH20; or an inventory JSON file "
                   f"(at most {MAX_DEVICES} devices).")
@click.option("--model", default="llama-7b", show_default=True, metavar="NAME|FILE.json",
              help="llama-7b, llama-13b, llama-32b, or a profile / ModelConfig JSON file.")
@click.option("--global-batch", type=number("plan --global-batch"), default=64,
              show_default=True, help="Sequences per step.")
@click.option("--fail", "fail", multiple=True, metavar="IDS",
              help="Failed devices: ids or NODE:INDEX (NODE: a name such as node0, or a "
                   "position such as 0), comma-separated or repeated.")
@click.option("--degrade", multiple=True, metavar="ID=FACTOR",
              help="Slow devices, e.g. 3=2 (half speed) or node1:0=1.5.")
@click.option("--current", type=click.Path(dir_okay=False), default=None,
              help="The current plan (JSON): report the bytes a switch would move.")
@click.option("--tp", default=None, metavar="DEGREES", help="Allowed TP degrees, e.g. 1,2,4.")
@click.option("--pp", default=None, metavar="DEPTHS", help="Allowed pipeline depths, e.g. 1,2.")
@click.option("--cross-node-replicas", is_flag=True,
              help="Prefer plans that keep every parameter slice on two nodes.")
@click.option("--redundancy", type=click.IntRange(min=1), default=1, show_default=True,
              help="Every parameter slice on this many nodes, a hard constraint.")
@click.option("--device-memory", default=None, metavar="SIZE",
              help="Every device's memory, e.g. 24MiB (as --hspmd-device-memory declares it).")
@click.option("--all-devices", is_flag=True,
              help="Prefer plans that give every device a role, even where a slow device "
                   "costs the step more than it adds (by default such a device is left idle "
                   "and the output says why).")
@click.option("--alternatives", type=number("plan --alternatives"), default=3, show_default=True,
              help="Next-best plans to show (0..100).")
@click.option("--uniform", is_flag=True,
              help="The best uniform SPMD plan (one TP/PP everywhere, even layers and rows) over "
                   "any prefix of the devices by speed, every device of it taken for its "
                   "weakest, as --hspmd-planner uniform plans; its step time on these devices "
                   "is added.")
@click.option("--lengths", default=None, metavar="LEN:SHARE,...",
              help="Length buckets, shortest first: each bucket's longest sequence (tokens) "
                   "and its share of the sequences, the shares summing to 1, e.g. "
                   "512:0.9,8192:0.1. Shows one plan per bucket and the estimated gain over "
                   "the best single plan that fits the longest bucket.")
@click.option("--optimizer-shards", type=click.Choice(OPTIMIZER_SHARDS), default="replicated",
              show_default=True,
              help="Where the AdamW moments live, as --hspmd-optimizer-shards sets it: uneven "
                   "charges each device's optimizer update and optimizer state at its "
                   "pipeline's share of the rows (not with --lengths).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def plan_command(devices: str, model: str, global_batch: int, fail: tuple[str, ...],
                 degrade: tuple[str, ...], current: Optional[str], tp: Optional[str],
                 pp: Optional[str], cross_node_replicas: bool, redundancy: int,
                 device_memory: Optional[str], all_devices: bool, alternatives: int,
                 uniform: bool, lengths: Optional[str], optimizer_shards: str,
                 as_json: bool) -> None:
    """Show the plan the planner would choose for a (hypothetical) cluster."""
    buckets = _lengths(lengths, current)
    if buckets is not None and optimizer_shards != OPTIMIZER_SHARDS[0]:
        raise click.BadParameter(f"{optimizer_shards!r} is not supported with --lengths "
                                 "(length buckets keep replicated optimizer state)",
                                 param_hint="--optimizer-shards")
    try:
        inventory = load_inventory(devices)
    except PlannerError as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from None
    try:
        profile = load_profile(model)
    except PlannerError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    inventory = declare_memory(inventory, device_memory)
    failed = tuple(resolve_device(t, inventory, "--fail") for t in _tokens(fail))
    inventory = inventory.with_health(failed, _degrades(degrade, inventory))
    current_plan = None
    if current is not None:
        try:
            current_plan = Plan.from_dict(_load_json(current, "--current"))
        except PlanError as exc:
            raise click.BadParameter(str(exc), param_hint="--current") from None
    options = PlannerOptions(tp_degrees=_degrees(tp, "--tp"), pp_degrees=_degrees(pp, "--pp"),
                             cross_node_replicas=cross_node_replicas, redundancy=redundancy,
                             use_all_devices=all_devices, alternatives=alternatives,
                             optimizer_shards=optimizer_shards)
    if buckets is not None:
        _show_buckets(inventory, profile, global_batch, buckets, options, as_json, uniform)
        return
    with _planner_errors():
        if uniform:
            result = _told_on(best_uniform(plan_for, inventory, profile, global_batch,
                                           current_plan, options),
                              inventory, options, current_plan)
        else:
            result = plan_for(inventory, profile, global_batch, current_plan, options)
    if as_json:
        doc = result_to_dict(result)
        doc["optimizer_shards"] = optimizer_shards
        if uniform:
            est = result.estimate
            doc["uniform"] = {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s}
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    if uniform:
        click.echo("The best uniform plan (one TP/PP degree everywhere, even layers and rows, "
                   "as --hspmd-planner uniform plans)\nuniform plan on these devices: step time "
                   "and memory estimated on them, as they are")
    click.echo(explain(result))
    if optimizer_shards != OPTIMIZER_SHARDS[0]:
        click.echo(f"optimizer shards: {optimizer_shards} (each device's optimizer update and "
                   "optimizer state estimated at its pipeline's share of the rows)")


def _told_on(result: PlanResult, inventory: Inventory, options: PlannerOptions,
             current_plan: Optional[Plan]) -> PlanResult:
    """``result`` (``best_uniform``'s, searched over uniform devices) with every plan's label
    and estimate on ``inventory``, the devices as they are (the chosen plan keeps its
    ``Estimate.idle``, whose step times are the uniform predictions); a plan that cannot run
    there (not expected: the uniform devices are the weakest) is left out."""
    def told(c: Candidate) -> Optional[Candidate]:
        try:
            est = estimate_plan(c.plan, inventory, result.profile, options, current_plan)
        except PlanInfeasibleError:
            return None
        label = c.label.replace(describe(c.plan, result.inventory),
                                describe(c.plan, inventory))
        return Candidate(c.plan, est, label, c.score)

    chosen = told(result.chosen)
    if chosen is not None:
        chosen = replace(chosen, estimate=replace(chosen.estimate, idle=result.estimate.idle))
    if chosen is None:
        raise click.ClickException("the best uniform plan does not run on these devices: "
                                   + describe(result.plan, inventory))
    alternatives = tuple(a for a in map(told, result.alternatives) if a is not None)
    return PlanResult(chosen, alternatives, result.profile, inventory)


def _show_buckets(inventory: Inventory, profile, global_batch: int,
                  buckets: tuple[LengthBucket, ...], options: PlannerOptions,
                  as_json: bool, uniform: bool = False) -> None:
    """``--lengths``: the buckets' plans and the best single plan, then what a job's leader
    publishes; with ``uniform`` only the latter, for ``--hspmd-planner uniform``."""
    result = None
    if not uniform:
        with _planner_errors():
            result = plan_buckets(inventory, profile, global_batch, buckets, options)
    in_step = _in_step(inventory, profile, global_batch, buckets, options, uniform)
    if as_json:
        doc = dict(result.to_dict()) if result is not None else {"planner": "uniform"}
        click.echo(json.dumps(dict(doc, in_step=in_step), indent=2, sort_keys=True))
        return
    if result is not None:
        click.echo(result.explain())
    planner = " --hspmd-planner uniform" if uniform else ""
    click.echo(f"In an elastic job with{planner} --hspmd-lengths (the model at "
               f"{in_step['seq_len']} tokens): home plan {in_step['home']}")
    for b in in_step["buckets"]:
        how = ("its own plan, switched in the step" if b["own"]
               else "the home layout, no switch")
        home = (f"home layout {b['home_s']:.4g} s" if b["home_s"] is not None
                else f"the home layout cannot run it ({b['home_why']})")
        click.echo(f"  <= {b['window']} tokens, rows {b['start']}+{b['rows']}: {how}: "
                   f"{b['layout']} (estimate {b['step_s']:.4g} s; {home}; switch "
                   f"{b['switch_s']:.4g} s)")


def _in_step(inventory: Inventory, profile, global_batch: int,
             buckets: tuple[LengthBucket, ...], options: PlannerOptions,
             uniform: bool = False) -> dict:
    """What a job's leader publishes for these buckets: the home plan (``plan_for`` on the
    whole batch at the longest length; ``best_uniform`` with ``uniform``) and each
    bucket's plan inside the step (``planner.bucket_layouts`` over the devices as they are).
    ``home_s`` is None where the home layout cannot run a bucket, ``home_why`` says why."""
    at = profile_at(profile, buckets[-1].max_len)
    with _planner_errors():
        home = (best_uniform(plan_for, inventory, at, global_batch, options=options) if uniform
                else plan_for(inventory, at, global_batch, options=options)).plan
        layouts = bucket_layouts(inventory, at, home, buckets, options)

    def why(rows: int) -> str:
        if spread_rows(home, rows) is None:
            return (f"only {rows} row{'s' if rows != 1 else ''} for its "
                    f"{len(home.pipelines)} pipelines")
        return "a device's memory is too small for it"

    out = []
    for b in layouts:
        runs = b.home_s != float("inf")
        out.append({"window": b.window, "start": b.start, "rows": b.plan.global_batch,
                    "own": b.own, "layout": layout_line(b.plan), "step_s": b.step_s,
                    "home_s": b.home_s if runs else None,
                    "home_why": "" if runs else why(b.plan.global_batch),
                    "switch_s": b.switch_s})
    return {"seq_len": at.seq_len, "home": layout_line(home), "buckets": out}


command = plan_command  # the name launcher.cli's subcommand table looks up


def main() -> None:
    plan_command(prog_name="hspmd-launch plan")


if __name__ == "__main__":
    main()
