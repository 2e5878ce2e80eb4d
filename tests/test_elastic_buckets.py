"""A length-bucketed elastic job (``--hspmd-lengths``): every plan the leader publishes carries
one plan per length bucket: each step runs the short bucket under the home plan (data
parallel) and the long one under its own pipeline plan (the memory each device declares does not
hold a replica beside a long row's activations), and the gradients come home by fused BSR before
the one optimizer step. One of four workers is SIGKILLed mid-run: the leader recomputes the
bucket plans over the three survivors, they switch in memory, and the final parameters equal
the fault-free run on the same global batches (float64, 1e-9)."""

from __future__ import annotations


import pytest

import _elastic
from _elastic_job import (TINY, assert_switched_once_in_memory, documents_job_files,
                          one_node_kill_run)

from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.graph.bucketed import buckets_from, layout_key

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

STEPS, BATCH, PAUSE = 6, 8, 3
LENGTHS = f"3:0.75,{TINY.seq_len}:0.25"  # windows of 3 and 8 tokens: 6 and 2 rows
MEMORY = "340KiB"  # per device: a replica fits, beside a short row's activations only
NODE = "bn"


def test_a_bucketed_job_loses_a_worker_and_ends_equal_to_the_fault_free_run(tmp_path, marker,
                                                                            etcd_server):
    # documents of 2 to 14 tokens: short ones (up to 4) and long ones, cut to 9
    model, docs, payload = documents_job_files(tmp_path, 14, steps=STEPS, batch=BATCH,
                                               lengths=LENGTHS)
    events, results, pids, plans = one_node_kill_run(
        tmp_path, marker, etcd_server, model, nproc=4, batch=BATCH, steps=STEPS, pause=PAUSE,
        victim=3, node=NODE, prefix="bj",
        flags=("--hspmd-lengths", LENGTHS, "--hspmd-device-memory", MEMORY,
               "--hspmd-straggler-replans", "off"),
        train=("--documents", docs, "--lengths", LENGTHS))
    assert_switched_once_in_memory(events)
    for version, devices in ((1, 4), (2, 3)):
        record = plans[version]
        buckets = buckets_from(record.buckets, len(record.devices))
        assert len(record.devices) == devices and [b.window for b in buckets] == [3, 8]
        # the long bucket's rows are too few for the home plan's pipelines: its own plan
        assert layout_key(buckets[1].plan) != layout_key(plan_of(record)), record.buckets
    assert set(results) == {f"{NODE}:{lr}" for lr in range(3)}, sorted(results)
    for device, r in results.items():  # every step ran its long bucket out and back
        assert r["bucket_switches"] == {s: 2 for s in range(STEPS)}, (device, r)
    _elastic.assert_recovered_in_memory(
        results, {f"{NODE}:{lr}": pids[lr] for lr in range(3)}, payload)
    # the same documents packed several to a row train something else: the check can fail
    packed = dict(payload, lengths=None)
    assert _elastic.max_param_diff(results.values(), packed) > 1e-6
