"""Jobs across hosts: every node in a network namespace of its own, with its own address on a
control bridge (to a 3-member etcd, each member in its own namespace) and on a data bridge (to
its peers). Nothing here reaches another node over loopback: an address that only works on
loopback (an agent's store on ``localhost``, gloo on the hostname's 127.0.0.1) fails these jobs.

Restart mode: two nodes meet in one rendezvous, ``MASTER_ADDR`` is node 0's data address and
gloo's all_reduce spans the namespaces. Elastic mode: two nodes train to the end on one plan
whose store is a data address, and the parameters equal the fault-free reference.
"""

from __future__ import annotations

import pytest

import _elastic
from _elastic_job import TINY, elastic_argv, write_tiny
from _netns import NetnsJob
from launch_harness import SCRIPTS, base_env, read_json_files

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.plans import read_plan

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

CONFIG = TINY
STEPS, BATCH, SEED, DATA_SEED = 4, 4, 3, 7
REFERENCE = _elastic.reference_payload(CONFIG, steps=STEPS, global_batch=BATCH, seed=SEED,
                                       data_seed=DATA_SEED)


def test_restart_mode_two_hosts_meet_over_their_own_addresses(netns, tmp_path, marker):
    topo = netns()
    dump = tmp_path / "dump"
    dump.mkdir()
    job = NetnsJob(topo, base_env(marker, DUMP_DIR=str(dump)))
    try:
        for node in topo.nodes:
            job.start(node, job.args(node, "2", 1, str(SCRIPTS / "env_dump.py")))
        job.finish(90)
        dumps = read_json_files(dump, "round0_rank*.json")
        assert sorted(dumps) == ["round0_rank0.json", "round0_rank1.json"]
        data = {n.data_addr for n in topo.nodes.values()}
        for d in dumps.values():
            e = d["env"]
            assert d["all_reduce"] == 1.0 and d["pg_world"] == 2
            assert e["MASTER_ADDR"] in data, e["MASTER_ADDR"]
            assert e["HSPMD_ETCD_ENDPOINTS"] == topo.endpoint_str
    finally:
        job.close()


def elastic_args(job: NetnsJob, node: str, out, *gates: str, nnodes: str = "2",
                 timeout: float = 30.0, extra: tuple = ()) -> list[str]:
    config = write_tiny(job.topo.tmp / "model.json")
    args = job.args(node, nnodes, 1, *elastic_argv(
        config, BATCH, *extra, steps=STEPS, out=out, seed=SEED, data_seed=DATA_SEED,
        train=("--timeout", str(timeout))))
    for g in gates:
        args += ["--gate", g]
    return args


def test_elastic_two_hosts_train_to_the_reference(netns, tmp_path, marker):
    topo = netns()
    out = tmp_path / "out"
    job = NetnsJob(topo, base_env(marker))
    try:
        for node in topo.nodes:
            job.start(node, elastic_args(job, node, out))
        job.finish(90)
        import torch

        results = {p.stem.replace("_", ":"): torch.load(p, weights_only=False)
                   for p in sorted(out.glob("*.pt"))}
        assert sorted(results) == ["node-a:0", "node-b:0"]
        _elastic.assert_recovered_in_memory(results, {}, REFERENCE)
        plan, _ = read_plan(job.client, job.name)
        data = {n.data_addr for n in topo.nodes.values()}
        assert plan.store_endpoint.rsplit(":", 1)[0] in data, plan.store_endpoint
        types = [e.type for e in job.events()]
        assert "failure" not in types and "leave" not in types, types
        assert schema is not None
    finally:
        job.close()
