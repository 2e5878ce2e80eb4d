"""Where elastic workers compute, on any machine: the device selection (auto, cuda, cpu, with and
without CUDA, the CUDA answer replaced only at ``hspmd_elastic.devices``' seam), the backend that
follows, ``--hspmd-device`` and its one-line errors, the NVML inventory (PCI bus id), and NVML
names mapped to the planner's device profiles through the scripted driver."""

from __future__ import annotations

import logging

import pytest
import torch

from hspmd_elastic import devices
from hspmd_elastic.contract.env import DEVICE_ENV
from hspmd_elastic.elastic.api import ConfigurationError, WorkerIdentity
from hspmd_elastic.planner import inventory_from_nodes, spec_for_device
from launch_harness import SCRIPTS
from launcher import cli
from launcher.api import ConfigError
from launcher.health.fake_nvml import FakeGpu, FakeNvml
from launcher.health.nvml import NvmlHealthSource
from launcher.node.elastic.devices import device_table, inventory_lines

SCRIPT = str(SCRIPTS / "sleeper.py")
ELASTIC = ["--hspmd-elastic", "--hspmd-model", "llama-7b", "--hspmd-global-batch", "4"]


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: the selection seam reports ``n`` CUDA devices (0: no CUDA)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(devices, "cuda_available", lambda: n > 0)
        monkeypatch.setattr(devices, "cuda_count", lambda: n)

    return set_count


@pytest.mark.parametrize("setting, count, local_rank, want", [
    ("cpu", 0, 0, "cpu"), ("cpu", 2, 1, "cpu"),
    ("auto", 0, 3, "cpu"), ("auto", 2, 1, "cuda:1"),
    ("cuda", 2, 0, "cuda:0"), (" CUDA ", 8, 7, "cuda:7"),
])
def test_device_selection(gpus, setting, count, local_rank, want):
    gpus(count)
    assert devices.select_device(setting, local_rank) == torch.device(want)


@pytest.mark.parametrize("setting, count, local_rank, needle", [
    ("cuda", 0, 0, "HSPMD_DEVICE='cuda': CUDA is not available (torch "),
    ("auto", 2, 2, "LOCAL_RANK=2 has no GPU (2 visible"),
    ("cuda", 1, 1, "LOCAL_RANK=1 has no GPU (1 visible"),
    ("gpu", 1, 0, "HSPMD_DEVICE='gpu': use one of auto, cuda, cpu"),
])
def test_device_selection_errors_are_one_line(gpus, setting, count, local_rank, needle):
    gpus(count)
    with pytest.raises(devices.DeviceSettingError) as err:
        devices.select_device(setting, local_rank)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_this_torch_without_cuda_selects_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this torch can use CUDA")
    assert devices.select_device("auto", 0) == torch.device("cpu")
    with pytest.raises(devices.DeviceSettingError, match="CUDA is not available"):
        devices.select_device("cuda", 0)


def test_backend_follows_the_device():
    assert devices.backend_for("cpu") == "gloo"
    assert devices.backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert devices.uses_nccl("cpu:gloo,cuda:nccl") and not devices.uses_nccl("gloo")
    from hspmd_elastic.elastic.group import GroupFormer

    assert GroupFormer(5.0).backend == "gloo"
    assert GroupFormer(5.0, device="cuda:1").backend == "cpu:gloo,cuda:nccl"


def test_nccl_environment_keeps_what_the_user_set():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    quiet = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}
    assert devices.nccl_environment(42.5, env) == {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
                                                   "TORCH_NCCL_NONBLOCKING_TIMEOUT": "42",
                                                   **quiet}
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1",
                   "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
                   "TORCH_NCCL_NONBLOCKING_TIMEOUT": "42", **quiet}
    env = {"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"}  # a user who wants blocking creation keeps it
    assert "TORCH_NCCL_USE_COMM_NONBLOCKING" not in devices.nccl_environment(0.2, env)
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1" and env[
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"


def test_the_nonblocking_bound_fires_by_the_creation_deadline():
    # torch fires a bound of N whole seconds after N + 1 s (elapsed seconds compared with '>')
    assert [devices.nonblocking_timeout_s(s) for s in (0.2, 1.0, 2.0, 3.0, 3.5, 60.0)] == \
        [1, 1, 1, 2, 3, 59]


def test_torch_never_times_a_work_out_before_the_runtime_has_left_it():
    assert devices.backend_timeout_s("gloo", 60.0, 70.0) == 60.0  # gloo's timeout is the bound
    from hspmd_elastic.elastic.group import ARMED_GRACE_S

    nccl = devices.backend_timeout_s("cpu:gloo,cuda:nccl", 60.0, 70.0)
    assert nccl > 60.0 + ARMED_GRACE_S + 70.0  # the armed monitor's limit, then its abort


def test_which_backends_complete_at_enqueue():
    assert devices.completes_at_enqueue("cpu:gloo,cuda:nccl")
    assert devices.completes_at_enqueue("nccl")
    assert not devices.completes_at_enqueue("gloo")
    assert not devices.completes_at_enqueue("cpu:gloo,cuda:ncclx-not-registered")
    devices.register_enqueue_backend("Test-Enqueue")
    assert devices.completes_at_enqueue("cpu:test-enqueue")
    from hspmd_elastic.elastic.group import GroupFormer

    assert GroupFormer(5.0).monitor is None  # gloo: no abort monitor
    former = GroupFormer(5.0, device="cuda:1")
    assert former.enqueue and former.monitor is not None


