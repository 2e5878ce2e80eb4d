"""The elastic worker's pieces on a GPU, each also run on the CPU so the test itself is exercised
everywhere: the specialized model trains like the dense reference with its state (and the undo
copy) on the device, the fused BSR places its output there, a plan's process group on NCCL
is formed, aborted when a collective is abandoned, and formed again in the same process, and the
pipeline's point-to-point pattern goes through the CUDA path of ``Comm`` (sends posted with the
next receive) without deadlock.

The ``cuda`` cases carry the ``gpu`` marker and skip, with the reason, where torch cannot use
CUDA (``scripts/gpu_check`` runs them on a GPU machine: ``pytest -m gpu tests/test_gpu.py``)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

NO_CUDA = None if torch.cuda.is_available() else \
    f"torch {torch.__version__} cannot use CUDA (a CPU-only build, or no GPU)"
DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))])]
CONFIG = dict(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, ffn_size=32, seq_len=8,
              dtype="float64")


def _one_device_plan(global_batch: int = 4):
    from hspmd_elastic.plan import Pipeline, Plan, Stage

    return Plan((Pipeline((Stage((0,), (0, 2)),), 2, global_batch // 2),),
                global_batch=global_batch, num_layers=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", DEVICES)
def test_model_and_undo_copy_live_on_the_device_and_train_like_the_reference(device):
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.graph.optim import AdamWConfig
    from hspmd_elastic.graph.reference import reference_train
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.runtime import global_batch_at, synthetic_sampler
    from hspmd_elastic.switch import Held

    config = ModelConfig(**CONFIG)
    plan = _one_device_plan()
    model = SpecializedModel.build(config, plan, 0, seed=3, device=device)
    held = Held(1, plan, ["n:0"], model)
    sample = synthetic_sampler(config, 7)
    batches = [global_batch_at(sample, s, 4) for s in range(2)]
    for batch in batches:
        held.train_step(batch)  # the batch comes from the host
    want = torch.device(device)
    assert all(p.device == want for p in model.params.values())
    assert all(t.device == want for n, (t, _a) in model.state_tensors().items()
               if n != "optim.step")
    assert held.undo is not None and held.undo[0] == 1
    assert all(t.device == want for n, t in held.undo[1].items() if n != "optim.step")
    ref, _losses = reference_train(config, 3, batches, AdamWConfig())
    for name, p in model.params.items():
        assert (p.detach().cpu() - ref[name]).abs().max().item() < 1e-9, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_bsr_places_its_output_on_the_device(device):
    from hspmd_elastic.annotations import TensorAnnotation
    from hspmd_elastic.reshard.api import TensorSpec
    from hspmd_elastic.reshard.executor import execute_fused
    from hspmd_elastic.reshard.planner import fused_bsr_schedule

    ann = TensorAnnotation.single_group([0], {})
    specs = [TensorSpec("host", (8, 4), "float32", ann, ann),
             TensorSpec("kept", (3,), "float64", ann, ann)]
    schedule = fused_bsr_schedule(specs, {0}, {0: "n"})
    host = torch.arange(32, dtype=torch.float32).reshape(8, 4)  # held on the host
    kept = torch.ones(3, dtype=torch.float64, device=device)  # already there: rebound
    out, _stats = execute_fused(schedule, 0, {"host": host, "kept": kept}, device=device,
                                timeout_s=10.0)
    assert out["host"].device == torch.device(device) and torch.equal(out["host"].cpu(), host)
    assert out["kept"] is kept


@pytest.mark.timeout(90)
@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_group_is_formed_aborted_and_formed_again_in_process(device):
    from hspmd_elastic.elastic.group import GroupFormer

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    endpoint = f"127.0.0.1:{server.port}"
    former = GroupFormer(30.0, device=device)
    nccl = former.backend != "gloo"
    try:
        before = torch.cuda.memory_allocated() if nccl else 0
        for version in (1, 2, 3):
            former.form(version, endpoint, 0, 1, aborted=lambda: False,
                        deadline=time.monotonic() + 30)
            assert dist.get_backend() == former.backend
            x = torch.ones(4, device=device)
            dist.all_reduce(x)  # the plan's tensors: NCCL on CUDA
            host = [torch.empty(2, dtype=torch.int64)]
            dist.all_gather(host, torch.tensor([version, 0]))  # the switch's exchange: gloo
            assert host[0].tolist() == [version, 0] and x.sum().item() == 4
            assert not nccl or former.monitor.fired is None  # this plan's: intact
            former.abandoned(threading.Event())  # a collective left in flight
            if nccl:  # the monitor's thread aborted the plan's communicators, and waited
                assert former.monitor.fired and "abandoned" in former.monitor.fired
                assert former.monitor.abort_thread == "comm-abort-monitor"
            else:  # gloo: nothing to abort; the reaper keeps the groups until it ends
                assert former.monitor is None
            # the groups stay registered until the plan is left (the next form, or leave)
            assert dist.is_initialized()
        former.reaper._inflight.clear()  # nothing ran: let retired groups go
        former.leave()
        assert not dist.is_initialized()
        if nccl:
            assert former.monitor.fired is None  # reset: the next plan's groups are intact
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() <= before + (1 << 20)
    finally:
        former.reaper._inflight.clear()  # nothing ran: let retired groups go
        former.leave()
        server = None


def _two_stages(rank: int, world: int):
    """Two pipeline stages, 1F1B over two micro-batches: stage 0 sends activations a0, a1 and
    receives gradient g0; stage 1 receives a0, sends g0, receives a1. On CUDA the sends are held
    and posted with the next receive in one batch (the Comm's CUDA path, driven here over gloo,
    where each rank would otherwise block NCCL's stream on a send its peer receives later)."""
    from hspmd_elastic.graph.comm import Comm, deadline_waiter

    comm = Comm({}, rank, deadline_waiter(30.0), device=torch.device("cuda"))
    n = 1 << 16  # larger than NCCL's buffers would be on a GPU
    if rank == 0:
        comm.send(torch.full((n,), 1.0), 1, tag=0)
        comm.send(torch.full((n,), 2.0), 1, tag=2)
        held = len(comm._held_sends)
        got = [comm.recv(torch.empty(n), 1, tag=1)[0].item()]
    else:
        got = [comm.recv(torch.empty(n), 0, tag=0)[0].item()]
        comm.send(torch.full((n,), -1.0), 0, tag=1)
        held = len(comm._held_sends)
        got.append(comm.recv(torch.empty(n), 0, tag=2)[0].item())
    comm.flush_sends()
    return held, got, len(comm._held_sends)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_sends_are_posted_with_the_next_receive_on_cuda():
    from _world import run_world

    results = run_world(_two_stages, 2, timeout_s=60.0)
    assert results == [(2, [-1.0], 0), (1, [1.0, 2.0], 0)]
