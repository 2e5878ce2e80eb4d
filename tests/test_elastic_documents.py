"""An elastic job on documents of any length (``hspmd_elastic.documents``, packed rows keyed by
the global sample index): one of three workers is SIGKILLed mid-run, the survivors switch in
memory, and the final parameters equal the fault-free run on the same packed batches (attention
inside each document, the loss over the real targets only; float64, 1e-9)."""

from __future__ import annotations


import pytest

import _elastic
from _elastic_job import assert_switched_once_in_memory, documents_job_files, one_node_kill_run


pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

STEPS, BATCH, PAUSE = 6, 6, 3
NODE = "dn"


def test_a_killed_worker_of_a_documents_job_is_switched_away_in_memory(tmp_path, marker,
                                                                      etcd_server):
    # documents of 2 to 20 tokens (a row holds seq_len + 1 = 9): short ones pack together, long
    # ones are cut to the row
    model, docs, payload = documents_job_files(tmp_path, 20, steps=STEPS, batch=BATCH)
    events, results, pids, _plans = one_node_kill_run(
        tmp_path, marker, etcd_server, model, nproc=3, batch=BATCH, steps=STEPS, pause=PAUSE,
        victim=2, node=NODE, train=("--documents", docs), prefix="dj")
    assert_switched_once_in_memory(events)
    assert set(results) == {f"{NODE}:0", f"{NODE}:1"}, sorted(results)
    _elastic.assert_recovered_in_memory(
        results, {f"{NODE}:{lr}": pids[lr] for lr in (0, 1)}, payload)
    # the same run without the segments trains something else: the check can fail
    plain = dict(payload, documents=None)
    assert _elastic.max_param_diff(results.values(), plain) > 1e-6