def test_worker_identity_reads_the_device_setting():
    env = {"HSPMD_ETCD_ENDPOINTS": "127.0.0.1:1", "HSPMD_JOB_ID": "j", "HSPMD_NODE_ID": "n",
           "LOCAL_RANK": "1"}
    assert WorkerIdentity.from_env(env).device_setting == "auto"
    assert WorkerIdentity.from_env(dict(env, HSPMD_DEVICE="CPU")).device_setting == "cpu"
    with pytest.raises(ConfigurationError, match=r"HSPMD_DEVICE='tpu': use one of"):
        WorkerIdentity.from_env(dict(env, HSPMD_DEVICE="tpu"))
    assert DEVICE_ENV == devices.DEVICE_ENV


def test_a_worker_that_cannot_have_cuda_fails_before_touching_etcd(gpus):
    from hspmd_elastic.graph.config import ModelConfig
    from hspmd_elastic.runtime import run, synthetic_sampler

    gpus(0)
    config = ModelConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=1, ffn_size=16,
                         seq_len=4)
    identity = WorkerIdentity("j", "n", 0, "127.0.0.1:1", device_setting="cuda")
    with pytest.raises(ConfigurationError, match="HSPMD_DEVICE='cuda': CUDA is not available"):
        run(config, sample=synthetic_sampler(config), global_batch=2, steps=1,
            identity=identity)


# ------------------------------------------------------------------------- --hspmd-device
def parse(args: list[str]):
    ctx = cli.launch_command.make_context("hspmd-launch", list(args))
    return cli.build_config(ctx.params)


def test_hspmd_device_reaches_the_elastic_workers_environment():
    assert parse([*ELASTIC, SCRIPT]).extra_env == {}  # workers default to auto
    assert parse([*ELASTIC, "--hspmd-device", " CPU", SCRIPT]).extra_env == {DEVICE_ENV: "cpu"}
    assert parse([*ELASTIC, "--hspmd-device", "auto", SCRIPT]).extra_env == {DEVICE_ENV: "auto"}
    assert parse([SCRIPT]).extra_env == {}


@pytest.mark.parametrize("args, needle", [
    ([*ELASTIC, "--hspmd-device", "gpu"], "invalid --hspmd-device value 'gpu': use one of auto"),
    (["--hspmd-device", "cpu"], "--hspmd-device cpu is only used with --hspmd-elastic"),
])
def test_hspmd_device_bad_values(args, needle):
    with pytest.raises(ConfigError) as err:
        parse([*args, SCRIPT])
    assert needle in str(err.value)


def test_hspmd_device_cuda_without_cuda_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this torch can use CUDA")
    assert cli.main(["--standalone", *ELASTIC, "--hspmd-device", "cuda", SCRIPT]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == [
        f"hspmd-launch: error: invalid --hspmd-device value 'cuda': CUDA is not available on "
        f"this node (torch {torch.__version__}: a CPU-only build)"]


# ------------------------------------------------------------------------- NVML -> planner
NAMES = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "NVIDIA H800": "H800",
         "NVIDIA H20": "H20", "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA L40S": "L40S",
         "NVIDIA GeForce RTX 4090": "GeForce-RTX-4090"}


def test_nvml_inventory_maps_to_device_profiles(caplog):
    memory = [(80 + i) << 30 for i in range(len(NAMES))]
    fake = FakeNvml([FakeGpu(name=n, memory_total=m) for n, m in zip(NAMES, memory)])
    source = NvmlHealthSource(fake, event_thread=False)
    source.start()
    try:
        gpus = source.devices()
    finally:
        source.stop()
    assert [(g.index, g.name, g.memory_bytes) for g in gpus] == [
        (i, n, m) for i, (n, m) in enumerate(zip(NAMES, memory))]
    assert gpus[1].uuid == "GPU-00000000-0000-0000-0000-000000000001"
    assert gpus[1].pci_bus_id == "00000000:19:00.0"
    with caplog.at_level(logging.INFO):
        table = device_table("n", 99, accelerators=gpus)
    assert [d.memory_bytes for d in table] == memory  # the measured memory
    specs = [spec_for_device(d.type, d.memory_bytes) for d in table]
    assert [s.name for s in specs] == list(NAMES.values())
    assert [s.memory_bytes for s in specs] == memory
    unknown = specs[-1]
    assert unknown.peak_tflops < min(s.peak_tflops for s in specs[:-1])  # conservative
    assert "'GeForce-RTX-4090' is not in the planner's table" in caplog.text
    line = inventory_lines(gpus[1:2])[0]
    assert line == ("GPU 1: NVIDIA H200, 81.0 GiB, GPU-00000000-0000-0000-0000-000000000001, "
                    "PCI 00000000:19:00.0, planner profile H200")
    assert f"node n: {line}" in caplog.text


def test_plan_inventories_accept_the_agents_type_names():
    inv = inventory_from_nodes("2xH100-80GB-HBM3,1xH200,1xA100-SXM4-80GB")
    assert [d.spec.name for d in inv.devices] == ["H100", "H100", "H200", "A100"]
    from hspmd_elastic.planner import PlannerError

    with pytest.raises(PlannerError, match="unknown device type 'RTX-4090'"):
        inventory_from_nodes("1xRTX-4090")
